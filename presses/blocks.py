"""What every kvpress ``with press(model)`` block gets from this project, whatever the press (issue 32).

:mod:`presses.base` wraps kvpress's ``BasePress.__call__`` once (every kvpress press and wrapper enters through it);
on entering a block it calls :func:`check_model` and :func:`skip_sliding_layers`, and the outermost block on a model
registers :func:`chunk_guard`:

- **a compiled model is refused** (:func:`check_model`): hooks registered after ``torch.compile`` do not run in the
  compiled graph (pytorch #117758), so no press would compress it, silently;
- **sliding-window layers stay whole** (:func:`skip_sliding_layers`): transformers masks such a layer by cache slot,
  so after eviction a decoded token's last ``window`` slots reach positions outside its window (transformers PR
  #40039); the press's attention hook passes over them (:func:`presses.core.model.sliding_layers`), and a model
  whose sliding mask is built from a full-attention layer (layer 0) that a press would compress is refused;
- **a prompt in chunks is refused** (:func:`chunk_guard`): a forward of more than one token on a cache that a
  prefill filled inside the same block (``generate(..., prefill_chunk_size=...)``, a serving loop) would be stored
  uncompressed after the compressed first chunk, silently over budget (kvpress's presses compress only a forward
  that starts at position 0); single-token decoding inside the block and a question forward in a later block (kvpress's
  pipeline with a ``PrefillDecodingPress``) are untouched.
"""

from __future__ import annotations

import logging
import sys
import weakref

from presses.core.model import language_model, sliding_layers

__all__ = ["check_model", "skip_sliding_layers", "restore_hook", "chunk_guard"]

logger = logging.getLogger(__name__)

_WARNED: weakref.WeakSet = weakref.WeakSet()  # models whose whole sliding layers were reported once


def _compiled(model) -> str | None:
    """How ``model`` (or a module or forward of it) was compiled, or None. (Without ``torch._dynamo`` imported
    nothing was compiled: it is not imported here.)"""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return "torch.compile(model)"
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"{name or 'model'}.compile()"
        if getattr(module.forward, "_torchdynamo_orig_callable", None) is not None:
            return f"torch.compile({name or 'model'}.forward)"
    return None


def check_model(model) -> None:
    """Refuse a model no press can hook reliably, before any hook is registered.

    Raises:
        ValueError: for a compiled model (naming how it was compiled) or a model whose sliding-window mask is built
            from layer 0 while layer 0 is a full-attention layer (naming the layers).
    """
    how = _compiled(model)
    if how is not None:
        raise ValueError(
            f"the model is compiled ({how}): hooks registered after torch.compile do not run in the compiled graph "
            "(pytorch #117758), so the press would not compress; enter `with press(model)` on the uncompiled model"
        )
    sliding = sliding_layers(model)
    if sliding and 0 not in sliding:
        raise ValueError(
            f"layers {sorted(sliding)} use a sliding window but layer 0 does not: transformers builds their mask from "
            "layer 0's cache length, which a press shortens, so they would attend the wrong window; not supported"
        )


def skip_sliding_layers(press, model) -> bool:
    """Make ``press``'s attention hook leave the sliding-window layers of ``model`` whole (until
    :func:`restore_hook`), logging them once per model.

    kvpress's ``BasePress.__call__`` registers ``press.forward_hook`` on every attention layer; an instance attribute
    of that name, set before the call, is what it registers. Returns whether one was set.
    """
    sliding = sliding_layers(model)
    if not sliding or "forward_hook" in press.__dict__:
        return False
    if model not in _WARNED:
        _WARNED.add(model)
        logger.warning(
            "layers %s attend a sliding window (%s positions): the presses leave them uncompressed",
            sorted(sliding),
            sorted(set(sliding.values())),
        )
    hook = press.forward_hook

    def forward_hook(module, input, kwargs, output):
        if module.layer_idx in sliding:
            return output
        return hook(module, input, kwargs, output)

    press.__dict__["forward_hook"] = forward_hook
    return True


def restore_hook(press) -> None:
    """Undo :func:`skip_sliding_layers`."""
    press.__dict__.pop("forward_hook", None)


def chunk_guard(model):
    """A forward pre-hook for the language model of ``model`` that refuses a prompt arriving in chunks (module
    docstring). Register it ``with_kwargs=True`` while the outermost block on the model is open.

    Raises (from the hook):
        ValueError: for a forward of more than one token on a cache that a prefill inside the block filled, naming
            the tokens and the cache length.
    """
    prefilled: weakref.WeakSet = weakref.WeakSet()

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None:
            return None
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        stored = cache.get_seq_length()
        if stored == 0:
            prefilled.add(cache)
        elif tokens is not None and tokens.shape[1] > 1 and cache in prefilled:
            raise ValueError(
                f"a forward of {tokens.shape[1]} tokens on a cache of {stored} entries that this `with press(model)` "
                "block prefilled: a prompt in chunks (prefill_chunk_size, a serving loop) would be stored "
                "uncompressed after the compressed first chunk; prefill the whole prompt in one forward inside the "
                "block, and the question or decoding outside it"
            )
        return None

    return language_model(model).register_forward_pre_hook(hook, with_kwargs=True)
