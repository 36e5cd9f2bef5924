"""Choose Page-EntroKV's defaults on a development split, with the win score against kvpress's presses.

Usage (``python -m evaluation.studies.tune_page_entrokv`` is the same)::

    python scripts/tune_page_entrokv.py --stage A --shard 0/2 &   # both shards of a stage, then ...
    python scripts/tune_page_entrokv.py --stage A --shard 1/2
    python scripts/tune_page_entrokv.py --stage B --shard 0/2 &   # stage B varies around stage A's best
    python scripts/tune_page_entrokv.py --stage B --shard 1/2
    python scripts/tune_page_entrokv.py --report                  # results/tuning/page_entrokv/

The split (issue 14): needle 2k (20 examples, 4 per depth) and RULER 2k (11 tasks x 2) generated from seed 7 (the
committed results use seed 42; nothing here reads them), in both protocols (question after compression, question
inside the compressed context), at compression ratios 0.5 and 0.75. Runs go through the harness's shared-prefill
loop into ``runs/tuning`` (resumable; not committed).

Search space. Stage A: the policy options of paper 000 (docs/methods.md §1.11) at page size 16 and tau 0.5:
``observer_window`` in {None (the last 64 queries), 256, "all"} x ``protect`` in {sink_window, none} x
``group_selection`` in {group, union}. Stage B: one change at a time around stage A's best: page size 8 or 32, tau
0.25 or 1.0, ``max_fallback`` 0.05.

Objective: for each candidate and cell (dataset x protocol x ratio), its win score (paper 003 section 7) among
itself and kvpress's SnapKV, TOVA, StreamingLLM, KNorm and ExpectedAttention, on the same examples; the mean over
the eight cells; ties broken by the mean score. A candidate that keeps more than the budget in some cell (paper
000's per-layer union keeps the union of the groups' selections) ranks after every candidate that keeps to it and is
never chosen: its wins would be bought with a larger cache. Every candidate and its scores are written to
``results/tuning/page_entrokv/`` with the chosen one.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

from evaluation.cli import ArgumentParser

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from evaluation import harness, tables
from evaluation.loop import evaluate
from evaluation.metrics import win_scores
from evaluation.predictions import rows_files
from evaluation.studies import REPO

SEED = 7
RATIOS = (0.5, 0.75)
BASELINES = ("snapkv", "tova", "streaming_llm", "knorm", "expected_attention")
#: (dataset config, Hydra overrides of the split)
SPLITS = {
    "needle": ["dataset=needle", "n_samples=20"],
    "ruler": ["dataset=ruler", "dataset.context_lengths=[2048]", "n_samples=2", "dataset.num_samples=2"],
}
PROTOCOLS = {"question_after": False, "question_inside": True}
OUT = REPO / "results" / "tuning" / "page_entrokv"
#: a candidate keeps to the budget when its effective compression is at least the ratio minus this (a page's
#: rounding: 16 tokens of a 2k prompt are 0.008)
BUDGET_TOLERANCE = 0.01
RUNS = REPO / "runs" / "tuning"


#: the search's base, fixed here (not read from configs/press/page_entrokv.yaml, which holds the chosen values):
#: a candidate's unset page_size, tau and max_fallback take these
BASE = {"page_size": 16, "tau": 0.5, "max_fallback": None}


def stage_a() -> list[dict]:
    """The policy options of paper 000 at page size 16, tau 0.5 (12 candidates)."""
    return [
        {"observer_window": w, "protect": p, "group_selection": g}
        for w, p, g in itertools.product([None, 256, "all"], ["sink_window", "none"], ["group", "union"])
    ]


def stage_b(best: dict) -> list[dict]:
    """One change at a time around ``best`` (5 candidates)."""
    return [
        {**best, "page_size": 8},
        {**best, "page_size": 32},
        {**best, "tau": 0.25},
        {**best, "tau": 1.0},
        {**best, "max_fallback": 0.05},
    ]


def label(candidate: dict) -> str:
    """A short, stable run name of a candidate (its run directory under ``runs/tuning``)."""
    short = {
        "observer_window": "ow",
        "protect": "pr",
        "group_selection": "gs",
        "page_size": "ps",
        "tau": "tau",
        "max_fallback": "mf",
    }
    value = {None: "def", "sink_window": "sw", "none": "no", "group": "grp", "union": "uni"}
    parts = [f"{short[k]}{value.get(v, v)}" for k, v in candidate.items()]
    return "pe_" + "_".join(str(p) for p in parts)


def _override(value) -> str:
    return "null" if value is None else str(value)


def runs_for(dataset: str, protocol: str, candidates: list[dict], shard: str | None) -> list:
    """Harness configs of the candidates (as labelled variants of ``page_entrokv``) and the baselines."""
    base = [
        *SPLITS[dataset],
        f"seed={SEED}",
        f"query_aware={str(PROTOCOLS[protocol]).lower()}",
        f"output_dir={RUNS}",
    ] + ([f"shard={shard}"] if shard else [])
    runs = []
    for ratio in RATIOS:
        for cand in candidates:
            cfg = harness.compose_config(
                [
                    *base,
                    "press=page_entrokv",
                    f"compression_ratio={ratio}",
                    *[f"press.{k}={_override(v)}" for k, v in {**BASE, **cand}.items()],
                ]
            )
            runs.append(
                (cfg, {"press": "page_entrokv", "run_name": label(cand), "dataset": dataset, "model": "smollm2-135m"})
            )
        for press in BASELINES:
            cfg = harness.compose_config([*base, f"press={press}", f"compression_ratio={ratio}"])
            runs.append((cfg, {"press": press, "dataset": dataset, "model": "smollm2-135m"}))
    return runs


def rows_of(dataset: str, protocol: str, name: str, ratio: float) -> list[dict]:
    """All rows of one run (merging shards)."""
    d = RUNS / (dataset + ("-qa" if PROTOCOLS[protocol] else "")) / "smollm2-135m" / name / f"cr{ratio:g}"
    rows = {}
    for path in rows_files(d):  # either form (evaluation.predictions)
        for r in harness.read_predictions(path):
            rows[r["id"]] = r
    return list(rows.values())


def score_candidates(candidates: list[dict]) -> list[dict]:
    """One record per candidate and cell with its win score against the baselines and its mean score."""
    out = []
    for cand in candidates:
        name = label(cand)
        for dataset, protocol, ratio in itertools.product(SPLITS, PROTOCOLS, RATIOS):
            runs = {m: {r["id"]: r for r in rows_of(dataset, protocol, m, ratio)} for m in (name, *BASELINES)}
            ids = sorted(set.intersection(*(set(v) for v in runs.values())))
            if not ids:
                continue
            per_task: dict = {}
            for i in ids:
                task = runs[name][i]["task"]
                for m in runs:
                    per_task.setdefault(task, {}).setdefault(m, []).append(runs[m][i]["score"])
            out.append(
                {
                    "candidate": name,
                    **{
                        k: _override(cand.get(k))
                        for k in ("observer_window", "protect", "group_selection", "page_size", "tau", "max_fallback")
                    },
                    "dataset": dataset,
                    "protocol": protocol,
                    "ratio": ratio,
                    "n": len(ids),
                    "win_score": win_scores(per_task)[name],
                    "score": sum(runs[name][i]["score"] for i in ids) / len(ids),
                    "effective_compression": sum(runs[name][i]["effective_compression"] for i in ids) / len(ids),
                }
            )
    return out


def ranking(records: list[dict]) -> list[dict]:
    """Candidates ranked by mean win score over the cells (ties: mean score); a candidate that keeps more than the
    budget in some cell (measured effective compression below the ratio by more than ``BUDGET_TOLERANCE``, as
    paper 000's per-layer union does) ranks after every candidate that keeps to it, since its wins against the
    baselines are bought with a larger cache."""
    by = {}
    for r in records:
        by.setdefault(r["candidate"], []).append(r)
    full_n = {}  # the examples a cell has when every run of it is complete
    for r in records:
        key = (r["dataset"], r["protocol"], r["ratio"])
        full_n[key] = max(full_n.get(key, 0), r["n"])
    expected = len(SPLITS) * len(PROTOCOLS) * len(RATIOS)
    ranked = [
        {
            "candidate": c,
            "cells": len(v),
            "win_score": sum(r["win_score"] for r in v) / len(v),
            "score": sum(r["score"] for r in v) / len(v),
            "within_budget": all(r["effective_compression"] >= r["ratio"] - BUDGET_TOLERANCE for r in v),
            "complete": len(v) == expected
            and all(r["n"] == full_n[(r["dataset"], r["protocol"], r["ratio"])] for r in v),
            **{
                k: v[0][k]
                for k in ("observer_window", "protect", "group_selection", "page_size", "tau", "max_fallback")
            },
        }
        for c, v in by.items()
    ]
    return sorted(
        ranked, key=lambda r: (not r["complete"], not r["within_budget"], -r["win_score"], -r["score"], r["candidate"])
    )


def candidate_of(record: dict) -> dict:
    """The option dict of a ranked record (inverse of the ``None`` -> ``"null"`` rendering)."""

    def parse(v):
        if v == "null":
            return None
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v

    return {
        k: parse(record[k])
        for k in ("observer_window", "protect", "group_selection", "page_size", "tau", "max_fallback")
        if record[k] != "null" or k == "observer_window"
    }


def run_stage(stage: str, shard: str | None) -> None:
    candidates = stage_a()
    if stage == "B":
        best = candidate_of(ranking(score_candidates(stage_a()))[0])
        candidates = stage_b(best)
    for dataset, protocol in itertools.product(SPLITS, PROTOCOLS):
        runs = runs_for(dataset, protocol, candidates, shard)
        evaluate(runs, tables.command("tune_page_entrokv", sys.argv[1:]), shared_prefill=True)


def report() -> None:
    """Write the search space, every candidate's cells, the ranking and the chosen defaults."""
    cands = stage_a()
    best_a = candidate_of(ranking(score_candidates(cands))[0])
    cands = cands + stage_b(best_a)
    records = score_candidates(cands)
    ranked = ranking(records)
    OUT.mkdir(parents=True, exist_ok=True)
    for path, rows in ((OUT / "dev_cells.csv", records), (OUT / "dev_ranking.csv", ranked)):
        cells = [{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
        tables.write_rows(path, cells, list(rows[0]))
    chosen = ranked[0]
    expected = len(SPLITS) * len(PROTOCOLS) * len(RATIOS)
    scored = {r["candidate"]: r["cells"] for r in ranked}
    complete = {r["candidate"] for r in ranked if r["complete"]}
    missing = [label(c) for c in cands if label(c) not in complete]
    if missing:  # a partial search chooses nothing: chosen.json is written only once every candidate has run
        (OUT / "chosen.json").unlink(missing_ok=True)
    else:
        harness.write_atomic(OUT / "chosen.json", json.dumps(candidate_of(chosen), indent=2) + "\n")
    lines = [
        "# Page-EntroKV defaults chosen on a development split",
        "",
        "Written by `python scripts/tune_page_entrokv.py --report` (never edited by hand); the stages ran with "
        "`--stage A --shard {0,1}/2` then `--stage B --shard {0,1}/2`. See the script's docstring.",
        "",
        f"- **Split**: needle 2k (20 examples) and RULER 2k (11 tasks x 2), generated from seed {SEED}; the "
        "committed grids use seed 42 and were not read. Both protocols; ratios " + ", ".join(map(str, RATIOS)) + ".",
        "- **Objective**: per cell (dataset x protocol x ratio), the candidate's win score among itself and "
        + ", ".join(BASELINES)
        + " (paper 003 section 7); the mean over the cells; ties: mean score.",
        f"- **Search space**: stage A = {len(stage_a())} candidates (observer_window x protect x "
        "group_selection at page_size 16, tau 0.5); stage B = 5 one-at-a-time changes around stage A's best "
        f"({label(best_a)}).",
        "",
        f"**{'Leader so far (search incomplete; nothing chosen)' if missing else 'Chosen'}**: "
        f"`{chosen['candidate']}` — "
        + ", ".join(
            f"{k}={chosen[k]}"
            for k in ("observer_window", "protect", "group_selection", "page_size", "tau", "max_fallback")
        )
        + f" (mean win score {chosen['win_score']:.3f}, mean score {chosen['score']:.3f}).",
        "",
        "## Every candidate (mean over the cells)",
        "",
        "Candidates that keep more than the budget in some cell (effective compression below the ratio by more "
        f"than {BUDGET_TOLERANCE}: the per-layer union of paper 000) rank after all others and are not chosen. "
        "`null` in page_size, tau, max_fallback: the search's base (16, 0.5, off), which was also the config's default "
        "before this search.",
        "",
        "| rank | candidate | observer_window | protect | group_selection | page_size | tau | max_fallback | "
        "cells | complete | within budget | win score | score |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(ranked, 1):
        lines.append(
            f"| {i} | {r['candidate']} | {r['observer_window']} | {r['protect']} | {r['group_selection']} | "
            f"{r['page_size']} | {r['tau']} | {r['max_fallback']} | {r['cells']} | "
            f"{'yes' if r['complete'] else 'no'} | "
            f"{'yes' if r['within_budget'] else 'no'} | {r['win_score']:.3f} | "
            f"{r['score']:.3f} |"
        )
    lines += [
        "",
        "## Cells of the chosen candidate and of our previous default",
        "",
        "| candidate | dataset | protocol | ratio | n | win score | score | effective compression |",
        "|---|---|---|---|---|---|---|---|",
    ]
    previous = label(stage_a()[0])
    for r in records:
        if r["candidate"] in (chosen["candidate"], previous):
            lines.append(
                f"| {r['candidate']} | {r['dataset']} | {r['protocol']} | {r['ratio']} | {r['n']} | "
                f"{r['win_score']:.3f} | {r['score']:.3f} | {r['effective_compression']:.3f} |"
            )
    if missing:
        lines += [
            "",
            f"**Not (fully) run yet** (fewer than {expected} cells, or cells with fewer examples than "
            "the others; resume with `--stage A|B`; they rank after every complete candidate): "
            + ", ".join(f"`{m}` ({scored.get(m, 0)} cells)" for m in missing)
            + ".",
        ]
    lines += ["", "All cells of all candidates: `dev_cells.csv`; the ranking: `dev_ranking.csv`.", ""]
    harness.write_atomic(OUT / "README.md", "\n".join(lines))
    print("\n".join(lines))


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["A", "B"])
    p.add_argument("--shard", default=None, help="i/n: this process's share of the examples")
    p.add_argument("--report", action="store_true")
    args = p.parse_args(argv)
    if args.report:
        report()
    elif args.stage:
        run_stage(args.stage, args.shard)
    else:
        p.error("give --stage A|B or --report")


if __name__ == "__main__":
    main()
