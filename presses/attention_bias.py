"""A per-layer additive attention-logit bias over the prompt slots of the cache, applied at decode time.

Presses that leave decode-time state (probabilistic eviction's SNIS correction, paper 003 Algorithm 1 and
eq. 10; docs/methods.md §3 item 5) express it as one bias per (batch row, KV group, prompt slot): the
importance log-weight on kept entries, ``0`` on every entry written after eviction (question, generated
tokens), ``-inf`` on padding. Softmax with that bias equals Algorithm 1's self-normalised estimate
``(sum_{i<=t} w_i p~_i v_i + sum_{i>t} p~_i v_i) / (sum_{i<=t} w_i p~_i + sum_{i>t} p~_i)`` with
``w_i = exp(bias_i)``. The harness uses the same state to mask the padding of caches of different lengths
decoded as one batch (``evaluation.fused``).

The bias of a layer lives on its attention module (``module._attention_bias``, an :class:`AttentionBias`)
so that it survives the ``with press(model)`` block: kvpress's pipeline decodes outside it. A wrapper
around the ``sdpa`` and ``eager`` functions of transformers' ``ALL_ATTENTION_FUNCTIONS`` (installed once by
:func:`install_bias_attention`, like kvpress's ``attention_patch``) turns the state into a float attention
mask whenever it is present, and drops a stale state at the next prefill. A layer with a bias is computed in
float32 on every path, so the log-weights are never rounded to a half-precision model's dtype: the sdpa and
eager wrappers upcast that layer's query, keys and values (a transient float32 copy of the layer's cache) and
cast the output back; the Triton decode kernel reads the float32 bias and accumulates in float32. On CUDA a
one-token decode step goes through the dispatch point :func:`presses.kernels.biased_decode_attention`
(split-K Triton flash decoding with the bias of :func:`decode_bias`) instead. :func:`take_biases` and
:func:`install_biases` move
the states of a model off and back on (the press contract's decode-state export and import).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from presses.kernels import biased_decode_attention, use_triton

__all__ = [
    "AttentionBias",
    "bias_mask",
    "decode_bias",
    "grouped_sdpa",
    "install_bias_attention",
    "clear_attention_bias",
    "take_biases",
    "install_biases",
    "select_bias_rows",
    "SUPPORTED_ATTENTION",
]

SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass
class AttentionBias:
    """Per-layer decode-time logit bias left on an attention module (e.g. after SNIS eviction).

    Attributes:
        bias: ``(B, G, P)`` float32 logit bias of the ``P`` (padded) prompt slots at the head of the
            layer's cache: e.g. the SNIS log-weight for kept entries, ``-inf`` for padding. Query head ``h``
            uses the row of group ``h // (H_Q / G)``.
    """

    bias: torch.Tensor

    @property
    def prefix_len(self) -> int:
        """``P``, the number of (padded) prompt slots at the head of the layer's cache."""
        return self.bias.shape[-1]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> additive float mask (0 / -inf); float masks are cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def bias_mask(
    state: AttentionBias, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Float attention mask for a layer with a corrected, padded prompt prefix.

    The first ``P`` key slots get ``state.bias`` (shared by all query heads of a group); the
    ``n = K - P`` slots written after eviction keep the model's own mask (its last ``n`` columns, so
    causality and padding of a multi-token question stay intact even when the model built the mask for
    another layer's cache length), or the causal pattern when the model passed no mask.

    Args:
        state: the layer's :class:`AttentionBias`.
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
        raise ValueError(
            f"SNIS state (B={bias.shape[0]}, G={bias.shape[1]}, P={P}) does not match the "
            f"layer's cache (B={B}, G={G}, K={K}): was the cache replaced without a prefill?"
        )
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


def clear_attention_bias(model) -> None:
    """Remove every layer's correction state from ``model`` (the wrapper also does it at prefill)."""
    for mod in model.modules():
        if hasattr(mod, "_attention_bias"):
            mod._attention_bias = None


def decode_bias(state: AttentionBias, key: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Per-group logit bias ``(B, G, K)`` float32 of a one-token decode step (paper 003 eq. 10; docs/methods.md §3 item
    5).

    The ``P`` prompt slots get ``state.bias``; the ``K - P`` slots written after eviction get ``0``, or the
    model's own additive mask there (padding) when it passed one that all heads share.

    Args:
        state: the layer's :class:`AttentionBias` (``bias`` ``(B, G, P)``).
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
        post = post + _additive(attention_mask[..., -(K - P) :], torch.float32).reshape(-1, 1, K - P)
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


def grouped_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, None]:
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
        query.reshape(B, G, rows, d), key, value, attn_mask=mask.reshape(B, G, rows, K), scale=scaling
    )
    return out.reshape(B, H, q, d).transpose(1, 2).contiguous(), None


def _in_dtype(out: tuple, dtype: torch.dtype | None) -> tuple:
    """An attention function's ``(output, weights)`` cast back to the model's ``dtype`` (None: unchanged)."""
    if dtype is None:
        return out
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in out)


