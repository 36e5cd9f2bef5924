"""Sweeps as separate jobs through Hydra's submitit launchers (issue 33), as a user runs them, in subprocesses.

- ``hydra/launcher=submitit_local``: the shared-prefill sweep as an array of two shards, one process each, gives
  the predictions of the same sweep run in one process (Hydra's basic launcher), and the report merges the shards.
- ``hydra/launcher=slurm`` (marked ``slurm``), on the one-node cluster of ``scripts/slurm_local.sh``: the same
  sweep as a two-job array; one job is cancelled mid-run (``scancel``) and the sweep resubmitted: no row is lost or
  duplicated, the rows written before the kill are kept as they were, the predictions equal the local run's and the
  merged report is complete. Two array jobs with other settings never write one run directory (the run-directory
  lock holds across jobs). Skipped, with the script's reason, where SLURM cannot be installed (its exit status 3).

The model is a tiny random Llama saved as a checkpoint (``model.path=``) whose greedy answers vary by example, so
equal predictions mean something; the jobs run the checkout's code with the Python running the tests, on one torch
thread each (``OMP_NUM_THREADS=1``, as the local run in this process), two at a time on two cores.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _tiny_tokenizer import char_tokenizer
from conftest import make_sharp_tiny_llama
from hydra.core.global_hydra import GlobalHydra
from test_cli import ROOT, _run, cli_env

from evaluation import fused, harness, report

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
N = 32  # examples of the sweep, 16 per shard
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PRESSES = ["no_press", "knorm", "tova"]
SWEEP = [
    "shard=0/2,1/2",
    f"presses=[{','.join(PRESSES)}]",
    "ratios=[0.75]",
    "model=llama-3.2-3b",
    "dataset.context_length=256",
    "max_new_tokens=6",
    f"n_samples={N}",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    make_sharp_tiny_llama().save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _sweep(checkpoint: Path, out: Path, *launcher: str) -> list[str]:
    """``python -m evaluation.fused -m`` over the two shards of :data:`SWEEP` into ``out``."""
    return ["evaluation.fused", "-m", *launcher, *SWEEP, f"model.path={checkpoint}", f"output_dir={out}"]


def _predictions(out: Path) -> dict[tuple[str, float, str], str]:
    """``(press, ratio, example id) -> prediction`` over every run below ``out``, shards merged by the report."""
    return {(run.press, run.ratio, row["id"]): row["prediction"] for run in report.scan(out) for row in run.rows}


@pytest.fixture(scope="module")
def local_predictions(checkpoint, tmp_path_factory, one_thread) -> dict[tuple[str, float, str], str]:
    """The sweep run locally: ``python -m evaluation.fused -m ...`` (Hydra's basic launcher, both shards one after
    the other) in this process, on one torch thread."""
    out = tmp_path_factory.mktemp("local") / "runs"
    GlobalHydra.instance().clear()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", _sweep(checkpoint, out))
            fused.main()
    finally:
        GlobalHydra.instance().clear()
        harness._MODEL_CACHE.clear()
    predictions = _predictions(out)
    assert len(predictions) == len(PRESSES) * N
    assert len(set(predictions.values())) > N / 2  # the answers vary: equal predictions below mean something
    return predictions


def _check_merged(out: Path, local: dict) -> None:
    """Every run of the sweep below ``out`` holds each example once, its shards complete, with the local run's
    predictions; the report's summary counts every example."""
    runs = report.scan(out)
    assert sorted(run.press for run in runs) == sorted(PRESSES)
    for run in runs:
        assert run.problems == [] and len(run.rows) == N == len({row["id"] for row in run.rows})
    assert _predictions(out) == local
    report.main([str(out), "--out", str(out / "report"), "--no-plots"])
    with open(out / "report" / "tables" / "needle__llama-3.2-3b__summary.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    assert sorted((row["press"], int(row["n"]), row["complete"]) for row in summary) == [
        (press, N, "True") for press in sorted(PRESSES)
    ]


def test_submitit_local_shards_equal_the_local_sweep_and_merge(checkpoint, local_predictions, tmp_path):
    out = tmp_path / "runs"
    rc, _, stderr, _ = _run(_sweep(checkpoint, out, "hydra/launcher=submitit_local"), tmp_path, **ONE_THREAD)
    assert rc == 0, stderr[-3000:]
    assert len(list((out / ".hydra").glob("multirun_*/.submitit/*/*_result.pkl"))) == 2  # two jobs ran
    _check_merged(out, local_predictions)


