"""The grid queue (``scripts/queue/``, issue 31; results/.staging/README.md): ``make_jobs.sh`` writes the jobs the
4k / 8k grids ran, for presses and datasets that exist today, and two ``worker.sh`` processes share a queue of jobs:
each job run once, its finished shard directories copied into the staging directory and committed, a failed or
unfinished job set aside, a stale claim (its worker gone) taken up again."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from evaluation.harness import config_choices

ROOT = Path(__file__).resolve().parent.parent
QUEUE = ROOT / "scripts" / "queue"
DONE = ROOT / "results" / ".staging" / "done.txt"


def _env(tmp_path: Path, **paths) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUE_")}
    env.update({f"QUEUE_{k.upper()}": str(v) for k, v in paths.items()})
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return env


def _jobs(path: Path) -> list[tuple[str, str, str, int]]:
    return [(n, c, g, int(k)) for n, c, g, k in (line.split("|") for line in path.read_text().splitlines())]


def test_make_jobs_writes_the_jobs_the_staged_grids_ran(tmp_path):
    subprocess.run(["bash", str(QUEUE / "make_jobs.sh")], env=_env(tmp_path, dir=tmp_path), check=True, timeout=60)
    jobs = _jobs(tmp_path / "jobs.txt")
    assert sorted(n for n, *_ in jobs) == sorted(DONE.read_text().split())  # every job the grid ran, once
    presses, datasets = set(config_choices("press")), set(config_choices("dataset"))
    for name, command, glob, count in jobs:
        for part in command.split(" && "):
            words = shlex.split(part)
            assert words[:3] in (["$PY", "-m", "evaluation.fused"], ["$PY", "-m", "evaluation.run"]), (name, part)
            settings = dict(w.split("=", 1) for w in words[3:] if "=" in w)
            named = re.sub(r"[\[\]]", "", settings.get("presses", settings.get("press", ""))).split(",")
            assert set(named) <= presses, (name, set(named) - presses)
            assert settings["dataset"] in datasets, name
            assert settings["output_dir"].startswith("$OUT/"), name
        assert count > 0 and glob.startswith(settings["output_dir"].removeprefix("$OUT/")), name


def _fake_job(name: str, shard: str, finished: bool = True) -> str:
    """A job line whose command writes one shard directory under $OUT as the harness would (no model is run)."""
    where = f"$OUT/g/m/{name}/cr0.5/{shard}"
    write = f"mkdir -p {where} && echo '{{\"id\": 1}}' > {where}/predictions.jsonl && echo 'a: 1' > {where}/config.yaml"
    if finished:
        write += f" && echo '{{}}' > {where}/metrics.json"
    return f"{name}|{write}|g/m/{name}/cr*/{shard}|1"


@pytest.mark.timeout(120)
def test_two_workers_run_every_job_once_and_commit_its_shards(tmp_path):
    repo, queue, out = tmp_path / "repo", tmp_path / "queue", tmp_path / "out"
    stage = repo / "results" / ".staging"
    stage.mkdir(parents=True)
    (stage / "done.txt").write_text("")
    env = _env(tmp_path, dir=queue, repo=repo, out=out)
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "start"], check=True, env=env)
    lines = [_fake_job(f"ok{i}", f"shard_{i}_of_4") for i in range(4)]
    lines += [_fake_job("unfinished", "shard_0_of_1", finished=False), "broken|false|g/m/broken/cr*/x|1"]
    queue.mkdir()
    (queue / "jobs.txt").write_text("\n".join(lines) + "\n")
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (queue / "claims" / "ok1").mkdir(parents=True)  # cut off by a stop: its worker (a pid that is no worker) is gone
    (queue / "claims" / "ok1" / "owner").write_text(f"{boot} {os.getpid()}\n")
    (queue / "claims" / "ok2").mkdir()  # an older worker's claim, without an owner file

    # the second worker starts once the first has cleared the claims (an ownerless claim goes only when no other
    # worker runs), then both take jobs from the one queue
    workers = [subprocess.Popen(["bash", str(QUEUE / "worker.sh")], env=env)]
    log = queue / "log.txt"
    deadline = time.monotonic() + 60
    while "start " not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    workers.append(subprocess.Popen(["bash", str(QUEUE / "worker.sh")], env=env))
    assert [w.wait(timeout=100) for w in workers] == [0, 0]

    done = (stage / "done.txt").read_text().split()
    assert sorted(done) == ["ok0", "ok1", "ok2", "ok3"]  # each once: the stale claims were taken up again
    for i in range(4):
        shard = stage / "g" / "m" / f"ok{i}" / "cr0.5" / f"shard_{i}_of_4"
        assert sorted(p.name for p in shard.iterdir()) == ["config.yaml", "metrics.json", "predictions.jsonl"]
    assert sorted(p.name for p in (queue / "failed").iterdir()) == ["broken", "unfinished"]
    assert not (stage / "g" / "m" / "unfinished").exists()
    log = log.read_text()
    assert "removed the stale claim ok1" in log and "removed the stale claim ok2" in log
    assert "unfinished: 0 of 1 shard dirs finished" in log and "FAILED broken" in log
    subjects = subprocess.run(
        ["git", "-C", str(repo), "log", "--format=%s"], capture_output=True, text=True, check=True, env=env
    ).stdout.split("\n")
    assert sorted(s for s in subjects if s.startswith("Staging")) == [
        f"Staging (issue 31): ok{i}, 1 shard runs" for i in range(4)
    ]
    tracked = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "results/.staging"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(tracked) == 1 + 4 * 3  # done.txt and every copied file, all committed
    assert not subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
