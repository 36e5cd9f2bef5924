"""evaluation.report on a hand-made results tree: shard merge, intervals, averages, win score, files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from evaluation.metrics import t_interval, wilson_interval
from evaluation.report import build_report, main, scan


def _write_run(
    root: Path,
    press: str,
    ratio: str,
    rows: list[tuple[str, str, float]],
    shard: str | None = None,
    finished: bool = True,
    dataset: str = "ruler",
    model: str = "tiny",
) -> None:
    d = root / dataset / model / press / f"cr{ratio}"
    if shard:
        d = d / shard
    d.mkdir(parents=True)
    with open(d / "predictions.jsonl", "w") as f:
        for ex_id, task, score in rows:
            f.write(
                json.dumps(
                    {
                        "id": ex_id,
                        "task": task,
                        "score": score,
                        "prediction": "p",
                        "answers": ["a"],
                        "context_length": 100,
                        "effective_compression": float(ratio),
                        "metadata": {"context_length": 128},
                    }
                )
                + "\n"
            )
        f.write('{"id": "torn", "sco')  # a killed run's torn last line must be ignored
    if finished:
        cmd = f"python -m evaluation.run dataset={dataset} press={press} compression_ratio={ratio}"
        (d / "metrics.json").write_text(json.dumps({"command": cmd}))
    (d / "config.yaml").write_text(f"compression_ratio: {ratio}\n")


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "runs"
    _write_run(root, "no_press", "0", [("a1", "A", 1), ("a2", "A", 1), ("b1", "B", 1)])
    _write_run(root, "snapkv", "0.5", [("a1", "A", 1), ("b1", "B", 0)], shard="shard_0_of_2")
    _write_run(root, "snapkv", "0.5", [("a2", "A", 0)], shard="shard_1_of_2")
    _write_run(root, "knorm", "0.5", [("a1", "A", 1), ("a2", "A", 1), ("b1", "B", 0.5)])
    _write_run(root, "streaming_llm", "0.5", [("a1", "A", 0), ("a2", "A", 0), ("b1", "B", 1)])
    _write_run(root, "knorm", "0.25", [("a1", "A", 1), ("a2", "A", 1), ("b1", "B", 1)])
    _write_run(
        root, "streaming_llm", "0.25", [("a1", "A", 0)], shard="shard_0_of_2", finished=False
    )  # shard 1 never ran
    (root / "ruler" / "tiny" / "streaming_llm" / "cr0.25" / "shard_0_of_2" / "commands.txt").write_text(
        "python -m evaluation.fused dataset=ruler shard=0/2\n"
    )  # the unfinished shard's command log
    (root / ".hydra" / "x").mkdir(parents=True)
    (root / ".hydra" / "x" / "predictions.jsonl").write_text('{"id": "zz", "task": "A", "score": 1}\n')
    return root


def _csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _cell(rows, press, ratio, key):
    (row,) = [r for r in rows if r["press"] == press and float(r["ratio"]) == ratio]
    return float(row[key])


def test_scan_merges_shards_and_flags_missing(results):
    runs = {(r.press, r.ratio): r for r in scan(results)}
    assert len(runs) == 6  # the .hydra directory is ignored
    snap = runs[("snapkv", 0.5)]
    assert sorted(r["id"] for r in snap.rows) == ["a1", "a2", "b1"] and snap.complete
    assert len(snap.commands) == 1 and "press=snapkv" in snap.commands[0]
    stream = runs[("streaming_llm", 0.25)]
    assert not stream.complete and "shards [1] of 2 missing" in stream.problems[-1]
    assert stream.commands == ["python -m evaluation.fused dataset=ruler shard=0/2"]  # from its command log


def test_scan_leaves_a_results_root_nested_inside_to_its_own_report(results, caplog):
    """Runs of another root kept inside this one (results/learned_2k/<dataset>/...) share a dataset's name but not
    its examples: they must not join this root's runs, and they are found when that root is scanned."""
    nested = results / "learned_2k"
    _write_run(nested, "kvzap_page", "0.5", [("a1", "A", 1)])
    _write_run(nested, "kvzap_page", "0.25", [("a1", "A", 0)])
    with caplog.at_level("WARNING", logger="evaluation.runs"):
        presses = {r.press for r in scan(results)}
    assert "kvzap_page" not in presses and len(presses) == 4
    assert [m for m in caplog.messages if "learned_2k" in m and "another results root" in m] == [
        f"skipping the runs of {nested}: another results root (report it on its own)"
    ]  # once for the root, not per run
    assert {(r.press, r.ratio) for r in scan(nested)} == {("kvzap_page", 0.5), ("kvzap_page", 0.25)}


