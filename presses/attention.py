"""The one attention wrapper of the project, and the per-cache requests it reads.

Two things the presses need happen inside a layer's attention function, not in kvpress's forward hooks:

- **decode-time logit biases** (an :class:`presses.attention_bias.AttentionBias` per layer: the SNIS
  log-weights of probabilistic eviction, paper 003 eq. 10; ``-inf`` on the padding of a batched decode), added
  to the logits of every query that reads the layer's cache after the prefill;
- **prefill requests** (a :class:`PrefillRequest`, e.g. the probabilistic press's proposal statistics, which
  the prefill's own attention computes in the same pass over the keys, paper 003 appendix H).

Both belong to the cache they were made for, never to the model: they are kept in a weak table keyed by the
cache object (a transformers ``Cache``), so they die with it, and a request that failed part-way (an exception,
Ctrl-C) can never reach another request's cache. The wrapper finds a call's cache by identity: at every
forward, a ``DynamicCache`` layer's ``update`` returns the very tensor it stores (``cache.layers[i].keys``),
which is the ``key`` the attention function receives.

:func:`install` wraps transformers' ``sdpa`` and ``eager`` attention functions (``ALL_ATTENTION_FUNCTIONS``, on
top of kvpress's own patch) once per process. Without a request for the call's cache the wrapper calls the
wrapped function unchanged (``eager``: the ``eager_attention_forward`` of the module's own modeling file), so
a model without a press computes exactly what it computes without the wrapper. Every call, with or without a
request, first fits the model's attention mask to the layer's own key count
(:func:`presses.attention_bias.fit_mask`): transformers builds one mask per forward from one layer's cache length,
which the other layers of a cache with per-layer lengths (PyramidKV, a sliding-window layer left whole) do not
share; a mask that fits is passed on untouched. A prefill from position 0
(queries and keys cover the same positions) drops the cache's old biases (they describe an earlier content).

The functions below are the only way in and out: presses call :func:`set_decode_bias`,
:func:`request_prefill` and :func:`take_prefill_result`; a press's ``export_decode_state`` /
``import_decode_state`` call :func:`take_decode_state` / :func:`put_decode_state`; the harness's batched decode
calls :func:`select_rows`.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from presses.attention_bias import AttentionBias, biased_attention, fit_mask

__all__ = [
    "CacheRequests",
    "PrefillRequest",
    "install",
    "requests_of",
    "set_decode_bias",
    "take_decode_state",
    "put_decode_state",
    "select_rows",
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
    """The requests of one cache.

    Attributes:
        biases: decode-time bias per layer index (``bias`` ``(B, G, P)`` float32 over the ``P`` prompt slots at
            the head of the layer's cache).
        prefill: the request the next prefill of this cache serves (every layer), or None.
        results: what the prefill request left per layer index, until taken.
    """

    biases: dict[int, AttentionBias] = field(default_factory=dict)
    prefill: PrefillRequest | None = None
    results: dict[int, Any] = field(default_factory=dict)


_REQUESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> CacheRequests


def requests_of(cache, create: bool = False) -> CacheRequests | None:
    """The requests of ``cache`` (None when it has none and ``create`` is false)."""
    found = _REQUESTS.get(cache)
    if found is None and create:
        found = _REQUESTS[cache] = CacheRequests()
    return found


def _find(module, key: torch.Tensor) -> CacheRequests | None:
    """The requests of the cache whose layer ``module.layer_idx`` stores ``key`` (see the module docstring)."""
    layer = getattr(module, "layer_idx", None)
    if layer is None or not _REQUESTS:
        return None
    for cache, requests in list(_REQUESTS.items()):
        layers = getattr(cache, "layers", ())
        if layer < len(layers) and getattr(layers[layer], "keys", None) is key:
            return requests
    return None


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
        requests = _find(module, key)
        if requests is None:
            return call(module, query, key, value, attention_mask, *args, **kwargs)
        layer = module.layer_idx
        if query.shape[2] == key.shape[2]:  # a prefill from position 0 of this cache
            requests.biases.pop(layer, None)  # a bias describes an earlier content of the cache
            if requests.prefill is not None:
                out, result = requests.prefill.run(module, query, key, value, attention_mask, call, args, kwargs)
                if result is not None:
                    requests.results[layer] = result
                return out
            return call(module, query, key, value, attention_mask, *args, **kwargs)
        bias = requests.biases.get(layer)
        if bias is None:
            return call(module, query, key, value, attention_mask, *args, **kwargs)
        return biased_attention(module, query, key, value, attention_mask, bias, call, name, args, kwargs)

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
    """Give (or, with None, take away) layer ``layer`` of ``cache`` a decode-time bias."""
    if bias is None:
        requests = requests_of(cache)
        if requests is not None:
            requests.biases.pop(layer, None)
        return
    install()
    requests_of(cache, create=True).biases[layer] = bias


def take_decode_state(cache, num_layers: int) -> tuple:
    """Detach the decode-time biases of ``cache``.

    Returns:
        One entry per layer (``num_layers``): its :class:`AttentionBias` or None. The cache keeps none.
    """
    requests = requests_of(cache)
    if requests is None:
        return (None,) * num_layers
    biases, requests.biases = requests.biases, {}
    return tuple(biases.get(i) for i in range(num_layers))


def put_decode_state(cache, states_per_run: list) -> None:
    """Give ``cache`` the biases of the runs it holds, one batch row per run (the harness's batched decode).

    Layer ``i`` gets the batch-wise concatenation of the runs' biases (row ``k`` is run ``k``); a layer without a
    bias in every run gets none.

    Args:
        cache: the cache the runs decode from (batch row ``k`` = run ``k``).
        states_per_run: per run, one :class:`AttentionBias` or None per layer (:func:`take_decode_state`), each
            with that run's batch rows.

    Raises:
        ValueError: if some but not all runs have a bias at a layer, or their padded lengths ``P`` differ.
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
        set_decode_bias(cache, i, AttentionBias(torch.cat([s.bias for s in layer_states], dim=0)))


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep only the batch rows ``index`` of ``cache``'s biases (with ``cache.batch_select_indices(index)``).

    Args:
        cache: the cache whose rows were selected.
        index: ``(B',)`` long, the rows kept, in their new order.
    """
    requests = requests_of(cache)
    if requests is None:
        return
    for layer, state in list(requests.biases.items()):
        requests.biases[layer] = AttentionBias(state.bias.index_select(0, index.to(state.bias.device)))


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
