"""evaluation.merge_runs: finished runs of more context lengths, in shards, joined to finished runs (issue 31's 4k
grids), on hand-made run directories."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from evaluation import harness
from evaluation.merge_runs import main, merge_runs, plan_merges
from evaluation.report import scan

NAMES = {"press": "snapkv", "dataset": "ruler_smoke", "model": "smollm2-135m"}


def make_run(root, lengths, ids, *extra, press="snapkv", dataset="ruler_smoke", score=1.0):
    """A finished run of ``ids`` (hand-made rows) under ``root``, made with ``dataset.context_lengths=lengths``."""
    names = {**NAMES, "press": press, "dataset": dataset}
    overrides = [f"press={press}", f"dataset={dataset}", "compression_ratio=0.5", "n_samples=1", f"output_dir={root}"]
    overrides += [f"dataset.context_lengths=[{','.join(map(str, lengths))}]", *extra]
    cfg = harness.compose_config(overrides)
    out, _ = harness.start_run(cfg, names)
    rows = [
        {
            "id": i,
            "task": "niah",
            "score": score,
            "effective_compression": 0.5,
            "physical_compression": 0.5,
            "seconds": 1.0,
        }
        for i in ids
    ]
    for row in rows:
        harness.append_row(out / "predictions.jsonl", row)
    command = "python -m evaluation.fused " + " ".join(overrides)
    harness.note_command(out, command)
    metrics = {**harness.summarize(rows), "press": "snapkv@0.5", "command": command, "shard": cfg.get("shard")}
    (out / "metrics.json").write_text(json.dumps(metrics))
    return out


def files(run_dir):
    return {p.name: p.read_text() for p in sorted(run_dir.iterdir()) if p.is_file()}


def test_shards_of_another_length_join_the_run_as_grow_would_have_written_it(tmp_path):
    results, staging = tmp_path / "results", tmp_path / "staging"
    target = make_run(results, [1024], ["a-1024-0", "b-1024-0"])
    make_run(staging, [2048], ["a-2048-0"], "shard=0/2", score=0.0)
    make_run(staging, [2048], ["b-2048-0"], "shard=1/2", score=0.0)

    plans = merge_runs(staging, results, "python -m evaluation.merge_runs staging results")
    assert [p.target for p in plans] == [target] and plans[0].new_rows == 2
    rows = harness.read_predictions(target / "predictions.jsonl")
    assert [r["id"] for r in rows] == ["a-1024-0", "b-1024-0", "a-2048-0", "b-2048-0"]
    assert OmegaConf.load(target / "config.yaml").dataset.context_lengths == [1024, 2048]
    metrics = json.loads((target / "metrics.json").read_text())
    assert metrics["n"] == 4 and metrics["score"] == 0.5 and metrics["shard"] is None
    assert metrics["command"] == "python -m evaluation.merge_runs staging results"
    assert len(metrics["merged"]) == 3 and "shard=1/2" in metrics["merged"][2]
    assert sum("shard=" in c for c in (target / "commands.txt").read_text().splitlines()) == 2

    # the harness takes it for the finished run of the grown settings; the report for one whole run
    grown = harness.compose_config(
        [
            "press=snapkv",
            "dataset=ruler_smoke",
            "compression_ratio=0.5",
            "n_samples=1",
            f"output_dir={results}",
            "dataset.context_lengths=[1024,2048]",
            "grow=true",
        ]
    )
    assert harness.check_existing_run(grown, NAMES)["n"] == 4
    (run,) = scan(results)
    assert run.complete and len(run.rows) == 4 and sum("shard=" in c for c in run.commands) == 2

    before = files(target)  # merging again changes nothing
    assert merge_runs(staging, results, "again") == [] and files(target) == before
    assert main([str(staging), str(results), "--dry-run"]) == 0


def test_a_merge_cut_off_before_its_metrics_is_completed_by_the_same_command(tmp_path):
    """Rows and config written, metrics.json not yet (a stop in between), after an earlier merge: the same command
    writes the metrics of every row; it does not take the run for merged."""
    results = tmp_path / "results"
    target = make_run(results, [1024], ["a-1024-0"])
    make_run(tmp_path / "s2k", [2048], ["a-2048-0"], "shard=0/1")
    make_run(tmp_path / "s4k", [4096], ["a-4096-0"], "shard=0/1")
    merge_runs(tmp_path / "s2k", results, "merge 2k")
    after_2k = (target / "metrics.json").read_text()
    merge_runs(tmp_path / "s4k", results, "merge 4k")
    (target / "metrics.json").write_text(after_2k)  # as if cut off before its metrics
    (plan,) = merge_runs(tmp_path / "s4k", results, "merge 4k")
    metrics = json.loads((target / "metrics.json").read_text())
    assert plan.new_rows == 0 and metrics["n"] == 3 and metrics["command"] == "merge 4k"
    assert OmegaConf.load(target / "config.yaml").dataset.context_lengths == [1024, 2048, 4096]
    assert merge_runs(tmp_path / "s4k", results, "again") == []


def test_every_run_is_checked_before_anything_is_written(tmp_path, capsys):
    results, staging = tmp_path / "results", tmp_path / "staging"
    good = make_run(results, [1024], ["a-1024-0"])
    make_run(staging, [2048], ["a-2048-0"])  # joins good
    other = make_run(results, [1024], ["a-1024-0"], press="tova")
    make_run(staging, [2048], ["a-2048-0"], "shard=0/2", press="tova")  # shard 1 of 2 missing
    before = {p: files(p) for p in (good, other)}
    with pytest.raises(ValueError, match=r"tova/cr0.5: not whole \(shards \[1\] of 2 missing\)"):
        merge_runs(staging, results, "x")
    assert {p: files(p) for p in (good, other)} == before
    assert main([str(staging), str(results)]) == 1 and "shards [1] of 2 missing" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case, message",
    [
        ("seed", r"in more than dataset.context_lengths \(.*; seed: 42 -> 43\)"),
        ("no_target", r"no finished run to join"),
        ("unfinished_target", r"no finished run to join"),
        ("other_row", r"holds another row with id 'a-1024-0'"),
        ("sharded_target", r"a sharded run"),
        ("not_nested", r"does not declare nested_samples"),
    ],
)
def test_a_run_that_cannot_join_is_one_clear_error(tmp_path, case, message):
    results, staging = tmp_path / "results", tmp_path / "staging"
    (results / "ruler_smoke").mkdir(parents=True)
    dataset = "multidoc" if case == "not_nested" else "ruler_smoke"  # multidoc's examples do not nest
    lengths = [1024]
    if case == "sharded_target":
        make_run(results, lengths, ["a-1024-0"], "shard=0/1", dataset=dataset)
    elif case != "no_target":
        target = make_run(results, lengths, ["a-1024-0"], dataset=dataset)
        if case == "unfinished_target":
            (target / "metrics.json").unlink()
    extra = ["seed=43"] if case == "seed" else []
    ids = ["a-1024-0"] if case == "other_row" else ["a-2048-0"]
    make_run(staging, [2048], ids, *extra, dataset=dataset, score=0.0)
    with pytest.raises(ValueError, match=message):
        plan_merges(staging, results)


def test_an_empty_or_missing_source_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no run"):
        plan_merges(tmp_path / "empty", tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        plan_merges(tmp_path / "nowhere", tmp_path)


def test_dataset_joins_one_whole_grid_while_another_is_still_in_shards(tmp_path, capsys):
    results, staging = tmp_path / "results", tmp_path / "staging"
    after = make_run(results, [1024], ["a-1024-0"])
    inside = make_run(results, [1024], ["a-1024-0"], "query_aware=true")
    make_run(staging, [2048], ["a-2048-0"], "shard=0/2", "query_aware=true")
    make_run(staging, [2048], ["b-2048-0"], "shard=1/2", "query_aware=true")  # the inside grid is whole
    make_run(staging, [2048], ["a-2048-0"], "shard=0/2")  # the after grid still runs: shard 1 of 2 missing
    grid = inside.relative_to(results).parts[0]
    assert grid != after.relative_to(results).parts[0]
    before = files(after)
    with pytest.raises(ValueError, match=r"not whole \(shards \[1\] of 2 missing\)"):
        plan_merges(staging, results)

    assert main([str(staging), str(results), "--dataset", grid]) == 0
    assert "joined 1 run(s)" in capsys.readouterr().out
    assert [r["id"] for r in harness.read_predictions(inside / "predictions.jsonl")] == [
        "a-1024-0",
        "a-2048-0",
        "b-2048-0",
    ]
    assert files(after) == before
    with pytest.raises(ValueError, match=r"nope holds no run"):
        plan_merges(staging, results, "nope")
