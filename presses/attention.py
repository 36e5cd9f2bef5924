"""The one attention wrapper of the project, and the per-cache state it reads.

Two things the presses need happen inside a layer's attention function, not in kvpress's forward hooks:

- **decode-time logit biases** (an :class:`presses.attention_bias.AttentionBias` per layer: the SNIS
  log-weights of probabilistic eviction, paper 003 eq. 10; ``-inf`` on the padding of layers padded to a common
  kept count or of a batched decode), added to the logits of every query that reads the layer's cache after the
  prefill;
- **prefill requests** (a :class:`PrefillRequest`, e.g. the probabilistic press's proposal statistics, which
  the prefill's own attention computes in the same pass over the keys, paper 003 appendix H).

Both belong to the cache they were made for, never to the model, so a request that failed part-way (an exception,
Ctrl-C) can never reach another request's cache.

**A decode-time bias lives on the cache layer it describes** (:func:`set_decode_bias`; issue 63): the layer object
stores it and its class becomes a subclass made once per base class (``BiasedDynamicLayer``, same layout, so the class
is swapped in place; ``isinstance(layer, DynamicLayer)`` still holds, as kvpress and :func:`presses.base.cache_problem`
check), whose cache operations (transformers 5) carry the bias with the keys:

- ``copy.deepcopy``, pickling, ``torch.save`` / ``torch.load``: the copy's layers are biased layers with a copy of
  the bias (``__reduce_ex__``; loading in a new process installs the wrapper); ``copy.copy(cache)`` shares the layer
  objects, and so their biases (transformers' semantics);
- ``crop(n)`` and ``crop(-n)``: the bias is cut to the layer's new length when that falls below ``P`` (the first
  slots keep their own biases), and dropped at 0;
- ``reorder_cache`` (beam search), ``batch_select_indices``, ``batch_repeat_interleave``: the bias's batch rows are
  indexed, selected or repeated as the keys';
- ``reset``, and a prefill into a layer left empty: the bias is dropped (the content it described is gone);
- ``offload`` / ``prefetch``, keys moved to another device: the bias stays where it is and each call moves it to the
  query's device (a few kB per layer).

Only a full-attention, unquantized ``DynamicLayer`` takes a bias: a ``QuantizedLayer`` returns dequantized copies and
keeps most entries in quantized storage that its ``crop`` and batch operations do not follow, a sliding-window layer
drops its oldest entries and a ``StaticLayer`` writes at fixed slots; :func:`set_decode_bias` refuses each in one line,
as the presses refuse such caches before compressing (:func:`presses.base.cache_problem`).

The wrapper finds a call's layer by identity: a biased layer records the key tensor its ``update`` returns (for a
``DynamicLayer`` its own stored tensor; with offloading the device tensor it returns before its storage moves to the
CPU), which is the ``key`` the attention function receives; a weak table from that tensor's ``id`` to the layer
(validated by a weak reference to the tensor) makes the lookup O(1).

What is refused (one line each), and what cannot be detected:

- a bias whose batch or group sizes disagree with the layer's keys, or that covers more slots than the layer holds
  (keys replaced by hand): ``ValueError`` at the next attention call (:func:`presses.attention_bias.check_fit`);
- a forward of another batch size than the layer's (``num_beams`` rows on a one-row cache): ``ValueError`` in the
  layer's ``update``, naming ``batch_repeat_interleave``;
- a forward at positions below the prompt length ``T`` the press compressed (a model called without
  ``position_ids`` numbers the new tokens from the cache's length, e.g. transformers' prompt-reuse recipe with
  ``model.generate``): ``ValueError`` (:func:`presses.attention_bias.check_positions`), checked at every forward of
  more than one token and at a layer object's first forward (not at every one-token step: reading the positions
  waits for the device); it reads ``position_ids`` from the attention call, where transformers passes them
  (Llama-style models): a model that does not is not checked;
- a forward whose attention bypassed this wrapper (``flash_attention_2``, ``flex_attention``, a model that does not
  read ``ALL_ATTENTION_FUNCTIONS``): the bias was not applied, and the layer's next ``update`` raises a
  ``RuntimeError``; the logits of that first forward are already out;
- not detectable: a cache rebuilt from its tensors alone (``DynamicCache(ddp_cache_data=...)``, legacy tuples,
  layers replaced by new layer objects) carries no bias and decodes uncorrected; keys replaced by others of the same
  shape keep the old bias.

:func:`install` wraps transformers' ``sdpa`` and ``eager`` attention functions (``ALL_ATTENTION_FUNCTIONS``, on
top of kvpress's own patch) once per process. Without a bias for the call's layer and without a prefill request the
wrapper calls the wrapped function unchanged (``eager``: the ``eager_attention_forward`` of the module's own modeling
file), so a model without a press computes exactly what it computes without the wrapper. Every call first fits the
model's attention mask to the layer's own key count (:func:`presses.attention_bias.fit_mask`): transformers builds one
mask per forward from one layer's cache length, which the other layers of a cache with per-layer lengths (PyramidKV,
a sliding-window layer left whole) do not share; a mask that fits is passed on untouched.

A prefill request is transient (it lives for one prefill): it is kept in a weak table keyed by the cache object and
found through the cache's layer ``module.layer_idx`` (a copy of the cache made mid-prefill does not get it).

The functions below are the only way in and out: presses call :func:`set_decode_bias`,
:func:`request_prefill` and :func:`take_prefill_result`; a press's ``export_decode_state`` /
``import_decode_state`` call :func:`take_decode_state` / :func:`put_decode_state`; :func:`decode_state` reads the
biases without taking them.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from transformers.cache_utils import DynamicLayer, QuantizedLayer

from presses.attention_bias import AttentionBias, biased_attention, check_fit, check_positions, fit_mask

__all__ = [
    "CacheRequests",
    "PrefillRequest",
    "install",
    "requests_of",
    "set_decode_bias",
    "layer_bias",
    "decode_state",
    "take_decode_state",
    "put_decode_state",
    "request_prefill",
    "withdraw_prefill",
    "take_prefill_result",
    "SUPPORTED_ATTENTION",
    "check_implementation",
]

#: The attention implementations the wrapper serves (``attn_implementation``).
SUPPORTED_ATTENTION = ("sdpa", "eager")


class PrefillRequest(Protocol):
    """What a prefill request does inside a layer's attention (e.g.
    :class:`presses.probabilistic.prefill_attention.StatsRequest`)."""

    def run(self, module, query, key, value, attention_mask, call, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
        """The layer's attention output ``(output, weights)`` (transformers' convention; ``call(module, query, key,
        value, attention_mask, *args, **kwargs)`` is the wrapped function) and a result to keep for the layer
        (``None``: nothing)."""


@dataclass
class CacheRequests:
    """The prefill requests of one cache.

    Attributes:
        prefill: the request the next prefill of this cache serves (every layer), or None.
        results: what the prefill request left per layer index, until taken.
    """

    prefill: PrefillRequest | None = None
    results: dict[int, Any] = field(default_factory=dict)


_REQUESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> CacheRequests


def requests_of(cache, create: bool = False) -> CacheRequests | None:
    """The prefill requests of ``cache`` (None when it has none and ``create`` is false)."""
    found = _REQUESTS.get(cache)
    if found is None and create:
        found = _REQUESTS[cache] = CacheRequests()
    return found


def _find(module, key: torch.Tensor) -> CacheRequests | None:
    """The prefill requests of the cache whose layer ``module.layer_idx`` stores ``key``."""
    layer = getattr(module, "layer_idx", None)
    if layer is None or not _REQUESTS:
        return None
    for cache, requests in list(_REQUESTS.items()):
        layers = getattr(cache, "layers", ())
        if layer < len(layers) and getattr(layers[layer], "keys", None) is key:
            return requests
    return None


# ---------------------------------------------------------------------------------------------- biased layers
#: id of the key tensor a biased layer last returned (or holds) -> the layer; validated by the layer's weak
#: reference to that tensor (an id may be reused once its tensor is gone).
_KEY_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

#: Per-process attributes of a biased layer, never copied or pickled: the weak reference to its key tensor, that
#: tensor's id, whether the last update's attention has yet to apply the bias, and whether a forward's positions were
#: checked against the bias's context length.
_TRANSIENT = ("_decode_keys", "_decode_key_id", "_bias_pending", "_positions_checked")

_BIASED_CLASSES: dict[type, type] = {}  # base layer class -> its biased subclass


def _note_keys(layer, keys) -> None:
    """Make ``keys`` the tensor the wrapper finds ``layer`` by (its update returned it, or the layer holds it)."""
    old = layer.__dict__.get("_decode_key_id")
    if old is not None and _KEY_OWNERS.get(old) is layer:
        del _KEY_OWNERS[old]
    if not isinstance(keys, torch.Tensor):
        layer.__dict__.pop("_decode_keys", None)
        layer.__dict__.pop("_decode_key_id", None)
        return
    layer.__dict__["_decode_keys"] = weakref.ref(keys)
    layer.__dict__["_decode_key_id"] = id(keys)
    _KEY_OWNERS[id(keys)] = layer


def _owner_of(key: torch.Tensor):
    """The biased layer whose last update returned (or that holds) ``key``, or None."""
    layer = _KEY_OWNERS.get(id(key))
    if layer is None:
        return None
    ref = layer.__dict__.get("_decode_keys")
    return layer if ref is not None and ref() is key and _is_biased(layer) else None


def _unbias(layer) -> None:
    """Take ``layer``'s bias away: its class back to the base class, its transient attributes gone."""
    if not _is_biased(layer):
        return
    _note_keys(layer, None)
    for name in ("_decode_bias", *_TRANSIENT):
        layer.__dict__.pop(name, None)
    layer.__class__ = type(layer)._unbiased_class


