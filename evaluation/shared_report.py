"""The report's view of the shared-context protocol (:mod:`evaluation.shared`): quality per question position, and
the cost per answered question, the context's compression paid once over K answers.

Rows of that protocol carry ``example_id``, ``question_index`` (1-based), ``question_kind``, the context's
``prefill_seconds`` (and ``replay_seconds`` from ``evaluation.fused``) and the answer's ``decode_seconds``. For
``k`` questions asked of a context (the first ``k`` of its K: in multi-request question j's answer does not depend
on the others, and a chat's first ``k`` turns are a chat of ``k`` turns), the cost per answer is

    (prefill_seconds + replay_seconds + sum_{j <= k} decode_seconds_j) / k,

averaged over the contexts, and the quality the mean score of those ``k`` questions. :func:`answer_cost_table` gives
both at ``k = 1`` (a context asked one question) and ``k = K`` (all of them), each press's cost also over the
uncompressed run's cost per answer at the same ``k`` (when the group has it), and per ratio and ``k`` the
presses on the quality-cost frontier (:func:`evaluation.frontier.frontier_rows`: no other press scores as much at no
more cost per answer).
"""

from __future__ import annotations

import math
from collections import defaultdict

from evaluation.frontier import frontier_rows
from evaluation.harness import BASELINE
from evaluation.metrics import score_interval, t_interval

__all__ = ["answer_cost_table", "drop_table", "has_questions", "position_table", "section"]


def has_questions(rows: list[dict]) -> bool:
    """Whether ``rows`` are the shared-context protocol's (every row has a ``question_index``)."""
    return bool(rows) and all("question_index" in r for r in rows)


def position_table(runs: list, confidence: float) -> list[dict]:
    """Per run (``press``, ``ratio``) and question position: ``n`` answers, the mean score with its interval
    (:func:`evaluation.metrics.score_interval`) and the question kinds asked there.

    Args:
        runs: the report's runs (``press``, ``ratio``, ``rows``); runs of other protocols are left out.
        confidence: the interval's level.
    """
    out = []
    for run in runs:
        if not has_questions(run.rows):
            continue
        by_position: dict[int, list[dict]] = defaultdict(list)
        for row in run.rows:
            by_position[int(row["question_index"])].append(row)
        for position, rows in sorted(by_position.items()):
            mean, low, high, method = score_interval([float(r["score"]) for r in rows], confidence)
            kinds = sorted({str(r.get("question_kind")) for r in rows})
            out.append(
                {
                    "press": run.press,
                    "ratio": run.ratio,
                    "question_index": position,
                    "kinds": "+".join(kinds),
                    "n": len(rows),
                    "score": mean,
                    "low": low,
                    "high": high,
                    "interval": method,
                }
            )
    return out


def drop_table(runs: list, confidence: float) -> list[dict]:
    """Per run (``press``, ``ratio``): how much the later questions lose against the first, context by context.

    For each context that has all its K >= 2 questions, ``d = score(q1) - mean(score(q2..qK))``; the row gives the
    mean of ``d`` over the contexts with its Student-t interval (:func:`evaluation.metrics.t_interval`). With the
    first question inside the compressed context (a ``-qa`` directory) this is what the press loses on the questions
    it never saw (issue 66's third goal); with every question after, the questions' own difficulty.

    Returns:
        Rows ``press, ratio, contexts, first, later, drop, low, high`` (``first`` and ``later``: the mean scores);
        ``[]`` for runs of other protocols or of one question.
    """
    out = []
    for run in runs:
        if not has_questions(run.rows):
            continue
        contexts: dict[str, dict[int, float]] = defaultdict(dict)
        for row in run.rows:
            contexts[row["example_id"]][int(row["question_index"])] = float(row["score"])
        K = max(int(r["questions"]) for r in run.rows)
        full = [c for c in contexts.values() if len(c) == K]
        if K < 2 or not full:
            continue
        firsts = [c[1] for c in full]
        laters = [sum(c[q] for q in range(2, K + 1)) / (K - 1) for c in full]
        drops = [f - later for f, later in zip(firsts, laters)]
        low, high = t_interval(drops, confidence)
        out.append(
            {
                "press": run.press,
                "ratio": run.ratio,
                "contexts": len(full),
                "first": sum(firsts) / len(full),
                "later": sum(laters) / len(full),
                "drop": sum(drops) / len(full),
                "low": low,
                "high": high,
            }
        )
    return sorted(out, key=lambda r: (r["press"] != BASELINE, r["ratio"], r["press"]))


def _per_answer(rows: list[dict], k: int) -> tuple[float, float, int] | None:
    """``(mean score, mean cost per answer in seconds, contexts)`` of the first ``k`` questions of every context of
    ``rows`` that has all of them timed; None when none has."""
    contexts: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        contexts[row["example_id"]].append(row)
    scores, costs = [], []
    for asked in contexts.values():
        first = sorted((r for r in asked if int(r["question_index"]) <= k), key=lambda r: int(r["question_index"]))
        if len(first) < k or not all(isinstance(r.get("decode_seconds"), (int, float)) for r in first):
            continue
        once = float(first[0]["prefill_seconds"]) + float(first[0].get("replay_seconds") or 0.0)
        costs.append((once + sum(float(r["decode_seconds"]) for r in first)) / k)
        scores += [float(r["score"]) for r in first]
    if not costs:
        return None
    return sum(scores) / len(scores), sum(costs) / len(costs), len(costs)


