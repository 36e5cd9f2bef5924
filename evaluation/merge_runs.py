"""Join finished runs of more context lengths into finished runs, as ``grow=true`` would have written them.

    python -m evaluation.merge_runs SOURCE RESULTS [--dataset DIR] [--dry-run]   # e.g. results/.staging/4k results

A grid too long for one session runs its new lengths alone and in shards (``dataset.context_lengths=[4096]
shard=i/n``), each shard committed as it finishes (``results/.staging/README.md``). When every shard of a run under
``SOURCE`` is in, this joins its rows to the finished run at the same place under ``RESULTS``
(``<dataset>[-qa]/<model>/<press>/cr<ratio>/``), which then holds both lengths. The result is the run that
``grow=true`` with the union of the lengths would have written: on a dataset whose examples nest
(``nested_samples``, :func:`evaluation.harness.nests_samples`), the examples of one length are the same whichever
other lengths are asked, so the examples, and the rows, are the same.

Every run is checked before anything is written; a failed check is one ``ValueError`` naming the run and the rule,
and then nothing is written at all:

- the source run is whole: every shard ``0..n-1`` finished (``metrics.json``), one shard count, one set of settings
  (the report's scan, :func:`evaluation.runs.scan`);
- the target run is finished, unsharded and not being written by another process;
- their settings differ in ``dataset.context_lengths`` alone, on a dataset whose examples nest;
- no source row's id is in the target with another content (a row already there as it is, from an earlier merge,
  is kept once: merging twice changes nothing).

Per target, in this order and each file atomically: ``predictions.jsonl`` (its rows, then the new ones; a target
stored compressed stays so, ``predictions.jsonl.gz``: :mod:`evaluation.predictions`),
``config.yaml`` (the lengths' sorted union), ``commands.txt`` (the commands that wrote the new rows added), and
``metrics.json`` (:func:`evaluation.harness.summarize` over every row; ``command`` is this merge's command line and
``merged`` the commands of the pieces: the target's, then the source's). A merge cut off between files is completed
by the same command. The source is left as it is. ``--dataset stdlib_docs-qa`` joins the runs of one dataset
directory only (one grid whole while the next still runs beside it under ``SOURCE``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.harness import (
    COMMANDS_NAME,
    config_changes,
    nests_samples,
    note_command,
    read_predictions,
    run_in_progress,
    summarize,
)
from evaluation.predictions import rows_file, write_text
from evaluation.runs import SHARD_DIR, scan

__all__ = ["Merge", "plan_merges", "merge_runs", "main"]

#: the one setting in which a source run may differ from its target
LENGTHS = "dataset.context_lengths"


@dataclass
class Merge:
    """One target run and what joins it."""

    target: Path
    rows: list[dict]  # the target's rows, then the new ones
    new_rows: int
    lengths: list[int]  # the merged dataset.context_lengths
    config: dict  # the target's saved settings with the merged lengths
    commands: list[str]  # the commands that wrote the source's rows
    merged: list[str]  # the pieces' commands: the target's, then the source's
    metrics: dict  # the target's metrics.json


def _load(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def _piece_dirs(run_dir: Path) -> list[Path]:
    """The directories holding a run's rows: ``cr<ratio>/`` itself and / or its ``shard_i_of_n/``."""
    shards = sorted(p for p in run_dir.iterdir() if p.is_dir() and SHARD_DIR.fullmatch(p.name))
    return ([run_dir] if rows_file(run_dir) is not None else []) + shards


