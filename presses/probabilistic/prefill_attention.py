"""The prefill's own attention computes the probabilistic-eviction proposal statistics (paper 003 appendix H).

The all-row proposals need every prompt row's attention over the prompt: the column sums ``sum_j w_j p_j(i)``
(``h2o``: ``w = 1``, eq. 16; ``h2o_h`` and ``min_h``: the harmonic prior, eq. 36) and, for ``min``, the last row
``p_t``. Instead of recomputing ``Q K^T`` for every row after the prefill, the prefill's attention produces them
in the same pass over the keys, through the dispatch :func:`presses.kernels.attention_with_column_sums` (Triton
on CUDA, :func:`presses.core.prefill_stats.attention_with_column_sums` elsewhere).

How it is wired (:func:`request_statistics`, called by :class:`presses.probabilistic.ProbabilisticEvictionPress`'s
model hooks when its prefill starts and ends):

- the ``sdpa`` and ``eager`` entries of transformers' ``ALL_ATTENTION_FUNCTIONS`` (the ``AttentionInterface``)
  are wrapped once (:func:`install_prefill_attention`, idempotent, composes with the SNIS decode-bias wrapper
  of :mod:`presses.attention_bias` in either order). Without a request on the module the wrapper calls the
  wrapped function unchanged, so it is active only while a press has asked for statistics;
- the press leaves a :class:`StatsRequest` on every attention module for the duration of its prefill; at the layer's
prefill
  (queries and keys cover the same positions) the wrapper computes the attention output AND the statistics,
  and leaves a :class:`PrefillStats` on the module;
- the press's ``compress`` (kvpress forward hook, right after the attention) takes them with
  :func:`take_prefill_stats`, which checks that they belong to the very key tensor it compresses.

Column sums are fused only for the plain causal prefill: no attention mask (transformers' ``sdpa`` passes none
for an unpadded prompt), no dropout, sliding window or soft-capping, no attention weights requested, no
gradient. Otherwise (``eager``, which always builds a mask; padded batches; ...) the wrapped function runs
and the press recomputes the statistics as before. The ``min`` statistic (the last row) needs no fusion: the
wrapped function computes the output and the last row comes from the layer's own last query, with any
attention implementation. Decoding steps (one query against a longer cache) are never touched.

The fused path replaces the wrapped function's prefill call, so it also does what kvpress's attention patch
does at every prefill: clear the module's ``masked_key_indices`` (AdaKV-style masking of an earlier cache).
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from presses import kernels
from presses.core.columns import harmonic_prior

__all__ = [
    "STATISTICS",
    "PrefillStats",
    "StatsRequest",
    "attention_modules",
    "install_prefill_attention",
    "prefill_statistics",
    "request_statistics",
    "take_prefill_stats",
]

#: Statistic each attention proposal reads: column sums with unit or harmonic row weights, or the last row.
STATISTICS = {"h2o": "columns", "h2o_h": "harmonic_columns", "min_h": "harmonic_columns", "min": "last_row"}


@dataclass
class StatsRequest:
    """What the prefill's attention should compute for a layer (left on the module by :func:`request_statistics`).

    Attributes:
        kind: a value of :data:`STATISTICS`.
        block_size: query rows per block of the torch path's column pass
            (:func:`presses.core.prefill_stats.column_sums_from_lse`).
    """

    kind: str
    block_size: int = 128


@dataclass
class PrefillStats:
    """Statistics of one layer's prefill attention.

    Attributes:
        kind: a value of :data:`STATISTICS`.
        scores: ``(B, H_Q, t)`` float32: column sums ``sum_j w_j p^h_j(i)`` or the last row ``p^h_t(i)``.
        keys: the ``(B, G, t, d)`` key tensor they were computed with (the layer's cache entry).
    """

    kind: str
    scores: torch.Tensor
    keys: torch.Tensor


def attention_modules(model) -> list:
    """The attention modules of the language model's decoder layers (the modules kvpress hooks)."""
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in lm.layers]


def _fusable(module, query, key, attention_mask, args, kwargs) -> bool:
    """True for a plain causal prefill whose output the fused kernel reproduces (see the module docstring)."""
    dropout = args[0] if args else kwargs.get("dropout", 0.0)  # kvpress's patch passes it positionally
    return (
        query.shape[2] == key.shape[2]
        and attention_mask is None
        and len(args) <= 1
        and not dropout
        and not kwargs.get("sliding_window")
        and not kwargs.get("softcap")
        and not kwargs.get("output_attentions")
        and kwargs.get("is_causal", getattr(module, "is_causal", True))
        and query.shape[1] % key.shape[1] == 0
        and query.is_floating_point()
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
    )


