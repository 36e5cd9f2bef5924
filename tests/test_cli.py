"""The entry points as a user runs them, in subprocesses (issue 17 items 2, 4 and 7).

- Bad input gets one ``error: ...`` line on stderr and exit status 1, in seconds, with nothing left behind; the
  traceback only with ``HYDRA_FULL_ERROR=1``; an unreachable hub is detected in seconds, and the model and the
  data are resolved before anything is loaded or written.
- The joblib multirun of the issue (``seed=1,2`` into one run directory) refuses one job, naming ``seed``.
- ``model=qwen2.5-1.5b model.path=<dir>`` runs on a tiny random Qwen2 checkpoint saved here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tiny_models import save_tiny_checkpoint
from _tiny_tokenizer import char_tokenizer_flavour
from hydra.core.global_hydra import GlobalHydra
from test_harness import composed

from evaluation import harness
from evaluation import run as entry

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
SMALL = ["dataset.context_length=200", "dataset.depths=[0,100]", "max_new_tokens=2"]


def cli_env(tmp_path: Path, offline: bool = True, **env) -> dict[str, str]:
    """The environment of a command a user runs from the checkout (its code, not an installed copy): a Hugging
    Face cache of its own under ``tmp_path``, offline unless told, none of pytest's settings."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTEST_XDIST_WORKER", "HYDRA_FULL_ERROR")
    }
    environ.update({"HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT), **env})
    if offline:
        environ["HF_HUB_OFFLINE"] = "1"
    return environ


def _run(args: list[str], tmp_path: Path, offline: bool = True, timeout: float = 300, **env) -> tuple:
    """``python -m <args>`` from the checkout (:func:`cli_env`); returns (rc, stdout, stderr, seconds)."""
    environ = cli_env(tmp_path, offline, **env)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start


def _left(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.mark.parametrize(
    "args, message",
    [
        (["evaluation.run", "compression_ratio=1.0"], r"compression_ratio=1.0 must be in [0, 1)"),
        (["evaluation.fused", "presses=[snapkv]", "ratios=[1.2]"], r"compression_ratio=1.2 must be in [0, 1)"),
        (["evaluation.run", "n_samples=0"], "n_samples=0 must be an integer >= 1"),
        (["evaluation.run", "dataset=longbench", "dataset.tasks=[nope]"], "unknown LongBench tasks ['nope']"),
        (
            ["evaluation.run", "model=qwen2.5-1.5b", "model.path=/no/such/dir"],
            "model.path=/no/such/dir is not a directory",
        ),
        (["evaluation.run", "-m", "press=snapkv,nope"], "unknown press 'nope'; valid: adakv,"),
        (["evaluation.fused", "presses=[snapkv,nope]"], "unknown press 'nope'; valid: adakv,"),
    ],
    ids=["ratio", "fused-ratio", "n_samples", "longbench-task", "model-path", "press-name", "fused-press-name"],
)
def test_bad_input_is_one_error_line_in_seconds_and_leaves_nothing(args, message, tmp_path):
    out = tmp_path / "runs"
    rc, stdout, stderr, seconds = _run([*args, f"output_dir={out}"], tmp_path)
    assert rc == 1 and stderr.splitlines() == [stderr.strip()] and stderr.startswith("error: "), stderr
    assert message in stderr
    assert seconds < 60  # before torch and kvpress are imported (about 2 s on an idle machine)
    assert _left(out) == []


def test_full_traceback_on_request(tmp_path):
    out = tmp_path / "runs"
    rc, _, stderr, _ = _run(
        ["evaluation.run", "compression_ratio=1.0", f"output_dir={out}"], tmp_path, HYDRA_FULL_ERROR="1"
    )
    assert rc == 1 and "Traceback (most recent call last)" in stderr and "check_ratio" in stderr
    assert _left(out) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["model=qwen2.5-1.5b"],
            "model 'qwen2.5-1.5b' (Qwen/Qwen2.5-1.5B-Instruct) is not in the local Hugging Face "
            "cache and the hub is unreachable",
        ),
        (
            ["dataset=longbench"],
            "LongBench needs the Hugging Face dataset 'THUDM/LongBench' (its data.zip), which could "
            "not be loaded (the hub is unreachable and it is not in the local cache)",
        ),
    ],
    ids=["hub-model", "hub-data"],
)
def test_no_network_is_detected_in_seconds(args, message, tmp_path):
    """No HF_HUB_OFFLINE, a hub endpoint that never answers (TEST-NET-1), an empty cache: one line, fast."""
    out = tmp_path / "runs"
    rc, _, stderr, seconds = _run(
        ["evaluation.run", *args, f"output_dir={out}"], tmp_path, offline=False, HF_ENDPOINT="http://192.0.2.1"
    )
    assert rc == 1 and stderr.splitlines() == [stderr.strip()] and message in stderr, stderr
    assert seconds < 30  # a 3 s check; retrying the hub with backoff took about a minute before
    assert _left(out) == []


