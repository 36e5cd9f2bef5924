"""Sample budget of probabilistic eviction: how many draws ``m`` and the draws themselves.

Paper 003 appendix F (Algorithm 2, eq. 24; F.1 for the global budget) and docs/methods.md §3 items 2-3:
``E[J(m)] = sum_i (1 - (1 - pi_i)^m)`` is the expected number of distinct entries after ``m`` draws
with replacement from ``pi``; an integer binary search on ``m in [0, 1e12]`` stops at the first
midpoint with ``|E[J(m)] - j*| <= 0.5``, ``j* = (1 - r*) t``. The draw of ``m`` samples is an exact
multinomial sample computed by binomial splitting, so its cost does not grow with ``m``.
"""

from __future__ import annotations

import torch

from presses.core.coupon import expected_unique_from_log, log_miss
from presses.core.paging import check_compression_ratio
from presses.kernels import expected_unique_many, use_triton  # dispatch: Triton on CUDA, presses.core.coupon elsewhere

__all__ = ["MAX_SAMPLES", "BUDGETS", "DRAWS", "layer_generator", "search_num_samples", "sample_counts"]

MAX_SAMPLES = 10**12
BUDGETS = ("head", "global")
#: How a request's layers get their random streams (:func:`layer_generator`): ``"per_layer"``, one stream per
#: (seed, layer); ``"sequential"``, one stream seeded once per request and consumed in layer order (the scheme of
#: the runs committed before issue 32 item 8, kept to reproduce them).
DRAWS = ("per_layer", "sequential")


def search_num_samples(
    pi: torch.Tensor,
    compression_ratio: float,
    pool_dims: tuple[int, ...] = (),
    tol: float = 0.5,
    max_samples: int = MAX_SAMPLES,
    target: float | None = None,
) -> torch.Tensor:
    """Number of samples ``m`` whose expected kept count meets ``j* = (1 - r*) t`` (paper 003 Alg. 2).

    Runs Algorithm 2 independently for every row (``budget="head"``). With ``pool_dims`` the
    criterion is the MEAN of ``E[J]`` over those dimensions, so one ``m`` serves all of them
    (``budget="global"``, appendix F.1 eq. 33). The search starts from ``[0, max_samples]``, takes
    the midpoint ``floor((low + high) / 2)`` and stops at the first midpoint within ``tol`` of
    ``j*``; ``E[J(mid)]`` of every row goes through the kernel dispatch
    :func:`presses.kernels.expected_unique_many` (one candidate per row; without Triton, eq. 24 with
    ``log(1 - pi_i)`` computed once per search). When ``j*`` is unreachable (entries with ``pi_i = 0`` cap ``E[J]``) it
    returns the
    smallest ``m`` it could not rule out, at most ``max_samples``. ``E[J]`` is monotone in ``m``.

    Args:
        pi: ``(..., t)`` proposals.
        compression_ratio: ``r*`` in ``[0, 1)``.
        pool_dims: dimensions of ``pi`` (not the last) whose ``E[J]`` are averaged.
        tol: tolerance ``epsilon`` on ``|E[J(m)] - j*|``, ``>= 0`` (0.5 in the paper).
        max_samples: upper end ``alpha`` of the search, ``>= 1``.
        target: ``j*`` itself, overriding ``(1 - r*) t`` (e.g. a page count for the page unit,
            :func:`presses.probabilistic.page_sampling.page_target`); ``compression_ratio`` is then only validated.

    Returns:
        int64 ``m`` of shape ``pi.shape[:-1]`` without the ``pool_dims`` (kept as size-1 dims).

    Raises:
        ValueError: for ``compression_ratio`` outside ``[0, 1)``, ``tol < 0``, ``max_samples < 1``,
            or a pooled dimension that is the entry axis.
    """
    check_compression_ratio(compression_ratio)
    if tol < 0:
        raise ValueError(f"tol={tol} must be >= 0")
    if max_samples < 1:
        raise ValueError(f"max_samples={max_samples} must be >= 1")
    nd = pi.dim()
    dims = tuple(d % nd for d in pool_dims)
    if nd - 1 in dims:
        raise ValueError(f"pool_dims={pool_dims} may not contain the entry axis (the last one)")

    pi = pi.double()
    # without Triton, log(1 - pi_i) is taken once for all midpoints (expected_unique_from_log: the same values)
    log_q = None if use_triton(pi) else log_miss(pi)
    buf = None if log_q is None else torch.empty_like(log_q)
    j_star = (1.0 - compression_ratio) * pi.shape[-1] if target is None else float(target)
    out_shape = [1 if d in dims else s for d, s in enumerate(pi.shape[:-1])]
    low = torch.zeros(out_shape, dtype=torch.int64, device=pi.device)
    high = torch.full_like(low, max_samples)
    result = torch.full_like(low, -1)
    active = torch.ones_like(low, dtype=torch.bool)
    while bool(active.any()):
        mid = torch.div(low + high, 2, rounding_mode="floor")
        if log_q is None:
            e = expected_unique_many(pi, mid.unsqueeze(-1)).squeeze(-1)  # E[J(mid)] per row, eq. 24
        else:
            e = expected_unique_from_log(log_q, mid, buf)
        if dims:
            e = e.mean(dim=dims, keepdim=True)
        if bool(e.isnan().any()):  # a NaN would never hit, rise or fall: the search would never end
            raise ValueError(f"E[J(m)] is NaN for m={mid.flatten()[:4].tolist()}: pi must be finite, in [0, 1]")
        hit = active & ((e - j_star).abs() <= tol)
        result = torch.where(hit, mid, result)
        below = active & ~hit & (e < j_star)
        above = active & ~hit & (e > j_star)
        low = torch.where(below, mid + 1, low)
        high = torch.where(above, mid - 1, high)
        active = active & ~hit & (low <= high)
    return torch.where(result >= 0, result, low.clamp(max=max_samples))


