"""The speed and memory benchmark (:mod:`evaluation.studies.bench_speed_memory`) on a tiny random Llama: rows, byte
accounting, overhead reference, resume."""

from __future__ import annotations

import copy
import csv
import json
import math
from pathlib import Path

import pytest
from conftest import make_tiny_llama
from hydra import compose, initialize_config_dir

from evaluation.studies.bench_speed_memory import measure, report, sweep
from evaluation.studies.bench_speed_memory.rows import COLUMNS, write_rows

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(REPO / "configs")
T = 96
L, H, G, HIDDEN = 2, 4, 2, 64  # head_dim 16


def _tokenizer():
    """One token per word (all [UNK]) plus <s> / </s>: the pipeline prepends bos_token when there is no
    chat template."""
    from _tiny_tokenizer import word_tokenizer

    tok = copy.deepcopy(word_tokenizer())
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return tok


def _cfg(out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(
            config_name="bench_speed_memory",
            overrides=[
                f"output_dir={out}",
                f"lengths=[{T}]",
                "decode_tokens=3",
                "warmup=false",
                "presses=[snapkv,knorm,snis_h2o_h]",
                *overrides,
            ],
        )


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(num_heads=H, num_kv_heads=G, num_layers=L, hidden=HIDDEN, attn_implementation="sdpa")


def test_config_defaults_match_the_issue():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="bench_speed_memory")
    assert list(cfg.lengths) == [1024, 2048, 4096, 8192]
    assert list(cfg.compression_ratios) == [0.5, 0.75] and cfg.decode_tokens == 64
    assert {"no_press", "snapkv", "page_entrokv", "snis_h2o_h", "entroprefill"} <= set(cfg.presses)
    assert cfg.output_dir == "results/speed_memory"
    assert sweep.resolve_time_limit(cfg.time_limit_s, "cuda:0") == 480
    assert sweep.resolve_time_limit(cfg.time_limit_s, "cpu") == math.inf
    for name in cfg.presses:  # every listed press instantiates at both ratios
        for r in cfg.compression_ratios:
            press = sweep.make_press(name, r, cfg.seed)
            assert (press is None) == (name == "no_press")
            if press is not None:
                assert press.compression_ratio == r


