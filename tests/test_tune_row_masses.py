"""The row-kernel sweep (evaluation.studies.tune_row_masses): its configuration parser and its CPU dry run."""

import csv

import pytest

from evaluation.studies.tune_row_masses import GRID, main, parse_config


def test_parse_config():
    assert parse_config("mass_precision=tf32x3 num_warps=4") == {"mass_precision": "tf32x3", "num_warps": 4}
    assert parse_config("") == {}
    with pytest.raises(ValueError, match="'block_q=16': expected name=value with a name among"):
        parse_config("block_q=16")
    with pytest.raises(ValueError, match="'num_warps'"):
        parse_config("num_warps")
    with pytest.raises(ValueError, match="'num_warps=four': num_warps takes a positive integer"):
        parse_config("num_warps=four")
    assert set(GRID) == {"mass_precision", "max_block_k", "block_m", "block_n", "num_warps"}


def test_dry_run_writes_one_row_per_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the dry run sets it; restored after the test
    argv = ["--dry-run", "--out", str(tmp_path), "--configs", ";max_block_k=16 block_m=16", "--cases", "audit"]
    assert main(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "dry_run" / "tune_row_masses.csv")))
    assert [r["config"] for r in rows] == ["reference", "defaults", "max_block_k=16 block_m=16"]
    assert {r["case"] for r in rows} == {"row_chunk_masses_audit"}
    for r in rows[1:]:  # every configuration ran and matches the reference to float32 round-off
        assert not r.get("error") and float(r["max_abs_diff"]) < 1e-6


def test_unknown_case_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"--cases 'audits': each case must be one of \['proposal', 'audit'\]"):
        main(["--dry-run", "--out", str(tmp_path), "--cases", "audits"])
