"""Torch references of the scoring kernels that have no reference elsewhere (no Triton import here).

- :func:`pooled_page_scores_reference`: Page-EntroKV scoring after the observer attention
  (docs/methods.md §1 steps 2-6), composed from :func:`presses.core.pooling.pooled_group_scores` and
  :func:`presses.core.paging.page_scores`.
- :func:`expected_unique_many_reference`: ``E[J(m)]`` of many candidate ``m`` (paper 003 eq. 24) via
  :func:`presses.core.coupon.expected_unique`.
- :func:`biased_decode_reference`: one-token decode attention with a per-group logit bias
  (paper 003 Alg. 1, eq. 10; docs/methods.md §3 item 5), the math of :mod:`presses.attention_bias`'s sdpa path.
- :func:`scorer_page_scores_reference`: page scores of a scorer's per-token scores, optionally averaged over the KV
  heads first (:class:`presses.scorer_pages.ScorerPagePress`, docs/methods.md §1.17).

The observer-attention and column-sum references are :func:`presses.core.observer.observer_attention_reference`
and :func:`presses.core.columns.column_sums`.
"""

from __future__ import annotations

import torch

from presses.core.coupon import expected_unique
from presses.core.paging import PAGE_SCORES, page_scores
from presses.core.pooling import POOLINGS, pooled_group_scores

__all__ = [
    "pooled_page_scores_reference",
    "expected_unique_many_reference",
    "biased_decode_reference",
    "check_pooling_args",
    "broadcast_candidates",
    "check_decode_args",
    "scorer_page_scores_reference",
    "check_scorer_page_args",
]


def check_pooling_args(attn: torch.Tensor, num_groups: int, pooling: str, page_size: int, page_score: str) -> None:
    """Validate the arguments shared by the pooled-page-score functions (``ValueError`` naming the value)."""
    if attn.dim() != 3:
        raise ValueError(f"attn must be (B, H_Q, T), got shape {tuple(attn.shape)}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not one of {POOLINGS}")
    if page_score not in PAGE_SCORES:
        raise ValueError(f"page_score={page_score!r} is not one of {PAGE_SCORES}")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    HQ = attn.shape[1]
    if num_groups <= 0 or HQ % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of query heads H_Q={HQ}")


