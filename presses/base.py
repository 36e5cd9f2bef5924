"""The contract of this project's presses: what the harness, the sweeps and the scripts may rely on.

Every press of this project (:class:`presses.PageEntroKVPress`, :class:`presses.ProbabilisticEvictionPress`,
:class:`presses.EntroPrefillPress`) is a kvpress press (``with press(model): ...``, kvpress's pipeline)
and a :class:`ResearchPress`:

- :attr:`ResearchPress.capabilities`, a :class:`Capabilities`: what the harness reads instead of class names;
- :meth:`ResearchPress.reset`: the one per-request reset, called at the start of every prefill (by a forward
  pre-hook on the language model that every press of this project registers);
- :meth:`ResearchPress.check_wrappers`: refuse, before any compute, a wrapper the press cannot work in;
- :meth:`ResearchPress.check_cache`: refuse, before any compute, a cache kind the press cannot compress;
- :meth:`ResearchPress.summary`: statistics of the last prefill, written to each prediction row, with the
  standard key ``kept_entries`` (:data:`KEPT_ENTRIES`);
- :meth:`ResearchPress.export_decode_state` / :meth:`ResearchPress.import_decode_state`: the per-layer
  decode-time state (an :class:`presses.attention_bias.AttentionBias`) of the cache it was computed for, the only
  way it leaves the press, so a sweep can decode several presses' caches as one batch;
- :meth:`ResearchPress.sharing`: a sweep's memo for intermediates that do not depend on the press's options.

Wrappers. kvpress's wrappers (``ComposedPress``, ``PrefillDecodingPress``, ``AdaKVPress``...) call an inner
press's ``post_init_from_model`` and ``forward_hook`` / ``compress`` / ``score``, never its ``__call__``. So a
press must not depend on its own ``__call__``: setup happens in :meth:`ResearchPress.post_init_from_model`,
and hooks a press needs beyond the attention hooks (on the language model or the decoder layers) are
declared by :meth:`ResearchPress.model_hooks` and registered there. Those hooks act only while the press is
in use (:func:`press_in_use`): this module tracks which kvpress presses are inside their ``with press(model)``
block, per model, by wrapping kvpress's ``BasePress.__call__`` once (every kvpress press and wrapper enters
through it), and removes a press's model hooks when the outermost press holding it leaves the model. The same
wrap gives every block the checks of :mod:`presses.blocks` (a compiled model refused, sliding-window layers left
whole, a prompt in chunks refused). ARCHITECTURE.md shows the flow.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from kvpress.presses.base_press import BasePress
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import DynamicLayer

from presses import attention, blocks
from presses.core.model import language_model, max_positions

__all__ = [
    "Capabilities",
    "KEPT_ENTRIES",
    "RemovedField",
    "SAVED_BEFORE",
    "cache_problem",
    "check_prompt_positions",
    "ResearchPress",
    "held_presses",
    "kept_entries_text",
    "press_in_use",
    "wrapper_path",
]

#: The standard key of every press summary: the kept cache entries per KV head, one number per layer, comma-
#: separated (a float where KV heads keep different counts: their mean). The harness reads effective compression
#: from it, ``1 - mean(kept) / T``, with no press-specific key.
KEPT_ENTRIES = "kept_entries"

#: Dataclass field metadata key: the value a press field had in effect before the field existed. A run directory
#: whose saved settings lack the field ran with that value, not with today's default
#: (:func:`evaluation.settings.saved_run_settings`), e.g. ``ProbabilisticEvictionPress.draws``.
SAVED_BEFORE = "saved_before"


class RemovedField(NamedTuple):
    """A field a press class once had and no longer has (:attr:`ResearchPress.removed_fields`), the converse of
    :data:`SAVED_BEFORE`.

    Attributes:
        value: the value the field had in every press the class still builds: a saved run listing the field at this
            value ran today's press (:func:`evaluation.settings.saved_press` reads the field as absent).
        moved_to: where the field's other values live now (a class path), named in the one line that refuses a
            saved run listing another value.
    """

    value: Any
    moved_to: str


@dataclass(frozen=True)
class Capabilities:
    """What a press can do, as the harness reads it (never from the class name).

    Attributes:
        shares_prefill: the press compresses in attention forward hooks after each layer's attention output is
            computed and leaves that output unchanged, so its cache can be rebuilt by replaying its hooks on one
            recorded uncompressed prefill (``evaluation.fused``).
        needs_question: the press needs the question inside the compressed context (``query_aware=true``).
        changes_prefill: the press changes the prefill itself (hidden states or positions of later layers).
        decode_state: the press leaves per-layer decode-time state on the layers of the cache it compressed
            (:mod:`presses.attention`; :meth:`ResearchPress.export_decode_state`).
        needs_eager: the press reads the layers' attention weights (``attn_implementation="eager"``).
        composable: the press may share a ``ComposedPress`` with other presses (see each press's docstring).
        scores_once: after an uncompressed prefill the press runs the model again on that cache to score it (KVzip's
            context reconstruction; or reads the scores in the prefill: ``prefill_scores``), and the scores do not
            depend on the compression ratio: a sweep scores once per example and selects per ratio
            (``evaluation.kvzip_path``) instead of replaying hooks.
        needs_delimiter: the press finds the question inside the context by a delimiter token that must be added
            to the tokenizer and the model's embeddings (Finch), between the document and the question
            (``evaluation.prompt_delimiter``).
        uneven_layers: the press may leave different cache lengths per layer, which the attention masks
            transformers builds from one layer's length do not fit: the harness installs the project's attention
            wrapper (:func:`presses.attention.install`, :func:`presses.attention_bias.fit_mask`) before it runs.
        extra_forwards: the press runs the model again on the context (more forward passes than the prefill's own,
            e.g. to rebuild or re-score it), so no recorded prefill stands for its work.
        scores_as: with ``scores_once``, the class whose scores the press's pass computes when they are another
            class's (KVzip's, for this project's KVzip subclasses): a sweep scores both from one pass; None: its own.
        selection_fields: with ``scores_once``, the press's fields that only its selection reads (besides the
            ratio): presses differing only in them share one score tensor (``evaluation.kvzip_path``).
        pass_as: with ``scores_once``, the class whose reconstruction pass (its chunks and forwards) the press runs
            when it is another class's though its scores are its own (KVzip's, for Page-EntroKV's reconstruction
            observers): a sweep runs one pass for both and each scores it; None: ``scores_as``, else its own class.
        empty_scores: with ``pass_as``, the press's zero scores ``(model, T, device) -> tensor`` when they have another
            shape than kvpress's ``(L, 1, G, T)`` (a pass another press leads starts the press's scores from them);
            None: kvpress's shape.
        prefill_scores: with ``scores_once``, a press that reads its scores in the prefill itself, with no pass
            after it: ``(model, layer_calls) -> (L, 1, G, T)`` scores from every attention layer's call of the
            uncompressed prefill, ``layer_calls[i] = (args, kwargs, output)`` as its forward hooks saw it (a sweep
            gives it the shared prefill's, ``evaluation.kvzip_path``); None: a reconstruction pass scores it.
    """

    shares_prefill: bool = True
    needs_question: bool = False
    changes_prefill: bool = False
    decode_state: bool = False
    needs_eager: bool = False
    composable: bool = True
    scores_once: bool = False
    needs_delimiter: bool = False
    uneven_layers: bool = False
    extra_forwards: bool = False
    scores_as: type | None = None
    selection_fields: tuple[str, ...] = ()
    pass_as: type | None = None
    empty_scores: Callable[..., Any] | None = None
    prefill_scores: Callable[..., Any] | None = None


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


def held_presses(owner: Any, depth: int = 4):
    """``owner`` and every press it holds through dataclass fields and lists (:func:`wrapper_path`'s traversal)."""
    yield owner
    if depth == 0 or not (dataclasses.is_dataclass(owner) and not isinstance(owner, type)):
        return
    for f in dataclasses.fields(owner):
        value = getattr(owner, f.name, None)
        for child in value if isinstance(value, (list, tuple)) else [value]:
            if child is not None and not isinstance(child, (int, float, str, bool)):
                yield from held_presses(child, depth - 1)


def cache_problem(cache, quantized: bool = False) -> str | None:
    """Why a press of this project cannot compress ``cache``, or None (issue 32 item 5).

    The presses replace a layer's ``keys`` and ``values`` by shorter tensors after its attention: a ``DynamicCache``
    (its layers ``DynamicLayer``, sliding-window ones included) takes that; a ``StaticCache`` writes later tokens at
    fixed slots of preallocated tensors, an offloading cache (``DynamicCache(offloading=True)``, transformers' former
    ``OffloadedCache``) has moved the layer off the device by then, and a ``QuantizedCache`` keeps most entries in its
    quantized storage (only a press that compresses through kvpress's ``forward_hook``, which prunes that storage,
    takes it: ``quantized=True``).

    Returns:
        A one-line reason naming the cache class, or None (also for ``cache=None``).
    """
    if cache is None:
        return None
    name = type(cache).__name__
    if getattr(cache, "offloading", False):
        return f"{name}(offloading=True) moves each layer off the device before the press compresses it"
    if isinstance(cache, QuantizedCache):
        return None if quantized else f"{name} keeps the entries in quantized storage, which this press cannot prune"
    if not isinstance(cache, DynamicCache) or any(not isinstance(layer, DynamicLayer) for layer in cache.layers):
        return f"{name} stores entries at fixed slots, which a shorter layer cannot follow"
    return None


def check_prompt_positions(model, args: tuple, kwargs: dict, name: str) -> None:
    """Refuse a prefill longer than the model's positions (:func:`presses.core.model.max_positions`), as the harness
    refuses such an example (``evaluation.guards.check_model_input``): a RoPE model computes positions past
    ``max_position_embeddings`` without an error, on rotations it was never trained on.

    Args:
        model: the causal LM or its decoder stack.
        args, kwargs: the decoder stack's forward arguments (``input_ids`` or ``inputs_embeds``, ``(B, T, ...)``).
        name: the press, for the message.

    Raises:
        ValueError: naming the prompt length ``T`` and ``max_position_embeddings``.
    """
    x = kwargs.get("input_ids")
    x = kwargs.get("inputs_embeds") if x is None else x
    x = args[0] if x is None and args else x
    limit = max_positions(model)
    if x is not None and limit is not None and x.shape[1] > limit:
        raise ValueError(
            f"{name}: the prompt has {x.shape[1]} tokens, more than the model's max_position_embeddings={limit} "
            f"(positions past it were never trained, and the model computes them without an error); use a prompt "
            f"of at most {limit} tokens"
        )


def kept_entries_text(kept) -> str:
    """The :data:`KEPT_ENTRIES` value: kept entries per KV head, one number per layer, comma-separated."""
    return ",".join(repr(float(k)) for k in kept)  # exact: effective compression is computed from it


#: Per model, the kvpress presses whose ``with press(model)`` block is open, outermost first.
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def press_in_use(model, press) -> list | None:
    """The wrapper chain through which ``press`` is in use on ``model`` (``[outer, ..., press]``), or None.

    A press is in use while the ``with`` block of a press that holds it (or its own) is open on ``model``
    (kvpress's ``BasePress.__call__``, tracked by this module); the innermost such block wins.
    """
    for outer in reversed(_ACTIVE.get(model, [])):
        path = wrapper_path(outer, press)
        if path is not None:
            return path
    return None


def _track_kvpress_blocks() -> None:
    """Wrap kvpress's ``BasePress.__call__`` once so that :func:`press_in_use` knows the open ``with`` blocks, and
    a press's model hooks leave with the last block that holds it (see the module docstring)."""
    if getattr(BasePress.__call__, "_kvpress_research_tracked", False):
        return
    kvpress_call = BasePress.__call__

    @contextmanager
    def tracked_call(self, model):
        blocks.check_model(model)  # a compiled model, a sliding mask built from a compressed layer (presses.blocks)
        active = _ACTIVE.setdefault(model, [])
        active.append(self)
        guard, skipping = None, False
        try:
            if len(active) == 1:  # the outermost block refuses a prompt in chunks
                guard = blocks.chunk_guard(model)
            skipping = blocks.skip_sliding_layers(self, model)  # sliding-window layers stay whole
            if skipping:  # whole sliding layers next to compressed ones: one mask per layer (fit_mask)
                attention.install()
            with kvpress_call(self, model):
                yield
        finally:
            if skipping:
                blocks.restore_hook(self)
            if guard is not None:
                guard.remove()
            del active[next(k for k in range(len(active) - 1, -1, -1) if active[k] is self)]
            for press in held_presses(self):
                if isinstance(press, ResearchPress) and not any(wrapper_path(o, press) for o in active):
                    press._detach_model_hooks()

    tracked_call._kvpress_research_tracked = True
    tracked_call.__doc__ = kvpress_call.__doc__
    BasePress.__call__ = tracked_call


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
    #: Fields the class no longer has, by name (:class:`RemovedField`): what saved runs that list them ran with.
    removed_fields: ClassVar[dict[str, RemovedField]] = {}

    # ------------------------------------------------------------------ per request
    def reset(self) -> None:
        """Forget the state of the previous request. Called at the start of every prefill (by the press's
        first hook of that prefill), so no request sees another's statistics or draws."""

    def summary(self) -> dict[str, Any]:
        """Statistics of the last prefill (a flat dict of numbers and strings; ``{}`` before the first), with
        :data:`KEPT_ENTRIES` (:func:`kept_entries_text`) once a prefill compressed."""
        return {}

    # ------------------------------------------------------------------ decode-time state
    def export_decode_state(self, cache) -> tuple:
        """Take the decode-time state the last prefill left with ``cache`` (the cache it compressed).

        Returns:
            One entry per layer of ``cache``: a :class:`presses.attention_bias.AttentionBias` (bias ``(B, G, P)``)
            or ``None``. The cache keeps none.
        """
        return attention.take_decode_state(cache, len(cache))

    def import_decode_state(self, cache, states: tuple) -> None:
        """Give ``cache`` decode-time state (as :meth:`export_decode_state` returned it).

        Raises:
            ValueError: if ``states`` does not have one entry per layer of ``cache``.
        """
        if len(states) != len(cache):
            raise ValueError(f"decode state has {len(states)} layers, the cache has {len(cache)}")
        attention.put_decode_state(cache, [states])

    # ------------------------------------------------------------------ a sweep's shared intermediates
    @property
    def memo(self):
        """The memo of the sweep replaying this press (:meth:`sharing`), or None."""
        return self.__dict__.get("_memo")

    @contextmanager
    def sharing(self, memo):
        """Use ``memo`` inside the block for intermediates that do not depend on the press's options.

        A sweep that replays one recorded prefill for several presses (the harness's shared prefill) passes one
        memo (an object with ``get(key, compute, *keep)``, e.g. ``evaluation.memo.ReplayMemo``) to every press
        of an example, so e.g. Page-EntroKV's observer attention or the probabilistic press's proposal is computed
        once per layer for all ratios. Keep the block to one prefill: keys hold tensor identities.
        """
        previous = self.__dict__.get("_memo")
        self.__dict__["_memo"] = memo
        try:
            yield
        finally:
            self.__dict__["_memo"] = previous

    # ------------------------------------------------------------------ hooks beyond the attention hooks
    def check_cache(self, cache) -> None:
        """Raise a ``ValueError`` when the press cannot compress ``cache`` (:func:`cache_problem`), called when a
        prefill starts, before any layer runs. Accepts a ``DynamicCache`` (and ``None``) by default.

        Raises:
            ValueError: naming the press, the cache class and what to use instead.
        """
        problem = cache_problem(cache)
        if problem:
            raise ValueError(f"{type(self).__name__} cannot compress this cache: {problem}; use a DynamicCache")

    def check_wrappers(self, path: list) -> None:
        """Raise a ``ValueError`` when the press cannot work inside the wrappers that hold it.

        Called at the start of every prefill with ``path``, the chain of presses from the outermost one
        in use on the model down to this press (``[self]`` when used directly; see :func:`wrapper_path`).
        Accepts everything by default.
        """

    def model_hooks(self, model) -> list[tuple[Any, str, Callable]]:
        """Hooks the press needs besides kvpress's attention forward hooks.

        Returns:
            ``(module, kind, function)`` triples, ``kind`` one of ``"forward_pre"`` or ``"forward"`` (both
            registered ``with_kwargs=True``). The default is one forward pre-hook on the language model that,
            when a prefill starts (an empty or absent cache), refuses a prompt longer than the model's positions
            (:func:`check_prompt_positions`) and calls :meth:`check_cache`, :meth:`check_wrappers` and
            :meth:`reset`; subclasses extend the list.
        """
        return [(language_model(model), "forward_pre", self._prefill_start_hook)]

    def _prefill_start_hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length() == 0:
            check_prompt_positions(module, args, kwargs, type(self).__name__)
            self.check_cache(cache)
            self.check_wrappers(self.__dict__.get("_wrapper_path") or [self])
            self.reset()

    def post_init_from_model(self, model):
        """Read what the press needs from ``model`` and register :meth:`model_hooks` (kvpress calls this on
        entering ``with press(model)``, and wrappers call it on their inner presses). A press whose capabilities say
        ``uneven_layers`` gets the attention wrapper that fits each layer's mask to its own cache length
        (:func:`presses.attention.install`), so it decodes through kvpress's pipeline too, not only the harness."""
        if self.capabilities.uneven_layers:
            attention.install()
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
            path = press_in_use(model, self)
            if path is None:  # the press (or its wrapper) left the model
                self._detach_model_hooks()
                return None
            self.__dict__["_wrapper_path"] = path
            return fn(*args)

        return hook

    def _detach_model_hooks(self) -> None:
        _remove_handles(self.__dict__.pop("_model_hook_handles", []))


_track_kvpress_blocks()
