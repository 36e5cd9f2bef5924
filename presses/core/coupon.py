"""Coupon-collector expectation: distinct entries after ``m`` draws with replacement.

Paper 003 appendix F, eq. 24 (docs/methods.md §3 item 3). Used by the sample-budget search of probabilistic
eviction and by the torch reference of its kernel (:mod:`presses.kernels.references`).
"""

from __future__ import annotations

import torch

__all__ = ["expected_unique", "expected_unique_from_log"]


def expected_unique(pi: torch.Tensor, num_samples) -> torch.Tensor:
    """Expected number of distinct entries after ``m`` draws with replacement (paper 003 eq. 24).

    ``E[J(m)] = sum_i -expm1(m * log1p(-pi_i))`` (the stable form of ``1 - (1 - pi_i)^m``).

    Args:
        pi: ``(..., t)`` probabilities (rows summing to 1).
        num_samples: ``m``, an int or an integer tensor broadcastable to ``pi.shape[:-1]``.

    Returns:
        ``(...)`` float64 expectations in ``[0, t]``.
    """
    pi = pi.double()
    m = torch.as_tensor(num_samples, dtype=torch.float64, device=pi.device)
    return (-torch.expm1(m.unsqueeze(-1) * torch.log1p(-pi))).sum(-1)


def expected_unique_from_log(
    log_q: torch.Tensor, num_samples: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`expected_unique` from a precomputed ``log_q = log1p(-pi)`` (paper 003 eq. 24), bit for bit.

    ``E[J(m)] = -sum_i expm1(m log(1 - pi_i))``: the same products, ``expm1`` and sum as :func:`expected_unique`
    (the sign taken after the sum, which is exact), so a search over many ``m`` takes the logarithm once.

    Args:
        log_q: ``(..., t)`` float64 ``log1p(-pi)``.
        num_samples: integer tensor ``m`` broadcastable to ``log_q.shape[:-1]``.
        out: optional float64 buffer of ``log_q``'s shape, overwritten.

    Returns:
        ``(...)`` float64.
    """
    m = num_samples.to(dtype=torch.float64).unsqueeze(-1)
    return torch.mul(log_q, m, out=out).expm1_().sum(-1).neg_()
