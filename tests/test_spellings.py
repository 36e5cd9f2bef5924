"""One run per setting however it is typed (issue 63 item 3): every spelling Hydra 1.3 gives a run setting (a literal,
a quoted string, an exponent, an int for a float, a sweep's job, a list) names one run directory, saves one
``config.yaml``, and finds the finished run (``evaluation.settings.normalise``, read by the run directory, the saved
settings, the settings comparison, ``evaluation.fused``'s ratios and the shards).

The values are Hydra's own: configs are composed with Hydra's compose API, and a multirun's jobs are split by
Hydra's ``BasicSweeper`` from the parsed command line (``OverridesParser``), as ``-m`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _tiny_models import make_tiny_family
from _tiny_tokenizer import char_tokenizer
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf
from test_harness import CONFIG_DIR, composed

from evaluation import fused, harness, settings
from evaluation import run as entry
from evaluation.predictions import rows_file
from evaluation.settings import normal_value, run_settings

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"press": "knorm", "dataset": "needle", "model": "smollm2-135m"}
SMALL = ["n_samples=2", "max_new_tokens=2", "dataset.context_length=200", "dataset.depths=[0,100]"]


def _job_overrides(*command_line: str) -> list[list[str]]:
    """The override lists of the jobs that ``python -m evaluation.run -m <command_line>`` runs: Hydra's parser and
    its basic sweeper's split (a discrete sweep becomes one ``key=value`` string per value)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed: list[Override] = OverridesParser.create().parse_overrides(list(command_line))
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return batch


def _saved(cfg) -> str:
    """The ``config.yaml`` a run of ``cfg`` writes (what ``harness._claim`` writes)."""
    return OmegaConf.to_yaml(OmegaConf.create(run_settings(cfg)))


# the literal spellings Hydra 1.3 gives 0.5, and what each parses to
RATIO_SPELLINGS = ["0.5", "0.50", ".5", "5e-1", "50e-2", "+0.5", "'0.5'", '"0.50"', "0.5000000000000001"]


def test_hydra_parses_the_spellings_into_different_values():
    """The premise: Hydra keeps a quoted number a string and an int an int, and a sweep's floats carry float error;
    without normalising, these would be other settings or other directories."""
    values = [OverridesParser.create().parse_override(f"compression_ratio={s}").value() for s in RATIO_SPELLINGS]
    assert {type(v) for v in values} == {float, str} and len(set(map(repr, values))) > 2
    assert [j for (j,) in _job_overrides("compression_ratio=range(0.1,0.5,0.1)")][2].endswith("0.30000000000000004")


@pytest.mark.parametrize("spelling", RATIO_SPELLINGS)
def test_every_spelling_of_a_ratio_is_one_run(spelling, tmp_path):
    reference = composed("press=snapkv", "compression_ratio=0.5", f"output_dir={tmp_path}")
    cfg = composed("press=snapkv", f"compression_ratio={spelling}", f"output_dir={tmp_path}")
    names = {**NAMES, "press": "snapkv"}
    assert (
        harness.run_dir(cfg, names)
        == harness.run_dir(reference, names)
        == tmp_path / "needle/smollm2-135m/snapkv/cr0.5"
    )
    assert _saved(cfg) == _saved(reference)
    assert run_settings(cfg)["press"]["compression_ratio"] == 0.5  # the press reads the one spelling too
    assert harness.config_changes(run_settings(reference), cfg) == []


