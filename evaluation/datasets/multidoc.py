"""Multi-document QA in the spirit of LongBench's multi-doc tasks, generated locally from a seed.

The context is a list of ``Passage N:`` passages (:func:`presses.entroprefill.chunking.passage_marker`, the
markers EntroPrefill's ``chunking="passage"`` mode splits on) built from offline English prose
(:mod:`evaluation.datasets.prose`, CPython's ``pydoc_data.topics``). Every passage carries one
generated fact of the same kind about a different person (a city of residence, or an access
code), so the passages are distractors for each other; exactly one passage holds the fact about
the person the question asks for, and the answer string occurs exactly once in the context. The
layout follows LongBench's multi-doc prompts (instruction, passages, instruction again, question).
Context lengths are counted in the model's tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from evaluation.datasets.base import Example, place_question
from evaluation.datasets.prose import check_passage_count, check_passage_lengths, fill_body, prose_sentences
from presses.entroprefill.chunking import passage_marker

__all__ = ["MultiDocQADataset", "INSTRUCTION", "FACTS"]

INSTRUCTION = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
)
HEADER = INSTRUCTION + "\n\nThe following are given passages.\n\n"
#: fact kind -> (fact sentence, question); ``{name}`` and ``{value}`` are filled in.
FACTS = {
    "city": ("{name} lives in the city of {value}.", "In which city does {name} live?"),
    "code": ("The access code of {name} is {value}.", "What is the access code of {name}?"),
}
_FIRST = [
    "Alma",
    "Bruno",
    "Clara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Leon",
    "Mara",
    "Nils",
    "Olga",
    "Pavel",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Viktor",
    "Wanda",
    "Xavier",
    "Yara",
    "Zeno",
]
_LAST = [
    "Abbott",
    "Brennan",
    "Castillo",
    "Dalton",
    "Eriksen",
    "Fischer",
    "Gallo",
    "Hartley",
    "Ivanova",
    "Jansen",
    "Kowalski",
    "Lindqvist",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Petrov",
    "Quinn",
    "Rossi",
    "Schmidt",
    "Tanaka",
    "Ueda",
    "Varga",
    "Weber",
    "Yilmaz",
    "Zamora",
]
_CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Montreal",
    "Kyoto",
    "Valparaiso",
    "Tbilisi",
    "Marrakesh",
    "Reykjavik",
    "Hanoi",
    "Bergen",
    "Cusco",
    "Krakow",
    "Adelaide",
    "Tallinn",
    "Porto",
    "Dakar",
    "Zagreb",
    "Busan",
    "Ljubljana",
    "Cordoba",
    "Tromso",
    "Windhoek",
    "Hobart",
    "Salzburg",
    "Quito",
    "Izmir",
    "Gdansk",
    "Lyon",
    "Seville",
    "Bologna",
    "Antwerp",
    "Kathmandu",
    "Bratislava",
    "Vilnius",
    "Mombasa",
    "Tucson",
    "Halifax",
    "Dunedin",
    "Galway",
]


def _code(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    return f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randrange(1000, 10000)}"


@dataclass
class MultiDocQADataset:
    """Multi-document QA examples (one answer passage among distractor passages).

    Args:
        context_lengths: target context lengths in model tokens (passages plus instructions and
            question, before the chat template); examples cycle over them.
        passage_tokens: approximate tokens per passage (prose sentences are added while they fit);
            passages are added while the context stays within its length (at most 40 for cities).
        num_samples: examples per fact kind (task) and context length when the run leaves ``n_samples`` unset.
        fact_kinds: kinds of facts (keys of :data:`FACTS`); examples cycle over them.
        max_new_tokens: generation length.

    Raises:
        ValueError: for an unknown fact kind, ``passage_tokens < 32``, or a context length that
            cannot hold two passages.
    """

    context_lengths: list[int] = field(default_factory=lambda: [2048, 4096])
    passage_tokens: int = 160
    num_samples: int = 5
    fact_kinds: list[str] = field(default_factory=lambda: ["city", "code"])
    max_new_tokens: int = 12
    name: str = "multidoc"

    def __post_init__(self):
        bad = [k for k in self.fact_kinds if k not in FACTS]
        if bad or not self.fact_kinds:
            raise ValueError(f"fact_kinds {list(self.fact_kinds)} must be a non-empty subset of {sorted(FACTS)}")
        check_passage_lengths(self.passage_tokens, self.context_lengths)

    def examples(self, tokenizer, n_samples: int | None, seed: int, query_aware: bool) -> list[Example]:
        """Build ``n_samples`` (default ``num_samples``) examples per fact kind and context length.

        Each example is seeded by ``(seed, kind, length, i)``, so a smaller ``n_samples`` gives a prefix
        of a larger one. Order: by length, then index, alternating fact kinds.

        Args:
            tokenizer: the model's tokenizer, used to count tokens.
            n_samples: examples per task (fact kind) and length, or None for ``num_samples``.
            seed: generation seed; the same seed gives the same examples.
            query_aware: put the closing instruction and the question at the end of the context
                (``question`` is then empty) instead of asking it after compression.
        """
        from evaluation.datasets.tokens import count_tokens

        lengths = [int(n) for n in self.context_lengths]
        n = self.num_samples if n_samples is None else int(n_samples)
        if n < 1:
            raise ValueError(f"n_samples={n} must be >= 1 (examples per fact kind and length)")
        sentences = prose_sentences()
        enc = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
        sent_len = [len(x) for x in enc]
        out = []
        for length, i, kind in ((ln, i, k) for ln in lengths for i in range(n) for k in self.fact_kinds):
            rng = random.Random(f"{seed}-multidoc-{kind}-{length}-{i}")
            fact_t, question_t = FACTS[kind]
            probe = question_t.format(name="Xavier Castillo")  # a long name: budget for the question
            tail_probe = "\n\n" + INSTRUCTION + "\n\nQuestion: " + probe + "\nAnswer:"
            remaining = length - count_tokens(tokenizer, HEADER + tail_probe)
            names = rng.sample([f"{f} {lst}" for f in _FIRST for lst in _LAST], len(_FIRST) * len(_LAST))
            values = rng.sample(_CITIES, len(_CITIES)) if kind == "city" else _unique_codes(rng, 200)
            passages, j = [], rng.randrange(len(sentences))
            while len(passages) < len(values):
                p = len(passages)
                fact = fact_t.format(name=names[p], value=values[p])
                body, k = fill_body(sentences, sent_len, j, self.passage_tokens - count_tokens(tokenizer, " " + fact))
                body.insert(rng.randrange(len(body) + 1), fact)
                passage = passage_marker(p + 1) + "\n" + " ".join(body)
                cost = count_tokens(tokenizer, "\n\n" + passage)
                if cost > remaining:
                    break
                passages.append(passage)
                remaining -= cost
                j = k
            n_pass = len(passages)
            check_passage_count(length, n_pass, self.passage_tokens)
            context = HEADER + "\n\n".join(passages)
            # the asked person's value must occur exactly once (prose could contain a city's name)
            unique = [p for p in range(n_pass) if context.lower().count(values[p].lower()) == 1]
            answer_idx = rng.choice(unique)
            question = question_t.format(name=names[answer_idx])
            asked = "\n\n" + INSTRUCTION + "\n\nQuestion: " + question + "\nAnswer:"
            answer = values[answer_idx]
            context, asked, question_start = place_question(context, asked, query_aware)
            out.append(
                Example(
                    id=f"multidoc-{kind}-{length}-{i}",
                    context=context,
                    question=asked.lstrip("\n"),
                    answers=[answer],
                    answer_prefix="",
                    max_new_tokens=self.max_new_tokens,
                    task=f"multidoc_{kind}",
                    question_start=question_start,
                    metadata={
                        "context_length": count_tokens(tokenizer, context + asked),
                        "target_length": length,
                        "n_passages": n_pass,
                        "answer_passage": answer_idx + 1,
                        "depth": 100.0 * answer_idx / max(1, n_pass - 1),
                        "fact_kind": kind,
                        "person": names[answer_idx],
                    },
                )
            )
        return out

    def score(self, prediction: str, example: Example) -> float:
        """1.0 when an answer string occurs in the prediction (case-insensitive), else 0.0."""
        return float(any(a.lower() in prediction.lower() for a in example.answers))


def _unique_codes(rng: random.Random, n: int) -> list[str]:
    codes: list[str] = []
    while len(codes) < n:
        c = _code(rng)
        if c not in codes:
            codes.append(c)
    return codes
