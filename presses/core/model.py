"""Where a causal LM keeps what the presses read: its decoder stack, layers, attention modules and text config.

The one place in the project that knows the layout (``model.model.layers[i].self_attn``, or
``model.model.language_model.layers`` for multimodal wrappers such as Gemma3's); the presses, the harness
and the studies import these instead of re-deriving it.
"""

from __future__ import annotations

__all__ = [
    "attention_modules",
    "decoder_layers",
    "language_model",
    "max_positions",
    "sliding_layers",
    "text_config",
]


def language_model(model):
    """The decoder stack of a causal LM: ``model.model.language_model`` for multimodal wrappers, else
    ``model.model``."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def decoder_layers(model):
    """The decoder layers of a causal LM (each with ``self_attn``), a ``ModuleList``."""
    return language_model(model).layers


def attention_modules(model) -> list:
    """The attention module of every decoder layer, in layer order (the modules kvpress hooks)."""
    return [layer.self_attn for layer in decoder_layers(model)]


def text_config(model):
    """The text model's config (``config.text_config`` for multimodal wrappers, else ``config``)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def max_positions(model) -> int | None:
    """The most positions ``model`` takes: ``max_position_embeddings``, or ``factor x
    original_max_position_embeddings`` when a YaRN / dynamic / LongRoPE scaling extends it further; None when
    the config does not say.

    Args:
        model: a causal LM, or its decoder stack (:func:`language_model`; its ``config`` is the text config).
    """
    cfg = text_config(model)
    limit = getattr(cfg, "max_position_embeddings", None)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if limit and kind in ("yarn", "dynamic", "longrope") and rope.get("factor"):
        limit = max(limit, int(rope["factor"] * rope.get("original_max_position_embeddings", limit)))
    return int(limit) if limit else None


def sliding_layers(model) -> dict[int, int]:
    """The layers whose attention sees only a sliding window of recent positions, with their window.

    From the text config: ``sliding_window`` applies to the layers ``layer_types`` marks ``"sliding_attention"``
    (Gemma2, Gemma3, Qwen2 with ``use_sliding_window``), or to every layer when the config has no ``layer_types``
    (Mistral, Phi-3). A window no shorter than ``max_position_embeddings`` never excludes a position the model can
    take (Phi-3.5-mini's 262144 against 131072 positions), so its layers count as full.

    transformers masks such a layer by cache slot (``kv_idx > q_idx - window``), not by original position: after a
    press removed entries, the last ``window`` slots reach positions outside the window (transformers PR #40039).
    The presses therefore leave these layers whole (:mod:`presses.base`).

    Returns:
        ``{layer index: window}``, empty for a model without sliding-window layers.
    """
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    limit = getattr(cfg, "max_position_embeddings", None)
    if not window or (limit and window >= limit):
        return {}
    types = getattr(cfg, "layer_types", None)
    n = cfg.num_hidden_layers
    return {i: int(window) for i in range(n) if types is None or types[i] == "sliding_attention"}