def test_a_sweeps_jobs_are_the_runs_their_values_name(tmp_path):
    """``-m compression_ratio=range(0.1,0.5,0.1)``'s third job (Hydra's 0.30000000000000004) is the run
    ``compression_ratio=0.3``; ``0.5,0.75``, ``choice(0.5,7.5e-1)``, ``sort(0.75,0.50)`` and a list give the same
    jobs."""
    out = f"output_dir={tmp_path}"
    (third,) = _job_overrides("compression_ratio=range(0.1,0.5,0.1)")[2]
    typed = composed("press=snapkv", "compression_ratio=0.3", out)
    swept = composed("press=snapkv", third, out)
    assert swept.compression_ratio != 0.3  # Hydra's value, before the harness reads it
    names = {**NAMES, "press": "snapkv"}
    assert harness.run_dir(swept, names) == harness.run_dir(typed, names) and _saved(swept) == _saved(typed)
    jobs = {
        command: [_saved(composed("press=snapkv", *job, out)) for job in _job_overrides(command)]
        for command in (
            "compression_ratio=0.5,0.75",
            "compression_ratio=choice(0.5,7.5e-1)",
            "compression_ratio=sort(0.75,0.50)",
            "compression_ratio='0.5','0.75'",
        )
    }
    assert len({tuple(saved) for saved in jobs.values()}) == 1, jobs


@pytest.mark.parametrize(
    "typed, other",
    [
        ("seed=42", "seed=42.0"),
        ("seed=42", "seed=4.2e1"),
        ("seed=42", "seed='42'"),
        ("shard=0/2", "shard=00/2"),
        ("shard=0/2", "shard=' 0 / 2'"),
        ("n_samples=2", "n_samples=2.0"),
        ("query_aware=true", "query_aware='true'"),
        ("query_aware=false", "query_aware=0"),
        ("compression_ratio=0", "compression_ratio=0.0"),
        ("model.enable_thinking=false", "model.enable_thinking='False'"),
    ],
)
def test_every_spelling_of_a_setting_is_one_run(typed, other, tmp_path):
    a, b = (composed("press=snapkv", s, f"output_dir={tmp_path}") for s in (typed, other))
    names = {**NAMES, "press": "snapkv"}
    assert harness.run_dir(a, names) == harness.run_dir(b, names)
    assert _saved(a) == _saved(b)
    assert harness.config_changes(run_settings(a), b) == []


def test_the_baseline_is_one_run_whatever_ratio_it_is_given(tmp_path):
    """``no_press`` builds no press: its ratio is 0.0 (its directory's ``cr0``) in ``evaluation.run`` (whose default
    ratio is 0.5) and ``evaluation.fused`` alike."""
    names = {**NAMES, "press": "no_press"}
    plain, typed = (composed("press=no_press", *r, f"output_dir={tmp_path}") for r in ([], ["compression_ratio=0"]))
    assert (
        harness.run_dir(plain, names) == harness.run_dir(typed, names) == tmp_path / "needle/smollm2-135m/no_press/cr0"
    )
    assert _saved(plain) == _saved(typed) and run_settings(plain)["compression_ratio"] == 0.0


