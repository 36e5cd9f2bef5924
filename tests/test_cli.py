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
        (["evaluation.run", "-m", "press=snapkv,page_entrokvv"], "unknown press 'page_entrokvv'; did you mean "),
        (["evaluation.fused", "presses=[snapkv,nope]"], "unknown press 'nope'; did you mean no_press?"),
        # issue 65 item 3: what a command does not read is refused before any model loads
        (["evaluation.fused", "press=entroprefill", "n_samples=1"], "did you mean presses=[entroprefill]?"),
        (["evaluation.run", "+presss=snapkv"], "evaluation.run has no key 'presss'"),
    ],
    ids=[
        "ratio",
        "fused-ratio",
        "n_samples",
        "longbench-task",
        "model-path",
        "press-name",
        "fused-press-name",
        "fused-press",
        "unknown-key",
    ],
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


# -- Every command refuses what it does not read (issue 65 item 3), in this process (each entry point's ``main``
# with ``sys.argv``, as ``python -m`` calls it): one ``error:`` line, exit status 1, before any model loads.


@pytest.fixture
def no_model(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the command line must be refused before any model loads")

    monkeypatch.setattr(harness, "get_model", load)
    monkeypatch.setattr("evaluation.models.load_model", load)
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _refused(main, argv: list[str], capsys, monkeypatch) -> str:
    """The one line ``main()`` prints when it refuses ``argv`` (exit status 1)."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.splitlines() == [err.strip()] and err.startswith("error: "), err
    return err.strip()


def _hydra_mains():
    from evaluation import fused
    from evaluation.studies.bench_speed_memory import sweep
    from evaluation.uor import study

    return {"run": entry.main, "fused": fused.main, "uor": study.main, "bench_speed_memory": sweep.main}


@pytest.mark.parametrize(
    "command, args, message",
    [
        ("fused", ["press=entroprefill", "n_samples=1"], "evaluation.fused reads presses=, not press= "),
        ("fused", ["press=entroprefill"], "did you mean presses=[entroprefill]?"),
        ("fused", ["-m", "compression_ratio=0.5,0.75"], "did you mean ratios=[0.5,0.75]?"),
        ("run", ["+presss=snapkv"], "evaluation.run has no key 'presss' (a '+' would add it, and nothing would read"),
        ("run", ["+presss=snapkv"], "did you mean press?"),
        ("run", ["presss=snapkv"], "did you mean press?"),
        ("run", ["++batch_decode=false"], "it reads: compression_ratio, dataset, device,"),
        ("run", ["model.enable_thinkin=true"], "has no key 'model.enable_thinkin' "),
        ("run", ["+model.enable_thinkin=true"], "did you mean model.enable_thinking?"),
        ("run", ["--multirn", "press=snapkv"], "unrecognized option --multirn (did you mean --multirun?)"),
        ("fused", ["+presses_=[snapkv]"], "did you mean presses or press?"),
        ("uor", ["+presss.x=1"], "evaluation.uor has no key 'presss' "),
        ("uor", ["+presss.x=1"], "did you mean presses?"),
        ("uor", ["prompts.needle.lenghts=[512]"], "did you mean prompts.needle.lengths?"),
        ("bench_speed_memory", ["+presss=[snapkv]"], "did you mean presses?"),
        ("run", ["press=page_entrokvv"], "unknown press 'page_entrokvv'; did you mean page_entrokv, "),
        ("run", ["-m", "press=snapkv,page_entrokvv"], "did you mean page_entrokv, "),
        ("fused", ["dataset=needel"], "unknown dataset 'needel'; valid: continuation_loss, "),
        ("run", ["+experiment=gird"], "unknown experiment 'gird'; valid: baseline, grid, grid_paper003"),
    ],
)
def test_hydra_entry_points_refuse_what_they_do_not_read(
    command, args, message, no_model, capsys, monkeypatch, tmp_path
):
    line = _refused(_hydra_mains()[command], [command, *args, f"output_dir={tmp_path}"], capsys, monkeypatch)
    assert message in line
    assert len(line) < 400  # the closest names, not the ~90 configs of a group
    assert _left(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        ["+experiment=grid", "dataset=ruler", "hydra/launcher=joblib_local"],
        ["press=page_entrokv", "++press.page_size=16", "model=qwen3-4b", "model.path=/x", "model.enable_thinking=true"],
        ["-m", "press=snapkv,knorm", "compression_ratio=range(0.25,1,0.25)", "shard=0/2,1/2"],
        ["dataset=longbench", "dataset.tasks=[trec]", "+dataset.source=/x", "hydra.run.dir=/tmp/x", "--cfg", "job"],
        ["press=per_layer_compression", "press.compression_ratios=[0.0,0.5]", "~press.press"],
        ["dataset=ruler_shared", "protocol=shared", "questions=3", "shared_mode=turn", "query_aware=true"],
    ],
)
def test_hydra_entry_points_take_every_key_they_read(args):
    """What the README's commands use passes the check (Hydra then composes it)."""
    from evaluation.cli import check_command_line

    check_command_line(args, "config", "evaluation.run")
    fused_args = [a for a in args if not a.startswith(("press=", "compression_ratio="))]
    check_command_line(["presses=[snapkv]", "ratios=[0.5]", *fused_args], "fused", "evaluation.fused")
    check_command_line(["+press_overrides.snapkv.window_size=32", "presses=[snapkv]"], "bench_speed_memory", "bench")


def _argparse_mains():
    from evaluation import merge_runs, migrate, report
    from evaluation.studies import kvzip_cost, paired

    return {
        "python -m evaluation.report": (report.main, ["results", "--outt", "x"], "--outt (did you mean --out "),
        "evaluation.migrate": (
            migrate.main,
            ["results", "--rename_press", "a", "b"],
            "(did you mean --rename-press?)",
        ),
        "python -m evaluation.merge_runs": (merge_runs.main, ["a", "b", "--datset", "x"], "did you mean --dataset?"),
        "python -m evaluation.studies.paired": (paired.main, ["--presss", "x"], "--presss (did you mean --press"),
        "python -m evaluation.studies.kvzip_cost": (kvzip_cost.cli, ["2", "512", "out", "extra"], "arguments: extra"),
    }


@pytest.mark.parametrize("command", list(_argparse_mains()))
def test_argparse_entry_points_refuse_unknown_arguments_in_one_line(command, no_model, capsys, monkeypatch):
    main, args, message = _argparse_mains()[command]
    line = _refused(main, [command, *args], capsys, monkeypatch)
    assert "unrecognized arguments: " in line and message in line


@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "scripts").glob("*.py")))
def test_every_script_refuses_an_option_it_does_not_have(script, no_model, capsys, monkeypatch):
    """``python scripts/<name>.py --no-such-option``: one line naming it (the Hydra-based benchmark names Hydra's
    options), for every study reached through ``scripts/``."""
    import ast
    import importlib

    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    (module, function) = [(n.module, n.names[0].name) for n in tree.body if isinstance(n, ast.ImportFrom)][-1:][0]
    main = getattr(importlib.import_module(module), function)
    line = _refused(main, [f"scripts/{script}.py", "--no-such-option"], capsys, monkeypatch)
    assert "--no-such-option" in line


