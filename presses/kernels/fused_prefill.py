"""Triton: a prefill's causal attention plus the row-weighted column sums of its attention matrix.

``out^h_j = sum_{i<=j} p^h_j(i) v_i`` and ``s^h[i] = sum_{j>=i} w_j p^h_j(i)``, ``p^h_j`` the causal softmax of
``q^h_j . k_i * scaling`` (paper 003 eqs. 16 and 36: the SNIS proposals ``h2o``, ``h2o_h``, ``min_h`` taken from
the prefill itself). Torch reference: :func:`presses.core.prefill_stats.attention_with_column_sums`.

A column sum needs each row's final softmax normaliser, which a single pass over the keys only knows at the end
of the row, so there are two kernels:

1. ``_forward_kernel``: a flash-attention forward (online softmax, base 2), one program per (block of query
   rows, batch x query head); it writes the output and each row's log-sum-exp ``lse_j = m_j + log2 l_j``
   (base-2 logits ``q . k * scaling * log2(e)``). Keys after the block's last row are never loaded.
2. the column pass ``_column_kernel`` of :mod:`presses.kernels.attention_columns` with the row maxima replaced
   by ``lse`` and unit normalisers: per (key block, KV group), ``sum_j w_j exp2(s_ji - lse_j)`` over the rows
   that see the block, the key tile shared by the ``r`` heads of the group.

Global memory holds the output, the ``(B, H_Q, T)`` log-sum-exps and the ``(B, H_Q, T)`` column sums; no
``T x T`` matrix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from presses.core.prefill_stats import check_prefill_attention_args
from presses.kernels.attention_columns import _LOG2E, _column_kernel
from presses.kernels.tiles import key_tile_scores, online_softmax_step

__all__ = ["attention_with_column_sums_triton"]

_BLOCK_M, _BLOCK_N = 64, 64


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    t_len,
    sq_b,
    sq_h,
    sq_t,
    sq_d,
    sk_b,
    sk_g,
    sk_t,
    sk_d,
    sv_b,
    sv_g,
    sv_t,
    sv_d,
    so_b,
    so_h,
    so_t,
    so_d,
    qk_scale,
    HQ: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)  # 64-bit offsets: caches can exceed 2^31 elements
    h = pid_bh % HQ
    g = h // R
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < t_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(
        q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :] * sq_d,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * sk_b + g * sk_g
    v_base = v_ptr + b * sv_b + g * sv_g

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, t_len)  # causal: the block's rows see keys < hi
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < t_len
        s = key_tile_scores(q, k_base, offs_n, mask_n, offs_d, mask_d, sk_t, sk_d, IEEE, UPCAST)
        v = tl.load(
            v_base + offs_n[:, None] * sv_t + offs_d[None, :] * sv_d, mask=mask_n[:, None] & mask_d[None, :], other=0.0
        )
        if UPCAST:
            v = v.to(tl.float32)
        visible = (offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(s, m_i, l_i)  # rows past T see nothing: sum 0
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :] * so_d,
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
    tl.store(lse_ptr + pid_bh * t_len + offs_m, m_i + tl.log2(l_safe), mask=mask_m)


def attention_with_column_sums_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton causal prefill attention plus weighted column sums (paper 003 eqs. 16, 36).

    Same contract as :func:`presses.core.prefill_stats.attention_with_column_sums` (which it matches to float
    round-off; low-precision inputs: ``p`` is rounded to the value dtype before ``p @ v``, as in flash
    attention), with the value head dim equal to ``d``.

    Args:
        query: ``(B, H_Q, T, d)`` RoPE'd queries of positions ``0 .. T-1`` (fp32, bf16 or fp16; any strides).
        key: ``(B, G, T, d)`` RoPE'd keys, same dtype, ``G`` dividing ``H_Q``.
        value: ``(B, G, T, d)`` values, same dtype.
        row_weights: ``(T,)`` row weights ``w_j`` or ``None`` for 1.
        scaling: logit scale, default ``d ** -0.5``.
        block_m, block_n: tiles of both kernels (default 64 x 64).

    Returns:
        ``(out (B, H_Q, T, d)`` in the query dtype, a transposed view of a contiguous ``(B, T, H_Q, d)`` tensor;
        ``s (B, H_Q, T)`` float32).

    Raises:
        ValueError: on inconsistent shapes or dtypes (:func:`presses.core.prefill_stats.check_prefill_attention_args`).
    """

    B, HQ, G, T, d = check_prefill_attention_args(query, key, value, row_weights)
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {query.dtype} is not supported (float32, bfloat16, float16)")
    if value.shape[-1] != d:
        raise ValueError(f"value head dim {value.shape[-1]} differs from the query/key head dim {d}")
    R = HQ // G
    out = torch.empty(B, T, HQ, d, dtype=query.dtype, device=query.device).transpose(1, 2)
    sums = torch.zeros(B, HQ, T, dtype=torch.float32, device=query.device)
    if T == 0 or B == 0:
        return out, sums
    scaling = d**-0.5 if scaling is None else float(scaling)
    qk_scale = scaling * _LOG2E
    interpreting = not key.is_cuda
    bm, bn = block_m or _BLOCK_M, block_n or _BLOCK_N
    bd = max(16, triton.next_power_of_2(d))
    ieee = query.dtype == torch.float32
    upcast = interpreting and query.dtype == torch.bfloat16  # the interpreter multiplies bf16 tiles as integers
    num_warps = 4 if bd <= 64 else 8

    lse = torch.empty(B, HQ, T, dtype=torch.float32, device=query.device)
    _forward_kernel[(triton.cdiv(T, bm), B * HQ)](
        query,
        key,
        value,
        out,
        lse,
        T,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *out.stride(),
        qk_scale,
        HQ=HQ,
        R=R,
        D=d,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=num_warps,
    )
    # column pass: p_j(i) = exp2(s_ji - lse_j), coefficient w_j (unit normalisers: lse already includes them)
    rows = torch.arange(T, device=query.device, dtype=torch.int32)
    ones = torch.ones(B * HQ * T, device=query.device, dtype=torch.float32)
    weights = None
    if row_weights is not None:
        weights = row_weights.to(device=query.device, dtype=torch.float32).contiguous()
    _column_kernel[(triton.cdiv(T, bn), B * G)](
        query,
        key,
        rows,
        weights if weights is not None else ones,
        lse,
        ones,
        sums,
        T,
        T,
        *query.stride(),
        *key.stride(),
        qk_scale,
        G=G,
        R=R,
        D=d,
        HAS_W=weights is not None,
        MAX=False,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=num_warps,
    )
    return out, sums