def test_summary_intervals_averages_and_win_score(results, tmp_path):
    out = tmp_path / "results"
    readme = build_report(results, out)
    summary = _csv(out / "tables" / "ruler__tiny__summary.csv")
    # snapkv merged from two shards: scores 1, 0, 0 -> 1/3 with a Wilson interval (all 0/1)
    assert _cell(summary, "snapkv", 0.5, "n") == 3
    assert _cell(summary, "snapkv", 0.5, "score") == pytest.approx(1 / 3)
    lo, hi = wilson_interval(1, 3)
    assert _cell(summary, "snapkv", 0.5, "low") == pytest.approx(lo, abs=1e-5)
    assert _cell(summary, "snapkv", 0.5, "high") == pytest.approx(hi, abs=1e-5)
    # knorm: 1, 1, 0.5 -> fractional scores use the t interval
    assert [r["interval"] for r in summary if r["press"] == "knorm" and float(r["ratio"]) == 0.5] == ["t"]
    lo, hi = t_interval([1, 1, 0.5])
    assert _cell(summary, "knorm", 0.5, "low") == pytest.approx(lo, abs=1e-5)
    assert hi > 1 and _cell(summary, "knorm", 0.5, "high") == 1.0  # clipped to the score range
    # paper 003 weighted average: 2/3 * mean(A) + 1/3 * mean(B) = 2/3 * 1 + 1/3 * 0.5; task average (1 + .5) / 2
    assert _cell(summary, "knorm", 0.5, "weighted_average") == pytest.approx(5 / 6, abs=1e-5)
    assert _cell(summary, "knorm", 0.5, "task_average") == pytest.approx(0.75, abs=1e-5)
    # win score at 0.5 over knorm, snapkv, streaming_llm (by hand):
    # task A ranks: a1 (2, 2, 0), a2 (2, 1, 1) -> /2 -> 1, .75, .25 ; task B: b1 (1, 0, 2) -> .5, 0, 1
    wins = _csv(out / "tables" / "ruler__tiny__win.csv")
    assert _cell(wins, "knorm", 0.5, "win_score") == pytest.approx(0.75)
    assert _cell(wins, "snapkv", 0.5, "win_score") == pytest.approx(0.375)
    assert _cell(wins, "streaming_llm", 0.5, "win_score") == pytest.approx(0.625)
    # at 0.25 streaming_llm is incomplete (shard 1 missing): knorm alone is left, no win score
    assert not any(float(r["ratio"]) == 0.25 for r in wins)
    assert not any(r["press"] == "no_press" for r in wins)
    # ... except in the provisional table, on a1, the one example both hold: knorm 1 beats streaming_llm 0
    provisional = _csv(out / "tables" / "ruler__tiny__win_provisional.csv")
    assert {float(r["ratio"]) for r in provisional} == {0.25}  # ratios whose runs are all complete stay out
    assert _cell(provisional, "knorm", 0.25, "win_score") == 1.0
    assert _cell(provisional, "streaming_llm", 0.25, "win_score") == 0.0
    assert _cell(provisional, "knorm", 0.25, "n_examples") == 1
    per_task = _csv(out / "tables" / "ruler__tiny__per_task.csv")
    assert _cell([r for r in per_task if r["group"] == "B"], "knorm", 0.5, "score") == pytest.approx(0.5)

    text = readme.read_text()
    assert readme == out / "README.md"
    assert "python -m evaluation.run dataset=ruler press=knorm compression_ratio=0.5" in text
    assert "### Win score on the examples every run holds (some runs incomplete)" in text and "cr 0.25: n = 1" in text
    assert "shards [1] of 2 missing" in text and "never edit by hand" in text
    for name in ("score", "win", "tasks"):
        png = out / "plots" / f"ruler__tiny__{name}.png"
        assert f"plots/ruler__tiny__{name}.png" in text
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no temporary file left behind


def test_report_is_regenerated_and_prunes_stale_files(results, tmp_path):
    out = tmp_path / "results"
    build_report(results, out, plots=False)
    first = (out / "README.md").read_text()
    stale = out / "tables" / "old__model__summary.csv"
    stale.write_text("x")
    assert main([str(results), "--out", str(out), "--no-plots"]) == 0
    assert (out / "README.md").read_text().split("\n", 3)[3] == first.split("\n", 3)[3]  # same body
    assert not stale.exists()


def test_missing_results_dir_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_report(tmp_path / "nope", tmp_path / "out", plots=False)


def test_length_and_depth_breakdowns(tmp_path):
    root = tmp_path / "runs"
    d = root / "needle" / "tiny" / "snapkv" / "cr0.5"
    d.mkdir(parents=True)
    rows = [  # (length, depth, score): length 512 -> mean 1, 1024 -> mean 0.5; depth 0 -> 1, depth 50 -> 0.5
        (512, 0, 1.0),
        (512, 50, 1.0),
        (1024, 0, 1.0),
        (1024, 50, 0.0),
    ]
    with open(d / "predictions.jsonl", "w") as f:
        for i, (length, depth, score) in enumerate(rows):
            f.write(
                json.dumps(
                    {
                        "id": f"e{i}",
                        "task": "needle",
                        "score": score,
                        "depth": depth,
                        "context_length": length - 3,
                        "metadata": {"context_length": length},
                    }
                )
                + "\n"
            )
    out = tmp_path / "results"
    text = build_report(root, out, plots=False).read_text()
    by_length = _csv(out / "tables" / "needle__tiny__by_length.csv")
    assert {r["group"]: float(r["score"]) for r in by_length} == {"512": 1.0, "1024": 0.5}
    by_depth = _csv(out / "tables" / "needle__tiny__by_depth.csv")
    assert {r["group"]: float(r["score"]) for r in by_depth} == {"0": 1.0, "50": 0.5}
    assert "Per context length (tokens)" in text and "Per needle depth (%)" in text
    assert {r["win_score"] for r in by_length} == {""}  # one press: no win score in any group


