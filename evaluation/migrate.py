"""Bring run directories written by earlier versions of the harness up to the current format, in place.

    python -m evaluation.migrate results          # or runs/, or any output_dir

Three changes, each idempotent and written atomically:

1. ``config.yaml`` holds the run's settings (:func:`evaluation.settings.run_settings`: the press as the class and
   every field it built), where earlier versions saved the yaml tree that built it. A field added since takes the
   value it had before it existed where its class says so (:func:`evaluation.settings.saved_run_settings`), e.g.
   ``draws: sequential`` for the probabilistic press's runs made before per-layer random streams; a field removed
   since is dropped where it holds the value it had in effect (its class's ``removed_fields``, e.g. Page-EntroKV's
   ``kernel_size: 5`` and ``budget: tokens``, which left with the ablation ladder), and the harness reads such a run
   the same way unmigrated (:func:`evaluation.settings.saved_press`). (The committed
   results were migrated with this command; a class that moved module before then, ``presses.snis_press``, was
   mapped to its new path once, by hand.)
2. A prediction row's ``effective_compression`` counts the kept entries. Rows written before this rule by a press
   that pads its per-group caches (probabilistic eviction) hold the padded (physical) figure there, which their
   ``physical_compression`` also holds; their press reported the kept one as ``press_stats.logical_compression``,
   which is copied over; only a row whose ``effective_compression`` equals its ``physical_compression`` (the
   padded figure) is such a row. Nothing else in a row changes, and the rows keep their form (plain, or a finished
   run's compressed ``predictions.jsonl.gz``: :mod:`evaluation.predictions`).

3. A needle row's ``metadata.target_length`` (the length a report groups rows by:
   :func:`evaluation.report.row_length`) is the run's ``dataset.context_length``; rows written before the needle
   wrote it get it from the run's settings. Their ``metadata.context_length`` counts each example's own tokens, so
   without it a paired study split a needle run into one group per example length.

A fourth, on request: ``--rename-press OLD NEW`` gives the runs of press config ``OLD`` the name ``NEW`` when a
class's defaults move and another config now states the settings they ran with (the committed runs of the
reconstruction press were renamed so: results/tuning/page_entrokv_reconstruction/README.md). Every run directory of
``OLD`` moves (a ``NEW`` one in its place is refused), its ``metrics.json`` names ``NEW`` and the command that now
rebuilds it (the command as run is kept as ``command_as_run``), ``commands.txt`` likewise; the rows and settings
are untouched, and each moved run is checked against config ``NEW`` (the harness's settings check), so a rename
that would change what the name means is refused before anything moves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import OmegaConf

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.predictions import read_text, rows_file, write_text
from evaluation.settings import saved_run_settings

__all__ = ["migrate", "migrated_row", "rename_press"]


#: The dataset class whose rows carry ``metadata.target_length`` only since 2026-12-07 (change 3).
_NEEDLE = "evaluation.datasets.needle.NeedleDataset"


def _target_length(settings: dict) -> int | None:
    """The needle's target length (its one ``context_length``) from a run's settings, or None for another
    dataset."""
    dataset = settings.get("dataset") or {}
    return int(dataset["context_length"]) if dataset.get("_target_") == _NEEDLE else None


def migrated_row(row: dict, settings: dict) -> dict:
    """One prediction row as :func:`migrate` leaves it (changes 2 and 3 of the module docstring): the same object
    when nothing changes, else a new one.

    Args:
        row: a prediction row as a run wrote it.
        settings: the run's ``config.yaml`` as a dict (its ``dataset`` node is read).
    """
    stats = row.get("press_stats") or {}
    kept = stats.get("logical_compression")
    padded = row.get("effective_compression") == row.get("physical_compression")  # the old rule's tell
    evicted = stats.get("num_layers_evicted")
    if isinstance(kept, (int, float)) and evicted and padded and row["effective_compression"] != kept:
        row = {**row, "effective_compression": float(kept)}
    target_length, meta = _target_length(settings), row.get("metadata")
    if target_length is not None and isinstance(meta, dict) and "target_length" not in meta:
        row = {**row, "metadata": {**meta, "target_length": target_length}}
    return row


def migrate(root: Path) -> dict[str, int]:
    """Migrate every run directory under ``root``; returns the counts of configs and rows changed."""
    changed = {"configs": 0, "rows": 0}
    for config in sorted(Path(root).rglob("config.yaml")):
        rows_path = rows_file(config.parent)  # predictions.jsonl, or a finished run's predictions.jsonl.gz
        if rows_path is None and not (config.parent / "metrics.json").exists():
            continue  # not a run directory
        node = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
        new = saved_run_settings(node)
        if new != node:
            write_atomic(config, OmegaConf.to_yaml(OmegaConf.create(new)))
            changed["configs"] += 1
        if rows_path is not None:
            lines = read_text(rows_path).splitlines(keepends=True)
            try:
                rows = [json.loads(line) for line in lines]
            except json.JSONDecodeError:  # a torn last line (a killed run): leave the file to the harness's resume
                changed["skipped"] = changed.get("skipped", 0) + 1
                continue
            new_rows = [migrated_row(r, new) for r in rows]
            n = sum(a is not b for a, b in zip(rows, new_rows))
            if n:  # unchanged rows keep their bytes
                text = "".join(line if a is b else json.dumps(b) + "\n" for line, a, b in zip(lines, rows, new_rows))
                write_text(config.parent, text)  # in the form the run stores them
                changed["rows"] += n
    return changed


def _run_pieces(press_dir: Path) -> list[Path]:
    """The directories under one press directory that hold a run's settings: ``cr<ratio>/`` and, for a sharded run,
    each ``cr<ratio>/shard_i_of_n/``."""
    return sorted(config.parent for config in press_dir.rglob("config.yaml"))


def rename_press(root: Path, old: str, new: str) -> list[Path]:
    """Move every run of press config ``old`` under ``root`` (``<dataset>/<model>/<old>/``) to ``new`` (see the
    module docstring); returns the new press directories.

    Raises:
        ValueError: ``new`` is not a press config, a ``new`` directory exists already, or a run's saved settings
            differ from what config ``new`` builds (naming the run and the changes); nothing has moved then.
    """
    from evaluation import harness

    if new not in harness.config_choices("press"):
        raise ValueError(harness.unknown_config("press", new))
    press = harness.compose_config([f"press={new}"]).press
    sources = sorted(d for d in Path(root).glob(f"*/*/{old}") if d.is_dir())
    for src in sources:
        if (src.parent / new).exists():
            raise ValueError(f"{src.parent / new} exists: renaming {src} would mix two presses' runs")
        for run in _run_pieces(src):
            saved = OmegaConf.load(run / "config.yaml")
            cfg = saved.copy()
            cfg.press = press  # the run's own settings with the press config `new` builds at its ratio
            changes = harness.config_changes(saved, cfg)
            if changes:
                raise ValueError(f"{run} ran with other settings than config {new!r} builds: {'; '.join(changes)}")
    word = re.compile(rf"(?<![\w]){re.escape(old)}(?![\w])")
    moved = []
    for src in sources:
        dst = src.parent / new
        src.rename(dst)
        moved.append(dst)
        for run in _run_pieces(dst):
            log = run / harness.COMMANDS_NAME
            if log.exists():
                write_atomic(log, word.sub(new, log.read_text()))
            if (run / "metrics.json").exists():
                metrics = json.loads((run / "metrics.json").read_text())
                command = metrics.get("command") or ""
                metrics.update(press=new, command=word.sub(new, command), command_as_run=command, renamed_from=old)
                write_atomic(run / "metrics.json", json.dumps(metrics, indent=2))
    return moved


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="a results or output directory")
    parser.add_argument("--rename-press", nargs=2, metavar=("OLD", "NEW"), help="rename a press config's runs")
    args = parser.parse_args(argv)
    if args.rename_press:
        print(json.dumps([str(p) for p in rename_press(args.root, *args.rename_press)]))
    else:
        print(json.dumps(migrate(args.root)))


if __name__ == "__main__":
    main()
