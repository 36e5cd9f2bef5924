"""Triton: weighted column sums of causal softmax attention, never materialising rows x keys.

One kernel family serves two presses:

- Page-EntroKV / EntroPrefill observer attention (docs/methods.md §1 step 1, paper 000 sec. 3, paper 001 eq. 2):
  ``a^h[j] = mean_u softmax_j(q_u . k_j / sqrt(d))`` over the last ``W`` queries
  (:func:`window_attention_triton`; reference :func:`presses.core.observer.observer_attention_reference`).
- SNIS proposals (docs/methods.md §3 item 1, paper 003 eqs. 16, 35-36): ``s^h[i] = sum_j w_j softmax_i(q_j . k_i *
scaling)``
  over a block of query rows with row weights ``w`` (the harmonic prior for ``h2o_h`` / ``min_h``)
  (:func:`column_sums_triton`; reference :func:`presses.core.columns.column_sums`).

Query at absolute position ``p`` sees keys ``j <= p``. Two passes over the keys, each row's softmax
normaliser being needed before rows can be summed:

1. ``_row_stats_kernel``: per query row, online-softmax max ``m`` and sum ``l`` (base 2) over its visible
   keys, split over key chunks for parallelism (partials merged in torch: a ``(rows, splits)`` tensor).
2. ``_column_kernel``: per (key block, KV group), for each of the ``r`` query heads and each block of
   rows, ``sum_u w_u exp2(s_uj - m_u) / l_u``; the key tile is loaded once for all heads of the group.

Global memory holds only the ``(B, H_Q, t)`` output and ``O(B H_Q n)`` row statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from presses.core.observer import check_window
from presses.kernels.tiles import key_tile_scores, load_group_rows, online_softmax_step

__all__ = ["check_query_key_args", "column_maxes_triton", "column_sums_triton", "window_attention_triton"]

_LOG2E = 1.4426950408889634
# default tiles, GPU and interpreter alike (the interpreter pays per operation, not per element)
_BLOCK_M, _BLOCK_N = 64, 64


@triton.jit
def _row_stats_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    m_ptr,
    l_ptr,
    n_rows,
    t_keys,
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
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # program: (key split, row block of the group's flattened r*n rows) x (batch, group); the row
    # blocks of one key split are adjacent in launch order, so the split's keys are reused from L2
    pid = tl.program_id(0)
    pid_bg = tl.program_id(1)
    pid_m = pid % n_mblocks
    split = pid // n_mblocks
    b = (pid_bg // G).to(tl.int64)  # 64-bit offsets: caches can exceed 2^31 elements
    g = pid_bg % G

    offs_i, valid, pos, offs_d, mask_d, q = load_group_rows(
        q_ptr, rows_ptr, pid_m, b, g, n_rows, sq_b, sq_h, sq_n, sq_d, R, D, BLOCK_M, BLOCK_D, UPCAST
    )
    k_base = k_ptr + b * sk_b + g * sk_g

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, tl.max(pos, 0) + 1)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s = key_tile_scores(q, k_base, offs_n, offs_n < t_keys, offs_d, mask_d, sk_t, sk_d, IEEE, UPCAST)
        s = tl.where(offs_n[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
        m_i, _, _, l_i = online_softmax_step(s, m_i, l_i)
    out = (pid_bg * R * n_rows + offs_i) * n_split + split
    tl.store(m_ptr + out, m_i, mask=valid)
    tl.store(l_ptr + out, l_i, mask=valid)


@triton.jit
def _column_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    w_ptr,
    m_ptr,
    linv_ptr,
    out_ptr,
    n_rows,
    t_keys,
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
    HAS_W: tl.constexpr,
    MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)  # 64-bit offsets: caches can exceed 2^31 elements
    g = pid_bg % G
    n_start = pid_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < t_keys
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    kt = tl.load(
        k_ptr + b * sk_b + g * sk_g + offs_n[None, :] * sk_t + offs_d[:, None] * sk_d,
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    if UPCAST:
        kt = kt.to(tl.float32)
    for hh in range(R):
        h = g * R + hh
        acc = tl.zeros([BLOCK_N], tl.float32)
        stat = (pid_bg * R + hh) * n_rows
        for m_start in range(0, n_rows, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            mask_m = offs_m < n_rows
            pos = tl.load(rows_ptr + offs_m, mask=mask_m, other=-1)
            if tl.max(pos, 0) >= n_start:  # some row of the block sees some key of the tile
                q = tl.load(
                    q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :] * sq_d,
                    mask=mask_m[:, None] & mask_d[None, :],
                    other=0.0,
                )
                if UPCAST:
                    q = q.to(tl.float32)
                m_r = tl.load(m_ptr + stat + offs_m, mask=mask_m, other=0.0)
                coef = tl.load(linv_ptr + stat + offs_m, mask=mask_m, other=0.0)  # w_u / l_u
                if HAS_W:
                    coef = coef * tl.load(w_ptr + offs_m, mask=mask_m, other=0.0)
                if IEEE:
                    s = tl.dot(q, kt, input_precision="ieee")
                else:
                    s = tl.dot(q, kt)
                s = tl.where(offs_n[None, :] <= pos[:, None], s * qk_scale - m_r[:, None], float("-inf"))
                if MAX:  # the column max of the weighted rows (KVzip's importance per head)
                    acc = tl.maximum(acc, tl.max(tl.exp2(s) * coef[:, None], 0))
                else:
                    acc += tl.sum(tl.exp2(s) * coef[:, None], 0)  # padded rows: pos = -1, coef = 0
        tl.store(out_ptr + (b * G * R + h) * t_keys + offs_n, acc, mask=mask_n)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass(frozen=True)
class RowLaunch:
    """Host-side launch settings of the observer-row kernels (this module's row statistics and
    :mod:`presses.kernels.row_masses`), from :func:`row_launch`.

    Attributes:
        qk_scale: the logit scale times ``log2 e`` (the kernels work in base 2).
        bd: the head-dimension tile size.
        ieee: float32 inputs multiply in IEEE precision (no TF32).
        upcast: bfloat16 tiles are upcast before ``tl.dot`` (the Triton interpreter, which runs the kernels off
            CUDA, multiplies them as raw uint16; the upcast is exact).
        num_warps: warps per program.
        n_kblocks, chunk, num_splits: key tiles up to the last visible key, keys per split, and the number of
            splits of the row-statistics pass.
    """

    qk_scale: float
    bd: int
    ieee: bool
    upcast: bool
    num_warps: int
    n_kblocks: int
    chunk: int
    num_splits: int


def row_launch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    scaling: float | None,
    bn: int,
    num_splits: int | None,
    programs: int,
) -> RowLaunch:
    """The launch settings of an observer-row kernel over ``queries`` ``(B, H_Q, n, d)`` and ``keys``.

    Args:
        rows: ``(n,)`` the rows' absolute positions (keys after the last one are never visible).
        scaling: logit scale, default ``d ** -0.5``.
        bn: the key tile size (the caller's, or its kernel's default).
        num_splits: the caller's override (``None``: by device; the interpreter uses one split).
        programs: the programs per key split besides the splits themselves (row blocks x batch x groups x ...),
            against which the splits fill about four waves of the GPU's multiprocessors.
    """
    d = queries.shape[-1]
    interpreting = not keys.is_cuda
    bd = max(16, triton.next_power_of_2(d))
    n_kblocks = triton.cdiv(int(rows.max()) + 1, bn)
    if num_splits is None and interpreting:
        num_splits = 1
    if num_splits is None:
        num_splits = max(1, min(n_kblocks, 4 * _num_sms(keys.device) // max(1, programs)))
    chunk = triton.cdiv(n_kblocks, num_splits) * bn
    return RowLaunch(
        qk_scale=(d**-0.5 if scaling is None else float(scaling)) * _LOG2E,
        bd=bd,
        ieee=queries.dtype == torch.float32,
        upcast=interpreting and queries.dtype == torch.bfloat16,
        num_warps=4 if bd <= 64 else 8,
        n_kblocks=n_kblocks,
        chunk=chunk,
        num_splits=triton.cdiv(n_kblocks * bn, chunk),
    )


def check_query_key_args(queries: torch.Tensor, keys: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """The shapes of observer queries ``(B, H_Q, n, d)`` against a GQA key cache ``(B, G, t, d)``, checked for the
    row-scoring kernels (this module's and :mod:`presses.kernels.row_masses`).

    Returns:
        ``(B, H_Q, n, d, G, t)``.

    Raises:
        ValueError: if the key shape does not match, ``G`` does not divide ``H_Q``, the dtypes differ, or the
            dtype is not float32, bfloat16 or float16.
    """
    B, HQ, n, d = queries.shape
    if keys.dim() != 4 or keys.shape[0] != B or keys.shape[3] != d:
        raise ValueError(
            f"keys of shape {tuple(keys.shape)} do not match queries {tuple(queries.shape)} (expected (B, G, t, d))"
        )
    G, t = keys.shape[1], keys.shape[2]
    if HQ % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={HQ}")
    if queries.dtype != keys.dtype:
        raise ValueError(f"queries dtype {queries.dtype} differs from keys dtype {keys.dtype}")
    if queries.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {queries.dtype} is not supported (float32, bfloat16, float16)")
    return B, HQ, n, d, G, t


def column_sums_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scaling: float | None = None,
    row_scale: float = 1.0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    reduce: str = "sum",
) -> torch.Tensor:
    """Triton weighted column sums of causal softmax attention (paper 003 eqs. 16, 36; docs/methods.md §3 item 1).

    ``s^h[i] = row_scale * sum_u w_u softmax_i(q^h_u . k_i * scaling) [i <= pos_u]``; same contract as
    :func:`presses.core.columns.column_sums` (which it matches to float round-off), plus ``row_scale``.

    Args:
        queries: ``(B, H_Q, n, d)`` RoPE'd queries (fp32, bf16 or fp16; any strides).
        keys: ``(B, G, t, d)`` RoPE'd keys, same dtype, ``G`` dividing ``H_Q``.
        row_weights: ``(n,)`` row weights ``w_u`` or ``None`` for 1.
        rows: ``(n,)`` absolute positions of the rows in ``[0, t)`` (any order); default ``t - n .. t - 1``.
        scaling: logit scale, default ``d ** -0.5``.
        row_scale: a constant factor on every row weight (``1 / W`` gives the observer mean).
        block_m, block_n, num_splits: tile sizes and key splits of pass 1 (defaults by device).
        reduce: ``"sum"``, or ``"max"`` over the weighted rows (:func:`column_maxes_triton`).

    Returns:
        ``(B, H_Q, t)`` float32.

    Raises:
        ValueError: if ``G`` does not divide ``H_Q``, ``n > t``, shapes or dtypes disagree, a row
            position is outside ``[0, t)``, or ``reduce`` is unknown.
    """
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce={reduce!r} is not 'sum' or 'max'")
    B, HQ, n, d, G, t = check_query_key_args(queries, keys)
    R = HQ // G
    out = torch.zeros(B, HQ, t, device=keys.device, dtype=torch.float32)
    if n == 0 or t == 0 or B == 0:
        return out
    if rows is None:
        if n > t:
            raise ValueError(f"n={n} query rows exceed t={t} keys")
        rows = torch.arange(t - n, t, device=keys.device)
    if rows.shape != (n,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, expected ({n},)")
    if int(rows.min()) < 0 or int(rows.max()) >= t:
        raise ValueError(f"row positions must lie in [0, t={t}), got [{int(rows.min())}, {int(rows.max())}]")
    rows = rows.to(device=keys.device, dtype=torch.int32).contiguous()
    if row_weights is not None:
        if row_weights.shape != (n,):
            raise ValueError(f"row_weights has shape {tuple(row_weights.shape)}, expected ({n},)")
        row_weights = row_weights.to(device=keys.device, dtype=torch.float32).contiguous()
    # pass 1: per-row softmax statistics, split over key chunks
    bm, bn = block_m or _BLOCK_M, block_n or _BLOCK_N
    n_mblocks = triton.cdiv(R * n, bm)
    launch = row_launch(queries, keys, rows, scaling, bn, num_splits, n_mblocks * B * G)
    qk_scale, bd, ieee, upcast, num_warps = launch.qk_scale, launch.bd, launch.ieee, launch.upcast, launch.num_warps
    n_kblocks, chunk, num_splits = launch.n_kblocks, launch.chunk, launch.num_splits
    m_part = torch.empty(B * HQ * n, num_splits, device=keys.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    _row_stats_kernel[(n_mblocks * num_splits, B * G)](
        queries,
        keys,
        rows,
        m_part,
        l_part,
        n,
        t,
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
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=num_warps,
    )
    m_row = m_part.amax(-1)  # every row sees key 0, so m_row is finite
    l_row = (l_part * torch.exp2(m_part - m_row.unsqueeze(-1))).sum(-1)
    coef = row_scale / l_row

    # pass 2: column accumulation, one key tile per program shared by the r heads of its group (the
    # invisible tail keeps the zeros of `out`)
    _column_kernel[(n_kblocks, B * G)](
        queries,
        keys,
        rows,
        row_weights if row_weights is not None else coef,
        m_row,
        coef,
        out,
        n,
        t,
        *queries.stride(),
        *keys.stride(),
        qk_scale,
        G=G,
        R=R,
        D=d,
        HAS_W=row_weights is not None,
        MAX=reduce == "max",
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=num_warps,
    )
    return out


def column_maxes_triton(
    queries: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None, scaling: float | None = None, **blocks
) -> torch.Tensor:
    """Triton column maxima of causal softmax attention (KVzip's importance per query head); same contract as
    :func:`presses.core.columns.column_maxes`, which it matches to float round-off. ``blocks``: ``block_m``,
    ``block_n``, ``num_splits`` of :func:`column_sums_triton`, whose two passes it shares (the second keeps the max
    of each key's probabilities instead of their sum)."""
    return column_sums_triton(queries, keys, None, rows, scaling, reduce="max", **blocks)


def window_attention_triton(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float | None = None, **blocks
) -> torch.Tensor:
    """Triton observer-averaged causal window attention (docs/methods.md §1 step 1; paper 000 sec. 3).

    ``a^h[j] = mean_u softmax_j(q_u . k_j * scaling)`` over the last ``W`` queries (query ``u`` at
    position ``T - W + u`` sees keys ``j <= T - W + u``). Same contract as
    :func:`presses.core.observer.observer_attention_reference`.

    Args:
        queries: ``(B, H_Q, W, d)`` RoPE'd window queries.
        keys: ``(B, G, T, d)`` RoPE'd keys.
        scaling: logit scale (the module's ``scaling``), default ``1 / sqrt(d)``.
        blocks: optional ``block_m``, ``block_n``, ``num_splits`` (see :func:`column_sums_triton`).

    Returns:
        ``(B, H_Q, T)`` float32; each row sums to 1.

    Raises:
        ValueError: if ``W`` is outside ``[1, T]`` or ``G`` does not divide ``H_Q``.
    """

    W, T = queries.shape[2], keys.shape[2]
    check_window(W, T)
    scaling = 1.0 / math.sqrt(queries.shape[-1]) if scaling is None else scaling
    return column_sums_triton(queries, keys, None, None, scaling, 1.0 / W, **blocks)
