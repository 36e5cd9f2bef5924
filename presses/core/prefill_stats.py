"""Causal prefill attention that also returns the column sums of its attention matrix (paper 003 eqs. 16, 36).

The all-row proposals of probabilistic eviction (``h2o``, ``h2o_h``, ``min_h``; paper 003 appendix H) need
``s^h[i] = sum_j w_j p^h_j(i)``, the row-weighted column sums of every prompt row's causal attention ``p^h_j``
(``w = 1`` for H2O's score, eq. 16; ``w = h`` the harmonic prior, eq. 36). The prefill computes every ``p^h_j``
anyway; :func:`attention_with_column_sums` returns the layer's attention output together with these sums, so the
press does not recompute the queries and ``Q K^T`` after the prefill (:mod:`presses.probabilistic.prefill_attention`
wires it
into the model; :func:`presses.kernels.attention_with_column_sums` is the dispatch point, Triton on CUDA, this
torch implementation elsewhere).

Algorithm (two passes over the keys; a column sum needs each row's final softmax normaliser):

1. :func:`causal_attention_lse`: the attention output and each row's log-sum-exp ``lse_j`` from torch's fused
   CPU flash-attention kernel, the very kernel transformers' ``sdpa`` runs for a causal prefill, so the output
   is bit for bit the one the model computes without the press (the rest of the prefill is unchanged);
2. :func:`column_sums_from_lse`: ``p_j(i) = exp(q_j . k_i * scaling - lse_j)`` exactly, so the column sums need
   no softmax: the rows are cut into blocks of ``block_size``; a block's rows ``st .. e-1`` see the keys
   ``0 .. e-1``, taken in chunks of :data:`TILE_ELEMENTS` logits; per chunk ``S = scaling Q_blk K_chunk^T +
   (log w - lse)_blk`` (one matrix product: the bias is a last coordinate, ``[scaling q_j, b_j] . [k_i, 1]``),
   ``S <- exp(S)`` in place, the causal mask applied (entries of keys after their row set to 0) and
   ``s[chunk] += sum_rows S``: the product and two cache-resident passes over ``S``; the ``r`` query heads of a
   KV group are stacked as extra rows against the group's keys. Every visible entry of ``S`` is at most ``log w_j``
   (``lse_j`` bounds
   the row's logits), so ``exp`` cannot overflow there; a masked entry may overflow to ``inf`` before it is set
   to 0 (never multiplied, so no NaN).

Pass 2 does the causal ``Q K^T`` of the prefill a second time (not ``P V``); it is computed in float32 (inputs
upcast). It runs on ``num_workers`` Python threads (torch's intra-op thread count by default), each running its
ops single-threaded: torch's intra-op thread count is set to 1 for the duration of the pass and restored
afterwards (torch releases the GIL inside its ops). Per-op parallel regions would synchronise all threads
several times per block, which costs far more than the work on a shared or busy machine; one join per call does
not. Each worker sums its own column partials; they are added in worker order, so the result is deterministic
for a given ``num_workers``.

An earlier variant computed ``P`` by a blocked softmax and the output as ``P V`` in the same pass (about 1.15x
the fused kernel's time instead of ~1.6x here, one thread, T = 2k-4k, SmolLM2-135M's heads), but its output differs
from ``sdpa``'s in the last bits and
30 layers amplify that to relative proposal differences of ``1e-5 .. 1e-4``, enough to change some multinomial
draws of the press for a fixed seed; with the fused kernel's own output they stay at ``~1e-6``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["attention_with_column_sums", "causal_attention_lse", "check_prefill_attention_args", "column_sums_from_lse"]

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def check_prefill_attention_args(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row_weights: torch.Tensor | None
) -> tuple[int, int, int, int, int]:
    """Validate the shapes of :func:`attention_with_column_sums`; returns ``(B, H_Q, G, T, d)``.

    Raises:
        ValueError: naming the offending shape (queries and keys must cover the same ``T`` positions: a prefill
            from an empty cache).
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
            "must be 4-d: (B, H_Q, T, d), (B, G, T, d), (B, G, T, d_v)"
        )
    B, HQ, T, d = query.shape
    if key.shape[0] != B or key.shape[2] != T or key.shape[3] != d:
        raise ValueError(
            f"key of shape {tuple(key.shape)} does not match query {tuple(query.shape)}: expected "
            f"(B={B}, G, T={T}, d={d}) (the whole prefill, from position 0)"
        )
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