def test_rows_bytes_overhead_and_resume(tmp_path, model, monkeypatch):
    tok = _tokenizer()
    cfg = _cfg(tmp_path, "compression_ratios=[0.5]")
    rows = sweep.run_bench(cfg, model, tok, "tiny", "cpu", command="pytest-command")

    with open(tmp_path / "speed_memory.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        assert len(list(reader)) == len(rows)
    by = {r["press"]: r for r in rows}
    assert set(by) == {"no_press", "snapkv", "knorm", "snis_h2o_h"}
    assert all(not r["error"] for r in rows), [r["error"] for r in rows]
    n = int(by["snapkv"]["context_length"])
    assert T - 40 <= n <= T  # T counts the template (BOS); the haystack stops at a whole sentence
    full = 2 * L * G * n * (HIDDEN // H) * 4  # keys + values, float32
    for r in rows:
        assert int(r["kv_full_bytes"]) == full
        assert float(r["prefill_s"]) > 0 and float(r["decode_tok_s"]) > 0 and float(r["peak_mem_mb"]) > 0
        assert r["model"] == "tiny" and r["T"] == str(T)
    # the uncompressed row holds the whole cache and has no press time
    assert float(by["no_press"]["physical_vs_full"]) == 1.0 and float(by["no_press"]["press_s"]) == 0.0
    assert by["no_press"]["compression_ratio"] == "0.0"
    # ScorerPresses keep int(n * (1 - ratio)) tokens per layer: physical == logical == that fraction
    for p in ("snapkv", "knorm"):
        kept = int(n * 0.5)
        assert int(by[p]["kv_physical_bytes"]) == full * kept // n
        assert float(by[p]["logical_vs_full"]) == pytest.approx(float(by[p]["physical_vs_full"]))
        assert float(by[p]["press_s"]) > 0
        assert float(by[p]["prefill_ratio_vs_full"]) == pytest.approx(
            float(by[p]["prefill_s"]) / float(by[p]["full_prefill_s"])
        )
    # SnapKV against itself in the same run is exactly 1; the others are divided by that same time
    assert float(by["snapkv"]["overhead_ratio"]) == 1.0
    assert float(by["knorm"]["snapkv_press_s"]) == float(by["snapkv"]["press_s"])
    assert float(by["knorm"]["overhead_ratio"]) == pytest.approx(
        float(by["knorm"]["press_s"]) / float(by["snapkv"]["press_s"])
    )
    # SNIS: padded physical cache, logical = kept entries (its summary), near the target in expectation
    snis = by["snis_h2o_h"]
    stats = json.loads(snis["press_stats"])
    assert float(snis["logical_vs_full"]) == pytest.approx(1 - stats["logical_compression"], abs=1e-6)
    assert float(snis["logical_vs_full"]) <= float(snis["physical_vs_full"]) + 1e-9
    assert abs(float(snis["logical_vs_full"]) - 0.5) < 0.2
    readme = (tmp_path / "README.md").read_text()
    assert "pytest-command" in readme and f"overhead T={T}" in readme and f"physical T={T}" in readme
    for png in ("overhead_ratio.png", "kv_bytes.png", "prefill.png"):
        assert (tmp_path / png).stat().st_size > 1000

    # resume: nothing left to do -> nothing is measured
    def boom(*a, **k):
        raise AssertionError("a finished row was measured again")

    monkeypatch.setattr(sweep, "measure_row", boom)
    assert sweep.run_bench(cfg, model, tok, "tiny", "cpu", command="again") == rows
    monkeypatch.undo()

    # a new ratio: only its rows, plus the run's own SnapKV and full-prefill references, are measured
    calls = []
    real = sweep.measure_row

    def counting(model_, press, *a, **k):
        calls.append(type(press).__name__ if press is not None else None)
        return real(model_, press, *a, **k)

    monkeypatch.setattr(sweep, "measure_row", counting)
    cfg2 = _cfg(tmp_path, "compression_ratios=[0.5,0.75]", "presses=[snapkv,knorm]")
    rows2 = sweep.run_bench(cfg2, model, tok, "tiny", "cpu", command="more")
    assert sorted(map(str, calls)) == ["KnormPress", "None", "SnapKVPress"]
    new = {r["press"]: r for r in rows2 if r["compression_ratio"] == "0.75"}
    assert set(new) == {"snapkv", "knorm"} and len(rows2) == len(rows) + 2
    assert int(new["knorm"]["kv_physical_bytes"]) == full * int(n * 0.25) // n


def test_time_limit_stops_cleanly(tmp_path, model):
    cfg = _cfg(tmp_path, "compression_ratios=[0.5]")
    rows = sweep.run_bench(cfg, model, _tokenizer(), "tiny", "cpu", command="x", time_limit_s=1e-9)
    assert rows == []
    assert "Incomplete" in (tmp_path / "README.md").read_text()


def test_hook_timer_counts_outermost_calls_and_restores():
    class Press:
        def forward_hook(self, x):
            return self.helper(x) + 1

        def helper(self, x):
            return x * 2

        def model_hooks(self, model):  # the press contract: hooks beyond the attention hooks
            return [(model, "forward", lambda x: self.forward_hook(x) * 10)]

    press = Press()
    with measure.HookTimer(press) as timer:
        assert "forward_hook" in vars(press) and press.forward_hook(3) == 7
        assert press.forward_hook.__wrapped__.__self__ is press  # the contract still finds the owner
        ((_, _, hook),) = press.model_hooks("model")
        assert hook(3) == 70  # the model hook calls forward_hook: counted once
        assert press.helper(1) == 2  # not a hook: not timed
    assert timer.calls == 2 and timer.seconds > 0
    assert "forward_hook" not in vars(press) and "model_hooks" not in vars(press)
    with measure.HookTimer(None) as timer:
        pass
    assert timer.seconds == 0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("compression_ratios=[1.2]", r"compression_ratio=1.2 must be in \[0, 1\)"),
        ("presses=[nope]", "unknown press 'nope'"),
        ("lengths=[32]", r"lengths \[32\] must be >= 64"),
        ("repeats=0", "repeats=0 must be >= 1"),
    ],
)
def test_bad_config_is_rejected(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        sweep.validate(_cfg(tmp_path, override))
    with pytest.raises(ValueError, match="time_limit_s=-1"):
        sweep.resolve_time_limit(-1, "cpu")


def test_context_that_falls_short_of_T_is_an_error(tmp_path, model):
    """A multi-document context with too few passages for T (city facts: 40 passages) is refused with the
    length it reached, instead of being measured as length T; the configured code facts reach it."""
    from kvpress import KVPressTextGenerationPipeline

    tok = _tokenizer()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device="cpu")
    cfg = _cfg(tmp_path)
    ds = copy.deepcopy(cfg.contexts.query_aware)
    ids, _ = sweep.build_context(ds, pipe, tok, 8192, 0, True)
    assert ids.shape[1] >= 0.8 * 8192
    ds.fact_kinds = ["city"]
    with pytest.raises(ValueError, match=r"built a context of \d+ tokens for T=8192, below 80% of T"):
        sweep.build_context(ds, pipe, tok, 8192, 0, True)


