"""Two processes on one run directory (issue 17 item 2): the directory is claimed with a file lock for the whole
run; other settings are refused naming the changed keys (before any row exists, too), the same settings wait and
skip what is done, a killed writer frees the directory, and the report says a run being written is in progress.

The writers are real processes (``multiprocessing`` with ``fork``, each with its own tiny model); a shard directory
is used throughout (``shard=0/2``). The joblib multirun of the issue runs as a subprocess in ``tests/test_cli.py``.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
from _tiny_models import make_tiny_family
from _tiny_tokenizer import char_tokenizer
from test_harness import composed

from evaluation import harness
from evaluation import run as entry
from evaluation.report import build_report, scan

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = {"press": "knorm", "dataset": "needle", "model": "smollm2-135m"}
CTX = multiprocessing.get_context("fork")


def _settings(out, seed: int) -> list[str]:
    return [
        "press=knorm",
        "compression_ratio=0.5",
        f"seed={seed}",
        "n_samples=4",
        "shard=0/2",
        "max_new_tokens=2",
        "dataset.context_length=200",
        "dataset.depths=[0,100]",
        f"output_dir={out}",
    ]


def _tiny():
    return make_tiny_family("llama-3.2-3b", vocab=128, seed=1), char_tokenizer()


def _writer(out, seed: int, pause_at: int, paused, release, results) -> None:
    """A harness run (another process) that stops before appending its ``pause_at``-th row (0: before any row)
    until ``release`` is set."""
    model, tok = _tiny()
    harness.get_model = lambda *args, **kwargs: (model, tok)
    real, calls = harness.append_row, []

    def append(path, row):
        if len(calls) == pause_at:
            paused.set()
            release.wait(120)
        calls.append(row["id"])
        real(path, row)

    harness.append_row = append
    try:
        results.put(("ok", entry.run(composed(*_settings(out, seed)), NAMES)))
    except ValueError as err:
        results.put(("refused", str(err)))


def _start(out, seed: int, pause_at: int):
    paused, release, results = CTX.Event(), CTX.Event(), CTX.SimpleQueue()
    proc = CTX.Process(target=_writer, args=(out, seed, pause_at, paused, release, results), daemon=True)
    proc.start()
    assert paused.wait(120), "the writer never reached its pause"
    return proc, release, results


@pytest.fixture
def tiny(monkeypatch):
    model, tok = _tiny()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))


def _run_dir(out):
    return out / "needle" / "smollm2-135m" / "knorm" / "cr0.5" / "shard_0_of_2"


def test_other_settings_are_refused_before_any_row(tiny, tmp_path):
    """A writer holds the directory and has written config.yaml but no row yet: a job with seed=2 is refused at
    once naming ``seed: 1 -> 2``; after the writer finished, it is refused again (the directory holds its rows)."""
    proc, release, results = _start(tmp_path, seed=1, pause_at=0)
    try:
        assert not (_run_dir(tmp_path) / "predictions.jsonl").exists()
        assert harness.run_in_progress(_run_dir(tmp_path))
        start = time.perf_counter()
        with pytest.raises(
            ValueError,
            match=r"is being written by another process with other settings "
            r"\(seed: 1 -> 2\)",
        ):
            entry.run(composed(*_settings(tmp_path, seed=2)), NAMES)
        assert time.perf_counter() - start < 30  # refused while the writer still holds it, not after
    finally:
        release.set()
    status, metrics = results.get()
    proc.join(60)
    assert status == "ok" and metrics["n"] == 2
    rows = harness.read_predictions(_run_dir(tmp_path) / "predictions.jsonl")
    assert len(rows) == 2 and len({r["id"] for r in rows}) == 2  # one seed's rows, once each
    assert not harness.run_in_progress(_run_dir(tmp_path))
    with pytest.raises(ValueError, match=r"holds a run made with other settings \(seed: 1 -> 2\)"):
        entry.run(composed(*_settings(tmp_path, seed=2)), NAMES)


def test_same_settings_wait_a_killed_writer_frees_the_directory_and_the_report_says_in_progress(tiny, tmp_path):
    proc, release, _ = _start(tmp_path, seed=1, pause_at=1)  # one row written, the second pending
    run_dir = _run_dir(tmp_path)
    (first,) = harness.read_predictions(run_dir / "predictions.jsonl")
    (run,) = scan(tmp_path)
    assert run.problems == [
        "cr0.5/shard_0_of_2 is in progress (another process is writing it)",
        "shards [1] of 2 missing",
    ]
    readme = build_report(tmp_path, tmp_path / "report", plots=False).read_text()
    assert "shard_0_of_2 is in progress" in readme and " *" in readme  # incomplete, never finished
    proc.kill()  # the kernel drops its lock
    proc.join(60)
    (run,) = scan(tmp_path)
    assert run.problems[0] == "cr0.5/shard_0_of_2 has no metrics.json (unfinished)"
    # a new writer resumes (one row left) and pauses before it; a job with the same settings waits for it, then
    # finds the run finished and skips it
    proc, release, results = _start(tmp_path, seed=1, pause_at=0)
    timer = threading.Timer(1.5, release.set)
    timer.start()
    start = time.perf_counter()
    try:
        waited = entry.run(composed(*_settings(tmp_path, seed=1)), NAMES)
    finally:
        timer.cancel()
        release.set()
    assert time.perf_counter() - start >= 1.0
    status, metrics = results.get()
    proc.join(60)
    assert status == "ok" and waited == metrics and metrics["n"] == 2
    rows = harness.read_predictions(run_dir / "predictions.jsonl")
    assert len(rows) == 2 and rows[0] == first and len({r["id"] for r in rows}) == 2
    assert scan(tmp_path)[0].problems == ["shards [1] of 2 missing"]  # finished: only shard 1 is missing
