"""The studies and benchmarks behind ``results/``: each module does one study, runs as
``python -m evaluation.studies.<name>`` (``scripts/<name>.py`` is the same command line) and writes its artifacts
with the command that produced them. Analysis, not library: nothing under ``presses/`` imports it.

- ``claims_ledger``: every claim of the three papers beside this project's counterpart (``results/claims.md``);
- ``bench_speed_memory``: prefill time, press overhead, decode speed, KV bytes and peak memory of every press;
- ``bench_kernels``, ``gpu_end_to_end``, ``gpu_report``: the GPU check's stages (``scripts/gpu_check.sh``);
- ``entroprefill_bench``, ``entroprefill_attention_probe``, ``entroprefill_position_bias_report``,
  ``keyfacts_full_accuracy``: EntroPrefill against the full prefill, and its position bias (paper 001);
- ``snis_bias_variance``, ``snis_needle_coverage``, ``profile_snis_press``: probabilistic eviction (paper 003);
- ``page_straddle``, ``partial_answers``: committed rows read again (answers on the page grid; wrong numbers by
  kind), nothing run through a model;
- ``table6_retention``: paper 000's Table 6 and Fig. 9b; ``tune_page_entrokv``: Page-EntroKV's defaults;
- ``ladder``: the ablation ladder from ChunkKV to Page-EntroKV, its press (ChunkKV's options, which the library's
  Page-EntroKV does not hold) and rungs, run as press configs through ``evaluation.fused`` (``results/tuning/ladder/``);
- shared: ``needle_group`` (paper 000 Table 10's synthetic needle group, for the ledger); ``committed`` (the
  committed-rows studies' run lookup and common arguments); their tables (CSV rows in
  and out, Markdown cells, the recorded command) are :mod:`evaluation.tables`, a floor below, which the report
  reads too.
"""

from pathlib import Path

#: the checkout whose ``results/``, ``configs/`` and ``runs/`` the studies read and write by default
REPO = Path(__file__).resolve().parents[2]
