"""Decode-time SNIS correction as an additive attention-logit bias (paper 003 Alg. 1, eq. 10; SPEC 3.5).

Softmax with the bias ``b_i = (log c_i - log m - log pi_i) / tau`` on the kept prompt entries, ``0`` on
every entry written after eviction and ``-inf`` on padding equals Algorithm 1's
``(sum_{i<=t} w_i p~_i v_i + sum_{i>t} p~_i v_i) / (sum_{i<=t} w_i p~_i + sum_{i>t} p~_i)`` with
``w_i = (c_i / (m pi_i)) ** (1 / tau)``.

The bias of a layer lives on its attention module (``module._snis_state``, a :class:`SNISLayerState`)
so that it survives the ``with press(model)`` block: kvpress's pipeline decodes outside it. A wrapper
around the ``sdpa`` and ``eager`` functions of transformers' ``ALL_ATTENTION_FUNCTIONS`` (installed
once by :func:`install_snis_attention`, like kvpress's ``attention_patch``) turns the state into a
float attention mask whenever it is present, and drops a stale state at the next prefill. On CUDA a
one-token decode step goes through the dispatch point :func:`presses.kernels.biased_decode_attention`
(split-K Triton flash decoding with the bias of :func:`decode_bias`) instead.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from presses.kernels import biased_decode_attention, use_triton

__all__ = ["SNISLayerState", "snis_bias", "snis_mask", "decode_bias", "grouped_sdpa", "install_snis_attention",
           "clear_snis_state", "SUPPORTED_ATTENTION"]

SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass
class SNISLayerState:
    """Per-layer correction state left on the attention module after eviction.

    Attributes:
        bias: ``(B, G, P)`` float32 logit bias of the ``P`` (padded) prompt slots at the head of the
            layer's cache: the SNIS log-weight for kept entries, ``-inf`` for padding. Query head ``h``
            uses the row of group ``h // (H_Q / G)``.
    """

    bias: torch.Tensor

    @property
    def prefix_len(self) -> int:
        """``P``, the number of (padded) prompt slots at the head of the layer's cache."""
        return self.bias.shape[-1]


