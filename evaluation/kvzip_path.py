"""KVzip's path in the shared-prefill sweep (capability ``scores_once``): one context-reconstruction scoring pass
per example, shared by every compression ratio and by KVzip and KVzip+, then kvpress's own selection per run.

kvpress's KVzip press (KVzip, https://arxiv.org/abs/2505.23416) prefills the context uncompressed; on leaving
``with press(model)`` it runs the model again on that cache to reconstruct the context chunk by chunk, its attention
hooks scoring every cached pair (``score_kvzip``: the most attention a reconstruction query pays it; KVzip+ also
divides by the query's hidden-state norm and multiplies by the value's output norm) and cutting the cache back to
the context after each layer; ``compress_post`` then masks the lowest-scored pairs (``masked_key_indices`` on the
attention modules, which kvpress's attention patch turns into keys that get no attention when decoding; the
cache stays dense, as AdaKV's).

Why sharing is exact:

- the cache it scores is the prefill's: the sweep's shared uncompressed prefill holds the same keys and values;
- the reconstruction forwards read only that cache and the tokenizer, and the hooks change the cache only after
  each layer's attention output, so the forwards do not depend on the press: presses with one ``chunk_size`` (the
  fields outside :data:`SCORING_FIELDS` and :data:`SELECTION_FIELDS`) share one pass;
- the scores depend on :data:`SCORING_FIELDS` besides, never on :data:`SELECTION_FIELDS`, which only
  ``compress_post`` reads: one score tensor serves every ratio (each run selects from its own copy).

kvpress's code does the work: the first press of each pass runs its own ``__call__`` with the shared cache as the
cache its prefill recorded, so kvpress's tokenizer reload, chunking, reconstruction forwards and hooks run
unchanged; a hook registered before its hooks calls ``score_kvzip`` of the presses with other scoring fields (KVzip+
next to KVzip), or with scores of their own from the same pass (capability ``pass_as``: Page-EntroKV's
reconstruction observers, ``presses/page_entrokv/reconstruction.py``), on the same inputs, and presses with one
``n_sink`` compute the reconstruction attention once per layer (:func:`_shared_cross_attention`); a hook on the
language model copies the first press's scores after each forward (its ``compress_post`` then raises the sinks'
scores in place). Each run then gets ``compress_post`` on a copy of its scores and decodes alone with its masks on
the modules, through the pipeline's ``generate_answer`` as ``evaluation.run`` does: the masks are kvpress's, and so
are the keys it decodes with (``tests/test_kvzip_path.py``: equal masks and predictions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch
from kvpress.utils import extract_keys_and_values

from evaluation.registry import capabilities
from presses import attention
from presses.core.model import decoder_layers, language_model

__all__ = [
    "SCORING_FIELDS",
    "SELECTION_FIELDS",
    "masked_keys",
    "pass_key",
    "score",
    "scores_key",
    "select",
    "selected_runs",
    "take_masked_keys",
]

#: Fields of kvpress's KVzip press that only ``compress_post`` reads (the selection): the scores do not depend on them.
SELECTION_FIELDS = frozenset({"compression_ratio", "layerwise"})
#: Fields that ``score_kvzip`` reads but the reconstruction forwards do not: presses differing only in these (and in
#: :data:`SELECTION_FIELDS`) share one reconstruction pass, each with its own scores.
SCORING_FIELDS = frozenset({"n_sink", "kvzip_plus_normalization"})


def _key(press, drop: frozenset, cls: type | None = None) -> tuple:
    """The press's dataclass fields outside ``drop``, as a hashable key (an unknown new field counts as different),
    after ``cls`` (default: the class whose scores the press computes).

    A subclass that changes only kvpress's selection (``compress_post``) says so in its capabilities
    (:class:`presses.base.Capabilities`: ``scores_as``, the class whose scores it computes, and ``selection_fields``,
    its fields that only the selection reads): it then shares the pass and the scores of that class (the page and
    sampling variants, presses/kvzip_pages/)."""
    caps = capabilities(press)
    drop = drop | frozenset(caps.selection_fields)
    cls = cls or caps.scores_as or type(press)
    return (cls, *((f.name, getattr(press, f.name)) for f in dataclasses.fields(press) if f.name not in drop))


def take_masked_keys(model) -> tuple:
    """The head-wise masks (kvpress's ``masked_key_indices``, ``(batch, head, position)`` index tensors, or None)
    on every attention module, taken off it."""
    masks = []
    for layer in decoder_layers(model):
        masks.append(getattr(layer.self_attn, "masked_key_indices", None))
        layer.self_attn.masked_key_indices = None
    return tuple(masks)


@contextlib.contextmanager
def masked_keys(model, masks: tuple):
    """Put ``masks`` (one per layer, :func:`take_masked_keys`) on the attention modules for the block, then take them
    off (another run's decode must not see them)."""
    for layer, mask in zip(decoder_layers(model), masks):
        layer.self_attn.masked_key_indices = mask
    try:
        yield
    finally:
        take_masked_keys(model)


def score(presses: list, model, capture, context_ids: torch.Tensor) -> dict[tuple, torch.Tensor]:
    """One reconstruction pass over the captured prefill's cache, scoring for every press of ``presses``.

    Args:
        presses: kvpress KVzip presses with ``compression_ratio > 0`` and one :func:`pass_key`.
        model: the causal LM the capture was taken on.
        capture: a filled :class:`evaluation.replay.PrefillCapture` of ``context_ids``.
        context_ids: ``(1, T)``, the prefill's input ids.

    Returns:
        Per scoring key (:func:`scores_key`), the raw scores ``(L, 1, G, T)`` (kvpress's ``score_val`` before
        ``compress_post``), as the press's own prefill would compute them.
    """
    reps: dict = {}
    for press in presses:
        reps.setdefault(scores_key(press), press)
    (lead_key, lead), *others = reps.items()
    kept: dict = {}

    def score_others(module, args, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)  # before the cut
        for _, press in others:
            if press.score_val is None:
                press.score_val = _empty_scores(press, model, lead.score_val)
            press.context_length, press.prefix_length = lead.context_length, lead.prefix_length
            press.start_idx, press.end_idx = lead.start_idx, lead.end_idx
            press.score_kvzip(module, kwargs["hidden_states"], keys, values, output[1], kwargs)

    def keep_lead_scores(module, args, output):
        kept[lead_key] = lead.score_val.clone()

    layers = decoder_layers(model) if others else []
    handles = [layer.self_attn.register_forward_hook(score_others, with_kwargs=True) for layer in layers]
    handles.append(language_model(model).register_forward_hook(keep_lead_scores))
    try:
        with _shared_cross_attention(list(reps.values())), lead(model):  # on leaving: kvpress's reconstruction
            lead._context_ids, lead._cache = context_ids, capture.uncompressed_cache()  # what its prefill records
    finally:
        for handle in handles:
            handle.remove()
        for key, press in others:
            kept[key] = press.score_val
            press._reset_internal_parameters()
        take_masked_keys(model)  # the lead's own compress_post: each run selects below
    return kept


def _empty_scores(press, model, lead_scores: torch.Tensor) -> torch.Tensor:
    """Zero scores for ``press`` in a pass that another press leads (``lead_scores`` ``(L, 1, *, T)``): the press's
    own (its capability ``empty_scores(model, T, device)``, for scores of another shape than kvpress's) or
    kvpress's ``(L, 1, G, T)`` in the model's dtype, as kvpress's own ``prepare`` makes them."""
    L, T, device = lead_scores.shape[0], lead_scores.shape[-1], lead_scores.device
    own = capabilities(press).empty_scores
    if own is not None:
        return own(model, T, device)
    return torch.zeros(L, 1, model.config.num_key_value_heads, T, dtype=model.dtype, device=device)


@contextlib.contextmanager
def _shared_cross_attention(presses: list):
    """Within one pass, hand each layer's reconstruction attention (kvpress's ``_compute_cross_attention``, the bulk
    of the scoring) computed for one press to the others that would compute it from the same inputs.

    It reads the layer, its hidden states and keys, and the press's ``n_sink`` and chunk (``start_idx``, ``end_idx``),
    and ``score_kvzip`` never changes the tensor it returns (KVzip slices it, KVzip+ rescales it into a new one): so
    KVzip and KVzip+ with one ``n_sink`` share it exactly. Only the current layer's tensors (one per ``n_sink``) are
    held.
    """
    memo: dict = {}  # n_sink -> attention, for the layer and chunk of memo["at"]

    def shared(press):
        compute = press._compute_cross_attention

        def call(module, hidden_states, keys, kwargs):
            at = (module.layer_idx, press.start_idx, press.end_idx, hidden_states.data_ptr(), keys.data_ptr())
            at += (tuple(hidden_states.shape), tuple(keys.shape))
            if memo.get("at") != at:
                memo.clear()
                memo["at"] = at
            if press.n_sink not in memo:
                memo[press.n_sink] = compute(module, hidden_states, keys, kwargs)
            return memo[press.n_sink]

        return call

    for press in presses:
        press._compute_cross_attention = shared(press)
    try:
        yield
    finally:
        for press in presses:
            del press._compute_cross_attention  # the class's method again
        memo.clear()


def scores_key(press) -> tuple:
    """What a press's scores depend on: its fields outside :data:`SELECTION_FIELDS`."""
    return _key(press, SELECTION_FIELDS)


def pass_key(press) -> tuple:
    """What a press's reconstruction pass depends on (``chunk_size``): the class whose pass it runs (its capabilities'
    ``pass_as``, else ``scores_as``, else its own) and its fields outside :data:`SELECTION_FIELDS` and
    :data:`SCORING_FIELDS`."""
    return _key(press, SELECTION_FIELDS | SCORING_FIELDS, capabilities(press).pass_as)


def select(press, scores: torch.Tensor, model, cache) -> tuple:
    """The press's ``compress_post`` on a copy of ``scores`` (``(L, 1, G, T)``, :func:`score`) with ``cache`` (a new
    uncompressed cache of the prefill) as the cache its prefill recorded: the masks kvpress's selection leaves on the
    modules, taken off (:func:`take_masked_keys`). A selection that evicts from the cache instead (the sampling
    variant, presses/kvzip_pages/sampling.py) leaves ``cache`` evicted, with its decode-time state."""
    press.post_init_from_model(model)  # the lead press's pass called it for the lead only (kvpress's: a no-op)
    press.score_val, press._cache = scores.clone(), cache
    try:
        press.compress_post(model)
    finally:
        press._reset_internal_parameters()
    return take_masked_keys(model)


def selected_runs(runs: list, model, capture, context_ids: torch.Tensor) -> Iterator[tuple]:
    """Score ``runs`` (the loop's runs of presses with ``scores_once``) with one reconstruction pass per pass key, or
    from the shared prefill's attention calls for a press that reads its scores in the prefill (its capability
    ``prefill_scores``), and select per run.

    Yields:
        ``(run, cache, seconds, masks, state)`` per run, in order: a new cache of the prefill (uncompressed for
        kvpress's selection: the decode writes kvpress's fake keys into it; evicted by a sampling selection), the
        seconds of its pass (shared, counted in full for every run, as the shared prefill is) plus its selection,
        its masks per layer (None everywhere at ratio 0, which kvpress does not score, and for a sampling selection)
        and its decode-time state per layer, taken off the cache (:func:`presses.attention.take_decode_state`; None
        for kvpress's selection).
    """
    passes: dict = {}
    for run in runs:
        if run.press.compression_ratio > 0 and capabilities(run.press).prefill_scores is None:
            passes.setdefault(pass_key(run.press), []).append(run.press)
    scores, seconds = {}, {}
    for key, presses in passes.items():
        start = time.perf_counter()
        with torch.inference_mode():
            scores.update(score(presses, model, capture, context_ids))
        seconds[key] = time.perf_counter() - start
    layer_calls = [(args, kwargs, output) for args, kwargs, output, _, _ in capture.layers]
    for run in runs:
        start = time.perf_counter()
        scored = run.press.compression_ratio > 0
        cache = capture.uncompressed_cache()
        shared = 0.0
        if not scored:
            masks = take_masked_keys(model)
        elif (prefill_scores := capabilities(run.press).prefill_scores) is not None:  # no pass
            with torch.inference_mode():
                masks = select(run.press, prefill_scores(model, layer_calls), model, cache)
        else:
            masks = select(run.press, scores[scores_key(run.press)], model, cache)
            shared = seconds[pass_key(run.press)]
        state = attention.take_decode_state(cache, len(cache))
        yield run, cache, shared + time.perf_counter() - start, masks, state
