"""evaluation.studies.paired on a hand-made results tree: matching by id, counts, sign test, interval, files."""

from __future__ import annotations

import csv
import json

import pytest
from scipy.stats import binomtest
from test_report import _write_run

from evaluation.metrics import t_interval
from evaluation.report import scan
from evaluation.studies.paired import compare, main, paired_rows


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    # ours: e1..e6 split over two shards; peer: e2..e7 (e1 and e7 are unmatched)
    _write_run(root, "ours", "0.5", [("e1", "A", 1), ("e2", "A", 1), ("e3", "A", 1)], shard="shard_0_of_2")
    _write_run(root, "ours", "0.5", [("e4", "B", 0), ("e5", "B", 0.5), ("e6", "B", 1)], shard="shard_1_of_2")
    _write_run(root, "peer", "0.5", [("e2", "A", 0), ("e3", "A", 1), ("e4", "B", 1), ("e5", "B", 0)])
    _write_run(root, "peer", "0.5", [("e6", "B", 0), ("e7", "B", 1)], shard="extra", finished=True)
    _write_run(root, "ours", "0.75", [("e1", "A", 1)])
    _write_run(root, "peer", "0.75", [("e1", "A", 0)], finished=False)
    return root


def test_compare_matches_by_id_and_counts(root):
    runs = {(r.press, r.ratio): r for r in scan(root)}
    row = compare(runs[("ours", 0.5)], runs[("peer", 0.5)])
    # common ids e2..e5 (e6 of "peer" sits in a directory that is not a shard, so scan skips it)
    diffs = [1 - 0, 1 - 1, 0 - 1, 0.5 - 0]
    assert row["n"] == 4
    assert (row["better"], row["worse"], row["tied"]) == (2, 1, 1)
    assert row["diff"] == pytest.approx(sum(diffs) / 4)
    assert (row["diff_low"], row["diff_high"]) == pytest.approx(t_interval(diffs))
    assert row["sign_p"] == pytest.approx(binomtest(2, 3).pvalue)
    assert row["mean_a"] == pytest.approx(2.5 / 4) and row["mean_b"] == pytest.approx(2 / 4)
    assert row["complete"]


def test_unfinished_runs_need_partial(root):
    runs = scan(root)
    finished = paired_rows(runs, "ours", ["peer"])
    assert [r["ratio"] for r in finished] == [0.5]
    partial = paired_rows(runs, "ours", ["peer"], partial=True)
    assert [(r["ratio"], r["complete"]) for r in partial] == [(0.5, True), (0.75, False)]
    assert partial[1]["sign_p"] == pytest.approx(binomtest(1, 1).pvalue)
    assert paired_rows(runs, "ours", ["peer"], ratios=[0.75], partial=True)[0]["better"] == 1


def test_all_tied_has_sign_p_one(tmp_path):
    _write_run(tmp_path, "ours", "0.5", [("e1", "A", 1), ("e2", "A", 0)])
    _write_run(tmp_path, "peer", "0.5", [("e1", "A", 1), ("e2", "A", 0)])
    (row,) = paired_rows(scan(tmp_path), "ours", ["peer"])
    assert row["sign_p"] == 1.0 and row["diff"] == 0.0 and row["tied"] == 2


def test_bad_input_is_refused(root):
    runs = {(r.press, r.ratio): r for r in scan(root)}
    with pytest.raises(ValueError, match="ratio"):
        compare(runs[("ours", 0.5)], runs[("peer", 0.75)])
    with pytest.raises(ValueError, match="against"):
        paired_rows(list(runs.values()), "ours", ["ours"])
    with pytest.raises(ValueError, match="against"):
        paired_rows(list(runs.values()), "ours", [])


def test_cli_writes_csv_and_markdown(root, tmp_path):
    out = tmp_path / "paired"
    assert main([str(root), "--press", "ours", "--against", "peer", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "ours.csv")))
    assert [(r["ratio"], r["better"], r["worse"]) for r in rows] == [("0.5", "2", "1")]
    text = (out / "ours.md").read_text()
    assert "python -m evaluation.studies.paired" in text and "2 / 1 / 1" in text
    assert main([str(root), "--press", "ours", "--against", "nobody", "--out", str(out)]) == 1


def test_two_lengths_are_compared_pooled_and_each_alone(tmp_path):
    """A joined run of 2 lengths: ours beats peer on both 2048 examples and loses both 4096 ones; pooled it is
    2 / 2, per length 2 / 0 and 0 / 2 (each length's counts add up to the pooled ones)."""
    for press, scores in (("ours", [1, 1, 0, 0]), ("peer", [0, 0, 1, 1])):
        _write_run(tmp_path, press, "0.5", [(f"e{i}", "A", s) for i, s in enumerate(scores)])
        path = tmp_path / "ruler" / "tiny" / press / "cr0.5" / "predictions.jsonl"
        lines = path.read_text().splitlines()[:4]  # the torn last line dropped
        rows = [json.loads(line) for line in lines]
        for row, length in zip(rows, [2048, 2048, 4096, 4096]):
            row["metadata"]["context_length"] = length
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = paired_rows(scan(tmp_path), "ours", ["peer"])
    assert [(r["length"], r["n"], r["better"], r["worse"]) for r in rows] == [
        ("all", 4, 2, 2),
        (2048, 2, 2, 0),
        (4096, 2, 0, 2),
    ]


def test_one_length_gives_the_pooled_row_only(root):
    rows = paired_rows(scan(root), "ours", ["peer"])
    assert [r["length"] for r in rows] == ["all"]


