"""Scoring kernels: one dispatch point per kernel, Triton on CUDA and the torch reference elsewhere.

``KVPRESS_RESEARCH_KERNELS`` selects the implementation for every dispatch function:

- unset / ``""`` / ``"auto"``: Triton for CUDA tensors (when Triton imports), the reference otherwise;
- ``"reference"``: the torch reference on any device;
- ``"triton"``: Triton on any device; CPU tensors then need ``TRITON_INTERPRET=1`` set before Triton is
  first imported (the tests use this to run whole presses through the kernels on CPU).

Dispatch function -> torch reference -> Triton implementation:

- :func:`window_attention` -> :func:`presses.core.observer.observer_attention_reference` ->
  :func:`presses.kernels.attention_columns.window_attention_triton`
- :func:`column_sums` -> :func:`presses.core.columns.column_sums` ->
  :func:`presses.kernels.attention_columns.column_sums_triton`
- :func:`column_maxes` -> :func:`presses.core.columns.column_maxes` ->
  :func:`presses.kernels.attention_columns.column_maxes_triton`
- :func:`pooled_page_scores` -> :func:`presses.kernels.references.pooled_page_scores_reference` ->
  :func:`presses.kernels.renyi_pages.pooled_page_scores_triton`
- :func:`expected_unique_many` -> :func:`presses.kernels.references.expected_unique_many_reference` ->
  :func:`presses.kernels.expected_unique.expected_unique_many_triton`
- :func:`biased_decode_attention` -> :func:`presses.kernels.references.biased_decode_reference` ->
  :func:`presses.kernels.biased_decode.biased_decode_triton`
- :func:`attention_with_column_sums` -> :func:`presses.core.prefill_stats.attention_with_column_sums` ->
  :func:`presses.kernels.fused_prefill.attention_with_column_sums_triton`
- :func:`row_chunk_masses` -> :func:`presses.core.row_masses.row_chunk_masses_reference` ->
  :func:`presses.kernels.row_masses.row_chunk_masses_triton`
- :func:`scorer_page_scores` -> :func:`presses.kernels.references.scorer_page_scores_reference` ->
  :func:`presses.kernels.scorer_pages.scorer_page_scores_triton`
- :func:`reconstruction_column_maxes` -> :func:`presses.core.kvzip_scores.reconstruction_column_maxes` ->
  :func:`presses.kernels.kvzip_scores.reconstruction_column_maxes_triton`

The references need no Triton: without it installed, the Triton modules are ``None`` and every call takes
the reference (``KVPRESS_RESEARCH_KERNELS=triton`` then raises).
"""

from __future__ import annotations

import os

import torch

from presses.core.columns import column_maxes as column_maxes_reference
from presses.core.columns import column_sums as column_sums_reference
from presses.core.kvzip_scores import reconstruction_column_maxes as reconstruction_column_maxes_reference
from presses.core.observer import observer_attention_reference
from presses.core.prefill_stats import attention_with_column_sums as attention_with_column_sums_reference
from presses.core.row_masses import row_chunk_masses_reference
from presses.kernels.references import (
    biased_decode_reference,
    expected_unique_many_reference,
    pooled_page_scores_reference,
    scorer_page_scores_reference,
)

try:  # the Triton implementations (an optional dependency: the ``triton`` extra)
    from presses.kernels import (
        attention_columns,
        biased_decode,
        expected_unique,
        fused_prefill,
        kvzip_scores,
        renyi_pages,
        row_masses,
        scorer_pages,
    )
except ImportError:  # pragma: no cover - only without triton
    attention_columns = biased_decode = expected_unique = fused_prefill = renyi_pages = row_masses = None
    scorer_pages = kvzip_scores = None

__all__ = [
    "KERNEL_MODES",
    "kernel_mode",
    "use_triton",
    "window_attention",
    "column_maxes",
    "column_sums",
    "pooled_page_scores",
    "expected_unique_many",
    "biased_decode_attention",
    "attention_with_column_sums",
    "row_chunk_masses",
    "scorer_page_scores",
    "reconstruction_column_maxes",
]

