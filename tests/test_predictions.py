"""A finished run's rows stored compressed (issue 65 item 7, :mod:`evaluation.predictions`): the same bytes in and
out, refused for an unfinished run, skipped while another process writes it; a compressed run is found finished,
resumes and grows; the report, merge_runs, migrate and the claims ledger read either form alike; the committed runs
are stored compressed and hold the rows they held plain."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from test_harness import composed
from test_merge_runs import make_run
from test_report import _write_run
from test_run_directory import NAMES as KNORM
from test_run_directory import _settings, _tiny

from evaluation import harness, predictions
from evaluation import run as entry
from evaluation.compress_runs import compress_runs, main
from evaluation.merge_runs import merge_runs
from evaluation.migrate import migrate, migrated_row
from evaluation.predictions import COMPRESSED, NAME, compress_run, read_predictions, restore_run, rows_file
from evaluation.report import build_report
from evaluation.studies.claims_ledger.artifacts import jsonl_rows

ROOT = Path(__file__).resolve().parent.parent
ROWS = [{"id": "a", "score": 1.0, "prediction": "é ✓"}, {"id": "b", "score": 0.0, "prediction": "x"}]


def _run(path: Path, rows=ROWS, finished: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / NAME).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    if finished:
        (path / "metrics.json").write_text("{}")
    return path


def test_compress_keeps_the_bytes_and_refuses_an_unfinished_run(tmp_path):
    run = _run(tmp_path / "a")
    plain = (run / NAME).read_bytes()
    assert compress_run(run) and not (run / NAME).exists() and rows_file(run) == run / COMPRESSED
    assert gzip.decompress((run / COMPRESSED).read_bytes()) == plain
    assert read_predictions(run / NAME) == ROWS  # the plain name reads the compressed file
    assert not compress_run(run)  # nothing left to compress
    again = _run(tmp_path / "b")
    compress_run(again)
    assert (again / COMPRESSED).read_bytes() == (run / COMPRESSED).read_bytes()  # no name or time in the header

    unfinished = _run(tmp_path / "c", finished=False)
    with pytest.raises(ValueError, match=r"c has no metrics.json: an unfinished run keeps appending"):
        compress_run(unfinished)
    assert (unfinished / NAME).read_bytes() == plain and not (unfinished / COMPRESSED).exists()

    assert restore_run(run) and (run / NAME).read_bytes() == plain and rows_file(run) == run / NAME
    assert not (run / COMPRESSED).exists()
    both = tmp_path / "d"  # a compression cut off between its steps: the plain file is the run's
    shutil.copytree(again, both)
    (both / NAME).write_bytes(plain + b'{"id": "c"}\n')
    assert rows_file(both) == both / NAME and len(read_predictions(both / NAME)) == 3
    assert not restore_run(both) and not (both / COMPRESSED).exists()

    predictions.write_text(again, '{"id": "z"}\n')  # a rewrite keeps the run's form
    assert rows_file(again) == again / COMPRESSED and read_predictions(again / NAME) == [{"id": "z"}]
    (again / COMPRESSED).write_bytes((again / COMPRESSED).read_bytes()[:-6])
    with pytest.raises(ValueError, match=r"predictions.jsonl.gz is not a whole gzip file"):
        read_predictions(again / NAME)


def test_the_command_compresses_finished_runs_only_and_can_run_again(tmp_path, capsys):
    done = _run(tmp_path / "r" / "done")
    unfinished = _run(tmp_path / "r" / "unfinished", finished=False)
    busy = _run(tmp_path / "r" / "busy")
    with FileLock(busy / harness.LOCK_NAME, thread_local=False, is_singleton=False):  # another process writes it
        assert main([str(tmp_path / "r"), "--dry-run"]) == 0
        assert rows_file(done) == done / NAME
        assert main([str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert f"left plain (no metrics.json, unfinished): {unfinished}" in out
    assert f"left plain (being written by another process): {busy}" in out
    assert "would compress 1 finished run(s)" in out and "compressed 1 finished run(s)" in out
    assert [rows_file(d).name for d in (done, unfinished, busy)] == [COMPRESSED, NAME, NAME]
    found = compress_runs([tmp_path / "r"])  # run again once the writer is gone: the rest, once
    assert found.done == [busy] and found.unfinished == [unfinished]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    assert "error: python -m evaluation.compress_runs: " in capsys.readouterr().err


@pytest.fixture
def tiny(monkeypatch):
    model, tok = _tiny()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))


@pytest.mark.usefixtures("one_thread")
def test_a_compressed_run_is_found_finished_and_resumes(tiny, tmp_path, monkeypatch):
    cfg = composed(*[s for s in _settings(tmp_path, seed=3) if not s.startswith("shard=")])
    metrics = entry.run(cfg, KNORM)
    out = harness.run_dir(cfg, KNORM)
    rows = read_predictions(out / NAME)
    assert len(rows) == 4 and compress_runs([tmp_path]).done == [out]

    appended = []
    monkeypatch.setattr(harness, "append_row", lambda path, row: appended.append(row["id"]))
    assert harness.check_existing_run(cfg, KNORM) == metrics  # finished, in its compressed form
    assert entry.run(cfg, KNORM) == metrics and rows_file(out) == out / COMPRESSED  # skipped, left compressed
    (out / "metrics.json").unlink()  # unfinished again: it resumes after its rows, in its plain file
    assert entry.run(cfg, KNORM)["n"] == 4 and appended == []
    assert rows_file(out) == out / NAME and not (out / COMPRESSED).exists()
    assert read_predictions(out / NAME) == rows  # every row as it was, timings too


def test_grow_reopens_a_compressed_run_with_its_rows(tmp_path):
    names = {"press": "snapkv", "dataset": "ruler_smoke", "model": "smollm2-135m"}
    base = ["press=snapkv", "dataset=ruler_smoke", "compression_ratio=0.5", f"output_dir={tmp_path}"]
    out, _ = harness.start_run(composed(*base, "n_samples=1"), names)
    harness.append_row(out / NAME, {"id": "niah_single_1_1024_0", "score": 1.0})
    (out / "metrics.json").write_text(json.dumps({"score": 1.0, "n": 1}))
    text = (out / NAME).read_text()
    compress_run(out)
    assert harness.start_run(composed(*base, "n_samples=3", "grow=true"), names)[1] is None
    assert (out / NAME).read_text() == text and not (out / COMPRESSED).exists()
    assert not (out / "metrics.json").exists()
    (out / "metrics.json").write_text("{}")
    compress_run(out)
    harness.start_run(composed(*base, "n_samples=3", "overwrite=true"), names)  # overwrite leaves neither form
    assert rows_file(out) is None


def test_the_report_merge_migrate_and_the_ledger_read_either_form(tmp_path):
    root = tmp_path / "runs"
    _write_run(root, "no_press", "0", [("a1", "A", 1), ("b1", "B", 1)])
    _write_run(root, "snapkv", "0.5", [("a1", "A", 1)], shard="shard_0_of_2")
    _write_run(root, "snapkv", "0.5", [("b1", "B", 0)], shard="shard_1_of_2")
    _write_run(root, "knorm", "0.5", [("a1", "A", 0), ("b1", "B", 1)])
    _write_run(root, "tova", "0.5", [("a1", "A", 0)], finished=False)
    plain = build_report(root, tmp_path / "plain", command="report", plots=False).parent
    assert len(compress_runs([root]).done) == 4  # every finished piece; the unfinished run stays plain
    packed = build_report(root, tmp_path / "packed", command="report", plots=False).parent
    names = sorted(p.relative_to(plain) for p in plain.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(packed) for p in packed.rglob("*") if p.is_file())
    for name in names:
        assert (plain / name).read_text() == (packed / name).read_text(), name

    ledger = tmp_path / "ledger"  # a claim's pointer names plain files; a compressed run answers for its own
    compress_run(_run(ledger / "p" / "cr0.5"))
    _run(ledger / "q" / "cr0.5", finished=False)
    assert jsonl_rows(ledger, "*/cr0.5/predictions.jsonl") == [
        *[("p/cr0.5/predictions.jsonl.gz", r) for r in ROWS],
        *[("q/cr0.5/predictions.jsonl", r) for r in ROWS],
    ]

    results, staging = tmp_path / "results", tmp_path / "staging"
    target = make_run(results, [1024], ["a-1024-0"])
    make_run(staging, [2048], ["a-2048-0"], "shard=0/2")
    make_run(staging, [2048], ["b-2048-0"], "shard=1/2")
    compress_runs([results, staging])  # a shard read compressed too
    assert merge_runs(staging, results, "merge")[0].new_rows == 2
    assert rows_file(target) == target / COMPRESSED  # the joined run stays compressed
    assert [r["id"] for r in read_predictions(target / NAME)] == ["a-1024-0", "a-2048-0", "b-2048-0"]

    old = tmp_path / "old" / "d" / "m" / "snis" / "cr0.5"  # a row of the rule before kept-entry counts
    row = {"id": "a", "effective_compression": 0.4, "physical_compression": 0.4}
    row["press_stats"] = {"logical_compression": 0.5, "num_layers_evicted": 2}
    _run(old, rows=[row])
    (old / "config.yaml").write_text("seed: 1\n")
    compress_run(old)
    assert migrate(tmp_path / "old")["rows"] == 1
    assert rows_file(old) == old / COMPRESSED and read_predictions(old / NAME)[0]["effective_compression"] == 0.5


def _git(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True, **kwargs)


def _tracked() -> list[str]:
    try:
        return _git("ls-files", "-z", "results", text=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an archive)
        pytest.skip("needs the repository's git history")


def test_every_committed_finished_run_stores_its_rows_compressed():
    tracked = set(_tracked())
    plain = sorted(p for p in tracked if p.endswith("/" + NAME) and p.replace(NAME, "metrics.json") in tracked)
    assert not plain, (
        f"{len(plain)} finished run(s) committed with plain rows, e.g. {plain[:3]}: "
        "python -m evaluation.compress_runs results (make compress), then commit the .gz files"
    )


def test_committed_compressed_runs_hold_the_rows_they_held_plain():
    """Each committed ``predictions.jsonl.gz`` against the plain file the commit that compressed it removed
    (``git show <commit>^:<path>``), line by line: the same bytes, or a row that ``python -m evaluation.migrate``
    changed since (:func:`evaluation.migrate.migrated_row` of the plain row, under the run's settings: e.g. the needle
    rows' ``metadata.target_length``); a run committed compressed from the start has no such file."""
    packed = [p for p in _tracked() if p.endswith("/" + COMPRESSED)]
    log = _git("log", "--diff-filter=D", "--format=commit %H", "--name-only", "--", "results/*" + NAME, text=True)
    removed, commit = {}, None
    for line in log.stdout.splitlines():
        if line.startswith("commit "):
            commit = line.split()[1]
        elif line.endswith(NAME):
            removed.setdefault(line, commit)  # newest first: the commit that last removed the plain file
    pairs = [(p, removed[p.removesuffix(".gz")]) for p in packed if p.removesuffix(".gz") in removed]
    if not pairs:
        pytest.skip("no committed run was compressed from a committed plain file")
    query = "".join(f"{c}^:{p.removesuffix('.gz')}\n" for p, c in pairs)
    blobs = _git("cat-file", "--batch", input=query.encode()).stdout
    at = 0
    for path, _ in pairs:
        header_end = blobs.index(b"\n", at)
        size = int(blobs[at:header_end].split()[2])
        before = blobs[header_end + 1 : header_end + 1 + size]
        at = header_end + 1 + size + 1
        settings = yaml.safe_load((ROOT / path).parent.joinpath("config.yaml").read_text(encoding="utf-8"))
        now, then = gzip.decompress((ROOT / path).read_bytes()).splitlines(), before.splitlines()
        assert len(now) == len(then), path
        for new, old in zip(now, then):
            assert new == old or json.loads(new) == migrated_row(json.loads(old), settings), path
        assert read_predictions(ROOT / path) == [json.loads(line) for line in now], path
