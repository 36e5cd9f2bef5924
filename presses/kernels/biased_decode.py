"""Triton: one decode query per head against a padded per-group cache with a per-key logit bias.

SNIS decode-time correction (paper 003 Algorithm 1 with eq. 10; docs/methods.md §3 item 5): attention with an additive
bias ``b_i`` on the logits, ``b_i = (log c_i - log m - log pi_i) / tau`` on kept prompt entries, ``0``
(or the model's own mask) on entries written after eviction, ``-inf`` on padding. The bias is per KV
group and shared by its ``r`` query heads, exactly as :func:`presses.attention_bias.bias_mask` builds it
(the mask of head ``h`` is the bias of group ``h // r``).

Split-K flash-decoding: ``_split_kernel`` runs one program per (key split, batch x group) that handles
all ``r`` heads of the group against its slice of the cache with an online softmax and writes partial
``(m, l, acc)``; ``_combine_kernel`` merges the splits per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from presses.kernels.references import check_decode_args
from presses.kernels.tiles import key_tile_scores, online_softmax_step

__all__ = ["biased_decode_triton"]

_LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    K,
    chunk,
    n_split,
    sq_b,
    sq_h,
    sq_d,
    sk_b,
    sk_g,
    sk_t,
    sk_d,
    sv_b,
    sv_g,
    sv_t,
    sv_d,
    sb_b,
    sb_g,
    sb_t,
    qk_scale,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    split = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)  # 64-bit offsets: caches can exceed 2^31 elements
    g = pid_bg % G
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < R
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(
        q_ptr + b * sq_b + (g * R + offs_h)[:, None] * sq_h + offs_d[None, :] * sq_d,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        s = key_tile_scores(q, k_ptr + b * sk_b + g * sk_g, offs_n, mask_n, offs_d, mask_d, sk_t, sk_d, IEEE, UPCAST)
        v = tl.load(
            v_ptr + b * sv_b + g * sv_g + offs_n[:, None] * sv_t + offs_d[None, :] * sv_d,
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        bias = tl.load(bias_ptr + b * sb_b + g * sb_g + offs_n * sb_t, mask=mask_n, other=float("-inf"))
        s = s * qk_scale + bias.to(tl.float32)[None, :] * 1.4426950408889634  # base-2 logits
        m_new, alpha, p, l_i = online_softmax_step(s, m_i, l_i)
        pv = p.to(v.dtype)
        if UPCAST:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, v)
        m_i = m_new
    row = (pid_bg * R + offs_h) * n_split + split
    tl.store(m_ptr + row, m_i, mask=mask_h)
    tl.store(l_ptr + row, l_i, mask=mask_h)
    tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, n_split, so_bh, so_d, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    bh = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_split
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    m = tl.load(m_ptr + bh * n_split + offs_s, mask=mask_s, other=float("-inf"))
    l_sum = tl.load(l_ptr + bh * n_split + offs_s, mask=mask_s, other=0.0)
    acc = tl.load(
        acc_ptr + (bh * n_split + offs_s)[:, None] * D + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(out_ptr + bh * so_bh + offs_d * so_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def biased_decode_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    scaling: float | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Split-K Triton version of :func:`presses.kernels.references.biased_decode_reference` (same arguments, result and
    errors).

    Args:
        block_n: keys per tile (default 64).
        num_splits: key splits (default: enough programs to fill the device; 1 on the interpreter).
    """
    query, B, HQ, G, K, d = check_decode_args(query, key, value, bias)
    if (
        query.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or key.dtype != query.dtype
        or value.dtype != query.dtype
    ):
        raise ValueError(
            f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype} must match and be "
            "float32, bfloat16 or float16"
        )
    r = HQ // G
    scaling = d**-0.5 if scaling is None else float(scaling)
    out = torch.empty(B, HQ, 1, d, device=query.device, dtype=query.dtype)
    if out.numel() == 0:
        return out
    interpreting = not query.is_cuda
    bn = block_n or 64
    n_blocks = triton.cdiv(K, bn)
    if num_splits is None:
        if interpreting:
            num_splits = 1
        else:
            want = 2 * torch.cuda.get_device_properties(query.device).multi_processor_count
            num_splits = max(1, min(n_blocks, triton.cdiv(want, B * G)))
    chunk = triton.cdiv(n_blocks, num_splits) * bn
    num_splits = max(1, triton.cdiv(K, chunk))
    bd = max(16, triton.next_power_of_2(d))
    bh = max(16, triton.next_power_of_2(r))
    m_part = torch.empty(B * HQ, num_splits, device=query.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B * HQ, num_splits, d, device=query.device, dtype=torch.float32)
    q3 = query[:, :, 0, :]
    _split_kernel[(num_splits, B * G)](
        q3,
        key,
        value,
        bias,
        m_part,
        l_part,
        acc_part,
        K,
        chunk,
        num_splits,
        *q3.stride(),
        *key.stride(),
        *value.stride(),
        *bias.stride(),
        scaling * _LOG2E,
        G=G,
        R=r,
        D=d,
        BLOCK_H=bh,
        BLOCK_N=bn,
        BLOCK_D=bd,
        IEEE=query.dtype == torch.float32,
        UPCAST=interpreting and query.dtype == torch.bfloat16,
        num_warps=4,
    )
    _combine_kernel[(B * HQ,)](
        m_part,
        l_part,
        acc_part,
        out,
        num_splits,
        d,
        1,
        D=d,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=bd,
        num_warps=4,
    )
    return out
