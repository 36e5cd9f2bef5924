"""Compress once, ask many: the shared-context protocol (``protocol=shared``; docs/methods.md §5.7).

A context is prefilled and compressed once, then asked its K questions (``questions``, default 4:
:data:`evaluation.settings.SHARED_DEFAULTS`) one after another, as a cached document, code base or chat history is
(SCBench, arXiv 2412.10319: "shared context, multiple requests"; KVzip, arXiv 2505.23416):

- ``shared_mode=request`` (multi-request): each question on the compressed context alone, as kvpress's pipeline
  answers ``questions=[...]``: the answer is cut off the cache after each question (the cache's keys and values
  sliced back, its decode-time state kept: :mod:`presses.attention`), which decodes as a copy of the compressed
  cache would;
- ``shared_mode=turn`` (multi-turn): the questions form one chat: each question, as the chat template's next user
  turn (:func:`evaluation.pipeline.next_turn_text`), and the model's answer stay in the cache for the next.

With ``query_aware=true`` the first question sits inside the compressed context (the press knew it) and the later
ones are asked after it (it never knew them); in multi-request they follow the first one's text after
:data:`FOLLOWUP_SEPARATOR`. Every question of a context is answered with the example's ``max_new_tokens``.

A dataset gives such contexts through ``examples(..., questions=K)``
(:attr:`evaluation.datasets.base.Example.questions`: needle, RULER's multi-key tasks, stdlib_docs). Each question
gets a row (:func:`rows`): the id ``<example>#q<k>`` (:func:`evaluation.harness.row_ids`), ``example_id``,
``question_index`` k (1-based: question 1 is asked first), ``questions`` K, ``question_kind`` and the answer's own
score; the costs are the context's once, ``prefill_seconds`` (``evaluation.run``: the press's prefill, compression
included; ``evaluation.fused``: the shared uncompressed prefill) and ``replay_seconds`` (``evaluation.fused``: the
press's replay on it), and the answer's own ``decode_seconds``. ``seconds`` is the three summed: the cost of this
answer had it been the only question; the report's cost per answered question pays the context's costs once over K
answers (:mod:`evaluation.shared_report`).
Runs live in ``<dataset>-shared[-qa]/`` and ``<dataset>-turns[-qa]/`` (:func:`evaluation.harness.protocol_suffix`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from evaluation import harness

__all__ = ["FOLLOWUP_SEPARATOR", "Protocol", "asked", "question_view", "rows", "tokenise"]

#: In multi-request with the first question inside the compressed context, what separates it from a later question.
FOLLOWUP_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Protocol:
    """A run's shared-context settings: ``questions`` per context, in ``turns`` (multi-turn) or not (multi-request),
    the first one inside the compressed context (``query_aware``) or not."""

    questions: int
    turns: bool
    query_aware: bool

    @classmethod
    def of(cls, cfg) -> Protocol | None:
        """The protocol of a normalised run config (:func:`evaluation.settings.normalise`), or None for
        ``protocol=single``."""
        if cfg.get("protocol") != "shared":
            return None
        return cls(int(cfg.questions), cfg.shared_mode == "turn", bool(cfg.query_aware))

    @property
    def mode(self) -> str:
        """``"turn"`` or ``"request"`` (``shared_mode``)."""
        return "turn" if self.turns else "request"


def asked(ex, protocol: Protocol) -> tuple[list[str], list[str]]:
    """The texts the K questions of ``ex`` are asked with, and their answer prefixes.

    Question 1 is the example's own (empty when ``query_aware`` put it inside the context); a later one is its
    :attr:`evaluation.datasets.base.Question.question`, after :data:`FOLLOWUP_SEPARATOR` in multi-request with the
    first question inside the context (in a chat the template's turn separates it).

    Raises:
        ValueError: an example without :attr:`evaluation.datasets.base.Example.questions`, or with another number of
            them than the protocol's.
    """
    if len(ex.questions) != protocol.questions:
        raise ValueError(
            f"example {ex.id}: {len(ex.questions)} questions where protocol=shared asks questions={protocol.questions}"
        )
    lead = FOLLOWUP_SEPARATOR if protocol.query_aware and not protocol.turns else ""
    texts = [ex.question] + [lead + q.question for q in ex.questions[1:]]
    return texts, [q.answer_prefix for q in ex.questions]


def tokenise(pipe, ex, protocol: Protocol) -> dict:
    """``ex`` tokenised for the protocol (the caller holds the example's chat template setting): the context ids
    ``(1, T)`` and one ``(1, n_k)`` per question, as :class:`evaluation.pipeline.TextGenerationPipeline` feeds them
    (its ``answer_prefixes`` and ``turns``)."""
    questions, prefixes = asked(ex, protocol)
    return pipe.preprocess(
        ex.context, questions, ex.answer_prefix, int(1e10), answer_prefixes=prefixes, turns=protocol.turns
    )


def question_view(ex, k: int):
    """Question ``k`` (1-based) of ``ex`` as an example of its own, for scoring and its row: the row id
    (:func:`evaluation.harness.row_ids`), the question's text, answers and prefix, and the question's metadata over
    the example's."""
    q = ex.questions[k - 1]
    return dataclasses.replace(
        ex,
        id=harness.row_ids(ex)[k - 1],
        question=ex.question if k == 1 else q.question,
        answers=list(q.answers),
        answer_prefix=q.answer_prefix,
        metadata={**ex.metadata, **q.metadata},
        questions=(),
    )


def rows(
    ex,
    names: dict,
    dataset,
    answers: list[str],
    decode_seconds: list[float],
    cache,
    model,
    T: int,
    press,
    protocol: Protocol,
    prefill_seconds: float,
    replay_seconds: float | None = None,
    **extra,
) -> list[dict]:
    """One prediction row per question of ``ex`` (:func:`evaluation.harness.prediction_row`), in order.

    Args:
        ex: the example (its K questions).
        names, dataset, model, press: as for :func:`evaluation.harness.prediction_row`.
        answers: the K answers, in question order.
        decode_seconds: each answer's decode (question forward and greedy decode; in a chat, the turn's).
        cache: the run's compressed cache, holding the compressed context (its compression is every row's).
        T: the uncompressed context's length in tokens.
        protocol: the run's protocol.
        prefill_seconds: the context's prefill (``evaluation.run``: with the press, compression included;
            ``evaluation.fused``: the shared uncompressed one).
        replay_seconds: the press's replay on the shared prefill (``evaluation.fused``), or None.
        extra: more fields of every row (``shared_prefill``, ``decode_batch``).
    """
    once = prefill_seconds + (replay_seconds or 0.0)
    out = []
    for k, (answer, decode) in enumerate(zip(answers, decode_seconds), start=1):
        costs = {"prefill_seconds": prefill_seconds, "decode_seconds": decode}
        if replay_seconds is not None:
            costs["replay_seconds"] = replay_seconds  # the press's own prefill work (evaluation.frontier.run_costs)
        out.append(
            harness.prediction_row(
                question_view(ex, k),
                names,
                dataset,
                answer,
                cache,
                model,
                T,
                once + decode,
                press,
                example_id=ex.id,
                question_index=k,
                questions=protocol.questions,
                question_kind=ex.questions[k - 1].kind,
                shared_mode=protocol.mode,
                **costs,
                **extra,
            )
        )
    return out
