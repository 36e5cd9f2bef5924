"""The page-grid study (``evaluation.studies.page_straddle``): where an answer falls on the pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluation import tables
from evaluation.studies.page_straddle import main, straddles

ROOT = Path(__file__).resolve().parent.parent


def test_straddles_reads_the_page_grid():
    assert not straddles([0, 31], 32)  # page 0 is [0, 32)
    assert straddles([31, 32], 32)
    assert not straddles([32, 40, 63], 32)
    assert straddles([60, 70], 8)
    assert not straddles([5], 1)
    with pytest.raises(ValueError, match="positions is empty"):
        straddles([], 32)
    with pytest.raises(ValueError, match="page_size=0 must be >= 1"):
        straddles([1, 2], 0)


def test_the_committed_needle_table_is_regenerated(tmp_path, embedded_model):
    """The study rebuilds the committed needle runs' examples and scores: its rows equal the committed table's."""
    committed = tables.read_rows(ROOT / "results" / "page_straddle" / "needle_0.9.csv")
    presses = [c for c in committed[0] if c not in ("id", "task", "answer_tokens", "straddles")]
    main(
        [
            str(ROOT / "results" / "needle" / "smollm2-135m"),
            "--ratio",
            "0.9",
            "--presses",
            *presses,
            "--out",
            str(tmp_path),
        ]
    )
    assert tables.read_rows(tmp_path / "needle_0.9.csv") == committed
    assert len(committed) == 40 and {r["answer_tokens"] for r in committed} == {"7"}


def test_a_press_without_runs_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no run of press 'kvzip' at ratio 0.9 under"):
        main([str(tmp_path), "--ratio", "0.9", "--presses", "kvzip"])
