"""The README's "Which press when" block is the one the committed tables give (``evaluation/readme_table.py``)."""

import re
from pathlib import Path

import pytest

from evaluation.readme_table import END, KVZIP_SLACK, START, best_press, render, rewrite
from evaluation.tables import read_rows

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_block_is_regenerated_from_the_committed_tables():
    text = README.read_text(encoding="utf-8")
    assert rewrite(text, render(ROOT, text)) == text, "run: .venv/bin/python -m evaluation.readme_table"


def test_every_pick_is_a_config_and_matches_its_linked_table():
    block = render(ROOT, README.read_text(encoding="utf-8"))
    cells = re.findall(
        r"\[\w+\]\((results/tables/[^)]+__cost\.csv)\): `press=(\w+)` ([\d.]+) \(n=(\d+)\), ([\d.]+) x", block
    )
    assert cells, "no cell found"
    for path, press, score, n, cost in cells:
        assert (ROOT / "configs" / "press" / f"{press}.yaml").is_file(), press
        rows = [r for r in read_rows(ROOT / path) if r["press"] == press]
        assert any(
            f"{float(r['score']):.3f}" == score and r["n"] == n and f"{float(r['prefill_cost']):.2f}" == cost
            for r in rows
        ), (path, press, score, n, cost)


def _row(press, score, cost, ratio="0.5"):
    return {"ratio": ratio, "press": press, "n": "40", "score": str(score), "prefill_cost": str(cost)}


def test_best_press_takes_the_best_score_within_the_budget_and_ties_to_the_lower_cost():
    rows = [
        _row("no_press", 1.0, 1.0),
        _row("cheap", 0.5, 0.9),
        _row("tie_dear", 0.6, 1.2),
        _row("tie_cheap", 0.6, 1.1),
        _row("too_dear", 0.9, 5.0),
        _row("untimed", 0.95, ""),
        _row("other_ratio", 0.99, 0.5, ratio="0.75"),
    ]
    assert best_press(rows, 0.5, 1.25)["press"] == "tie_cheap"
    assert best_press(rows, 0.5, 6.0)["press"] == "too_dear"
    assert best_press(rows, 0.5, 0.5) is None


def test_rewrite_needs_both_markers_once():
    assert rewrite(f"a\n{START}\nold\n{END}\nb", "NEW") == "a\nNEW\nb"
    for text in ("no markers", f"{END}\n{START}", f"{START}{START}{END}"):
        with pytest.raises(ValueError, match="once each"):
            rewrite(text, "NEW")


def test_the_question_after_usage_example_runs_the_tables_pick():
    text = README.read_text(encoding="utf-8")
    line = re.search(r"evaluation\.run press=(\w+) dataset=needle compression_ratio=([\d.]+) .*# question after", text)
    assert line, "the usage example with the question after compression is gone"
    rows = read_rows(ROOT / "results" / "tables" / "needle__smollm2-135m__cost.csv")
    kvzip = next(
        float(r["prefill_cost"]) for r in rows if r["press"] == "kvzip" and float(r["ratio"]) == float(line[2])
    )
    assert best_press(rows, float(line[2]), KVZIP_SLACK * kvzip)["press"] == line[1]
