"""One source for every default, and runs identified by the press they build (issue 28, deliverable 3).

- every ``configs/press/*.yaml`` states only what differs from its class (a value equal to the class default is a
  second source of that default; an interpolation such as ``${seed}`` links a run setting and is allowed);
- the committed run directories resume under today's configs: for each, the press today's ``press=<name>`` builds
  at its ratio has the settings its ``config.yaml`` holds (a field added since at the value it had before it existed,
  a field removed since at the value it had in effect: ``evaluation.settings.saved_press``), and the harness's own
  resume check finds no change for every run of Page-EntroKV and of the press that reuses its code;
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
from hydra.utils import get_class, instantiate
from kvpress import KnormPress
from omegaconf import OmegaConf
from test_harness import composed

from evaluation import harness
from evaluation.predictions import rows_file
from evaluation.settings import press_settings, public_path, run_settings, saved_press, saved_run_settings
from evaluation.studies.ladder import PageEntroKVLadderPress
from presses import PageEntroKVPress, PageEntroKVReconstructionPress, ProbabilisticEvictionPress, ScorerPagePress

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
        if rows_file(config.parent) is not None:  # predictions.jsonl, or a finished run's .gz
            yield config


def test_committed_runs_resume_with_todays_configs():
    """For every committed run, the press ``press=<name> compression_ratio=<ratio>`` builds today is the one its
    ``config.yaml`` holds, field for field (a changed default or a yaml that dropped a value would show here). The
    exceptions: a field the run predates holds the value it had before it existed (its ``SAVED_BEFORE``
    metadata, e.g. the probabilistic press's ``draws: sequential``), and the run is rebuilt with that override; a
    field the class no longer has is listed at the value it had in effect (its ``removed_fields``, e.g.
    Page-EntroKV's ``budget: tokens``), and :func:`evaluation.settings.saved_press` reads it as absent."""
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
        assert built[key] == saved_press(saved["press"]), config
        checked += 1
        overridden += bool(before)
    assert checked > 300 and 0 < overridden < checked


def _holds(node, targets: set[str]) -> bool:
    """Whether a saved press section is, or holds at any depth, a press of one of ``targets``."""
    if isinstance(node, dict):
        return node.get("_target_") in targets or any(_holds(v, targets) for v in node.values())
    return isinstance(node, list) and any(_holds(v, targets) for v in node)


def test_committed_page_entrokv_runs_are_the_runs_todays_configs_build():
    """Every committed run whose press is Page-EntroKV or holds it (the reconstruction press too, which reuses its
    code) is, for the harness's resume check (``harness.config_changes``: its saved ``config.yaml`` against its own
    config with the press ``press=<name>`` builds today), the same run: no change. Runs saved while the ablation
    ladder's ``kernel_size`` and ``budget`` were fields of the class list them; they build and compare equal."""
    targets = {public_path(PageEntroKVPress), public_path(PageEntroKVReconstructionPress)}
    configs: dict[str, object] = {}
    checked = 0
    for config in _committed_runs():
        saved = yaml.load(config.read_text(encoding="utf-8"), Loader=_YAML_LOADER)
        if not _holds(saved.get("press"), targets):
            continue
        parts = config.relative_to(ROOT / "results").parts
        name = parts[-4] if parts[-2].startswith("shard_") else parts[-3]
        if name not in configs:
            configs[name] = harness.compose_config([f"press={name}"]).press
        cfg = OmegaConf.create(saved)
        cfg.press = configs[name]  # the run's own settings, the press as its config builds it today
        assert harness.config_changes(saved, cfg) == [], config
        fields = {f.name for f in dataclasses.fields(get_class(saved["press"]["_target_"])) if f.init}
        assert set(saved_run_settings(saved)["press"]) == fields | {"_target_"}, config  # builds with today's fields
        checked += 1
    assert checked > 0 and {"page_entrokv", "page_entrokv_reconstruction"} <= set(configs)


def test_a_removed_field_reads_as_absent_at_its_value_and_is_refused_at_another():
    """``removed_fields``: a saved section listing Page-EntroKV's former ``kernel_size`` and ``budget`` at the values
    every Page-EntroKV press ran with is today's press (nested in a wrapper too); another value is one line naming
    the ladder's press, where those values live now. The ladder's press keeps them as its own fields."""
    today = press_settings(PageEntroKVPress(0.5))
    saved = {**today, "kernel_size": 5, "budget": "tokens"}
    assert saved_press(saved) == today and saved["budget"] == "tokens"  # the saved dict is left as it is
    assert saved_run_settings({"press": saved})["press"] == today
    wrapped = {"_target_": "kvpress.AdaKVPress", "press": saved}
    assert saved_press(wrapped)["press"] == today
    ladder = press_settings(PageEntroKVLadderPress(0.5, budget="pages"))
    assert saved_press(ladder) == ladder and ladder["budget"] == "pages"
    reconstruction = press_settings(PageEntroKVReconstructionPress(0.5))
    assert saved_press({**reconstruction, "budget": "tokens"}) == reconstruction
    for section, field, value in (
        (saved, "budget", "pages"),
        (saved, "kernel_size", 7),
        (wrapped["press"], "budget", "pages"),
        (reconstruction, "budget", "pages"),
    ):
        bad = {**section, field: value}
        message = (
            f"this run was saved with {field}={value!r}, a field the class no longer has .* other values are "
            r"evaluation\.studies\.ladder\.PageEntroKVLadderPress's$"
        )
        with pytest.raises(ValueError, match=message):
            saved_press(bad)


def test_migrate_drops_a_removed_field_and_the_run_stays_the_same(tmp_path):
    """``python -m evaluation.migrate`` on a committed Page-EntroKV run as it was saved before the ladder's fields left
    the class (``kernel_size: 5``, ``budget: tokens``): they leave its ``config.yaml``, which the harness reads as the
    same run before and after (idempotent; the rows untouched)."""
    import shutil

    from evaluation.migrate import migrate

    target = public_path(PageEntroKVPress)
    run = next(c.parent for c in _committed_runs() if f"_target_: {target}\n" in c.read_text(encoding="utf-8"))
    copy = tmp_path / "run"
    copy.mkdir()
    rows = rows_file(run)  # plain or compressed (a finished run's predictions.jsonl.gz)
    shutil.copy(rows, copy / rows.name)
    before = OmegaConf.load(run / "config.yaml")
    before.press.update({name: removed.value for name, removed in PageEntroKVPress.removed_fields.items()})
    (copy / "config.yaml").write_text(OmegaConf.to_yaml(before))
    assert migrate(tmp_path)["configs"] == 1 and migrate(tmp_path)["configs"] == 0
    after = OmegaConf.load(copy / "config.yaml")
    assert not set(PageEntroKVPress.removed_fields) & set(after.press) and after.press._target_ == target
    assert harness.config_changes(before, after, both_saved=True) == []
    assert (copy / rows.name).read_bytes() == rows.read_bytes()


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


def test_the_learned_presses_defaults_are_the_tuned_values():
    """The development search on KVzap's learned scores (results/tuning/learned/chosen.json): ScorerPagePress's class
    defaults are its choice, and the snis_kvzap configs hold the proposal temperature and unit it chose."""
    chosen = json.loads((ROOT / "results" / "tuning" / "learned" / "chosen.json").read_text())
    press = ScorerPagePress(press=KnormPress())
    assert {key: getattr(press, key) for key in chosen["kvzap_page"]} == chosen["kvzap_page"]
    sampling = instantiate(composed("press=snis_kvzap_token").press)
    assert {key: getattr(sampling, key) for key in chosen["snis_kvzap_page"]} == chosen["snis_kvzap_page"]
    assert instantiate(composed("press=snis_kvzap_page").press).proposal_temperature == sampling.proposal_temperature
