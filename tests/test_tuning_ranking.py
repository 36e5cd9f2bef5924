"""The Page-EntroKV search's ranking (:mod:`evaluation.studies.tune_page_entrokv`): over-budget and incomplete
candidates never lead (issue 14)."""

from __future__ import annotations

import itertools

from evaluation.studies import tune_page_entrokv


def _records(mod, name, win, eff_delta=0.0, n=20, cells=None):
    out = []
    for dataset, protocol, ratio in itertools.islice(itertools.product(mod.SPLITS, mod.PROTOCOLS, mod.RATIOS), cells):
        out.append(
            {
                "candidate": name,
                "observer_window": "null",
                "protect": "sink_window",
                "group_selection": "group",
                "page_size": "null",
                "tau": "null",
                "max_fallback": "null",
                "dataset": dataset,
                "protocol": protocol,
                "ratio": ratio,
                "n": n,
                "win_score": win,
                "score": win / 2,
                "effective_compression": ratio + eff_delta,
            }
        )
    return out


def test_over_budget_and_incomplete_candidates_rank_last():
    mod = tune_page_entrokv
    records = (
        _records(mod, "fair", 0.90)
        + _records(mod, "fair_low", 0.80)
        + _records(mod, "union", 0.99, eff_delta=-0.16)  # keeps more than the budget
        + _records(mod, "partial", 1.00, cells=4)  # half the cells
        + _records(mod, "few", 1.00, n=2)
    )  # every cell, but 2 examples each
    ranked = mod.ranking(records)
    assert [r["candidate"] for r in ranked] == ["fair", "fair_low", "union", "few", "partial"]
    flags = {r["candidate"]: (r["complete"], r["within_budget"]) for r in ranked}
    assert flags == {
        "fair": (True, True),
        "fair_low": (True, True),
        "union": (True, False),
        "few": (False, True),
        "partial": (False, True),
    }
    # a page's rounding (0.008 of a 2k prompt) stays within budget
    assert mod.ranking(_records(mod, "rounded", 0.9, eff_delta=-0.008))[0]["within_budget"]


def test_learned_search_ranks_complete_candidates_first_and_builds_each_candidate():
    """The search on KVzap's learned scores (:mod:`evaluation.studies.tune_learned`): every candidate builds the press
    it names, with its overrides; an incomplete candidate never leads, and the best mean win score does."""
    from hydra.utils import instantiate

    from evaluation.studies import tune_learned as tl

    runs = tl.runs_for("needle")
    per_ratio = sum(len(c) for c in tl.CANDIDATES.values()) + len(tl.BASELINES)
    assert len(runs) == per_ratio * len(tl.RATIOS)
    labels = [names.get("run_name", names["press"]) for _, names in runs]
    assert len(set(labels)) == per_ratio  # one name per candidate, the same at every ratio
    for cfg, names in runs[:per_ratio]:
        press = instantiate(cfg.press)
        cand = next((c for p, cs in tl.CANDIDATES.items() for c in cs if tl.label(p, c) == names.get("run_name")), {})
        assert all(getattr(press, k) == v for k, v in cand.items()), (names, press)

    def cells(name, win, count):
        out = []
        for dataset, ratio in itertools.islice(itertools.product(tl.SPLITS, tl.RATIOS), count):
            out.append(
                {
                    "press": "kvzap_page",
                    "candidate": name,
                    **{k: "" for k in tl._SHORT},
                    "dataset": dataset,
                    "ratio": ratio,
                    "n": 20,
                    "win_score": win,
                    "score": win / 2,
                    "effective_compression": ratio,
                }
            )
        return out

    full = len(tl.SPLITS) * len(tl.RATIOS)
    records = cells("a", 0.5, full) + cells("b", 0.9, full - 1) + cells("c", 0.7, full)
    assert [r["candidate"] for r in tl.ranking(records, "kvzap_page")] == ["c", "a", "b"]