def _wrap(func, name: str):
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        state = getattr(module, "_attention_bias", None)
        model_dtype = None  # set when a biased layer is computed in float32
        if state is not None:
            if query.shape[2] == key.shape[2]:  # a new prefill: the correction belongs to an old cache
                module._attention_bias = None
            else:
                fast = _kernel_decode(module, query, key, value, attention_mask, state, kwargs)
                if fast is not None:
                    return fast
                if query.dtype != torch.float32:
                    # the correction in full precision: a float mask must have the query's dtype (sdpa) or is
                    # added to logits of that dtype (eager), which would round the fp32 log-weights (bf16:
                    # 0.123456 -> 0.12354); the biased layer runs in float32 instead and its output is cast back
                    model_dtype = query.dtype
                    query, key, value = query.float(), key.float(), value.float()
                attention_mask = bias_mask(state, query, key, attention_mask)
                dropout = args[0] if args else kwargs.get("dropout", 0.0)  # kvpress's patch passes it positionally
                if (
                    name == "sdpa"
                    and len(args) <= 1
                    and not dropout
                    and not kwargs.get("sliding_window")
                    and not kwargs.get("softcap")
                    and not kwargs.get("output_attentions")
                    and getattr(module, "masked_key_indices", None) is None  # kvpress's AdaKV masking
                    and query.shape[1] % key.shape[1] == 0
                ):
                    return _in_dtype(
                        grouped_sdpa(query, key, value, attention_mask, kwargs.get("scaling")), model_dtype
                    )
        inner = func
        if inner is None:  # eager: the model file's own eager function
            inner = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if inner is None:
                from transformers.models.llama.modeling_llama import eager_attention_forward as inner
        return _in_dtype(inner(module, query, key, value, attention_mask, *args, **kwargs), model_dtype)

    wrapper._bias_wrapped = True
    wrapper.__name__ = f"snis_{name}_attention"
    return wrapper


def install_bias_attention() -> None:
    """Wrap ``sdpa`` and register ``eager`` in transformers' ``ALL_ATTENTION_FUNCTIONS`` (idempotent).

    Without a ``_attention_bias`` on the module the wrappers call the original function unchanged (for
    ``eager``: the ``eager_attention_forward`` of the module's own modeling file).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), "_bias_wrapped", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _wrap(ALL_ATTENTION_FUNCTIONS["sdpa"], "sdpa")
    current = ALL_ATTENTION_FUNCTIONS.get("eager")
    if not getattr(current, "_bias_wrapped", False):
        ALL_ATTENTION_FUNCTIONS["eager"] = _wrap(current, "eager")


def _decoder_layers(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner.layers


def take_biases(model) -> tuple:
    """Detach the per-layer biases a prefill left on ``model``'s attention modules.

    Returns:
        One entry per decoder layer: its :class:`AttentionBias` (bias ``(B, G, P)``) or ``None``. The modules
        are cleared, so the next prefill (or replay) starts clean.
    """
    states = tuple(getattr(layer.self_attn, "_attention_bias", None) for layer in _decoder_layers(model))
    clear_attention_bias(model)
    return states


def install_biases(model, states_per_run: list) -> None:
    """Put the biases of the runs of one decode batch back on ``model``'s attention modules.

    Layer ``i`` gets the batch-wise concatenation of the runs' biases (row ``k`` of the batch is run ``k``),
    which :func:`bias_mask` applies per row; a layer without a state in every run gets none.

    Args:
        model: the causal LM.
        states_per_run: per run, one :class:`AttentionBias` or ``None`` per decoder layer
            (:func:`take_biases`); each run's biases have batch size 1 (or that run's rows).

    Raises:
        ValueError: if some but not all runs have a state at a layer, or their padded lengths ``P`` differ.
    """
    if any(state is not None for states in states_per_run for state in states):
        install_bias_attention()  # the states act through the wrapper
    for i, layer in enumerate(_decoder_layers(model)):
        layer_states = [states[i] for states in states_per_run]
        present = [s is not None for s in layer_states]
        if not any(present):
            layer.self_attn._attention_bias = None
            continue
        if not all(present) or len({s.prefix_len for s in layer_states}) != 1:
            raise ValueError(
                f"layer {i}: runs decoded in one batch need attention biases of equal padded length "
                f"(present={present}, lengths={[s.prefix_len if s else None for s in layer_states]})"
            )
        layer.self_attn._attention_bias = AttentionBias(torch.cat([s.bias for s in layer_states], dim=0))


def select_bias_rows(model, index: torch.Tensor) -> None:
    """Keep only the batch rows ``index`` of the biases on ``model``'s attention modules.

    The companion of ``DynamicCache.batch_select_indices`` when a decode batch drops the rows that finished
    (:func:`evaluation.replay.generate_answers`): row ``k`` of each layer's bias follows row ``index[k]`` of
    the cache. Layers without a bias are left alone.

    Args:
        model: the causal LM.
        index: ``(B',)`` long, the batch rows to keep, in their new order.
    """
    for layer in _decoder_layers(model):
        state = getattr(layer.self_attn, "_attention_bias", None)
        if state is not None:
            layer.self_attn._attention_bias = AttentionBias(state.bias.index_select(0, index.to(state.bias.device)))
