"""Where a run's rows live: ``predictions.jsonl`` while the run is written, ``predictions.jsonl.gz`` once it is
finished and compressed; reading either, compressing a finished run and restoring one that is reopened.

The harness appends one fsynced row per example to the plain file (:func:`evaluation.harness.append_row`) until the
run's ``metrics.json`` is written. A finished run may then store its rows compressed (:func:`compress_run`;
``python -m evaluation.compress_runs``, ``make compress``): gzip of the very same bytes, its header without a name or
a time (the same rows give the same file), about six times smaller; the compressed file is read back and compared
before the plain one is removed. Every reader goes through :func:`rows_file`, :func:`rows_files` or
:func:`read_predictions`, so a run reads the same in either form. A run reopened to take more rows (``grow=true``,
or its ``metrics.json`` removed) gets its plain file back first (:func:`restore_run`, called by the harness's claim).
When both files exist (a compression or a restoration cut off between its two steps) the plain one is the run's.

Standard library only, like :mod:`evaluation.atomic`.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from evaluation.atomic import write_atomic

__all__ = [
    "COMPRESSED",
    "NAME",
    "compress_run",
    "read_predictions",
    "read_text",
    "restore_run",
    "rows_file",
    "rows_files",
    "write_text",
]

#: the file a run appends its rows to, one JSON object a line
NAME = "predictions.jsonl"
#: the same rows of a finished run, gzip-compressed
COMPRESSED = NAME + ".gz"
#: gzip's level for :func:`compress_run` (the smallest files; compressing is done once per run)
LEVEL = 9


def rows_file(run_dir: Path) -> Path | None:
    """The file holding the rows of the run (or shard) directory ``run_dir``: ``predictions.jsonl`` when it exists,
    else ``predictions.jsonl.gz`` when that exists, else None (no row yet)."""
    for name in (NAME, COMPRESSED):
        path = Path(run_dir) / name
        if path.is_file():
            return path
    return None


def rows_files(root: Path) -> list[Path]:
    """The rows file (:func:`rows_file`) of every directory below ``root`` (``root`` included) that holds one, sorted
    by path; one per directory, whichever form it is stored in."""
    root = Path(root)
    found = {p.parent for name in (NAME, COMPRESSED) for p in root.rglob(name) if p.is_file()}
    return sorted(rows_file(d) for d in found)


def _source(path: Path) -> Path:
    """``path`` itself, or its compressed form when ``path`` is a plain ``predictions.jsonl`` that does not exist and
    the ``.gz`` beside it does."""
    path = Path(path)
    if not path.exists() and path.name == NAME and (path.parent / COMPRESSED).is_file():
        return path.parent / COMPRESSED
    return path


def read_text(path: Path) -> str:
    """The text of a rows file (``.gz`` decompressed); ``path`` as :func:`read_predictions` takes it.

    Raises:
        FileNotFoundError: neither form exists. ValueError: a ``.gz`` that is not a whole gzip file (named)."""
    path = _source(path)
    if path.suffix != ".gz":
        return path.read_text(encoding="utf-8")
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    except (gzip.BadGzipFile, EOFError) as err:
        raise ValueError(f"{path} is not a whole gzip file ({err}); restore it from git") from err


def read_predictions(path: Path, repair: bool = False) -> list[dict]:
    """Complete rows of a run's ``predictions.jsonl`` (``[]`` when the run has none in either form); a torn line (a
    run killed mid-write) is skipped.

    Args:
        path: the run's ``predictions.jsonl``; when it does not exist, the ``predictions.jsonl.gz`` beside it is read
            (a finished run stored compressed). A ``.gz`` path is read as such.
        repair: rewrite the plain file without its torn lines (atomically), so that appending resumes cleanly. Only
            the run's writer, which holds the run directory's lock (:func:`evaluation.harness.claim_runs`), repairs;
            every reader (the report, studies) leaves the file as it is. A compressed file is whole (written
            atomically), so it has nothing to repair.
    """
    path = _source(path)
    if not path.exists():
        return []
    rows, torn = [], False
    for line in read_text(path).splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            torn = True
    if torn and repair and path.suffix != ".gz":
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def write_text(run_dir: Path, text: str) -> Path:
    """Replace the rows of ``run_dir`` with ``text`` (JSON lines), atomically, in the form the run stores them:
    compressed when only ``predictions.jsonl.gz`` exists, else plain. Returns the file written."""
    path = rows_file(run_dir) or Path(run_dir) / NAME
    if path.name == COMPRESSED:
        write_atomic(path, gzip.compress(text.encode("utf-8"), compresslevel=LEVEL, mtime=0))
    else:
        write_atomic(path, text)
    return path


def compress_run(run_dir: Path) -> bool:
    """Store the rows of the finished run (or shard) directory ``run_dir`` compressed: ``predictions.jsonl.gz``
    written atomically, read back and compared with the plain file's bytes, then ``predictions.jsonl`` removed.

    Returns:
        True when it compressed, False when there was no plain file (already compressed, or no rows).

    Raises:
        ValueError: ``run_dir`` is not finished (no ``metrics.json``: the harness may still append to its rows), or
            the compressed file did not read back equal (the plain file is then kept).
    """
    run_dir = Path(run_dir)
    plain = run_dir / NAME
    if not plain.is_file():
        return False
    if not (run_dir / "metrics.json").is_file():
        raise ValueError(f"{run_dir} has no metrics.json: an unfinished run keeps appending to {NAME}")
    data = plain.read_bytes()
    packed = run_dir / COMPRESSED
    write_atomic(packed, gzip.compress(data, compresslevel=LEVEL, mtime=0))
    if gzip.decompress(packed.read_bytes()) != data:
        packed.unlink()
        raise ValueError(f"{packed} did not read back as {plain}; {plain} is kept")
    plain.unlink()
    return True


def restore_run(run_dir: Path) -> bool:
    """Give the run (or shard) directory ``run_dir`` its plain ``predictions.jsonl`` back, to append to: the rows of
    ``predictions.jsonl.gz`` written out atomically, then the ``.gz`` removed (also when both existed: the plain file
    is the run's). Returns True when it restored a compressed file."""
    run_dir = Path(run_dir)
    plain, packed = run_dir / NAME, run_dir / COMPRESSED
    if not packed.is_file():
        return False
    restored = not plain.is_file()
    if restored:
        write_atomic(plain, read_text(packed))
    packed.unlink()
    return restored
