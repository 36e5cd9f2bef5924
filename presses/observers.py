"""Observer attention of a prefill layer: what the observer queries attend to, averaged over the observers.

The one entry point presses use (Page-EntroKV, the UOR analysis): it slices kvpress's eager attention
weights when the layer returns them, and otherwise recomputes the observers' RoPE'd queries and calls the
kernel dispatch point :func:`presses.kernels.window_attention` (Triton on CUDA, the torch reference
:func:`presses.core.observer.observer_attention_reference` elsewhere). docs/methods.md §1 step 1;
paper 000 section 3; paper 001 eq. 2 and appendix C (rows are averaged before any entropy is taken).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from presses.core.observer import attention_logit_options, check_window, window_queries
from presses.kernels import window_attention

__all__ = ["observer_attention", "memoized_observers"]


def memoized_observers(
    memo,
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    observers: int,
    compute: Callable[[], torch.Tensor],
    *extra,
) -> torch.Tensor:
    """``compute()``, or, with a sweep's ``memo``, what it already computed for the same layer inputs.

    A sweep that replays one recorded prefill for several presses (the harness's shared prefill) passes a memo
    (``memo.get(key, compute, *keep)``, e.g. ``evaluation.memo.ReplayMemo``); the observer attention does not
    depend on the compression ratio, the protection or the group selection, so e.g. Page-EntroKV at three ratios
    computes it once per layer. The key is the attention module, the same ``hidden_states`` tensor object, keys of
    the same shape (a replay rebuilds each layer's keys from the recorded ones, so their tensor objects differ) and
    the same observer count.

    Args:
        memo: the sweep's memo, or None (compute).
        module, hidden_states, keys: the layer and the tensors the observer attention is computed from.
        observers: the number of observer queries.
        compute: returns the ``(B, H_Q, T)`` observer attention.
        extra: further objects the result depends on (e.g. ``position_embeddings``), identified by ``id``.
    """
    if memo is None:
        return compute()
    key = ("observers", id(module), id(hidden_states), tuple(keys.shape), int(observers), *map(id, extra))
    return memo.get(key, compute, module, hidden_states, extra)


def observer_attention(
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    window_size: int,
    position_embeddings,
    attentions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Observer-averaged attention of the last ``window_size`` prefill queries (docs/methods.md §1 step 1).

    Uses the layer's eager attention weights when kvpress passes them, and otherwise recomputes the
    window queries and calls the dispatch point :func:`presses.kernels.window_attention` (Triton on
    CUDA, :func:`observer_attention_reference` elsewhere) with the module's logit scale and soft-cap
    (:func:`presses.core.observer.attention_logit_options`), so the rows are the model's own.

    Args:
        module: the attention module the kvpress hook fired on.
        hidden_states: ``(B, T, D_model)``.
        keys: ``(B, G, T, d)`` RoPE'd keys of the cache.
        window_size: ``W``, ``1 <= W <= T``.
        position_embeddings: ``(cos, sin)`` from the hook's kwargs.
        attentions: optional ``(B, H_Q, T, T)`` eager attention weights.

    Returns:
        ``(B, H_Q, T)`` float32 rows summing to 1.

    Raises:
        ValueError: if ``window_size`` is outside ``[1, T]``.
    """
    T = keys.shape[2]
    check_window(window_size, T)
    if attentions is not None:
        return attentions[..., -window_size:, :].float().mean(dim=-2)
    queries = window_queries(module, hidden_states, window_size, position_embeddings)
    return window_attention(queries, keys, *attention_logit_options(module))  # the model's scale and soft-cap