def test_length_breakdown_ranks_each_length_on_its_own(tmp_path):
    """Two presses, two lengths: A wins every 512 example and loses every 1024 one. Pooled they tie (win 0.5
    each); per length A's win score is 1 at 512 and 0 at 1024, as runs of one length would have said."""
    root = tmp_path / "runs"
    for press, scores in (("a", {512: 1.0, 1024: 0.0}), ("b", {512: 0.0, 1024: 1.0})):
        d = root / "needle" / "tiny" / press / "cr0.5"
        d.mkdir(parents=True)
        with open(d / "predictions.jsonl", "w") as f:
            for i, length in enumerate([512, 512, 1024, 1024]):
                row = {"id": f"e{i}", "task": "needle", "score": scores[length], "metadata": {"context_length": length}}
                f.write(json.dumps(row) + "\n")
        (d / "metrics.json").write_text(json.dumps({"command": f"python -m evaluation.run press={press}"}))
        (d / "config.yaml").write_text("compression_ratio: 0.5\n")
    out = tmp_path / "results"
    text = build_report(root, out, plots=False).read_text()
    pooled = {r["press"]: float(r["win_score"]) for r in _csv(out / "tables" / "needle__tiny__win.csv")}
    assert pooled == {"a": 0.5, "b": 0.5}
    by_length = _csv(out / "tables" / "needle__tiny__by_length.csv")
    wins = {(r["press"], r["group"]): float(r["win_score"]) for r in by_length}
    assert wins == {("a", "512"): 1.0, ("a", "1024"): 0.0, ("b", "512"): 0.0, ("b", "1024"): 1.0}
    assert "| a @ 0.5 | 1.000 (1.000) | 0.000 (0.000) |" in text
    # RULER-like continuous depths (more than 12 distinct values) get no depth table
    with open(d / "predictions.jsonl", "a") as f:
        for i in range(20):
            f.write(
                json.dumps(
                    {
                        "id": f"x{i}",
                        "task": "needle",
                        "score": 1.0,
                        "depth": 1.5 * i,
                        "metadata": {"context_length": 512},
                    }
                )
                + "\n"
            )
    build_report(root, out, plots=False)
    assert not (out / "tables" / "needle__tiny__by_depth.csv").exists()  # pruned


def test_all_zero_run_plots_with_its_interval(tmp_path):
    """An all-zero run has a Wilson lower end a rounding error above 0; its error bar must still plot."""
    root = tmp_path / "runs"
    ids = [f"a{i}" for i in range(24)]  # 24 zeros: Wilson's lower end is 1.4e-17, not 0
    _write_run(root, "no_press", "0", [(i, "A", 1) for i in ids], dataset="needle")
    _write_run(root, "knorm", "0.5", [(i, "A", 0) for i in ids], dataset="needle")
    _write_run(root, "snapkv", "0.5", [(i, "A", k % 2) for k, i in enumerate(ids)], dataset="needle")
    out = tmp_path / "results"
    build_report(root, out)
    assert (out / "plots" / "needle__tiny__score.png").stat().st_size > 1000
    assert _cell(_csv(out / "tables" / "needle__tiny__summary.csv"), "knorm", 0.5, "score") == 0.0


