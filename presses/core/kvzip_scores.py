"""KVzip's reconstruction scores without the eager attention weights (torch): what
:class:`presses.kvzip_pages.fast.KVzipFastPress` computes in each layer of KVzip's reconstruction pass
(docs/methods.md §1.18; KVzip, https://arxiv.org/abs/2505.23416 section 3.2).

- :func:`attention_with_lse`: softmax attention and each row's log normaliser from a fused torch kernel
  (:func:`attention_with_lse_reference`: the explicit softmax, for devices without one);
- :func:`reconstruction_column_maxes`: the most attention any query of a KV group pays each scored key under a
  given normaliser (KVzip+'s row and column weights optional), the torch reference of the dispatch
  :func:`presses.kernels.reconstruction_column_maxes` (Triton on CUDA:
  :func:`presses.kernels.kvzip_scores.reconstruction_column_maxes_triton`);
- :func:`value_output_norms`: KVzip+'s column weight ``||W_O^h v_i||``.
"""

from __future__ import annotations

import torch

__all__ = [
    "attention_with_lse",
    "attention_with_lse_reference",
    "check_reconstruction_args",
    "reconstruction_column_maxes",
    "value_output_norms",
]

_ROW_BLOCK = 128  # query rows per score block: (B G, chunk, 128) float32 logits at a time, not (B H, n, chunk)


def attention_with_lse(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and each row's log normaliser, from one fused kernel where the device has one.

    Args:
        queries: ``(B, H, n, d)``.
        keys, values: ``(B, H, k, d)`` (heads already repeated to the queries'); with ``causal``, ``k == n`` and
            row ``i`` sees keys ``<= i``.
        causal: whether to apply the causal mask.
        scaling: logit scale.

    Returns:
        ``(out, lse)``: ``(B, H, n, d)`` in the queries' dtype and ``(B, H, n)`` float32,
        ``lse = logsumexp_j(q . k_j * scaling)``. CPU: torch's flash kernel
        (``_scaled_dot_product_flash_attention_for_cpu``); CUDA: torch's memory-efficient kernel; else the explicit
        softmax (:func:`attention_with_lse_reference`). The CUDA branch has not yet run on a GPU.
    """
    if queries.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, 0.0, causal, scale=scaling
        )
        return out, lse.float()
    if queries.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            queries, keys, values, None, True, 0.0, causal, scale=scaling
        )[:2]
        return out, lse[..., : queries.shape[2]].float()  # the kernel pads its rows to a block
    return attention_with_lse_reference(queries, keys, values, causal, scaling)


def attention_with_lse_reference(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` through the explicit ``(B, H, n, k)`` softmax (devices without a fused kernel)."""
    logits = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scaling
    if causal:
        n = queries.shape[2]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse[..., None]), values.float()).to(queries.dtype), lse


def check_reconstruction_args(
    queries: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    column_weights: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int, int]:
    """The shapes of :func:`reconstruction_column_maxes`'s arguments, checked (its reference and Triton paths).

    Returns:
        ``(B, H, n, d, G, c)``.

    Raises:
        ValueError: if ``keys`` is not ``(B, G, c, d)``, ``G`` does not divide ``H``, or ``lse``, ``row_weights`` or
            ``column_weights`` is not ``(B, H, n)``, ``(B, n)`` or ``(B, H, c)``.
    """
    B, H, n, d = queries.shape
    if keys.dim() != 4 or keys.shape[0] != B or keys.shape[3] != d:
        raise ValueError(f"keys of shape {tuple(keys.shape)} do not match queries {tuple(queries.shape)} (B, G, c, d)")
    G, c = keys.shape[1], keys.shape[2]
    if H % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={H}")
    for name, value, shape in (("lse", lse, (B, H, n)), ("row_weights", row_weights, (B, n))):
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if column_weights is not None and tuple(column_weights.shape) != (B, H, c):
        raise ValueError(f"column_weights has shape {tuple(column_weights.shape)}, expected {(B, H, c)}")
    return B, H, n, d, G, c


