"""The dataset interface every benchmark implements (needle, RULER, LongBench, multi-document QA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Example:
    """One prompt of a benchmark.

    Attributes:
        id: unique, stable id inside the dataset (used to resume runs).
        context: the long context (no chat template; the pipeline applies it).
        question: the question asked after compression (kvpress's question-agnostic protocol). Empty
            when ``query_aware=True`` put it inside ``context``.
        answers: reference answers; the dataset's ``score`` decides how they are matched.
        answer_prefix: text that starts the model's answer (RULER-style), may be empty.
        max_new_tokens: generation length for this example, or None for the run's ``max_new_tokens``.
        task: sub-task name (RULER or LongBench task; the dataset name when there is one task).
        metadata: extra per-example fields written to ``predictions.jsonl`` (depth, context_length...).
        question_start: where the question part starts inside ``context`` (characters) when ``query_aware=True`` put
            it there: the document is ``context[:question_start]``. None otherwise, or when the dataset cannot say;
            a press that needs a delimiter between the two (Finch) refuses such an example.
        continuation: the text that follows ``context``. When set, nothing is generated: the loop teacher-forces
            the first ``max_new_tokens`` tokens of it on the compressed cache and scores the loss of the next-token
            predictions against the uncompressed context's (:mod:`evaluation.continuation`). Empty: generate.
        questions: the shared-context protocol's questions (``protocol=shared``, :mod:`evaluation.shared`), in the
            order they are asked, the first being the example's own (``question``, ``answers``, ``answer_prefix``);
            empty (the default) for one question per context. All of them use ``max_new_tokens``.
    """

    id: str
    context: str
    question: str
    answers: list[str]
    answer_prefix: str = ""
    max_new_tokens: int | None = None
    task: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    question_start: int | None = None
    continuation: str = ""
    questions: tuple[Question, ...] = ()


@dataclass
class Question:
    """One of the questions a context is asked under the shared-context protocol (:attr:`Example.questions`).

    Attributes:
        question: the question as it is asked after compression (as :attr:`Example.question` would hold it alone).
        answers: its reference answers (the dataset's ``score`` matches them as for an example's).
        answer_prefix: the text that starts the model's answer, may be empty.
        kind: ``"retrieve"`` (one key, fact or chain of the context) or ``"aggregate"`` (needs the whole context,
            e.g. every needle of it, scored by recall).
        metadata: what the rows of this question add to the example's metadata (the asked needle's ``depth``, ...).
    """

    question: str
    answers: list[str]
    answer_prefix: str = ""
    kind: str = "retrieve"
    metadata: dict[str, Any] = field(default_factory=dict)


def place_question(context: str, question: str, query_aware: bool, separator: str = "") -> tuple[str, str, int | None]:
    """Put the question where the protocol asks it (docs/methods.md §5.5).

    Args:
        context: the document, without the question.
        question: what is asked after it (instruction, question, cue).
        query_aware: ask it inside the compressed context instead of after compression.
        separator: text between the document and the question when the question goes inside (e.g. ``"\\n\\n"``).

    Returns:
        ``(context, question, question_start)``: after compression ``(context, question, None)``; inside,
        ``(context + separator + question, "", len(context))``, so ``context[:question_start]`` is the document
        (:attr:`Example.question_start`, where a press that needs a delimiter puts it).
    """
    if not query_aware:
        return context, question, None
    return context + separator + question, "", len(context)


class DataUnavailableError(RuntimeError):
    """A dataset's files could not be found or fetched (e.g. the hub is unreachable and they are not cached);
    the message says how to provide them."""


class Dataset(Protocol):
    """What ``evaluation.run`` needs from a dataset config's ``_target_``.

    Two optional methods let the harness check a dataset before it loads a model or writes anything
    (:mod:`evaluation.inputs`, :mod:`evaluation.guards`): ``prepare()`` finds and reads the dataset's files (raising
    ``FileNotFoundError`` or :class:`DataUnavailableError` with the fix), and ``sample_limit()`` returns
    ``(limit, what)``, the most ``n_samples`` the dataset can give without repeating itself and what sets that
    limit, or None when it can generate any number.

    A dataset that puts several questions on one context (``protocol=shared``, :mod:`evaluation.shared`) also has
    ``shared_problem(questions) -> str | None`` (why it cannot give ``questions`` per context, or None) and takes
    ``examples(..., questions=K)``, returning examples whose :attr:`Example.questions` hold K questions.
    """

    name: str

    def examples(self, tokenizer, n_samples: int | None, seed: int, query_aware: bool) -> list[Example]:
        """Build the examples (deterministic in ``seed``); ``n_samples`` sets the count (each dataset says per what)."""
        ...

    def score(self, prediction: str, example: Example) -> float:
        """Score in [0, 1] of one prediction."""
        ...