def test_a_press_keeps_its_colour_across_plots():
    """Score, win and per-task plots draw different subsets of presses; each press keeps one colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from evaluation.report import _plot_lines

    presses = ["no_press", "knorm", "snapkv", "tova"]
    every = [{"press": p, "ratio": r, "score": 0.5} for p in presses[1:] for r in (0.25, 0.5)]
    _, (ax1, ax2) = plt.subplots(1, 2)
    _plot_lines(ax1, every, "score", presses)
    _plot_lines(ax2, [r for r in every if r["press"] != "knorm"], "score", presses)  # knorm left out here
    colour = [{ln.get_label(): ln.get_color() for ln in ax.get_lines()} for ax in (ax1, ax2)]
    plt.close("all")
    assert set(colour[1]) == {"snapkv", "tova"}
    assert all(colour[0][p] == colour[1][p] for p in ("snapkv", "tova"))
    assert len(set(map(str, colour[0].values()))) == 3


def test_shards_made_with_other_settings_are_flagged(tmp_path):
    """Shards of one run must share their settings (all but ``shard``); otherwise the run is incomplete."""
    root = tmp_path / "runs"
    _write_run(root, "no_press", "0", [("a", "A", 1.0), ("b", "A", 0.0)])
    for i, n_samples in enumerate((2, 2)):
        _write_run(root, "snapkv", "0.5", [(f"x{i}", "A", 1.0)], shard=f"shard_{i}_of_2")
        d = root / "ruler" / "tiny" / "snapkv" / "cr0.5" / f"shard_{i}_of_2"
        (d / "config.yaml").write_text(f"compression_ratio: 0.5\nn_samples: {n_samples}\nshard: {i}/2\n")
    text = build_report(root, tmp_path / "out", plots=False).read_text()
    assert "Incomplete runs" not in text  # same settings, only the shard differs: merged as complete
    (d / "config.yaml").write_text("compression_ratio: 0.5\nn_samples: 1\nshard: 1/2\n")
    text = build_report(root, tmp_path / "out", plots=False).read_text()
    assert "Incomplete runs" in text
    assert "shard_1_of_2 was made with other settings than shard_0_of_2 (n_samples: 2 -> 1)" in text


def test_longbench_e_by_length_range(tmp_path):
    """LongBench-E's official breakdown (eval.py scorer_e: length < 4000, < 8000, else 8k+) by each row's length."""
    root = tmp_path / "runs"
    lengths = [3000, 5000, 9000, 3500, 7000, 12000]
    for press, scores in (("snapkv", [1, 0, 0, 1, 1, 0]), ("page_entrokv", [1, 1, 0, 1, 0, 1])):
        d = root / "longbench_e" / "tiny" / press / "cr0.5"
        d.mkdir(parents=True)
        rows = [
            {
                "id": f"trec-{i}",
                "task": "trec",
                "score": s,
                "effective_compression": 0.5,
                "metadata": {"length": n, "longbench_e": True},
            }
            for i, (n, s) in enumerate(zip(lengths, scores))
        ]
        (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "metrics.json").write_text(json.dumps({"command": "x"}))
    readme = build_report(root, tmp_path / "out", plots=False).read_text()
    table = _csv(tmp_path / "out" / "tables" / "longbench_e__tiny__by_length_range.csv")
    got = {(r["press"], r["task"], r["range"]): (float(r["score"]), int(r["n"])) for r in table}
    assert {k[2]: v for k, v in got.items() if k[:2] == ("snapkv", "all")} == {
        "0-4k": (1.0, 2),
        "4-8k": (0.5, 2),
        "8k+": (0.0, 2),
    }
    assert {k[2]: v for k, v in got.items() if k[:2] == ("page_entrokv", "all")} == {
        "0-4k": (1.0, 2),
        "4-8k": (0.5, 2),
        "8k+": (0.5, 2),
    }
    assert got[("snapkv", "trec", "4-8k")] == (0.5, 2)
    assert "### LongBench-E by length range" in readme
    assert "| snapkv @ 0.5 | 1.000 | 0.500 | 0.000 |" in readme
    assert "| page_entrokv @ 0.5 | 1.000 | 0.500 | 0.500 |" in readme


def test_length_range_table_averages_tasks_and_skips_other_rows():
    from evaluation.report import Run, length_range, length_range_table

    assert [length_range(n) for n in (0, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    run = Run(
        "longbench_e",
        "tiny",
        "knorm",
        0.5,
        Path("."),
        rows=[
            {"id": "a", "task": "A", "score": 1.0, "metadata": {"length": 100, "longbench_e": True}},
            {"id": "b", "task": "A", "score": 1.0, "metadata": {"length": 200, "longbench_e": True}},
            {"id": "c", "task": "B", "score": 0.0, "metadata": {"length": 300, "longbench_e": True}},
            {"id": "d", "task": "B", "score": 1.0, "metadata": {"length": 300}},
        ],
    )  # not LongBench-E: left out
    (row,) = [r for r in length_range_table([run]) if r["task"] == "all"]
    assert row["range"] == "0-4k" and row["n"] == 3 and row["score"] == 0.5  # (1.0 + 0.0) / 2 tasks, not 2/3


def test_protocols_side_by_side_compare_the_same_presses(tmp_path):
    """A dataset run in both protocols gets one side-by-side table; its win scores are computed among the presses
    present in both protocols (a press run only with the question inside does not change the 'inside' column)."""
    root = tmp_path / "runs"
    for dataset, scores in (
        ("needle", {"snapkv": (1, 0), "tova": (0, 0)}),
        ("needle-qa", {"snapkv": (0, 1), "tova": (1, 0), "knorm": (1, 0)}),
    ):
        for press, (s1, s2) in scores.items():
            _write_run(root, press, "0.5", [("e1", "needle", s1), ("e2", "needle", s2)], dataset=dataset)
    out = tmp_path / "report"
    readme = build_report(root, out, plots=False).read_text()
    assert "## The two protocols side by side" in readme
    rows = {r["press"]: r for r in _csv(out / "tables" / "needle__tiny__protocols.csv")}
    assert set(rows) == {"snapkv", "tova"}  # knorm ran in one protocol only
    assert float(rows["snapkv"]["score_after"]) == 0.5 and float(rows["tova"]["score_inside"]) == 0.5
    # after: snapkv beats-or-ties tova on both examples (1), tova ties only on e2 (0.5). Inside, between the two
    # only: each wins one example (0.5, 0.5); were knorm counted, tova would get 0.75 (it ties knorm twice).
    assert float(rows["snapkv"]["win_after"]) == 1.0 and float(rows["tova"]["win_after"]) == 0.5
    assert float(rows["snapkv"]["win_inside"]) == 0.5 and float(rows["tova"]["win_inside"]) == 0.5
    # a protocol still running (e3 only after, e2 missing from one inside run): both columns use e1 only
    root2 = tmp_path / "partial"
    _write_run(
        root2, "snapkv", "0.5", [("e1", "needle", 1), ("e2", "needle", 0), ("e3", "needle", 0)], dataset="needle"
    )
    _write_run(root2, "tova", "0.5", [("e1", "needle", 0), ("e2", "needle", 1), ("e3", "needle", 1)], dataset="needle")
    _write_run(root2, "snapkv", "0.5", [("e1", "needle", 0), ("e2", "needle", 1)], dataset="needle-qa")
    _write_run(root2, "tova", "0.5", [("e1", "needle", 1)], dataset="needle-qa")
    for proto in ("needle", "needle-qa"):  # another ratio, complete in both protocols, keeps its 3 examples
        _write_run(root2, "snapkv", "0.75", [(e, "needle", 1) for e in ("e1", "e2", "e3")], dataset=proto)
    build_report(root2, tmp_path / "r3", plots=False)
    table = _csv(tmp_path / "r3" / "tables" / "needle__tiny__protocols.csv")
    assert {(r["ratio"], r["n_after"], r["n_inside"]) for r in table if r["press"] == "snapkv"} == {
        ("0.5", "1", "1"),
        ("0.75", "3", "3"),
    }
    rows = {r["press"]: r for r in table if r["ratio"] == "0.5"}
    assert {r["n_after"] for r in rows.values()} == {r["n_inside"] for r in rows.values()} == {"1"}
    assert float(rows["snapkv"]["score_after"]) == 1.0 and float(rows["tova"]["score_after"]) == 0.0
    assert float(rows["snapkv"]["score_inside"]) == 0.0 and float(rows["tova"]["score_inside"]) == 1.0
    # the win scores count the same runs and examples as the scores, complete or not (e1: snapkv wins after,
    # tova inside)
    assert (float(rows["snapkv"]["win_after"]), float(rows["tova"]["win_after"])) == (1.0, 0.0)
    assert (float(rows["snapkv"]["win_inside"]), float(rows["tova"]["win_inside"])) == (0.0, 1.0)
    # a run with a shard missing (incomplete) still gets its win score beside the complete ones
    root3 = tmp_path / "sharded"
    for proto, (s1, s2) in (("needle", (1, 1)), ("needle-qa", (1, 0))):
        _write_run(root3, "snapkv", "0.5", [("e1", "needle", s1), ("e2", "needle", s2)], dataset=proto)
        _write_run(root3, "tova", "0.5", [("e1", "needle", 0)], shard="shard_0_of_2", dataset=proto)
    build_report(root3, tmp_path / "r4", plots=False)
    rows = {r["press"]: r for r in _csv(tmp_path / "r4" / "tables" / "needle__tiny__protocols.csv")}
    assert rows["tova"]["n_after"] == "1" and float(rows["tova"]["win_after"]) == 0.0
    assert float(rows["snapkv"]["win_after"]) == float(rows["snapkv"]["win_inside"]) == 1.0
    only_after = tmp_path / "one"
    _write_run(only_after, "snapkv", "0.5", [("e1", "needle", 1)], dataset="needle")
    assert "side by side" not in build_report(only_after, tmp_path / "r2", plots=False).read_text()


def test_shards_whose_saved_presses_differ_only_in_how_they_are_stated_are_one_run(tmp_path):
    """A shard saved as the yaml tree that built its press (an old module path, defaults left out) and one saved as
    the press's settings (every field) are the same run, whichever shard is older; a changed field is not."""
    from evaluation.settings import run_settings

    root = tmp_path / "runs"
    full = run_settings({"press": {"_target_": "presses.ProbabilisticEvictionPress", "compression_ratio": 0.5}})
    # both saved before the press had its ``draws`` field (a field they predate reads as its earlier value)
    stated = "\n".join(f"  {k}: {v}" for k, v in full["press"].items() if k not in ("_target_", "draws"))
    trees = (
        f"press:\n  _target_: presses.ProbabilisticEvictionPress\n{stated}\n",
        "press:\n  _target_: presses.probabilistic.ProbabilisticEvictionPress\n  compression_ratio: 0.5\n",
    )
    for shard, tree in zip(("shard_0_of_2", "shard_1_of_2"), trees):
        _write_run(root, "snis_min_h", "0.5", [(f"{shard}-e", "A", 1)], shard=shard)
        (root / "ruler" / "tiny" / "snis_min_h" / "cr0.5" / shard / "config.yaml").write_text(
            f"compression_ratio: 0.5\nshard: {shard[6]}/2\n{tree}"
        )
    (run,) = scan(root)
    assert run.complete, run.problems
    (root / "ruler" / "tiny" / "snis_min_h" / "cr0.5" / "shard_1_of_2" / "config.yaml").write_text(
        "compression_ratio: 0.5\nshard: 1/2\npress:\n  _target_: presses.ProbabilisticEvictionPress\n"
        "  compression_ratio: 0.5\n  tau: 2.0\n"
    )
    (run,) = scan(root)
    assert not run.complete and "tau" in run.problems[0]


