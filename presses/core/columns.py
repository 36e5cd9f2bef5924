"""Weighted column sums of causal softmax attention for a block of query rows (torch reference).

The statistic behind the H2O-style proposals of probabilistic eviction (paper 003 eqs. 16, 36;
docs/methods.md §3 item 1) and the observer average over many prompt queries. The kernel dispatch
:func:`presses.kernels.column_sums` picks this reference off CUDA and the Triton kernel on CUDA.
"""

from __future__ import annotations

import torch

from presses.core.observer import softcap_logits

__all__ = ["column_maxes", "column_sums", "harmonic_prior"]


def column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    reduce: str = "sum",
) -> torch.Tensor:
    """Weighted column sums of causal softmax attention for one block of query rows.

    ``s^h[i] = sum_{j in block} w_j softmax_i(q^h_j . k_i * scaling) [i <= pos_j]`` (paper 003 eq. 16
    with row weights; ``w = 1`` is H2O's score, ``w = h`` the harmonic marginal of eq. 36).

    Args:
        queries: ``(B, H_Q, n, d)`` RoPE'd queries of the block rows.
        keys: ``(B, G, t, d)`` RoPE'd keys, ``G`` dividing ``H_Q``.
        row_weights: ``(n,)`` weights of the rows, or ``None`` for 1.
        rows: ``(n,)`` absolute positions of the rows (query at position ``p`` sees keys ``<= p``);
            default the last ``n`` positions ``t - n .. t - 1``.
        scaling: logit scale, default ``d ** -0.5``.
        softcap: the attention soft-cap applied to the scaled logits (Gemma2), or None.
        reduce: ``"sum"``, or ``"max"`` over the weighted rows (:func:`column_maxes`).

    Returns:
        ``(B, H_Q, t)`` float32.

    Raises:
        ValueError: if ``G`` does not divide ``H_Q``, a row position is outside ``[0, t)`` or ``reduce`` is unknown.
    """
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce={reduce!r} is not 'sum' or 'max'")
    B, HQ, n, d = queries.shape
    G, t = keys.shape[1], keys.shape[2]
    if HQ % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={HQ}")
    r = HQ // G
    if rows is None:
        rows = torch.arange(t - n, t, device=keys.device)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= t):
        raise ValueError(f"row positions must lie in [0, t={t}), got [{int(rows.min())}, {int(rows.max())}]")
    scaling = d**-0.5 if scaling is None else scaling
    end = int(rows.max()) + 1 if rows.numel() else 0  # keys beyond the last row are never visible
    q = queries.float().reshape(B, G, r * n, d)
    logits = torch.matmul(q, keys[:, :, :end].float().transpose(-1, -2)).mul_(scaling)  # (B, G, r*n, end)
    logits = softcap_logits(logits, softcap).view(B, G, r, n, end)
    # in place and only where some row cannot see (the keys before the first row's are seen by every row): the
    # (B, G, r, n, end) logits are the bulk of the memory and time, so no masked copy of them is made
    seen = int(rows.min()) + 1 if rows.numel() else end
    if seen < end:
        future = torch.arange(seen, end, device=keys.device).view(1, end - seen) > rows.view(n, 1)
        logits[..., seen:].masked_fill_(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if row_weights is not None:
        probs = probs * row_weights.float().view(n, 1)
    out = (probs.sum(dim=-2) if reduce == "sum" else probs.amax(dim=-2)).reshape(B, HQ, end)
    return torch.nn.functional.pad(out, (0, t - end))


def column_maxes(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Column maxima of causal softmax attention for one block of query rows.

    ``s^h[i] = max_{j in block, pos_j >= i} softmax_i(q^h_j . k_i * scaling)``: the most attention any row pays key
    ``i`` (KVzip's importance per query head, https://arxiv.org/abs/2505.23416 section 3.2, before its max over the
    group's heads). Keys no row sees score 0.

    Args:
        queries: ``(B, H_Q, n, d)`` RoPE'd queries of the block rows.
        keys: ``(B, G, t, d)`` RoPE'd keys, ``G`` dividing ``H_Q``.
        rows: ``(n,)`` absolute positions of the rows (query at position ``p`` sees keys ``<= p``);
            default the last ``n`` positions ``t - n .. t - 1``.
        scaling: logit scale, default ``d ** -0.5``.
        softcap: the attention soft-cap applied to the scaled logits (Gemma2), or None.

    Returns:
        ``(B, H_Q, t)`` float32 in ``[0, 1]``.

    Raises:
        ValueError: if ``G`` does not divide ``H_Q`` or a row position is outside ``[0, t)``.
    """
    return column_sums(queries, keys, None, rows, scaling, softcap, reduce="max")


def harmonic_prior(t: int, device=None) -> torch.Tensor:
    """Harmonic prior over the prompt rows, ``h_j = 1 / ((t - j + 1) H_t)`` (paper 003 eq. 35).

    Args:
        t: number of rows (prompt length), ``>= 1``.
        device: torch device of the result.

    Returns:
        ``(t,)`` float32 summing to 1; row ``j`` (0-based ``j - 1``) gets ``1 / ((t - j + 1) H_t)``,
        so the last row has the largest weight ``1 / H_t``.

    Raises:
        ValueError: if ``t < 1``.
    """
    if t < 1:
        raise ValueError(f"t={t} must be >= 1")
    inv = 1.0 / torch.arange(t, 0, -1, device=device, dtype=torch.float64)  # 1/t, ..., 1/2, 1
    return (inv / inv.sum()).float()
