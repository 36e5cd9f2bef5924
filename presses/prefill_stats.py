"""Causal prefill attention that also returns the column sums of its attention matrix (paper 003 eqs. 16, 36).

The all-row proposals of probabilistic eviction (``h2o``, ``h2o_h``, ``min_h``; paper 003 appendix H) need
``s^h[i] = sum_j w_j p^h_j(i)``, the row-weighted column sums of every prompt row's causal attention ``p^h_j``
(``w = 1`` for H2O's score, eq. 16; ``w = h`` the harmonic prior, eq. 36). The prefill computes every ``p^h_j``
anyway; :func:`attention_with_column_sums` returns the layer's attention output and these sums from one pass
over the keys, so the press does not recompute ``Q K^T`` after the prefill (:mod:`presses.prefill_attention`
wires it into the model; :func:`presses.kernels.attention_with_column_sums` is the dispatch point, Triton on
CUDA, this torch implementation elsewhere).

Algorithm (exact softmax, no online rescaling). The query rows are cut into blocks of ``block_size`` rows. The
rows ``st .. e-1`` of a block see the keys ``0 .. e-1``, so ``S = scaling * Q_blk K[:e]^T`` (causal mask on its
last ``e - st`` columns) holds every logit of those rows: one row softmax gives the block's attention rows ``P``
exactly, then ``out_blk = P V[:e]`` and ``s[:e] += w_blk^T P``. Per block: two matrix products, one in-place
softmax and one matrix-vector product; the ``r`` query heads of a KV group are stacked as extra rows against the
group's keys (no ``repeat_kv``). Work: the causal ``Q K^T`` and ``P V`` of a prefill, plus the column sums.
Everything is computed in float32 (inputs upcast), the output cast back to the query's dtype.

Threads. The blocks are shared among ``num_workers`` Python threads (torch's intra-op thread count by default),
each running its ops single-threaded (torch's intra-op thread count is set to 1 for the duration of the call and
restored afterwards; torch releases the GIL inside its ops). Per-op parallel regions would synchronise all
threads several times per block, which costs far more than the work on a shared or busy machine; one join per
call does not. Each worker sums its own column partials; they are added in worker order, so for a given
``num_workers`` the result is deterministic.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["attention_with_column_sums", "check_prefill_attention_args"]

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def check_prefill_attention_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 row_weights: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Validate the shapes of :func:`attention_with_column_sums`; returns ``(B, H_Q, G, T, d)``.

    Raises:
        ValueError: naming the offending shape (queries and keys must cover the same ``T`` positions: a prefill
            from an empty cache).
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                         "must be 4-d: (B, H_Q, T, d), (B, G, T, d), (B, G, T, d_v)")
    B, HQ, T, d = query.shape
    if key.shape[0] != B or key.shape[2] != T or key.shape[3] != d:
        raise ValueError(f"key of shape {tuple(key.shape)} does not match query {tuple(query.shape)}: expected "
                         f"(B={B}, G, T={T}, d={d}) (the whole prefill, from position 0)")
    G = key.shape[1]
    if G < 1 or HQ % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={HQ}")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value of shape {tuple(value.shape)} does not match key {tuple(key.shape)} on (B, G, T)")
    if row_weights is not None and tuple(row_weights.shape) != (T,):
        raise ValueError(f"row_weights has shape {tuple(row_weights.shape)}, expected ({T},)")
    return B, HQ, G, T, d


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="prefill_stats")
            _pool_size = size
        return _pool


def _assign_blocks(T: int, block_size: int, num_workers: int) -> list[list[int]]:
    """Block starts per worker, balanced by cost (a block ending at ``e`` costs ``~e``), largest first."""
    loads = [0] * num_workers
    assigned: list[list[int]] = [[] for _ in range(num_workers)]
    for start in reversed(range(0, T, block_size)):
        i = loads.index(min(loads))
        assigned[i].append(start)
        loads[i] += min(start + block_size, T)
    return [a for a in assigned if a]


def _attend_blocks(q, k, v, w, out, acc, starts, block_size, scaling, inference):
    """One worker: for each block start, ``out[.., st:e] = P V[:e]`` and ``acc[.., :e] += w^T P`` (see the module
    docstring). ``q (B, G, r, T, d)`` any dtype; ``k (B, G, T, d)`` / ``v (B, G, T, d_v)`` float32; ``out`` a
    ``(B, G, r, T, d_v)`` view in the output dtype; ``acc (B, G, r, T)`` float32, this worker's own."""
    B, G, r, T, d = q.shape
    kt = k.transpose(-1, -2)
    with torch.inference_mode(inference), torch.no_grad():
        buf = torch.empty(B * G * r * block_size * T, dtype=torch.float32, device=k.device)
        future = torch.ones(block_size, block_size, dtype=torch.bool, device=k.device).triu_(1)
        for start in starts:
            end = min(start + block_size, T)
            n = end - start
            logits = buf[: B * G * r * n * end].view(B, G, r * n, end)
            rows = (q[:, :, :, start:end].float() * scaling).reshape(B, G, r * n, d)
            torch.matmul(rows, kt[..., :end], out=logits)
            logits.view(B, G, r, n, end)[..., start:end].masked_fill_(future[:n, :n], float("-inf"))
            probs = torch.softmax(logits, dim=-1, out=logits)  # in place: the block's exact attention rows
            out[:, :, :, start:end] = torch.matmul(probs, v[:, :, :end]).view(B, G, r, n, -1)
            probs = probs.view(B, G, r, n, end)
            if w is None:
                acc[..., :end] += probs.sum(-2)
            else:
                acc[..., :end] += torch.matmul(w[start:end].view(1, n), probs).squeeze(-2)


