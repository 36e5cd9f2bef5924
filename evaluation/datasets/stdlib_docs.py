"""Questions with exact answers over real documentation and sources, offline: CPython's standard library
(:mod:`evaluation.datasets.stdlib`; Python Software Foundation License v2).

The context is a list of documents in LongBench's multi-document layout (instruction, documents, instruction
again, question): windows of whole lines of the split's ``.py`` files (``File <path>, lines a-b:``; module
docstrings, code and comments as written) and of its documentation topics (``Documentation topic '<name>':``,
``pydoc_data.topics``). One window, at a seeded random place among them, holds the fact asked about; the others
fill the target length.

Questions are built mechanically from the file's syntax tree (``ast``, which reads the source without importing
it, so no module's import side effects run and the answer is the text the context shows; ``inspect.signature``
would give the default's ``repr`` instead, which can differ from the source), one kind per task:

- ``param_default``: the default of a parameter of a function defined in the window (``def`` line to the default
  in the window): "What is the default value of the parameter `p` of the function `f`?"
- ``constant_value``: the value of a module-level ``UPPER_CASE = <literal>`` assignment;
- ``method_class``: which class defines a method (the ``class`` line and the method's ``def`` line in the window).

The answer prefix (after the question, RULER-style) starts the answer as the code that states the fact would:
``p=``, ``NAME =``, ``class``; on the development split (seed 1, 2k tokens) these made the uncompressed embedded
model answer 8, 6 and 4 of 10 against 3, 4 and 3 with English prefixes ("The default value of `p` is", ...;
every configuration tried: ``results/dev_realtext/README.md``).

An answer is a string literal's text (without quotes), a number as written, a negative number, or for defaults a
name or dotted name, of 3 to 40 characters; ``True``, ``False``, ``None`` and bytes are never answers. A question
is kept only when, in the final context, its answer occurs exactly once (case-insensitive, the way RULER's
``string_match_all`` scores it), not in the question, and its subject is defined once (``def f(`` once for the
first and last kinds, ``NAME =`` once for constants); otherwise another fact is drawn. Scoring: RULER's
``string_match_all``. Both protocols: the question after compression, or inside the context (``query_aware``).
Files and topics are drawn by seed from the chosen split (``dev`` or ``test``: disjoint modules, packages and
topics). Every example records its file, the fact's lines and the interpreter
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

from evaluation.datasets.base import Example, Question, place_question
from evaluation.datasets.stdlib import (
    check_set,
    examples_per_cell,
    file_lines,
    files_in_split,
    interpreter_metadata,
    largest_prefix,
    read_source,
    topic_lines,
    topics_in_split,
)
from evaluation.datasets.tokens import count_tokens
from evaluation.metrics import string_match_all

__all__ = ["StdlibDocsDataset", "Fact", "TASKS", "DEFAULT_TASKS", "QUESTIONS", "file_facts", "unique_problem"]

INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
HEADER = INSTRUCTION + "\n\nThe following are given documents.\n\n"
#: task -> (question, answer prefix); ``{subject}`` and ``{param}`` are filled in. The prefixes start the answer as
#: the source states it (chosen on the development split: results/dev_realtext/README.md)
QUESTIONS = {
    "param_default": (
        "What is the default value of the parameter `{param}` of the function `{subject}`?",
        "{param}=",
    ),
    "constant_value": ("What is the value of the constant `{subject}`?", "{subject} ="),
    "method_class": ("Which class defines the method `{subject}`?", "class"),
}
TASKS = tuple(QUESTIONS)
#: the tasks run by default: ``method_class`` is left out, since on the development split the uncompressed embedded
#: model answered it no better than StreamingLLM at 0.75 (8/20 each; results/dev_realtext/README.md)
DEFAULT_TASKS = ("param_default", "constant_value")
_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]+")
MIN_ANSWER, MAX_ANSWER = 3, 40
#: draws of a fact per example before giving up
MAX_DRAWS = 200


@dataclass(frozen=True)
class Fact:
    """One question's fact in a file: its task, the 0-based lines ``first..last`` a window must show, the subject
    (function, constant or method name), the parameter (``param_default``), the answer text, and the class a
    function is defined in (its owner; empty for a module-level or nested function, and for the other tasks)."""

    task: str
    relpath: str
    first: int
    last: int
    subject: str
    param: str
    answer: str
    owner: str = ""


def _segment(node: ast.AST, lines: list[str]) -> str | None:
    """The source text of a one-line node (``ast`` column offsets count UTF-8 bytes), or None for a multi-line one."""
    if node.lineno != node.end_lineno:
        return None
    return lines[node.lineno - 1].encode("utf-8")[node.col_offset : node.end_col_offset].decode("utf-8")


def _answer(node: ast.AST, lines: list[str], names: bool) -> str | None:
    """The answer text of a default or constant value (see the module docstring), or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        value = node.value
        ok = value.isprintable() and value == value.strip()
        return value if ok and MIN_ANSWER <= len(value) <= MAX_ANSWER else None
    number = isinstance(node, ast.Constant) and type(node.value) in (int, float)
    negative = (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    )
    if number or negative or (names and isinstance(node, (ast.Name, ast.Attribute))):
        source = _segment(node, lines)
        return source if source and MIN_ANSWER <= len(source) <= MAX_ANSWER else None
    return None


