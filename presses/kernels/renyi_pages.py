"""Triton: sink-isolated Rényi statistics, group weights, pooled group score and page scores.

From the observer attention ``a^h`` ``(B, H_Q, T)`` (the output of :mod:`presses.kernels.attention_columns`)
Page-EntroKV needs (docs/methods.md §1 steps 2-6; paper 000 sec. 3 and Thm. 2; paper 001 sec. 3.1 and eq. 29):

- ``z_h = sum_{j >= n_sink} a^h[j]`` and the Rényi entropy of ``a~^h = a^h / z_h`` on the non-sinks,
  plus the raw-row entropy (ablation ``pooling="raw_entropy"``): ``_row_entropy_kernel``, one program
  per head, two sweeps over the row (the second divides by ``z`` before taking powers, as the
  reference does);
- the group weights ``w = softmax_{h in g}(-H_h / tau)``: ``O(B H_Q)`` numbers, computed by
  :func:`presses.core.renyi.group_weights` in torch (no kernel needed);
- ``p_g[j] = sum_h w_h a^h[j]`` (or ``max_h a^h[j]``) and the page score ``max_{j in page} p_g[j]``
  (or the page mass, or its mean: the mass over the page's length): ``_pool_pages_kernel``, one program per
  (group, block of pages).

The torch reference is :func:`presses.kernels.references.pooled_page_scores_reference` (Page-EntroKV's own
``pooled_group_scores`` followed by :func:`presses.core.paging.page_scores`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from presses.core.paging import page_scores
from presses.core.renyi import RENYI_ORDERS, group_weights
from presses.kernels.references import check_pooling_args

__all__ = ["pooled_page_scores_triton", "row_entropies_triton"]


@triton.jit
def _entropy_from_sums(s, mx, alpha, n_support, MODE: tl.constexpr):
    """Rényi entropy from the sums over a normalised row (MODE 0: alpha=2, 1: Shannon, 2: inf, 3: general)."""
    if MODE == 0:
        h = -tl.log(tl.maximum(s, 1.1754943508222875e-38))
    elif MODE == 1:
        h = -s
    elif MODE == 2:
        h = -tl.log(tl.maximum(mx, 1.1754943508222875e-38))
    else:
        h = tl.log(tl.maximum(s, 1.1754943508222875e-38)) / (1.0 - alpha)
    return tl.minimum(tl.maximum(h, 0.0), tl.log(n_support))


@triton.jit
def _power_term(p, alpha, MODE: tl.constexpr):
    if MODE == 0:
        return p * p
    elif MODE == 1:
        return tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)  # xlogy(p, p)
    elif MODE == 2:
        return p
    else:
        return tl.where(p > 0, tl.exp(alpha * tl.log(tl.where(p > 0, p, 1.0))), 0.0)


@triton.jit
def _row_entropy_kernel(
    a_ptr, z_ptr, h_ptr, hraw_ptr, T, n_sink, alpha, s_row, MODE: tl.constexpr, BLOCK_T: tl.constexpr
):
    row = tl.program_id(0)
    base = a_ptr + row.to(tl.int64) * s_row
    # sweep 1: non-sink mass z and the raw-row sums
    z_acc = tl.zeros([BLOCK_T], tl.float32)
    raw_acc = tl.zeros([BLOCK_T], tl.float32)
    raw_mx = tl.zeros([BLOCK_T], tl.float32)
    for start in range(0, T, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        a = tl.load(base + offs, mask=offs < T, other=0.0).to(tl.float32)
        z_acc += tl.where(offs >= n_sink, a, 0.0)
        term = _power_term(a, alpha, MODE)
        if MODE == 2:
            raw_mx = tl.maximum(raw_mx, term)
        else:
            raw_acc += term
    z = tl.sum(z_acc, 0)
    h_raw = _entropy_from_sums(tl.sum(raw_acc, 0), tl.max(raw_mx, 0), alpha, T * 1.0, MODE)
    # sweep 2: the sums over a~ = a / z on the non-sinks
    inv_z = 1.0 / tl.maximum(z, 1.1754943508222875e-38)
    acc = tl.zeros([BLOCK_T], tl.float32)
    mx = tl.zeros([BLOCK_T], tl.float32)
    for start in range(n_sink, T, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        a = tl.load(base + offs, mask=offs < T, other=0.0).to(tl.float32)
        term = _power_term(a * inv_z, alpha, MODE)
        if MODE == 2:
            mx = tl.maximum(mx, term)
        else:
            acc += term
    n_tail = (T - n_sink) * 1.0
    h = _entropy_from_sums(tl.sum(acc, 0), tl.max(mx, 0), alpha, n_tail, MODE)
    h = tl.where(z > 0, h, tl.log(n_tail))  # z = 0: a~ is uniform (reference convention)
    tl.store(z_ptr + row, z)
    tl.store(h_ptr + row, h)
    tl.store(hraw_ptr + row, h_raw)


@triton.jit
def _pool_pages_kernel(
    a_ptr,
    w_ptr,
    pooled_ptr,
    pages_ptr,
    T,
    P,
    page_size,
    sa_b,
    sa_h,
    sa_t,
    G: tl.constexpr,
    R: tl.constexpr,
    MAX_POOL: tl.constexpr,
    MASS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    page = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    slot = tl.arange(0, BLOCK_S)
    pos = page[:, None] * page_size + slot[None, :]
    mask = (slot[None, :] < page_size) & (pos < T)
    if MAX_POOL:
        acc = tl.full([BLOCK_P, BLOCK_S], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_P, BLOCK_S], tl.float32)
    for hh in range(R):
        a = tl.load(a_ptr + b * sa_b + (g * R + hh) * sa_h + pos * sa_t, mask=mask, other=0.0).to(tl.float32)
        if MAX_POOL:
            acc = tl.maximum(acc, a)
        else:
            acc += tl.load(w_ptr + pid_bg * R + hh) * a
    tl.store(pooled_ptr + pid_bg * T + pos, acc, mask=mask)
    if MASS:
        score = tl.sum(tl.where(mask, acc, 0.0), 1)
    else:
        score = tl.max(tl.where(mask, acc, float("-inf")), 1)
    tl.store(pages_ptr + pid_bg * P + page, score, mask=page < P)


def _alpha_mode(alpha: float) -> int:
    if math.isinf(alpha):
        return 2
    if abs(alpha - 1.0) < 1e-9:
        return 1
    if alpha == 2.0:
        return 0
    return 3


def row_entropies_triton(attn: torch.Tensor, n_sink: int, alpha: float) -> dict[str, torch.Tensor]:
    """Per-row sink-isolated and raw Rényi entropies (docs/methods.md §1 steps 2-3) with Triton.

    Args:
        attn: ``(..., T)`` observer attention rows (float32/bf16/fp16).
        n_sink: ``0 <= n_sink < T``.
        alpha: Rényi order ``> 0`` or ``inf``.

    Returns:
        dict of ``(...)`` float32 tensors: ``z`` (non-sink mass), ``entropy``
        (:func:`presses.core.renyi.renyi_entropy` of :func:`presses.core.renyi.sink_isolate`'s ``a~``) and
        ``raw_entropy`` (:func:`presses.core.renyi.renyi_entropy` of the raw row).

    Raises:
        ValueError: for ``n_sink`` outside ``[0, T)`` or ``alpha <= 0``.
    """

    T = attn.shape[-1]
    if n_sink < 0 or n_sink >= T:
        raise ValueError(f"n_sink={n_sink} must satisfy 0 <= n_sink < T={T} (no non-sink position left)")
    if not (alpha > 0):
        raise ValueError(f"Rényi order alpha={alpha} must be > 0 ({RENYI_ORDERS})")
    lead = attn.shape[:-1]
    rows = attn.reshape(-1, T)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    z = torch.empty(n, device=attn.device, dtype=torch.float32)
    h, h_raw = torch.empty_like(z), torch.empty_like(z)
    if n:
        block = min(1024, triton.next_power_of_2(T))
        _row_entropy_kernel[(n,)](
            rows,
            z,
            h,
            h_raw,
            T,
            n_sink,
            float(alpha) if not math.isinf(alpha) else 0.0,
            rows.stride(0),
            MODE=_alpha_mode(alpha),
            BLOCK_T=block,
            num_warps=4,
        )
    return {"z": z.reshape(lead), "entropy": h.reshape(lead), "raw_entropy": h_raw.reshape(lead)}


def pooled_page_scores_triton(
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
    """Triton version of :func:`presses.kernels.references.pooled_page_scores_reference` (same arguments, returns and
    errors;
    equal to float32 round-off). docs/methods.md §1 steps 2-6."""

    check_pooling_args(attn, num_groups, pooling, page_size, page_score)
    Bsz, HQ, T = attn.shape
    G = num_groups
    r = HQ // G
    stats = None
    if pooling in ("entropy", "raw_entropy") or diagnostics:
        stats = row_entropies_triton(attn, n_sink, alpha)
    weights = None
    if pooling == "entropy":
        weights = group_weights(stats["entropy"], G, tau)
    elif pooling == "raw_entropy":
        weights = group_weights(stats["raw_entropy"], G, tau)
    elif pooling == "mean":
        weights = torch.full((Bsz, G, r), 1.0 / r, device=attn.device, dtype=torch.float32)
    P = -(-T // page_size)
    pooled = torch.empty(Bsz, G, T, device=attn.device, dtype=torch.float32)
    pages = torch.empty(Bsz, G, P, device=attn.device, dtype=torch.float32)
    if Bsz and T:
        block_s = triton.next_power_of_2(page_size)
        block_p = max(1, min(triton.next_power_of_2(P), 2048 // block_s))
        w = weights.contiguous() if weights is not None else pooled  # dummy pointer for "max"
        _pool_pages_kernel[(triton.cdiv(P, block_p), Bsz * G)](
            attn,
            w,
            pooled,
            pages,
            T,
            P,
            page_size,
            *attn.stride(),
            G=G,
            R=r,
            MAX_POOL=pooling == "max",
            MASS=page_score in ("mass", "mean"),  # "mean": the mass divided by the page's length below
            BLOCK_P=block_p,
            BLOCK_S=block_s,
            num_warps=4,
        )
    if page_score == "halo_max":  # the kernel's pooled scores, the halo read across pages in torch
        pages = page_scores(pooled, page_size, page_score)
    if page_score == "mean" and P:
        lengths = torch.full((P,), float(page_size), device=attn.device)
        lengths[-1] = T - (P - 1) * page_size
        pages = pages / lengths
    if not diagnostics:
        return pooled, pages, None
    return (
        pooled,
        pages,
        {"weights": weights, "entropy": stats["entropy"], "raw_entropy": stats["raw_entropy"], "z": stats["z"]},
    )