def _is_biased(layer) -> bool:
    """Whether ``layer`` is a biased layer (of a class :func:`_biased_class` made)."""
    return "_unbiased_class" in type(layer).__dict__


def _biased_class(base: type) -> type:
    """The subclass of the layer class ``base`` that carries a decode-time bias (``_decode_bias``, an
    :class:`AttentionBias` ``(B, G, P)`` over the layer's first ``P`` slots) through every cache operation (the module
    docstring's table): one per base class, made at first use. It has ``base``'s layout, so a layer's class is swapped
    in place (:func:`set_decode_bias`) and back (:func:`_unbias`)."""
    found = _BIASED_CLASSES.get(base)
    if found is not None:
        return found

    class Biased(base):
        _unbiased_class: ClassVar[type] = base

        def update(self, key_states, value_states, cache_kwargs=None):
            """The base class's update; an emptied layer first drops its bias (a prefill from position 0 describes a
            new content).

            Raises:
                RuntimeError: when the previous update's attention did not apply the bias (it bypassed the wrapper).
                ValueError: when ``key_states`` has another batch size than the layer (e.g. ``num_beams`` rows on a
                    cache of one row: expand the cache first).
            """
            if self.get_seq_length() == 0:
                _unbias(self)
                return self.update(key_states, value_states, cache_kwargs)
            if self.__dict__.get("_bias_pending"):
                raise RuntimeError(
                    "the previous forward did not apply this cache layer's decode-time bias (its attention bypassed "
                    f"presses.attention's wrapper; attn_implementation must be one of {SUPPORTED_ATTENTION})"
                )
            rows, held = key_states.shape[0], self._decode_bias.bias.shape[0]
            if rows != held:
                raise ValueError(
                    f"a forward of {rows} rows on a compressed cache of {held}: give the cache as many rows first "
                    f"(cache.batch_repeat_interleave({rows // held if held and rows % held == 0 else 'n'}), e.g. for "
                    "num_beams or num_return_sequences)"
                )
            keys, values = super().update(key_states, value_states, cache_kwargs)
            _note_keys(self, keys)
            self.__dict__["_bias_pending"] = True
            return keys, values

        def crop(self, max_length: int) -> None:
            """The base class's crop (``max_length < 0`` removes that many entries); the bias is cut to the new
            length when it falls below ``P``, and dropped at 0."""
            super().crop(max_length)
            length = self.get_seq_length()
            if length == 0:
                _unbias(self)
            elif length < self._decode_bias.prefix_len:
                self._decode_bias = self._decode_bias.with_bias(self._decode_bias.bias[..., :length])

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """The base class's beam reordering, the bias's rows with the keys'."""
            super().reorder_cache(beam_idx)
            bias = self._decode_bias.bias
            self._decode_bias = self._decode_bias.with_bias(bias.index_select(0, beam_idx.to(bias.device)))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """The base class's row selection, the bias's rows with the keys'."""
            super().batch_select_indices(indices)
            bias = self._decode_bias.bias
            rows = indices.to(bias.device) if isinstance(indices, torch.Tensor) else indices
            self._decode_bias = self._decode_bias.with_bias(bias[rows])

        def batch_repeat_interleave(self, repeats: int) -> None:
            """The base class's row repetition, the bias's rows with the keys'."""
            super().batch_repeat_interleave(repeats)
            self._decode_bias = self._decode_bias.with_bias(self._decode_bias.bias.repeat_interleave(repeats, dim=0))

        def reset(self) -> None:
            """The base class's reset; the bias is dropped."""
            super().reset()
            _unbias(self)

        def __reduce_ex__(self, protocol):
            """Copies and pickles rebuild a biased layer of the same base class (:func:`_new_biased_layer`)."""
            state = {k: v for k, v in self.__dict__.items() if k not in _TRANSIENT}
            return _new_biased_layer, (base,), state

        def __setstate__(self, state: dict) -> None:
            self.__dict__.update(state)
            _note_keys(self, self.__dict__.get("keys"))

    Biased.__name__ = Biased.__qualname__ = f"Biased{base.__name__}"
    _BIASED_CLASSES[base] = Biased
    return Biased


