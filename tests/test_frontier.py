"""Quality against cost (issue 29, deliverable 4): the frontier of score against prefill cost at each ratio."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_report import _write_run

from evaluation.frontier import COST_COLUMN, cost_table, frontier_rows, read_costs, run_costs
from evaluation.report import build_report, main


def test_frontier_keeps_the_points_no_other_point_dominates():
    pts = [
        {"press": "cheap_bad", "score": 0.2, "cost": 1.0},
        {"press": "mid", "score": 0.5, "cost": 1.1},
        {"press": "dominated", "score": 0.4, "cost": 1.2},  # mid scores more for less
        {"press": "dear_good", "score": 0.9, "cost": 6.0},
        {"press": "tie_dear", "score": 0.9, "cost": 6.5},  # same score as dear_good, more cost
        {"press": "unmeasured", "score": 1.0, "cost": None},
    ]
    on = {p["press"]: p["on_frontier"] for p in frontier_rows(pts)}
    assert on == {
        "cheap_bad": True,
        "mid": True,
        "dominated": False,
        "dear_good": True,
        "tie_dear": False,
        "unmeasured": False,
    }


def _costs(path: Path, rows: list[tuple]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "press", "compression_ratio", "T", "prefill_ratio_vs_full", "error"])
        w.writerows(rows)
    return path


def test_cost_table_reads_the_nearest_length_and_leaves_the_baseline_off_the_frontier(tmp_path):
    costs = read_costs(
        _costs(
            tmp_path / "c.csv",
            [
                ("tiny", "a", 0.5, 1024, 1.5, ""),
                ("tiny", "a", 0.5, 2048, 1.1, ""),  # nearest to 1900 tokens
                ("tiny", "b", 0.5, 2048, 3.0, ""),
                ("tiny", "c", 0.5, 2048, 0.9, "RuntimeError: failed"),  # an error row is not a cost
                ("other", "b", 0.5, 2048, 0.1, ""),  # another model's
            ],
        )
    )
    summary = [
        {"press": "no_press", "ratio": 0.0, "score": 0.9, "n": 4},
        {"press": "a", "ratio": 0.5, "score": 0.4, "n": 4},
        {"press": "b", "ratio": 0.5, "score": 0.6, "n": 4},
        {"press": "c", "ratio": 0.5, "score": 0.7, "n": 4},
    ]
    rows = {r["press"]: r for r in cost_table(summary, costs, "tiny", 1900.0, "no_press")}
    assert rows["a"]["prefill_cost"] == 1.1 and rows["b"]["prefill_cost"] == 3.0
    assert rows["a"]["cost_length"] == 2048 and rows["c"]["cost_length"] is None
    assert {r["cost_length"] for r in cost_table(summary, costs, "tiny", 1100.0, "no_press") if r["press"] == "a"} == {
        1024
    }
    assert rows["c"]["prefill_cost"] is None and not rows["c"]["on_frontier"]
    assert rows["a"]["on_frontier"] and rows["b"]["on_frontier"]
    assert rows["no_press"]["prefill_cost"] == 1.0 and not rows["no_press"]["on_frontier"]
    assert cost_table(summary, [], "tiny", 1900.0, "no_press") == []


def test_the_report_lists_the_frontier_with_its_costs(tmp_path):
    root = tmp_path / "runs"
    _write_run(root, "no_press", "0", [("e1", "A", 1), ("e2", "A", 1)])
    _write_run(root, "fast", "0.5", [("e1", "A", 1), ("e2", "A", 0)])
    _write_run(root, "slow_better", "0.5", [("e1", "A", 1), ("e2", "A", 1)])
    _write_run(root, "slow_worse", "0.5", [("e1", "A", 0), ("e2", "A", 0)])
    costs = _costs(
        tmp_path / "speed.csv",
        [("tiny", "fast", 0.5, 128, 1.0, ""), ("tiny", "slow_better", 0.5, 128, 5.0, "")]
        + [("tiny", "slow_worse", 0.5, 128, 5.0, "")],
    )
    readme = build_report(root, tmp_path / "out", plots=False, costs=costs).read_text()
    assert "### Quality against prefill cost" in readme
    assert "at 128 tokens (the runs' mean context length: 100)" in readme  # _write_run's rows: 100 tokens
    line = next(line for line in readme.splitlines() if line.startswith("- cr 0.5 (") and "on the frontier" in line)
    assert line.startswith("- cr 0.5 (question after compression; costs of the speed sweep speed.csv): on the")
    assert "`fast` (0.500, 1.00 x)" in line and "`slow_better` (1.000, 5.00 x)" in line and "slow_worse" not in line
    table = list(csv.DictReader(open(tmp_path / "out" / "tables" / "ruler__tiny__cost.csv")))
    assert {r["press"]: r["on_frontier"] for r in table} == {
        "fast": "True",
        "slow_better": "True",
        "slow_worse": "False",
        "no_press": "False",
    }
    assert "Quality against prefill cost" not in build_report(root, tmp_path / "o2", plots=False).read_text()


def _timed_run(root: Path, dataset: str, press: str, ratio: str, scores: list[float], replay: float) -> None:
    """A shared-prefill run: rows with ``prefill_seconds`` (2 s and 4 s) and ``replay_seconds`` (``replay`` x each)."""
    _write_run(root, press, ratio, [(f"e{i}", "A", s) for i, s in enumerate(scores)], dataset=dataset)
    path = root / dataset / "tiny" / press / f"cr{ratio}" / "predictions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    for row, prefill in zip(rows, (2.0, 4.0)):
        row.update(prefill_seconds=prefill, replay_seconds=replay * prefill, seconds=prefill * (1 + replay) + 1)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_costs_are_the_replay_over_the_shared_prefill_of_the_same_examples():
    rows = [
        {"prefill_seconds": 2.0, "replay_seconds": 1.0, "context_length": 100},
        {"prefill_seconds": 4.0, "replay_seconds": 5.0, "context_length": 300},
        {"seconds": 9.0, "context_length": 500},  # evaluation.run's row: no prefill apart from the compression
    ]
    (cost,) = run_costs([("tiny", "kvzip", 0.5, rows), ("tiny", "snapkv", 0.5, rows[2:])])
    assert cost[COST_COLUMN] == pytest.approx((3 + 3) / 3)  # (mean prefill 3 s + mean replay 3 s) / 3 s
    assert (cost["press"], cost["compression_ratio"], cost["repeats"], cost["T"]) == ("kvzip", 0.5, 2, 200)


def test_make_evals_frontier_uses_the_runs_own_costs_and_names_each_protocol(tmp_path):
    """What `make eval` prints: one frontier line per protocol, each naming it and where its costs come from; a press
    whose replay costs nothing is at 1.00 x, never cheaper than the uncompressed prefill (0.90 x came from another
    machine's sweep)."""
    root = tmp_path / "runs"
    for dataset in ("needle", "needle-qa"):
        _timed_run(root, dataset, "no_press", "0", [1, 1], 0.01)  # rebuilding the cache, no press
        _timed_run(root, dataset, "tova", "0.75", [0, 0], 0.0)
        _timed_run(root, dataset, "kvzip", "0.75", [1, 1], 3.0)
        _timed_run(root, dataset, "knorm", "0.75", [0, 0], 0.5)  # dearer than tova, no better: off the frontier
    readme = build_report(root, tmp_path / "out", plots=False, own_costs=True).read_text()
    lines = [line for line in readme.splitlines() if line.startswith("- cr ") and "on the frontier" in line]
    assert lines == [
        f"- cr 0.75 (question {where}; costs of these runs, 2 examples): on the frontier, by cost: "
        "`tova` (0.000, 1.00 x), `kvzip` (1.000, 4.00 x)"
        for where in ("after compression", "inside the context")
    ]
    assert "averaged over 2 examples per press at 100 tokens, on the machine" in readme  # _write_run's 100 tokens
    assert "compresses nothing, costs 1.01 x: the floor of these costs" in readme
    table = list(csv.DictReader(open(tmp_path / "out" / "tables" / "needle-qa__tiny__cost.csv")))
    assert {r["press"]: (r["prefill_cost"], r["cost_repeats"]) for r in table} == {
        "no_press": ("1", ""),
        "tova": ("1", "2"),
        "knorm": ("1.5", "2"),
        "kvzip": ("4", "2"),
    }
    with pytest.raises(ValueError, match="one source of costs"):
        build_report(root, tmp_path / "o2", plots=False, own_costs=True, costs=tmp_path / "speed.csv")
    with pytest.raises(SystemExit):  # the command line takes one source too
        main([str(root), "--out", str(tmp_path / "o3"), "--no-plots", "--own-costs", "--costs", "x.csv"])


def test_a_frontier_line_counts_its_repeats_in_words():
    from evaluation.report import _counts

    assert _counts([1, 1, None], "repeat") == "1 repeat"
    assert _counts([5, 5], "example") == "5 examples"
    assert _counts([5, 3, 4], "example") == "3-5 examples"
    assert _counts([None], "repeat") == ""
