"""The README's "Which press when" table, generated from the committed quality-cost tables.

For each protocol (the question inside the compressed context, or asked after compression) and each compression
ratio of the committed cost tables (``results/tables/<dataset>[-qa]__<model>__cost.csv``, written by
``make report`` from the 2k speed sweep), the table names the press with the best score among those whose measured
prefill cost fits a budget (ties: the lower cost), with its score, its number of examples and its cost in multiples
of the uncompressed prefill. Every press of the cost tables competes, kvpress's and this project's alike; a press
without a measured cost, and the uncompressed model, are left out of the choice.

Two budgets: about one prefill (:data:`ONE_PREFILL`) and up to KVzip's cost (:data:`KVZIP_SLACK` times KVzip's
measured cost at that ratio in the same table, the slack for timing noise: presses that run KVzip's reconstruction
pass measure within it).

``python -m evaluation.readme_table`` rewrites the block of README.md between :data:`START` and :data:`END`;
``--check`` exits 1 when the README's block differs from the one the tables give (``tests/test_readme_table.py``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from evaluation.atomic import write_atomic
from evaluation.registry import KVZIP_CONFIG
from evaluation.report import BASELINE
from evaluation.tables import num, read_rows

__all__ = ["END", "KVZIP_SLACK", "ONE_PREFILL", "START", "best_press", "render", "rewrite"]

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- which-press:start -->"
END = "<!-- which-press:end -->"
MODEL = "smollm2-135m"
#: The KVzip config whose measured cost sets the second budget (the registry names presses).
KVZIP = KVZIP_CONFIG
#: The first budget: a prefill cost of at most this many uncompressed prefills.
ONE_PREFILL = 1.25
#: The second budget: at most this many times KVzip's measured cost at the same ratio.
KVZIP_SLACK = 1.1
#: (file stem, name shown); the question-inside runs are the stem plus ``-qa``.
DATASETS = (("needle", "needle"), ("ruler", "RULER"))
#: (suffix of the dataset's directory, the protocol as the table names it).
PROTOCOLS = (
    ("-qa", "inside the context (`query_aware=true`)"),
    ("", "after compression (the default)"),
)
#: The shared-context protocol's rows (issue 66, :mod:`evaluation.shared`): (the needle's directory stem, the row's
#: title); a row is shown when its cost table exists. Its score is the mean over the K questions of each context.
SHARED = (
    ("needle-shared", "several questions, each on a copy of the compressed cache (`protocol=shared`), all after"),
    (
        "needle-shared-qa",
        "several questions on copies, only the first inside the context (`protocol=shared query_aware=true`)",
    ),
    ("needle-turns", "several questions in turn, one chat (`protocol=shared shared_mode=turn`), all after"),
)


def _path(root: Path, stem: str, kind: str) -> Path:
    return root / "results" / "tables" / f"{stem}__{MODEL}__{kind}.csv"


def best_press(rows: list[dict], ratio: float, budget: float) -> dict | None:
    """The row of the best-scoring press at ``ratio`` whose ``prefill_cost`` is at most ``budget``.

    Args:
        rows: a cost table's rows (:func:`evaluation.frontier.cost_table`: ``ratio, press, n, score, prefill_cost``,
            strings as read from the csv).
        ratio: the compression ratio.
        budget: the largest prefill cost allowed, in multiples of the uncompressed prefill.

    Returns:
        The row with the highest score, ties broken by the lower cost then the name; None when no press with a
        measured cost fits (the baseline is never chosen).
    """
    fits = [
        r
        for r in rows
        if r["press"] != BASELINE
        and abs(num(r["ratio"]) - ratio) < 1e-9
        and math.isfinite(num(r["prefill_cost"]))
        and num(r["prefill_cost"]) <= budget
    ]
    if not fits:
        return None
    return min(fits, key=lambda r: (-num(r["score"]), num(r["prefill_cost"]), r["press"]))


def _kvzip_cost(rows: list[dict], ratio: float) -> float | None:
    found = [num(r["prefill_cost"]) for r in rows if r["press"] == KVZIP and abs(num(r["ratio"]) - ratio) < 1e-9]
    return found[0] if found and math.isfinite(found[0]) else None


def _cell(root: Path, stem: str, ratio: float, budget_of, name: str | None = None) -> str:
    """One dataset's line of a cell: its name (``name``, else the dataset's in :data:`DATASETS`) linking to the
    cost table, the press, score (n) and cost."""
    path = _path(root, stem, "cost")
    rows = read_rows(path)
    name = name or dict(DATASETS)[stem.removesuffix("-qa")]
    link = f"[{name}]({path.relative_to(root).as_posix()})"
    budget = budget_of(rows, ratio)
    if budget is None:
        return f"{link}: no {KVZIP} cost"
    row = best_press(rows, ratio, budget)
    if row is None:
        return f"{link}: none fits"
    return f"{link}: `press={row['press']}` {num(row['score']):.3f} (n={row['n']}), {num(row['prefill_cost']):.2f} x"


def _ratios(root: Path, kind: str) -> list[float]:
    """The ratios (no baseline) that every dataset and protocol's ``kind`` table holds."""
    found = None
    for stem, _ in DATASETS:
        for suffix, _ in PROTOCOLS:
            rows = read_rows(_path(root, stem + suffix, kind))
            ratios = {num(r["ratio"]) for r in rows if r["press"] != BASELINE and num(r["ratio"]) > 0}
            found = ratios if found is None else found & ratios
    return sorted(found or ())


