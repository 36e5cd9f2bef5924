"""Store the rows of every finished run below a directory compressed (``predictions.jsonl.gz``), so that the results
stay small as grids grow.

    python -m evaluation.compress_runs results [more directories] [--dry-run]     # make compress

A run (or shard) directory is compressed when it has its ``metrics.json`` and no other process holds its lock
(:func:`evaluation.harness.run_in_progress`); a run without ``metrics.json`` (unfinished: the harness may still append
to it) or being written is left as it is and counted, so the command can run again later, beside a grid that still
writes, and compresses only what has finished since. Each compression is :func:`evaluation.predictions.compress_run`
(gzip of the same bytes, read back before the plain file goes); every reader of the harness, the report and the
studies reads either form, and a compressed run reopened (``grow=true``) gets its plain file back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from evaluation.cli import ArgumentParser
from evaluation.harness import run_in_progress
from evaluation.predictions import NAME, compress_run

__all__ = ["Compressed", "compress_runs", "main"]


@dataclass
class Compressed:
    """What :func:`compress_runs` did: the run directories compressed, and those left plain with why."""

    done: list[Path] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)  # no metrics.json
    in_progress: list[Path] = field(default_factory=list)  # another process holds the run's lock
    bytes_before: int = 0  # of the plain files compressed
    bytes_after: int = 0  # of their compressed files


def compress_runs(roots: list[Path], dry_run: bool = False) -> Compressed:
    """Compress the rows of every finished run directory below ``roots`` (module docstring); with ``dry_run``, only
    sort them into what would be compressed and what is left.

    Raises:
        FileNotFoundError: a root is not a directory (named).
    """
    found = Compressed()
    for root in map(Path, roots):
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        for plain in sorted(root.rglob(NAME)):
            run = plain.parent
            if not (run / "metrics.json").is_file():
                found.unfinished.append(run)
            elif run_in_progress(run):
                found.in_progress.append(run)
            else:
                found.bytes_before += plain.stat().st_size
                if not dry_run:
                    compress_run(run)
                    found.bytes_after += (run / f"{NAME}.gz").stat().st_size
                found.done.append(run)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m evaluation.compress_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", type=Path, nargs="+", help="directories holding run directories (e.g. results)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be compressed, change nothing")
    args = parser.parse_args(argv)
    try:
        found = compress_runs(args.roots, args.dry_run)
    except FileNotFoundError as err:
        parser.error(str(err))
    for run in found.unfinished:
        print(f"left plain (no metrics.json, unfinished): {run}")
    for run in found.in_progress:
        print(f"left plain (being written by another process): {run}")
    mb = found.bytes_before / 1e6
    if args.dry_run:
        print(f"would compress {len(found.done)} finished run(s), {mb:.1f} MB of rows")
    else:
        print(f"compressed {len(found.done)} finished run(s): {mb:.1f} MB of rows -> {found.bytes_after / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
