"""Code completion on real code, offline: LongBench's ``lcc`` and ``repobench-p`` rebuilt on the running interpreter's
standard library (:mod:`evaluation.datasets.stdlib`; Python Software Foundation License v2).

Two tasks, each with LongBench's official template (:func:`evaluation.datasets.longbench.split_prompt`), generation
length (64 tokens) and metric (``code_sim_score``: the edit similarity of the prediction's first code line to the
answer), without the chat template as LongBench's ``pred.py``:

- ``lcc``: the context is the head of one ``.py`` file, as many whole lines as fit the target length;
- ``repobench-p``: the line to complete is, as in RepoBench-P's "cross-file first" setting, the first use in its
  file of a name the file imports from another file of its package (:func:`cross_file_uses`); the context is other
  files of the package, each under a ``# Path: <file>`` line, the files defining the imported names the line uses
  first, then the others in seeded order (whole files while they fit, the last one cut to its head); the input
  (LongBench's ``{input}``, asked after compression unless ``query_aware``) is ``# Path: <file>`` and the last
  lines before the cut of the file being completed, at most ``in_file_tokens`` tokens of them.

The answer is the line right after the prompt's last line, with its indentation (trailing whitespace dropped). The
cut is placed so that this line is not blank and holds none of ``#``, a backtick or ``//``: LongBench's scorer
(:func:`evaluation.metrics.first_code_line`) skips a predicted line holding one of them, so such an answer could
never be matched; blank lines before it belong to the prompt. Lengths are the model's tokens of context, input and
answer prefix. Files are drawn by seed from the chosen split (``dev`` or ``test``, disjoint packages and modules);
each (task, length) uses a file once. Every example records the file, the answer's line number and the interpreter
(:func:`evaluation.datasets.stdlib.interpreter_metadata`): results hold for that Python version.
"""

from __future__ import annotations

import ast
import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from evaluation.datasets.base import Example, place_question
from evaluation.datasets.longbench import DATASET2MAXLEN, split_prompt
from evaluation.datasets.stdlib import (
    MIN_FILL,
    check_set,
    examples_per_cell,
    file_lines,
    files_in_split,
    first_examples,
    interpreter_metadata,
    largest_prefix,
    read_source,
    shrink_to_fit,
    unit_of,
)
from evaluation.datasets.tokens import count_tokens
from evaluation.metrics import longbench_score

__all__ = ["StdlibCodeDataset", "TASKS", "is_answer_line", "path_line", "cross_file_uses"]

TASKS = ("lcc", "repobench-p")


def is_answer_line(line: str) -> bool:
    """Whether a file line can be an answer: not blank, with a letter or digit, and none of ``#``, a backtick or
    ``//`` (LongBench's :func:`evaluation.metrics.first_code_line` would skip it in a prediction)."""
    return bool(line.strip()) and any(c.isalnum() for c in line) and not any(m in line for m in ("#", "`", "//"))


def path_line(relpath: str) -> str:
    """RepoBench's file header line: ``# Path: <relpath>``."""
    return f"# Path: {relpath}\n"


def _import_targets(relpath: str, node: ast.ImportFrom, alias: ast.alias) -> list[str]:
    """The files of ``relpath``'s package that ``from <module> import <alias>`` may read (a module or a package's
    ``__init__.py``; ``from . import name`` may name a module), nearest first; empty for another package."""
    parts = relpath.split("/")
    if node.level:
        if node.level > len(parts) - 1:
            return []
        base = parts[: len(parts) - node.level]
    elif node.module and node.module.split(".")[0] == parts[0]:
        base = []
    else:
        return []
    target = base + (node.module.split(".") if node.module else [])
    out = ["/".join([*target, alias.name]) + ".py"]
    return out + (["/".join(target) + ".py", "/".join([*target, "__init__.py"])] if target else [])


