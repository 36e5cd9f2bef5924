"""Input guards of the harness: turn the kvpress baselines' asserts and obscure failures into clear errors.

kvpress's baselines check their inputs with ``assert`` (silently skipped under ``python -O``) or not at
all; the per-press limits live in the registry (:func:`evaluation.registry.press_input_problem`). Every press
needs a Llama-style decoder (``model.model.layers[i].self_attn`` with a ``q_proj``). :func:`check_press_input`
raises a ``ValueError`` naming the value and the limit before the prefill instead. This project's presses
validate their own input; they only get the model-layout check here. ``tests/test_robustness.py``.
"""

from __future__ import annotations

from evaluation.registry import press_input_problem

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
    compression) is not checked. The press-specific limits come from the registry
    (:func:`evaluation.registry.press_input_problem`).

    Args:
        press: the instantiated press (kvpress or ours), or None.
        model: the causal LM.
        context_length: ``T``, prefill tokens of the example.
        multi_token_forward: True when a forward of more than one token follows the prefill on the
            compressed cache (kvpress's pipeline runs the question and answer prefix as one forward).

    Raises:
        ValueError: for an unsupported model layout, or a limit of the press (see the registry).
    """
    if press is None:
        return
    check_model_layout(model)
    problem = press_input_problem(press, model, context_length, multi_token_forward)
    if problem:
        raise ValueError(problem)