def _plan(run, source: Path, results: Path) -> Merge | None:
    where = run.path.relative_to(source)
    if run.problems:
        raise ValueError(f"{run.path}: not whole ({'; '.join(run.problems)}); finish it first")
    target = results / where
    if target.is_dir() and [p for p in _piece_dirs(target) if p != target]:
        raise ValueError(f"{target}: a sharded run; only an unsharded run takes other lengths")
    if not (target / "metrics.json").is_file():
        raise ValueError(f"{target}: no finished run to join {run.path} to (needs its metrics.json)")
    if run_in_progress(target):
        raise ValueError(f"{target}: another process is writing it")
    pieces = _piece_dirs(run.path)
    saved, own = _load(target / "config.yaml"), _load(pieces[0] / "config.yaml")
    if not nests_samples(OmegaConf.create(saved)):
        raise ValueError(f"{target}: its dataset does not declare nested_samples, so lengths cannot be joined")
    changed = [c for c in config_changes(saved, own, both_saved=True) if not c.startswith("shard:")]
    if [c for c in changed if not c.startswith(f"{LENGTHS}:")]:
        raise ValueError(
            f"{run.path}: its settings differ from {target}'s in more than {LENGTHS} ({'; '.join(changed)})"
        )
    held = {row["id"]: row for row in read_predictions(target / "predictions.jsonl")}
    new = []
    for row in run.rows:
        if row["id"] not in held:
            new.append(row)
        elif held[row["id"]] != row:
            raise ValueError(f"{target}: holds another row with id {row['id']!r} than {run.path}")
    lengths = sorted({*saved["dataset"]["context_lengths"], *own["dataset"]["context_lengths"]})
    metrics = _metrics(target)
    commands = list(dict.fromkeys(c for p in pieces for c in _commands(p)))
    earlier = metrics["merged"] if "merged" in metrics else _commands(target)  # the target's own pieces
    if not new and lengths == saved["dataset"]["context_lengths"] and set(commands) <= set(earlier):
        return None  # merged before, to the end (a merge cut off before metrics.json has not recorded its commands)
    config = {**saved, "dataset": {**saved["dataset"], "context_lengths": lengths}}
    merged = list(dict.fromkeys([*earlier, *commands]))
    return Merge(target, [*held.values(), *new], len(new), lengths, config, commands, merged, metrics)


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))


def _commands(piece: Path) -> list[str]:
    """The commands that wrote a finished piece's rows: its ``commands.txt``, else its ``metrics.json``'s."""
    log = piece / COMMANDS_NAME
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return [c for c in lines if c] or [_metrics(piece)["command"]]


def plan_merges(source: Path, results: Path, dataset: str | None = None) -> list[Merge]:
    """Check every run under ``source`` against its target under ``results`` (module docstring); nothing is written.

    Args:
        dataset: only the runs under ``source/<dataset>/`` (a dataset directory, e.g. ``stdlib_docs-qa``), or all.

    Returns:
        One :class:`Merge` per run that still has something to join (a run merged before gives none).

    Raises:
        FileNotFoundError: ``source`` or ``results`` is not a directory.
        ValueError: the first failed check, naming the run and the rule; or ``source`` (``source/<dataset>``)
            holds no run.
    """
    for path in (source, results):
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{path} is not a directory")
    where = Path(source) / dataset if dataset is not None else Path(source)
    runs = scan(Path(source), dataset) if where.is_dir() else []
    if not runs:
        raise ValueError(f"{where} holds no run (<dataset>/<model>/<press>/cr<ratio>/[shard_i_of_n/])")
    plans = [_plan(run, Path(source), Path(results)) for run in runs]
    return [p for p in plans if p is not None]


def merge_runs(source: Path, results: Path, command: str, dataset: str | None = None) -> list[Merge]:
    """Join every run under ``source`` to its target under ``results`` (module docstring), after checking them all.

    Args:
        command: this merge's command line, recorded as each target's ``metrics.json`` ``command``.
        dataset: only the runs under ``source/<dataset>/``, as in :func:`plan_merges`.

    Raises:
        as :func:`plan_merges`; then nothing is written.
    """
    plans = plan_merges(source, results, dataset)
    for m in plans:
        write_text(m.target, "".join(json.dumps(r) + "\n" for r in m.rows))  # compressed if the target was
        write_atomic(m.target / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(m.config)))
        for command_run in m.commands:
            note_command(m.target, command_run)
        keep = {k: m.metrics[k] for k in ("press", "dataset", "model", "compression_ratio") if k in m.metrics}
        metrics = {**summarize(m.rows), **keep, "shard": None, "command": command, "merged": m.merged}
        write_atomic(m.target / "metrics.json", json.dumps(metrics, indent=2))
    return plans


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m evaluation.merge_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="runs of more lengths (e.g. results/.staging/4k)")
    parser.add_argument("results", type=Path, help="the finished runs they join (e.g. results)")
    parser.add_argument("--dataset", help="only SOURCE/DATASET/ (a dataset directory, e.g. stdlib_docs-qa)")
    parser.add_argument("--dry-run", action="store_true", help="check and list, write nothing")
    args = parser.parse_args(argv)
    command = " ".join(["python -m evaluation.merge_runs", *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.dry_run:
            plans = plan_merges(args.source, args.results, args.dataset)
        else:
            plans = merge_runs(args.source, args.results, command, args.dataset)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for m in plans:
        print(f"{m.target}: +{m.new_rows} rows, {LENGTHS}={m.lengths}, {len(m.rows)} rows in all")
    print(f"{'would join' if args.dry_run else 'joined'} {len(plans)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
