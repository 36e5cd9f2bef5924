"""Speed and memory of every press (issue 8): prefill time, press overhead vs SnapKV, decode tokens/s,
KV-cache bytes (physical and logical) against the full cache, and peak memory.

Usage (``configs/bench_speed_memory.yaml``; one command from a fresh clone; ``python -m
evaluation.studies.bench_speed_memory`` is the same)::

    python scripts/bench_speed_memory.py
    python scripts/bench_speed_memory.py lengths=[256] presses=[snapkv,page_entrokv] compression_ratios=[0.5] \\
        decode_tokens=8 output_dir=/tmp/sm_smoke

For each context length ``T`` (ascending), compression ratio and press, one row of
``<output_dir>/speed_memory.csv`` holds (times in seconds, bytes in bytes, memory in MiB):

* ``prefill_s``: wall time of the prefill call ``model.model(input_ids, cache)`` inside ``with press(model)``
  (kvpress pipeline's own prefill), press hooks included; ``prefill_ratio_vs_full`` divides it by the
  uncompressed prefill on the same context measured in the same run (``full_prefill_s``).
* ``press_s``: wall time spent inside the press's compression hooks during the prefill, summed over layers:
  ``forward_hook`` (kvpress's hook that calls ``compress``; EntroPrefill's monitoring hook), plus the press
  contract's ``model_hooks`` (the SNIS press's deferred global eviction, EntroPrefill's chunk
  planning and layer hooks). On CUDA each hook is bracketed by
  ``torch.cuda.synchronize``. ``overhead_ratio = press_s / snapkv_press_s``, SnapKV measured at the same
  ``T`` and ratio in the same run (always, even when not listed); ``no_press`` has ``press_s = 0``.
* ``decode_tok_s``: after the prefill, the question (plus answer prefix) is fed at positions ``T..``
  (as kvpress's pipeline does), then ``decode_tokens`` greedy single-token steps are timed, EOS ignored,
  outside the press context (the SNIS press's decode-time bias stays on the attention modules).
* ``kv_full_bytes``: ``2 L B G T d e`` (keys and values of every context token, the cache's dtype);
  ``kv_physical_bytes``: the key and value tensors actually held after the prefill (padded shapes);
  ``kv_logical_bytes``: the kept (unmasked, unpadded) entries (:func:`evaluation.harness.cache_stats`: the press's
  own count, or the cache minus AdaKV-style masked keys).
* ``peak_mem_mb`` / ``peak_mem_delta_mb``: on CPU the process's peak RSS (``VmHWM``) over the row, reset
  before the row by writing ``5`` to ``/proc/self/clear_refs``, and its excess over the RSS at the row's
  start; on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` and its excess
  over ``memory_allocated`` at the start. ``mem_method`` names the method (``ru_maxrss``, monotone over
  the process, when ``clear_refs`` is not writable).

Rows are written atomically as they finish; a rerun skips rows already in the csv (failed rows, with an
``error``, are retried) and re-measures the SnapKV / full-prefill references it needs, so every ratio is
taken within one run (``snapkv_press_s`` and ``full_prefill_s`` are stored beside it). ``time_limit_s``
stops the sweep cleanly. ``README.md`` (tables and the command) and the plots are rebuilt from the csv.
``compare_with`` names earlier csv files (relative to ``output_dir``), e.g. a copy kept before a change: the README
then has a before / after table of the rows measured again (remove rows from the csv to have them re-measured).

Modules: :mod:`.measure` (one row: timers, memory, bytes, the timed decode), :mod:`.rows` (the csv),
:mod:`.sweep` (presses, contexts, the sweep, the Hydra entry point), :mod:`.report` (README and plots).
"""