# --- a one-node SLURM cluster (scripts/slurm_local.sh) ---------------------------------------------------------------


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The script's cluster: the running one, else one started here (state in a temporary directory) and stopped
    afterwards. Skips where the script says the machine cannot host it (exit status 3)."""
    if _script("status").returncode == 0:
        yield
        return
    state = tmp_path_factory.mktemp("slurm")
    started = _script("start", str(state))
    if started.returncode == 3:
        pytest.skip(started.stderr.strip() or "scripts/slurm_local.sh cannot start SLURM here")
    assert started.returncode == 0, started.stdout + started.stderr
    yield
    stopped = _script("stop", str(state))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def _jobs(name: str) -> dict[str, str]:
    """``array job id -> state`` of the queued and running jobs named ``name``."""
    out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i %T"], capture_output=True, text=True, check=True)
    return dict(line.split() for line in out.stdout.splitlines())


def _complete_lines(path: Path) -> int:
    """Rows a job has written so far, read without touching the file (``harness.read_predictions`` would rewrite
    a torn last line under the writer)."""
    return path.read_text().count("\n") if path.exists() else 0


def _wait_for(condition, seconds: float, what: str):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {seconds} s")


@pytest.mark.slurm
def test_slurm_array_survives_a_cancelled_job_and_equals_the_local_sweep(
    cluster, checkpoint, local_predictions, tmp_path
):
    out = tmp_path / "runs"
    name = f"kvpress-test-{uuid.uuid4().hex[:8]}"
    args = _sweep(checkpoint, out, "hydra/launcher=slurm", f"hydra.launcher.name={name}")
    log = tmp_path / "sweep.log"
    with open(log, "w") as sink:
        sweep = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, env=cli_env(tmp_path, **ONE_THREAD), stdout=sink, stderr=sink
        )
    try:
        shard0 = out / "needle" / "llama-3.2-3b" / "knorm" / "cr0.75" / "shard_0_of_2"
        _wait_for(lambda: _complete_lines(shard0 / "predictions.jsonl") >= 1, 300, "row of shard 0")
        (job,) = [j for j in _jobs(name) if j.endswith("_0")]
        # its step (the job's Python) killed at once: a plain `scancel <job>` sends SIGTERM, which submitit ignores,
        # and SIGKILL seconds later (KillWait), by which time this small shard has finished
        subprocess.run(["scancel", "--signal=KILL", f"{job}.0"], check=True)
        _wait_for(lambda: job not in _jobs(name), 60, f"end of job {job}'s processes")
        before = {}
        for run in out.glob("needle/*/*/*/shard_0_of_2"):  # killed mid-run: some rows, no metrics
            before[run] = (run / "predictions.jsonl").read_text()
            assert 1 <= before[run].count("\n") < N // 2 and not (run / "metrics.json").exists(), run
        assert len(before) == len(PRESSES)

        # resubmitted, the killed shard alone, while the first command waits for submitit to see the failure
        resubmit = ["shard=0/2" if arg == SWEEP[0] else arg for arg in args]
        rc, stdout, stderr, _ = _run(resubmit, tmp_path, **ONE_THREAD)
        assert rc == 0, (stdout + stderr)[-3000:]
        sweep.wait(timeout=300)
    finally:
        sweep.kill()
    text = log.read_text()
    assert sweep.returncode != 0 and f"{job} (task: 0)" in text and "FAILED" in text, text[-3000:]
    _wait_for(lambda: not _jobs(name), 120, "end of the first array's job 1")
    for run, text in before.items():  # resumed after its last complete row; the rows before the kill unchanged
        complete = text[: text.rfind("\n") + 1]
        assert (run / "predictions.jsonl").read_text().startswith(complete)
        assert json.loads((run / "metrics.json").read_text())["n"] == N // 2
    _check_merged(out, local_predictions)


@pytest.mark.slurm
def test_slurm_array_jobs_with_other_settings_never_share_a_run_directory(cluster, checkpoint, tmp_path):
    """Two jobs, seeds 1 and 2, one run directory (the directory does not name the seed): one job is refused,
    naming the seed; the directory holds one seed's rows, once each."""
    out = tmp_path / "runs"
    name = f"kvpress-test-{uuid.uuid4().hex[:8]}"
    args = [
        "evaluation.run",
        "-m",
        "hydra/launcher=slurm",
        f"hydra.launcher.name={name}",
        "press=knorm",
        "seed=1,2",
        "n_samples=4",
        "model=llama-3.2-3b",
        f"model.path={checkpoint}",
        "dataset.context_length=256",
        "max_new_tokens=2",
        f"output_dir={out}",
    ]
    # the array's end, read from SLURM (the command itself notices a failed job only at submitit's next sacct call,
    # up to half the time elapsed later; the test above checks that it fails)
    sweep = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=cli_env(tmp_path, **ONE_THREAD))
    try:
        logs = out / ".hydra"
        _wait_for(lambda: len(list(logs.glob("*/.submitit/*_*/"))) == 2 and not _jobs(name), 300, "end of the jobs")
    finally:
        sweep.kill()
        sweep.wait()
    sacct = ["sacct", "-n", "-X", "--name", name, "-o", "State", "--parsable2"]

    def states() -> list[str]:
        return sorted(subprocess.run(sacct, capture_output=True, text=True, check=True).stdout.split())

    _wait_for(lambda: states() == ["COMPLETED", "FAILED"], 30, "one job completed and one failed")
    errors = [
        line
        for log in (out / ".hydra").glob("multirun_*/.submitit/*/*_log.err")
        for line in log.read_text().splitlines()
        if line.startswith("error: ")
    ]
    assert len(errors) == 1 and ("other settings (seed: 1 -> 2)" in errors[0] or "(seed: 2 -> 1)" in errors[0])
    run_dir = out / "needle" / "llama-3.2-3b" / "knorm" / "cr0.5"
    rows = harness.read_predictions(run_dir / "predictions.jsonl")
    assert len(rows) == len({row["id"] for row in rows}) == 4
    assert json.loads((run_dir / "metrics.json").read_text())["n"] == 4