@functools.lru_cache(maxsize=1024)
def cross_file_uses(relpath: str, files: tuple[str, ...]) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """RepoBench-P's "cross-file first" lines of a package file: for each name it imports from another file of its
    package (one of ``files``), the first later line, outside import statements, that uses it, when that line can be
    an answer (:func:`is_answer_line`).

    Returns:
        ``(line index, the files defining the imported names the line uses)``, by line.
    """
    text = read_source(relpath)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return ()
    known = set(files) - {relpath}
    imported, import_lines = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            import_lines.update(range(node.lineno - 1, node.end_lineno))
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                source = next((f for f in _import_targets(relpath, node, alias) if f in known), None)
                if source and alias.name != "*":
                    imported[alias.asname or alias.name] = (source, node.end_lineno)
    lines = text.splitlines(keepends=True)
    uses: dict[int, set] = {}
    for name, (source, after) in imported.items():
        pattern = re.compile(rf"(?<![\w.]){re.escape(name)}\b")
        first = next((j for j in range(after, len(lines)) if j not in import_lines and pattern.search(lines[j])), None)
        if first is not None and is_answer_line(lines[first]):
            uses.setdefault(first, set()).add(source)
    return tuple((j, tuple(sorted(sources))) for j, sources in sorted(uses.items()))


def _snippet(relpath: str, m: int) -> str:
    """A context file of ``repobench-p``: its path line and its first ``m`` lines."""
    return path_line(relpath) + "".join(read_source(relpath).splitlines(keepends=True)[:m]) + "\n"


def _prompt_tokens(tokenizer, task: str, context: str, inp: str) -> int:
    """Tokens of LongBench's prompt of ``task`` (context, input and answer prefix, no chat template)."""
    return count_tokens(tokenizer, "".join(split_prompt(task, context, inp)))


