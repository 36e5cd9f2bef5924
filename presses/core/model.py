"""Where a causal LM keeps what the presses read: its decoder stack, layers, attention modules and text config.

The one place in the project that knows the layout (``model.model.layers[i].self_attn``, or
``model.model.language_model.layers`` for multimodal wrappers such as Gemma3's); the presses, the harness
and the studies import these instead of re-deriving it.
"""

from __future__ import annotations

__all__ = ["attention_modules", "decoder_layers", "language_model", "text_config"]


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