KERNEL_MODES = ("auto", "reference", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_mode() -> str:
    """The value of ``KVPRESS_RESEARCH_KERNELS`` (``"auto"`` when unset or empty).

    Raises:
        ValueError: for a value outside :data:`KERNEL_MODES`.
    """
    mode = os.environ.get("KVPRESS_RESEARCH_KERNELS", "").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"KVPRESS_RESEARCH_KERNELS={mode!r} is not one of {KERNEL_MODES}")
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should run for ``tensor`` (see the module docstring).

    Raises:
        ValueError: for an unknown ``KVPRESS_RESEARCH_KERNELS``.
        RuntimeError: when ``KVPRESS_RESEARCH_KERNELS=triton`` is asked for a CPU tensor without
            ``TRITON_INTERPRET=1``, or Triton is missing.
    """
    mode = kernel_mode()
    if mode == "reference" or (mode == "auto" and not tensor.is_cuda):
        return False
    if attention_columns is None:
        if mode == "triton":
            raise RuntimeError("KVPRESS_RESEARCH_KERNELS=triton but triton is not installed")
        return False
    if mode == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "KVPRESS_RESEARCH_KERNELS=triton on a CPU tensor needs TRITON_INTERPRET=1, set "
            "before triton is first imported"
        )
    return True


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Dispatch for the observer-averaged window attention ``(B, H_Q, W, d), (B, G, T, d) -> (B, H_Q, T)``
    float32 at logit scale ``scaling`` (None: ``1 / sqrt(d)``); see
    :func:`presses.core.observer.observer_attention_reference` for shapes, errors and source (docs/methods.md §1
    step 1). The Triton path never stores ``W x T`` per head; a soft-capped model (``softcap``, Gemma2) takes the
    reference."""
    if softcap is None and use_triton(keys) and queries.dtype == keys.dtype and keys.dtype in _TRITON_DTYPES:
        return attention_columns.window_attention_triton(queries, keys, scaling=scaling)
    return observer_attention_reference(queries, keys, scaling, softcap)


def column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dispatch for the weighted causal-attention column sums of a block of query rows (SNIS proposals
    ``h2o``, ``h2o_h``, ``min``, ``min_h``; paper 003 eqs. 16, 36); see
    :func:`presses.core.columns.column_sums` for shapes ``(B, H_Q, n, d), (B, G, t, d) -> (B, H_Q, t)``,
    errors and source. A soft-capped model (``softcap``, Gemma2) takes the reference."""
    if softcap is None and use_triton(keys) and queries.dtype == keys.dtype and keys.dtype in _TRITON_DTYPES:
        return attention_columns.column_sums_triton(queries, keys, row_weights, rows, scaling)
    return column_sums_reference(queries, keys, row_weights, rows, scaling, softcap)


def column_maxes(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dispatch for the column maxima of causal attention of a block of query rows (KVzip's importance per query
    head: Page-EntroKV's reconstruction observers); see :func:`presses.core.columns.column_maxes` for shapes
    ``(B, H_Q, n, d), (B, G, t, d) -> (B, H_Q, t)``, errors and source. A soft-capped model takes the reference."""
    if softcap is None and use_triton(keys) and queries.dtype == keys.dtype and keys.dtype in _TRITON_DTYPES:
        return attention_columns.column_maxes_triton(queries, keys, rows, scaling)
    return column_maxes_reference(queries, keys, rows, scaling, softcap)


