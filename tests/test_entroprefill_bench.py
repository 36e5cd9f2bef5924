"""The Finch comparison of the EntroPrefill bench (issue 30.3): where the answer value is, the per-length table."""

import math

import pytest
import torch

from evaluation.studies.entroprefill_bench import answer_positions, finch_table


def test_answer_positions_finds_the_last_occurrence_or_nothing():
    ids = torch.tensor([5, 1, 2, 3, 9, 1, 2, 3, 7])
    assert answer_positions(ids, [1, 2, 3]) == [5, 6, 7]
    assert answer_positions(ids, [2, 9]) == []
    assert answer_positions(ids, []) == []
    assert answer_positions(ids, [7]) == [8]


def _row(i, method, **kw):
    base = {"id": f"e{i}", "method": method, "target_length": 2048, "prefill_s": 1.0, "prefill_cpu_s": 1.0, "score": 1}
    return {**base, **kw}


def test_finch_table_compares_the_examples_all_three_ran():
    rows = [
        _row(0, "full", prefill_s=2.0, prefill_cpu_s=4.0),
        _row(0, "entroprefill", prefill_s=1.5, prefill_cpu_s=3.0, answer_removed=0),
        _row(0, "finch", prefill_s=1.9, prefill_cpu_s=3.8, score=0, finch_ratio=0.4, answer_value_kept=0.5),
        _row(1, "full", prefill_s=2.0, prefill_cpu_s=4.0),
        _row(1, "entroprefill", prefill_s=1.5, prefill_cpu_s=3.0, answer_removed=1, score=0),
        _row(1, "finch", prefill_s=1.9, prefill_cpu_s=3.8, finch_ratio=0.6, answer_value_kept=math.nan),
        _row(2, "full"),  # no finch row: left out
    ]
    (t,) = finch_table(rows, [2048, 4096], "entroprefill")
    assert t["n"] == 2 and t["mean_finch_ratio"] == pytest.approx(0.5)
    assert t["time_ratio_finch"] == pytest.approx(0.95) and t["time_ratio_entroprefill"] == pytest.approx(0.75)
    assert t["cpu_time_ratio_finch"] == pytest.approx(0.95)
    assert (t["acc_full"], t["acc_entroprefill"], t["acc_finch"]) == (1, 0.5, 0.5)
    assert t["answer_value_kept"] == 0.5  # the NaN (value not found) left out
    assert t["answer_passage_kept_entroprefill"] == 0.5
