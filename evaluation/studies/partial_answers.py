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

from evaluation import tables
from evaluation.predictions import read_predictions, rows_file
from evaluation.studies import committed

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
    parser = committed.parser(__doc__.split("\n")[0], "results/partial_answers")
    args = parser.parse_args(argv)

    rows = []
    for press in args.presses:
        counts: dict[str, dict[str, int]] = {}
        for run in committed.run_dirs(args.runs, press, args.ratio):
            for row in read_predictions(rows_file(run)):
                task, answer = row.get("task") or "all", str(row["answers"][0])
                if not answer.isdigit() or (args.tasks and task not in args.tasks):
                    continue
                per_task = counts.setdefault(task, dict.fromkeys(KINDS, 0))
                per_task[kind(row["prediction"], answer)] += 1
        for task, per_task in sorted(counts.items()):
            rows.append({"press": press, "task": task, "rows": sum(per_task.values()), **per_task})
    if not rows:
        raise ValueError(f"no row with a number answer under {args.runs} for {args.presses} (tasks {args.tasks})")

    body = [[r["press"], r["task"], r["rows"], *(r[k] for k in KINDS)] for r in rows]
    tables.write_study(
        args.out,
        committed.name(args),
        rows,
        f"How the number answers are wrong: {args.runs} at ratio {args.ratio:g}",
        "partial_answers",
        sys.argv[1:] if argv is None else argv,
        "Rows whose first answer is a number, by the first number of the prediction: the answer (exact), the answer "
        "with digits left out in order (digits dropped), or anything else.",
        ["press", "task", "rows", *KINDS],
        body,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