def test_a_kvpress_field_kvpress_does_not_check_is_refused_before_the_model_loads(no_model, tmp_path):
    names = {"press": "snapkv", "dataset": "needle", "model": "smollm2-135m"}
    for override, message in [
        ("++press.window_size=-5", r"press snapkv: SnapKVPress: press.window_size=-5 must be >= 1"),
        ("++press.window_size=0", r"press.window_size=0 must be >= 1"),
        ("++press.kernel_size=4", r"press.kernel_size=4 must be odd"),
        ("++press.window_size=64.5", r"press.window_size=64.5 must be an integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            entry.run(composed("press=snapkv", override, f"output_dir={tmp_path}"), names)
    chunkkv = {**names, "press": "chunkkv"}
    with pytest.raises(ValueError, match=r"ChunkKVPress: press.chunk_length=0 must be >= 1"):
        entry.run(composed("press=chunkkv", "++press.chunk_length=0", f"output_dir={tmp_path}"), chunkkv)
    with pytest.raises(ValueError, match=r"SnapKVPress: press.press.window_size=-1 must be >= 1"):
        entry.run(composed("press=chunkkv", "++press.press.window_size=-1", f"output_dir={tmp_path}"), chunkkv)
    streaming = {**names, "press": "streaming_llm"}
    with pytest.raises(ValueError, match=r"StreamingLLMPress: press.n_sink=-2 must be >= 0"):
        entry.run(composed("press=streaming_llm", "++press.n_sink=-2", f"output_dir={tmp_path}"), streaming)
    assert _left(tmp_path) == []