def _new_biased_layer(base: type):
    """An empty biased layer of ``base``'s subclass, for copies and unpickling (their state follows); installs the
    wrapper, as a cache loaded in a new process needs it."""
    install()
    cls = _biased_class(base)
    return cls.__new__(cls)


def _layer_problem(layer) -> str | None:
    """Why ``layer`` cannot carry a decode-time bias (one line), or None."""
    name = (type(layer)._unbiased_class if _is_biased(layer) else type(layer)).__name__
    if isinstance(layer, QuantizedLayer):
        return f"a {name} keeps its entries in quantized storage, which its crop and batch operations do not follow"
    if not isinstance(layer, DynamicLayer):
        return f"a {name} stores entries at fixed slots, which a bias over the first slots cannot follow"
    if getattr(layer, "is_sliding", False):
        return f"a {name} drops its oldest entries, which a bias over the first slots cannot follow"
    return None


def layer_bias(layer) -> AttentionBias | None:
    """The decode-time bias cache layer ``layer`` carries, or None."""
    return layer.__dict__.get("_decode_bias") if _is_biased(layer) else None


# ---------------------------------------------------------------------------------------------- the wrapper
def _eager(module):
    """The eager attention function of ``module``'s own modeling file (Llama's when it has none)."""
    func = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if func is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as func
    return func