def test_a_question_inside_section_names_its_protocol(tmp_path):
    root = tmp_path / "runs"
    _write_run(root, "snapkv", "0.5", [("e1", "needle", 1)], dataset="needle-qa")
    readme = build_report(root, tmp_path / "r", plots=False).read_text()
    assert "Protocol: the question inside the compressed context" in readme


def test_effective_compression_counts_kept_entries_not_padding(tmp_path):
    """A SNIS row's cache holds its KV groups' draws padded to the layer's longest (masked), so its cache length
    overstates what is kept: rows written before the kept count was the rule get it from their press's logical
    count (``python -m evaluation.migrate``), and the report reads ``effective_compression``."""
    from evaluation.migrate import migrate

    root = tmp_path / "runs"
    _write_run(root, "snis_min", "0.5", [("e1", "A", 1), ("e2", "A", 0)])
    path = root / "ruler" / "tiny" / "snis_min" / "cr0.5" / "predictions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:2]]
    for row, logical in zip(rows, (0.51, 0.49)):  # old rows: effective = physical, the padded figure
        row.update(
            effective_compression=0.37,
            physical_compression=0.37,
            press_stats={"logical_compression": logical, "num_layers_evicted": 30},
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_run(root, "snis_min_h", "0.5", [("e1", "A", 1)])  # a new row: its kept count, one float bit off the logical
    newer = root / "ruler" / "tiny" / "snis_min_h" / "cr0.5" / "predictions.jsonl"
    row = json.loads(newer.read_text().splitlines()[0])
    row.update(
        effective_compression=0.7529261255375905,
        physical_compression=0.728,
        press_stats={"logical_compression": 0.7529261255375904, "num_layers_evicted": 30},
    )
    newer.write_text(json.dumps(row) + "\n")
    newer_bytes = newer.read_bytes()
    _write_run(root, "tova", "0.5", [("e1", "A", 1), ("e2", "A", 1)])
    tova_rows = (root / "ruler" / "tiny" / "tova" / "cr0.5" / "predictions.jsonl").read_bytes()
    assert migrate(root)["rows"] == 2
    assert migrate(root)["rows"] == 0  # idempotent
    assert (root / "ruler" / "tiny" / "tova" / "cr0.5" / "predictions.jsonl").read_bytes() == tova_rows
    assert newer.read_bytes() == newer_bytes  # only the padded figure is replaced
    build_report(root, tmp_path / "out", plots=False)
    eff = {
        r["press"]: float(r["effective_compression"])
        for r in _csv(tmp_path / "out" / "tables" / "ruler__tiny__summary.csv")
    }
    assert eff == pytest.approx({"snis_min": 0.50, "snis_min_h": 0.7529261255375905, "tova": 0.5})


def test_migrate_gives_old_needle_rows_their_target_length(tmp_path):
    """Needle rows written before ``metadata.target_length`` hold only their own token count in
    ``metadata.context_length``: ``python -m evaluation.migrate`` takes the target from the run's settings (the
    needle's ``context_length``), once; another dataset's rows and a row that has it keep their bytes."""
    from evaluation.migrate import migrate
    from evaluation.report import row_length

    root = tmp_path / "runs"
    _write_run(root, "snapkv", "0.5", [("e1", "needle", 1), ("e2", "needle", 0)], dataset="needle")
    run = root / "needle" / "tiny" / "snapkv" / "cr0.5"
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()[:2]]
    rows[0]["metadata"] = {"context_length": 2030}
    rows[1]["metadata"] = {"context_length": 2041, "target_length": 4096}  # already has one: kept
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(
        "compression_ratio: 0.5\ndataset:\n  _target_: evaluation.datasets.needle.NeedleDataset\n"
        "  context_length: 2048\n"
    )
    _write_run(root, "snapkv", "0.5", [("r1", "A", 1)])  # RULER: metadata.context_length is the target
    ruler = (root / "ruler" / "tiny" / "snapkv" / "cr0.5" / "predictions.jsonl").read_bytes()
    assert [row_length(r) for r in rows] == [2030, 4096]  # before: the first row's own tokens
    assert migrate(root)["rows"] == 1
    assert migrate(root)["rows"] == 0  # idempotent
    migrated = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [row_length(r) for r in migrated] == [2048, 4096]
    assert migrated[0]["metadata"]["context_length"] == 2030  # the token count stays
    assert (root / "ruler" / "tiny" / "snapkv" / "cr0.5" / "predictions.jsonl").read_bytes() == ruler


