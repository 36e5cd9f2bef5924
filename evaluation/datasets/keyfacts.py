"""Key-value retrieval in prose passages: a multi-passage set the embedded model can answer, generated offline.

The context is a list of ``Passage N:`` passages (:func:`presses.entroprefill.chunking.passage_marker`, the
markers EntroPrefill's ``chunking="passage"`` mode splits on), each a few sentences of offline English prose
(:mod:`evaluation.datasets.prose`). One passage, drawn uniformly, holds RULER's "special magic number" fact
under a key (a noun such as ``walrus``) and a 7-digit value; the question names the key and the answer prefix is
RULER's. The layout follows LongBench's multi-document prompts (instruction, passages, instruction again,
question). Context lengths are counted in the model's tokens.

What the other passages hold besides prose (``distractor_facts``), every key distinct and no two sharing a word:

- ``"none"`` (default): nothing, so the answer passage is the only one with a fact;
- ``"other"``: one fact each under its own key, of another kind (``The special magic colour for otter is
  teal.``): only the answer passage holds a magic NUMBER;
- ``"number"``: one magic number each under its own key (RULER's ``niah_multikey`` with one needle per passage).

Why the default is ``"none"``: the set exists so that a compressed run's accuracy can be read against an
uncompressed one that is mostly right (docs/methods.md §5.5; the multi-document set of
:mod:`evaluation.datasets.multidoc` is answered 1-2 times in 20 by the embedded SmolLM2-135M). On a development
seed (1000, never the benchmark's) the uncompressed embedded model answered ``"none"`` at 2k/4k/8k tokens, but
``"number"`` and ``"other"`` fell to 0.0-0.5 from 4k on (every configuration tried and its score:
results/entroprefill/keyfacts_dev/README.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from evaluation.datasets.base import Example, place_question
from evaluation.datasets.prose import check_passage_count, check_passage_lengths, fill_body, prose_sentences
from presses.entroprefill.chunking import passage_marker

__all__ = [
    "KeyFactsDataset",
    "INSTRUCTION",
    "FACT_TEMPLATE",
    "QUESTION_TEMPLATE",
    "ANSWER_PREFIX",
    "KEYS",
    "OTHER_KINDS",
    "DISTRACTOR_MODES",
]

INSTRUCTION = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
)
HEADER = INSTRUCTION + "\n\nThe following are given passages.\n\n"
FACT_TEMPLATE = "The special magic {kind} for {key} is {value}."
QUESTION_TEMPLATE = "What is the special magic number for {key} mentioned in the passages?"
ANSWER_PREFIX = "The special magic number for {key} is"
#: the other fact kinds a distractor passage may hold (``distractor_facts="other"``) and their values
OTHER_KINDS = {
    "colour": ("crimson", "amber", "teal", "violet", "scarlet", "indigo", "ochre", "turquoise", "magenta", "cobalt"),
    "city": ("Lisbon", "Oslo", "Nairobi", "Montreal", "Kyoto", "Tbilisi", "Reykjavik", "Hanoi", "Cusco", "Krakow"),
    "weekday": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    "season": ("spring", "summer", "autumn", "winter"),
}
DISTRACTOR_MODES = ("number", "other", "none")
#: the keys: distinct concrete nouns, so no two keys share a word (an example draws its keys without replacement)
KEYS = tuple(
    """apple anchor badger banjo beetle bison blossom bottle bucket cabin camel candle canyon carpet castle