def _wrap(func, name: str):
    def call(module, *args, **kwargs):
        return (func or _eager(module))(module, *args, **kwargs)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        attention_mask = fit_mask(attention_mask, key.shape[2])  # per-layer cache lengths (fit_mask)
        layer = _owner_of(key)
        if layer is not None:
            layer.__dict__["_bias_pending"] = False
            state = layer._decode_bias
            if query.shape[2] > 1 or not layer.__dict__.get("_positions_checked"):  # .min() waits for the device:
                check_positions(state, kwargs.get("position_ids"))  # not at every one-token step
                layer.__dict__["_positions_checked"] = True
            return biased_attention(module, query, key, value, attention_mask, state, call, name, args, kwargs)
        if query.shape[2] == key.shape[2]:  # a prefill from position 0: the cache's prefill request, if any
            requests = _find(module, key)
            if requests is not None and requests.prefill is not None:
                out, result = requests.prefill.run(module, query, key, value, attention_mask, call, args, kwargs)
                if result is not None:
                    requests.results[module.layer_idx] = result
                return out
        return call(module, query, key, value, attention_mask, *args, **kwargs)

    attention._kvpress_research_attention = True
    attention.__wrapped__ = func  # the wrapped function (None: the module's own eager_attention_forward)
    attention.__name__ = f"kvpress_research_{name}_attention"
    return attention


def check_implementation(model, owner: str) -> str:
    """The model's attention implementation, when this module's wrapper corrects it (sdpa, eager).

    Raises:
        ValueError: naming the implementation, ``owner`` (the press) and :data:`SUPPORTED_ATTENTION`: a decode-time
            correction is an additive float mask, which flash attention does not take.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={impl!r} is not supported by {owner}: use one of {SUPPORTED_ATTENTION} "
            "(the correction is an additive float mask)"
        )
    return impl


def install() -> None:
    """Wrap ``sdpa`` and ``eager`` in transformers' ``ALL_ATTENTION_FUNCTIONS`` once per process (idempotent)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in SUPPORTED_ATTENTION:
        current = ALL_ATTENTION_FUNCTIONS.get(name)
        if not getattr(current, "_kvpress_research_attention", False):
            ALL_ATTENTION_FUNCTIONS[name] = _wrap(current, name)


