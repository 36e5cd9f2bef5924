"""Collect runs: every run below a results directory, its shards merged, with why it is incomplete.

The report's first step (:mod:`evaluation.report`), and what :mod:`evaluation.merge_runs`, the paired comparison
(:mod:`evaluation.studies.paired`) and the claims ledger read. A run is laid out by the harness
(:mod:`evaluation.harness`): ``<dataset>/<model>/<press>/cr<ratio>/predictions.jsonl`` (or ``predictions.jsonl.gz``,
a finished run's rows compressed: :mod:`evaluation.predictions`; either reads the same), or in shards
``cr<ratio>/shard_<i>_of_<n>/`` whose rows are merged and de-duplicated by example id (the first shard's row wins).
A run that another process is writing (it holds the run directory's lock, :func:`evaluation.harness.claim_runs`)
is in progress, never finished.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from evaluation.harness import COMMANDS_NAME, config_changes, run_in_progress
from evaluation.predictions import read_predictions, rows_files

__all__ = ["RATIO_DIR", "SHARD_DIR", "Run", "scan"]

logger = logging.getLogger("evaluation.runs")

#: a shard's directory below its run's: ``shard_<i>_of_<n>``
SHARD_DIR = re.compile(r"shard_(\d+)_of_(\d+)")
#: a run's directory: ``cr<ratio>``
RATIO_DIR = re.compile(r"cr(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")


@dataclass
class Run:
    """One (dataset, model, press, ratio) run, its shards merged."""

    dataset: str
    model: str
    press: str
    ratio: float
    path: Path
    rows: list[dict] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why the run is incomplete; empty when complete

    @property
    def complete(self) -> bool:
        return not self.problems

    def keep(self, predicate) -> Run:
        """This run with only the rows ``predicate(row)`` holds (e.g. one context length's); path, commands and
        problems unchanged."""
        return replace(self, rows=[r for r in self.rows if predicate(r)])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def scan(results_dir: Path, dataset: str | None = None) -> list[Run]:
    """All runs below ``results_dir`` (hidden directories such as ``.hydra`` are skipped).

    A run sits exactly at ``<dataset>/<model>/<press>/cr<ratio>/`` below ``results_dir`` (its shards one level
    deeper). A run directory deeper than that belongs to another results root kept inside this one (e.g.
    ``results/learned_2k/``, whose runs share a dataset's name but not its examples): it is left out, with one
    warning per such root, so that its runs never join this root's tables.

    Args:
        results_dir: the directory holding ``<dataset>/<model>/<press>/cr<ratio>/``.
        dataset: read only ``results_dir/<dataset>/`` (``None``: every dataset).

    Raises:
        FileNotFoundError: ``results_dir`` does not exist.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results directory {results_dir} does not exist")
    parts: dict[Path, list[tuple[tuple[int, int] | None, Path]]] = defaultdict(list)
    nested: set[Path] = set()  # other results roots inside this one, warned about once each
    below = results_dir / dataset if dataset is not None else results_dir
    for pred in rows_files(below):  # either form, one per directory
        rel = pred.relative_to(results_dir).parts
        if any(p.startswith(".") for p in rel):
            continue
        directory = pred.parent
        shard = None
        match = SHARD_DIR.fullmatch(directory.name)
        if match:
            shard, directory = (int(match.group(1)), int(match.group(2))), directory.parent
        where = directory.relative_to(results_dir).parts
        is_run = RATIO_DIR.fullmatch(directory.name) is not None
        if is_run and len(where) > 4:
            root = results_dir.joinpath(*where[:-4])
            if root not in nested:
                nested.add(root)
                logger.warning("skipping the runs of %s: another results root (report it on its own)", root)
            continue
        if not is_run or len(where) < 4:
            logger.warning("skipping %s: not <dataset>/<model>/<press>/cr<ratio>/", pred)
            continue
        parts[directory].append((shard, pred.parent))
    runs = []
    for directory, pieces in sorted(parts.items()):
        run = Run(
            dataset=directory.parent.parent.parent.name,
            model=directory.parent.parent.name,
            press=directory.parent.name,
            ratio=float(RATIO_DIR.fullmatch(directory.name).group(1)),
            path=directory,
        )
        seen: set[str] = set()
        for _, piece in sorted(pieces, key=lambda x: (x[0] is not None, x[0] or (0, 0))):
            for row in read_predictions(piece / "predictions.jsonl"):  # or its .gz
                if row.get("id") not in seen:
                    seen.add(row.get("id"))
                    run.rows.append(row)
            metrics = _read_json(piece / "metrics.json")
            where = piece.relative_to(directory.parent) if piece != directory else "run"
            busy = run_in_progress(piece)  # its rows and metrics.json may change while we read them
            if busy or metrics is None:
                run.problems.append(
                    f"{where} is in progress (another process is writing it)"
                    if busy
                    else f"{where} has no metrics.json (unfinished)"
                )
                log = piece / COMMANDS_NAME  # the commands that wrote its rows so far
                for command in log.read_text(encoding="utf-8").splitlines() if log.exists() else []:
                    if command and command not in run.commands:
                        run.commands.append(command)
            else:  # a run joined from pieces (evaluation.merge_runs) lists their commands too
                for command in [metrics.get("command"), *metrics.get("merged", [])]:
                    if command and command not in run.commands:
                        run.commands.append(command)
        shards = [s for s, _ in pieces if s is not None]
        if shards:
            counts = {n for _, n in shards}
            if len(counts) > 1:
                run.problems.append(f"mixed shard counts {sorted(counts)}")
            n = max(counts)
            missing = sorted(set(range(n)) - {i for i, _ in shards})
            if missing:
                run.problems.append(f"shards {missing} of {n} missing")
            run.problems.extend(_shard_setting_problems(pieces))
        runs.append(run)
    return runs


def _shard_setting_problems(pieces: list[tuple[tuple[int, int] | None, Path]]) -> list[str]:
    """One problem per shard whose ``config.yaml`` differs from the first shard's in more than ``shard``."""
    from omegaconf import OmegaConf

    saved = [
        (piece, OmegaConf.load(piece / "config.yaml"))
        for s, piece in sorted(pieces, key=lambda x: x[0] or (0, 0))
        if s is not None and (piece / "config.yaml").is_file()
    ]
    problems = []
    for piece, cfg in saved[1:]:
        changed = [c for c in config_changes(saved[0][1], cfg, both_saved=True) if not c.startswith("shard:")]
        if changed:
            problems.append(f"{piece.name} was made with other settings than {saved[0][0].name} ({'; '.join(changed)})")
    return problems
