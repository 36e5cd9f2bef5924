"""A per-layer additive attention-logit bias over the prompt slots of the cache, applied at decode time.

Presses that leave decode-time state (probabilistic eviction's SNIS correction, paper 003 Algorithm 1 and
eq. 10; docs/methods.md §3 item 5) express it as one bias per (batch row, KV group, prompt slot): the
importance log-weight on kept entries, ``0`` on every entry written after eviction (question, generated
tokens), ``-inf`` on padding. Softmax with that bias equals Algorithm 1's self-normalised estimate
``(sum_{i<=t} w_i p~_i v_i + sum_{i>t} p~_i v_i) / (sum_{i<=t} w_i p~_i + sum_{i>t} p~_i)`` with
``w_i = exp(bias_i)``. The harness uses the same state to mask the padding of caches of different lengths
decoded as one batch (``evaluation.fused``).

This module is the math: the state (:class:`AttentionBias`), the float mask it becomes (:func:`bias_mask`,
:func:`decode_bias`) and one biased attention call (:func:`biased_attention`). Where a bias lives (on the
cache layer it describes, through every cache operation) and when it applies is :mod:`presses.attention`, the
project's one attention wrapper.
A layer with a bias is computed in float32 on every path, so the log-weights are never rounded to a
half-precision model's dtype: sdpa and eager upcast that layer's query, keys and values (a transient float32
copy of the layer's cache) and cast the output back; the Triton decode kernel reads the float32 bias and
accumulates in float32. On CUDA a one-token decode step goes through the dispatch point
:func:`presses.kernels.biased_decode_attention` (split-K Triton flash decoding with the bias of
:func:`decode_bias`) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from presses.kernels import biased_decode_attention, use_triton

__all__ = [
    "AttentionBias",
    "check_fit",
    "check_positions",
    "fit_mask",
    "bias_mask",
    "decode_bias",
    "grouped_sdpa",
    "biased_attention",
]


@dataclass
class AttentionBias:
    """Per-layer decode-time logit bias of a cache (e.g. after SNIS eviction; kept by :mod:`presses.attention`).

    Attributes:
        bias: ``(B, G, P)`` float32 logit bias of the ``P`` (padded) prompt slots at the head of the
            layer's cache: e.g. the SNIS log-weight for kept entries, ``-inf`` for padding. Query head ``h``
            uses the row of group ``h // (H_Q / G)``.
        context_length: ``T``, the number of prompt tokens the layer was compressed from, when known: the
            entries written after the prompt sit at positions ``T, T + 1, ...`` (kvpress's pipeline), so a decode
            at a position below ``T`` is refused (:func:`check_positions`). None: not checked.
    """

    bias: torch.Tensor
    context_length: int | None = None

    @property
    def prefix_len(self) -> int:
        """``P``, the number of (padded) prompt slots at the head of the layer's cache."""
        return self.bias.shape[-1]

    def with_bias(self, bias: torch.Tensor) -> AttentionBias:
        """The same state with ``bias`` (e.g. its rows selected or its slots cut by a cache operation)."""
        return AttentionBias(bias, self.context_length)


def check_fit(state: AttentionBias, B: int, G: int, K: int) -> None:
    """Raise unless ``state`` fits a layer cache of ``B`` rows, ``G`` KV groups and ``K >= P`` entries.

    Raises:
        ValueError: naming both shapes: the cache was changed without its state (keys replaced by hand, another
            batch size) or the state was given to another cache.
    """
    b, g, P = state.bias.shape
    if K < P or b != B or g != G:
        raise ValueError(
            f"decode-time bias (B={b}, G={g}, P={P}) does not match the layer's cache (B={B}, G={G}, K={K}): "
            "was the cache changed without its state?"
        )


def check_positions(state: AttentionBias, position_ids) -> None:
    """Raise when a forward on a layer compressed from ``T = state.context_length`` prompt tokens feeds positions
    below ``T`` (nothing when either is unknown).

    Args:
        state: the layer's :class:`AttentionBias`.
        position_ids: the forward's ``position_ids`` (``(B, q)``; transformers passes them to the attention
            function), or None.

    Raises:
        ValueError: naming the position and ``T``: a model called without ``position_ids`` (``model.generate``
            included) numbers the new tokens from the cache's length, which for a compressed cache is below ``T``,
            and would place them among the prompt's own positions.
    """
    T = state.context_length
    if T is None or not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return
    first = int(position_ids.min())
    if first < T:
        raise ValueError(
            f"a decode at position {first} on a cache compressed from a {T}-token prompt: the tokens after it start "
            f"at position {T} (pass position_ids, as kvpress's pipeline does; model.generate needs them too)"
        )


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> additive float mask (0 / -inf); float masks are cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def fit_mask(attention_mask, key_length: int):
    """The model's attention mask fitted to a layer whose cache holds ``key_length`` entries.

    transformers builds a forward's mask once, from one layer's cache length (layer 0's, or the first layer of the
    mask's kind, ``masking_utils.create_causal_mask``), and every layer of that kind reads it. After a press that
    keeps different counts per layer (PyramidKV, probabilistic eviction with ``budget="head"``, a sliding-window
    layer left whole next to compressed full layers) the other layers hold more or fewer keys; the entries written
    by the forward itself (the question, a decoded token) are the last columns of every layer. A wider mask keeps
    its last ``key_length`` columns (as :func:`bias_mask` does for biased layers; eager attention would otherwise
    take the first ones and lose the question's causal pattern, sdpa raises a size mismatch); a narrower one gets
    ``key_length - K'`` leading columns that every query may attend (the older prompt entries, which precede every
    query of the forward). A mask that already fits, or anything but a 4-d tensor (``None``, a flex ``BlockMask``),
    is returned as is, so a model whose layers hold equal lengths computes exactly what it computes without this.

    Args:
        attention_mask: ``None`` or a boolean keep-mask / additive float mask ``(B|1, 1|H_Q, q, K')``.
        key_length: ``K``, the layer's key count (its cache after this forward's update).

    Returns:
        The mask ``(..., q, K)`` (a view of the model's mask when it is cut), or ``attention_mask`` itself.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return attention_mask
    width = attention_mask.shape[-1]
    if width == key_length:
        return attention_mask
    if width > key_length:
        return attention_mask[..., width - key_length :]
    shape = (*attention_mask.shape[:-1], key_length - width)
    allowed = attention_mask.new_ones(shape) if attention_mask.dtype == torch.bool else attention_mask.new_zeros(shape)
    return torch.cat([allowed, attention_mask], dim=-1)


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
    check_fit(state, B, G, K)
    bias = state.bias
    P = state.prefix_len
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
        ValueError: if the cache is shorter than the prefix or the batch / group sizes disagree (:func:`check_fit`).
    """
    B, G, K = key.shape[0], key.shape[1], key.shape[2]
    check_fit(state, B, G, K)
    P = state.prefix_len
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


def biased_attention(module, query, key, value, attention_mask, state: AttentionBias, call, name: str, args, kwargs):
    """One attention call of a layer whose cache carries a decode-time bias (after the prefill).

    The one-token step goes through the Triton decode kernel when the dispatch picks it (CUDA); otherwise the
    layer runs in float32 (cast back to the model's dtype at the end) with the float mask of :func:`bias_mask`:
    through :func:`grouped_sdpa` for plain ``sdpa`` calls (no dropout, sliding window, soft-cap, requested
    weights or kvpress key masking), else through the wrapped function ``call``.

    Args:
        module: the attention module; query ``(B, H_Q, q, d)``; key, value ``(B, G, K, d)`` (``K >= P``);
            attention_mask: the model's mask or None.
        state: the layer's :class:`AttentionBias`.
        call: the wrapped attention function, ``call(module, query, key, value, mask, *args, **kwargs)``.
        name: ``"sdpa"`` or ``"eager"``, the implementation being wrapped.
        args, kwargs: the rest of the call, passed on.

    Returns:
        ``(output (B, q, H_Q, d), weights or None)`` in the model's dtype.

    Raises:
        ValueError: if the bias does not match the layer's cache (:func:`bias_mask`).
    """
    fast = _kernel_decode(module, query, key, value, attention_mask, state, kwargs)
    if fast is not None:
        return fast
    model_dtype = None
    if query.dtype != torch.float32:
        # the correction in full precision: a float mask must have the query's dtype (sdpa) or is added to logits
        # of that dtype (eager), which would round the fp32 log-weights (bf16: 0.123456 -> 0.12354); the biased
        # layer runs in float32 instead and its output is cast back
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
        return _in_dtype(grouped_sdpa(query, key, value, attention_mask, kwargs.get("scaling")), model_dtype)
    return _in_dtype(call(module, query, key, value, attention_mask, *args, **kwargs), model_dtype)
