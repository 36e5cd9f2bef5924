"""Coupon-collector expectation: distinct entries after ``m`` draws with replacement.

Paper 003 appendix F, eq. 24 (docs/methods.md §3 item 3). Used by the sample-budget search of probabilistic
eviction and by the torch reference of its kernel (:mod:`presses.kernels.references`).
"""

from __future__ import annotations

import torch

__all__ = ["LOG_FLOOR", "expected_unique", "expected_unique_from_log", "log_miss"]

#: ``log(1 - pi)`` of an entry drawn surely (``pi = 1``: a one-token prompt, a prompt of one page) is ``-inf``, and
#: ``0 * -inf`` is NaN at ``m = 0``: the log is floored at the most negative float64, which gives the limits
#: ``(1 - 1)^0 = 1`` and ``(1 - 1)^m = 0`` for ``m >= 1`` and changes no finite value.
LOG_FLOOR = -torch.finfo(torch.float64).max


def log_miss(pi: torch.Tensor) -> torch.Tensor:
    """``log(1 - pi_i)`` in float64 (``log1p(-pi)``) for the coupon-collector sums.

    ``pi_i`` above 1 by float32 round-off (a page proposal of one page sums to ``1 + 1e-7``) is read as 1, and the
    log is floored at the most negative float64 (:data:`LOG_FLOOR`), so that an entry with ``pi_i = 1`` gives
    ``E[J(0)] = 0`` and ``E[J(m >= 1)] = 1`` instead of NaN; every ``pi_i <= 1`` with a finite log is unchanged.
    """
    return torch.log1p(-pi.double().clamp_max(1.0)).clamp_min(LOG_FLOOR)


def expected_unique(pi: torch.Tensor, num_samples) -> torch.Tensor:
    """Expected number of distinct entries after ``m`` draws with replacement (paper 003 eq. 24).

    ``E[J(m)] = sum_i -expm1(m * log1p(-pi_i))`` (the stable form of ``1 - (1 - pi_i)^m``).

    Args:
        pi: ``(..., t)`` probabilities (rows summing to 1).
        num_samples: ``m``, an int or an integer tensor broadcastable to ``pi.shape[:-1]``.

    Returns:
        ``(...)`` float64 expectations in ``[0, t]``.
    """
    m = torch.as_tensor(num_samples, dtype=torch.float64, device=pi.device)
    return (-torch.expm1(m.unsqueeze(-1) * log_miss(pi))).sum(-1)


def expected_unique_from_log(
    log_q: torch.Tensor, num_samples: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`expected_unique` from a precomputed ``log_q = log1p(-pi)`` (paper 003 eq. 24), bit for bit.

    ``E[J(m)] = -sum_i expm1(m log(1 - pi_i))``: the same products, ``expm1`` and sum as :func:`expected_unique`
    (the sign taken after the sum, which is exact), so a search over many ``m`` takes the logarithm once.

    Args:
        log_q: ``(..., t)`` float64 ``log1p(-pi)`` (:func:`log_miss`).
        num_samples: integer tensor ``m`` broadcastable to ``log_q.shape[:-1]``.
        out: optional float64 buffer of ``log_q``'s shape, overwritten.

    Returns:
        ``(...)`` float64.
    """
    m = num_samples.to(dtype=torch.float64).unsqueeze(-1)
    return torch.mul(log_q, m, out=out).expm1_().sum(-1).neg_()