def _shared_anchor(readme: str) -> str | None:
    """The README's anchor of the shared-context protocol's section (issue 66), or None while it has none."""
    for line in readme.splitlines():
        m = re.match(r"#{2,4} (.*shared[- ]context.*)$", line, flags=re.IGNORECASE)
        if m:
            return "#" + re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
    return None


def render(root: Path = ROOT, readme: str = "") -> str:
    """The block between :data:`START` and :data:`END` (markers included), from the tables under ``root``.

    Args:
        root: the repository root (``results/tables/`` is read below it).
        readme: the README's text, read only for the shared-context protocol's section anchor.

    Raises:
        ValueError: when no ratio has a cost table for every dataset and protocol (run ``make report``).
    """
    ratios = _ratios(root, "cost")
    if not ratios:
        raise ValueError(
            f"no ratio has a cost table under {root / 'results' / 'tables'} for every dataset and protocol"
        )
    single = read_rows(_path(root, "needle", "cost"))

    def kvzip_budget(rows: list[dict], ratio: float) -> float | None:
        """KVZIP_SLACK times KVzip's cost at ``ratio`` in ``rows``, else in the single needle's table (a cell that ran
        no kvpress KVzip, e.g. a shared one: every table's costs come from one speed sweep)."""
        cost = _kvzip_cost(rows, ratio) or _kvzip_cost(single, ratio)
        return None if cost is None else KVZIP_SLACK * cost

    budgets = (
        (f"about one prefill (cost <= {ONE_PREFILL} x)", lambda rows, ratio: ONE_PREFILL),
        (f"up to KVzip's cost (<= {KVZIP_SLACK} x `press={KVZIP}`'s)", kvzip_budget),
    )
    lines = [
        START,
        "<!-- generated by `python -m evaluation.readme_table` from the tables each cell links; do not edit -->",
        "",
        "**Which press when.** All numbers: SmolLM2-135M-Instruct on 2k-token contexts, CPU. A cell gives the "
        "config to type (`press=...`), its score (needle: share of needles found; RULER: mean task score), the "
        "examples n, and its prefill cost in uncompressed prefills (the 2k speed sweep "
        "`results/speed_memory_2k/speed_memory.csv`); the linked table holds them and every other press. The pick: "
        "the best score among kvpress's presses and this project's within the budget (ties: the lower cost); a "
        "press without a measured cost is not a candidate.",
        "",
        "| question | ratio | " + " | ".join(title for title, _ in budgets) + " |",
        "| --- | --- | " + " | ".join("---" for _ in budgets) + " |",
    ]
    for suffix, protocol in PROTOCOLS:
        for ratio in ratios:
            cells = ["<br>".join(_cell(root, stem + suffix, ratio, of) for stem, _ in DATASETS) for _, of in budgets]
            lines.append(f"| {protocol} | {ratio:g} | " + " | ".join(cells) + " |")
        base = []
        for stem, name in DATASETS:
            path = _path(root, stem + suffix, "summary")
            found = [r for r in read_rows(path) if r["press"] == BASELINE]
            if found:
                base.append(
                    f"[{name}]({path.relative_to(root).as_posix()}): {num(found[0]['score']):.3f} (n={found[0]['n']})"
                )
        lines.append(f"| {protocol} | uncompressed (`press={BASELINE}`, 1 x) | " + "<br>".join(base) + " | |")
    anchor = _shared_anchor(readme)
    where = f" ([the shared-context protocol]({anchor}))" if anchor else " (issue 66's shared-context protocol)"
    shared = [(stem, title) for stem, title in SHARED if _path(root, stem, "cost").is_file()]
    for stem, title in shared:
        rows = read_rows(_path(root, stem, "cost"))
        K = len({r["question_index"] for r in read_rows(_path(root, stem, "by_question"))})
        for ratio in sorted({num(r["ratio"]) for r in rows if r["press"] != BASELINE and num(r["ratio"]) > 0}):
            cells = [_cell(root, stem, ratio, of, name="needle") for _, of in budgets]
            lines.append(f"| {title}{where}, K = {K} | {ratio:g} | " + " | ".join(cells) + " |")
    if shared:
        lines += [
            "",
            "In the rows of several questions the score is the mean over each context's K questions, the last of "
            "which asks for every needle (scored by recall); the cost is the context's prefill, paid once for the K "
            "answers (per position and per answer: the linked table's `__by_question.csv` and "
            "`__cost_per_answer.csv`).",
            "",
        ]
    else:
        lines.append(f"| several questions on one compressed context{where} | | not measured yet | not measured yet |")
    untimed = [r for r in _ratios(root, "summary") if r not in ratios]
    if untimed:
        shown = ", ".join(f"{r:g}" for r in untimed)
        lines += [
            "",
            f"At ratio {shown} the runs are scored (`results/tables/{{needle,ruler}}{{,-qa}}__{MODEL}__summary.csv`) "
            "but the speed sweep measured no cost, so no budget can be checked there.",
        ]
    lines.append(END)
    return "\n".join(lines)


def rewrite(text: str, block: str) -> str:
    """``text`` with its block between :data:`START` and :data:`END` replaced by ``block``.

    Raises:
        ValueError: when ``text`` does not hold the two markers once each, in order.
    """
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"README must hold {START} and then {END} once each")
    head, rest = text.split(START)
    return head + block + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's block is out of date")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    new = rewrite(text, render(ROOT, text))
    if args.check:
        if new != text:
            print(f"error: {args.readme}: the which-press block is out of date; run python -m evaluation.readme_table")
            return 1
        return 0
    write_atomic(args.readme, new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
