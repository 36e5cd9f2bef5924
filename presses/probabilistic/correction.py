"""The SNIS importance weights of probabilistic eviction as an attention-logit bias (paper 003 Algorithm 1,
eq. 10; docs/methods.md §3 item 5). The bias is applied at decode time by :mod:`presses.attention_bias`."""

from __future__ import annotations

import math

import torch

__all__ = ["snis_bias"]


def snis_bias(
    counts: torch.Tensor, num_samples, pi: torch.Tensor, tau: float = 1.0, correction: bool = True
) -> torch.Tensor:
    """SNIS log importance weights as a logit bias (paper 003 Alg. 1 line 2 and eq. 10).

    ``b_i = (log c_i - log m - log pi_i) / tau`` where ``c_i > 0``; ``-inf`` where ``c_i = 0``;
    ``0`` on kept entries when ``correction`` is False or ``tau = inf`` (uncorrected estimator).

    Args:
        counts: ``(..., n)`` draw counts (float or int, may be fractional for expectation tests).
        num_samples: ``m > 0``, an int or tensor broadcastable to ``counts.shape[:-1]``.
        pi: ``(..., n)`` proposal probabilities of the same entries.
        tau: importance-weight temperature ``tau > 0`` (``inf`` allowed).
        correction: apply the correction at all.

    Returns:
        ``(..., n)`` float32.

    Raises:
        ValueError: if ``tau <= 0`` or a kept entry has ``pi_i <= 0``.
    """
    if not (tau > 0):
        raise ValueError(f"tau={tau} must be > 0 (inf = no correction)")
    kept = counts > 0
    if not correction or math.isinf(tau):
        return torch.where(kept, 0.0, float("-inf")).float()
    if bool((kept & (pi <= 0)).any()):
        raise ValueError("a kept entry has proposal probability pi_i <= 0: the proposal must cover the draws")
    m = torch.as_tensor(num_samples, dtype=torch.float64, device=counts.device).unsqueeze(-1)
    logw = torch.log(counts.double().clamp_min(1e-300)) - torch.log(m) - torch.log(pi.double().clamp_min(1e-300))
    return torch.where(kept, logw / tau, float("-inf")).float()