def layer_generator(seed: int, layer_idx: int) -> torch.Generator:
    """A CPU generator whose stream depends only on ``(seed, layer_idx)``.

    The seed is numpy's ``SeedSequence([seed, layer_idx])`` (well-mixed, so neighbouring seeds and layers give
    unrelated streams); the generator lives on the CPU so that a seed draws the same counts whatever device the
    layer is on (:func:`sample_counts`).

    Raises:
        ValueError: for a negative ``seed`` or ``layer_idx`` (``SeedSequence`` takes non-negative integers).
    """
    import numpy as np

    if seed < 0 or layer_idx < 0:
        raise ValueError(f"seed={seed} and layer_idx={layer_idx} must be >= 0")
    state = np.random.SeedSequence([int(seed), int(layer_idx)]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) >> 1)  # manual_seed takes values below 2**63


def sample_counts(pi: torch.Tensor, num_samples, generator: torch.Generator | None = None) -> torch.Tensor:
    """Counts ``c ~ Multinomial(m, pi)`` of ``m`` draws with replacement (docs/methods.md §3 item 2).

    Exact multinomial sampling by recursive binomial splitting over a binary tree of the entries:
    ``c_left ~ Binomial(c_node, pi_left / pi_node)``. Cost ``O(t log t)`` per row whatever ``m``
    (``m`` up to ``1e12`` is fine); randomness comes only from ``generator``.

    The draws are made on the generator's device: with a CPU generator and ``pi`` on a GPU, ``pi`` and ``m`` are
    copied to the CPU and the counts back, so a seed gives the same draws whatever device the proposal lives on
    (seeded CUDA and CPU streams differ, pytorch #196613).

    Args:
        pi: ``(..., t)`` probabilities (rows summing to 1; zeros are never drawn).
        num_samples: ``m >= 0``, an int or an integer tensor broadcastable to ``pi.shape[:-1]``.
        generator: a ``torch.Generator`` for reproducible draws (any device), or None (torch's default one on
            ``pi``'s device).

    Returns:
        ``(..., t)`` int64 counts on ``pi``'s device, each row summing to its ``m``.

    Raises:
        ValueError: if any ``m`` is negative or ``pi`` has negative / non-finite entries.
    """
    device = pi.device
    if generator is not None:  # draw where the generator lives (module docstring); a no-op on the same device
        pi = pi.to(generator.device)
    m = torch.as_tensor(num_samples).to(pi.device)
    if bool((m < 0).any()):
        raise ValueError(f"num_samples must be >= 0, got min {int(m.min())}")
    if not bool(torch.isfinite(pi).all()) or bool((pi < 0).any()):
        raise ValueError("pi must be finite and non-negative")
    shape = pi.shape
    t = shape[-1]
    p = pi.double().reshape(-1, t)
    n_rows = p.shape[0]
    size = 1 << max(0, (t - 1).bit_length())
    p = torch.nn.functional.pad(p, (0, size - t))
    counts = m.double().expand(shape[:-1]).reshape(n_rows, 1)
    width = size
    while width > 1:
        half = width // 2
        seg = p.view(n_rows, size // width, 2, half).sum(-1)  # masses of the two children of each node
        total = seg.sum(-1)
        q = torch.where(total > 0, seg[..., 0] / total.clamp_min(1e-300), torch.zeros_like(total)).clamp(0.0, 1.0)
        left = torch.binomial(counts, q, generator=generator)
        counts = torch.stack([left, counts - left], dim=-1).reshape(n_rows, -1)
        width = half
    return counts[:, :t].round().long().reshape(shape).to(device)
