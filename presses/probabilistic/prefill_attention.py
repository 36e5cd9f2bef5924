"""The prefill's own attention computes the probabilistic-eviction proposal statistics (paper 003 appendix H).

The all-row proposals need every prompt row's attention over the prompt: the column sums ``sum_j w_j p_j(i)``
(``h2o``: ``w = 1``, eq. 16; ``h2o_h`` and ``min_h``: the harmonic prior, eq. 36) and, for ``min``, the last row
``p_t``. Instead of recomputing ``Q K^T`` for every row after the prefill, the prefill's attention produces them
in the same pass over the keys, through the dispatch :func:`presses.kernels.attention_with_column_sums` (Triton
on CUDA, :func:`presses.core.prefill_stats.attention_with_column_sums` elsewhere).

How it is wired: when its prefill starts, :class:`presses.probabilistic.ProbabilisticEvictionPress` asks the
prefill's cache for a :class:`StatsRequest` (:func:`request_statistics`, a prefill request of the project's one
attention wrapper, :mod:`presses.attention`); every layer's attention then runs :meth:`StatsRequest.run`, which
computes the attention output AND the statistics and leaves a :class:`PrefillStats` with the cache; the press's
``compress`` (kvpress forward hook, right after the attention) takes them with :func:`take_prefill_stats`, which
checks that they belong to the very key tensor it compresses. The request belongs to that cache: one that fails
part-way cannot reach another request.

Column sums are fused only for the plain causal prefill: no attention mask (transformers' ``sdpa`` passes none
for an unpadded prompt), no dropout, sliding window or soft-capping, no attention weights requested, no
gradient. Otherwise (``eager``, which always builds a mask; padded batches; ...) the wrapped function runs
and the press recomputes the statistics as before. The ``min`` statistic (the last row) needs no fusion: the
wrapped function computes the output and the last row comes from the layer's own last query, with any
attention implementation.

The fused path replaces the wrapped function's prefill call, so it also does what kvpress's attention patch
does at every prefill: clear the module's ``masked_key_indices`` (AdaKV-style masking of an earlier cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from presses import attention, kernels
from presses.core.columns import harmonic_prior

__all__ = ["STATISTICS", "PrefillStats", "StatsRequest", "request_statistics", "take_prefill_stats"]

#: Statistic each attention proposal reads: column sums with unit or harmonic row weights, or the last row.
STATISTICS = {"h2o": "columns", "h2o_h": "harmonic_columns", "min_h": "harmonic_columns", "min": "last_row"}


@dataclass
class StatsRequest:
    """What every layer's prefill attention computes for the probabilistic press (a prefill request of
    :mod:`presses.attention`, made by :func:`request_statistics`).

    Attributes:
        kind: a value of :data:`STATISTICS`.
        block_size: query rows per block of the torch path's column pass
            (:func:`presses.core.prefill_stats.column_sums_from_lse`).
    """

    kind: str
    block_size: int = 128

    def run(self, module, query, key, value, attention_mask, call, args: tuple, kwargs: dict):
        """The layer's attention output and, where it can (module docstring), its :class:`PrefillStats`.

        Args:
            module: the attention module; query ``(B, H_Q, t, d)``, key and value ``(B, G, t, d)``.
            attention_mask, args, kwargs: the rest of the attention call.
            call: the wrapped attention function.

        Returns:
            ``((output, weights), PrefillStats or None)``.
        """
        scaling = kwargs.get("scaling", getattr(module, "scaling", None))
        if self.kind == "last_row":
            out = call(module, query, key, value, attention_mask, *args, **kwargs)
            scores = kernels.column_sums(query[:, :, -1:], key, scaling=scaling, softcap=kwargs.get("softcap"))  # p_t
            return out, PrefillStats(self.kind, scores, key)
        if not _fusable(module, query, key, attention_mask, args, kwargs):
            return call(module, query, key, value, attention_mask, *args, **kwargs), None
        weights = harmonic_prior(key.shape[2], key.device) if self.kind == "harmonic_columns" else None
        out, scores = kernels.attention_with_column_sums(query, key, value, weights, scaling, self.block_size)
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None  # what kvpress's attention patch does at a prefill
        return (out.transpose(1, 2), None), PrefillStats(self.kind, scores, key)  # (B, T, H_Q, d_v), no weights


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


def request_statistics(cache, proposal, block_size: int = 128) -> None:
    """Ask the next prefill of ``cache`` to compute ``proposal``'s statistics in its attention, or withdraw the
    request (``proposal=None``, or a proposal without prefill statistics, e.g. a kvpress scorer).

    The probabilistic press asks when its prefill starts and withdraws when it ends (its model hooks); withdrawing
    also drops statistics nobody took.

    Args:
        cache: the prefill's cache.
        proposal: a key of :data:`STATISTICS`, another proposal, or None.
        block_size: query rows per block of the torch path's column pass, ``>= 1``.

    Raises:
        ValueError: if ``block_size < 1``.
    """
    kind = STATISTICS.get(proposal) if isinstance(proposal, str) else None
    if kind is None:
        attention.withdraw_prefill(cache)
        return
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    attention.request_prefill(cache, StatsRequest(kind, block_size))


def take_prefill_stats(cache, layer: int, keys: torch.Tensor, proposal) -> torch.Tensor | None:
    """The statistics ``proposal`` needs if layer ``layer``'s prefill attention computed them for ``keys``, else None.

    They are removed from the cache (taken once). None when no request was active, the attention could not fuse
    them (module docstring), they are of another kind, or ``keys`` is not the tensor they were computed with (a
    replayed or modified cache): the caller then recomputes them.

    Args:
        cache: the prefill's cache (None: nothing to take).
        layer: the layer index.
        keys: ``(B, G, t, d)`` the keys being compressed (the layer's cache entry).
        proposal: the proposal (:data:`STATISTICS`).

    Returns:
        ``(B, H_Q, t)`` float32 or None.
    """
    stats = None if cache is None else attention.take_prefill_result(cache, layer)
    if not isinstance(stats, PrefillStats) or stats.kind != STATISTICS.get(proposal) or stats.keys is not keys:
        return None
    return stats.scores