def test_values_that_spell_no_setting_are_left_to_their_checks():
    assert normal_value("compression_ratio", "abc") == "abc"
    with pytest.raises(ValueError, match=r"compression_ratio='abc' must be a number in \[0, 1\)"):
        harness.check_ratio("abc")
    with pytest.raises(ValueError, match=r"compression_ratio=1.0 must be in \[0, 1\)"):
        harness.check_ratio("1")
    from evaluation.guards import check_setting_values

    for override, message in [
        ("seed=42.5", r"seed=42.5 must be an integer"),
        ("query_aware=yes", r"query_aware='yes' must be true or false"),
        ("n_samples=2.5", r"n_samples=2.5 must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_setting_values(settings.normalise(composed(override)))
    with pytest.raises(ValueError, match=r"shard='x/2' must look like 'i/n'"):
        harness.parse_shard("x/2")


def test_the_committed_runs_are_saved_in_their_one_spelling():
    """Normalising changes no committed run's settings (so none of their identities): each saved setting is already
    in its one spelling."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    checked = 0
    for config in sorted((ROOT / "results").rglob("config.yaml")):
        if rows_file(config.parent) is None:  # predictions.jsonl, or a finished run's .gz
            continue
        saved = yaml.load(config.read_text(encoding="utf-8"), Loader=loader)
        for key in settings.SETTING_KINDS:
            parent, _, leaf = key.rpartition(".")
            section = saved.get(parent, {}) if parent else saved
            if leaf in section:
                value = section[leaf]
                assert normal_value(key, value) == value and type(normal_value(key, value)) is type(value), config
        checked += 1
    assert checked > 300


def _fused_runs(*overrides: str) -> list:
    """:func:`evaluation.fused.compose_runs` as ``python -m evaluation.fused <overrides>`` calls it (Hydra's config
    of the app set, so that the runs compose as its job would)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="fused", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return fused.compose_runs(cfg, list(overrides))


def test_fused_ratios_in_any_spelling_are_the_same_runs(tmp_path):
    out = f"output_dir={tmp_path}"
    spellings = ["[0.5,0.75]", "[0.50, 0.75]", "[.5,7.5e-1]", "['0.5',0.75]", "[0.5,0.75,0.50]"]
    runs = {
        s: [
            (harness.run_dir(cfg, names), _saved(cfg))
            for cfg, names in _fused_runs("presses=[snapkv]", f"ratios={s}", out)
        ]
        for s in spellings
    }
    assert len(runs["[0.5,0.75]"]) == 2  # a ratio typed twice is one run
    assert all(r == runs["[0.5,0.75]"] for r in runs.values()), runs
    # and they are evaluation.run's runs of those ratios
    single = [composed("press=snapkv", f"compression_ratio={r}", out) for r in ("0.5", "0.75")]
    assert [saved for _, saved in runs["[0.5,0.75]"]] == [_saved(cfg) for cfg in single]


def test_fused_refuses_the_keys_it_does_not_read():
    with pytest.raises(ValueError, match=r"did you mean presses=\[entroprefill\]\?"):
        _fused_runs("press=entroprefill")
    with pytest.raises(ValueError, match=r"did you mean ratios=\[0.25\]\?"):
        _fused_runs("compression_ratio=0.25")


@pytest.fixture
def tiny(monkeypatch):
    model, tok = make_tiny_family("llama-3.2-3b", vocab=128, seed=1), char_tokenizer()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    yield
    GlobalHydra.instance().clear()


def test_a_finished_run_is_found_whichever_spelling_comes_next(tiny, tmp_path, monkeypatch):
    """A run finished with ``compression_ratio=0.50 seed=42`` is found (not refused, not run again, no second
    directory) by ``python -m evaluation.run compression_ratio='0.5' seed=42.0`` (Hydra's entry point: the task's
    config is normalised in place) and by a sweep's ``0.5,0.75`` job."""
    out = tmp_path / "runs"
    first = entry.run(composed("press=knorm", "compression_ratio=0.50", *SMALL, f"output_dir={out}"), NAMES)
    run_dir = out / "needle/smollm2-135m/knorm/cr0.5"
    config, rows = (run_dir / "config.yaml").read_text(), (run_dir / "predictions.jsonl").read_text()
    assert first["n"] == 2

    def no_model(*args, **kwargs):
        raise AssertionError("a finished run loads no model")

    monkeypatch.setattr(harness, "get_model", no_model)
    GlobalHydra.instance().clear()
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "evaluation.run",
            "press=knorm",
            "compression_ratio='0.5'",
            "seed=42.0",
            *SMALL,
            f"output_dir={out}",
            f"hydra.run.dir={out}/.hydra/run",
        ],
    )
    entry.main()  # finds the finished run: it would fail loading the model otherwise
    GlobalHydra.instance().clear()
    (job,) = [j for j in _job_overrides("compression_ratio=0.5,0.75") if j == ["compression_ratio=0.5"]]
    assert entry.run(composed("press=knorm", *job, "seed=4.2e1", *SMALL, f"output_dir={out}"), NAMES) == first
    assert sorted(p.name for p in (out / "needle/smollm2-135m/knorm").iterdir()) == ["cr0.5"]
    assert (run_dir / "config.yaml").read_text() == config and (run_dir / "predictions.jsonl").read_text() == rows
