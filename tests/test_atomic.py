"""Results are written whole or not at all (``evaluation.atomic``), and every study writes through it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from evaluation.atomic import save_figure, write_atomic

ROOT = Path(__file__).resolve().parent.parent


def test_text_and_bytes_replace_the_file(tmp_path):
    path = tmp_path / "table.csv"
    write_atomic(path, "a,b\n1,2\n")
    assert path.read_text() == "a,b\n1,2\n"
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["table.csv"]  # no temporary file is left


def test_a_write_that_fails_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "README.md"
    path.write_text("old report\n")

    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new report\n")
    assert path.read_text() == "old report\n"


def test_a_figure_is_a_whole_png_and_is_closed(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = tmp_path / "plot.png"
    save_figure(fig, path, dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.number not in plt.get_fignums()


#: Writes that bypass ``evaluation.atomic`` (the one exception: ``harness.append_row``, one fsynced line of a
#: ``predictions.jsonl``, whose torn last line the reader skips).
_DIRECT_WRITE = re.compile(r"\.write_text\(|\.write_bytes\(|\.savefig\(|json\.dump\(")


@pytest.mark.parametrize("folder", ["evaluation", "scripts"])
def test_no_result_file_is_written_past_the_atomic_writer(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.relative_to(ROOT).as_posix() == "evaluation/atomic.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _DIRECT_WRITE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