def causal_attention_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill and each row's natural log-sum-exp (pass 1 of the module docstring).

    On CPU: torch's fused flash-attention kernel, the one ``torch.nn.functional.scaled_dot_product_attention``
    (and so transformers' ``sdpa``) runs for ``is_causal=True`` without a mask: the output is identical to the
    model's own. Elsewhere (or if that kernel is unavailable): ``scaled_dot_product_attention`` for the output and
    a blocked ``logsumexp`` for ``lse``.

    Args:
        query: ``(B, H_Q, T, d)``; key: ``(B, G, T, d)``; value: ``(B, G, T, d_v)``; ``G`` dividing ``H_Q``.
        scaling: logit scale, default ``d ** -0.5``.

    Returns:
        ``out (B, H_Q, T, d_v)`` in the query dtype and ``lse (B, H_Q, T)`` float32,
        ``lse_j = log sum_{i<=j} exp(q_j . k_i * scaling)``.
    """
    d = query.shape[-1]
    scaling = d**-0.5 if scaling is None else float(scaling)
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if query.device.type == "cpu" and flash is not None and query.shape[-1] == value.shape[-1]:
        try:
            out, lse = flash(query, key, value, 0.0, True, scale=scaling)
            return out, lse.float()
        except RuntimeError:  # e.g. an older torch without GQA in this kernel: the generic path below
            pass
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=True
    )
    B, HQ, T, _ = query.shape
    G = key.shape[1]
    r = HQ // G
    lse = torch.empty(B, G, r, T, dtype=torch.float32, device=query.device)
    kt = key.float().transpose(-1, -2)
    q = query.unflatten(1, (G, r))
    for start in range(0, T, 128):
        end = min(start + 128, T)
        logits = torch.matmul(q[:, :, :, start:end].float() * scaling, kt.unsqueeze(2)[..., :end])
        future = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).triu_(1)
        logits[..., start:end].masked_fill_(future, float("-inf"))
        lse[..., start:end] = torch.logsumexp(logits, dim=-1)
    return out, lse.view(B, HQ, T)


#: Elements of one logits tile of the column pass (16 MiB of float32): a block's keys are taken in chunks of
#: about this many ``B H_Q block_size``-row columns, so the elementwise passes stay in the last-level cache.
TILE_ELEMENTS = 1 << 22


def _column_blocks(q, k, bias, acc, starts, block_size, scaling, inference):
    """One worker of pass 2: for each block start, ``acc[.., :e] += sum_rows exp(scaling Q K^T + bias)``, the keys
    in chunks of :data:`TILE_ELEMENTS`. ``q (B, G, r, T, d)`` any dtype; ``k (B, G, T, d)`` float32;
    ``bias (B, G, r, T)`` float32 ``log w - lse``; ``acc (B, G, r, T)`` float32, this worker's own."""
    B, G, r, T, d = q.shape
    # the bias rides in the matrix product as a last coordinate: [scaling q_j, b_j] . [k_i, 1]
    kt = torch.cat([k, k.new_ones(B, G, T, 1)], dim=-1).transpose(-1, -2)  # (B, G, d + 1, T)
    chunk = max(64, TILE_ELEMENTS // (B * G * r * block_size))
    with torch.inference_mode(inference), torch.no_grad():
        buf = torch.empty(B * G * r * block_size * min(chunk, T), dtype=torch.float32, device=k.device)
        for start in starts:
            end = min(start + block_size, T)
            n = end - start
            rows = torch.cat([q[:, :, :, start:end].float() * scaling, bias[:, :, :, start:end, None]], dim=-1)
            rows = rows.reshape(B, G, r * n, d + 1)
            for k0 in range(0, end, chunk):
                k1 = min(k0 + chunk, end)
                logits = buf[: B * G * r * n * (k1 - k0)].view(B, G, r * n, k1 - k0)
                torch.matmul(rows, kt[..., k0:k1], out=logits).exp_()  # w_j p_j(i)
                logits = logits.view(B, G, r, n, k1 - k0)
                if k1 > start:  # causal: row start + u sees keys <= start + u (zeros after exp)
                    logits.tril_(start - k0)
                acc[..., k0:k1] += logits.sum(-2)  # summed over the block's rows j


def column_sums_from_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    block_size: int = 128,
    num_workers: int | None = None,
) -> torch.Tensor:
    """Row-weighted column sums of causal attention whose row log-sum-exps are known (pass 2 of the module
    docstring): ``s^h[i] = sum_{j>=i} w_j exp(q^h_j . k_i * scaling - lse^h_j)`` (paper 003 eqs. 16, 36).

    Args:
        query: ``(B, H_Q, T, d)`` (any float dtype and strides); key: ``(B, G, T, d)``, ``G`` dividing ``H_Q``.
        lse: ``(B, H_Q, T)`` natural log-sum-exps of the rows (:func:`causal_attention_lse`).
        row_weights: ``(T,)`` non-negative ``w_j`` or ``None`` for 1.
        scaling: logit scale, default ``d ** -0.5``.
        block_size: query rows per block, ``>= 1``; extra memory ``~ 4 B H_Q block_size T`` bytes per worker.
        num_workers: worker threads, ``>= 1``; default ``torch.get_num_threads()``.

    Returns:
        ``(B, H_Q, T)`` float32.

    Raises:
        ValueError: if ``block_size < 1`` or ``num_workers < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    workers = torch.get_num_threads() if num_workers is None else int(num_workers)
    if workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    B, HQ, T, d = query.shape
    G = key.shape[1]
    r = HQ // G
    scaling = d**-0.5 if scaling is None else float(scaling)
    sums = torch.zeros(B, G, r, T, dtype=torch.float32, device=query.device)
    if T == 0 or B == 0:
        return sums.view(B, HQ, T)
    bias = -lse.float()
    if row_weights is not None:
        bias = bias + torch.log(row_weights.to(device=query.device, dtype=torch.float32))
    bias = bias.reshape(B, G, r, T)
    q, k = query.unflatten(1, (G, r)), key.float()  # q: a view whatever the strides
    plan = _assign_blocks(T, block_size, min(workers, -(-T // block_size)))
    inference = torch.is_inference_mode_enabled()
    if len(plan) == 1:
        _column_blocks(q, k, bias, sums, plan[0], block_size, scaling, inference)
        return sums.view(B, HQ, T)
    threads = torch.get_num_threads()
    partials = [sums] + [torch.zeros_like(sums) for _ in plan[1:]]
    torch.set_num_threads(1)
    try:
        pool = _get_pool(len(plan))
        jobs = [
            pool.submit(_column_blocks, q, k, bias, acc, starts, block_size, scaling, inference)
            for acc, starts in zip(partials, plan)
        ]
        for job in jobs:
            job.result()
    finally:
        torch.set_num_threads(threads)
    for acc in partials[1:]:
        sums += acc
    return sums.view(B, HQ, T)


def attention_with_column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    scaling: float | None = None,
    block_size: int = 128,
    num_workers: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill and the row-weighted column sums of its attention matrix.

    ``out^h_j = sum_{i<=j} p^h_j(i) v_i`` and ``s^h[i] = sum_{j>=i} w_j p^h_j(i)`` with
    ``p^h_j = softmax_i(q^h_j . k_i * scaling)`` over ``i <= j`` (paper 003 eq. 16, eq. 36 with ``w`` the
    harmonic prior); query head ``h`` uses KV group ``h // r``. On CPU ``out`` is transformers' ``sdpa`` output
    of the layer (causal, no mask) bit for bit; ``s`` equals :func:`presses.core.columns.column_sums` over all rows
    to float32 round-off. Torch implementation of the dispatch :func:`presses.kernels.attention_with_column_sums`
    (:func:`causal_attention_lse` then :func:`column_sums_from_lse`; see the module docstring).

    Args:
        query: ``(B, H_Q, T, d)`` RoPE'd queries of positions ``0 .. T-1`` (any float dtype and strides).
        key: ``(B, G, T, d)`` RoPE'd keys, ``G`` dividing ``H_Q``.
        value: ``(B, G, T, d_v)`` values.
        row_weights: ``(T,)`` non-negative row weights ``w_j`` or ``None`` for 1.
        scaling: logit scale, default ``d ** -0.5``.
        block_size: query rows per block of the column pass, ``>= 1``.
        num_workers: worker threads of the column pass, ``>= 1``; default ``torch.get_num_threads()``.

    Returns:
        ``(out, s)``: ``out (B, H_Q, T, d_v)`` in ``query.dtype`` and ``s (B, H_Q, T)`` float32.

    Raises:
        ValueError: on inconsistent shapes (:func:`check_prefill_attention_args`), ``block_size < 1`` or
            ``num_workers < 1``.
    """
    check_prefill_attention_args(query, key, value, row_weights)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    out, lse = causal_attention_lse(query, key, value, scaling)
    return out, column_sums_from_lse(query, key, lse, row_weights, scaling, block_size, num_workers)
