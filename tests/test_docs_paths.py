"""Every committed artifact the documentation cites exists.

``docs/*.md``, ``README.md`` and ``results/README.md`` cite tables, reports and runs under ``results/`` by path
(often with shell braces, ``results/tables/ruler{,-qa}__smollm2-135m__win.csv``). A cited file that was never
committed leaves a reader with a number and nowhere to check it, so each such path must exist in the tree.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "results" / "README.md"]
SPAN = re.compile(r"`([^`]*)`")
CITED = re.compile(r"(?<![\w/])(results/[A-Za-z0-9_./{},+\-]+)")
PLACEHOLDER = re.compile(r"[<>*]|\.\.\.")
#: A grid's staged shards (``results/.staging/4k``, ``8k``) leave the tree when ``evaluation.merge_runs`` joins
#: them (``results/.staging/README.md``), while the commands that joined them stay cited: not artifacts.
TRANSIENT = re.compile(r"^results/\.staging/\d+k(/|$)")


def expand_braces(path: str) -> list[str]:
    """Every path a shell brace expression names (``a{b,c}d`` -> ``abd``, ``acd``; nested braces expand too)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for option in match.group(1).split(",") for p in expand_braces(head + option + tail)]


def cited_paths(text: str) -> set[str]:
    """Paths under ``results/`` cited inside backticks, braces expanded, trailing punctuation dropped."""
    found = set()
    for raw in (path for span in SPAN.findall(text) for path in CITED.findall(span)):
        if PLACEHOLDER.search(raw) or TRANSIENT.match(raw):
            continue
        for path in expand_braces(raw.rstrip(".,")):
            found.add(path.rstrip("/.,"))
    return found


def test_expand_braces_names_every_combination():
    assert expand_braces("results/t/ruler{,-qa}__m__{win,summary}.csv") == [
        "results/t/ruler__m__win.csv",
        "results/t/ruler__m__summary.csv",
        "results/t/ruler-qa__m__win.csv",
        "results/t/ruler-qa__m__summary.csv",
    ]


def test_cited_paths_reads_backticked_paths_only():
    text = "see `results/paired/a.md` and `python -m x --out results/b` but not results/c.md"
    assert cited_paths(text) == {"results/paired/a.md", "results/b"}


def test_cited_paths_skips_staged_grids_only():
    text = "`merge_runs results/.staging/4k results` and `results/.staging/8k/x` but `results/.staging/README.md`"
    assert cited_paths(text) == {"results/.staging/README.md"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_results_path_exists(doc):
    missing = sorted(p for p in cited_paths(doc.read_text(encoding="utf-8")) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that are not in the tree: {missing}"