cedar cherry chimney cobra comet copper cotton crater crystal dagger desert diamond dragon eagle ember falcon
feather fiddle forest fossil fountain galaxy garlic ginger glacier goblet granite guitar hammer harbor hazel
helmet hornet iceberg ivory jaguar jasmine kettle koala ladder lagoon lantern lemon lizard lobster magnet mango
marble meadow meteor mirror monkey mustard nectar needle nickel nutmeg oasis octopus olive onion orchid otter
oyster panda parrot peach pebble pelican pepper pillow pirate planet pocket puzzle quartz rabbit radish raven
ribbon rocket saddle salmon sapphire scarf shovel silver spider sponge squirrel statue temple thistle thunder
tiger tomato trumpet tulip turtle velvet violin walnut walrus whistle willow wizard zebra""".split()
)


@dataclass
class KeyFactsDataset:
    """Multi-passage key-value retrieval: one passage holds the asked key's magic number (see the module docstring).

    Args:
        context_lengths: target context lengths in model tokens (passages plus instructions and question,
            before the chat template); examples cycle over them. The default's 8000 (not 8192) leaves room for
            the chat template, the answer prefix and the answer within a model of 8192 positions (SmolLM2).
        passage_tokens: approximate tokens per passage (prose sentences are added while they fit, leaving room
            for a fact); passages are added while the context stays within its length.
        distractor_facts: ``"none" | "other" | "number"``, what the other passages hold besides prose.
        num_samples: examples per context length when the run leaves ``n_samples`` unset.
        max_new_tokens: generation length.

    Raises:
        ValueError: for an unknown ``distractor_facts``, ``passage_tokens < 32``, or a context length that
            cannot hold two passages.
    """

    #: a smaller n_samples gives a subset of a larger one (ids and contents): grow=true may extend a run
    nested_samples: ClassVar[bool] = True

    context_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8000])
    passage_tokens: int = 96
    distractor_facts: str = "none"
    num_samples: int = 10
    max_new_tokens: int = 12
    name: str = "keyfacts"

    def __post_init__(self):
        if self.distractor_facts not in DISTRACTOR_MODES:
            raise ValueError(f"distractor_facts={self.distractor_facts!r} must be one of {DISTRACTOR_MODES}")
        check_passage_lengths(self.passage_tokens, self.context_lengths)

    def examples(self, tokenizer, n_samples: int | None, seed: int, query_aware: bool) -> list[Example]:
        """Build ``n_samples`` (default ``num_samples``) examples per context length.

        Each example is seeded by ``(seed, length, i)``, so a smaller ``n_samples`` gives a prefix of a larger
        one. The answer passage is drawn uniformly among the passages. Order: by length, then index.

        Args:
            tokenizer: the model's tokenizer, used to count tokens.
            n_samples: examples per length, or None for ``num_samples``.
            seed: generation seed; the same seed gives the same examples.
            query_aware: put the closing instruction and the question at the end of the context
                (``question`` is then empty) instead of asking it after compression.

        Raises:
            ValueError: for ``n_samples < 1``, or a length that holds fewer than two passages, or more
                fact passages than there are keys.
        """
        from evaluation.datasets.tokens import count_tokens

        n = self.num_samples if n_samples is None else int(n_samples)
        if n < 1:
            raise ValueError(f"n_samples={n} must be >= 1 (examples per context length)")
        sentences = prose_sentences()
        enc = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
        sent_len = [len(x) for x in enc]
        probe = QUESTION_TEMPLATE.format(key="sapphire")  # the longest key: budget for the question
        tail_probe = "\n\n" + INSTRUCTION + "\n\nQuestion: " + probe + "\nAnswer:"
        fact_len = count_tokens(
            tokenizer, " " + FACT_TEMPLATE.format(kind="weekday", key="sapphire", value="Wednesday")
        )
        out = []
        for length, i in ((int(ln), i) for ln in self.context_lengths for i in range(n)):
            rng = random.Random(f"{seed}-keyfacts-{length}-{i}")
            remaining = length - count_tokens(tokenizer, HEADER + tail_probe)
            bodies, j = [], rng.randrange(len(sentences))
            while True:  # prose bodies, each leaving room for one fact
                body, k = fill_body(sentences, sent_len, j, self.passage_tokens - fact_len)
                cost = count_tokens(tokenizer, "\n\n" + passage_marker(len(bodies) + 1) + "\n" + " ".join(body))
                cost += fact_len if self.distractor_facts != "none" or not bodies else 0
                if cost > remaining:
                    break
                bodies.append(body)
                remaining -= cost
                j = k
            n_pass = len(bodies)
            check_passage_count(length, n_pass, self.passage_tokens)
            n_facts = n_pass if self.distractor_facts != "none" else 1
            if n_facts > len(KEYS):
                raise ValueError(f"context_length={length} holds {n_facts} passages, more than the {len(KEYS)} keys")
            with_fact = sorted(rng.sample(range(n_pass), n_facts))
            asked_fact = rng.randrange(n_facts)
            keys = rng.sample(KEYS, n_facts)
            values = [str(v) for v in rng.sample(range(10**6, 10**7), n_facts)]
            for f, (p, key, value) in enumerate(zip(with_fact, keys, values)):
                kind = "number"
                if f != asked_fact and self.distractor_facts == "other":
                    kind = rng.choice(sorted(OTHER_KINDS))
                    value = rng.choice(OTHER_KINDS[kind])
                fact = FACT_TEMPLATE.format(kind=kind, key=key, value=value)
                bodies[p].insert(rng.randrange(len(bodies[p]) + 1), fact)
            passages = [passage_marker(p + 1) + "\n" + " ".join(body) for p, body in enumerate(bodies)]
            answer_idx, key = with_fact[asked_fact], keys[asked_fact]
            context = HEADER + "\n\n".join(passages)
            asked = "\n\n" + INSTRUCTION + "\n\nQuestion: " + QUESTION_TEMPLATE.format(key=key) + "\nAnswer:"
            context, asked, question_start = place_question(context, asked, query_aware)
            out.append(
                Example(
                    id=f"keyfacts-{length}-{i}",
                    context=context,
                    question=asked.lstrip("\n"),
                    answers=[values[asked_fact]],
                    answer_prefix=ANSWER_PREFIX.format(key=key),
                    max_new_tokens=self.max_new_tokens,
                    task="keyfacts",
                    question_start=question_start,
                    metadata={
                        "context_length": count_tokens(tokenizer, context + asked),
                        "target_length": length,
                        "n_passages": n_pass,
                        "answer_passage": answer_idx + 1,
                        "depth": 100.0 * answer_idx / max(1, n_pass - 1),
                        "key": key,
                    },
                )
            )
        return out

    def score(self, prediction: str, example: Example) -> float:
        """1.0 when the 7-digit value appears in the prediction, else 0.0."""
        return float(any(a in prediction for a in example.answers))