@functools.lru_cache(maxsize=1024)
def file_facts(relpath: str) -> tuple[Fact, ...]:
    """Every fact of one stdlib file, in source order (empty when it does not parse)."""
    text = read_source(relpath)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return ()
    lines = text.splitlines()
    facts = []

    def visit(node, owner: str) -> None:  # owner: the class whose body holds node's children directly
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                positional = args.posonlyargs + args.args
                pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
                pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
                for arg, default in pairs:
                    answer = _answer(default, lines, names=True)
                    if answer:
                        first, last = child.lineno - 1, default.end_lineno - 1
                        facts.append(Fact("param_default", relpath, first, last, child.name, arg.arg, answer, owner))
                visit(child, "")
            elif isinstance(child, ast.ClassDef):
                if MIN_ANSWER <= len(child.name) <= MAX_ANSWER:
                    for item in child.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            first, last = child.lineno - 1, item.lineno - 1
                            facts.append(Fact("method_class", relpath, first, last, item.name, "", child.name))
                visit(child, child.name)
            else:
                visit(child, owner)

    visit(tree, "")
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            answer = _answer(node.value, lines, names=False) if _CONSTANT.fullmatch(name) else None
            if answer:
                facts.append(Fact("constant_value", relpath, node.lineno - 1, node.end_lineno - 1, name, "", answer))
    return tuple(sorted(facts, key=lambda f: (f.first, f.last, f.task, f.subject, f.param)))


def _subject_pattern(fact: Fact) -> re.Pattern:
    """Where the context defines the fact's subject (a ``def`` of the function or method, the constant's
    assignment)."""
    name = re.escape(fact.subject)
    if fact.task == "constant_value":
        return re.compile(rf"(?<![\w.]){name}\s*=(?!=)")
    return re.compile(rf"\bdef\s+{name}\s*\(")


def unique_problem(fact: Fact, context: str, asked: str) -> str | None:
    """Why ``fact`` cannot be asked in ``context`` (whose question part is ``asked``), or None when its answer occurs
    exactly once in the context (case-insensitive, outside ``asked``) and its subject is defined once."""
    answer = fact.answer.lower()
    if answer in asked.lower():
        return "the question holds the answer"
    count = context.lower().count(answer)
    if count != 1:
        return f"the answer occurs {count} times"
    defined = len(_subject_pattern(fact).findall(context))
    return None if defined == 1 else f"the subject is defined {defined} times"