def snis_bias(counts: torch.Tensor, num_samples, pi: torch.Tensor, tau: float = 1.0,
              correction: bool = True) -> torch.Tensor:
    """SNIS log importance weights as a logit bias (paper 003 Alg. 1 line 2 and eq. 10).

    ``b_i = (log c_i - log m - log pi_i) / tau`` where ``c_i > 0``; ``-inf`` where ``c_i = 0``;
    ``0`` on kept entries when ``correction`` is False or ``tau = inf`` (uncorrected estimator).

    Args:
        counts: ``(..., n)`` draw counts (float or int, may be fractional for expectation tests).
        num_samples: ``m > 0``, an int or tensor broadcastable to ``counts.shape[:-1]``.
        pi: ``(..., n)`` proposal probabilities of the same entries.
        tau: importance-weight temperature ``tau > 0`` (``inf`` allowed).
        correction: apply the correction at all.

    Returns:
        ``(..., n)`` float32.

    Raises:
        ValueError: if ``tau <= 0`` or a kept entry has ``pi_i <= 0``.
    """
    if not (tau > 0):
        raise ValueError(f"tau={tau} must be > 0 (inf = no correction)")
    kept = counts > 0
    if not correction or math.isinf(tau):
        return torch.where(kept, 0.0, float("-inf")).float()
    if bool((kept & (pi <= 0)).any()):
        raise ValueError("a kept entry has proposal probability pi_i <= 0: the proposal must cover the draws")
    m = torch.as_tensor(num_samples, dtype=torch.float64, device=counts.device).unsqueeze(-1)
    logw = torch.log(counts.double().clamp_min(1e-300)) - torch.log(m) - torch.log(pi.double().clamp_min(1e-300))
    return torch.where(kept, logw / tau, float("-inf")).float()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> additive float mask (0 / -inf); float masks are cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def snis_mask(state: SNISLayerState, query: torch.Tensor, key: torch.Tensor,
              attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Float attention mask for a layer with a corrected, padded prompt prefix.

    The first ``P`` key slots get ``state.bias`` (shared by all query heads of a group); the
    ``n = K - P`` slots written after eviction keep the model's own mask (its last ``n`` columns, so
    causality and padding of a multi-token question stay intact even when the model built the mask for
    another layer's cache length), or the causal pattern when the model passed no mask.

    Args:
        state: the layer's :class:`SNISLayerState`.
        query: ``(B, H_Q, q, d)``.
        key: ``(B, G, K, d)`` the layer's full key cache (``K >= P``).
        attention_mask: ``None``, a boolean keep-mask or an additive float mask ``(B|1, 1|H_Q, q, K')``.

    Returns:
        ``(B, H_Q, q, K)`` additive mask in ``query.dtype``.

    Raises:
        ValueError: if the cache is shorter than the prefix or the batch / group sizes disagree.
    """
    B, HQ, q, _ = query.shape
    G, K = key.shape[1], key.shape[2]
    bias = state.bias
    P = state.prefix_len
    if K < P or bias.shape[0] != B or bias.shape[1] != G:
        raise ValueError(f"SNIS state (B={bias.shape[0]}, G={bias.shape[1]}, P={P}) does not match the "
                         f"layer's cache (B={B}, G={G}, K={K}): was the cache replaced without a prefill?")
    n_after = K - P
    dtype = query.dtype
    prefix = bias.to(device=query.device, dtype=dtype).repeat_interleave(HQ // G, dim=1).unsqueeze(2)
    prefix = prefix.expand(B, HQ, q, P)
    if n_after == 0:
        return prefix.contiguous()
    if attention_mask is None:
        # causal over the post-eviction entries: query u (absolute post index n_after - q + u) sees <= itself
        rows = torch.arange(n_after - q, n_after, device=query.device).view(q, 1)
        post = _additive(torch.arange(n_after, device=query.device).view(1, n_after) <= rows, dtype)
    else:
        post = _additive(attention_mask[..., -n_after:], dtype)
    post = post.expand(B, HQ, q, n_after)
    return torch.cat([prefix, post], dim=-1)


def clear_snis_state(model) -> None:
    """Remove every layer's correction state from ``model`` (the wrapper also does it at prefill)."""
    for mod in model.modules():
        if hasattr(mod, "_snis_state"):
            mod._snis_state = None


def decode_bias(state: SNISLayerState, key: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Per-group logit bias ``(B, G, K)`` float32 of a one-token decode step (paper 003 eq. 10; SPEC 3.5).

    The ``P`` prompt slots get ``state.bias``; the ``K - P`` slots written after eviction get ``0``, or the
    model's own additive mask there (padding) when it passed one that all heads share.

    Args:
        state: the layer's :class:`SNISLayerState` (``bias`` ``(B, G, P)``).
        key: ``(B, G, K, d)`` the layer's key cache, ``K >= P``.
        attention_mask: ``None`` or a boolean keep-mask / additive mask ``(B|1, 1, 1, K')``.

    Returns:
        ``(B, G, K)`` float32, the ``bias`` argument of :func:`presses.kernels.biased_decode_attention`.

    Raises:
        ValueError: if the cache is shorter than the prefix.
    """
    B, G, K = key.shape[0], key.shape[1], key.shape[2]
    P = state.prefix_len
    if K < P:
        raise ValueError(f"SNIS state has P={P} prompt slots but the layer's cache has K={K}")
    post = torch.zeros(B, G, K - P, device=key.device, dtype=torch.float32)
    if attention_mask is not None and K > P:
        post = post + _additive(attention_mask[..., -(K - P):], torch.float32).reshape(-1, 1, K - P)
    return torch.cat([state.bias.to(device=key.device, dtype=torch.float32), post], dim=-1)


def _kernel_decode(module, query, key, value, attention_mask, state, kwargs):
    """The one-token decode step through :func:`presses.kernels.biased_decode_attention` when the dispatch
    picks Triton (CUDA), else ``None`` (the caller then runs the wrapped attention function)."""
    if query.shape[2] != 1 or not use_triton(key) or kwargs.get("sliding_window") or kwargs.get("softcap"):
        return None
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1:
        return None  # a per-head mask: leave it to the attention function
    bias = decode_bias(state, key, attention_mask)
    out = biased_decode_attention(query, key, value, bias, kwargs.get("scaling", getattr(module, "scaling", None)))
    return out.transpose(1, 2).contiguous(), None  # transformers' (B, q, H_Q, d), no weights


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None) -> tuple[torch.Tensor, None]:
    """sdpa with a float mask under GQA, without copying keys and values to every query head.

    The ``r = H_Q / G`` query heads of a group become extra query rows against the group's own keys:
    query ``(B, G, r q, d)``, mask ``(B, G, r q, K)``. Each row attends independently, so this equals
    sdpa on ``repeat_kv``'d keys and values (transformers' path when a mask is given, which copies the
    whole cache ``r`` times per step) up to floating-point rounding.

    Args:
        query: ``(B, H_Q, q, d)``; key, value: ``(B, G, K, d)``; mask: additive ``(B, H_Q, q, K)``.
        scaling: the softmax scale (``None``: ``d ** -0.5``).

    Returns:
        ``((B, q, H_Q, d), None)``, transformers' attention-function convention.
    """
    B, H, q, d = query.shape
    G, K = key.shape[1], key.shape[2]
    rows = (H // G) * q  # query head h = g r + j (repeat_kv's order) -> group g, rows j q .. j q + q - 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, G, rows, d), key, value, attn_mask=mask.reshape(B, G, rows, K), scale=scaling)
    return out.reshape(B, H, q, d).transpose(1, 2).contiguous(), None


def _wrap(func, name: str):
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        state = getattr(module, "_snis_state", None)
        if state is not None:
            if query.shape[2] == key.shape[2]:  # a new prefill: the correction belongs to an old cache
                module._snis_state = None
            else:
                fast = _kernel_decode(module, query, key, value, attention_mask, state, kwargs)
                if fast is not None:
                    return fast
                attention_mask = snis_mask(state, query, key, attention_mask)
                dropout = args[0] if args else kwargs.get("dropout", 0.0)  # kvpress's patch passes it positionally
                if (name == "sdpa" and len(args) <= 1 and not dropout and not kwargs.get("sliding_window")
                        and not kwargs.get("softcap") and not kwargs.get("output_attentions")
                        and getattr(module, "masked_key_indices", None) is None  # kvpress's AdaKV masking
                        and query.shape[1] % key.shape[1] == 0):
                    return grouped_sdpa(query, key, value, attention_mask, kwargs.get("scaling"))
        inner = func
        if inner is None:  # eager: the model file's own eager function
            inner = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if inner is None:
                from transformers.models.llama.modeling_llama import eager_attention_forward as inner
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    wrapper._snis_wrapped = True
    wrapper.__name__ = f"snis_{name}_attention"
    return wrapper


def install_snis_attention() -> None:
    """Wrap ``sdpa`` and register ``eager`` in transformers' ``ALL_ATTENTION_FUNCTIONS`` (idempotent).

    Without a ``_snis_state`` on the module the wrappers call the original function unchanged (for
    ``eager``: the ``eager_attention_forward`` of the module's own modeling file).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), "_snis_wrapped", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _wrap(ALL_ATTENTION_FUNCTIONS["sdpa"], "sdpa")
    current = ALL_ATTENTION_FUNCTIONS.get("eager")
    if not getattr(current, "_snis_wrapped", False):
        ALL_ATTENTION_FUNCTIONS["eager"] = _wrap(current, "eager")
