"""Tables for the report, the frontier and the studies: the rows of a CSV file in and out, numbers for Markdown
cells, a Markdown table, and the command a study records beside its artifacts. Its imports are the standard
library's and :mod:`evaluation.atomic` (itself standard library only): the GPU check's report imports it on a
machine that may lack the project's dependencies (``scripts/gpu_check.sh``)."""

from __future__ import annotations

import csv
import io
import math
import shlex
from pathlib import Path

from evaluation.atomic import write_atomic

__all__ = ["read_rows", "csv_text", "write_rows", "num", "fmt", "markdown_table", "command", "write_study"]


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV file with a header, as dicts of strings (``csv.DictReader``); ``[]`` when the file does
    not exist."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(x) -> float:
    """``float(x)``; NaN for an empty or malformed cell (``None``, ``""``, ``"-"``)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def fmt(x, spec: str = ".3g") -> str:
    """A number for a Markdown cell, ``format(num(x), spec)``; ``-`` for NaN, infinite or empty values."""
    v = num(x)
    return "-" if not math.isfinite(v) else format(v, spec)


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """The lines of a Markdown table; a cell's ``|`` becomes ``/`` and its line breaks spaces."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in row) + " |" for row in rows]
    return out


def command(script: str, argv: list[str]) -> str:
    """The command line a study records: ``python scripts/<script>.py`` and its arguments, shell-quoted (the same
    whether the study ran through the script or as ``python -m evaluation.studies.<script>``)."""
    return shlex.join(["python", f"scripts/{script}.py", *argv])


def csv_text(rows: list[dict], columns: list[str] | None = None, float_spec: str | None = None) -> str:
    """The text of a CSV file of ``rows`` with the header ``columns`` (default: every key of ``rows``, in first-seen
    order); a missing cell is empty and a key outside ``columns`` is left out; lines end in ``\n``. ``float_spec``
    (e.g. ``".6g"``) formats every float cell with ``format(value, float_spec)``; ``None`` writes ``str(value)``."""
    columns = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        if float_spec is not None:
            row = {k: format(v, float_spec) if isinstance(v, float) else v for k, v in row.items()}
        writer.writerow(row)
    return buf.getvalue()


def write_rows(path: Path, rows: list[dict], columns: list[str] | None = None, float_spec: str | None = None) -> None:
    """Write :func:`csv_text` of ``rows`` to ``path``. Atomic (:func:`evaluation.atomic.write_atomic`): an
    interrupted write leaves the previous file."""
    write_atomic(Path(path), csv_text(rows, columns, float_spec))


def write_study(
    out: Path, name: str, rows: list[dict], title: str, script: str, argv: list[str], intro: str, header, body
) -> None:
    """Write a committed-rows study's two artifacts, atomically: ``<out>/<name>.csv`` (``rows``) and
    ``<out>/<name>.md`` (``# title``, the recording command :func:`command` of ``script`` and ``argv``, ``intro``,
    then the Markdown table of ``header`` and ``body``); print where they went."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_rows(out / f"{name}.csv", rows)
    text = [f"# {title}", "", f"Regenerated, never hand-edited: `{command(script, argv)}`", "", intro, ""]
    write_atomic(out / f"{name}.md", "\n".join([*text, *markdown_table(header, body), ""]))
    print(f"wrote {out / name}.csv and .md ({len(rows)} rows)")