def _wrap(func, name: str):
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        request = getattr(module, "_prefill_stats_request", None)
        if request is None or query.shape[2] != key.shape[2]:
            return _call(func, module, query, key, value, attention_mask, *args, **kwargs)
        module._prefill_stats = None
        scaling = kwargs.get("scaling", getattr(module, "scaling", None))
        if request.kind == "last_row":
            result = _call(func, module, query, key, value, attention_mask, *args, **kwargs)
            scores = kernels.column_sums(query[:, :, -1:], key, scaling=scaling)  # p_t, paper 003 app. H "min"
            module._prefill_stats = PrefillStats(request.kind, scores, key)
            return result
        if not _fusable(module, query, key, attention_mask, args, kwargs):
            return _call(func, module, query, key, value, attention_mask, *args, **kwargs)
        weights = harmonic_prior(key.shape[2], key.device) if request.kind == "harmonic_columns" else None
        out, scores = kernels.attention_with_column_sums(query, key, value, weights, scaling, request.block_size)
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None  # what kvpress's attention patch does at a prefill
        module._prefill_stats = PrefillStats(request.kind, scores, key)
        return out.transpose(1, 2), None  # transformers' (B, T, H_Q, d_v), no weights

    if func is not None:
        functools.update_wrapper(wrapper, func)  # keeps the markers of inner wrappers (e.g. the SNIS one)
    wrapper._prefill_stats_wrapped = True
    wrapper.__name__ = f"prefill_stats_{name}_attention"
    return wrapper


def _call(func, module, *args, **kwargs):
    if func is None:  # eager: the model file's own eager function
        func = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if func is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as func
    return func(module, *args, **kwargs)


def install_prefill_attention() -> None:
    """Wrap ``sdpa`` and ``eager`` in transformers' ``ALL_ATTENTION_FUNCTIONS`` (idempotent).

    Without a :class:`StatsRequest` on the module the wrappers call the wrapped function unchanged (for
    ``eager`` when nothing is registered: the ``eager_attention_forward`` of the module's own modeling file).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("sdpa", "eager"):
        current = ALL_ATTENTION_FUNCTIONS.get(name)
        if not getattr(current, "_prefill_stats_wrapped", False):
            ALL_ATTENTION_FUNCTIONS[name] = _wrap(current, name)


def request_statistics(modules, proposal: str | None, block_size: int = 128) -> None:
    """Ask the attention ``modules`` to compute ``proposal``'s statistics during the next prefill, or
    withdraw the request (``proposal=None``, or a proposal without prefill statistics, e.g. a scorer adapter).

    The probabilistic press asks when its prefill starts and withdraws when it ends (its model hooks, the press
    contract of :mod:`presses.base`), so the wrapper computes statistics only while the press is in use.
    Withdrawing also drops statistics nobody took.

    Args:
        modules: attention modules (:func:`attention_modules`).
        proposal: a key of :data:`STATISTICS`, another proposal name, or ``None``.
        block_size: query rows per block of the torch path's column pass, ``>= 1``.

    Raises:
        ValueError: if ``block_size < 1``.
    """
    kind = STATISTICS.get(proposal) if isinstance(proposal, str) else None
    if kind is not None and block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    for module in modules:
        module._prefill_stats_request = StatsRequest(kind, block_size) if kind is not None else None
        module._prefill_stats = None


@contextmanager
def prefill_statistics(model, proposal: str | None, block_size: int = 128):
    """:func:`request_statistics` on ``model``'s attention modules for the duration of a block (withdrawn on exit)."""
    install_prefill_attention()
    modules = attention_modules(model)
    request_statistics(modules, proposal, block_size)
    try:
        yield
    finally:
        request_statistics(modules, None)


def take_prefill_stats(module, keys: torch.Tensor, proposal: str) -> torch.Tensor | None:
    """The statistics ``proposal`` needs if this layer's prefill attention computed them for ``keys``, else None.

    They are removed from the module (taken once). None when no request was active, the attention could not
    fuse them (see the module docstring), they are of another kind, or ``keys`` is not the tensor they were
    computed with (a replayed or modified cache): the caller then recomputes them.

    Args:
        module: the attention module.
        keys: ``(B, G, t, d)`` the keys being compressed (the layer's cache entry).
        proposal: the proposal name (:data:`STATISTICS`).

    Returns:
        ``(B, H_Q, t)`` float32 or None.
    """
    stats = getattr(module, "_prefill_stats", None)
    if stats is None:
        return None
    module._prefill_stats = None
    if stats.kind != STATISTICS.get(proposal) or stats.keys is not keys:
        return None
    return stats.scores
