"""Quality without an answer key: the loss of the real text that follows a compressed context, offline, on
CPython's standard library (:mod:`evaluation.datasets.stdlib`; Python Software Foundation License v2).

Each example is a context of about ``T`` tokens (whole lines, at most ``T``) and the text that follows it. Nothing
is asked and nothing generated: the harness compresses the context, teacher-forces the first
``continuation_tokens`` tokens of the continuation on the compressed cache and compares the model's next-token
predictions with those it makes after the uncompressed context (:mod:`evaluation.continuation`: the mean
negative log-likelihood increase and the mean KL divergence; a row's ``score`` is ``exp(-KL)``). The measure is
question-agnostic by construction, so ``query_aware`` does not apply.

Two tasks:

- ``code``: the head of one ``.py`` file of the split (as ``lcc``'s contexts), then its next lines;
- ``docs``: the split's documentation topics (``pydoc_data.topics``: English prose with its grammar rules and
  examples, as written), joined in sorted order into one stream (read cyclically), from a seeded random line.
  The development split holds 24 topics (about 22k tokens), so its longer contexts overlap.

Contexts and continuations start on a non-blank line. No chat template: the context is raw text after the
tokenizer's BOS token, as the pipeline prepares a prompt without one. Every example records its source and the
interpreter (:func:`evaluation.datasets.stdlib.interpreter_metadata`): results hold for that Python version.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from evaluation.datasets.base import Example
from evaluation.datasets.stdlib import (
    MIN_FILL,
    LineTokens,
    check_set,
    examples_per_cell,
    file_lines,
    files_in_split,
    first_examples,
    interpreter_metadata,
    largest_prefix,
    shrink_to_fit,
    topic_text,
    topics_in_split,
)
from evaluation.datasets.tokens import count_tokens

__all__ = ["ContinuationLossDataset", "TASKS"]

TASKS = ("docs", "code")
#: tokens of continuation text kept beyond the scored ones (a re-tokenised cut may lose one or two)
_SPARE = 16


@functools.lru_cache(maxsize=8)
def _docs_stream(tokenizer, split: str) -> LineTokens:
    """The split's documentation topics joined in sorted order, twice over (so a window may wrap around)."""
    text = "\n\n".join(topic_text(t).strip("\n") for t in topics_in_split(split)) + "\n\n"
    return LineTokens(tokenizer, text + text)


@dataclass
class ContinuationLossDataset:
    """Contexts of real code and documentation and the text that follows them (see the module docstring).

    Args:
        tasks: ``docs`` and / or ``code``.
        context_lengths: ``T``, the context's tokens (text only; the BOS token comes on top). The positions used
            are ``T + 1 + continuation_tokens``: the default's 7680 fits SmolLM2's 8192.
        split: ``"test"`` (the benchmark's files and topics) or ``"dev"`` (disjoint ones, for choosing settings).
        continuation_tokens: tokens teacher-forced and scored after the context (the example's
            ``max_new_tokens``; a run's ``max_new_tokens`` replaces it, up to the text each example carries).
        num_samples: examples per task and length when the run leaves ``n_samples`` unset.

    Raises:
        ValueError: an unknown task or split, a length below 128 tokens, or ``continuation_tokens < 1``.
    """

    #: a smaller n_samples gives a subset of a larger one (ids and contents): grow=true may extend a run
    nested_samples: ClassVar[bool] = True

    tasks: Sequence[str] = TASKS
    context_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 7680])
    split: str = "test"
    continuation_tokens: int = 256
    num_samples: int = 10
    name: str = "continuation_loss"

    def __post_init__(self):
        self.tasks = check_set(self.name, self.tasks, TASKS, self.split, self.context_lengths, 128)
        if self.continuation_tokens < 1:
            raise ValueError(f"continuation_tokens={self.continuation_tokens} must be >= 1")

    def examples(self, tokenizer, n_samples: int | None, seed: int, query_aware: bool) -> list[Example]:
        """``n_samples`` (default ``num_samples``) examples per task and length, ordered by task, length, index.

        Per (task, length) the candidates (files, or start lines of the documentation stream) are shuffled by
        ``(seed, task, length)`` and taken in that order while they give an example, so a smaller ``n_samples``
        gives a prefix of a larger one.

        Raises:
            ValueError: ``query_aware=True`` (nothing is asked), ``n_samples < 1``, or more ``code`` examples than
                the split's files long enough give (the message names the count).
        """
        if query_aware:
            raise ValueError(
                "continuation_loss asks no question (it scores the text after the compressed context): "
                "query_aware=true does not apply"
            )
        n = examples_per_cell(n_samples, self.num_samples)
        out = []
        for task in self.tasks:
            for length in (int(x) for x in self.context_lengths):
                if task == "code":  # a file's head; tokenised only when its turn comes
                    sources = [(functools.partial(file_lines, tokenizer, f), 0, f) for f in files_in_split(self.split)]
                else:  # a non-blank line of the first copy of the stream
                    stream = functools.partial(_docs_stream, tokenizer, self.split)
                    starts = [k for k in range(len(stream().lines) // 2) if stream().lines[k].strip()]
                    sources = [(stream, k, f"docs line {k + 1}") for k in starts]
                random.Random(f"{seed}-continuation_loss-{task}-{length}").shuffle(sources)
                out += first_examples(
                    sources,
                    n,
                    lambda source, i, task=task, length=length: self._example(tokenizer, task, length, i, *source),
                    f"the {self.split} split gives for {task} at {length} tokens",
                )
        return out

    def _example(self, tokenizer, task, length, i, text, start: int, where: str) -> Example | None:
        """The context from line ``start`` of ``text()`` (a :class:`LineTokens`; at most ``length`` tokens, the next
        line not blank) and the continuation after it; None when the text after ``start`` is too short."""
        est = text()
        lines = est.lines

        def allowed(j):
            return start + j < len(lines) and bool(lines[start + j].strip())

        def context(j):
            return "".join(lines[start : start + j])

        j = largest_prefix(len(lines) - start, lambda j: est.count(start, start + j) <= length, allowed)
        j = shrink_to_fit(j, lambda j: count_tokens(tokenizer, context(j)), length, allowed)
        tokens = count_tokens(tokenizer, context(j)) if j else 0
        if tokens < MIN_FILL * length:
            return None
        cut, need = start + j, self.continuation_tokens + 1 + _SPARE
        m = largest_prefix(len(lines) - cut, lambda m: est.count(cut, cut + m) < need) + 1
        continuation = "".join(lines[cut : cut + m])
        if count_tokens(tokenizer, continuation) < self.continuation_tokens + 1:
            return None
        return Example(
            id=f"{task}-{length}-{i}",
            context=context(j),
            question="",
            answers=[],
            max_new_tokens=self.continuation_tokens,
            task=task,
            continuation=continuation,
            metadata={
                "context_length": length,
                "prompt_tokens": tokens,
                "source": where,
                "first_line": start + 1,
                "chat_template": False,
                "split": self.split,
                **interpreter_metadata(),
            },
        )

    def score(self, prediction: str, example: Example) -> float:
        """Not used: a row is scored by its loss (:func:`evaluation.continuation.loss_score`).

        Raises:
            ValueError: always.
        """
        raise ValueError(
            "continuation_loss examples are scored by the loss of their continuation (evaluation.continuation), "
            "not by a generated prediction"
        )
