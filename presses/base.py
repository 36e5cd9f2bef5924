"""The contract of this project's presses: what the harness, the sweeps and the scripts may rely on.

Every press of this project (:class:`presses.PageEntroKVPress`, :class:`presses.ProbabilisticEvictionPress`,
:class:`presses.EntroPrefillPress`) is a kvpress press (``with press(model): ...``, kvpress's pipeline)
and a :class:`ResearchPress`:

- :attr:`ResearchPress.capabilities`, a :class:`Capabilities`: what the harness reads instead of class names;
- :meth:`ResearchPress.reset`: the one per-request reset, called at the start of every prefill (by a forward
  pre-hook on the language model that every press of this project registers);
- :meth:`ResearchPress.check_wrappers`: refuse, before any compute, a wrapper the press cannot work in;
- :meth:`ResearchPress.summary`: statistics of the last prefill, written to each prediction row;
- :meth:`ResearchPress.export_decode_state` / :meth:`ResearchPress.import_decode_state`: the per-layer
  decode-time state (an :class:`presses.attention_bias.AttentionBias`), so a sweep can decode several
  presses' caches as one batch.

Wrappers. kvpress's wrappers (``ComposedPress``, ``PrefillDecodingPress``, ``AdaKVPress``...) call an inner
press's ``post_init_from_model`` and ``forward_hook`` / ``compress`` / ``score``, never its ``__call__``. So a
press must not depend on its own ``__call__``: setup happens in :meth:`ResearchPress.post_init_from_model`,
and hooks a press needs beyond the attention hooks (on the language model or the decoder layers) are
declared by :meth:`ResearchPress.model_hooks` and registered there. Those hooks act only while the press is
in use: at every call they check that an attention forward hook of the model belongs to this press or to a
wrapper holding it (:func:`press_in_use`), and remove themselves otherwise; once they have seen that hook,
they are removed together with it, when the outermost ``with`` block exits. ARCHITECTURE.md shows the flow.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpress.presses.base_press import BasePress

from presses.attention_bias import install_biases, take_biases

__all__ = [
    "Capabilities",
    "ResearchPress",
    "press_in_use",
    "active_hook",
    "wrapper_path",
    "decoder_layers",
    "language_model",
]


@dataclass(frozen=True)
class Capabilities:
    """What a press can do, as the harness reads it (never from the class name).

    Attributes:
        shares_prefill: the press compresses in attention forward hooks after each layer's attention output is
            computed and leaves that output unchanged, so its cache can be rebuilt by replaying its hooks on one
            recorded uncompressed prefill (``evaluation.fused``).
        needs_question: the press needs the question inside the compressed context (``query_aware=true``).
        changes_prefill: the press changes the prefill itself (hidden states or positions of later layers).
        decode_state: the press leaves per-layer decode-time state on the attention modules
            (:meth:`ResearchPress.export_decode_state`).
        needs_eager: the press reads the layers' attention weights (``attn_implementation="eager"``).
        composable: the press may share a ``ComposedPress`` with other presses (see each press's docstring).
        extra_forwards: the press runs the model again on the context (more forward passes than the prefill's own,
            e.g. to rebuild or re-score it), so no recorded prefill stands for its work.
    """

    shares_prefill: bool = True
    needs_question: bool = False
    changes_prefill: bool = False
    decode_state: bool = False
    needs_eager: bool = False
    composable: bool = True
    extra_forwards: bool = False


def language_model(model):
    """The decoder stack of a causal LM (``model.model.language_model`` for multimodal wrappers, else
    ``model.model``)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def decoder_layers(model):
    """The decoder layers of a causal LM (each with ``self_attn``)."""
    return language_model(model).layers


def wrapper_path(owner: Any, press: Any, depth: int = 4) -> list | None:
    """The chain of presses from ``owner`` down to ``press`` through dataclass fields and lists, or None.

    ``wrapper_path(ComposedPress([a, b]), b) == [ComposedPress([a, b]), b]``; ``wrapper_path(a, a) == [a]``.
    """
    if owner is press:
        return [owner]
    if depth == 0:
        return None
    children: list = []
    if dataclasses.is_dataclass(owner) and not isinstance(owner, type):
        for f in dataclasses.fields(owner):
            value = getattr(owner, f.name, None)
            children.extend(value if isinstance(value, (list, tuple)) else [value])
    for child in children:
        if child is None or isinstance(child, (int, float, str, bool)):
            continue
        path = wrapper_path(child, press, depth - 1)
        if path is not None:
            return [owner, *path]
    return None


def press_in_use(model, press) -> list | None:
    """The wrapper chain through which ``press`` is active on ``model``, or None when it is not in use.

    See :func:`active_hook`.
    """
    found = active_hook(model, press)
    return None if found is None else found[0]


def active_hook(model, press) -> tuple[list, Any] | None:
    """``(wrapper chain, hook)`` for the attention forward hook through which ``press`` is active, or None.

    A press is in use while an attention forward hook of ``model`` is a bound method of the press itself or
    of a press that holds it (kvpress registers ``self.forward_hook`` of the outermost press on every layer);
    a hook wrapped with ``functools.wraps`` (e.g. a timer) is unwrapped first.
    """
    for layer in decoder_layers(model):
        for hook in layer.self_attn._forward_hooks.values():
            owner = getattr(inspect.unwrap(hook), "__self__", None)
            if owner is not None:
                path = wrapper_path(owner, press)
                if path is not None:
                    return path, hook
    return None


def _remove_handles(handles: list) -> None:
    """Remove hook handles (idempotent: a removed handle's removal is a no-op)."""
    for handle in handles:
        handle.remove()


class ResearchPress(BasePress):
    """Base class of this project's presses (see the module docstring for the contract).

    Subclasses are dataclasses; they set :attr:`capabilities`, implement :meth:`reset` and :meth:`summary`,
    and, when they need hooks beyond the attention hooks, :meth:`model_hooks`.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()

    # ------------------------------------------------------------------ per request
    def reset(self) -> None:
        """Forget the state of the previous request. Called at the start of every prefill (by the press's
        first hook of that prefill), so no request sees another's statistics or draws."""

    def summary(self) -> dict[str, Any]:
        """Statistics of the last prefill (a flat dict of numbers and strings; ``{}`` before the first)."""
        return {}

    # ------------------------------------------------------------------ decode-time state
    def export_decode_state(self, model) -> tuple:
        """Take the decode-time state the last prefill left on ``model`` off its attention modules.

        Returns:
            One entry per decoder layer: a :class:`presses.attention_bias.AttentionBias` (bias ``(B, G, P)``)
            or ``None``. The modules are cleared.
        """
        return take_biases(model)

    def import_decode_state(self, model, states: tuple) -> None:
        """Put decode-time state (as :meth:`export_decode_state` returned it) back on ``model``.

        Raises:
            ValueError: if ``states`` does not have one entry per decoder layer.
        """
        if len(states) != len(decoder_layers(model)):
            raise ValueError(f"decode state has {len(states)} layers, the model has {len(decoder_layers(model))}")
        install_biases(model, [states])

    # ------------------------------------------------------------------ hooks beyond the attention hooks
    def check_wrappers(self, path: list) -> None:
        """Raise a ``ValueError`` when the press cannot work inside the wrappers that hold it.

        Called at the start of every prefill with ``path``, the chain of presses from the outermost one
        registered on the model down to this press (``[self]`` when used directly; see :func:`wrapper_path`).
        Accepts everything by default.
        """

    def model_hooks(self, model) -> list[tuple[Any, str, Callable]]:
        """Hooks the press needs besides kvpress's attention forward hooks.

        Returns:
            ``(module, kind, function)`` triples, ``kind`` one of ``"forward_pre"`` or ``"forward"`` (both
            registered ``with_kwargs=True``). The default is one forward pre-hook on the language model that
            calls :meth:`check_wrappers` and :meth:`reset` when a prefill starts (an empty or absent cache);
            subclasses extend the list.
        """
        return [(language_model(model), "forward_pre", self._prefill_start_hook)]

    def _prefill_start_hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length() == 0:
            self.check_wrappers(self.__dict__.get("_wrapper_path") or [self])
            self.reset()

    def post_init_from_model(self, model):
        """Read what the press needs from ``model`` and register :meth:`model_hooks` (kvpress calls this on
        entering ``with press(model)``, and wrappers call it on their inner presses)."""
        self._detach_model_hooks()
        handles = []
        for module, kind, fn in self.model_hooks(model):
            guarded = self._guarded(model, fn)
            if kind == "forward_pre":
                handles.append(module.register_forward_pre_hook(guarded, with_kwargs=True))
            elif kind == "forward":
                handles.append(module.register_forward_hook(guarded, with_kwargs=True))
            else:
                raise ValueError(f"hook kind {kind!r} must be 'forward_pre' or 'forward'")
        self.__dict__["_model_hook_handles"] = handles

    def _guarded(self, model, fn: Callable) -> Callable:
        def hook(*args):
            found = active_hook(model, self)
            if found is None:  # the press (or its wrapper) left the model
                self._detach_model_hooks()
                return None
            path, attention_hook = found
            watched = self.__dict__.get("_watched")
            if watched is None or watched() is not attention_hook:
                # kvpress removes the attention hooks when the outermost `with` exits: leave with them
                weakref.finalize(attention_hook, _remove_handles, self.__dict__.get("_model_hook_handles", []))
                self.__dict__["_watched"] = weakref.ref(attention_hook)
            self.__dict__["_wrapper_path"] = path
            return fn(*args)

        return hook

    def _detach_model_hooks(self) -> None:
        self.__dict__.pop("_watched", None)
        _remove_handles(self.__dict__.pop("_model_hook_handles", []))

    @contextmanager
    def __call__(self, model):
        """kvpress's context manager; the model hooks are removed on exit too."""
        try:
            with super().__call__(model):
                yield
        finally:
            self._detach_model_hooks()
