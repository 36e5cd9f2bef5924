"""Observer attention: what the last ``W`` prefill queries attend to, averaged over the window.

docs/methods.md §1 step 1 (paper 000 section 3; paper 001 eq. 2 and appendix C): the observer rows are
averaged BEFORE any entropy is taken. This module is the torch reference; the Triton kernel of
``presses.kernels`` computes the same quantity without materialising ``W x T`` per head.
"""

from __future__ import annotations

import math
import sys

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

__all__ = [
    "apply_rope",
    "attention_logit_options",
    "rotary_embeddings",
    "softcap_logits",
    "window_queries",
    "observer_attention_reference",
    "check_window",
]


def apply_rope(module, queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``queries`` rotated as the model rotates them: the ``apply_rotary_pos_emb`` of the module's own modeling file
    (Llama's when it has none), so a partial rotary embedding (Phi-3's ``partial_rotary_factor``, which rotates the
    first dimensions only) is the model's own.

    Args:
        module: the attention module whose modeling file is used.
        queries: ``(B, H_Q, n, d)`` pre-RoPE queries.
        cos, sin: ``(B, n, d_rot)`` from the model's rotary embedding (``d_rot <= d``).

    Returns:
        ``(B, H_Q, n, d)`` RoPE'd queries.
    """
    rope = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None) or llama_rope
    return rope(queries, queries[:, :1], cos, sin)[0]


def rotary_embeddings(module, x: torch.Tensor, positions: torch.Tensor):
    """``(cos, sin)`` of ``positions`` from the rotary embedding kvpress gives the module (``module.rotary_emb``, the
    language model's), for the module's own layer type where the embedding has one per type (Gemma3: sliding
    layers rotate with ``rope_local_base_freq``, full ones with ``rope_theta``; kvpress issue #274).

    Args:
        module: an attention module with ``rotary_emb`` (set by kvpress's ``BasePress.__call__``).
        x: a tensor of the model's dtype and device (the embedding's dtype reference).
        positions: ``(B, n)`` int64 positions.
    """
    rotary = module.rotary_emb
    layer_type = getattr(module, "layer_type", None)
    if layer_type is not None and hasattr(rotary, "layer_types"):
        return rotary(x, positions, layer_type)
    return rotary(x, positions)


def attention_logit_options(module) -> tuple[float | None, float | None]:
    """``(scaling, softcap)`` of the module's attention logits: ``module.scaling`` (``query_pre_attn_scalar ** -0.5``
    for Gemma, ``d ** -0.5`` elsewhere; None when the module has none) and its tanh soft-cap
    (Gemma2's ``attn_logit_softcapping``; None for none)."""
    return getattr(module, "scaling", None), getattr(module, "attn_logit_softcapping", None)


def softcap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` (Gemma2's attention soft-cap, as its eager attention computes it), or
    ``logits`` unchanged for ``softcap=None``."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


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
        module: a Llama-like attention module (``q_proj``, ``head_dim``, ``config``); its modeling file's RoPE is
            applied (:func:`apply_rope`).
        hidden_states: ``(B, T, D_model)`` input of the attention layer.
        window_size: ``W``.
        position_embeddings: ``(cos, sin)`` each ``(B, T, d_rot)`` from the model's rotary embedding.

    Returns:
        ``(B, H_Q, W, d)`` queries in the dtype of ``hidden_states``.

    Raises:
        NotImplementedError: for attention modules kvpress cannot project (from kvpress).
    """
    q = get_prerope_query_states(module, hidden_states[:, -window_size:])
    cos, sin = position_embeddings
    return apply_rope(module, q, cos[:, -window_size:], sin[:, -window_size:])


def observer_attention_reference(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Observer-averaged causal attention, torch reference (docs/methods.md §1 step 1).

    ``a^h[j] = mean_u softmax_j(cap(q_u . k_j * scaling))`` over the last ``W`` queries, where window query
    ``u`` (absolute position ``T - W + u``) sees keys ``j <= T - W + u``; ``cap`` is the model's soft-cap
    (:func:`softcap_logits`, identity without one).

    Args:
        queries: ``(B, H_Q, W, d)`` RoPE'd window queries.
        keys: ``(B, G, T, d)`` RoPE'd keys, ``G`` dividing ``H_Q`` (query head ``h`` uses group ``h // r``).
        scaling: logit scale (the module's ``scaling``); None divides by ``sqrt(d)``.
        softcap: the attention soft-cap, or None.

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
    logits = torch.matmul(q, keys.float().transpose(-1, -2))  # (B, G, r*W, T)
    logits = logits / math.sqrt(d) if scaling is None else logits * scaling
    logits = softcap_logits(logits, softcap).reshape(B, G, r, W, T)
    pos_q = torch.arange(T - W, T, device=keys.device).view(W, 1)
    future = torch.arange(T, device=keys.device).view(1, T) > pos_q
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=-2).reshape(B, HQ, T)
