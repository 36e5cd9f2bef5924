"""Paired comparisons of one press against others, example by example, from committed runs.

Usage::

    python -m evaluation.studies.paired RESULTS_DIR [RESULTS_DIR ...] --press A --against B [C ...]
        [--dataset ruler ruler-qa] [--model smollm2-135m] [--ratios 0.5 0.75] [--partial] [--out results/paired]
    python scripts/paired.py ...            # the same

For each dataset, model and ratio where ``A`` and a press ``B`` both have a run (:func:`evaluation.runs.scan`:
shards merged, rows de-duplicated by example ``id``), the two runs' rows are matched by ``id`` and compared on the
examples both scored:

- ``better`` / ``worse`` / ``tied``: examples where ``A``'s score is above / below / equal to ``B``'s;
- ``sign_p``: the two-sided exact sign test on the untied examples (``scipy.stats.binomtest(better, better +
  worse)``; 1.0 when every example is tied);
- ``diff`` with ``diff_low`` / ``diff_high``: the mean of ``score_A - score_B`` and its Student-t interval
  (:func:`evaluation.metrics.t_interval`), the paired analogue of the report's per-press intervals.

Each pair is compared on all its examples (``length = all``) and, when the rows carry 2 or more target context
lengths (:func:`evaluation.report.row_length`, e.g. a run joined from 2k and 4k by :mod:`evaluation.merge_runs`), on
each length's examples alone too (``length = 2048``, ...); likewise, in the shared-context protocol (rows with a
``question_index``), on each question position's answers alone (``question = 1``, ...: the same contexts, so the
difference is paired context by context).

Several results directories may be given (e.g. ``results/learned_2k results``: the learned presses' runs beside
KVzip's); a run of the same dataset, model, press and ratio found under two of them is refused, never chosen
silently.

The rows' ``score`` is compared by default; ``--field`` picks another per-row measure of :data:`FIELDS` (e.g.
``nll_increase``, the continuation loss's, where lower is better: ``better`` then counts the examples where ``A``'s
value is lower).

Unfinished runs (no ``metrics.json``, missing shards) are skipped unless ``--partial`` is given; their rows then
say ``complete = False``. Writes ``<out>/<A>.csv`` (one row per dataset, model, ratio, ``B`` and group) and
``<out>/<A>.md`` (the same as a table, with the command), both atomically (``<A>__<field>.csv`` / ``.md`` with
``--field``). Regenerated, never hand-edited.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.metrics import t_interval
from evaluation.report import row_length
from evaluation.runs import Run, scan
from evaluation.tables import markdown_table, write_rows

__all__ = ["FIELDS", "paired_rows", "compare", "main"]


#: The per-row measures a pair can be compared on, each with ``True`` where higher is better.
FIELDS = {"score": True, "nll_increase": False, "kl": False}


def compare(a: Run, b: Run, confidence: float = 0.95, field: str = "score") -> dict:
    """One paired comparison of run ``a`` against run ``b`` on the examples both scored.

    Args:
        a, b: runs of the same dataset, model and ratio (rows with ``id`` and ``field``).
        confidence: level of the interval of the mean difference, in (0, 1).
        field: the per-row measure compared, a key of :data:`FIELDS`; ``better`` / ``worse`` follow its direction
            (for a loss, ``better`` counts the examples where ``a``'s value is lower).

    Returns:
        A flat record: ``n`` (common examples), ``mean_a``, ``mean_b``, ``diff``, ``diff_low``, ``diff_high``,
        ``better``, ``worse``, ``tied``, ``sign_p``, ``complete`` (both runs finished).

    Raises:
        ValueError: the runs share no example id, their dataset, model or ratio differ, ``field`` is not one of
            :data:`FIELDS`, or a row lacks it (e.g. ``nll_increase`` on a question-answering run).
    """
    from scipy.stats import binomtest

    if field not in FIELDS:
        raise ValueError(f"field={field!r} must be one of {', '.join(FIELDS)}")
    if (a.dataset, a.model, a.ratio) != (b.dataset, b.model, b.ratio):
        raise ValueError(
            f"paired runs must share dataset, model and ratio, got {(a.dataset, a.model, a.ratio)} and "
            f"{(b.dataset, b.model, b.ratio)}"
        )
    for run in (a, b):
        if any(field not in r for r in run.rows):
            raise ValueError(f"{run.press}'s rows in {run.dataset} have no {field!r} ({run.path})")
    sa = {r["id"]: float(r[field]) for r in a.rows}
    sb = {r["id"]: float(r[field]) for r in b.rows}
    common = sorted(set(sa) & set(sb))
    if not common:
        raise ValueError(f"{a.press} and {b.press} share no example id in {a.dataset} at ratio {a.ratio}")
    diffs = [sa[i] - sb[i] for i in common]
    sign = 1 if FIELDS[field] else -1
    better = sum(sign * d > 0 for d in diffs)
    worse = sum(sign * d < 0 for d in diffs)
    low, high = t_interval(diffs, confidence)
    return {
        "dataset": a.dataset,
        "model": a.model,
        "ratio": a.ratio,
        "press": a.press,
        "against": b.press,
        "n": len(common),
        "mean_a": sum(sa[i] for i in common) / len(common),
        "mean_b": sum(sb[i] for i in common) / len(common),
        "diff": sum(diffs) / len(diffs),
        "diff_low": low,
        "diff_high": high,
        "better": better,
        "worse": worse,
        "tied": len(common) - better - worse,
        "sign_p": float(binomtest(better, better + worse).pvalue) if better + worse else 1.0,
        "complete": a.complete and b.complete,
    }


def paired_rows(
    runs: list[Run],
    press: str,
    against: list[str],
    ratios: list[float] | None = None,
    partial: bool = False,
    confidence: float = 0.95,
    field: str = "score",
) -> list[dict]:
    """Every comparison of ``press`` against each of ``against`` among ``runs`` (:func:`compare`).

    Args:
        runs: runs from :func:`evaluation.runs.scan`.
        press: the press compared (``A``).
        against: the presses it is compared with, each ``!= press``.
        ratios: keep these compression ratios only (``None``: all).
        partial: include unfinished runs (``False``: finished runs only).
        confidence: level of the interval of the mean difference.
        field: the per-row measure compared (:func:`compare`).

    Returns:
        :func:`compare`'s records, each with ``length`` and ``question``: both ``"all"``, then one record per
        target context length and one per question position (the other ``"all"``) where the pair's rows carry two
        or more.

    Raises:
        ValueError: ``against`` is empty or names ``press`` itself, or two runs (e.g. under two results
            directories) share a dataset, model, press and ratio.
    """
    if not against or press in against:
        raise ValueError(f"against={against} must name at least one press other than press={press!r}")
    keyed: dict[tuple, Run] = {}
    for r in runs:
        if not r.rows or not (partial or r.complete) or (ratios is not None and r.ratio not in ratios):
            continue
        key = (r.dataset, r.model, r.ratio, r.press)
        if key in keyed:
            raise ValueError(
                f"two runs of press={r.press!r}, dataset={r.dataset!r}, ratio={r.ratio:g}: {keyed[key].path} and "
                f"{r.path}; give one results directory holding it"
            )
        keyed[key] = r
    out = []
    for (dataset, model, ratio, name), run in sorted(keyed.items()):
        if name != press:
            continue
        for other in against:
            peer = keyed.get((dataset, model, ratio, other))
            if peer is None:
                continue
            out.append({"length": "all", "question": "all", **compare(run, peer, confidence, field)})
            common = {r["id"] for r in run.rows} & {r["id"] for r in peer.rows}
            for label, key in _GROUPS:  # split only where the common examples carry two or more groups
                groups = sorted({key(r) for r in run.rows + peer.rows if r["id"] in common} - {None})
                for group in groups if len(groups) > 1 else []:
                    a, b = (x.keep(lambda r, g=group, k=key: k(r) == g) for x in (run, peer))
                    if {r["id"] for r in a.rows} & {r["id"] for r in b.rows}:
                        out.append(
                            {"length": "all", "question": "all", label: group, **compare(a, b, confidence, field)}
                        )
    return out


#: The row groups a pair is also compared within, when its rows carry two or more: the target context length
#: (:func:`evaluation.report.row_length`) and, in the shared-context protocol, the question's position (1..K).
_GROUPS = (("length", row_length), ("question", lambda r: r.get("question_index")))


def _table(rows: list[dict]) -> str:
    by_question = any(r["question"] != "all" for r in rows)  # the column only where a pair split by position
    header = [
        "dataset",
        "length",
        *(["question"] if by_question else []),
        "ratio",
        "against",
        "n",
        "A",
        "B",
        "A - B [interval]",
        "better / worse / tied",
        "sign p",
    ]
    body = [
        [
            r["dataset"] + ("" if r["complete"] else " (partial)"),
            r["length"],
            *([r["question"]] if by_question else []),
            f"{r['ratio']:g}",
            r["against"],
            r["n"],
            f"{r['mean_a']:.3f}",
            f"{r['mean_b']:.3f}",
            f"{r['diff']:+.3f} [{r['diff_low']:+.3f}, {r['diff_high']:+.3f}]",
            f"{r['better']} / {r['worse']} / {r['tied']}",
            f"{r['sign_p']:.3g}",
        ]
        for r in rows
    ]
    return "\n".join(markdown_table(header, body))


def main(argv: list[str] | None = None) -> int:
    """Command line (the module docstring). Returns 0, or 1 when no pair of runs was found."""
    parser = ArgumentParser(prog="python -m evaluation.studies.paired", description=__doc__.split("\n")[0])
    parser.add_argument("results_dir", type=Path, nargs="+", help="one or more results directories")
    parser.add_argument("--press", required=True)
    parser.add_argument("--against", nargs="+", required=True)
    parser.add_argument("--dataset", nargs="+", default=None, help="datasets to read (default: all)")
    parser.add_argument("--model", default=None, help="keep this model only (default: all)")
    parser.add_argument("--ratios", nargs="+", type=float, default=None)
    parser.add_argument("--partial", action="store_true", help="include unfinished runs")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--field", choices=list(FIELDS), default="score", help="per-row measure (default: score)")
    parser.add_argument("--out", type=Path, default=Path("results/paired"))
    args = parser.parse_args(argv)
    runs = [r for root in args.results_dir for d in args.dataset or [None] for r in scan(root, d)]
    if args.model is not None:
        runs = [r for r in runs if r.model == args.model]
    try:
        rows = paired_rows(runs, args.press, args.against, args.ratios, args.partial, args.confidence, args.field)
    except ValueError as err:
        parser.error(str(err))
    if not rows:
        print(f"no run of {args.press} shares a dataset, model and ratio with {args.against}", file=sys.stderr)
        return 1
    command = "python -m evaluation.studies.paired " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.press if args.field == "score" else f"{args.press}__{args.field}"
    write_rows(args.out / f"{stem}.csv", rows)
    note = ""  # the compared measure, where it is not the score
    if args.field != "score":
        lower = "" if FIELDS[args.field] else " (lower is better: better / worse count the examples where A is lower)"
        note = f"Compared on the rows' `{args.field}`{lower}.\n"
    text = (
        f"# {args.press}, paired against {', '.join(args.against)}\n\n{note}"
        "Examples matched by `id`; A is the first press, B the other; the interval is Student-t over the\n"
        "per-example differences, the sign test two-sided on the untied examples (`evaluation/studies/paired.py`).\n"
        f"Regenerated, never hand-edited:\n\n    {command}\n\n{_table(rows)}\n"
    )
    write_atomic(args.out / f"{stem}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
