"""Triton: ``E[J(m)]`` for many candidate draw counts ``m`` in one launch (paper 003 appendix F, eq. 24).

``E[J(m)] = sum_i -expm1(m * log1p(-pi_i))`` for every row of ``pi`` and every candidate ``m`` of that
row: one program per (row, block of candidates) sweeps the row once, so a budget search can score a
whole level set of candidates (e.g. the next ``k`` levels of its binary search) per launch.

float64 throughout, like :func:`presses.core.coupon.expected_unique`. ``expm1`` and ``log1p`` are
evaluated with Kahan's compensated forms (``x log(u) / (u - 1)`` with ``u = 1 + x``; ``(u - 1) x / log u``
with ``u = e^x``), accurate to a few ulp from plain ``exp`` / ``log``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from presses.kernels.references import broadcast_candidates

__all__ = ["expected_unique_many_triton"]


@triton.jit
def _expected_unique_kernel(
    pi_ptr, m_ptr, out_ptr, t, M, s_pi, s_m, s_out, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    m = tl.load(m_ptr + row * s_m + offs_m, mask=mask_m, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_T], tl.float64)
    for start in range(0, t, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        p = tl.minimum(tl.load(pi_ptr + row * s_pi + offs_t, mask=offs_t < t, other=0.0), 1.0)  # 1 + round-off
        # log1p(-p) (Kahan): u = 1 - p; log(u) * (-p) / (u - 1), or -p when u rounds to 1
        u = 1.0 - p
        lq = tl.where(u == 1.0, -p, tl.log(u) * (-p / tl.where(u == 1.0, -1.0, u - 1.0)))
        # m = 0 draws nothing: 0, not 0 * -inf = NaN where p = 1 (presses.core.coupon.log_miss)
        x = tl.where(m[:, None] == 0.0, 0.0, tl.where(m == 0.0, 1.0, m)[:, None] * lq[None, :])
        # expm1(x) (Kahan): e = e^x; (e - 1) x / log(e), or x when e rounds to 1, -1 when e - 1 == -1
        e = tl.exp(x)
        em1 = e - 1.0
        safe = (e != 1.0) & (em1 != -1.0)
        val = tl.where(safe, em1 * x / tl.log(tl.where(safe, e, 2.0)), tl.where(em1 == -1.0, -1.0, x))
        acc += -val
    tl.store(out_ptr + row * s_out + offs_m, tl.sum(acc, 1), mask=mask_m)


def expected_unique_many_triton(
    pi: torch.Tensor, num_samples, block_m: int | None = None, block_t: int | None = None
) -> torch.Tensor:
    """Triton version of :func:`presses.kernels.references.expected_unique_many_reference` (same arguments and result,
    float64,
    equal to a few ulp per term)."""
    pi, m = broadcast_candidates(pi, num_samples)
    lead, t, M = pi.shape[:-1], pi.shape[-1], m.shape[-1]
    p2 = pi.double().reshape(-1, t).contiguous()
    m2 = m.double().reshape(-1, M).contiguous()
    out = torch.empty(p2.shape[0], M, device=pi.device, dtype=torch.float64)
    if out.numel() == 0:
        return out.reshape(*lead, M)
    if t == 0:
        return out.zero_().reshape(*lead, M)
    bm = block_m or min(16, triton.next_power_of_2(M))
    bt = block_t or min(256 if pi.is_cuda else 1024, triton.next_power_of_2(t))
    _expected_unique_kernel[(p2.shape[0], triton.cdiv(M, bm))](
        p2, m2, out, t, M, p2.stride(0), m2.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_T=bt, num_warps=4
    )
    return out.reshape(*lead, M)
