"""The partial-answers study (``evaluation.studies.partial_answers``): how wrong number answers are wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluation import tables
from evaluation.studies.partial_answers import dropped, kind, main

ROOT = Path(__file__).resolve().parent.parent


def test_dropped_is_a_shorter_subsequence_in_order():
    assert dropped("679103", "6791038")
    assert dropped("1727", "1725772")
    assert not dropped("6791083", "6791038")  # as long: a swap, not a drop
    assert not dropped("6791038", "6791038")
    assert not dropped("83", "6791038")  # out of order
    assert not dropped("", "6791038")


def test_kind_reads_the_first_number():
    assert kind(" 2978129.", "2978129") == "exact"
    assert kind(" 310492.33.", "3104926") == "digits dropped"
    assert kind(" 2222222222", "2978129") == "other"
    assert kind(" no idea", "2978129") == "other"


def _run(root: Path, press: str, rows: list[dict]) -> None:
    run = root / press / "cr0.9" / "shard_0_of_2"
    run.mkdir(parents=True)
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_counts_per_press_and_task(tmp_path):
    _run(
        tmp_path,
        "a",
        [
            {"task": "t1", "answers": ["1234"], "prediction": "1234"},
            {"task": "t1", "answers": ["1234"], "prediction": "124"},
            {"task": "t1", "answers": ["1234"], "prediction": "99"},
            {"task": "t2", "answers": ["55"], "prediction": "5"},
            {"task": "t2", "answers": ["a word"], "prediction": "5"},  # not a number answer: not read
        ],
    )
    main([str(tmp_path), "--ratio", "0.9", "--presses", "a", "--out", str(tmp_path / "out"), "--name", "x"])
    rows = tables.read_rows(tmp_path / "out" / "x.csv")
    got = {r["task"]: (r["rows"], r["exact"], r["digits dropped"], r["other"]) for r in rows}
    assert got == {"t1": ("3", "1", "1", "1"), "t2": ("1", "0", "1", "0")}
    main([str(tmp_path), "--ratio", "0.9", "--presses", "a", "--tasks", "t2", "--out", str(tmp_path), "--name", "y"])
    assert [r["task"] for r in tables.read_rows(tmp_path / "y.csv")] == ["t2"]


def test_the_committed_table_is_regenerated(tmp_path):
    committed = ROOT / "results" / "partial_answers" / "ruler_0.9.md"
    command = committed.read_text().split("`")[1].split()
    argv = command[2:] + ["--out", str(tmp_path)]
    argv[0] = str(ROOT / argv[0])
    main(argv)
    assert tables.read_rows(tmp_path / "ruler_0.9.csv") == tables.read_rows(committed.with_suffix(".csv"))


def test_a_press_without_runs_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no run of press 'kvzip' at ratio 0.9 under"):
        main([str(tmp_path), "--ratio", "0.9", "--presses", "kvzip"])