def answer_cost_table(runs: list) -> list[dict]:
    """Per ratio, ``k`` in {1, K} and press: the quality of the first ``k`` questions and the cost per answer (see
    the module docstring), the cost over the uncompressed run's at that ``k`` and whether the press is on the
    frontier of its ratio and ``k``.

    Returns:
        Rows ``ratio, k, press, contexts, score, seconds_per_answer, cost_vs_uncompressed, on_frontier`` sorted by
        ratio, ``k``, cost; ``[]`` for runs of other protocols.
    """
    runs = [run for run in runs if has_questions(run.rows)]
    if not runs:
        return []
    K = max(int(r["questions"]) for run in runs for r in run.rows)
    cells: dict[tuple[float, int], list[dict]] = defaultdict(list)
    base: dict[int, float] = {}
    for run in runs:
        for k in sorted({1, K}):
            got = _per_answer(run.rows, k)
            if got is None:
                continue
            score, seconds, contexts = got
            if run.press == BASELINE:
                base[k] = seconds
                continue
            cells[(run.ratio, k)].append(
                {"press": run.press, "score": score, "cost": seconds, "contexts": contexts, "ratio": run.ratio, "k": k}
            )
    out = []
    for (ratio, k), points in sorted(cells.items()):
        for p in sorted(frontier_rows(points), key=lambda p: (p["cost"], p["press"])):
            out.append(
                {
                    "ratio": ratio,
                    "k": k,
                    "press": p["press"],
                    "contexts": p["contexts"],
                    "score": p["score"],
                    "seconds_per_answer": p["cost"],
                    "cost_vs_uncompressed": p["cost"] / base[k] if base.get(k) else math.nan,
                    "on_frontier": p["on_frontier"],
                }
            )
    return out


def section(
    positions: list[dict], costs: list[dict], links: dict[str, str], pct: str, drops: list[dict] | None = None
) -> list[str]:
    """The README lines of the shared-context view: the score per question position (press @ ratio by position)
    and the cost per answer at ``k = 1`` and ``k = K`` with each ratio's frontier; ``links``: the csv paths
    (``positions``, ``costs``)."""
    if not positions:
        return []
    order = sorted({(r["ratio"], r["press"]) for r in positions}, key=lambda x: (x[1] != BASELINE, x[0], x[1]))
    columns = sorted({r["question_index"] for r in positions})
    cell = {(r["ratio"], r["press"], r["question_index"]): r for r in positions}
    kinds = {q: "+".join(sorted({r["kinds"] for r in positions if r["question_index"] == q})) for q in columns}
    header = ["press @ ratio", *[f"q{q} ({kinds[q]})" for q in columns]]
    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    for ratio, press in order:
        values = []
        for q in columns:
            r = cell.get((ratio, press, q))
            values.append("–" if r is None else f"{r['score']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")
        lines.append(f"| {press} @ {ratio:g} | " + " | ".join(values) + " |")
    md = [
        f"### Score per question position (mean over contexts, {pct} interval)",
        "",
        "One context compressed once and asked its questions in order (`evaluation/shared.py`): q1 is asked first "
        "(inside the compressed context in a `-qa` directory, the later ones after it); the kind of each position "
        "is in its header (`retrieve`: one key, fact or chain; `aggregate`: every needle, scored by recall).",
        "",
        *lines,
        "",
        f"Table: [{links['positions']}]({links['positions']})",
        "",
    ]
    if drops:
        md += [
            f"### The later questions against the first (mean over contexts, {pct} Student-t interval)",
            "",
            "Per context, q1's score minus the mean of the later questions' (`drop_table`); positive: the later "
            "questions lose. In a `-qa` directory q1 was inside the compressed context and the later ones were not.",
            "",
            "| press @ ratio | contexts | q1 | later | drop [interval] |",
            "| --- | --- | --- | --- | --- |",
            *[
                f"| {r['press']} @ {r['ratio']:g} | {r['contexts']} | {r['first']:.3f} | {r['later']:.3f} | "
                f"{r['drop']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] |"
                for r in drops
            ],
            "",
            f"Table: [{links['drops']}]({links['drops']})",
            "",
        ]
    if costs:
        md += [
            "### Cost per answered question",
            "",
            "The context's prefill and compression (`prefill_seconds` + `replay_seconds`) paid once over the k "
            "questions asked of it, plus each answer's decode (`decode_seconds`), per answer, mean over contexts, "
            f"beside the mean score of those k questions; x: over `{BASELINE}`'s cost per answer at the same k. On "
            "the frontier: no other press at that ratio and k scores as much at no more cost per answer.",
            "",
        ]
        for ratio, k in sorted({(r["ratio"], r["k"]) for r in costs}):
            rows = [r for r in costs if r["ratio"] == ratio and r["k"] == k]
            front = [
                f"`{r['press']}` ({r['score']:.3f}, {r['seconds_per_answer']:.3f} s"
                + ("" if math.isnan(r["cost_vs_uncompressed"]) else f", {r['cost_vs_uncompressed']:.2f} x")
                + ")"
                for r in rows
                if r["on_frontier"]
            ]
            md.append(f"- cr {ratio:g}, k = {k}: on the frontier, by cost: {', '.join(front)}")
        md += ["", f"Table: [{links['costs']}]({links['costs']})", ""]
    return md