def test_continuation_loss_is_broken_down_by_length(tmp_path):
    """A continuation run of two lengths: the table holds each length's mean and interval as a run of that length
    alone would, and the pooled ones; the README shows a table per length and the pooled one, the plot a row each."""
    root = tmp_path / "runs"
    increase = {(512, "code"): [0.1, 0.3], (512, "docs"): [0.2, 0.2], (1024, "code"): [0.5, 0.7], (1024, "docs"): [0.9]}
    for press, scale in (("no_press", 0.0), ("snapkv", 1.0)):
        ratio = "0" if press == "no_press" else "0.5"
        d = root / "continuation_loss" / "tiny" / press / f"cr{ratio}"
        d.mkdir(parents=True)
        with open(d / "predictions.jsonl", "w") as f:
            for (length, task), values in increase.items():
                for i, v in enumerate(values):
                    row = {
                        "id": f"{task}-{length}-{i}",
                        "task": task,
                        "score": 1.0,
                        "metadata": {"context_length": length},
                    }
                    row.update(
                        {"nll": 2 + v * scale, "nll_uncompressed": 2.0, "nll_increase": v * scale, "kl": v * scale / 2}
                    )
                    f.write(json.dumps(row) + "\n")
        (d / "metrics.json").write_text(json.dumps({"command": f"python -m evaluation.run press={press}"}))
        (d / "config.yaml").write_text(f"compression_ratio: {ratio}\n")
    out = tmp_path / "results"
    text = build_report(root, out).read_text()
    table = _csv(out / "tables" / "continuation_loss__tiny__continuation.csv")
    cells = {(r["press"], r["context_length"], r["task"]): r for r in table}
    assert len(cells) == len(table) == 2 * 3 * 3  # per press: lengths all / 512 / 1024, tasks all / code / docs
    for length, values in (
        ("512", [0.1, 0.3, 0.2, 0.2]),
        ("1024", [0.5, 0.7, 0.9]),
        ("all", [0.1, 0.3, 0.2, 0.2, 0.5, 0.7, 0.9]),
    ):
        row = cells[("snapkv", length, "all")]
        lo, hi = t_interval(values, 0.95)
        assert int(row["n"]) == len(values)
        assert float(row["nll_increase"]) == pytest.approx(sum(values) / len(values))
        assert (float(row["nll_increase_low"]), float(row["nll_increase_high"])) == pytest.approx((lo, hi), rel=1e-5)
        assert float(row["kl"]) == pytest.approx(sum(values) / len(values) / 2)
    assert float(cells[("snapkv", "1024", "code")]["nll_increase"]) == pytest.approx(0.6)
    assert float(cells[("no_press", "1024", "all")]["nll_increase"]) == 0.0
    for label in ("NLL increase", "KL"):
        for caption in (" at 512 tokens:", " at 1024 tokens:", " over all lengths:"):
            assert f"\n{label}{caption}\n" in text
    at_1024 = text.split("NLL increase at 1024 tokens:")[1].split("NLL increase over all lengths:")[0]
    assert "| snapkv | – | 0.7000 [" in at_1024 and "| no_press | 0.0000 [0.0000, 0.0000] | – |" in at_1024
    assert "Table (per task and length too)" in text
    assert (out / "plots" / "continuation_loss__tiny__loss.png").stat().st_size > 1000


class _Figures:
    """A stand-in for the report's writer that keeps each figure, by its name's last part (``loss.png``), unsaved."""

    def __init__(self):
        self.figs = {}

    def figure(self, rel: str, fig) -> str:
        self.figs[rel.rsplit("__", 1)[1]] = fig
        return rel


