"""Triton device helpers shared by the attention-scoring kernels (inlined by Triton into each caller).

- :func:`load_group_rows`: one block of a KV group's query rows, the ``r`` heads' rows flattened
  (row ``i`` of the block is head ``i // n`` of the group at observer row ``i % n``), with the rows'
  absolute positions; used by the row-statistics pass of :mod:`presses.kernels.attention_columns`
  (docs/methods.md §1 step 1, §3 item 1) and the chunk-mass pass of :mod:`presses.kernels.row_masses`
  (docs/methods.md §4).
- :func:`key_tile_scores` and :func:`online_softmax_step` also serve the fused prefill
  (:mod:`presses.kernels.fused_prefill`) and the SNIS decode step (:mod:`presses.kernels.biased_decode`).
- :func:`key_tile_scores`: one tile of raw scores ``q . k^T`` (``(BLOCK_M, BLOCK_N)``, float32 accumulate).
- :func:`online_softmax_step`: one key tile of the online softmax in base 2 (flash attention's update;
  paper 003 eq. 16 and paper 001 eq. 2 need each row's normaliser): the new running maximum, the rescale
  factor of the old partial sums, the tile's unnormalised probabilities and the new running sum. A row
  that has seen no key yet (maximum ``-inf``) gets a sum of 0, not NaN.

Their torch references are those of the kernels that call them (``presses/kernels/references.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["key_tile_scores", "load_group_rows", "online_softmax_step"]


@triton.jit
def load_group_rows(
    q_ptr,
    rows_ptr,
    pid_m,
    b,
    g,
    n_rows,
    sq_b,
    sq_h,
    sq_n,
    sq_d,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Row block ``pid_m`` of KV group ``g`` of batch row ``b``: queries ``(B, H_Q, n, D)`` at ``q_ptr`` with
    strides ``sq_*``, row positions ``(n,)`` int at ``rows_ptr``.

    Returns ``(offs_i, valid, pos, offs_d, mask_d, q)``: the flattened (head-in-group, row) indices
    ``(BLOCK_M,)``, which of them exist, their absolute positions (``-1`` where not), the head-dim offsets
    ``(BLOCK_D,)`` and mask, and the queries ``(BLOCK_M, BLOCK_D)`` (float32 when ``UPCAST``).
    """
    offs_i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (head-in-group, row) index
    valid = offs_i < R * n_rows
    hh = offs_i // n_rows
    u = offs_i % n_rows
    pos = tl.load(rows_ptr + u, mask=valid, other=-1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(
        q_ptr + b * sq_b + (g * R + hh)[:, None] * sq_h + u[:, None] * sq_n + offs_d[None, :] * sq_d,
        mask=valid[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    return offs_i, valid, pos, offs_d, mask_d, q


@triton.jit
def key_tile_scores(q, k_base, offs_n, in_keys, offs_d, mask_d, sk_t, sk_d, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Raw scores ``q . k_j`` ``(BLOCK_M, BLOCK_N)`` of the keys ``offs_n`` (``in_keys``: those that exist; the
    others load as 0) of one KV head at ``k_base`` with strides ``sk_t``, ``sk_d``. ``IEEE``: full-precision
    float32 dot (no TF32)."""
    kt = tl.load(
        k_base + offs_n[None, :] * sk_t + offs_d[:, None] * sk_d, mask=in_keys[None, :] & mask_d[:, None], other=0.0
    )
    if UPCAST:
        kt = kt.to(tl.float32)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return s


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of scores ``s`` ``(BLOCK_M, BLOCK_N)`` (base-2 logits, ``-inf`` where masked) folded into the
    running maximum ``m_i`` and sum ``l_i`` ``(BLOCK_M,)``. Returns ``(m_new, alpha, p, l_new)``:
    ``alpha = 2^(m_i - m_new)`` rescales earlier partial sums, ``p = 2^(s - m_new)``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)
