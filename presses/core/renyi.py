"""Sink-isolated Rényi entropy and entropy-weighted head pooling inside GQA groups.

Shared by Page-EntroKV (paper 000, docs/methods.md §1, steps 2-5), EntroPrefill (paper 001 section 3.1,
eqs. 3-5) and the UOR analysis. Shapes use ``H_Q`` query heads, ``G`` KV groups, ``r = H_Q / G``
and ``T`` key positions. Query head ``h`` belongs to group ``h // r`` (the Hugging Face
``repeat_kv`` layout).
"""

from __future__ import annotations

import math

import torch

__all__ = ["sink_isolate", "renyi_entropy", "group_weights", "pool_groups", "RENYI_ORDERS"]

RENYI_ORDERS = "alpha is a float > 0 (1 = Shannon, 2 = collision) or float('inf') (min-entropy)"


def sink_isolate(attn: torch.Tensor, n_sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Condition observer attention on the non-sink positions (docs/methods.md §1 step 2, paper 000 Thm. 2).

    Args:
        attn: ``(..., T)`` observer-averaged attention ``a^h[j]`` (rows sum to 1 over ``T``).
        n_sink: number of leading sink positions ``|S|``; ``0 <= n_sink < T``.

    Returns:
        ``(a_tilde, z)``: ``a_tilde`` is ``(..., T - n_sink)`` float32 and sums to 1 over the
        non-sink positions (uniform where ``z == 0``); ``z`` is ``(...)`` float32, the non-sink mass
        ``z_h = sum_{j not in S} a^h[j]``.

    Raises:
        ValueError: if ``n_sink`` is negative or leaves no non-sink position.
    """
    T = attn.shape[-1]
    if n_sink < 0 or n_sink >= T:
        raise ValueError(f"n_sink={n_sink} must satisfy 0 <= n_sink < T={T} (no non-sink position left)")
    tail = attn[..., n_sink:].float()
    z = tail.sum(-1)
    safe = z.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    a_tilde = torch.where(z.unsqueeze(-1) > 0, tail / safe, torch.full_like(tail, 1.0 / tail.shape[-1]))
    return a_tilde, z


def renyi_entropy(p: torch.Tensor, alpha: float) -> torch.Tensor:
    """Rényi entropy of order ``alpha`` of distributions on the last axis, in nats (docs/methods.md §1 step 3).

    ``alpha == 2``: collision entropy ``-ln sum p^2`` (one dot product); ``alpha == 1``: Shannon
    ``-sum p ln p``; ``alpha == inf``: min-entropy ``-ln max p``; otherwise
    ``ln(sum p^alpha) / (1 - alpha)``. Accumulates in float32; results lie in ``[0, ln n]`` for ``n``
    support points (clamped against round-off).

    Args:
        p: ``(..., n)`` non-negative, rows summing to 1.
        alpha: the order, ``> 0`` or ``inf``.

    Returns:
        ``(...)`` float32 entropies.

    Raises:
        ValueError: if ``alpha <= 0`` or is NaN.
    """
    if not (alpha > 0):
        raise ValueError(f"Rényi order alpha={alpha} must be > 0 ({RENYI_ORDERS})")
    p = p.float()
    n = p.shape[-1]
    tiny = torch.finfo(torch.float32).tiny
    if math.isinf(alpha):
        h = -torch.log(p.amax(-1).clamp_min(tiny))
    elif abs(alpha - 1.0) < 1e-9:
        h = -(torch.special.xlogy(p, p)).sum(-1)
    elif alpha == 2.0:
        h = -torch.log((p * p).sum(-1).clamp_min(tiny))
    else:
        h = torch.log(p.pow(alpha).sum(-1).clamp_min(tiny)) / (1.0 - alpha)
    return h.clamp(0.0, math.log(n))


def group_weights(entropy: torch.Tensor, num_groups: int, tau: float) -> torch.Tensor:
    """Entropy-softmax head weights inside each GQA group (docs/methods.md §1 step 4, paper 000 eq. for ``w_h``).

    ``w_h = softmax_{h in group}(-H_h / tau)``. ``tau -> inf`` gives mean pooling ``1/r``;
    ``tau = inf`` is accepted and returns exactly ``1/r``.

    Args:
        entropy: ``(..., H_Q)`` per-head entropies.
        num_groups: ``G``; must divide ``H_Q``.
        tau: the group temperature ``tau_g > 0``.

    Returns:
        ``(..., G, r)`` float32 weights, each group summing to 1.

    Raises:
        ValueError: if ``tau <= 0`` or ``G`` does not divide ``H_Q``.
    """
    if not (tau > 0):
        raise ValueError(f"tau={tau} must be > 0")
    hq = entropy.shape[-1]
    if num_groups <= 0 or hq % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of query heads H_Q={hq}")
    r = hq // num_groups
    e = entropy.float().reshape(*entropy.shape[:-1], num_groups, r)
    if math.isinf(tau):
        return torch.full_like(e, 1.0 / r)
    return torch.softmax(-e / tau, dim=-1)


def pool_groups(attn: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Pooled group score ``p_g[j] = sum_{h in g} w_h a^h[j]`` (docs/methods.md §1 step 5).

    Args:
        attn: ``(..., H_Q, T)`` observer attention (the ORIGINAL, not sink-isolated, rows).
        weights: ``(..., G, r)`` head weights from :func:`group_weights` (or ``1/r``, or one-hot).

    Returns:
        ``(..., G, T)`` float32 pooled scores.
    """
    G, r = weights.shape[-2:]
    a = attn.float().reshape(*attn.shape[:-2], G, r, attn.shape[-1])
    return (weights.unsqueeze(-1) * a).sum(-2)
