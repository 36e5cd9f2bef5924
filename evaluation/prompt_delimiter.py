"""The delimiter token a press needs between the document and the question (capability ``needs_delimiter``:
kvpress's Finch press), set up as kvpress's own evaluation sets it up.

Finch compresses with the question inside the context (``query_aware=true``) and finds where the question starts
by a delimiter token: kvpress adds the token to the tokenizer and resizes the model's embeddings
(its ``update_model_and_tokenizer``), then prompts ``document + delimiter + question``; its embedding hook
drops the delimiter again, and the tokens after it are SnapKV's observation window. Here:

- the run gets a model and tokenizer of its own (``evaluation.harness.get_model``'s ``variant``), so the resized
  embeddings and the grown tokenizer never reach a run of another press; a call that mixes such runs with others
  is refused;
- the delimiter goes where the dataset says the question part starts (:attr:`evaluation.datasets.base.Example.
  question_start`: needle before its ``"\\n\\n" + question``, RULER before the task's question marker, keyfacts,
  multidoc, LongBench, stdlib_docs and stdlib_code before their closing instruction or question); an example that
  cannot say, or whose question part is empty (LongBench's and stdlib_code's ``lcc``), is refused;
- the rows count the context the press compresses, without the delimiter (:func:`strip`).
"""

from __future__ import annotations

import dataclasses

from evaluation.registry import install_delimiter

__all__ = ["VARIANT", "delimited", "model_variant", "setup", "strip"]

#: The name of the model copy a press that needs a delimiter runs on (``evaluation.harness.get_model``).
VARIANT = "prompt delimiter"


def model_variant(runs: list) -> str:
    """The model copy ``runs`` (the loop's runs, with ``caps``) need: :data:`VARIANT`, or ``""`` (the plain model)."""
    return VARIANT if any(run.caps.needs_delimiter for run in runs) else ""


def setup(runs: list, model, tokenizer, examples: list, seed: int) -> tuple[list, int | None]:
    """Install the delimiter of the runs whose press needs one and put it into every example's context.

    Args:
        runs: the loop's runs (``press``, ``caps``, ``names``); all or none need a delimiter.
        model, tokenizer: the run's own copy (:func:`model_variant`), changed in place.
        examples: the run's examples, the question inside the context (``query_aware=true``).
        seed: seeds the new embedding rows (:func:`evaluation.registry.install_delimiter`).

    Returns:
        ``(examples, token_id)``: the examples with ``document + delimiter + question`` as their context and the
        delimiter's token id; the examples unchanged and None when no run needs a delimiter.

    Raises:
        ValueError: runs that mix such presses with others, presses that disagree on the token, or an example that
            does not say where its question starts (:attr:`evaluation.datasets.base.Example.question_start`).
    """
    needing = [run for run in runs if run.caps.needs_delimiter]
    if not needing:
        return examples, None
    if len(needing) < len(runs):
        raise ValueError(
            f"press {needing[0].names['press']} adds a delimiter token to the model and tokenizer: run it apart from "
            f"the other presses ({', '.join(sorted({r.names['press'] for r in runs if not r.caps.needs_delimiter}))})"
        )
    tokens = {install_delimiter(run.press, model, tokenizer, seed) for run in needing}
    if len(tokens) != 1:
        raise ValueError(f"the presses of one call need different delimiter tokens {sorted(tokens)}: run them apart")
    token = tokens.pop()
    out = [delimited(ex, token, needing[0].names["press"]) for ex in examples]
    return out, tokenizer.convert_tokens_to_ids(token)


def delimited(ex, token: str, press: str):
    """``ex`` (an :class:`evaluation.datasets.base.Example`) with ``token`` between the document and the question:
    at :attr:`~evaluation.datasets.base.Example.question_start`, which the result no longer has.

    Raises:
        ValueError: naming the example and ``press`` (the press that needs the token), when the example does not say
            where its question starts inside the context.
    """
    at = ex.question_start
    if at is None or not 0 < at < len(ex.context):
        raise ValueError(
            f"example {ex.id!r}: press {press} needs a delimiter between the document and the "
            f"question, and the dataset does not say where a non-empty question starts inside the context "
            f"(question_start={at}, context of {len(ex.context)} characters); set query_aware=true, or use a dataset "
            "that sets it (needle, ruler, keyfacts, multidoc, longbench, stdlib_docs, stdlib_code)"
        )
    return dataclasses.replace(ex, context=ex.context[:at] + token + ex.context[at:], question_start=None)


def strip(tokens: dict[str, dict], token_id: int | None) -> dict[str, dict]:
    """The tokenised examples (the loop's, by id) without the delimiter token: the context the press compresses.

    Args:
        tokens: per example id, kvpress's ``preprocess`` output (``context_ids`` ``(1, T + 1)``).
        token_id: the delimiter's id (:func:`setup`), or None (``tokens`` unchanged).

    Returns:
        The same mapping with ``context_ids`` ``(1, T)``.

    Raises:
        ValueError: a context that does not hold the delimiter exactly once (the press would refuse it).
    """
    if token_id is None:
        return tokens
    out = {}
    for key, ids in tokens.items():
        context = ids["context_ids"]
        keep = context[0] != token_id
        if int((~keep).sum()) != 1:
            raise ValueError(
                f"example {key!r}: the tokenised context holds the delimiter token {int((~keep).sum())} times, not once"
            )
        out[key] = {**ids, "context_ids": context[:, keep]}
    return out
