"""Input guards of the harness: turn the kvpress baselines' asserts and obscure failures into clear errors.

kvpress's baselines check their inputs with ``assert`` (silently skipped under ``python -O``) or not at
all: SnapKV / PyramidKV / AdaKV(SnapKV) assert ``T > window_size``, StreamingLLM and ExpectedAttention
assert ``T > n_sink``, TOVA fails inside ``Tensor.max()`` on a one-token context, AdaKV asserts against
eager attention, PyramidKV's per-layer lengths break the eager decode mask and the mask of any
multi-token forward after the prefill (the pipeline's question forward), and every press needs a
Llama-style decoder (``model.model.layers[i].self_attn`` with
a ``q_proj``). :func:`check_press_input` raises a ``ValueError`` naming the value and the limit before the
prefill instead. Our presses (Page-EntroKV, probabilistic eviction, EntroPrefill) validate their own
input; they only get the model-layout check here. Issue 8 (robustness); ``tests/test_robustness.py``.
"""

from __future__ import annotations

__all__ = ["check_model_layout", "check_press_input"]


def _decoder_layers(model):
    """The decoder layers of a causal LM (``model.model.layers`` or ``model.model.language_model.layers``)."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    return getattr(inner, "layers", None)


def check_model_layout(model) -> None:
    """Raise unless ``model`` has the decoder layout every press hooks into.

    Presses hook ``model.model.layers[i].self_attn`` (kvpress's ``BasePress.__call__``) and project window
    queries with its ``q_proj`` (or Phi-3's ``qkv_proj``) using ``config.num_attention_heads`` and
    ``num_key_value_heads``.

    Raises:
        ValueError: naming the model class and what is missing.
    """
    name = type(model).__name__
    layers = _decoder_layers(model)
    if layers is None or len(layers) == 0:
        raise ValueError(f"model class {name} is not supported by the presses: they need a decoder-only causal "
                         "LM with its layers at model.model.layers (Llama, Mistral, Qwen2/3, Phi-3, Gemma3)")
    attn = getattr(layers[0], "self_attn", None)
    if attn is None or not (hasattr(attn, "q_proj") or hasattr(attn, "qkv_proj")) or not hasattr(attn, "layer_idx"):
        raise ValueError(f"model class {name} is not supported by the presses: its decoder layers need a "
                         "Llama-style self_attn with q_proj (or qkv_proj) and layer_idx, got "
                         f"{type(attn).__name__ if attn is not None else 'no self_attn'}")
    cfg = getattr(model.config, "text_config", None) or model.config
    if not hasattr(cfg, "num_attention_heads"):
        raise ValueError(f"model class {name} is not supported by the presses: config.num_attention_heads is missing")


def check_press_input(press, model, context_length: int, multi_token_forward: bool = False) -> None:
    """Raise a clear error for a (press, model, context) the press cannot compress.

    Call once per example, after tokenising the context and before the prefill. ``press=None`` (no
    compression) is not checked. A press at ``compression_ratio == 0`` never scores, so only the
    model layout is checked then.

    Args:
        press: the instantiated press (kvpress or ours), or None.
        model: the causal LM.
        context_length: ``T``, prefill tokens of the example.
        multi_token_forward: True when a forward of more than one token follows the prefill on the
            compressed cache (kvpress's pipeline runs the question and answer prefix as one forward).

    Raises:
        ValueError: for an unsupported model layout; ``T <= window_size`` (SnapKV, PyramidKV, AdaKV
            over a windowed scorer); ``T <= n_sink`` (StreamingLLM, ExpectedAttention); ``T < 2``
            (TOVA); AdaKV or PyramidKV with ``attn_implementation="eager"``; PyramidKV followed by a
            multi-token forward.
    """
    if press is None:
        return
    check_model_layout(model)
    from kvpress import AdaKVPress, ExpectedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress, TOVAPress

    inner = press.press if isinstance(press, AdaKVPress) else press
    ratio = getattr(inner, "compression_ratio", None)
    if not ratio:
        return
    label = type(press).__name__ if inner is press else f"{type(press).__name__}({type(inner).__name__})"
    T = int(context_length)
    if isinstance(press, AdaKVPress) and getattr(model.config, "_attn_implementation", None) == "eager":
        raise ValueError(f"{label} does not support attn_implementation='eager' (its key masking patches sdpa "
                         "and flash attention only): use sdpa")
    if isinstance(inner, PyramidKVPress) and getattr(model.config, "_attn_implementation", None) == "eager":
        raise ValueError(f"{label} keeps a different number of entries per layer, which the eager attention "
                         "mask of the decode step cannot follow (size mismatch): use sdpa")
    if isinstance(inner, PyramidKVPress) and multi_token_forward:
        raise ValueError(f"{label} keeps a different number of entries per layer, but transformers builds the "
                         "attention mask of a multi-token forward after the prefill (the question) from layer 0's "
                         "cache length, so the other layers fail with a size mismatch: it cannot answer questions "
                         "through kvpress's pipeline (kvpress 0.5.5, transformers 5.x)")
    if isinstance(inner, SnapKVPress) and T <= inner.window_size:  # PyramidKVPress subclasses SnapKVPress
        raise ValueError(f"{label}: the context has T={T} tokens but needs more than window_size="
                         f"{inner.window_size}: use a longer context or a smaller press.window_size")
    if isinstance(inner, (StreamingLLMPress, ExpectedAttentionPress)) and T <= inner.n_sink:
        raise ValueError(f"{label}: the context has T={T} tokens but needs more than n_sink={inner.n_sink}")
    if isinstance(inner, TOVAPress) and T < 2:
        raise ValueError(f"{label}: the context has T={T} tokens but needs at least 2 (it scores the keys "
                         "before the last token)")
