"""Needle in a haystack, generated locally from a seed (docs/methods.md §5).

The haystack is offline English prose (:mod:`evaluation.datasets.prose`, ``haystack="prose"``) or real
documentation (``haystack="docs"``: the lines of CPython's bundled documentation, ``pydoc_data.topics``, of one
split of :mod:`evaluation.datasets.stdlib`, whose code, tables and cross-references are the distractors generated
prose spares a press); the needle is RULER's "special magic number": a key word pair and a 7-digit value. Context
lengths are counted in the model's own tokens; depth ``d`` puts the needle after a fraction ``d / 100`` of the
haystack's units (sentences, or lines). The needle is inserted between whole units, so its tokens are never split,
and the context carries no special token (the pipeline's chat template adds the single BOS). The needle, its key,
value and depth, and where its haystack starts are drawn from the same seeded generator for both haystacks.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from evaluation.datasets.base import Example, place_question
from evaluation.datasets.prose import prose_sentences
from evaluation.datasets.stdlib import check_split, topic_text, topics_in_split

__all__ = ["NeedleDataset", "NEEDLE_TEMPLATE", "QUESTION_TEMPLATE", "ANSWER_PREFIX", "HAYSTACKS", "haystack_units"]

#: ``prose``: generated English sentences joined by spaces; ``docs``: documentation lines joined by newlines.
HAYSTACKS = ("prose", "docs")

NEEDLE_TEMPLATE = "One of the special magic numbers for {key} is: {value}."
QUESTION_TEMPLATE = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
_ADJECTIVES = [
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "kind",
    "lucky",
    "misty",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
]
_NOUNS = [
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
]


@functools.cache
def _doc_lines(split: str) -> tuple[str, ...]:
    return tuple(line for topic in topics_in_split(split) for line in topic_text(topic).splitlines())


def haystack_units(haystack: str, split: str = "test") -> tuple[tuple[str, ...], str]:
    """The units a haystack is cut from and the text that joins them.

    Args:
        haystack: one of :data:`HAYSTACKS`.
        split: for ``"docs"``, the documentation split (``"dev"`` to choose settings on, ``"test"`` to report on;
            :func:`evaluation.datasets.stdlib.topics_in_split`); not read for ``"prose"``.

    Returns:
        ``(units, joiner)``: the prose sentences and ``" "``, or the documentation's lines (blank ones included, so
        joined they are the topics' own text) and ``"\n"``.

    Raises:
        ValueError: an unknown haystack or split.
    """
    if haystack == "prose":
        return prose_sentences(), " "
    if haystack == "docs":
        return _doc_lines(check_split(split)), "\n"
    raise ValueError(f"haystack={haystack!r} is not one of {HAYSTACKS}")


@dataclass
class NeedleDataset:
    """Needle-in-a-haystack examples.

    Args:
        context_length: target context length in model tokens (the haystack plus the needle, before
            the chat template); must leave room for the needle.
        depths: needle depths in percent, each in ``[0, 100]``.
        n_per_depth: examples per depth when the run's ``n_samples`` is unset.
        max_new_tokens: generation length.
        haystack: ``"prose"`` (default) or ``"docs"`` (:func:`haystack_units`).
        split: the documentation split of ``haystack="docs"``: ``"test"`` (default; nothing is tuned on it) or
            ``"dev"``.

    Raises:
        ValueError: for a depth outside ``[0, 100]``, a ``context_length`` too short for the needle, an unknown
            haystack or split.
    """

    context_length: int = 2048
    depths: list[float] = field(default_factory=lambda: [0, 25, 50, 75, 100])
    n_per_depth: int = 8
    max_new_tokens: int = 16
    name: str = "needle"
    haystack: str = "prose"
    split: str = "test"

    def __post_init__(self):
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"haystack={self.haystack!r} is not one of {HAYSTACKS}")
        check_split(self.split)
        bad = [d for d in self.depths if not 0 <= float(d) <= 100]
        if bad:
            raise ValueError(f"needle depths {bad} must lie in [0, 100] (percent)")
        if self.context_length < 64:
            raise ValueError(f"context_length={self.context_length} tokens is too short for a needle (minimum 64)")

    def examples(self, tokenizer, n_samples: int | None, seed: int, query_aware: bool) -> list[Example]:
        """Build ``len(depths) * per_depth`` examples; ``n_samples`` caps the total, spread over depths.

        Args:
            tokenizer: the model's tokenizer, used to count tokens.
            n_samples: total number of examples (depths cycle first), or None for ``n_per_depth`` each.
            seed: generation seed; the same seed gives the same examples.
            query_aware: put the question at the end of the context instead of after compression.
        """
        total = len(self.depths) * self.n_per_depth if n_samples is None else int(n_samples)
        sentences, joiner = haystack_units(self.haystack, self.split)
        lengths = [
            len(ids) for ids in tokenizer([joiner + s for s in sentences], add_special_tokens=False)["input_ids"]
        ]
        prefix_id = "needle" if self.haystack == "prose" else f"needle-{self.haystack}-{self.split}"
        out = []
        for i in range(total):
            depth = float(self.depths[i % len(self.depths)])
            rng = random.Random(f"{seed}-{self.context_length}-{i}")
            key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
            value = f"{rng.randrange(10**6, 10**7)}"
            needle = NEEDLE_TEMPLATE.format(key=key, value=value)
            budget = self.context_length - len(tokenizer.encode(joiner + needle, add_special_tokens=False))
            start = rng.randrange(len(sentences))
            hay, used, j = [], 0, start
            while used + lengths[j % len(sentences)] <= budget:
                hay.append(sentences[j % len(sentences)])
                used += lengths[j % len(sentences)]
                j += 1
            at = round(depth / 100 * len(hay))
            parts = hay[:at] + [needle] + hay[at:]
            context = joiner.join(parts)
            question = QUESTION_TEMPLATE.format(key=key)
            prefix = joiner.join(parts[:at])  # the needle's leading space merges into its first token
            needle_start = len(tokenizer.encode(prefix, add_special_tokens=False)) if at else 0
            n_tokens = len(tokenizer.encode(context, add_special_tokens=False))
            context, question, question_start = place_question(context, question, query_aware, separator="\n\n")
            out.append(
                Example(
                    id=f"{prefix_id}-{self.context_length}-d{depth:g}-{i}",
                    context=context,
                    question=question,
                    answers=[value],
                    answer_prefix=ANSWER_PREFIX.format(key=key),
                    max_new_tokens=self.max_new_tokens,
                    task="needle",
                    question_start=question_start,
                    metadata={
                        "depth": depth,
                        "context_length": n_tokens,
                        "needle": needle,
                        "key": key,
                        "needle_token_start": needle_start,
                    },
                )
            )
        return out

    def score(self, prediction: str, example: Example) -> float:
        """1.0 when the needle's 7-digit value appears in the prediction, else 0.0."""
        return float(any(a in prediction for a in example.answers))