def test_data_is_resolved_before_the_model_is_loaded(monkeypatch, tmp_path):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded before the data is found")

    monkeypatch.setattr(harness, "get_model", no_model)
    cfg = composed("dataset=longbench", f"dataset.source={tmp_path / 'nowhere'}", f"output_dir={tmp_path / 'runs'}")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a hub id"):
        entry.run(cfg, {"press": "page_entrokv", "dataset": "longbench", "model": "smollm2-135m"})
    assert _left(tmp_path / "runs") == []


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny random Qwen2 checkpoint (the qwen2.5-1.5b family's shape ratios) with a BOS-less ChatML tokenizer."""
    path = tmp_path_factory.mktemp("qwen2")
    save_tiny_checkpoint("qwen2.5-1.5b", path, char_tokenizer_flavour(bos=False, chat_template=True))
    return path


def test_a_local_qwen2_checkpoint_runs_through_the_harness(qwen2_dir, tmp_path, monkeypatch):
    """``python -m evaluation.run model=qwen2.5-1.5b model.path=<dir>`` (Hydra's entry point, in this process to
    spare an interpreter start; the joblib test below runs the same model in subprocesses)."""
    out = tmp_path / "runs"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "evaluation.run",
            "model=qwen2.5-1.5b",
            f"model.path={qwen2_dir}",
            "press=snapkv",
            "n_samples=2",
            *SMALL,
            f"output_dir={out}",
            f"hydra.run.dir={out}/.hydra/run",
        ],
    )
    GlobalHydra.instance().clear()
    try:
        entry.main()
    finally:
        GlobalHydra.instance().clear()
        harness._MODEL_CACHE.clear()
    run_dir = out / "needle" / "qwen2.5-1.5b" / "snapkv" / "cr0.5"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n"] == 2 and metrics["effective_compression"] >= 0.5 - 1 / 200
    model, _ = harness.get_model(composed("model=qwen2.5-1.5b", f"model.path={qwen2_dir}").model, "cpu", "sdpa")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.model.layers[0].self_attn.q_proj.bias is not None
    assert f"path: {qwen2_dir}" in (run_dir / "config.yaml").read_text()


def test_joblib_multirun_of_two_seeds_refuses_one(qwen2_dir, tmp_path):
    """The issue's command: two parallel jobs, seeds 1 and 2, one run directory. One job is refused naming the
    seed; the directory holds one seed's rows, once each."""
    out = tmp_path / "runs"
    rc, _, stderr, _ = _run(
        [
            "evaluation.run",
            "-m",
            "hydra/launcher=joblib_local",
            "press=knorm",
            "seed=1,2",
            "n_samples=2",
            "model=qwen2.5-1.5b",
            f"model.path={qwen2_dir}",
            *SMALL,
            f"output_dir={out}",
        ],
        tmp_path,
    )
    assert rc == 1
    (line,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert "other settings (seed: 1 -> 2)" in line or "other settings (seed: 2 -> 1)" in line
    run_dir = out / "needle" / "qwen2.5-1.5b" / "knorm" / "cr0.5"
    rows = harness.read_predictions(run_dir / "predictions.jsonl")
    assert len(rows) == len({r["id"] for r in rows}) <= 2
    if (run_dir / "metrics.json").exists():
        assert json.loads((run_dir / "metrics.json").read_text())["n"] == len(rows) == 2
