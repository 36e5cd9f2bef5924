"""How a wrong number answer is wrong: whole, with digits dropped, or something else. Committed runs only.

A needle's value is a number of several digits, and the embedded model's tokenizer gives each digit its own
token. A press that keeps tokens one by one can keep some of the answer's digits and not the others; the model then
answers the digits it still sees, in order. For every row of the committed runs of a dataset at one ratio whose
first answer is a number, this study reads the first number of the prediction and sorts the row into

- ``exact``: that number is the answer;
- ``digits dropped``: a shorter number whose digits are a subsequence of the answer's, in order (:func:`dropped`);
- ``other``: anything else (another number, a longer one, no number).

Nothing is run through a model; the rows are the committed ones.

Usage (``python -m evaluation.studies.partial_answers`` is the same)::

    python scripts/partial_answers.py results/ruler/smollm2-135m --ratio 0.9 \\
        --presses kvzap_global kvzap_page snis_kvzap_token [--tasks niah_single_1] \\
        [--out results/partial_answers] [--name ruler_0.9]

Writes ``<out>/<name>.csv`` (per press and task: rows, exact, digits dropped, other) and ``<out>/<name>.md`` (the
same table and the command), atomically.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from evaluation import tables
from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.predictions import read_predictions, rows_files

__all__ = ["dropped", "kind", "main"]

_NUMBER = re.compile(r"\d+")


def dropped(prediction: str, answer: str) -> bool:
    """Whether the digit string ``prediction`` is ``answer`` with one or more digits left out (a proper
    subsequence, order kept): ``dropped("679103", "6791038")`` is True, ``dropped("6791083", "6791038")`` False."""
    if not prediction or len(prediction) >= len(answer):
        return False
    rest = iter(answer)
    return all(digit in rest for digit in prediction)


def kind(prediction: str, answer: str) -> str:
    """``"exact"``, ``"digits dropped"`` or ``"other"`` for the first number in the text ``prediction`` against the
    number ``answer`` (see the module docstring)."""
    found = _NUMBER.search(prediction)
    number = found.group(0) if found else ""
    if number == answer:
        return "exact"
    return "digits dropped" if dropped(number, answer) else "other"


KINDS = ("exact", "digits dropped", "other")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, help="<results>/<dataset>/<model>: one protocol's runs")
    parser.add_argument("--ratio", type=float, required=True)
    parser.add_argument("--presses", nargs="+", required=True)
    parser.add_argument("--tasks", nargs="*", default=None, help="only these tasks (default: every task)")
    parser.add_argument("--out", type=Path, default=Path("results/partial_answers"))
    parser.add_argument("--name", default=None, help="default: <dataset>_<ratio>")
    args = parser.parse_args(argv)

    rows = []
    for press in args.presses:
        files = rows_files(args.runs / press / f"cr{args.ratio:g}")
        if not files:
            raise ValueError(f"no run of press {press!r} at ratio {args.ratio:g} under {args.runs}")
        counts: dict[str, dict[str, int]] = {}
        for path in files:
            for row in read_predictions(path):
                task, answer = row.get("task") or "all", str(row["answers"][0])
                if not answer.isdigit() or (args.tasks and task not in args.tasks):
                    continue
                per_task = counts.setdefault(task, dict.fromkeys(KINDS, 0))
                per_task[kind(row["prediction"], answer)] += 1
        for task, per_task in sorted(counts.items()):
            rows.append({"press": press, "task": task, "rows": sum(per_task.values()), **per_task})
    if not rows:
        raise ValueError(f"no row with a number answer under {args.runs} for {args.presses} (tasks {args.tasks})")

    name = args.name or f"{args.runs.parent.name}_{args.ratio:g}"
    args.out.mkdir(parents=True, exist_ok=True)
    tables.write_rows(args.out / f"{name}.csv", rows)
    body = [[r["press"], r["task"], r["rows"], *(r[k] for k in KINDS)] for r in rows]
    text = [
        f"# How the number answers are wrong: {args.runs} at ratio {args.ratio:g}",
        "",
        "Regenerated, never hand-edited: `"
        + tables.command("partial_answers", sys.argv[1:] if argv is None else argv)
        + "`",
        "",
        "Rows whose first answer is a number, by the first number of the prediction: the answer (exact), the answer "
        "with digits left out in order (digits dropped), or anything else.",
        "",
        *tables.markdown_table(["press", "task", "rows", *KINDS], body),
        "",
    ]
    write_atomic(args.out / f"{name}.md", "\n".join(text))
    print(f"wrote {args.out / name}.csv and .md ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
