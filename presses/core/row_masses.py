"""Per-row chunk masses of causal softmax attention (torch reference): what EntroPrefill consumes from its rows.

Paper 001 Algorithm 1 reads the attention rows of a few prompt positions (eq. 1) in two ways: the proposal
observers' rows through their per-head average (eq. 2, the input of eqs. 3-9) and through each row's mass on
each candidate chunk (the constraints of eq. 14), and the audit observers' rows through their mass on the
removal set (eq. 17), a sum of chunk masses. docs/methods.md §4 steps 2, 4 and 5. The kernel dispatch
:func:`presses.kernels.row_chunk_masses` picks this reference off CUDA and the Triton kernel
(:mod:`presses.kernels.row_masses`, which never stores a row in global memory) on CUDA.
"""

from __future__ import annotations

import torch

from presses.core.observer import softcap_logits

__all__ = ["chunk_ids", "chunk_masses_from_rows", "row_chunk_masses_reference", "check_chunk_ids"]


def chunk_ids(n_tokens: int, chunks, device=None) -> torch.Tensor:
    """The chunk of every token: ``(T,)`` int32, ``i`` for the tokens of ``chunks[i]``, ``-1`` elsewhere.

    Args:
        n_tokens: ``T``.
        chunks: ``k`` disjoint token ranges ``[start, end)`` inside ``[0, T)``.

    Raises:
        ValueError: for a range outside ``[0, T)`` or overlapping ranges.
    """
    ids = torch.full((n_tokens,), -1, dtype=torch.int32)
    for i, (s, e) in enumerate(chunks):
        if not 0 <= s <= e <= n_tokens:
            raise ValueError(f"chunk {i} = [{s}, {e}) is outside [0, T={n_tokens})")
        if bool((ids[s:e] >= 0).any()):
            raise ValueError(f"chunk {i} = [{s}, {e}) overlaps another chunk")
        ids[s:e] = i
    return ids.to(device) if device is not None else ids


def check_chunk_ids(ids: torch.Tensor, n_tokens: int, num_chunks: int) -> None:
    """Raise ``ValueError`` unless ``ids`` is ``(T,)`` with values in ``[-1, num_chunks)``."""
    if ids.shape != (n_tokens,):
        raise ValueError(f"chunk ids have shape {tuple(ids.shape)}, expected ({n_tokens},) (one per key)")
    if num_chunks < 0:
        raise ValueError(f"num_chunks={num_chunks} must be >= 0")
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= num_chunks):
        raise ValueError(
            f"chunk ids must lie in [-1, num_chunks={num_chunks}), got [{int(ids.min())}, {int(ids.max())}]"
        )


def chunk_masses_from_rows(rows: torch.Tensor, ids: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Mass of every row on every chunk: ``m[..., u, i] = sum_{j : ids[j] = i} rows[..., u, j]``.

    Args:
        rows: ``(..., n, T)`` attention rows.
        ids: ``(T,)`` chunk of every key (``-1``: no chunk), e.g. :func:`chunk_ids`.
        num_chunks: ``k``.

    Returns:
        ``(..., n, k)`` float32.

    Raises:
        ValueError: as :func:`check_chunk_ids`.
    """
    check_chunk_ids(ids, rows.shape[-1], num_chunks)
    inside = ids >= 0
    out = rows.new_zeros(*rows.shape[:-1], num_chunks, dtype=torch.float32)
    return out.index_add_(-1, ids[inside].long(), rows[..., inside].float())


def row_chunk_masses_reference(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor,
    num_chunks: int,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk masses of causal attention rows, and optionally their weighted average (paper 001 eqs. 1-2, 14, 17).

    Row ``u`` of head ``h`` is ``A^h_u = softmax_j(q^h_u . k_j * scaling)`` over the keys ``j <= rows[u]``;
    its mass on chunk ``i`` is ``m[h, u, i] = sum_{j : ids[j] = i} A^h_u[j]``, and the weighted average is
    ``a^h[j] = sum_u w_u A^h_u[j]`` (``w = 1/W`` gives eq. 2's observer average).

    Args:
        queries: ``(B, H_Q, n, d)`` RoPE'd queries of the rows.
        keys: ``(B, G, t, d)`` RoPE'd keys, ``G`` dividing ``H_Q`` (query head ``h`` reads group ``h // r``).
        rows: ``(n,)`` absolute positions of the rows in ``[0, t)``, any order.
        ids: ``(t,)`` int chunk of every key, ``-1`` for keys in no chunk (:func:`chunk_ids`).
        num_chunks: ``k``.
        row_weights: ``(n,)`` weights ``w_u`` of the average, or ``None``: no average.
        scaling: logit scale, default ``d ** -0.5``.
        softcap: the attention soft-cap applied to the scaled logits (Gemma2), or None.

    Returns:
        ``(masses (B, H_Q, n, k), average (B, H_Q, t) or None)``, float32.

    Raises:
        ValueError: if ``G`` does not divide ``H_Q``, a row position is outside ``[0, t)``, or the chunk ids
            or row weights have the wrong shape or range.
    """
    B, HQ, n, d = queries.shape
    G, t = keys.shape[1], keys.shape[2]
    if HQ % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={HQ}")
    if rows.shape != (n,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, expected ({n},)")
    if n and (int(rows.min()) < 0 or int(rows.max()) >= t):
        raise ValueError(f"row positions must lie in [0, t={t}), got [{int(rows.min())}, {int(rows.max())}]")
    check_chunk_ids(ids, t, num_chunks)
    if row_weights is not None and row_weights.shape != (n,):
        raise ValueError(f"row_weights has shape {tuple(row_weights.shape)}, expected ({n},)")
    scaling = d**-0.5 if scaling is None else scaling
    r = HQ // G
    q = queries.float().reshape(B, G, r * n, d)
    logits = softcap_logits(torch.matmul(q, keys.float().transpose(-1, -2)) * scaling, softcap).reshape(B, HQ, n, t)
    future = torch.arange(t, device=keys.device).view(1, t) > rows.to(keys.device).view(n, 1)
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)  # (B, H_Q, n, t)
    masses = chunk_masses_from_rows(probs, ids.to(keys.device), num_chunks)
    average = None
    if row_weights is not None:
        average = (probs * row_weights.to(probs).view(n, 1)).sum(-2)
    return masses, average
