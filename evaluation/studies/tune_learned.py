"""Choose the defaults of this project's presses on KVzap's learned scores on a development split (issue 64 item 2).

Usage (``python -m evaluation.studies.tune_learned`` is the same)::

    python scripts/tune_learned.py --run needle [--shard 0/2]    # then needle_docs, ruler (each resumable)
    python scripts/tune_learned.py --report                      # results/tuning/learned/

The split: needle 2k (20 examples, 4 per depth) on the generated prose, the needle in CPython's documentation
(``dataset=needle_docs dataset.split=dev``: the development topics, 20 examples) and RULER 2k (11 tasks x 2), all
generated from seed 7 (the committed grids use seed 42 and the documentation's test topics; nothing here reads them),
question after compression (the protocol the learned scores are for: KVzap scores without the question), at
compression ratios 0.5, 0.75 and 0.9. Runs go through the harness's shared-prefill loop into ``runs/tuning_learned``
(resumable; not committed): one prefill per example for every candidate and ratio, and one KVzap scoring per layer
(the sweep's memo).

Search space (every configuration tried, listed in the report):

- ``kvzap_page`` (:class:`presses.ScorerPagePress` on the linear surrogate): ``page_score`` in {block_max, halo_max,
  mean} x ``group_selection`` in {group, shared} x ``protect`` in {sink_window, none}, pages of 32 (12 candidates);
- ``snis_kvzap_page`` / ``snis_kvzap_token`` (probabilistic eviction with KVzap's scores as the proposal,
  ``pi ~ exp(score / T)``): the unit in {page, token} x ``proposal_temperature`` T in {0.5, 1, 2} (6 candidates).

Objective: per cell (dataset x ratio), the candidate's win score (paper 003 section 7) among every candidate of its
press and the kvpress presses on the same scores, ``kvzap_linear`` (KVzap's top-k per head) and ``chunkkv_kvzap``
(ChunkKV's chunks of them); the mean over the cells; ties: mean score. Each press's chosen candidate becomes its
class's (``ScorerPagePress``) or config's (``snis_kvzap_*``) defaults.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from evaluation import harness, tables
from evaluation.cli import ArgumentParser
from evaluation.loop import evaluate
from evaluation.metrics import win_scores
from evaluation.predictions import rows_files
from evaluation.studies import REPO

__all__ = ["CANDIDATES", "SPLITS", "RATIOS", "label", "runs_for", "score_cells", "ranking", "report", "main"]

SEED = 7
RATIOS = (0.5, 0.75, 0.9)
#: dataset name (its run directory) -> Hydra overrides of its development split
SPLITS = {
    "needle": ["dataset=needle", "n_samples=20"],
    "needle_docs": ["dataset=needle_docs", "dataset.split=dev", "n_samples=20"],
    "ruler": ["dataset=ruler", "dataset.context_lengths=[2048]", "n_samples=2", "dataset.num_samples=2"],
}
#: the kvpress presses on the same learned scores every cell compares with
BASELINES = ("kvzap_linear", "chunkkv_kvzap")
#: press config -> its candidates (field overrides of that config)
CANDIDATES = {
    "kvzap_page": [
        {"page_score": s, "group_selection": g, "protect": p}
        for s, g, p in itertools.product(
            ["block_max", "halo_max", "mean"], ["group", "shared"], ["sink_window", "none"]
        )
    ],
    "snis_kvzap_page": [
        {"unit": u, "proposal_temperature": t} for u, t in itertools.product(["page", "token"], [0.5, 1.0, 2.0])
    ],
}
RUNS = REPO / "runs" / "tuning_learned"
OUT = REPO / "results" / "tuning" / "learned"
_SHORT = {
    "page_score": "ps",
    "group_selection": "gs",
    "protect": "pr",
    "unit": "u",
    "proposal_temperature": "T",
}
_VALUES = {
    "block_max": "bmax",
    "halo_max": "halo",
    "mean": "mean",
    "group": "grp",
    "shared": "shr",
    "sink_window": "sw",
    "none": "no",
    "page": "pg",
    "token": "tok",
}


def label(press: str, candidate: dict) -> str:
    """A short, stable run name of a candidate (its run directory), e.g. ``kvzap_page_psbmax_gsgrp_prsw``."""
    return "_".join([press, *(f"{_SHORT[k]}{_VALUES.get(v, v)}" for k, v in candidate.items())])


def runs_for(dataset: str, shard: str | None = None) -> list:
    """Harness configs of every candidate (labelled variants of its press config) and the baselines, on the split of
    ``dataset``, at every ratio."""
    base = [*SPLITS[dataset], f"seed={SEED}", f"output_dir={RUNS}", *([f"shard={shard}"] if shard else [])]
    names = {"dataset": dataset, "model": "smollm2-135m"}
    runs = []
    for ratio in RATIOS:
        for press, candidates in CANDIDATES.items():
            for cand in candidates:
                overrides = [f"++press.{k}={v}" for k, v in cand.items()]
                cfg = harness.compose_config([*base, f"press={press}", f"compression_ratio={ratio}", *overrides])
                runs.append((cfg, {**names, "press": press, "run_name": label(press, cand)}))
        for press in BASELINES:
            cfg = harness.compose_config([*base, f"press={press}", f"compression_ratio={ratio}"])
            runs.append((cfg, {**names, "press": press}))
    return runs


def _rows(dataset: str, name: str, ratio: float) -> dict:
    """The rows of one run by example id (shards merged)."""
    out = {}
    for path in rows_files(RUNS / dataset / "smollm2-135m" / name / f"cr{ratio:g}"):
        out.update({r["id"]: r for r in harness.read_predictions(path)})
    return out


def score_cells() -> list[dict]:
    """One record per (press, candidate, dataset, ratio): n, win score among the press's candidates and the
    baselines on the examples every one of them holds, mean score and effective compression; the baselines too."""
    out = []
    for press, candidates in CANDIDATES.items():
        names = [label(press, c) for c in candidates]
        for dataset, ratio in itertools.product(SPLITS, RATIOS):
            runs = {m: _rows(dataset, m, ratio) for m in (*names, *BASELINES)}
            ids = sorted(set.intersection(*(set(v) for v in runs.values())))
            if not ids:
                continue
            per_task: dict = {}
            for i in ids:
                for m, rows in runs.items():
                    per_task.setdefault(rows[i]["task"], {}).setdefault(m, []).append(rows[i]["score"])
            wins = win_scores(per_task)
            for m, rows in runs.items():
                cand = candidates[names.index(m)] if m in names else {}
                out.append(
                    {
                        "press": press if m in names else m,
                        "candidate": m,
                        **{k: cand.get(k, "") for k in _SHORT},
                        "dataset": dataset,
                        "ratio": ratio,
                        "n": len(ids),
                        "win_score": wins[m],
                        "score": sum(rows[i]["score"] for i in ids) / len(ids),
                        "effective_compression": sum(rows[i]["effective_compression"] for i in ids) / len(ids),
                    }
                )
    return out


def ranking(records: list[dict], press: str) -> list[dict]:
    """The candidates of ``press`` ranked by mean win score over the cells (ties: mean score, then name); a
    candidate with fewer cells than the most complete one ranks after every complete one."""
    by: dict = {}
    for r in records:
        if r["press"] == press:
            by.setdefault(r["candidate"], []).append(r)
    most = max((len(v) for v in by.values()), default=0)
    ranked = [
        {
            "candidate": c,
            **{k: v[0][k] for k in _SHORT},
            "cells": len(v),
            "complete": len(v) == most == len(SPLITS) * len(RATIOS),
            "win_score": sum(r["win_score"] for r in v) / len(v),
            "score": sum(r["score"] for r in v) / len(v),
        }
        for c, v in by.items()
    ]
    return sorted(ranked, key=lambda r: (not r["complete"], -r["win_score"], -r["score"], r["candidate"]))


def report() -> str:
    """Write ``dev_cells.csv``, ``chosen.json`` (once every candidate is complete) and ``README.md`` to
    ``results/tuning/learned/``; returns the README's text."""
    records = score_cells()
    OUT.mkdir(parents=True, exist_ok=True)
    if records:
        cells = [{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()} for r in records]
        tables.write_rows(OUT / "dev_cells.csv", cells, list(records[0]))
    lines = [
        "# Defaults of the presses on KVzap's learned scores, chosen on a development split",
        "",
        "Written by `python scripts/tune_learned.py --report` (never edited by hand) from the runs of "
        "`python scripts/tune_learned.py --run <needle|needle_docs|ruler>`; see the script's docstring for the split, "
        "the search space and the objective. Every cell of every candidate: `dev_cells.csv`.",
        "",
    ]
    chosen, complete = {}, True
    for press, candidates in CANDIDATES.items():
        ranked = ranking(records, press)
        complete &= bool(ranked) and all(r["complete"] for r in ranked) and len(ranked) == len(candidates)
        if ranked:
            best = ranked[0]
            chosen[press] = {k: best[k] for k in _SHORT if best[k] != ""}
        header = ["rank", "candidate", *[k for k in _SHORT if k in candidates[0]], "cells", "win score", "score"]
        rows = [
            [
                i,
                r["candidate"],
                *[r[k] for k in _SHORT if k in candidates[0]],
                r["cells"],
                f"{r['win_score']:.3f}",
                f"{r['score']:.3f}",
            ]
            for i, r in enumerate(ranked, 1)
        ]
        lines += [f"## `{press}`: {len(candidates)} candidates", "", *tables.markdown_table(header, rows), ""]
    lines += ["## Scores per cell (the leaders and the baselines)", ""]
    leaders = {ranking(records, p)[0]["candidate"] for p in CANDIDATES if ranking(records, p)}
    shown = [r for r in records if r["candidate"] in leaders or r["candidate"] in BASELINES]
    seen, rows = set(), []
    for r in shown:
        key = (r["candidate"], r["dataset"], r["ratio"])
        if key not in seen:
            seen.add(key)
            rows.append(
                [
                    r["candidate"],
                    r["dataset"],
                    r["ratio"],
                    r["n"],
                    f"{r['score']:.3f}",
                    f"{r['effective_compression']:.3f}",
                ]
            )
    lines += tables.markdown_table(["run", "dataset", "ratio", "n", "score", "effective compression"], sorted(rows))
    if complete:
        harness.write_atomic(OUT / "chosen.json", json.dumps(chosen, indent=2) + "\n")
        lines += ["", "**Chosen** (`chosen.json`): " + json.dumps(chosen), ""]
    else:
        (OUT / "chosen.json").unlink(missing_ok=True)
        lines += ["", "**Search incomplete: nothing chosen yet.**", ""]
    text = "\n".join(lines)
    harness.write_atomic(OUT / "README.md", text)
    return text


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", choices=list(SPLITS), help="run every candidate and baseline on this split")
    p.add_argument("--shard", default=None, help="i/n: this process's share of the examples")
    p.add_argument("--report", action="store_true", help="write results/tuning/learned/")
    args = p.parse_args(argv)
    if args.run:
        evaluate(runs_for(args.run, args.shard), tables.command("tune_learned", sys.argv[1:]), shared_prefill=True)
    elif args.report:
        print(report())
    else:
        p.error("give --run <split> or --report")


if __name__ == "__main__":
    main()
