"""Budgeted chunk removal under row constraints: greedy feasible scan and dual certificate.

Paper 001 section 4.2 (eqs. 14-16). The screening problem over removal decisions
``x in {0, 1}^k`` with chunk sizes ``n_i``, a row-mass table ``m[a, i] >= 0``, row tolerances
``eps_a`` and a minimum retained count ``m_0``:

    D* = max sum_i n_i x_i   s.t.   sum_i m[a, i] x_i <= eps_a  (every a),   sum_i x_i <= k - m_0.

:func:`greedy_feasible_scan` is the reference proposer; :func:`dual_certificate` evaluates the
upper bound ``U(y, t)`` of eq. 15 at prices from the LP relaxation (scipy's HiGHS) or at
``y = 0, t = 0`` when scipy is missing. Both are independent of attention and reusable for any
knapsack-style removal with linear capacity constraints.
"""

from __future__ import annotations

import torch

__all__ = ["greedy_feasible_scan", "dual_bound", "dual_certificate"]


def _check(sizes: torch.Tensor, masses: torch.Tensor, eps: torch.Tensor, min_keep: int) -> None:
    k = sizes.shape[0]
    if masses.dim() != 2 or masses.shape[1] != k:
        raise ValueError(f"masses must be (A, k={k}), got {tuple(masses.shape)}")
    if eps.shape != (masses.shape[0],):
        raise ValueError(f"eps must be (A={masses.shape[0]},), got {tuple(eps.shape)}")
    if not 0 <= min_keep <= k:
        raise ValueError(f"min_keep={min_keep} (m_0) must lie in [0, k={k}]")


def greedy_feasible_scan(
    priorities: torch.Tensor,
    sizes: torch.Tensor,
    masses: torch.Tensor,
    eps: torch.Tensor,
    min_keep: int = 0,
    target: float = float("inf"),
) -> tuple[list[int], torch.Tensor]:
    """Reference proposer of paper 001 section 4.2 (one scan, feasible by construction).

    Sort chunks by increasing priority, ties by larger size and then by smaller index; add a chunk
    to the removal set only if every row constraint ``sum_i m[a, i] x_i <= eps_a`` and the count
    constraint ``sum_i x_i <= k - m_0`` still hold; stop once the removed tokens reach ``target``.

    Args:
        priorities: ``(k,)`` chunk priorities ``S_i`` (lowest is removed first).
        sizes: ``(k,)`` chunk sizes ``n_i`` (tokens).
        masses: ``(A, k)`` row-chunk mass table ``m[a, i]``.
        eps: ``(A,)`` row tolerances ``eps_a``.
        min_keep: ``m_0``, the minimum number of retained chunks.
        target: the token-saving target ``N - B_pref`` (``inf``: scan every chunk).

    Returns:
        ``(removed, used)``: removed chunk indices in the order they were added, and the ``(A,)``
        float64 row masses used by them.

    Raises:
        ValueError: on inconsistent shapes or ``min_keep`` outside ``[0, k]``.
    """
    sizes = torch.as_tensor(sizes)
    masses = torch.as_tensor(masses, dtype=torch.float64)
    eps = torch.as_tensor(eps, dtype=torch.float64)
    _check(sizes, masses, eps, min_keep)
    k = sizes.shape[0]
    order = sorted(range(k), key=lambda i: (float(priorities[i]), -int(sizes[i]), i))
    used = torch.zeros(masses.shape[0], dtype=torch.float64)
    removed: list[int] = []
    saving = 0
    for i in order:
        if saving >= target:
            break
        if len(removed) + 1 > k - min_keep:
            break
        trial = used + masses[:, i]
        if bool((trial <= eps).all()):
            used = trial
            removed.append(i)
            saving += int(sizes[i])
    return removed, used


