"""Teacher-forced continuation loss: how much a compressed cache changes the model's predictions of real text.

For an example whose ``continuation`` is set (:class:`evaluation.datasets.base.Example`, e.g.
:mod:`evaluation.datasets.continuation_loss`) the loop does not generate. With ``c_0 .. c_n`` the first ``n + 1``
tokens of the continuation (``n``: the example's ``max_new_tokens``, 256 by default), the ``n`` tokens
``c_0 .. c_{n-1}`` are fed in one forward on the cache the prefill of the context left (positions ``T .. T+n-1``
as the pipeline's decode, whatever the press kept; a decode-time bias such as the SNIS correction applies), and
the ``n`` next-token distributions ``q_t`` that predict ``c_1 .. c_n`` are compared with ``p_t``, those after the
uncompressed context (the same forward on the full cache):

- ``nll = -(1/n) sum_t log q_t(c_{t+1})`` and ``nll_uncompressed`` the same under ``p_t`` (nats per token);
- ``nll_increase = nll - nll_uncompressed``;
- ``kl = (1/n) sum_t KL(p_t || q_t)`` (nats), the mean divergence of the next-token distributions;
- the row's ``score`` is ``exp(-kl)`` (:func:`loss_score`): 1 for a cache that changes no prediction, lower the
  more the predictions move, in ``(0, 1]`` as every score of the harness, so the report's tables and win scores
  rank presses by it. ``exp(-nll_increase)`` was not chosen: a compressed context can lower the loss of some
  continuation, which would put that score above 1.

``c_0``, the token right after the context, is fed but not scored: it is predicted by the prefill's last position,
which a press that compresses in its hooks computes before compressing. The uncompressed ``p_t`` comes from the
same forward on the uncompressed cache, so the uncompressed run scores exactly 0 increase and 0 KL; it equals the
model's own loss on the text (one forward over context and continuation) up to floating-point rounding
(``tests/test_continuation_loss.py``).

Two entry points, one per loop mode (:mod:`evaluation.loop`):

- :func:`run_row` (``python -m evaluation.run``): the press compresses the context as a user runs it,
  ``with press(model): model.model(context_ids, past_key_values=cache)``, then the teacher-forced forward; the
  uncompressed reference is computed once per example and process (:class:`ReferenceMemo`, every press shares it);
- :func:`shared_rows` (``python -m evaluation.fused``): each press's cache replayed from the shared prefill, whose
  own cache is the uncompressed reference. Each run's forward is its own (no batching or padding), so both entry
  points compute the same numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from evaluation import harness, kvzip_path
from evaluation.datasets.tokens import encode
from evaluation.replay import replay_prefill
from presses import attention

__all__ = [
    "continuation_ids",
    "teacher_forced_hidden",
    "loss_stats",
    "loss_score",
    "ReferenceMemo",
    "run_row",
    "shared_rows",
]


def continuation_ids(tokenizer, ex, n: int) -> torch.Tensor:
    """The first ``n + 1`` tokens of ``ex.continuation`` (no special tokens), ``(1, n + 1)`` long.

    Raises:
        ValueError: the continuation has fewer than ``n + 1`` tokens (naming the example and both counts).
    """
    ids = encode(tokenizer, ex.continuation)
    if len(ids) < n + 1:
        raise ValueError(
            f"example {ex.id}: its continuation has {len(ids)} tokens, fewer than max_new_tokens + 1 = {n + 1} "
            "(use a smaller max_new_tokens)"
        )
    return torch.tensor([ids[: n + 1]], dtype=torch.long)


def teacher_forced_hidden(model, cache, ids: torch.Tensor, context_length: int) -> torch.Tensor:
    """The last hidden states (after the final norm) of ``ids[:, :-1]`` fed on ``cache`` at positions
    ``context_length ...``; the cache is left as it was (the fed tokens are cut off again, as the pipeline removes
    an answer).

    Args:
        model: the causal LM (its decode-time biases, if any, are applied).
        cache: the context's cache (any per-layer lengths).
        ids: ``(1, n + 1)`` the continuation's tokens.
        context_length: ``T``, the context's tokens (BOS included).

    Returns:
        ``(1, n, d)`` float hidden states, the inputs of the LM head that predict ``ids[:, 1:]``.
    """
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    inputs = ids[:, :-1].to(model.device)
    positions = torch.arange(context_length, context_length + inputs.shape[1], device=model.device).unsqueeze(0)
    with torch.inference_mode():
        out = model.model(input_ids=inputs, past_key_values=cache, position_ids=positions)
    for i, n in enumerate(lengths):
        layer = cache.layers[i]
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
    return out.last_hidden_state


def _log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    """``(n, V)`` float32 log-probabilities of the LM head on ``(1, n, d)`` hidden states."""
    with torch.inference_mode():
        return F.log_softmax(model.get_output_embeddings()(hidden)[0].float(), dim=-1)


def loss_stats(model, hidden: torch.Tensor, reference: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """The continuation's loss under a compressed cache against the uncompressed one (module docstring).

    Args:
        model: the causal LM (its output embedding is the LM head).
        hidden: ``(1, n, d)`` :func:`teacher_forced_hidden` on the compressed cache.
        reference: ``(1, n, d)`` the same on the uncompressed cache.
        ids: ``(1, n + 1)`` the continuation's tokens.

    Returns:
        ``{"nll", "nll_uncompressed", "nll_increase", "kl"}`` in nats per token.
    """
    targets = ids[0, 1:].to(hidden.device)
    q, p = _log_probs(model, hidden), _log_probs(model, reference)
    nll = -q.gather(1, targets[:, None]).mean().item()
    nll_ref = -p.gather(1, targets[:, None]).mean().item()
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return {"nll": nll, "nll_uncompressed": nll_ref, "nll_increase": nll - nll_ref, "kl": max(0.0, kl)}


def loss_score(stats: dict[str, float]) -> float:
    """A continuation row's ``score``: ``exp(-kl)`` in ``(0, 1]`` (module docstring)."""
    return math.exp(-stats["kl"])