def pooled_page_scores_reference(
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
    """Torch reference: :func:`presses.core.pooling.pooled_group_scores` then :func:`presses.core.paging.page_scores`.

    Args:
        attn: ``(B, H_Q, T)`` observer attention.
        num_groups, n_sink, alpha, tau, pooling, diagnostics: see ``pooled_group_scores``.
        page_size, page_score: see ``page_scores``.

    Returns:
        ``(pooled (B, G, T), page scores (B, G, P), diag or None)``, all float32.

    Raises:
        ValueError: as the two functions do.
    """
    pooled, diag = pooled_group_scores(attn, num_groups, n_sink, alpha, tau, pooling, diagnostics)
    return pooled, page_scores(pooled, page_size, page_score), diag


def broadcast_candidates(pi: torch.Tensor, num_samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast ``pi (..., t)`` and candidates ``(..., M)`` on their leading dimensions."""
    m = torch.as_tensor(num_samples, device=pi.device)
    if m.dim() == 0:
        m = m.reshape(1)
    lead = torch.broadcast_shapes(pi.shape[:-1], m.shape[:-1])
    return pi.expand(*lead, pi.shape[-1]), m.expand(*lead, m.shape[-1])


def expected_unique_many_reference(pi: torch.Tensor, num_samples) -> torch.Tensor:
    """Torch reference: :func:`presses.core.coupon.expected_unique` for ``M`` candidates per row.

    Args:
        pi: ``(..., t)`` probabilities (rows summing to 1).
        num_samples: ``(..., M)`` (or ``(M,)``, or a scalar) candidate draw counts ``m``, broadcast
            against ``pi.shape[:-1]`` on the leading dimensions.

    Returns:
        ``(..., M)`` float64 ``E[J(m)] = sum_i -expm1(m log1p(-pi_i))`` (paper 003 eq. 24).
    """
    pi, m = broadcast_candidates(pi, num_samples)
    return expected_unique(pi.unsqueeze(-2), m)


def check_decode_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor):
    """Validate decode-attention shapes; returns ``(query (B, H_Q, 1, d), B, H_Q, G, K, d)``.

    Raises:
        ValueError: naming the offending shape.
    """
    if query.dim() == 3:
        query = query.unsqueeze(2)
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"query must be (B, H_Q, 1, d) or (B, H_Q, d) (one decode token), got {tuple(query.shape)}")
    B, HQ, _, d = query.shape
    if key.dim() != 4 or key.shape[0] != B or key.shape[3] != d or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be (B={B}, G, K, d={d})")
    G, K = key.shape[1], key.shape[2]
    if HQ % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={HQ}")
    if bias.shape != (B, G, K):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected (B, G, K) = ({B}, {G}, {K})")
    return query, B, HQ, G, K, d


def biased_decode_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Torch reference of decode attention with a per-group additive logit bias (paper 003 Alg. 1, eq. 10).

    ``out^h = sum_i softmax_i(q^h . k_i * scaling + bias_{g(h), i}) v_i`` with ``g(h) = h // r``; computed in
    float32 and cast to ``query.dtype``. Equals transformers' ``sdpa`` attention of the layer with the
    float mask of :func:`presses.attention_bias.bias_mask` (whose rows are this bias, in the query dtype).

    Args:
        query: ``(B, H_Q, 1, d)`` or ``(B, H_Q, d)``, the one decode token.
        key, value: ``(B, G, K, d)`` the layer's (padded) cache.
        bias: ``(B, G, K)`` additive logit bias (``-inf`` = masked slot), any float dtype and strides.
        scaling: logit scale, default ``d ** -0.5`` (pass the module's ``scaling``).

    Returns:
        ``(B, H_Q, 1, d)`` in ``query.dtype`` (NaN for a head whose every slot is masked).

    Raises:
        ValueError: on inconsistent shapes or ``G`` not dividing ``H_Q``.
    """
    query, B, HQ, G, K, d = check_decode_args(query, key, value, bias)
    r = HQ // G
    scaling = d**-0.5 if scaling is None else scaling
    q = query.float().reshape(B, G, r, d)
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scaling + bias.float().unsqueeze(2)
    out = torch.matmul(torch.softmax(logits, dim=-1), value.float())  # (B, G, r, d)
    return out.reshape(B, HQ, 1, d).to(query.dtype)


def check_scorer_page_args(tokens: torch.Tensor, page_size: int, method: str) -> None:
    """Validate the arguments of the scorer page-score functions (``ValueError`` naming the value)."""
    if tokens.dim() != 3:
        raise ValueError(f"token scores have shape {tuple(tokens.shape)}; expected (B, G, T)")
    if isinstance(page_size, bool) or int(page_size) != page_size or page_size < 1:
        raise ValueError(f"page_size={page_size} must be an integer >= 1")
    if method not in PAGE_SCORES:
        raise ValueError(f"page_score={method!r} is not one of {PAGE_SCORES}")


def scorer_page_scores_reference(tokens: torch.Tensor, page_size: int, method: str, shared: bool) -> torch.Tensor:
    """Page scores of per-token scores (docs/methods.md §1.17).

    Args:
        tokens: ``(B, G, T)`` token scores (higher = keep), any float dtype.
        page_size: tokens per page, ``>= 1``.
        method: one of :data:`presses.core.paging.PAGE_SCORES`.
        shared: average the scores over the ``G`` heads first (one selection for every head).

    Returns:
        ``(B, G, P)`` float32 (``(B, 1, P)`` when ``shared``), ``P = ceil(T / page_size)``.

    Raises:
        ValueError: for a shape that is not 3-d, ``page_size < 1`` or an unknown ``method``.
    """
    check_scorer_page_args(tokens, page_size, method)
    scores = tokens.float()
    if shared:
        scores = scores.mean(1, keepdim=True)
    return page_scores(scores, int(page_size), method)
