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

from evaluation.datasets.base import Example, Question, place_question
from evaluation.datasets.prose import prose_sentences
from evaluation.datasets.stdlib import check_split, topic_text, topics_in_split

__all__ = [
    "NeedleDataset",
    "NEEDLE_TEMPLATE",
    "QUESTION_TEMPLATE",
    "ANSWER_PREFIX",
    "AGGREGATE_QUESTION",
    "AGGREGATE_PREFIX",
    "HAYSTACKS",
    "haystack_units",
]

#: ``prose``: generated English sentences joined by spaces; ``docs``: documentation lines joined by newlines.
HAYSTACKS = ("prose", "docs")

NEEDLE_TEMPLATE = "One of the special magic numbers for {key} is: {value}."
QUESTION_TEMPLATE = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
#: the shared-context protocol's question that needs the whole context: every needle's value (scored by recall)
AGGREGATE_QUESTION = "What are all the special magic numbers mentioned in the provided text?"
AGGREGATE_PREFIX = "The special magic numbers mentioned in the provided text are"
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
        aggregate: with several questions per context (``protocol=shared``), the last one asks for every needle's
            value (:data:`AGGREGATE_QUESTION`, scored by recall); else every question asks for one needle.
        aggregate_max_new_tokens: the generation length of a context whose questions include the aggregate one (its
            answer lists every value: about 9 tokens each on SmolLM2's tokenizer).

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
    aggregate: bool = True
    aggregate_max_new_tokens: int = 64

    def __post_init__(self):
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"haystack={self.haystack!r} is not one of {HAYSTACKS}")
        check_split(self.split)
        bad = [d for d in self.depths if not 0 <= float(d) <= 100]
        if bad:
            raise ValueError(f"needle depths {bad} must lie in [0, 100] (percent)")
        if self.context_length < 64:
            raise ValueError(f"context_length={self.context_length} tokens is too short for a needle (minimum 64)")

    def shared_problem(self, questions: int) -> str | None:
        """Why a context cannot hold ``questions`` questions (``protocol=shared``), or None: one needle per question
        (:meth:`examples`), each under a distinct key of the :data:`_ADJECTIVES` x :data:`_NOUNS` pairs, in a
        context with room for them."""
        keys = len(_ADJECTIVES) * len(_NOUNS)
        if questions > keys:
            return f"the needles' keys are {keys} adjective-noun pairs, fewer than {questions} needles"
        if questions * 24 > self.context_length // 2:  # a needle is about 20 tokens
            return f"{questions} needles of about 24 tokens take over half of context_length={self.context_length}"
        return None

    def examples(
        self, tokenizer, n_samples: int | None, seed: int, query_aware: bool, questions: int | None = None
    ) -> list[Example]:
        """Build ``len(depths) * per_depth`` examples; ``n_samples`` caps the total, spread over depths.

        With ``questions`` (K, the shared-context protocol: :mod:`evaluation.shared`) example ``i`` instead holds K
        needles under distinct keys, needle ``j`` at a depth drawn in the ``j``-th of K equal slices of the haystack
        (``depths`` is not read), and asks for them one by one in a seeded order; with ``aggregate`` the last of the
        K questions asks for every needle's value instead (:data:`AGGREGATE_QUESTION`; one needle is then asked
        only there). Its id is ``<prefix>-<length>-k<K>-<i>``, seeded by ``(seed, length, K, i)`` alone.

        Args:
            tokenizer: the model's tokenizer, used to count tokens.
            n_samples: total number of examples (depths cycle first), or None for ``n_per_depth`` each.
            seed: generation seed; the same seed gives the same examples.
            query_aware: put the question at the end of the context instead of after compression (the first one).
            questions: questions per context (``protocol=shared``), or None for one.

        Each example's ``metadata`` holds ``context_length`` (the context's model tokens, before the chat template)
        and ``target_length`` (this dataset's ``context_length``: the length a report groups rows by), as
        :class:`evaluation.datasets.keyfacts.KeyFactsDataset`'s do.
        """
        total = len(self.depths) * self.n_per_depth if n_samples is None else int(n_samples)
        sentences, joiner = haystack_units(self.haystack, self.split)
        lengths = [
            len(ids) for ids in tokenizer([joiner + s for s in sentences], add_special_tokens=False)["input_ids"]
        ]
        prefix_id = "needle" if self.haystack == "prose" else f"needle-{self.haystack}-{self.split}"
        if questions is not None:
            problem = self.shared_problem(int(questions))
            if problem:
                raise ValueError(f"needle: {problem}")
            return [
                self._shared_example(tokenizer, i, seed, int(questions), query_aware, sentences, lengths, joiner)
                for i in range(total)
            ]
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
                        "target_length": self.context_length,
                        "needle": needle,
                        "key": key,
                        "needle_token_start": needle_start,
                    },
                )
            )
        return out

    def _shared_example(self, tokenizer, i, seed, K, query_aware, sentences, lengths, joiner) -> Example:
        """Example ``i`` with K needles and K questions (see :meth:`examples`)."""
        rng = random.Random(f"{seed}-{self.context_length}-shared{K}-{i}")
        keys: list[str] = []
        while len(keys) < K:
            key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
            if key not in keys:
                keys.append(key)
        values = [f"{rng.randrange(10**6, 10**7)}" for _ in range(K)]
        needles = [NEEDLE_TEMPLATE.format(key=k, value=v) for k, v in zip(keys, values)]
        budget = self.context_length - sum(len(tokenizer.encode(joiner + n, add_special_tokens=False)) for n in needles)
        start = rng.randrange(len(sentences))
        hay, used, j = [], 0, start
        while used + lengths[j % len(sentences)] <= budget:
            hay.append(sentences[j % len(sentences)])
            used += lengths[j % len(sentences)]
            j += 1
        depths = [100 * (j + rng.random()) / K for j in range(K)]  # needle j in the j-th of K slices
        cuts = [round(d / 100 * len(hay)) for d in depths]
        parts = []
        for j in range(K):
            parts += hay[cuts[j - 1] if j else 0 : cuts[j]] + [needles[j]]
        parts += hay[cuts[-1] :]
        context = joiner.join(parts)
        order = rng.sample(range(K), K)
        aggregate = self.aggregate and K > 1
        asked = [
            Question(
                QUESTION_TEMPLATE.format(key=keys[j]),
                [values[j]],
                ANSWER_PREFIX.format(key=keys[j]),
                "retrieve",
                {"depth": round(depths[j], 2), "key": keys[j], "needle": needles[j]},
            )
            for j in (order[: K - 1] if aggregate else order)
        ]
        if aggregate:
            asked.append(Question(AGGREGATE_QUESTION, list(values), AGGREGATE_PREFIX, "aggregate", {"depth": None}))
        n_tokens = len(tokenizer.encode(context, add_special_tokens=False))
        context, question, question_start = place_question(context, asked[0].question, query_aware, separator="\n\n")
        prefix_id = "needle" if self.haystack == "prose" else f"needle-{self.haystack}-{self.split}"
        return Example(
            id=f"{prefix_id}-{self.context_length}-k{K}-{i}",
            context=context,
            question=question,
            answers=list(asked[0].answers),
            answer_prefix=asked[0].answer_prefix,
            max_new_tokens=self.aggregate_max_new_tokens if aggregate else self.max_new_tokens,
            task="needle",
            question_start=question_start,
            metadata={
                "depth": asked[0].metadata["depth"],
                "context_length": n_tokens,
                "target_length": self.context_length,
                "needles": K,
                "needle_depths": [round(d, 2) for d in depths],
            },
            questions=tuple(asked),
        )

    def score(self, prediction: str, example: Example) -> float:
        """The fraction of the answers whose value appears in the prediction: for one needle 1.0 or 0.0, for the
        shared-context protocol's aggregate question its recall."""
        return sum(a in prediction for a in example.answers) / len(example.answers)