def test_comparison_table_lists_rows_measured_again(tmp_path):
    """``compare_with``: rows present in both csvs with another timestamp get before / after ratios; rows not
    measured again, no_press and rows only in one file are left out; a missing file is noted."""

    def row(press, T, ratio, full, press_s, over, stamp):
        return {
            **{c: "" for c in COLUMNS},
            "model": "m",
            "press": press,
            "T": str(T),
            "compression_ratio": str(ratio),
            "prefill_ratio_vs_full": str(full),
            "press_s": str(press_s),
            "overhead_ratio": str(over),
            "timestamp": stamp,
        }

    before = [
        row("snis_h2o_h", 2048, 0.5, 1.97, 2.6336, 14.48, "old"),
        row("snapkv", 2048, 0.5, 1.07, 0.2153, 1.0, "old"),
        row("knorm", 2048, 0.5, 1.0, 0.0297, 0.14, "same"),
        row("no_press", 2048, 0.0, 1.0, 0, 0, "old"),
        row("tova", 1024, 0.5, 0.89, 0.0324, 0.35, "old"),
    ]
    after = [
        row("snis_h2o_h", 2048, 0.5, 1.12, 0.31, 1.4, "new"),
        row("snapkv", 2048, 0.5, 1.01, 0.22, 1.0, "new"),
        row("knorm", 2048, 0.5, 1.0, 0.0297, 0.14, "same"),
        row("no_press", 2048, 0.0, 1.0, 0, 0, "new"),
        row("entroprefill", 2048, 0.5, 0.7, 0.04, 0.2, "new"),
    ]
    write_rows(tmp_path / "before.csv", before)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="bench_speed_memory", overrides=["compare_with=[before.csv,missing.csv]"])
    lines = report.comparison_tables(tmp_path, after, cfg)
    table = [line for line in lines if line.startswith("| m |")]
    assert table == [
        "| m | snapkv | 0.5 | 2048 | 1.07 | 1.01 | 215.3 | 220.0 | 1.00 | 1.00 |",
        "| m | snis_h2o_h | 0.5 | 2048 | 1.97 | 1.12 | 2633.6 | 310.0 | 14.48 | 1.40 |",
    ]
    assert "Comparison file `missing.csv` (compare_with) not found." in lines


