"""What the committed-rows studies (``page_straddle``, ``partial_answers``) share: the run directories of a press at
a ratio under one protocol's results, and their command line's common arguments. Nothing here runs a model."""

from __future__ import annotations

from pathlib import Path

from evaluation.cli import ArgumentParser
from evaluation.predictions import rows_files

__all__ = ["name", "parser", "run_dirs"]


def run_dirs(root: Path, press: str, ratio: float) -> list[Path]:
    """The run directories of ``press`` at ``ratio`` under ``root`` (``<results>/<dataset>/<model>``): one, or one
    per shard, whichever form their rows are stored in (:func:`evaluation.predictions.rows_files`).

    Raises:
        ValueError: naming the press, the ratio and ``root`` when there is none.
    """
    found = [p.parent for p in rows_files(Path(root) / press / f"cr{ratio:g}")]
    if not found:
        raise ValueError(f"no run of press {press!r} at ratio {ratio:g} under {root}")
    return found


def parser(description: str, out: str) -> ArgumentParser:
    """The arguments every committed-rows study reads: ``runs`` (one protocol's ``<results>/<dataset>/<model>``),
    ``--ratio``, ``--presses``, ``--tasks`` (default: every task), ``--out`` (default ``out``) and ``--name``
    (default ``<dataset>_<ratio>``, :func:`name`); a study adds its own."""
    args = ArgumentParser(description=description)
    args.add_argument("runs", type=Path, help="<results>/<dataset>/<model>: one protocol's runs")
    args.add_argument("--ratio", type=float, required=True)
    args.add_argument("--presses", nargs="+", required=True)
    args.add_argument("--tasks", nargs="*", default=None, help="only these tasks (default: every task)")
    args.add_argument("--out", type=Path, default=Path(out))
    args.add_argument("--name", default=None, help="default: <dataset>_<ratio>")
    return args


def name(args) -> str:
    """The artifacts' stem: ``--name``, else ``<dataset>_<ratio>`` from ``runs``' parent folder."""
    return args.name or f"{args.runs.parent.name}_{args.ratio:g}"