def _row(run, ex, dataset, model, cache, T: int, n: int, stats: dict, seconds: float, **extra) -> dict:
    return harness.prediction_row(
        ex,
        run.names,
        dataset,
        "",
        cache,
        model,
        T,
        seconds,
        run.press,
        score=loss_score(stats),
        **stats,
        continuation_tokens=n,
        **extra,
    )


class ReferenceMemo:
    """The uncompressed reference of each example, computed once per process and model (every press of an
    ``evaluation.run`` sweep in one process shares it).

    Per model (held weakly: a model's entries leave with it), keyed by the example (id, context and continuation
    text) and ``n``; holds the ``(1, n, d)`` hidden states on the CPU (``4 n d`` bytes: 0.6 MB for SmolLM2 at
    ``n = 256``), at most :data:`MAX_BYTES` in all (further examples are then recomputed each time, not stored).
    """

    MAX_BYTES = 1 << 30
    _store: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def get(cls, model, ex, context_ids: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The reference hidden states of ``ex`` (``(1, n, d)``, on the model's device): the context prefilled
        without a press, then :func:`teacher_forced_hidden`."""
        text = hashlib.sha256((ex.context + "\0" + ex.continuation).encode()).hexdigest()
        key = (ex.id, text, ids.shape[1], str(model.dtype), model.config._attn_implementation)
        store = cls._store.setdefault(model, {})
        if key in store:
            return store[key].to(model.device)
        cache = DynamicCache()
        with torch.inference_mode():
            model.model(input_ids=context_ids, past_key_values=cache)
        reference = teacher_forced_hidden(model, cache, ids, context_ids.shape[1])
        held = sum(t.numel() * t.element_size() for s in cls._store.values() for t in s.values())
        if held + reference.numel() * reference.element_size() <= cls.MAX_BYTES:
            store[key] = reference.cpu()
        return reference


def run_row(run, ex, dataset, model, tokenizer, context_ids: torch.Tensor, n: int) -> dict:
    """One ``evaluation.run`` row of a continuation example: the press's prefill (``with press(model)``), the
    teacher-forced continuation, the loss against the uncompressed reference. ``seconds``: the prefill and the
    forward (not the shared reference).

    Raises:
        ValueError: as :func:`continuation_ids`.
    """
    ids = continuation_ids(tokenizer, ex, n)
    reference = ReferenceMemo.get(model, ex, context_ids, ids)
    start = time.perf_counter()
    cache = DynamicCache()
    with run.press(model) if run.press is not None else contextlib.nullcontext(), torch.inference_mode():
        model.model(input_ids=context_ids, past_key_values=cache)
    hidden = teacher_forced_hidden(model, cache, ids, context_ids.shape[1])  # with the cache's decode-time state
    seconds = time.perf_counter() - start
    stats = loss_stats(model, hidden, reference, ids)
    return _row(run, ex, dataset, model, cache, context_ids.shape[1], n, stats, seconds)


def shared_rows(
    replayed: Iterable, capture, ex, dataset, model, tokenizer, T: int, n: int, prefill_seconds: float, masked=()
):
    """The ``evaluation.fused`` rows of a continuation example: each replayed press cache
    (``(run, cache, replay seconds, decode state per layer)``, as :mod:`evaluation.loop` replays them: from an
    iterator that replays each run when asked for, so one press cache is held at a time) teacher-forced on its own,
    against the shared prefill's uncompressed cache, then each ``masked`` run
    (``(run, cache, seconds, masks, state)``, :func:`evaluation.kvzip_path.selected_runs`) with its masked keys and
    decode-time state.
    ``seconds``: the shared prefill, the press's replay and its forward; ``prefill_seconds`` the shared part,
    ``replay_seconds`` the press's.

    Returns:
        ``[(run, row), ...]`` in ``replayed`` order.

    Raises:
        ValueError: as :func:`continuation_ids`.
    """
    ids = continuation_ids(tokenizer, ex, n)
    with torch.inference_mode():
        reference = teacher_forced_hidden(model, replay_prefill(model, None, capture), ids, T)
    extra = {"prefill_seconds": prefill_seconds, "shared_prefill": True, "decode_batch": 1}

    def row(run, cache, replay_s: float) -> tuple:
        start = time.perf_counter()
        hidden = teacher_forced_hidden(model, cache, ids, T)
        seconds = prefill_seconds + replay_s + time.perf_counter() - start
        stats = loss_stats(model, hidden, reference, ids)
        return run, _row(run, ex, dataset, model, cache, T, n, stats, seconds, replay_seconds=replay_s, **extra)

    rows = []
    for run, cache, replay_s, state in replayed:
        attention.put_decode_state(cache, [state])  # the run's decode-time state, on its own cache
        rows.append(row(run, cache, replay_s))
        del cache, state  # freed before the next run is replayed
    for run, cache, seconds, masks, state in masked:
        attention.put_decode_state(cache, [state])
        with kvzip_path.masked_keys(model, masks):
            rows.append(row(run, cache, seconds))
        del cache, state, masks
    return rows