@dataclass
class StdlibDocsDataset:
    """Exact-answer questions over standard library sources and documentation (see the module docstring).

    Args:
        tasks: question kinds (of :data:`TASKS`; default :data:`DEFAULT_TASKS`).
        context_lengths: target lengths in model tokens (instructions, documents, question; before the chat
            template); the default's 8000 leaves room for the template and the answer within 8192 positions.
        split: ``"test"`` (the benchmark's files and topics) or ``"dev"`` (disjoint ones, for choosing settings).
        window_tokens: the most tokens of one document window.
        num_samples: examples per task and length when the run leaves ``n_samples`` unset.
        max_new_tokens: generation length.

    Raises:
        ValueError: an unknown task or split, ``window_tokens < 64``, or a length below ``2 * window_tokens``.
    """

    #: a smaller n_samples gives a subset of a larger one (ids and contents): grow=true may extend a run
    nested_samples: ClassVar[bool] = True

    tasks: Sequence[str] = DEFAULT_TASKS
    context_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8000])
    split: str = "test"
    window_tokens: int = 400
    num_samples: int = 10
    max_new_tokens: int = 32
    name: str = "stdlib_docs"

    def __post_init__(self):
        if self.window_tokens < 64:
            raise ValueError(f"window_tokens={self.window_tokens} must be >= 64")
        self.tasks = check_set(
            self.name, self.tasks, TASKS, self.split, self.context_lengths, 2 * self.window_tokens, "2 * window_tokens"
        )

    def shared_problem(self, questions: int) -> str | None:
        """Why a context cannot hold ``questions`` questions (``protocol=shared``), or None: one fact window each
        (:meth:`examples`), and room for one distractor window besides at the shortest length."""
        shortest = min(int(x) for x in self.context_lengths)
        if (questions + 1) * self.window_tokens > shortest:
            return (
                f"{questions} fact windows and a distractor of window_tokens={self.window_tokens} each do not fit "
                f"the shortest context_length={shortest} (use a smaller dataset.window_tokens)"
            )
        return None

    def examples(
        self, tokenizer, n_samples: int | None, seed: int, query_aware: bool, questions: int | None = None
    ) -> list[Example]:
        """``n_samples`` (default ``num_samples``) examples per task and length, ordered by task, length, index.

        Example ``i`` of a (task, length) is seeded by ``(seed, task, length, i)``, so a smaller ``n_samples`` gives a
        prefix of a larger one. ``query_aware=True`` puts the closing instruction and the question at the end of
        the context (``question`` is then empty).

        With ``questions`` (K, the shared-context protocol: :mod:`evaluation.shared`) example ``i`` holds K facts of
        its task from K different files, each in a window of its own among the distractors, every answer once in the
        context and in no question, and asks about them in turn (ids ``<task>-<length>-k<K>-<i>``, seeded by K
        besides); the context fits its first question.

        Raises:
            ValueError: ``n_samples < 1``, or no askable fact (with ``questions``: set of facts) found in
                :data:`MAX_DRAWS` draws; with ``questions``, :meth:`shared_problem`'s.
        """
        n = examples_per_cell(n_samples, self.num_samples)
        files = files_in_split(self.split)
        topics = topics_in_split(self.split)
        problem = self.shared_problem(int(questions)) if questions is not None else None
        if problem:
            raise ValueError(f"stdlib_docs: {problem}")
        out = []
        for task in self.tasks:
            for length in (int(x) for x in self.context_lengths):
                for i in range(n):
                    if questions is not None:
                        rng = random.Random(f"{seed}-stdlib_docs-shared{questions}-{task}-{length}-{i}")
                        ex = self._shared_example(
                            tokenizer, task, length, i, files, topics, rng, query_aware, questions
                        )
                    else:
                        rng = random.Random(f"{seed}-stdlib_docs-{task}-{length}-{i}")
                        ex = self._example(tokenizer, task, length, i, files, topics, rng, query_aware)
                    out.append(ex)
        return out

    def _question(self, tokenizer, task, relpath, rng):
        """One drawn fact of ``task`` in ``relpath`` with its question as asked after the context (the closing
        instruction, the question, ``Answer:``), its answer prefix and its window; None when the file has no such
        fact or the fact cannot be asked in its window."""
        facts = [f for f in file_facts(relpath) if f.task == task]
        if not facts:
            return None
        fact = rng.choice(facts)
        question, prefix = (s.format(subject=fact.subject, param=fact.param) for s in QUESTIONS[task])
        asked = "\n\n" + INSTRUCTION + "\n\nQuestion: " + question + "\nAnswer:"
        window = self._window(tokenizer, relpath, fact, rng)
        if window is None or unique_problem(fact, window, asked):
            return None
        return fact, asked, prefix, window

    def _shared_example(self, tokenizer, task, length, i, files, topics, rng, query_aware, K) -> Example:
        """Example ``i`` with K facts and K questions (see :meth:`examples`)."""
        for _ in range(MAX_DRAWS):
            drawn, paths = [], set()
            for _ in range(MAX_DRAWS):  # K facts of K files, subjects and answers all different
                if len(drawn) == K:
                    break
                relpath = rng.choice(files)
                got = None if relpath in paths else self._question(tokenizer, task, relpath, rng)
                if got is None or any(got[0].subject == f.subject for f, _, _, _ in drawn):
                    continue  # the context's final check (unique_problem) refuses what remains
                drawn.append(got)
                paths.add(relpath)
            if len(drawn) < K:
                break
            windows = [got[3] for got in drawn]
            asked_all = "".join(got[1] for got in drawn)
            docs = self._fill(tokenizer, [*windows], length, drawn[0][1], paths, files, topics, rng)
            places = []
            for window in windows:
                at = rng.randrange(len(docs) + 1)
                docs.insert(at, window)
                places = [p + (p >= at) for p in places] + [at]
            context = HEADER + "\n\n".join(docs)
            if any(unique_problem(f, context + asked_all, asked_all) for f, _, _, _ in drawn):
                continue
            tokens = count_tokens(tokenizer, context + drawn[0][1])
            questions = tuple(
                Question(
                    asked.lstrip("\n"),
                    [fact.answer],
                    prefix,
                    "retrieve",
                    {
                        "answer_document": at + 1,
                        "depth": 100.0 * at / max(1, len(docs) - 1),
                        "file": fact.relpath,
                        "fact_lines": [fact.first + 1, fact.last + 1],
                        "subject": fact.subject,
                        "param": fact.param,
                    },
                )
                for (fact, asked, prefix, _), at in zip(drawn, places)
            )
            context, asked, question_start = place_question(context, drawn[0][1], query_aware)
            return Example(
                id=f"{task}-{length}-k{K}-{i}",
                context=context,
                question=asked.lstrip("\n"),
                answers=list(questions[0].answers),
                answer_prefix=questions[0].answer_prefix,
                max_new_tokens=self.max_new_tokens,
                task=task,
                question_start=question_start,
                metadata={
                    "context_length": length,
                    "prompt_tokens": tokens,
                    "n_documents": len(docs),
                    **questions[0].metadata,
                    "split": self.split,
                    **interpreter_metadata(),
                },
                questions=questions,
            )
        raise ValueError(
            f"stdlib_docs found no {K} askable {task} facts in {MAX_DRAWS} draws at {length} tokens (example {i}); "
            "try another seed, fewer questions or a shorter length"
        )

    def _example(self, tokenizer, task, length, i, files, topics, rng, query_aware) -> Example:
        for _ in range(MAX_DRAWS):
            relpath = rng.choice(files)
            facts = [f for f in file_facts(relpath) if f.task == task]
            if not facts:
                continue
            fact = rng.choice(facts)
            question, prefix = (s.format(subject=fact.subject, param=fact.param) for s in QUESTIONS[task])
            asked = "\n\n" + INSTRUCTION + "\n\nQuestion: " + question + "\nAnswer:"
            window = self._window(tokenizer, relpath, fact, rng)
            if window is None or unique_problem(fact, window, asked):
                continue
            docs = self._fill(tokenizer, [window], length, asked, {relpath}, files, topics, rng)
            at = rng.randrange(len(docs) + 1)
            docs.insert(at, window)
            context = HEADER + "\n\n".join(docs)
            if unique_problem(fact, context + asked, asked):
                continue
            tokens = count_tokens(tokenizer, context + asked)
            context, asked, question_start = place_question(context, asked, query_aware)
            return Example(
                id=f"{task}-{length}-{i}",
                context=context,
                question=asked.lstrip("\n"),
                answers=[fact.answer],
                answer_prefix=prefix,
                max_new_tokens=self.max_new_tokens,
                task=task,
                question_start=question_start,
                metadata={
                    "context_length": length,
                    "prompt_tokens": tokens,
                    "n_documents": len(docs),
                    "answer_document": at + 1,
                    "depth": 100.0 * at / max(1, len(docs) - 1),
                    "file": relpath,
                    "fact_lines": [fact.first + 1, fact.last + 1],
                    "subject": fact.subject,
                    "param": fact.param,
                    "split": self.split,
                    **interpreter_metadata(),
                },
            )
        raise ValueError(
            f"stdlib_docs found no askable {task} fact in {MAX_DRAWS} draws at {length} tokens (example {i}); "
            "try another seed or a shorter length"
        )

    def _window(self, tokenizer, relpath: str, fact: Fact, rng) -> str | None:
        """A window of whole lines of ``relpath`` around the fact's lines, about ``window_tokens`` tokens (estimated,
        :class:`evaluation.datasets.stdlib.LineTokens`), placed at random around them; None when the fact's own
        lines do not fit."""
        est = file_lines(tokenizer, relpath)
        budget = self.window_tokens - count_tokens(tokenizer, _title(relpath, fact.first, fact.last + 1))
        spare = budget - est.count(fact.first, fact.last + 1)
        if spare < 0:
            return None
        before = largest_prefix(fact.first, lambda m: est.count(fact.first - m, fact.first) <= rng.random() * spare)
        start = fact.first - before
        end = start + largest_prefix(len(est.lines) - start, lambda m: est.count(start, start + m) <= budget)
        return _title(relpath, start, end) + "".join(est.lines[start:end]).rstrip("\n") if end > fact.last else None

    def _fill(self, tokenizer, docs, length, asked, relpaths, files, topics, rng) -> list[str]:
        """Distractor documents (windows of files other than ``relpaths`` and of documentation topics) while they fit
        ``length`` with ``docs`` and the question. Windows are added on estimated counts, then the whole context is
        counted: the last window is dropped while it is too long, and windows are added again while at least 48
        tokens are left (documents are counted one by one, and a seam may merge or split a token)."""
        out = []
        for _ in range(8):  # each pass ends with an exact count
            room, misses = length - count_tokens(tokenizer, HEADER + "\n\n".join(docs + out) + asked), 0
            if room < 48:
                break
            while misses < 20 and min(self.window_tokens, room) >= 48:
                budget = min(self.window_tokens, room)
                if rng.random() < 0.5:
                    other = rng.choice([f for f in files if f not in relpaths])
                    doc = _window_from(file_lines(tokenizer, other), rng, budget, functools.partial(_title, other))
                else:
                    topic = rng.choice(topics)
                    doc = _window_from(
                        topic_lines(tokenizer, topic), rng, budget, lambda s, e, t=topic: _topic_title(t)
                    )
                misses = 0 if doc else misses + 1
                if doc:
                    out.append(doc)
                    room -= count_tokens(tokenizer, "\n\n" + doc)
            while out and count_tokens(tokenizer, HEADER + "\n\n".join(docs + out) + asked) > length:
                out.pop()
        return out

    def score(self, prediction: str, example: Example) -> float:
        """RULER's ``string_match_all``: the fraction of the answers found in the prediction (case-insensitive)."""
        return string_match_all(prediction, example.answers)


def _title(relpath: str, start: int, end: int) -> str:
    """The title line of a source window of 0-based lines ``start..end-1``."""
    return f"File {relpath}, lines {start + 1}-{end}:\n"


def _topic_title(topic: str) -> str:
    """The title line of a documentation window."""
    return f"Documentation topic '{topic}':\n"


def _window_from(est, rng, budget: int, title) -> str | None:
    """The title and the lines of a text (``est``: its :class:`evaluation.datasets.stdlib.LineTokens`) from a random
    line on while they fit about ``budget`` tokens (None when the first line alone does not); ``title(start, end)``
    gives the title of lines ``start..end-1``."""
    lines = est.lines
    if not lines:
        return None
    start = rng.randrange(len(lines))
    head = 16  # a title's tokens, about
    end = start + largest_prefix(len(lines) - start, lambda m: head + est.count(start, start + m) <= budget)
    return title(start, end) + "".join(lines[start:end]).rstrip("\n") if end > start else None