def pooled_page_scores(
    attn: torch.Tensor,
    num_groups: int,
    n_sink: int,
    alpha: float,
    tau: float,
    pooling: str,
    page_size: int,
    page_score: str,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """Dispatch for Page-EntroKV's scoring after the observer attention (docs/methods.md §1 steps 2-6): sink-isolated
    Rényi entropies, group weights, pooled group score and page scores.

    Args:
        attn: ``(B, H_Q, T)`` observer attention.
        num_groups, n_sink, alpha, tau, pooling, diagnostics: as
            :func:`presses.core.pooling.pooled_group_scores`.
        page_size, page_score: as :func:`presses.core.paging.page_scores`.

    Returns:
        ``(pooled (B, G, T), page_scores (B, G, P), diag or None)`` float32
        (:func:`presses.kernels.renyi_pages.pooled_page_scores_reference`).

    Raises:
        ValueError: as ``pooled_group_scores`` and ``page_scores``.
    """
    if use_triton(attn):
        return renyi_pages.pooled_page_scores_triton(
            attn, num_groups, n_sink, alpha, tau, pooling, page_size, page_score, diagnostics
        )
    return pooled_page_scores_reference(
        attn, num_groups, n_sink, alpha, tau, pooling, page_size, page_score, diagnostics
    )


def expected_unique_many(pi: torch.Tensor, num_samples) -> torch.Tensor:
    """Dispatch for ``E[J(m)]`` of many candidate ``m`` per row in one launch (paper 003 eq. 24):
    ``pi (..., t)``, ``num_samples (..., M)`` -> ``(..., M)`` float64; see
    :func:`presses.kernels.expected_unique.expected_unique_many_reference`."""
    if use_triton(pi):
        return expected_unique.expected_unique_many_triton(pi, num_samples)
    return expected_unique_many_reference(pi, num_samples)


def biased_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Dispatch for one-token decode attention with a per-group additive logit bias (SNIS correction,
    paper 003 Alg. 1 / eq. 10; docs/methods.md §3 item 5): ``(B, H_Q, 1, d)``, ``(B, G, K, d)`` x2, ``(B, G, K)`` ->
    ``(B, H_Q, 1, d)``; see :func:`presses.kernels.biased_decode.biased_decode_reference`. The Triton
    path is split-K flash decoding."""
    if use_triton(key) and query.dtype == key.dtype == value.dtype and key.dtype in _TRITON_DTYPES:
        return biased_decode.biased_decode_triton(query, key, value, bias, scaling)
    return biased_decode_reference(query, key, value, bias, scaling)


def attention_with_column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch for a prefill's causal attention plus the row-weighted column sums of its attention matrix
    (SNIS proposals ``h2o``, ``h2o_h``, ``min_h`` computed in the prefill; paper 003 eqs. 16, 36):
    ``(B, H_Q, T, d), (B, G, T, d), (B, G, T, d_v) -> ((B, H_Q, T, d_v) in the query dtype, (B, H_Q, T)``
    float32); see :func:`presses.core.prefill_stats.attention_with_column_sums` for the contract, errors and source
    (``block_size``: query rows per block of the torch path's column pass). Both paths are a flash-attention
    forward that also returns each row's log-sum-exp, then a column pass ``exp(logit - lse)``; the torch path's
    forward is torch's own fused CPU kernel (``sdpa``'s output bit for bit), the Triton path's the forward kernel
    of :mod:`presses.kernels.fused_prefill` followed by the column kernel of :func:`column_sums`."""
    if (
        use_triton(key)
        and query.dtype == key.dtype == value.dtype
        and key.dtype in _TRITON_DTYPES
        and query.shape[-1] == value.shape[-1]
    ):
        return fused_prefill.attention_with_column_sums_triton(query, key, value, row_weights, scaling)
    return attention_with_column_sums_reference(query, key, value, row_weights, scaling, block_size)


def row_chunk_masses(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor,
    num_chunks: int,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch for EntroPrefill's per-row chunk masses and weighted row average (paper 001 eqs. 1-2, 14, 17;
    docs/methods.md §4 steps 2, 4, 5): ``(B, H_Q, n, d)``, ``(B, G, t, d)``, rows ``(n,)``, chunk ids ``(t,)`` ->
    ``(masses (B, H_Q, n, k), average (B, H_Q, t) or None)`` float32; see
    :func:`presses.core.row_masses.row_chunk_masses_reference` for the contract and errors. The Triton path is
    one flash-style pass over the keys with one-hot chunk "values" and never stores a row; a soft-capped model
    (``softcap``, Gemma2) takes the reference."""
    if softcap is None and use_triton(keys) and queries.dtype == keys.dtype and keys.dtype in _TRITON_DTYPES:
        return row_masses.row_chunk_masses_triton(queries, keys, rows, ids, num_chunks, row_weights, scaling)
    return row_chunk_masses_reference(queries, keys, rows, ids, num_chunks, row_weights, scaling, softcap)


def scorer_page_scores(tokens: torch.Tensor, page_size: int, method: str, shared: bool = False) -> torch.Tensor:
    """Dispatch for the page scores of a scorer's per-token scores (:class:`presses.scorer_pages.ScorerPagePress`,
    docs/methods.md §1.17): ``(B, G, T)`` -> ``(B, G, P)`` float32, ``(B, 1, P)`` with ``shared`` (the heads' mean);
    see :func:`presses.kernels.references.scorer_page_scores_reference` for the methods and errors."""
    if use_triton(tokens) and tokens.dtype in _TRITON_DTYPES:
        return scorer_pages.scorer_page_scores_triton(tokens, page_size, method, shared)
    return scorer_page_scores_reference(tokens, page_size, method, shared)


def reconstruction_column_maxes(
    queries: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    row_weights: torch.Tensor | None = None,
    column_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch for KVzip's reconstruction scores under given log normalisers (:class:`presses.KVzipFastPress`,
    docs/methods.md §1.18): queries ``(B, H, n, d)``, keys ``(B, G, c, d)``, lse ``(B, H, n)``, KVzip+'s row weights
    ``(B, n)`` and column weights ``(B, H, c)`` -> ``(B, G, c)`` float32; see
    :func:`presses.core.kvzip_scores.reconstruction_column_maxes` for the contract and errors. The Triton path is
    :mod:`presses.kernels.attention_columns`'s column pass with the given normalisers (no row-statistics pass)."""
    if use_triton(keys) and queries.dtype == keys.dtype and keys.dtype in _TRITON_DTYPES:
        return kvzip_scores.reconstruction_column_maxes_triton(queries, keys, lse, scaling, row_weights, column_weights)
    return reconstruction_column_maxes_reference(queries, keys, lse, scaling, row_weights, column_weights)
