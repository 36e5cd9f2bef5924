"""Triton: KVzip's reconstruction scores (docs/methods.md §1.18), the column maxima of attention under given log
normalisers, never materialising rows x keys.

``s[g, i] = max_{h in group g, j} w_j c_{h, i} exp(q^h_j . k^g_i * scaling - lse^h_j)`` (KVzip,
https://arxiv.org/abs/2505.23416 section 3.2; KVzip+'s row weights ``w`` and column weights ``c`` optional).
Reference: :func:`presses.core.kvzip_scores.reconstruction_column_maxes`.

Each row's normaliser is given (KVzip's softmax runs over the sinks, the chunk and the repeat tokens; only the chunk
is scored), so :mod:`presses.kernels.attention_columns`'s row-statistics pass is not needed: its column pass
(``_column_kernel`` with ``MAX``) runs alone, with the base-2 normaliser ``lse * log2 e`` as each row's maximum and
the row weight as its coefficient. Every row sees every scored key (the rows' positions are all set to the last key).
The column weights and the max over the group's heads then act on the ``(B, H, c)`` per-head maxima in torch.
Global memory holds the ``(B, H, c)`` maxima and ``O(B H n)`` row statistics.
"""

from __future__ import annotations

import torch

from presses.core.kvzip_scores import check_reconstruction_args
from presses.kernels.attention_columns import _column_kernel, check_query_key_args, row_launch

__all__ = ["reconstruction_column_maxes_triton"]

_LOG2E = 1.4426950408889634
_BLOCK_M, _BLOCK_N = 64, 64  # attention_columns' default tiles


def reconstruction_column_maxes_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    row_weights: torch.Tensor | None = None,
    column_weights: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton KVzip scores under given log normalisers; same contract as
    :func:`presses.core.kvzip_scores.reconstruction_column_maxes`, which it matches to float round-off.

    Args:
        queries: ``(B, H, n, d)`` RoPE'd queries (fp32, bf16 or fp16; any strides).
        keys: ``(B, G, c, d)`` RoPE'd keys to score, same dtype, ``G`` dividing ``H``.
        lse: ``(B, H, n)`` each row's natural-log normaliser (any float dtype).
        scaling: logit scale.
        row_weights: ``(B, n)`` positive row weights (KVzip+: ``1 / ||h_j||``), or None for 1.
        column_weights: ``(B, H, c)`` column weights (KVzip+: ``||W_O^h v_i||``), or None for 1.
        block_m, block_n: row and key tile sizes (default 64 each).

    Returns:
        ``(B, G, c)`` float32.

    Raises:
        ValueError: as :func:`presses.core.kvzip_scores.check_reconstruction_args`, or if the dtypes differ or are
            not float32, bfloat16 or float16 (:func:`presses.kernels.attention_columns.check_query_key_args`).
    """
    B, H, n, d, G, c = check_reconstruction_args(queries, keys, lse, row_weights, column_weights)
    check_query_key_args(queries, keys)
    R = H // G
    if n == 0 or c == 0 or B == 0:
        return torch.zeros(B, G, c, device=keys.device, dtype=torch.float32)
    bm, bn = block_m or _BLOCK_M, block_n or _BLOCK_N
    rows = torch.full((n,), c - 1, device=keys.device, dtype=torch.int32)  # every row sees every key
    launch = row_launch(queries, keys, rows, scaling, bn, 1, 1)
    log2_norm = (lse.float() * _LOG2E).contiguous()  # (B, H, n): the rows' base-2 "maxima"
    if row_weights is None:
        coef = torch.ones(B, H, n, device=keys.device, dtype=torch.float32)
    else:
        coef = row_weights.to(device=keys.device, dtype=torch.float32)[:, None, :].expand(B, H, n).contiguous()
    per_head = torch.zeros(B, H, c, device=keys.device, dtype=torch.float32)
    _column_kernel[(launch.n_kblocks, B * G)](
        queries,
        keys,
        rows,
        coef,  # w_ptr: unread (HAS_W=False); the row weights are in coef
        log2_norm,
        coef,
        per_head,
        n,
        c,
        *queries.stride(),
        *keys.stride(),
        launch.qk_scale,
        G=G,
        R=R,
        D=d,
        HAS_W=False,
        MAX=True,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=launch.bd,
        IEEE=launch.ieee,
        UPCAST=launch.upcast,
        num_warps=launch.num_warps,
    )
    if column_weights is not None:
        per_head = per_head * column_weights.float()
    return per_head.view(B, G, R, c).amax(dim=2)
