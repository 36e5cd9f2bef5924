"""One source for every default, and runs identified by the press they build (issue 28, deliverable 3).

- every ``configs/press/*.yaml`` states only what differs from its class (a value equal to the class default is a
  second source of that default; an interpolation such as ``${seed}`` links a run setting and is allowed);
- the committed run directories resume under today's configs: for each, the press today's ``press=<name>`` builds
  at its ratio has the settings its ``config.yaml`` holds;
- the class defaults are the tuned values the benchmark runs (``PageEntroKVPress().page_size``);
- the scoring math and its kernels restate none of the press's defaults (they take every value from the press).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_class
from omegaconf import OmegaConf
from test_harness import composed

from evaluation.settings import press_settings, run_settings
from presses import PageEntroKVPress, ProbabilisticEvictionPress

ROOT = Path(__file__).resolve().parent.parent
PRESS_CONFIGS = sorted((ROOT / "configs" / "press").rglob("*.yaml"))


def _restated(node: dict) -> list[str]:
    """Keys of a raw yaml press node (nested presses too) whose value equals its class's default."""
    target = node.get("_target_")
    if not target:
        return []
    defaults = {
        f.name: f.default for f in dataclasses.fields(get_class(target)) if f.default is not dataclasses.MISSING
    }
    found = []
    for key, value in node.items():
        if isinstance(value, dict):
            found += [f"{key}.{k}" for k in _restated(value)]
        elif key in defaults and not (isinstance(value, str) and value.startswith("${")) and value == defaults[key]:
            found.append(f"{key}: {value!r}")
    return found


@pytest.mark.parametrize("path", PRESS_CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs" / "press")))
def test_a_press_yaml_states_only_what_differs_from_its_class(path):
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    node.pop("defaults", None)
    base = path
    while "_target_" not in OmegaConf.load(base):  # a variant: the class of the config it extends, at any depth
        extends = {str(entry).split("@")[0] for entry in OmegaConf.load(base).get("defaults") if entry != "_self_"}
        press_dir = ROOT / "configs" / "press"
        (base,) = [p for p in PRESS_CONFIGS if p.relative_to(press_dir).with_suffix("").as_posix() in extends]
    node["_target_"] = OmegaConf.load(base)["_target_"]
    assert _restated(node) == []


def test_the_class_defaults_are_the_tuned_values():
    chosen = json.loads((ROOT / "results" / "tuning" / "page_entrokv" / "chosen.json").read_text())
    press = PageEntroKVPress()
    assert {key: getattr(press, key) for key in chosen} == chosen  # the dev split's choice, page_size 32
    assert ProbabilisticEvictionPress().seed == composed().seed  # the harness's default run seed


def _scoring_functions():
    from presses.core import pooling, renyi
    from presses.kernels import pooled_page_scores, references, renyi_pages

    return [
        pooled_page_scores,
        references.pooled_page_scores_reference,
        renyi_pages.pooled_page_scores_triton,
        renyi_pages.row_entropies_triton,
        pooling.pooled_group_scores,
        renyi.renyi_entropy,
        renyi.group_weights,
    ]


@pytest.mark.parametrize("function", _scoring_functions(), ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_the_scoring_math_states_no_default_of_a_press_field(function):
    """The press's fields are the one source of ``n_sink``, ``alpha``, ``tau``, ``pooling``, ``page_size`` and
    ``page_score``: the kernels and the math they call take them, they do not restate them."""
    fields = {f.name for f in dataclasses.fields(PageEntroKVPress)}
    parameters = inspect.signature(function).parameters.values()
    restated = [f"{p.name}={p.default!r}" for p in parameters if p.name in fields and p.default is not p.empty]
    assert restated == []


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML has it: 20 times faster than OmegaConf.load over the ~1,000 (and growing) committed
run configs, and equal to it on every one of them (checked 2026-12-04)."""


def _committed_runs():
    for config in sorted((ROOT / "results").rglob("config.yaml")):
        if (config.parent / "predictions.jsonl").exists():
            yield config


def test_committed_runs_resume_with_todays_configs():
    """For every committed run, the press ``press=<name> compression_ratio=<ratio>`` builds today is the one its
    ``config.yaml`` holds, field for field (a changed default or a yaml that dropped a value would show here). The
    one exception: a field the run predates holds the value it had before it existed (its ``SAVED_BEFORE``
    metadata, e.g. the probabilistic press's ``draws: sequential``), and the run is rebuilt with that override."""
    import dataclasses

    from hydra.utils import get_class

    from presses.base import SAVED_BEFORE

    checked, built, overridden = 0, {}, 0
    for config in _committed_runs():
        saved = yaml.load(config.read_text(encoding="utf-8"), Loader=_YAML_LOADER)  # resolved: no interpolations
        parts = config.relative_to(ROOT / "results").parts
        shard = parts[-2].startswith("shard_")
        name = parts[-4] if shard else parts[-3]
        ratio = saved["compression_ratio"]
        target = (saved.get("press") or {}).get("_target_")
        cls = get_class(target) if target else None
        before = {
            f.name: saved["press"][f.name]
            for f in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ())
            if SAVED_BEFORE in f.metadata and saved["press"].get(f.name) == f.metadata[SAVED_BEFORE]
        }
        key = (name, ratio, saved.get("seed"), tuple(sorted(before.items())))
        if key not in built:
            built[key] = run_settings(
                composed(
                    f"press={name}",
                    f"compression_ratio={ratio}",
                    f"seed={saved.get('seed', 42)}",
                    *(f"++press.{k}={v}" for k, v in before.items()),
                )
            )["press"]
        assert built[key] == saved["press"], config
        checked += 1
        overridden += bool(before)
    assert checked > 300 and 0 < overridden < checked


def test_settings_are_the_built_press_not_the_yaml():
    a = run_settings({"press": {"_target_": "presses.page_entrokv.PageEntroKVPress", "page_size": 32}})
    b = run_settings({"press": {"_target_": "presses.PageEntroKVPress"}})
    assert a == b and a["press"] == press_settings(PageEntroKVPress())
    assert a["press"]["_target_"] == "presses.PageEntroKVPress" and a["press"]["page_size"] == 32
    c = run_settings({"press": {"_target_": "presses.PageEntroKVPress", "page_size": 16}})
    assert c["press"]["page_size"] == 16
    nested = run_settings(
        {"press": {"_target_": "kvpress.AdaKVPress", "press": {"_target_": "kvpress.SnapKVPress", "window_size": 8}}}
    )
    assert nested["press"]["press"] == {"_target_": "kvpress.SnapKVPress", **nested["press"]["press"]}
    assert nested["press"]["press"]["window_size"] == 8 and "kernel_size" in nested["press"]["press"]
    with pytest.raises(ValueError, match="cannot build the press kvpress.NoSuchPress"):
        run_settings({"press": {"_target_": "kvpress.NoSuchPress"}})


def test_reading_settings_holds_back_kvpress_construction_warnings(caplog):
    import logging

    with caplog.at_level(logging.WARNING):  # 0.317: a press no other test builds (the settings are cached)
        settings = run_settings({"press": {"_target_": "kvpress.KVzipPress", "compression_ratio": 0.317}})
    assert settings["press"]["compression_ratio"] == 0.317
    assert not [r for r in caplog.records if r.name.startswith("kvpress")]
    assert logging.getLogger("kvpress").level == logging.NOTSET  # restored
    with caplog.at_level(logging.WARNING):
        from kvpress import KVzipPress

        KVzipPress(0.3)  # built to run it: kvpress's warning is not held back
    assert [r for r in caplog.records if r.name.startswith("kvpress")]