def reconstruction_column_maxes(
    queries: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    row_weights: torch.Tensor | None = None,
    column_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """KVzip's score of each key: the most attention any query of the group pays it, under a softmax whose
    normaliser is given (so the softmax may run over more keys than those scored), without the ``(H, n, k)`` weights.

    ``s[g, i] = max_{h in group g, j} w_j c_{h, i} exp(q^h_j . k^g_i * scaling - lse^h_j)``; the log normaliser enters
    the matrix product as one more coordinate, and rows are taken ``128`` at a time, each block laid out keys x rows
    so that the maximum runs along contiguous memory (on one CPU thread, faster than rows x keys blocks: cost in
    docs/methods.md §1.18). Every row sees every scored key (no causal mask: KVzip's repeat tokens come after the
    chunk). The torch reference of the dispatch :func:`presses.kernels.reconstruction_column_maxes`.

    Args:
        queries: ``(B, H, n, d)`` RoPE'd queries.
        keys: ``(B, G, c, d)`` RoPE'd keys to score, ``G`` dividing ``H``.
        lse: ``(B, H, n)`` each row's log normaliser.
        scaling: logit scale.
        row_weights: ``(B, n)`` positive row weights ``w`` (KVzip+: ``1 / ||h_j||``), or None for 1.
        column_weights: ``(B, H, c)`` column weights ``c`` (KVzip+: ``||W_O^h v_i||``), or None for 1.

    Returns:
        ``(B, G, c)`` float32: attention probabilities in ``[0, 1]`` when ``lse`` covers the scored keys and there are
        no weights; times the weights otherwise. Zeros when ``n == 0``.

    Raises:
        ValueError: as :func:`check_reconstruction_args` (shapes; ``G`` not dividing ``H``).
    """
    B, H, n, d, G, c = check_reconstruction_args(queries, keys, lse, row_weights, column_weights)
    r = H // G
    offset = lse.float()
    if row_weights is not None:
        offset = offset - torch.log(row_weights.float())[:, None, :]
    rows = torch.cat([queries.float() * scaling, -offset[..., None]], dim=-1).view(B * G, r, n, d + 1)
    rows_t = rows.transpose(-1, -2)  # (B G, r, d + 1, n)
    cols = torch.cat([keys.float(), keys.new_ones(B, G, c, 1, dtype=torch.float32)], dim=-1).view(B * G, c, d + 1)
    best = torch.full((B * G, r, c), float("-inf"), device=keys.device)
    for h in range(r):
        for start in range(0, n, _ROW_BLOCK):
            block = torch.matmul(cols, rows_t[:, h, :, start : start + _ROW_BLOCK])  # (B G, c, rows) log-weights
            torch.maximum(best[:, h], block.amax(dim=-1), out=best[:, h])
    best = torch.exp(best).view(B, G, r, c)
    if column_weights is not None:
        best = best * column_weights.float().view(B, G, r, c)
    return best.amax(dim=2)


def value_output_norms(module, values: torch.Tensor) -> torch.Tensor:
    """``||W_O^h v_i||`` per query head ``h`` and value ``i`` (KVzip+'s column weight), through each head's Gram
    matrix ``W_O^h^T W_O^h`` (``d x d``) rather than the ``(H, c, hidden)`` products.

    Args:
        module: the attention module (its ``o_proj.weight``: ``(hidden, H d)``).
        values: ``(B, G, c, d)``.

    Returns:
        ``(B, H, c)`` float32.
    """
    B, G, c, d = values.shape
    H = module.o_proj.weight.shape[1] // d
    w = module.o_proj.weight.float().view(-1, H, d)  # (hidden, H, d)
    gram = torch.einsum("jhi,jhk->hik", w, w).view(G, H // G, d, d)
    v = values.float()
    squared = torch.einsum("bgci,grik,bgck->bgrc", v, gram, v)
    return squared.clamp_min(0).sqrt().reshape(B, H, c)