@dataclass
class StdlibCodeDataset:
    """Next-line code completion on the standard library (see the module docstring).

    Args:
        tasks: ``lcc`` and / or ``repobench-p``.
        context_lengths: target prompt lengths in model tokens (context, input and answer prefix); the default's
            8000 leaves room for the 64 generated tokens within SmolLM2's 8192 positions.
        split: ``"test"`` (the benchmark's files) or ``"dev"`` (disjoint files, for choosing settings).
        in_file_tokens: ``repobench-p``: the most tokens of the input (the path line and the lines of the file
            being completed).
        num_samples: examples per task and length when the run leaves ``n_samples`` unset.

    Raises:
        ValueError: an unknown task or split, a length below 256 tokens, or (``repobench-p``) ``in_file_tokens``
            outside ``[32, length / 2]``.
    """

    #: a smaller n_samples gives a subset of a larger one (ids and contents): grow=true may extend a run
    nested_samples: ClassVar[bool] = True

    tasks: Sequence[str] = TASKS
    context_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8000])
    split: str = "test"
    in_file_tokens: int = 512
    num_samples: int = 10
    name: str = "stdlib_code"

    def __post_init__(self):
        self.tasks = check_set(self.name, self.tasks, TASKS, self.split, self.context_lengths, 256)
        if "repobench-p" in self.tasks and not 32 <= self.in_file_tokens <= min(self.context_lengths) // 2:
            raise ValueError(
                f"in_file_tokens={self.in_file_tokens} must lie in [32, {min(self.context_lengths) // 2}] "
                "(half the shortest context length)"
            )

    def examples(self, tokenizer, n_samples: int | None, seed: int, query_aware: bool) -> list[Example]:
        """``n_samples`` (default ``num_samples``) examples per task and length, ordered by task, length, index.

        Per (task, length) the split's files are shuffled by ``(seed, task, length)`` and taken in that order while
        they give an example, so a smaller ``n_samples`` gives a prefix of a larger one.

        Raises:
            ValueError: ``n_samples < 1``, or more examples than the split's files give at some length (the
                message names the count).
        """
        n = examples_per_cell(n_samples, self.num_samples)
        files = files_in_split(self.split)
        out = []
        for task in self.tasks:
            for length in (int(x) for x in self.context_lengths):
                order = list(files)
                random.Random(f"{seed}-stdlib_code-{task}-{length}").shuffle(order)
                build = functools.partial(self._build, tokenizer, task, length, files, seed, query_aware)
                out += first_examples(
                    order, n, build, f"the {self.split} split's files give for {task} at {length} tokens"
                )
        return out

    def _build(self, tokenizer, task, length, files, seed, query_aware, relpath, i) -> Example | None:
        """Example ``i`` of ``task`` at ``length`` from ``relpath``, or None when the file gives none."""
        rng = random.Random(f"{seed}-stdlib_code-{task}-{length}-{relpath}")
        build = self._lcc if task == "lcc" else self._repobench
        ex = build(tokenizer, relpath, length, files, rng, query_aware)
        if ex is not None:
            ex.id = f"{task}-{length}-{i}"
        return ex

    def _example(self, task, context, inp, relpath, lines, j, length, tokenizer, query_aware) -> Example:
        """The example of ``task`` whose answer is ``lines[j]`` of ``relpath``."""
        ctx, question, prefix = split_prompt(task, context, inp)
        tokens = count_tokens(tokenizer, ctx + question + prefix)
        ctx, question, question_start = place_question(ctx, question, query_aware)
        return Example(
            id="",
            context=ctx,
            question=question,
            answers=[lines[j].rstrip()],
            answer_prefix=prefix,
            max_new_tokens=DATASET2MAXLEN[task],
            task=task,
            question_start=question_start,
            metadata={
                "context_length": length,
                "prompt_tokens": tokens,
                "file": relpath,
                "answer_line": j + 1,
                "split": self.split,
                "chat_template": False,
                **interpreter_metadata(),
            },
        )

    def _lcc(self, tokenizer, relpath, length, files, rng, query_aware) -> Example | None:
        """The head of ``relpath`` that fits ``length`` tokens and ends before an answer line; None if too short."""
        est = file_lines(tokenizer, relpath)
        lines = est.lines
        base = _prompt_tokens(tokenizer, "lcc", "", "")
        if base + est.count(0, len(lines)) < MIN_FILL * length:  # the whole file is too short (estimated)
            return None

        def allowed(j):
            return j < len(lines) and is_answer_line(lines[j])

        j = largest_prefix(len(lines), lambda j: base + est.count(0, j) <= length, allowed)
        j = shrink_to_fit(j, lambda j: _prompt_tokens(tokenizer, "lcc", "".join(lines[:j]), ""), length, allowed)
        if j == 0:
            return None
        ex = self._example("lcc", "".join(lines[:j]), "", relpath, lines, j, length, tokenizer, query_aware)
        return ex if ex.metadata["prompt_tokens"] >= MIN_FILL * length else None

    def _repobench(self, tokenizer, relpath, length, files, rng, query_aware) -> Example | None:
        """Other files of ``relpath``'s package as context (first those defining the names the answer line imports),
        the lines before a random cross-file-first line of ``relpath`` (:func:`cross_file_uses`) as input; None for
        a module outside a package, a file without such a line, or a package with too little other code."""
        if "/" not in relpath:
            return None
        uses = cross_file_uses(relpath, tuple(files))
        if not uses:
            return None
        j, sources = rng.choice(uses)
        est = file_lines(tokenizer, relpath)
        lines = est.lines
        others = [f for f in files if f != relpath and f not in sources and unit_of(f) == unit_of(relpath)]

        def in_file(m):  # the path line and the last m lines before the answer
            return path_line(relpath) + "".join(lines[j - m : j])

        head = count_tokens(tokenizer, path_line(relpath))
        m = largest_prefix(j, lambda m: head + est.count(j - m, j) <= self.in_file_tokens)
        inp = in_file(shrink_to_fit(m, lambda m: count_tokens(tokenizer, in_file(m)), self.in_file_tokens))
        rng.shuffle(others)
        context, shown = "", []
        for other in [*sources, *others]:  # the files the answer line's imported names come from first
            used = _prompt_tokens(tokenizer, "repobench-p", context + path_line(other), inp)
            m = self._snippet_lines(tokenizer, other, context, inp, length, used)
            if m == 0:
                break
            context += _snippet(other, m)
            shown.append(other)
            if m < len(file_lines(tokenizer, other).lines):
                break
        ex = self._example("repobench-p", context, inp, relpath, lines, j, length, tokenizer, query_aware)
        if ex.metadata["prompt_tokens"] < MIN_FILL * length:
            return None
        ex.metadata.update({"context_files": shown, "input_lines": inp.count("\n") - 1})
        return ex

    @staticmethod
    def _snippet_lines(tokenizer, other, context, inp, length, used) -> int:
        """How many head lines of ``other`` fit after ``context`` (``used``: the prompt's tokens with its path line)."""
        est = file_lines(tokenizer, other)
        m = largest_prefix(len(est.lines), lambda m: used + est.count(0, m) <= length)
        return shrink_to_fit(
            m, lambda m: _prompt_tokens(tokenizer, "repobench-p", context + _snippet(other, m), inp), length
        )

    def score(self, prediction: str, example: Example) -> float:
        """LongBench's ``code_sim_score`` (:func:`evaluation.metrics.longbench_score` of the task)."""
        return longbench_score(example.task, prediction, example.answers)