def test_a_press_that_needs_a_delimiter_runs_on_its_own_copy(tmp_path, model):
    """Finch (issue 29.4: the frontier in one speed sweep): measured on a model and tokenizer copy with its delimiter
    token, on the query-aware context with the token where the question starts; the sweep's model and tokenizer keep
    their vocabulary, and Finch's row is compared with the uncompressed prefill of the same context."""
    tok = _tokenizer()
    vocab, rows_before = len(tok), model.get_input_embeddings().weight.shape[0]
    cfg = _cfg(
        tmp_path, "compression_ratios=[0.5]", "presses=[snapkv,finch]", "query_aware_presses=[finch]", "lengths=[600]"
    )
    rows = sweep.run_bench(cfg, model, tok, "tiny", "cpu", command="finch")
    by = {r["press"]: r for r in rows}
    assert not by["finch"]["error"], by["finch"]["error"]
    finch = by["finch"]
    assert finch["context"] == "query_aware" and float(finch["prefill_s"]) > 0
    assert 0.4 < float(finch["physical_vs_full"]) < 0.6  # half the context kept (the question window included)
    assert float(finch["full_prefill_s"]) != float(by["snapkv"]["full_prefill_s"])  # its own context's reference
    assert len(tok) == vocab and model.get_input_embeddings().weight.shape[0] == rows_before


def test_plots_give_each_of_21_presses_its_own_colour_and_one_legend_below(tmp_path, monkeypatch):
    """The committed 2k sweep has 21 presses: with tab10 KVzip and `snis_min_page` shared a colour at the top of
    `prefill.png`, and the legend sat over the right panel's points."""
    presses = ["no_press"] + [f"page_entrokv_reconstruction_{i:02d}" for i in range(20)]
    rows = [
        {
            "press": p,
            "compression_ratio": str(0.0 if p == "no_press" else ratio),
            "T": str(T),
            "overhead_ratio": "1.5",
            "physical_vs_full": "0.5",
            "logical_vs_full": "0.5",
            "prefill_s": str(1 + i),
        }
        for i, p in enumerate(presses)
        for ratio in (0.5, 0.75)
        for T in (1024, 2048)
    ]
    figures = {}
    monkeypatch.setattr(report, "save_figure", lambda fig, path, dpi: figures.setdefault(path.name, fig))
    report.write_plots(tmp_path, rows)
    assert sorted(figures) == ["kv_bytes.png", "overhead_ratio.png", "prefill.png"]
    for name, fig in figures.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert [ax.get_legend() for ax in fig.axes] == [None, None]
        (legend,) = fig.legends
        shown = presses[1:] if name == "overhead_ratio.png" else presses
        assert [t.get_text() for t in legend.get_texts()] == shown
        box = legend.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width
        assert all(box.y1 < ax.get_window_extent(renderer).y0 for ax in fig.axes)
        for ax in fig.axes:
            colours = {line.get_label(): line.get_color() for line in ax.get_lines() if line.get_linestyle() == "-"}
            assert len(colours) == len(shown) and len(set(map(tuple, colours.values()))) == len(shown)


def test_the_cpu_clock_is_the_thread_s_cpu_time_only_with_one_torch_thread():
    import time

    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert measure.clock_fn("cpu") is time.thread_time
        assert measure.clock_fn("cuda:0") is time.perf_counter
        torch.set_num_threads(2)
        assert measure.clock_fn("cpu") is time.perf_counter
    finally:
        torch.set_num_threads(before)


def test_each_press_gets_the_project_s_scorers_before_it_is_measured(tmp_path, model, monkeypatch):
    """The sweep attaches the trained scorers the harness attaches (guards.check_press_downloads: KVzap, Q-Filters,
    statistics), so a learned press is measured offline; one whose scorer is missing gets that line as its error."""
    seen = []

    def check(press, run_model):
        seen.append((type(press).__name__, run_model is model))
        if type(press).__name__ == "KnormPress":
            raise OSError("press knorm needs results/scorers/tiny/x: python -m evaluation.train_scorers x")

    monkeypatch.setattr(sweep, "check_press_downloads", check)
    rows = sweep.run_bench(_cfg(tmp_path, "compression_ratios=[0.5]"), model, _tokenizer(), "tiny", "cpu", command="c")
    by = {r["press"]: r for r in rows}
    assert ("SnapKVPress", True) in seen and ("KnormPress", True) in seen
    assert "python -m evaluation.train_scorers x" in by["knorm"]["error"] and not by["snapkv"]["error"]
