"""``--help`` separates the presses a user runs from their tuning and ablation variants (issue 65 item 6).

- ``python -m evaluation.run --help`` and ``python -m evaluation.fused --help`` list every press config once: this
  project's presses, kvpress's, then the variants (a press yaml whose first line is ``# variant of <press>: ...``,
  :data:`evaluation.cli.VARIANT_LINE`), one line per press they vary;
- the variants the issue names (ablation rungs, page-size steps, the correction's ablations) are marked, the
  learned-scorer presses are not, and each variant varies a press a user runs;
- a variant keeps its config name, so every committed run keeps its directory: today's harness, given the run's
  saved settings and the press its directory names, finds it at the same place, finished, with no setting changed
  (``harness.check_existing_run``; ``tests/test_settings.py`` compares each saved press with today's field by field).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_class
from omegaconf import OmegaConf

from evaluation import harness
from evaluation.cli import config_groups_help, press_variants
from evaluation.predictions import rows_file
from presses.base import SAVED_BEFORE

ROOT = Path(__file__).resolve().parent.parent
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
HEADINGS = ("press, this project's: ", "press, kvpress's: ")
#: the issue's kinds of variant, by name: ablation rungs, page-size steps, the SNIS correction's ablations
VARIANT_NAMES = re.compile(r"_rung\d|_page(16|64)$|_p(8|16)$|_tau2$|_uncorrected$")
#: learned-scorer presses, which a user runs (the issue's list)
LEARNED = ["kvzap_page", "snis_kvzap_page", "snis_kvzap_token", "chunkkv_kvzap", "kvzap_linear", "kvzap_mlp"]
LEARNED += ["dms_linear", "qfilter", "expected_attention_stats"]


def _press_lines(text: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The press lines of a ``--help``'s groups: ``({heading: names}, {varied press: its variants})``."""
    users, variants = {}, {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for heading in HEADINGS:
            if line.startswith(heading):
                users[heading] = line.removeprefix(heading).split(", ")
        if line.startswith("press, tuning and ablation variants"):
            for row in lines[i + 1 :]:
                if not row.startswith("  "):
                    break
                base, _, names = row.strip().partition(": ")
                variants[base] = names.split(", ")
    return users, variants


@pytest.mark.parametrize("entry", ["evaluation.run", "evaluation.fused"])
def test_help_lists_the_presses_apart_from_their_variants(entry):
    out = subprocess.run(
        [sys.executable, "-m", entry, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    users, variants = _press_lines(out)
    marked = press_variants()
    listed = [n for names in users.values() for n in names] + [n for names in variants.values() for n in names]
    assert sorted(listed) == harness.config_choices("press")  # every press config, each once
    assert not set(marked) & {n for names in users.values() for n in names}
    assert variants == {b: sorted(n for n, v in marked.items() if v == b) for b in set(marked.values())}
    assert "no_press" in users["press, kvpress's: "] and "page_entrokv" in users["press, this project's: "]
    assert "snapkv" in users["press, kvpress's: "] and "kvzip_page" in users["press, this project's: "]
    assert not re.search(r"^press(/base)?: ", out, re.M)  # Hydra's one list of every press is gone
    assert "== Config ==" in out and "compression_ratio: 0.5" in out  # the rest of Hydra's help stays
    assert out.count("\n") < 200


def test_variants_are_the_tuning_and_ablation_configs():
    marked = press_variants()
    names = harness.config_choices("press")
    assert {n for n in names if VARIANT_NAMES.search(n)} <= set(marked)
    assert not set(LEARNED) & set(marked) and set(LEARNED) <= set(names)
    for name, base in marked.items():
        assert base in names and base not in marked, f"{name}: varies {base!r}, which is no press a user runs"
    assert len(marked) < len(names) / 2
    help_names = re.findall(r"\w+", config_groups_help().split("press, this project's", 1)[1])
    assert all(help_names.count(n) == 1 for n in names if n not in set(marked.values()))


def _committed_runs():
    for config in sorted((ROOT / "results").rglob("config.yaml")):
        if rows_file(config.parent) is not None and ".hydra" not in config.parts:  # rows, plain or compressed
            yield config


def test_committed_runs_keep_their_directory_and_settings():
    """Each committed run, with its saved settings and ``press=<its directory's press>`` as today's configs build it,
    is named its own directory by the harness (``run_dir``); each press's first run and every 10th run is found
    there finished (its metrics) or with its rows, no setting changed (``check_existing_run``, which builds the
    press: all of them would take a minute; ``tests/test_settings.py`` compares every run's press field by field).
    A field the run predates is given at the value it had before it existed (``SAVED_BEFORE``), as there."""
    choices = set(harness.config_choices("press"))
    built: dict[str, object] = {}
    checked = finished = 0
    resumed: set[str] = set()
    for config in _committed_runs():
        saved = yaml.load(config.read_text(encoding="utf-8"), Loader=LOADER)
        shard = config.parent.name.startswith("shard_")
        run = config.parent.parent if shard else config.parent
        name, model, dataset_dir, root = run.parent.name, run.parents[1].name, run.parents[2].name, run.parents[3]
        assert name in choices, f"{config}: press={name} names no config of configs/press/"
        cfg = OmegaConf.create(saved)
        cfg.output_dir = str(root)
        cfg.overwrite = False
        cfg.grow = False
        target = (saved.get("press") or {}).get("_target_")
        cls = get_class(target) if target else None
        before = {
            f.name: saved["press"][f.name]
            for f in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ())
            if SAVED_BEFORE in f.metadata and saved["press"].get(f.name) == f.metadata[SAVED_BEFORE]
        }
        if name not in built:
            built[name] = harness.compose_config([f"press={name}"]).press  # ${compression_ratio}, ${seed}: the run's
        cfg.press = OmegaConf.merge(OmegaConf.to_container(built[name]), before)
        suffix = harness.protocol_suffix(cfg)
        assert dataset_dir.endswith(suffix), config
        names = {"press": name, "dataset": dataset_dir.removesuffix(suffix) if suffix else dataset_dir, "model": model}
        assert harness.run_dir(cfg, names) == config.parent, config
        checked += 1
        if name in resumed and checked % 10:  # each press's first run, and every 10th: the check builds the press
            continue
        resumed.add(name)
        metrics = harness.check_existing_run(cfg, names)  # raises for a changed setting
        if (config.parent / "metrics.json").exists():
            assert metrics == json.loads((config.parent / "metrics.json").read_text()), config
            finished += 1
    assert checked > 300 and finished > 50 and len(resumed) > 30