# ---------------------------------------------------------------------------------------------- decode biases
def set_decode_bias(cache, layer: int, bias: AttentionBias | None) -> None:
    """Give (or, with None, take away) layer ``layer`` of ``cache`` a decode-time bias (see the module docstring).

    Args:
        cache: a transformers ``Cache`` whose ``layers[layer]`` is a full-attention, unquantized ``DynamicLayer``.
        layer: the layer index.
        bias: ``bias`` ``(B, G, P)`` float32 over the layer's first ``P`` slots, ``B`` and ``G`` those of its keys
            ``(B, G, K, d)``, ``P <= K``; or None.

    Raises:
        ValueError: (one line) if the cache has no layer ``layer``, the layer cannot carry a bias (a quantized,
            sliding-window or static layer), or the bias does not fit the layer's keys.
    """
    layers = getattr(cache, "layers", ())
    if bias is None:
        if layer < len(layers):
            _unbias(layers[layer])
        return
    if not 0 <= layer < len(layers):
        raise ValueError(f"the cache has {len(layers)} layers: no layer {layer} to give a decode-time bias")
    target = layers[layer]
    problem = _layer_problem(target)
    if problem:
        raise ValueError(f"layer {layer} cannot carry a decode-time bias: {problem}")
    keys = target.keys
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:
        try:
            check_fit(bias, *keys.shape[:3])
        except ValueError as err:
            raise ValueError(f"layer {layer}: {err}") from None
    install()
    if not _is_biased(target):
        target.__class__ = _biased_class(type(target))
    for name in _TRANSIENT:
        target.__dict__.pop(name, None)
    target._decode_bias = bias
    _note_keys(target, keys)


def decode_state(cache) -> tuple:
    """The decode-time biases of ``cache``'s layers, read without taking them: one :class:`AttentionBias` or None per
    layer."""
    return tuple(layer_bias(layer) for layer in getattr(cache, "layers", ()))


def take_decode_state(cache, num_layers: int) -> tuple:
    """Detach the decode-time biases of ``cache``.

    Returns:
        One entry per layer (``num_layers``): its :class:`AttentionBias` or None. The cache keeps none.
    """
    layers = getattr(cache, "layers", ())
    taken = []
    for i in range(num_layers):
        layer = layers[i] if i < len(layers) else None
        taken.append(layer_bias(layer))
        _unbias(layer)
    return tuple(taken)


def put_decode_state(cache, states_per_run: list) -> None:
    """Give ``cache`` the biases of the runs it holds, one batch row per run (the harness's batched decode).

    Layer ``i`` gets the batch-wise concatenation of the runs' biases (row ``k`` is run ``k``); a layer without a
    bias in every run gets none.

    Args:
        cache: the cache the runs decode from (batch row ``k`` = run ``k``).
        states_per_run: per run, one :class:`AttentionBias` or None per layer (:func:`take_decode_state`), each
            with that run's batch rows.

    Raises:
        ValueError: if some but not all runs have a bias at a layer, or their padded lengths ``P`` differ; as
            :func:`set_decode_bias` when the biases do not fit the cache.
    """
    num_layers = max((len(states) for states in states_per_run), default=0)
    for i in range(num_layers):
        layer_states = [states[i] for states in states_per_run]
        present = [s is not None for s in layer_states]
        if not any(present):
            set_decode_bias(cache, i, None)
            continue
        if not all(present) or len({s.prefix_len for s in layer_states}) != 1:
            lengths = [s.prefix_len if s else None for s in layer_states]
            raise ValueError(
                f"layer {i}: runs decoded in one batch need attention biases of equal padded length "
                f"(present={present}, lengths={lengths})"
            )
        contexts = {s.context_length for s in layer_states}
        context = contexts.pop() if len(contexts) == 1 else None  # runs of one example share it
        set_decode_bias(cache, i, AttentionBias(torch.cat([s.bias for s in layer_states], dim=0), context))


# ---------------------------------------------------------------------------------------------- prefill requests
def request_prefill(cache, request: PrefillRequest) -> None:
    """Ask the next prefill of ``cache`` to serve ``request`` in every layer's attention (results are dropped)."""
    install()
    requests = requests_of(cache, create=True)
    requests.prefill, requests.results = request, {}


def withdraw_prefill(cache) -> None:
    """Withdraw ``cache``'s prefill request and drop the results nobody took."""
    requests = requests_of(cache)
    if requests is not None:
        requests.prefill, requests.results = None, {}


def take_prefill_result(cache, layer: int):
    """What the prefill request left for layer ``layer`` of ``cache``, removed from it (None when nothing)."""
    requests = requests_of(cache)
    return None if requests is None else requests.results.pop(layer, None)
