"""Triton: per-row chunk masses of causal softmax attention (and the rows' weighted average), never storing a row.

What EntroPrefill consumes from its attention rows (paper 001 Algorithm 1; docs/methods.md §4 steps 2, 4, 5):
each proposal row's mass on each candidate chunk (eq. 14), the proposal rows' per-head average (eq. 2) and each
audit row's mass on the removal set (eq. 17, a sum of chunk masses). Reference:
:func:`presses.core.row_masses.row_chunk_masses_reference`.

The chunk masses are an attention whose "values" are the one-hot chunk indicators of the keys: row ``u``'s
masses are ``softmax(q_u K^T) @ onehot(ids)``. ``_chunk_mass_kernel`` computes them flash-attention style in
ONE pass over the keys: per (key split, block of the group's flattened ``r * n`` rows, chunk block), an online
softmax max ``m`` and sum ``l`` (base 2) and the unnormalised chunk accumulator
``c <- c * exp2(m_old - m_new) + exp2(s - m_new) @ onehot``, the one-hot tile built in registers from the keys'
chunk ids. The key splits are merged in torch (``(rows, splits)`` and ``(rows, splits, k)`` partials). The
weighted average then reuses :mod:`presses.kernels.attention_columns`'s column pass with the merged ``m`` and
``l`` (its row-statistics pass is not repeated). Global memory holds the ``(B, H_Q, n, k)`` masses, the partials
and, when asked, the ``(B, H_Q, t)`` average; never ``n x t`` per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from presses.core.row_masses import check_chunk_ids
from presses.kernels.attention_columns import (
    _column_kernel,
    check_query_key_args,
    row_launch,
)
from presses.kernels.tiles import key_tile_scores, load_group_rows, online_softmax_step

__all__ = ["row_chunk_masses_triton"]

# default tiles: rows x keys x chunks (the chunk accumulator is BLOCK_M x BLOCK_K float32 registers), and warps
# of the chunk-mass pass; chosen on an H200 (results/kernels/tune_row_masses/README.md)
_BLOCK_M, _BLOCK_N, _MAX_BLOCK_K, _NUM_WARPS = 32, 64, 128, 4
# precision of the one-hot chunk product on a GPU (``tl.dot``'s ``input_precision``): "ieee" multiplies on the
# float32 cores; "tf32x3" on the tensor cores as three TF32 products (the one-hot side is exact in TF32, so the
# result keeps ~22 of float32's 24 mantissa bits). The interpreter always multiplies in IEEE float32.
MASS_PRECISIONS = ("ieee", "tf32x3")
_MASS_PRECISION = "tf32x3"


@triton.jit
def _chunk_mass_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    ids_ptr,
    m_ptr,
    l_ptr,
    c_ptr,
    n_rows,
    t_keys,
    n_chunks,
    chunk,
    n_split,
    n_mblocks,
    sq_b,
    sq_h,
    sq_n,
    sq_d,
    sk_b,
    sk_g,
    sk_t,
    sk_d,
    qk_scale,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    MASS_PRECISION: tl.constexpr,
):
    # program: (key split, row block) x (batch, group) x chunk block
    pid = tl.program_id(0)
    pid_bg = tl.program_id(1)
    pid_c = tl.program_id(2)
    pid_m = pid % n_mblocks
    split = pid // n_mblocks
    b = (pid_bg // G).to(tl.int64)  # 64-bit offsets: caches can exceed 2^31 elements
    g = pid_bg % G

    offs_i, valid, pos, offs_d, mask_d, q = load_group_rows(
        q_ptr, rows_ptr, pid_m, b, g, n_rows, sq_b, sq_h, sq_n, sq_d, R, D, BLOCK_M, BLOCK_D, UPCAST
    )
    k_base = k_ptr + b * sk_b + g * sk_g
    offs_c = pid_c * BLOCK_K + tl.arange(0, BLOCK_K)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, tl.max(pos, 0) + 1)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_keys = offs_n < t_keys
        s = key_tile_scores(q, k_base, offs_n, in_keys, offs_d, mask_d, sk_t, sk_d, IEEE, UPCAST)
        s = tl.where(offs_n[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(s, m_i, l_i)
        cid = tl.load(ids_ptr + offs_n, mask=in_keys, other=-1)
        onehot = (cid[:, None] == offs_c[None, :]).to(tl.float32)  # (BLOCK_N, BLOCK_K): keys in no chunk are 0
        acc = acc * alpha[:, None] + tl.dot(p, onehot, input_precision=MASS_PRECISION)
        m_i = m_new
    row = (pid_bg * R * n_rows + offs_i) * n_split + split
    if pid_c == 0:
        tl.store(m_ptr + row, m_i, mask=valid)
        tl.store(l_ptr + row, l_i, mask=valid)
    tl.store(c_ptr + row[:, None] * n_chunks + offs_c[None, :], acc, mask=valid[:, None] & (offs_c < n_chunks)[None, :])


def row_chunk_masses_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor,
    num_chunks: int,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    max_block_k: int | None = None,
    num_warps: int | None = None,
    mass_precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton per-row chunk masses and weighted row average (paper 001 eqs. 1-2, 14, 17; docs/methods.md §4).

    Same contract as :func:`presses.core.row_masses.row_chunk_masses_reference` (which it matches to float
    round-off).

    Args:
        queries: ``(B, H_Q, n, d)`` RoPE'd queries (fp32, bf16 or fp16; any strides).
        keys: ``(B, G, t, d)`` RoPE'd keys, same dtype, ``G`` dividing ``H_Q``.
        rows: ``(n,)`` absolute positions of the rows in ``[0, t)``, any order.
        ids: ``(t,)`` int chunk of every key (``-1``: none).
        num_chunks: ``k``.
        row_weights: ``(n,)`` weights of the average, or ``None`` (no average).
        scaling: logit scale, default ``d ** -0.5``.
        block_m, block_n, num_splits: row and key tiles, key splits (defaults by device).
        max_block_k: largest chunk tile (a power of two >= 16; more chunks take more chunk-tile programs, each
            recomputing its rows' scores).
        num_warps: warps per program of the chunk-mass pass.
        mass_precision: one of :data:`MASS_PRECISIONS` for the one-hot product on a GPU (default
            ``_MASS_PRECISION``; the interpreter always uses ``"ieee"``).

    Returns:
        ``(masses (B, H_Q, n, k), average (B, H_Q, t) or None)``, float32.

    Raises:
        ValueError: if shapes or dtypes disagree, ``G`` does not divide ``H_Q``, a row position is outside
            ``[0, t)``, the chunk ids are out of range, ``max_block_k`` is not a power of two >= 16, or
            ``mass_precision`` is not one of :data:`MASS_PRECISIONS`.
    """
    B, HQ, n, d, G, t = check_query_key_args(queries, keys)
    max_bk = max_block_k or _MAX_BLOCK_K
    if max_bk < 16 or max_bk & (max_bk - 1):
        raise ValueError(f"max_block_k must be a power of two >= 16, got {max_block_k}")
    precision = mass_precision or _MASS_PRECISION
    if precision not in MASS_PRECISIONS:
        raise ValueError(f"mass_precision must be one of {MASS_PRECISIONS}, got {mass_precision!r}")
    if rows.shape != (n,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, expected ({n},)")
    check_chunk_ids(ids, t, num_chunks)
    if row_weights is not None and row_weights.shape != (n,):
        raise ValueError(f"row_weights has shape {tuple(row_weights.shape)}, expected ({n},)")
    R = HQ // G
    masses = torch.zeros(B, HQ, n, num_chunks, device=keys.device, dtype=torch.float32)
    average = None if row_weights is None else torch.zeros(B, HQ, t, device=keys.device, dtype=torch.float32)
    if n == 0 or t == 0 or B == 0:
        return masses, average
    if int(rows.min()) < 0 or int(rows.max()) >= t:
        raise ValueError(f"row positions must lie in [0, t={t}), got [{int(rows.min())}, {int(rows.max())}]")
    rows = rows.to(device=keys.device, dtype=torch.int32).contiguous()
    ids = ids.to(device=keys.device, dtype=torch.int32).contiguous()
    bm, bn = block_m or _BLOCK_M, block_n or _BLOCK_N
    bk = min(max_bk, max(16, triton.next_power_of_2(max(1, num_chunks))))
    n_cblocks = triton.cdiv(max(1, num_chunks), bk)
    n_mblocks = triton.cdiv(R * n, bm)
    launch = row_launch(queries, keys, rows, scaling, bn, num_splits, n_mblocks * B * G * n_cblocks)
    qk_scale, bd, ieee, upcast = launch.qk_scale, launch.bd, launch.ieee, launch.upcast
    num_warps = num_warps or _NUM_WARPS
    n_kblocks, chunk, num_splits = launch.n_kblocks, launch.chunk, launch.num_splits
    m_part = torch.empty(B * HQ * n, num_splits, device=keys.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    c_part = torch.empty(B * HQ * n, num_splits, max(1, num_chunks), device=keys.device, dtype=torch.float32)
    _chunk_mass_kernel[(n_mblocks * num_splits, B * G, n_cblocks)](
        queries,
        keys,
        rows,
        ids,
        m_part,
        l_part,
        c_part,
        n,
        t,
        max(1, num_chunks),
        chunk,
        num_splits,
        n_mblocks,
        *queries.stride(),
        *keys.stride(),
        qk_scale,
        G=G,
        R=R,
        D=d,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        BLOCK_K=bk,
        IEEE=ieee,
        UPCAST=upcast,
        MASS_PRECISION="ieee" if not keys.is_cuda else precision,
        num_warps=num_warps,
    )
    m_row = m_part.amax(-1)  # every row sees key 0, so m_row is finite
    scale = torch.exp2(m_part - m_row.unsqueeze(-1))  # (rows, splits): an empty split has m = -inf, weight 0
    l_row = (l_part * scale).sum(-1)
    if num_chunks:
        masses = ((c_part * scale.unsqueeze(-1)).sum(1) / l_row.unsqueeze(-1)).view(B, HQ, n, num_chunks)
    if row_weights is not None:
        coef = 1.0 / l_row
        weights = row_weights.to(device=keys.device, dtype=torch.float32).contiguous()
        _column_kernel[(n_kblocks, B * G)](
            queries,
            keys,
            rows,
            weights,
            m_row,
            coef,
            average,
            n,
            t,
            *queries.stride(),
            *keys.stride(),
            qk_scale,
            G=G,
            R=R,
            D=d,
            HAS_W=True,
            MAX=False,
            BLOCK_M=64,
            BLOCK_N=bn,
            BLOCK_D=bd,
            IEEE=ieee,
            UPCAST=upcast,
            num_warps=launch.num_warps,
        )
    return masses, average