def test_loss_figure_titles_stay_apart_and_one_legend_sits_below_the_panels():
    """The loss plot of a dataset with three lengths and twenty presses (the committed grid's shape): its panel
    titles do not run into each other, the ten presses of the lowest KL are in colour and the rest grey, and the
    legend names each coloured press once and the grey ones in one entry, below every panel."""
    from evaluation import report

    presses = ["no_press"] + [f"page_entrokv_reconstruction_{i:02d}" for i in range(19)]  # long names
    kl = {p: 0.1 + 0.01 * ((7 * i) % 19) for i, p in enumerate(presses)}  # the lowest ten: not the first ten
    losses = [
        {
            "press": press,
            "ratio": ratio,
            "task": "all",
            "context_length": length,
            **{
                key: v
                for k in ("nll_increase", "kl")
                for key, v in ((k, kl[press]), (f"{k}_low", 0.05), (f"{k}_high", 0.3))
            },
        }
        for length in (2048, 4096, 7680, "all")
        for press in presses
        for ratio in ((0.0,) if press == "no_press" else (0.25, 0.5, 0.75))
    ]
    w, title = _Figures(), "continuation_loss / smollm2-135m"  # the committed report's title
    assert report._loss_figure(w, "continuation_loss__smollm2-135m", title, losses, presses)
    fig = w.figs["loss.png"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    rows = fig.axes[0].get_gridspec().nrows
    assert rows == 4 and len(fig.axes) == 8
    for left, right in zip(fig.axes[0::2], fig.axes[1::2]):
        a, b = left.title.get_window_extent(renderer), right.title.get_window_extent(renderer)
        assert a.x1 < b.x0, (left.get_title(), right.get_title())
    assert [ax.get_legend() for ax in fig.axes] == [None] * 8
    (legend,) = fig.legends
    lowest = sorted(presses[1:], key=kl.get)[:10]
    assert [t.get_text() for t in legend.get_texts()] == ["no_press", *(p for p in presses if p in lowest)] + [
        "9 other presses"
    ]
    coloured = [c.lines[0].get_color() for c in fig.axes[0].containers if c.get_label() in lowest]
    assert len(coloured) == 10 and len(set(map(str, coloured))) == 10  # ten colours, apart
    box = legend.get_window_extent(renderer)
    assert all(box.y1 < ax.get_window_extent(renderer).y0 for ax in fig.axes)
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width, "the legend is cut off at the figure's edges"


def _press_lines(ax, names: list[str]) -> dict:
    """The lines of ``ax`` labelled with one of ``names``, by label: errorbar lines (a plot with intervals) or plain."""
    found = {c.get_label(): c.lines[0] for c in ax.containers if c.get_label() in names}
    found.update({ln.get_label(): ln for ln in ax.get_lines() if ln.get_label() in names})
    return found


def test_score_and_win_plots_split_many_presses_into_panels_and_cost_ticks_stay_apart():
    """With 22 presses the score and win plots split them into three panels of at most ten lines, each press in one
    panel in a colour no other press of its panel has, each panel's legend beside it and inside the figure (one
    panel of 29 look-alike colours was unreadable); the cost plot names its frontier's presses on the panel and every
    press in a legend below, and its log axis labels its ticks with plain numbers that do not run into each other."""
    from evaluation import report

    presses = ["no_press"] + [f"page_entrokv_reconstruction_{i:02d}" for i in range(22)]  # RULER's 23, long names
    ratios = (0.25, 0.5, 0.75)
    summary = [{"press": "no_press", "ratio": 0.0, "score": 0.56, "low": 0.5, "high": 0.6}] + [
        {"press": p, "ratio": r, "score": 0.5 - r / 2, "low": 0.4 - r / 2, "high": 0.6 - r / 2}
        for p in presses[1:]
        for r in ratios
    ]
    wins = [{"press": p, "ratio": r, "win_score": 0.5} for p in presses[1:] for r in ratios]
    costed = [
        {"press": "no_press", "ratio": r, "score": 0.56, "prefill_cost": 1.0, "on_frontier": False} for r in ratios
    ]
    costed += [
        {"press": p, "ratio": r, "score": 0.3, "prefill_cost": 0.95 + 6 * i / 19, "on_frontier": i % 5 == 0}
        for i, p in enumerate(presses[1:])
        for r in ratios
    ]
    w, title = _Figures(), "stdlib_docs / smollm2-135m"
    report._figures(w, "stdlib_docs__smollm2-135m", title, summary, wins, [], presses)
    report._cost_figure(w, "stdlib_docs__smollm2-135m", title, costed, presses)
    for name in ("score.png", "win.png"):
        fig = w.figs[name]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert len(fig.axes) == 3 and not fig.legends
        named = []
        for ax in fig.axes:
            lines = _press_lines(ax, presses[1:])
            assert 1 <= len(lines) <= 10
            assert len({str(ln.get_color()) for ln in lines.values()}) == len(lines)  # apart within the panel
            legend = ax.get_legend()
            assert [t.get_text() for t in legend.get_texts()] == (["no_press"] if name == "score.png" else []) + list(
                lines
            )
            box = legend.get_window_extent(renderer)
            assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 <= fig.bbox.height
            assert box.x0 >= ax.get_window_extent(renderer).x1  # beside its panel, not over its lines
            named += list(lines)
        assert named == presses[1:]  # every press once, in order
    fig = w.figs["cost.png"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    assert sorted(t.get_text() for t in legend.get_texts()) == sorted(presses + ["frontier"])
    box = legend.get_window_extent(renderer)
    assert (
        0 <= box.x0 and box.x1 <= fig.bbox.width and all(box.y1 < ax.get_window_extent(renderer).y0 for ax in fig.axes)
    )
    on_frontier = sorted(r["press"] for r in costed if r["on_frontier"] and r["ratio"] == 0.25)
    assert sorted(t.get_text() for t in fig.axes[0].texts) == on_frontier  # the rest are named in the legend only
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = zip(
            list(ax.get_xticks(minor=True)) + list(ax.get_xticks()),
            ax.get_xticklabels(minor=True) + ax.get_xticklabels(),
        )
        labels = [t for x, t in ticks if low <= x <= high and t.get_text()]
        assert len(labels) >= 3 and all(t.get_text().replace(".", "").isdigit() for t in labels)
        boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in labels]


def test_the_cost_plot_names_crowded_frontier_presses_apart_and_inside_the_panel():
    """The committed continuation-loss frontier at 0.5: five presses within 0.15 x of the full prefill and 0.01 of
    score, then the reconstruction press at 5 x near the top. Their names printed over one another and the last ran
    off the panel; now no two overlap, each stays inside its panel, and a name moved from its point has a line to it."""
    from matplotlib.text import Text

    from evaluation import report

    front = [("tova", 0.96, 0.966), ("chunkkv32", 1.0, 0.973), ("page_entrokv_mean", 1.02, 0.9735)]
    front += [("chunkkv", 1.05, 0.975), ("snis_min_h", 1.1, 0.976), ("page_entrokv_reconstruction", 5.2, 0.998)]
    costed = [{"press": "no_press", "ratio": 0.5, "score": 1.0, "prefill_cost": 1.0, "on_frontier": False}]
    costed += [{"press": p, "ratio": 0.5, "score": s, "prefill_cost": c, "on_frontier": True} for p, c, s in front]
    costed += [{"press": "knorm", "ratio": 0.5, "score": 0.8, "prefill_cost": 1.05, "on_frontier": False}]
    w = _Figures()
    presses = ["no_press", "knorm"] + [f[0] for f in front]
    report._cost_figure(w, "continuation_loss__smollm2-135m", "t", costed, presses)
    fig = w.figs["cost.png"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    assert sorted(t.get_text() for t in ax.texts) == sorted(f[0] for f in front)
    boxes = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}  # the name, not its line
    panel = ax.get_window_extent(renderer)
    for name, box in boxes.items():
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1, name
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not boxes[a].overlaps(boxes[b]), (a, b)
    moved = [t for t in ax.texts if t.arrow_patch is not None]
    assert moved, "five names within a line's height of one another: some must move"
    for t in moved:  # its name is off its point's height
        box = boxes[t.get_text()]
        assert abs((box.y0 + box.y1) / 2 - ax.transData.transform(t.xy)[1]) > box.height / 2


def test_every_press_of_a_large_grid_gets_its_own_colour():
    """RULER's report plots 24 presses (Finch and the halo candidate with the 22 of the grid): tab20 alone gave the
    21st press the first one's colour."""
    from evaluation.plotting import press_colors

    for n in (5, 10, 11, 20, 24, 40):
        colors = press_colors(["no_press"] + [f"p{i}" for i in range(n)], "no_press")
        assert len(colors) == n and len(set(colors.values())) == n
    small = press_colors(["no_press", "a", "b"], "no_press")
    assert small["a"] != small["b"]


def test_a_figure_with_nothing_labelled_gets_no_legend():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from evaluation.plotting import legend_below

    fig, ax = plt.subplots(layout="constrained")
    ax.plot([0, 1], [0, 1])  # unlabelled
    legend_below(fig, ax)
    assert fig.legends == []
    ax.plot([0, 1], [1, 0], label="snapkv")
    legend_below(fig, ax)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["snapkv"]
    plt.close(fig)


def test_a_one_task_grid_of_thirty_presses_keeps_its_panel():
    """needle's report has one task and 30 presses: the per-task figure, one panel wide, must still hold its panel
    (its 30-name legend once squeezed the panel to nothing: "constrained_layout not applied")."""
    import warnings

    from evaluation import report

    presses = ["no_press"] + [f"page_entrokv_reconstruction_{i:02d}" for i in range(29)]
    tasks = [
        {"group": "needle", "press": p, "ratio": r, "score": 0.5}
        for p in presses
        for r in ((0.0,) if p == "no_press" else (0.5, 0.75, 0.9))
    ]
    summary = [{"press": t["press"], "ratio": t["ratio"], "score": 0.5, "low": 0.4, "high": 0.6} for t in tasks]
    w = _Figures()
    report._figures(w, "needle__smollm2-135m", "needle / smollm2-135m", summary, [], tasks, presses)
    fig = w.figs["tasks.png"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when the layout collapses
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    (legend,) = fig.legends
    assert ax.get_window_extent(renderer).height >= 1.5 * fig.dpi  # inches of panel left
    box = legend.get_window_extent(renderer)
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 < ax.get_window_extent(renderer).y0


def test_one_ratio_draws_one_bar_per_press_and_no_title_is_cut():
    """`make eval` runs five presses at one ratio: as lines they all sat at x = 0.75 and hid one another; as bars each
    press has its own, named below it. The cost plot's one panel is narrower than its title, which was cut
    ("edle-qa / smollm2-135m: ..."); now it wraps inside the figure."""
    from matplotlib.patches import Rectangle

    from evaluation import report

    presses = ["no_press", "chunkkv", "kvzip", "page_entrokv", "snis_min_h_page", "tova"]
    summary = [{"press": "no_press", "ratio": 0.0, "score": 1.0, "low": 0.6, "high": 1.0}] + [
        {"press": p, "ratio": 0.75, "score": 0.2 * i, "low": 0.1 * i, "high": 0.3 * i}
        for i, p in enumerate(presses[1:])
    ]
    wins = [{"press": p, "ratio": 0.75, "win_score": 0.2 * i} for i, p in enumerate(presses[1:])]
    tasks = [{**r, "group": "needle"} for r in summary]
    costed = [{"press": "no_press", "ratio": 0.75, "score": 1.0, "prefill_cost": 1.0, "on_frontier": False}]
    costed += [
        {"press": p, "ratio": 0.75, "score": 0.5, "prefill_cost": 1.0 + i, "on_frontier": i == 4}
        for i, p in enumerate(presses[1:])
    ]
    w, title = _Figures(), "needle-qa / smollm2-135m"
    report._figures(w, "needle-qa__smollm2-135m", title, summary, wins, tasks, presses)
    report._cost_figure(w, "needle-qa__smollm2-135m", title, costed, presses)
    for name in ("score.png", "win.png", "tasks.png"):
        fig = w.figs[name]
        fig.canvas.draw()
        (ax,) = fig.axes
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert [t.get_text() for t in ax.get_xticklabels()] == presses[1:]
        assert sorted(round(b.get_height(), 6) for b in bars) == [round(0.2 * i, 6) for i in range(5)]
        assert len({round(b.get_x(), 6) for b in bars}) == 5  # side by side, not at one x
    for name in ("score.png", "cost.png"):
        fig = w.figs[name]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        titles = [t for t in (fig._suptitle, *(ax.title for ax in fig.axes)) if t is not None and t.get_text()]
        assert any("needle-qa" in t.get_text() for t in titles)
        for t in titles:
            box = t.get_window_extent(renderer)
            assert 0 <= box.x0 and box.x1 <= fig.bbox.width, f"{name}: title {t.get_text()!r} is cut"