def attention_with_column_sums(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               row_weights: torch.Tensor | None = None, scaling: float | None = None,
                               block_size: int = 64, num_workers: int | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill and the row-weighted column sums of its attention matrix, in one pass.

    ``out^h_j = sum_{i<=j} p^h_j(i) v_i`` and ``s^h[i] = sum_{j>=i} w_j p^h_j(i)`` with
    ``p^h_j = softmax_i(q^h_j . k_i * scaling)`` over ``i <= j`` (paper 003 eq. 16, eq. 36 with ``w`` the
    harmonic prior); query head ``h`` uses KV group ``h // r``. ``out`` equals transformers' ``sdpa`` attention
    of the layer (causal, no mask) and ``s`` equals :func:`presses.proposals.column_sums` over all rows, both to
    float32 round-off. Torch implementation of the dispatch :func:`presses.kernels.attention_with_column_sums`
    (algorithm and threads: module docstring).

    Args:
        query: ``(B, H_Q, T, d)`` RoPE'd queries of positions ``0 .. T-1`` (any float dtype and strides).
        key: ``(B, G, T, d)`` RoPE'd keys, ``G`` dividing ``H_Q``.
        value: ``(B, G, T, d_v)`` values.
        row_weights: ``(T,)`` row weights ``w_j`` or ``None`` for 1.
        scaling: logit scale, default ``d ** -0.5``.
        block_size: query rows per block, ``>= 1``; peak extra memory ``~ 4 B H_Q block_size T`` bytes per worker.
        num_workers: worker threads, ``>= 1``; default ``torch.get_num_threads()``.

    Returns:
        ``(out, s)``: ``out (B, H_Q, T, d_v)`` in ``query.dtype`` (a transposed view of a contiguous
        ``(B, T, H_Q, d_v)`` tensor, transformers' attention-output layout) and ``s (B, H_Q, T)`` float32.

    Raises:
        ValueError: on inconsistent shapes (:func:`check_prefill_attention_args`), ``block_size < 1`` or
            ``num_workers < 1``.
    """
    B, HQ, G, T, d = check_prefill_attention_args(query, key, value, row_weights)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    workers = torch.get_num_threads() if num_workers is None else int(num_workers)
    if workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    r, dv = HQ // G, value.shape[-1]
    scaling = d ** -0.5 if scaling is None else float(scaling)
    out = torch.empty(B, T, HQ, dv, dtype=query.dtype, device=query.device)
    sums = torch.zeros(B, G, r, T, dtype=torch.float32, device=query.device)
    if T == 0 or B == 0:
        return out.transpose(1, 2), sums.view(B, HQ, T)
    q = query.unflatten(1, (G, r))  # a view whatever the strides
    k, v = key.float(), value.float()
    w = None if row_weights is None else row_weights.to(device=query.device, dtype=torch.float32)
    out_view = out.view(B, T, G, r, dv).permute(0, 2, 3, 1, 4)  # (B, G, r, T, d_v)
    plan = _assign_blocks(T, block_size, min(workers, -(-T // block_size)))
    inference = torch.is_inference_mode_enabled()
    if len(plan) == 1:
        _attend_blocks(q, k, v, w, out_view, sums, plan[0], block_size, scaling, inference)
        return out.transpose(1, 2), sums.view(B, HQ, T)
    threads = torch.get_num_threads()
    partials = [sums] + [torch.zeros_like(sums) for _ in plan[1:]]
    torch.set_num_threads(1)
    try:
        pool = _get_pool(len(plan))
        jobs = [pool.submit(_attend_blocks, q, k, v, w, out_view, acc, starts, block_size, scaling, inference)
                for acc, starts in zip(partials, plan)]
        for job in jobs:
            job.result()
    finally:
        torch.set_num_threads(threads)
    for acc in partials[1:]:
        sums += acc
    return out.transpose(1, 2), sums.view(B, HQ, T)