def dual_bound(
    y: torch.Tensor, t: float, sizes: torch.Tensor, masses: torch.Tensor, eps: torch.Tensor, min_keep: int
) -> float:
    """``U(y, t)`` of paper 001 eq. 15 for any prices ``y >= 0``, ``t >= 0`` (Theorem 4.3).

    ``U = sum_a y_a eps_a + t (k - m_0) + sum_i [n_i - sum_a y_a m[a, i] - t]_+``; every feasible
    removal saves at most ``U`` tokens.

    Args:
        y: ``(A,)`` row prices (negative entries are clipped to 0).
        t: count price (clipped to 0).
        sizes, masses, eps, min_keep: as in :func:`greedy_feasible_scan`.

    Returns:
        the bound in tokens (float).
    """
    sizes = torch.as_tensor(sizes, dtype=torch.float64)
    masses = torch.as_tensor(masses, dtype=torch.float64)
    eps = torch.as_tensor(eps, dtype=torch.float64)
    _check(sizes, masses, eps, min_keep)
    y = torch.as_tensor(y, dtype=torch.float64).clamp_min(0.0)
    t = max(float(t), 0.0)
    k = sizes.shape[0]
    reduced = (sizes - y @ masses - t).clamp_min(0.0)
    return float(y @ eps + t * (k - min_keep) + reduced.sum())


def dual_certificate(
    sizes: torch.Tensor, masses: torch.Tensor, eps: torch.Tensor, min_keep: int = 0, use_lp: bool = True
) -> tuple[float, torch.Tensor, float, str]:
    """Dual certificate ``U_l(y, t) >= D*_l`` with LP-relaxation prices (paper 001 eq. 15, Thm 4.3).

    Solves the dual of the LP relaxation ``max n.x, M x <= eps, 1.x <= k - m_0, 0 <= x <= 1`` with
    ``scipy.optimize.linprog`` (HiGHS), i.e. ``min eps.y + (k - m_0) t + 1.s`` over
    ``s_i >= n_i - (M^T y)_i - t``, ``y, t, s >= 0``, then evaluates eq. 15 at the optimal
    ``(y, t)`` with :func:`dual_bound` (valid for any nonnegative prices, so solver round-off cannot
    invalidate it). Without scipy, or when the solver fails, ``y = 0, t = 0`` gives ``U = N``.

    Args:
        sizes, masses, eps, min_keep: as in :func:`greedy_feasible_scan`.
        use_lp: False forces the ``y = 0, t = 0`` prices.

    Returns:
        ``(U, y, t, method)`` with ``method`` in ``{"linprog", "zero"}``.
    """
    # a certificate, not a differentiable quantity: detach (autograd may be on around the prefill)
    sizes = torch.as_tensor(sizes, dtype=torch.float64).detach().cpu()
    masses = torch.as_tensor(masses, dtype=torch.float64).detach().cpu()
    eps = torch.as_tensor(eps, dtype=torch.float64).detach().cpu()
    _check(sizes, masses, eps, min_keep)
    A, k = masses.shape
    y0 = torch.zeros(A, dtype=torch.float64)
    if use_lp and k > 0:
        try:
            import numpy as np
            from scipy.optimize import linprog
        except ImportError:  # pragma: no cover - scipy is a dependency
            linprog = None
        if linprog is not None:
            c = np.concatenate([eps.numpy(), [float(k - min_keep)], np.ones(k)])
            # -(M^T y) - t - s <= -n
            a_ub = np.concatenate([-masses.numpy().T, -np.ones((k, 1)), -np.eye(k)], axis=1)
            res = linprog(c, A_ub=a_ub, b_ub=-sizes.numpy(), bounds=(0, None), method="highs")
            if res.status == 0:
                y = torch.as_tensor(res.x[:A], dtype=torch.float64).clamp_min(0.0)
                t = max(float(res.x[A]), 0.0)
                return dual_bound(y, t, sizes, masses, eps, min_keep), y, t, "linprog"
    return dual_bound(y0, 0.0, sizes, masses, eps, min_keep), y0, 0.0, "zero"
