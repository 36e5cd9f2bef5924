"""No import circles (issue 16): the import graph of ``presses/`` is acyclic with every import at the top of its
module, the library never imports the harness, and every module imports in a fresh interpreter. ``evaluation/`` is
built in floors (issue 65 item 7, :data:`FLOORS`): no module imports from a floor above its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "presses").rglob("*.py"))
EVALUATION = sorted((ROOT / "evaluation").rglob("*.py"))

#: ``evaluation/``'s floors, lowest first (ARCHITECTURE.md, "Floors"). A module may import from its own floor and
#: from those below it, never from one above, at the top of the module or inside a function. Each entry names a
#: module or a package (then every module below it); a new module gets its floor here.
FLOORS = (
    (  # the standard library's and third parties' helpers: files, tables, plots, statistics, settings
        "base",
        (
            "evaluation",
            "evaluation.atomic",
            "evaluation.hub",
            "evaluation.memo",
            "evaluation.metrics",
            "evaluation.pipeline",
            "evaluation.plotting",
            "evaluation.predictions",
            "evaluation.settings",
            "evaluation.tables",
        ),
    ),
    ("datasets", ("evaluation.datasets",)),  # the benchmarks and their official scorers
    (  # models, and what the harness knows of presses and inputs
        "models and presses",
        (
            "evaluation.models",
            "evaluation.scorers",
            "evaluation.registry",
            "evaluation.guards",
            "evaluation.prompt_delimiter",
        ),
    ),
    (  # run directories, configs, inputs, command lines, collected runs
        "runs",
        ("evaluation.harness", "evaluation.inputs", "evaluation.cli", "evaluation.runs"),
    ),
    (  # the per-example loop and what it calls
        "loop",
        (
            "evaluation.replay",
            "evaluation.kvzip_path",
            "evaluation.continuation",
            "evaluation.shared",
            "evaluation.loop",
        ),
    ),
    (  # commands that run or rewrite runs
        "entry points",
        (
            "evaluation.run",
            "evaluation.fused",
            "evaluation.migrate",
            "evaluation.merge_runs",
            "evaluation.compress_runs",
            "evaluation.train_scorers",
        ),
    ),
    (
        "report",
        ("evaluation.frontier", "evaluation.shared_report", "evaluation.report", "evaluation.readme_table"),
    ),  # runs into tables and plots
    ("studies", ("evaluation.studies", "evaluation.uor")),  # analysis: the studies behind results/
)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _top_level(body):
    """Statements at module level, including those inside top-level ``try`` / ``if`` blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level(part)
        elif isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """``(project modules imported at the top, imports of the project found elsewhere)``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in _top_level(tree.body)}
    modules, hidden = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]  # resolved to the module below
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        names = [n for n in names if n.split(".")[0] in ("presses", "evaluation")]
        if not names:
            continue
        if id(node) not in top:
            hidden.append(f"{path.relative_to(ROOT)}:{node.lineno} {names[0]}")
        modules.update(names)
    return modules, hidden


def test_imports_stand_at_the_top_and_the_library_never_imports_the_harness():
    hidden, harness = [], []
    for path in FILES:
        modules, inner = _imports(path)
        hidden += inner
        harness += [f"{path.relative_to(ROOT)}: {m}" for m in modules if m.startswith("evaluation")]
    assert not hidden, hidden
    assert not harness, harness


def test_the_import_graph_of_presses_is_acyclic():
    known = {_module(p) for p in FILES}
    graph = {}
    for path in FILES:
        modules, _ = _imports(path)
        deps = set()
        for m in modules:  # "from presses.kernels import column_sums" depends on presses.kernels
            while m and m not in known:
                m = m.rpartition(".")[0]
            if m and m != _module(path):
                deps.add(m)
        graph[_module(path)] = deps
    # a package's __init__ importing its own submodules is not a circle; a submodule importing its package is
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def _floor(module: str) -> int | None:
    """The index in :data:`FLOORS` of ``module``'s floor (its own entry, else its closest package's), or None."""
    while module:
        for k, (_, names) in enumerate(FLOORS):
            if module in names:
                return k
        module = module.rpartition(".")[0]
    return None


def test_evaluation_never_imports_up_a_floor():
    known = {_module(p) for p in EVALUATION}
    unplaced = sorted(m for m in known if _floor(m) is None)
    assert not unplaced, f"modules without a floor: {unplaced}; give each one in FLOORS (tests/test_imports.py)"
    upward = []
    for path in EVALUATION:
        here = _floor(_module(path))
        modules, _ = _imports(path)
        for name in sorted(modules):
            while name and name not in known:  # "from evaluation.report import scan" is evaluation.report
                name = name.rpartition(".")[0]
            if name.startswith("evaluation") and _floor(name) > here:
                upward.append(
                    f"{path.relative_to(ROOT)} (floor {FLOORS[here][0]!r}) imports {name} "
                    f"(floor {FLOORS[_floor(name)][0]!r}, above it)"
                )
    assert not upward, upward


def test_every_presses_module_imports_in_a_fresh_interpreter():
    names = sorted(_module(p) for p in FILES)
    script = (
        "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
        "print(len(sys.argv) - 1)\n"
    )
    # leaves first: each module is then imported before anything that would pull it in through a package
    names.sort(key=lambda n: -n.count("."))
    result = subprocess.run(
        [sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(len(names))
