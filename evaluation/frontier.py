"""Quality against cost: each press's score beside its prefill cost, and the presses on the frontier.

At one compression ratio every press holds the same share of the cache, so what separates them is the answer
quality and what the compression costs. The cost is the prefill time with the press (compression included: KVzip's
reconstruction pass, EntroPrefill's pruned layers) over the uncompressed prefill of the same context, measured
either in one speed sweep (:func:`read_costs`: ``python -m evaluation.studies.bench_speed_memory``, column
``prefill_ratio_vs_full``; one thread setting for every press) or by the runs themselves (:func:`run_costs`: the
rows of ``python -m evaluation.fused`` record the shared uncompressed prefill and each press's replay on it). A press
is on the frontier when no other press at that ratio scores at least as much at no more cost, one of the two
strictly (a Pareto frontier; the uncompressed model, which holds the whole cache, is drawn for reference and never
on it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from evaluation.tables import read_rows

__all__ = ["COST_COLUMN", "cost_table", "frontier_rows", "read_costs", "run_costs"]

#: The speed sweep's column this module reads: prefill time with the press over the uncompressed prefill.
COST_COLUMN = "prefill_ratio_vs_full"

#: The fields of a shared-prefill row (:mod:`evaluation.loop`) that :func:`run_costs` reads, seconds: the example's
#: uncompressed prefill, and the press's replay on it (its scoring and compression; KVzip's whole scoring pass).
RUN_COST_FIELDS = ("prefill_seconds", "replay_seconds")


def read_costs(path: Path) -> list[dict]:
    """The measured rows of a speed sweep's csv (rows with an error left out); ``[]`` when the file is missing."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for row in read_rows(path):
        if row.get("error"):
            continue
        try:
            cost = float(row[COST_COLUMN])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(cost):
            rows.append({**row, COST_COLUMN: cost, "T": int(float(row["T"]))})
    return rows


def run_costs(runs: Iterable[tuple[str, str, float, list[dict]]]) -> list[dict]:
    """Each run's prefill cost from its own rows, in :func:`read_costs`'s form.

    The cost of a run is (mean prefill + mean replay) / mean prefill over its rows that carry both
    :data:`RUN_COST_FIELDS` (the press's prefill, compression included, over the uncompressed prefill of the same
    examples, on the machine and the threads the run had); ``repeats`` is the number of rows (examples) it averages,
    ``T`` their mean ``context_length`` (tokens). Within an example, what a press reuses from an earlier press's replay
    (the sweep's memo: proposals, observer attention) is charged to the earlier one.

    Args:
        runs: ``(model, press, ratio, rows)`` per run.

    Returns:
        Rows ``model, press, compression_ratio, T, repeats, prefill_s, replay_s`` and :data:`COST_COLUMN`; none for a
        run without such rows (``evaluation.run``'s rows: its prefill is not apart from the compression) or with a
        zero prefill.
    """
    out = []
    for model, press, ratio, rows in runs:
        timed = [r for r in rows if all(isinstance(r.get(k), (int, float)) for k in RUN_COST_FIELDS)]
        if not timed:
            continue
        prefill, replay = (sum(float(r[k]) for r in timed) / len(timed) for k in RUN_COST_FIELDS)
        if prefill <= 0:
            continue
        lengths = [r["context_length"] for r in timed if r.get("context_length")]
        out.append(
            {
                "model": model,
                "press": press,
                "compression_ratio": float(ratio),
                "T": round(sum(lengths) / len(lengths)) if lengths else 0,
                "repeats": len(timed),
                "prefill_s": prefill,
                "replay_s": replay,
                COST_COLUMN: (prefill + replay) / prefill,
            }
        )
    return out


def _repeats(row: dict) -> int | None:
    """The measurements a cost row averages (a speed sweep's ``repeats``, :func:`run_costs`'s examples), or None."""
    try:
        return int(float(row["repeats"]))
    except (KeyError, TypeError, ValueError):
        return None


def _cost_of(
    costs: list[dict], model: str, press: str, ratio: float, length: float | None
) -> tuple[float | None, int | None, int | None]:
    """The cost of ``press`` at ``ratio`` on ``model``, the sweep length ``T`` (tokens) it was measured at, the one
    closest to ``length``, and the measurements it averages; ``(None, None, None)`` when the sweep has no such
    row."""
    found = [
        r
        for r in costs
        if r.get("model") == model and r.get("press") == press and abs(float(r["compression_ratio"]) - ratio) < 1e-9
    ]
    if not found:
        return None, None, None
    if length is not None:
        found.sort(key=lambda r: abs(r["T"] - length))
    return found[0][COST_COLUMN], found[0]["T"], _repeats(found[0])


def frontier_rows(points: list[dict]) -> list[dict]:
    """Mark each point ``{"press", "score", "cost"}`` with ``on_frontier`` (see the module docstring).

    Points without a cost are kept with ``on_frontier=False``.
    """
    out = []
    for p in points:
        on = p["cost"] is not None and not any(
            q is not p
            and q["cost"] is not None
            and q["score"] >= p["score"]
            and q["cost"] <= p["cost"]
            and (q["score"] > p["score"] or q["cost"] < p["cost"])
            for q in points
        )
        out.append({**p, "on_frontier": on})
    return out


def cost_table(summary: list[dict], costs: list[dict], model: str, length: float | None, baseline: str) -> list[dict]:
    """Per ratio and press: score, interval, prefill cost and whether the press is on that ratio's frontier.

    Args:
        summary: the report's summary rows of one dataset and model (``press``, ``ratio``, ``score``, ``low``,
            ``high``, ``n``).
        costs: :func:`read_costs` or :func:`run_costs` rows.
        model: the model name the runs used.
        length: the runs' mean context length in tokens (the cost measured nearest to it is used), or None.
        baseline: the uncompressed press's name (its rows are kept, cost 1 by definition, never on the frontier).

    Returns:
        Rows ``ratio, press, n, score, low, high, prefill_cost, cost_length, cost_repeats, on_frontier``, sorted by
        ratio then cost (``cost_length``: the sweep's ``T`` the cost was measured at, tokens; ``cost_repeats``: the
        measurements the cost averages; both empty for the baseline and for a press without a cost); ``[]`` when no
        press of the summary has a measured cost.
    """
    rows = []
    base = [r for r in summary if r["press"] == baseline]
    for ratio in sorted({r["ratio"] for r in summary if r["press"] != baseline}):
        points = [
            {
                **r,
                **dict(zip(("cost", "cost_length", "cost_repeats"), _cost_of(costs, model, r["press"], ratio, length))),
            }
            for r in summary
            if r["ratio"] == ratio and r["press"] != baseline
        ]
        if not any(p["cost"] is not None for p in points):
            continue
        marked = frontier_rows(points)
        marked += [{**b, "ratio": ratio, "cost": 1.0, "on_frontier": False} for b in base]
        for p in sorted(marked, key=lambda p: (math.inf if p["cost"] is None else p["cost"], p["press"])):
            rows.append(
                {
                    "ratio": ratio,
                    "press": p["press"],
                    "n": p.get("n"),
                    "score": p["score"],
                    "low": p.get("low"),
                    "high": p.get("high"),
                    "prefill_cost": p["cost"],
                    "cost_length": p.get("cost_length"),
                    "cost_repeats": p.get("cost_repeats"),
                    "on_frontier": p["on_frontier"],
                }
            )
    return rows
