"""Observer attention: what the last ``W`` prefill queries attend to, averaged over the window.

docs/methods.md §1 step 1 (paper 000 section 3; paper 001 eq. 2 and appendix C): the observer rows are
averaged BEFORE any entropy is taken. This module is the torch reference; the Triton kernel of
``presses.kernels`` computes the same quantity without materialising ``W x T`` per head.
"""

from __future__ import annotations

import math

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

__all__ = ["window_queries", "observer_attention_reference", "check_window"]


def check_window(window_size: int, seq_len: int) -> None:
    """Raise ``ValueError`` unless ``1 <= window_size <= seq_len``.

    Raises:
        ValueError: naming ``window_size`` and the context length ``T``.
    """
    if window_size < 1:
        raise ValueError(f"window_size={window_size} must be >= 1")
    if window_size > seq_len:
        raise ValueError(
            f"the context has T={seq_len} tokens, shorter than window_size={window_size}: "
            "use a longer context or a smaller window_size"
        )


def window_queries(module, hidden_states: torch.Tensor, window_size: int, position_embeddings) -> torch.Tensor:
    """RoPE'd queries of the last ``window_size`` positions.

    Args:
        module: a Llama-like attention module (``q_proj``, ``head_dim``, ``config``).
        hidden_states: ``(B, T, D_model)`` input of the attention layer.
        window_size: ``W``.
        position_embeddings: ``(cos, sin)`` each ``(B, T, d)`` from the model's rotary embedding.

    Returns:
        ``(B, H_Q, W, d)`` queries in the dtype of ``hidden_states``.

    Raises:
        NotImplementedError: for attention modules kvpress cannot project (from kvpress).
    """
    q = get_prerope_query_states(module, hidden_states[:, -window_size:])
    cos, sin = position_embeddings
    cos, sin = cos[:, -window_size:].unsqueeze(1), sin[:, -window_size:].unsqueeze(1)
    return q * cos + rotate_half(q) * sin


def observer_attention_reference(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Observer-averaged causal attention, torch reference (docs/methods.md §1 step 1).

    ``a^h[j] = mean_u softmax_j(q_u . k_j / sqrt(d))`` over the last ``W`` queries, where window query
    ``u`` (absolute position ``T - W + u``) sees keys ``j <= T - W + u``.

    Args:
        queries: ``(B, H_Q, W, d)`` RoPE'd window queries.
        keys: ``(B, G, T, d)`` RoPE'd keys, ``G`` dividing ``H_Q`` (query head ``h`` uses group ``h // r``).

    Returns:
        ``(B, H_Q, T)`` float32; each row sums to 1.

    Raises:
        ValueError: if ``W > T`` or ``G`` does not divide ``H_Q``.
    """
    B, HQ, W, d = queries.shape
    G, T = keys.shape[1], keys.shape[2]
    check_window(W, T)
    if HQ % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={HQ}")
    r = HQ // G
    q = queries.float().reshape(B, G, r * W, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) / math.sqrt(d)  # (B, G, r*W, T)
    logits = logits.reshape(B, G, r, W, T)
    pos_q = torch.arange(T - W, T, device=keys.device).view(W, 1)
    future = torch.arange(T, device=keys.device).view(1, T) > pos_q
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=-2).reshape(B, HQ, T)