def _rewrite_rows(path, edit):
    """Rewrite a hand-made run's rows (the torn last line dropped), each through ``edit(row, i)``."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    for i, row in enumerate(rows):
        edit(row, i)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_shared_rows_are_compared_per_question_position(tmp_path):
    """Two contexts of K = 2 questions (the shared-context protocol): ours wins both first questions and loses both
    second ones; pooled 2 / 2, per position 2 / 0 and 0 / 2, and the markdown gains a question column."""
    for press, scores in (("ours", [1, 0, 1, 0]), ("peer", [0, 1, 0, 1])):
        ids = ["c0#q1", "c0#q2", "c1#q1", "c1#q2"]
        _write_run(tmp_path, press, "0.5", [(i, "A", s) for i, s in zip(ids, scores)])
        path = tmp_path / "ruler" / "tiny" / press / "cr0.5" / "predictions.jsonl"
        _rewrite_rows(path, lambda row, i: row.update(question_index=1 + i % 2))
    rows = paired_rows(scan(tmp_path), "ours", ["peer"])
    assert [(r["length"], r["question"], r["n"], r["better"], r["worse"]) for r in rows] == [
        ("all", "all", 4, 2, 2),
        ("all", 1, 2, 2, 0),
        ("all", 2, 2, 0, 2),
    ]
    out = tmp_path / "paired"
    assert main([str(tmp_path), "--press", "ours", "--against", "peer", "--out", str(out)]) == 0
    assert "| dataset | length | question | ratio |" in (out / "ours.md").read_text()


def test_needle_rows_group_by_their_target_length_not_their_own_token_counts(tmp_path):
    """Needle rows count their own tokens in ``metadata.context_length`` (2030, 2041, ...) and carry the target in
    ``metadata.target_length``: one target, so the pooled comparison alone (not one per example length)."""
    for press, scores in (("ours", [1, 1, 0]), ("peer", [0, 1, 1])):
        _write_run(tmp_path, press, "0.5", [(f"e{i}", "A", s) for i, s in enumerate(scores)])
        path = tmp_path / "ruler" / "tiny" / press / "cr0.5" / "predictions.jsonl"
        _rewrite_rows(path, lambda row, i: row["metadata"].update(context_length=2030 + 11 * i, target_length=2048))
    assert [r["length"] for r in paired_rows(scan(tmp_path), "ours", ["peer"])] == ["all"]


def test_two_results_directories_pair_across_and_refuse_a_run_found_twice(tmp_path, capsys):
    _write_run(tmp_path / "a", "ours", "0.5", [("e1", "A", 1), ("e2", "A", 1)])
    _write_run(tmp_path / "b", "peer", "0.5", [("e1", "A", 0), ("e2", "A", 1)])
    out = tmp_path / "paired"
    args = [str(tmp_path / "a"), str(tmp_path / "b"), "--press", "ours", "--against", "peer", "--out", str(out)]
    assert main(args) == 0
    (row,) = csv.DictReader(open(out / "ours.csv"))
    assert (row["n"], row["better"], row["tied"]) == ("2", "1", "1")
    _write_run(tmp_path / "b", "ours", "0.5", [("e1", "A", 0)])  # the same run under the second directory
    with pytest.raises(ValueError, match="two runs of press='ours'"):
        paired_rows([r for d in ("a", "b") for r in scan(tmp_path / d)], "ours", ["peer"])
    with pytest.raises(SystemExit):  # the command line says it in one line
        main(args)
    assert "two runs of press='ours'" in capsys.readouterr().err


def test_a_loss_is_compared_with_lower_as_better(tmp_path, capsys):
    rows = {"ours": [0.1, 0.1, 0.5], "peer": [0.3, 0.2, 0.4]}  # ours lower on e0 and e1, higher on e2
    for press, losses in rows.items():
        _write_run(tmp_path, press, "0.5", [(f"e{i}", "A", 1) for i in range(3)])
        path = tmp_path / "ruler" / "tiny" / press / "cr0.5" / "predictions.jsonl"
        _rewrite_rows(path, lambda row, i, losses=losses: row.update(nll_increase=losses[i]))
    (row,) = paired_rows(scan(tmp_path), "ours", ["peer"], field="nll_increase")
    assert (row["better"], row["worse"], row["tied"]) == (2, 1, 0)  # lower counted as better
    assert row["diff"] == pytest.approx((-0.2 - 0.1 + 0.1) / 3)
    out = tmp_path / "paired"
    args = [str(tmp_path), "--press", "ours", "--against", "peer", "--out", str(out)]
    assert main([*args, "--field", "nll_increase"]) == 0
    assert "lower is better" in (out / "ours__nll_increase.md").read_text()
    assert not (out / "ours.md").exists()
    with pytest.raises(SystemExit):
        main([*args, "--field", "kl"])  # these rows carry no kl
    assert "have no 'kl'" in capsys.readouterr().err


def test_a_length_only_the_peer_has_does_not_split_the_pair(tmp_path):
    _write_run(tmp_path, "ours", "0.5", [("x-2048-0", "A", 1), ("x-2048-1", "A", 0)])
    _write_run(tmp_path, "peer", "0.5", [("x-2048-0", "A", 0), ("x-2048-1", "A", 0), ("x-4096-0", "A", 1)])
    runs = scan(tmp_path)
    for r in runs:  # the peer's rows carry two target lengths, ours one
        for row in r.rows:
            row["metadata"] = {"context_length": int(row["id"].split("-")[1])}
    rows = paired_rows(runs, "ours", ["peer"])
    assert [(r["length"], r["n"]) for r in rows] == [("all", 2)]
