"""The one registry of press capabilities the harness reads: nowhere else in ``evaluation/`` is a press
recognised by its class or its name (``no_press``, the uncompressed baseline, aside).

- This project's presses state their capabilities themselves (the press contract, :mod:`presses.base`); a
  probabilistic-eviction press with a kvpress scorer as its proposal states the scorer's need of eager attention
  (``tests/test_scorer_proposals.py`` checks it against :data:`KVPRESS`), and gets the scorer's input limits here.
- kvpress's presses get theirs from :data:`KVPRESS`, by class (a wrapper that compresses from one scorer's scores
  in its own hook, e.g. ChunkKV, gets its scorer's), why one cannot share a prefill from :func:`sharing_problem`,
  their input limits from :func:`press_input_problem` (kvpress checks its inputs with ``assert``, skipped under
  ``python -O``, or not at all, so the harness turns each limit into a ``ValueError`` naming the value and the
  limit before the prefill, ``evaluation.guards.check_press_input``), and what they download for the model
  (weights, statistics) from :func:`press_download_problem` (``evaluation.guards.check_press_downloads``), after
  the project's own trained scorers and statistics are attached in their place (:func:`attach_scorers`).

A press the registry does not know runs through kvpress's pipeline (it may not share a prefill), and only the
model layout is checked for it.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import torch
from kvpress import (
    AdaKVPress,
    BlockPress,
    CapPress,
    ChunkKVPress,
    ChunkPress,
    CompactorPress,
    ComposedPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    DecodingPress,
    DMSPress,
    DuoAttentionPress,
    ExpectedAttentionPress,
    ExpectedAttentionStatsPress,
    FastKVzipPress,
    FinchPress,
    KeyRerotationPress,
    KVComposePress,
    KVgradPress,
    KVzapPress,
    KVzipPress,
    LagKVPress,
    LUKVPress,
    MergingPress,
    ObservedAttentionPress,
    PerLayerCompressionPress,
    PrefillDecodingPress,
    PyramidKVPress,
    QFilterPress,
    ScorerPress,
    SimLayerKVPress,
    SnapKVPress,
    StreamingLLMPress,
    ThinKPress,
    TOVAPress,
)
from kvpress.utils import compute_n_kept

from presses.base import KEPT_ENTRIES, Capabilities, ResearchPress, held_presses
from presses.core.model import attention_modules, text_config
from presses.probabilistic import ProbabilisticEvictionPress

__all__ = [
    "KVPRESS",
    "UNKNOWN",
    "capabilities",
    "kept_entries",
    "research_presses",
    "sharing",
    "inner_press",
    "KVPRESS_FIELD_MINIMA",
    "attach_kvzap",
    "attach_scorers",
    "press_download_problem",
    "scorer_files",
    "held_press_problem",
    "press_field_problem",
    "press_input_problem",
    "run_ratio_problem",
    "sharing_problem",
    "export_decode_state",
    "install_delimiter",
]

#: kvpress presses by class, most specific first. Scorer presses (and ThinK, which zeroes key channels) compress in
#: their forward hooks after the attention output is computed, so one recorded uncompressed prefill can be replayed
#: for them (``evaluation.fused``); a scorer drawing from torch's generator (Compactor, LeverageScore, Random without
#: a seed) replays exactly because the harness seeds that generator per example and run. ObservedAttention (H2O)
#: reads the eager attention weights its hook receives: a shared prefill run on eager attention records them and
#: replays them exactly. KVzip scores the prefill's cache with a context-reconstruction pass after the prefill (its
#: ``__call__``) and selects per ratio: a sweep scores once per example (``evaluation.kvzip_path``). Finch finds the
#: question by a delimiter token that the harness adds to the tokenizer and the model's embeddings and inserts
#: between the document and the question (``evaluation.prompt_delimiter``). Presses that keep different counts per
#: layer (``uneven_layers``) answer through the project's attention wrapper, which fits each layer's mask. The others
#: share none (:data:`_NOT_SHARED` says why).
KVPRESS: tuple[tuple[type, Capabilities], ...] = (
    (ObservedAttentionPress, Capabilities(needs_eager=True)),
    (PyramidKVPress, Capabilities(shares_prefill=False, uneven_layers=True)),
    (KVComposePress, Capabilities(shares_prefill=False, extra_forwards=True)),
    (KVgradPress, Capabilities(shares_prefill=False, extra_forwards=True)),  # a KVzipPress subclass: before it
    (KVzipPress, Capabilities(shares_prefill=False, scores_once=True, extra_forwards=True)),
    (
        FinchPress,
        Capabilities(shares_prefill=False, needs_question=True, changes_prefill=True, needs_delimiter=True),
    ),
    (SimLayerKVPress, Capabilities(shares_prefill=False, uneven_layers=True)),
    (DecodingPress, Capabilities(shares_prefill=False)),  # CompressionRatioDecodingPress, CAMPress
    (DuoAttentionPress, Capabilities(shares_prefill=False)),
    (FastKVzipPress, Capabilities(shares_prefill=False)),
    (ThinKPress, Capabilities()),
    (ScorerPress, Capabilities()),
)

#: Why a kvpress press (or a wrapper holding one) cannot share a prefill; the sweep's refusal names it.
_PER_LAYER = "it keeps a different number of entries per layer, which the sweep's batched decode does not take"
_MASKED = (
    "it masks evicted keys per head on the attention modules for decoding (kvpress's attention patch), and a shared "
    "prefill's batched decode carries no such masks"
)
_NOT_SHARED: tuple[tuple[tuple[type, ...], str], ...] = (
    ((PyramidKVPress, PerLayerCompressionPress, SimLayerKVPress), _PER_LAYER),
    ((KVComposePress,), "it runs the model on the context a second time (on eager attention) and evicts afterwards"),
    (
        (KVgradPress,),
        "it replays the context through the model (a forward and a backward pass per chunk) and masks keys per head "
        "when the prefill ends",
    ),
    ((DecodingPress,), "it compresses while decoding, not in the prefill"),
    ((AdaKVPress, CriticalAdaKVPress, DMSPress, LUKVPress, DuoAttentionPress), _MASKED),
    ((FastKVzipPress,), "it evicts (masks keys per head) after the prefill, outside the attention hooks"),
    ((FinchPress,), "it removes its delimiter token from the prompt, which changes the prefill"),
    (
        (KeyRerotationPress,),
        "it re-rotates the kept keys to positions 0..n-1 and decodes from n, while the sweep decodes every run "
        "from the context length",
    ),
)

#: Presses whose keys are masked per head by kvpress's attention patch, which covers sdpa and flash attention only.
_MASKING = (AdaKVPress, CriticalAdaKVPress, DMSPress, LUKVPress, DuoAttentionPress, FastKVzipPress, KVzipPress)

#: kvpress wrappers that hold one scorer in ``press`` and compress in their own forward hook from its scores: their
#: capabilities are the scorer's (CriticalKV is itself a ScorerPress, so it comes before :data:`KVPRESS`).
_FOLLOW_INNER = (ChunkKVPress, ChunkPress, BlockPress, MergingPress, CriticalKVPress)  # + EntropyGatedChunkKV

#: Of those, the ones that assert they receive no attention weights (so neither an eager scorer nor eager attention).
_NO_ATTENTION = (ChunkKVPress, ChunkPress, BlockPress)

#: The config of kvpress's KVzip (arXiv 2505.23416), the quality reference of the question-after protocol: the
#: README's which-press table (:mod:`evaluation.readme_table`) takes its measured cost as the second cost budget.
KVZIP_CONFIG = "kvzip"

#: Anything else (kvpress's other wrappers and presses, user presses): run it through kvpress's pipeline, with the
#: attention wrapper that fits each layer's mask to its own cache length (it may keep different counts per layer).
UNKNOWN = Capabilities(shares_prefill=False, uneven_layers=True)

#: kvpress wrappers that hold one press in ``press`` and do not compress from its scores in a hook of their own
#: (head-wise masks, re-rotated keys, per-layer ratios): they share no prefill; eager follows the inner press.
_SINGLE_WRAPPERS = (
    AdaKVPress,
    CriticalAdaKVPress,
    KeyRerotationPress,
    PerLayerCompressionPress,
    DMSPress,
    LUKVPress,
)


#: Of those, the ones that keep a different number of entries per layer whatever their inner press keeps.
_UNEVEN_WRAPPERS = (PerLayerCompressionPress,)


def inner_press(press):
    """The press a single-press kvpress wrapper (AdaKV, ChunkKV, CriticalKV, ...) holds, else ``press`` itself."""
    return press.press if isinstance(press, _SINGLE_WRAPPERS + _FOLLOW_INNER) else press


def capabilities(press) -> Capabilities:
    """What ``press`` (None = no compression) can do, as the harness reads it.

    Returns:
        The press's own :attr:`presses.base.ResearchPress.capabilities`; a hook wrapper's scorer's
        (:data:`_FOLLOW_INNER`: ChunkKV, EntropyGatedChunkKV, Chunk, Block, Merging, CriticalKV); kvpress's from
        :data:`KVPRESS`; other wrappers combine their inner presses' (eager if any inner press needs it; a prefill
        is shared only by a ``ComposedPress`` / ``PrefillDecodingPress`` of presses that all share one);
        :data:`UNKNOWN` otherwise.
    """
    if press is None:
        return Capabilities()
    if isinstance(press, ResearchPress):
        return press.capabilities
    if isinstance(press, _FOLLOW_INNER):
        return capabilities(press.press)
    for cls, caps in KVPRESS:
        if isinstance(press, cls):
            return caps
    inner = []
    if isinstance(press, _SINGLE_WRAPPERS):
        inner = [press.press]
    elif isinstance(press, ComposedPress):
        inner = list(press.presses)
    elif isinstance(press, PrefillDecodingPress):
        inner = [p for p in (press.prefilling_press, press.decoding_press) if p is not None]
    if not inner:
        return UNKNOWN
    caps = [capabilities(p) for p in inner]
    shares = (
        not isinstance(press, _SINGLE_WRAPPERS)
        and all(c.shares_prefill for c in caps)
        and not (isinstance(press, PrefillDecodingPress) and press.decoding_press is not None)
    )
    return Capabilities(
        shares_prefill=shares,
        needs_question=any(c.needs_question for c in caps),
        changes_prefill=any(c.changes_prefill for c in caps),
        decode_state=any(c.decode_state for c in caps),
        needs_eager=any(c.needs_eager for c in caps),
        composable=all(c.composable for c in caps),
        needs_delimiter=any(c.needs_delimiter for c in caps),
        uneven_layers=isinstance(press, _UNEVEN_WRAPPERS) or any(c.uneven_layers for c in caps),
        extra_forwards=any(c.extra_forwards for c in caps),
    )


def sharing_problem(press) -> str | None:
    """Why ``press`` cannot be evaluated from a shared prefill (``evaluation.fused``), or None when it can.

    Returns:
        A clause naming the reason (a kvpress press's from :data:`_NOT_SHARED`, found in wrappers too; a press of
        this project that changes the prefill; otherwise that the press is not known to compress in its forward
        hooks only).
    """
    caps = capabilities(press)
    if caps.shares_prefill:
        return None
    pending, seen = [press], []
    while pending:  # the press and the presses it holds
        p = pending.pop(0)
        seen.append(p)
        for classes, why in _NOT_SHARED:
            if isinstance(p, classes):
                return why
        pending += [getattr(p, k) for k in ("press", "prefilling_press", "decoding_press") if hasattr(p, k)]
        pending += list(getattr(p, "presses", None) or [])
        pending = [q for q in pending if q is not None and not any(q is s for s in seen)]
    if caps.extra_forwards:
        return "it runs the model on the context again"
    if caps.changes_prefill or caps.needs_question:
        return "it changes the prefill itself"
    return "it is not known to compress in its forward hooks only"


def _ratio(press) -> float | None:
    """``press.compression_ratio``, or None where kvpress defines none before a forward (threshold-based presses
    assert or raise there)."""
    try:
        return getattr(press, "compression_ratio", None)
    except (AssertionError, ValueError):
        return None


def run_ratio_problem(press, ratio: float) -> str | None:
    """Why ``press`` cannot run as a run of ``compression_ratio=ratio`` (the ratio names the run's directory), or
    None: kvpress's ``PerLayerCompressionPress`` reports the mean of its per-layer ratios, which must be the run's."""
    if isinstance(press, PerLayerCompressionPress):
        mean = press.compression_ratio
        if abs(mean - float(ratio)) > 1e-9:
            return (
                f"PerLayerCompressionPress: the mean of compression_ratios is {mean:g}, the run's compression_ratio "
                f"is {float(ratio):g}: set compression_ratio={mean:g} (it names the run's directory)"
            )
    return None


#: kvpress's press fields (kvpress 0.5.5) that it takes unchecked and that fail or silently go wrong below a bound,
#: by field name, with the least value: a window or kernel of the last queries (SnapKV, PyramidKV, ThinK, FastKVzip:
#: 0 fails in SnapKV's pooling and makes ThinK's ``[-0:]`` take every query; below 0 fails), a count of protected
#: first tokens (StreamingLLM, ExpectedAttention, CapPress, LagKV, KVzip, FastKVzip, KVgrad, Compactor: a negative
#: count protects the wrong entries and the run goes on), the sizes a press cuts the context or its sketch into (0:
#: a division by zero), the future positions ExpectedAttention averages RoPE over (0: a mean over none, NaN scores,
#: and the run goes on). :func:`press_field_problem` reads them.
KVPRESS_FIELD_MINIMA = {
    "window_size": 1,
    "kernel_size": 1,
    "n_sink": 0,
    "sink_size_start": 0,
    "sink_size_end": 0,
    "lag_size": 1,
    "chunk_length": 1,
    "low_entropy_chunk_length": 1,
    "block_size": 1,
    "chunk_size": 1,
    "sketch_dimension": 1,
    "n_future_positions": 1,
}


def _kvpress_fields(press) -> dict:
    """The dataclass fields of ``press`` that a kvpress class declares (the first kvpress class of its MRO: this
    project's subclasses of kvpress presses keep kvpress's fields unchecked too), by name."""
    return _kvpress_fields_of_class(type(press))


def _kvpress_fields_of_class(press_cls: type) -> dict:
    """:func:`_kvpress_fields` of a class."""
    for cls in press_cls.__mro__:
        if cls.__module__.split(".")[0] == "kvpress" and dataclasses.is_dataclass(cls):
            return {f.name: f for f in dataclasses.fields(cls) if f.init}
    return {}


def held_press_problem(wrapper: type, name: str, held, where: str = "press") -> str | None:
    """Why ``held`` cannot be the press a kvpress wrapper class holds in its field ``name``, or None.

    kvpress's wrappers that compress from one scorer's scores (AdaKV, ChunkKV, DMS, KeyRerotation, ...) declare
    ``press: ScorerPress`` and call its ``score``; some assert it (AdaKV: "requires a ScorerPress"), DMSPress does not
    and fails in its first forward, KeyRerotationPress asserts without a message. A press of another kind (KVzip and
    the presses built on it, which score in a pass of their own: ``kvzip``, ``kvzap_global``, ...) is refused here,
    before the model loads.

    Returns:
        One line naming the wrapper, the key (``press.press``), the held press's class and what the field needs.
    """
    kvpress_field = _kvpress_fields_of_class(wrapper).get(name)
    if kvpress_field is None or kvpress_field.type not in (ScorerPress, "ScorerPress") or held is None:
        return None
    if isinstance(held, ScorerPress):
        return None
    return (
        f"{wrapper.__name__}: {where}.{name}={type(held).__name__} must be a kvpress ScorerPress "
        f"({wrapper.__name__} ranks the entries with its score(); {type(held).__name__} has no per-entry score)"
    )


def press_field_problem(press, where: str = "press") -> str | None:
    """Why a field of ``press`` (or of a press it holds: ``press.press``, ``press.presses[i]``, ...) has a value
    kvpress cannot use, or None. Needs no model: the harness asks before the model loads.

    Checked on the fields kvpress declares (:func:`_kvpress_fields`): an ``int`` field holds an int (not a float, a
    bool or a string; None where its default is None), a field of :data:`KVPRESS_FIELD_MINIMA` is at least its
    bound, and SnapKV's and PyramidKV's ``kernel_size`` is odd (an even one changes the length of the pooled
    scores, a shape error). This project's presses validate their own fields.

    Returns:
        One line naming the press class, the field as a command-line key (``press.press.window_size``), its value
        and the limit.
    """
    if not dataclasses.is_dataclass(press) or isinstance(press, type):
        return None
    label = type(press).__name__
    for name, f in _kvpress_fields(press).items():
        try:
            value = getattr(press, name, None)
        except (AssertionError, ValueError):  # a field kvpress turned into a property that needs a forward first
            continue
        key = f"{where}.{name}"
        if f.type in (int, "int") and not (value is None and f.default is None):
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{label}: {key}={value!r} must be an integer"
        if name in KVPRESS_FIELD_MINIMA and isinstance(value, int) and value < KVPRESS_FIELD_MINIMA[name]:
            return f"{label}: {key}={value} must be >= {KVPRESS_FIELD_MINIMA[name]}"
        if name == "kernel_size" and isinstance(press, SnapKVPress) and isinstance(value, int) and value % 2 == 0:
            return f"{label}: {key}={value} must be odd (its pooling keeps the scores' length only for odd kernels)"
    for f in dataclasses.fields(press):  # the presses it holds, any class
        value = getattr(press, f.name, None)
        problem = held_press_problem(type(press), f.name, value, where)
        if problem:
            return problem
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, item in items:
            if dataclasses.is_dataclass(item) and not isinstance(item, type) and hasattr(item, "compress"):
                problem = press_field_problem(item, f"{where}.{f.name}" + ("" if i is None else f"[{i}]"))
                if problem:
                    return problem
    return None


def press_input_problem(press, model, context_length: int, multi_token_forward: bool = False) -> str | None:
    """Why kvpress's ``press`` cannot compress a ``T``-token context on ``model``, or None.

    The limits (kvpress 0.5.5): SnapKV, PyramidKV and wrappers over a windowed scorer need ``T > window_size``
    (ChunkPress: every chunk, the last one included); StreamingLLM, ExpectedAttention and CapPress need
    ``T > n_sink``; TOVA needs ``T >= 2``; Compactor needs ``T > sink_size_start + sink_size_end``; LagKV scores
    only when ``T >= n_sink + 2 lag_size`` (below it keeps the most recent tokens, as StreamingLLM, which the
    harness refuses); ChunkKV, ChunkPress and BlockPress need ``chunk_length`` / ``block_size >= 1`` and take no
    attention weights (so neither an eager scorer nor eager attention); the presses that mask keys per head (AdaKV,
    CriticalAdaKV, DMS, LU-KV, DuoAttention, FastKVzip, KVzip, KVgrad) do not run on eager attention;
    ExpectedAttention, and SnapKV, TOVA, PyramidKV and AdaKV without eager attention weights, recompute attention in
    ways that fail or differ from the model's on Phi-4-mini, Gemma2 and Gemma3 (:func:`_recompute_problem`).
    (Per-layer lengths, PyramidKV's and PerLayerCompression's, need the attention wrapper the harness installs for
    them, ``uneven_layers``, and nothing else.) This project's presses compress any input they accept, and validate
    their own parameters, except that a :class:`presses.probabilistic.ProbabilisticEvictionPress` whose proposal is
    a kvpress scorer (``snapkv``, ``tova``, ``knorm`` or a ``ScorerPress`` instance) has that scorer's limits.

    Args:
        press: the instantiated press (not None).
        model: the causal LM.
        context_length: ``T``.
        multi_token_forward: a forward of more than one token follows the prefill on the compressed cache (no
            limit of kvpress 0.5.5 depends on it since the attention wrapper fits per-layer masks).

    Returns:
        A one-line message naming the press, the value and the limit, or None.
    """
    problem = press_field_problem(press)
    if problem:
        return problem
    inner = inner_press(press)
    label = type(press).__name__ if inner is press else f"{type(press).__name__}({type(inner).__name__})"
    eager = getattr(model.config, "_attn_implementation", None) == "eager"
    if isinstance(press, PerLayerCompressionPress):
        n_layers = len(attention_modules(model))
        if len(press.compression_ratios) != n_layers:
            return (
                f"{label}: compression_ratios has {len(press.compression_ratios)} values, the model has {n_layers} "
                "layers: give one ratio per layer"
            )
        inner = replace(inner, compression_ratio=max(press.compression_ratios))  # the scorer's limits at its ratios
    if isinstance(press, _MASKING) and eager and _ratio(press) != 0:  # threshold-based presses have none (None)
        return (
            f"{label} does not support attn_implementation='eager' (its key masking patches sdpa and flash "
            "attention only): use sdpa"
        )
    if not _ratio(inner):
        return None
    if isinstance(press, _NO_ATTENTION) and capabilities(inner).needs_eager:
        return (
            f"{label}: {type(inner).__name__} reads attention weights, which {type(press).__name__} does not take "
            "(kvpress asserts it): use a scorer that does not need eager attention"
        )
    if isinstance(press, _NO_ATTENTION) and eager:
        return (
            f"{label} takes no attention weights (kvpress asserts it), but the model runs eager attention here (a "
            "press of this sweep needs it): run it in a sweep on sdpa"
        )
    T = int(context_length)
    if isinstance(inner, ProbabilisticEvictionPress):
        scorer = inner.scorer  # only the proposal's score() is called, on every layer of the prefill
        if scorer is None:
            return None
        where = "press.window_size" if inner.proposal == "snapkv" else "press.proposal.window_size"
        label = f"{label}(proposal={type(scorer).__name__})"
        return _recompute_problem(scorer, label, model, eager) or _score_problem(scorer, label, T, where)
    problem = _recompute_problem(inner, label, model, eager)
    if problem:
        return problem
    where = "press.window_size" if inner is press else "press.press.window_size"
    if isinstance(press, ChunkPress):  # the scorer sees each chunk on its own, the last one shortest
        n = T % press.chunk_length or min(T, press.chunk_length)
        what = f"its last chunk has {n} tokens (T={T} in chunks of chunk_length={press.chunk_length})"
        return _score_problem(inner, label, n, where, what)
    if isinstance(press, BlockPress):  # the scorer sees the kept entries plus each block in turn
        kept, block = compute_n_kept(T, inner.compression_ratio), min(press.block_size, T)
        seen = [kept + min(block, T - i) for i in range(kept, T, block)]
        if seen:
            n = min(seen)
            return _score_problem(inner, label, n, where, f"its scorer sees {n} entries at a time (T={T})")
        return None
    return _score_problem(inner, label, T, where)


def _recompute_problem(scorer, label: str, model, eager: bool) -> str | None:
    """Why kvpress's ``scorer`` cannot recompute the attention of ``model``'s layers, or None.

    kvpress 0.5.5 recomputes window attention (SnapKV and TOVA when the attention returns no weights, PyramidKV and
    AdaKV through SnapKV) or an expected attention (ExpectedAttention, always) with RoPE over the whole head, logits
    divided by ``sqrt(head_dim)``, no soft-cap, and ExpectedAttention calls ``module.rotary_emb`` without a layer
    type. Phi-4-mini rotates ``partial_rotary_factor=0.75`` of each head (a size mismatch); Gemma scales by
    ``query_pre_attn_scalar ** -0.5`` (other scores than the model's attention when it differs from ``head_dim``);
    Gemma2 soft-caps; Gemma3 has one rotary embedding per layer type (kvpress issue #274). This project's presses
    use the module's own rotation, scale and soft-cap (:mod:`presses.core.observer`).
    """
    always = isinstance(scorer, ExpectedAttentionPress)
    if not (always or (isinstance(scorer, (SnapKVPress, TOVAPress)) and not eager)):
        return None
    config = text_config(model)
    rope = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor")
    module = attention_modules(model)[0]
    scaling = getattr(module, "scaling", None)
    if factor is not None and factor < 1:
        why = f"the model rotates partial_rotary_factor={factor} of it (kvpress 0.5.5 fails with a size mismatch)"
    elif scaling is not None and abs(scaling * module.head_dim**0.5 - 1) > 1e-6:
        why = f"the model scales its logits by {scaling:.6g}, not 1/sqrt(head_dim={module.head_dim})"
    elif getattr(module, "attn_logit_softcapping", None):
        why = f"the model soft-caps its logits (attn_logit_softcapping={module.attn_logit_softcapping})"
    elif always and getattr(module, "layer_type", None) is not None and isinstance(rope.get(module.layer_type), dict):
        why = "the model has one rotary embedding per layer type (kvpress issue #274: AttributeError 'None_inv_freq')"
    else:
        return None
    fix = "" if always else ": load the model with attn_implementation='eager' (then it reads the model's weights)"
    return f"{label} recomputes attention with RoPE over the whole head and logits / sqrt(head_dim), but {why}{fix}"


def _score_problem(scorer, label: str, T: int, where: str = "press.window_size", what: str = "") -> str | None:
    """The limits of a kvpress scorer's ``score`` at ``T`` tokens (see :func:`press_input_problem`), or None.

    ``what`` replaces ``the context has T=... tokens`` in the message (a wrapper that scores parts of the context).
    """
    what = what or f"the context has T={T} tokens"
    if isinstance(scorer, SnapKVPress) and T <= scorer.window_size:  # PyramidKVPress subclasses SnapKVPress
        return (
            f"{label}: {what} but needs more than window_size={scorer.window_size}: use a longer context or a "
            f"smaller {where}"
        )
    if isinstance(scorer, (StreamingLLMPress, ExpectedAttentionPress, CapPress)) and T <= scorer.n_sink:
        return f"{label}: {what} but needs more than n_sink={scorer.n_sink}"
    if isinstance(scorer, TOVAPress) and T < 2:
        return f"{label}: {what} but needs at least 2 (it scores the keys before the last token)"
    if isinstance(scorer, CompactorPress) and T <= scorer.sink_size_start + scorer.sink_size_end:
        return (
            f"{label}: {what} but needs more than sink_size_start + sink_size_end = "
            f"{scorer.sink_size_start + scorer.sink_size_end} (its protected sinks)"
        )
    if isinstance(scorer, LagKVPress) and T < scorer.n_sink + 2 * scorer.lag_size:
        return (
            f"{label}: {what} but LagKV scores only T >= n_sink + 2 lag_size = "
            f"{scorer.n_sink + 2 * scorer.lag_size} (below it keeps the most recent tokens, as StreamingLLM): use "
            "a longer context or a smaller press.lag_size"
        )
    return None


def _hub_file_problem(label: str, what: str, repo: str, filename: str) -> str | None:
    """Why ``repo``/``filename`` cannot be had here (not cached and the hub unreachable, or not on the hub), or None.

    Asks the hub only when the file is not in the local Hugging Face cache (:func:`evaluation.hub.hub_reachable`:
    seconds, once per process).
    """
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    from evaluation.hub import hub_reachable

    try:
        if isinstance(huggingface_hub.try_to_load_from_cache(repo, filename), str):
            return None
    except HFValidationError:  # a name kvpress builds from a local model path (too long, or '..' in it)
        return f"{label} needs {what}, but kvpress would download them as {repo}, which is no hub repository name"
    if not hub_reachable():
        return (
            f"{label} needs {what} ({repo}, file {filename}), which is not in the local Hugging Face cache and the "
            f"hub is unreachable: download it where the hub is reachable (hf download {repo})"
        )
    try:
        exists = huggingface_hub.file_exists(repo, filename)
    except Exception:  # a gated or rate-limited repo, a hub error: let kvpress try, and report
        return None
    return None if exists else f"{label} needs {what}, but the hub has no {repo} (file {filename}) for this model"


def _url_problem(label: str, what: str, url: str) -> str | None:
    """Why ``url`` (downloaded by kvpress at the prefill) cannot be had here, or None. The hub's reachability
    (:func:`evaluation.hub.hub_reachable`) stands for the network's."""
    from evaluation.hub import hub_reachable

    if hub_reachable():
        return None
    return f"{label} downloads {what} from {url} at the prefill, and this machine is offline"


def press_download_problem(press, model) -> str | None:
    """Why ``press`` cannot get the weights, statistics or data it downloads for ``model``, or None.

    kvpress 0.5.5 fetches them in ``post_init_from_model``, i.e. when the prefill starts, from the model's name
    (``model.config.name_or_path``): QFilterPress (``nthngdy/<model>_qfilt``), KVzapPress
    (``nvidia/KVzap-<model_type>-<model>``, also inside DMSPress; none when the project trained its own,
    :mod:`evaluation.scorers`, which the harness attaches first: a missing one is then named with the command that
    makes it; the same for QFilterPress and ExpectedAttentionStatsPress, :func:`attach_scorers`), FastKVzipPress
    (``Jang-Hyun/Fast-KVzip``), ExpectedAttentionStatsPress (``alessiodevoto/exp_att_stats_...``, unless
    ``stats_folder`` is set),
    DuoAttentionPress (attention patterns from GitHub for six models, or the BookSum dataset with
    ``on_the_fly_scoring``) and LUKVPress (a budget curve from GitHub, for Llama-3.1-8B-Instruct with
    ExpectedAttention only). The harness calls this once per run, before any run directory is created
    (:func:`evaluation.guards.check_press_downloads`), so offline a run stops at once with one line.

    Returns:
        A one-line message naming the press, what it needs and where to get it, or None (wrappers are searched).
    """
    config = model.config.get_text_config()
    name = model.config.name_or_path
    short = name.split("/")[-1]
    label = type(press).__name__
    if isinstance(press, QFilterPress):  # the project's own (evaluation.scorers, attached first), else the hub's
        from evaluation.scorers import QFILTER, qfilter_problem, scorer_dir

        own = qfilter_problem(model)
        if own is None or (scorer_dir(model, QFILTER) / "config.json").is_file():
            return own  # None, or filters made for another model
        short = short if "Meta-Llama-3.1-405B" in short else short.replace("Meta-Llama", "Llama")
        hub = _hub_file_problem(label, "Q-filters trained for the model", f"nthngdy/{short}_qfilt", "model.safetensors")
        return None if hub is None else f"{own}; nor can kvpress load its own: {hub}"
    if isinstance(press, KVzapPress):  # the project's own scorer (evaluation.scorers, attached first), else the hub's
        from evaluation.scorers import kvzap_dir, kvzap_problem

        own = kvzap_problem(model, press.model_type)
        if own is None or (kvzap_dir(model, press.model_type) / "config.json").is_file():
            return own  # None, or a scorer made for another model
        repo = f"nvidia/KVzap-{press.model_type}-{short}"
        hub = _hub_file_problem(label, "the KVzap scorer trained for the model", repo, "model.safetensors")
        return None if hub is None else f"{own}; nor can kvpress load its own: {hub}"
    if isinstance(press, FastKVzipPress):
        groups = config.num_attention_heads // config.num_key_value_heads
        gate = f"{short.lower()}/q{groups}_dim16_sink16.pt"
        return _hub_file_problem(label, "the Fast KVzip gates trained for the model", "Jang-Hyun/Fast-KVzip", gate)
    if isinstance(press, ExpectedAttentionStatsPress) and press.stats_folder is None:
        from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats

        from evaluation.scorers import EA_STATS, ea_stats_problem, scorer_dir

        own = ea_stats_problem(model)
        if own is None or (scorer_dir(model, EA_STATS) / "config.json").is_file():
            return own  # None, or statistics made for another model

        repo = ExpectedAttentionStats(
            num_layers=1,  # the statistics' id names the model and the sampling settings only
            num_heads=1,
            head_dim=1,
            dataset_name=press.dataset_name,
            model_name=name,
            num_samples=press.num_samples,
            sample_seq_len=press.sample_seq_len,
            n_sink=press.n_sink,
        ).stats_id()
        hub = _hub_file_problem(label, "query statistics computed for the model", repo, "model.safetensors")
        return None if hub is None else f"{own}; nor can kvpress load its own: {hub}"
    if isinstance(press, DuoAttentionPress):
        from kvpress.presses.duo_attention_press import PATTERNS_DICT

        if press.on_the_fly_scoring:
            return _url_problem(label, "the BookSum dataset (kmfoda/booksum) to score its heads", "the hub")
        if name not in PATTERNS_DICT:
            return (
                f"{label} has published attention patterns only for {', '.join(PATTERNS_DICT)}, not {name}: set "
                "press.on_the_fly_scoring=true to score the heads on BookSum (online)"
            )
        return _url_problem(label, "its attention pattern", "raw.githubusercontent.com/mit-han-lab/duo-attention")
    if isinstance(press, LUKVPress):
        from kvpress.presses.lukv_press import BUDGET_CURVE_URLS

        if (name, type(press.press).__name__) not in BUDGET_CURVE_URLS:
            known = ", ".join(f"{m} with {p}" for m, p in BUDGET_CURVE_URLS)
            return f"{label} has budget curves only for {known}, not {name} with {type(press.press).__name__}"
        return _url_problem(label, "its budget curve", BUDGET_CURVE_URLS[name, type(press.press).__name__])
    held = [getattr(press, k, None) for k in ("press", "base_press", "prefilling_press", "decoding_press")]
    for inner in [*held, *(getattr(press, "presses", None) or [])]:
        if inner is not None and inner is not press:
            problem = press_download_problem(inner, model)
            if problem:
                return problem
    return None


def attach_kvzap(press, model, root=None, required: bool = True) -> list:
    """Give every KVzapPress that ``press`` is or holds (any kvpress wrapper: DMSPress, AdaKVPress, ComposedPress, ...)
    the project's trained scorer for ``model`` (:mod:`evaluation.scorers`), as kvpress's own
    ``post_init_from_model`` would load it from the hub: ``kvzap_model`` and the ``kvzap_model_name`` it compares
    (``nvidia/KVzap-<model_type>-<model>``), so kvpress downloads nothing. The harness calls it for every run
    (:func:`evaluation.guards.check_press_downloads`); from Python, call it once before ``with press(model)`` or the
    pipeline::

        press = DMSPress(KVzapPress(model_type="linear"), threshold=-4)
        attach_kvzap(press, model)
        answer = pipe(context, question=question, press=press)["answer"]

    Args:
        press: a kvpress press (None: nothing).
        model: the model the press will run on.
        root: where the scorers live (default :data:`evaluation.scorers.SCORERS`, ``results/scorers/``).
        required: raise when a scorer is missing; with False, a press without one is left as it is (kvpress then
            loads the hub's; :func:`press_download_problem` says whether it can).

    Returns:
        The KVzapPress instances given a scorer.

    Raises:
        FileNotFoundError: a scorer made for another model (always) or a missing one (``required``): one line
            naming the model, the file and the command that makes it (:func:`evaluation.scorers.kvzap_problem`).
    """
    from evaluation.scorers import kvzap_dir, kvzap_problem, load_kvzap, model_key

    attached = []
    for inner in [] if press is None else held_presses(press):
        if not isinstance(inner, KVzapPress):
            continue
        problem = kvzap_problem(model, inner.model_type, root)
        if problem and (required or (kvzap_dir(model, inner.model_type, root) / "config.json").is_file()):
            raise FileNotFoundError(problem)
        if problem:
            continue
        inner.kvzap_model = load_kvzap(model, inner.model_type, root)
        inner.kvzap_model_name = f"nvidia/KVzap-{inner.model_type}-{model_key(model)}"  # what kvpress compares
        _record_file(inner, f"kvzap_{inner.model_type}", kvzap_dir(model, inner.model_type, root))
        attached.append(inner)
    return attached


class _ProjectFilters:
    """Stands for ``QFilterPress.load_q_filters`` on one press (an instance attribute shadows kvpress's cached static
    method, which would load ``nthngdy/<model>_qfilt`` from the hub in ``post_init_from_model``): returns the
    project's filters whatever the model name."""

    def __init__(self, q_filters: torch.Tensor):
        self.q_filters = q_filters

    def __call__(self, model_name: str) -> torch.Tensor:
        return self.q_filters


def attach_scorers(press, model, root=None, required: bool = True) -> list:
    """Give every press that ``press`` is or holds the project's trained scorer or statistics for ``model``
    (:mod:`evaluation.scorers`) in place of what kvpress's ``post_init_from_model`` downloads, so it downloads
    nothing: KVzapPress its scorer (:func:`attach_kvzap`); QFilterPress its ``q_filters`` and a ``load_q_filters``
    returning them (:class:`_ProjectFilters`: kvpress's ``post_init_from_model`` calls it, then casts to the
    model's dtype); ExpectedAttentionStatsPress without a ``stats_folder`` its ``mu`` and ``cov`` (on the model's
    device and dtype, which its ``post_init_from_model`` then keeps). The harness calls it for every run
    (:func:`evaluation.guards.check_press_downloads`); from Python, call it once before ``with press(model)`` or the
    pipeline.

    Args:
        press: a kvpress press (None: nothing).
        model: the model the press will run on.
        root: where the scorers live (default :data:`evaluation.scorers.SCORERS`, ``results/scorers/``).
        required: raise when one is missing; with False, a press without one is left as it is (kvpress then loads
            the hub's; :func:`press_download_problem` says whether it can).

    Returns:
        The presses given a scorer or statistics.

    Raises:
        FileNotFoundError: one made for another model (always) or a missing one (``required``): one line naming the
            model, the file and the command that makes it (:func:`evaluation.scorers.qfilter_problem`,
            :func:`evaluation.scorers.ea_stats_problem`, :func:`evaluation.scorers.kvzap_problem`).
    """
    from evaluation import scorers

    attached = attach_kvzap(press, model, root, required)
    for inner in [] if press is None else held_presses(press):
        if isinstance(inner, QFilterPress):
            name, problem = scorers.QFILTER, scorers.qfilter_problem(model, root)
        elif isinstance(inner, ExpectedAttentionStatsPress) and inner.stats_folder is None:
            name, problem = scorers.EA_STATS, scorers.ea_stats_problem(model, root)
        else:
            continue
        if problem and (required or (scorers.scorer_dir(model, name, root) / "config.json").is_file()):
            raise FileNotFoundError(problem)
        if problem:
            continue
        if name == scorers.QFILTER:
            inner.q_filters = scorers.load_qfilter(model, root).to(model.device, model.dtype)
            inner.load_q_filters = _ProjectFilters(inner.q_filters)
        else:
            stats = scorers.load_ea_stats(model, root)
            inner.mu = stats.query_mean.data.to(model.device, model.dtype)
            inner.cov = stats.query_cov.data.to(model.device, model.dtype)
        _record_file(inner, name, scorers.scorer_dir(model, name, root))
        attached.append(inner)
    return attached


#: The attribute (outside a press's fields: not a setting) where :func:`attach_scorers` records the weights it gave.
_SCORER_FILE = "_kvpress_research_scorer_file"


def _record_file(press, name: str, directory) -> None:
    from evaluation.scorers import weights_sha256

    press.__dict__[_SCORER_FILE] = (name, weights_sha256(directory))


def scorer_files(press) -> dict[str, str]:
    """The project's trained scorers ``press`` (or a press it holds) runs with, as :func:`attach_scorers` gave them:
    ``{"kvzap_linear": <SHA-256 of its model.safetensors>, ...}``; ``{}`` for a press that holds none. A run's rows
    record it (:func:`evaluation.harness.prediction_row`), since a scorer's file is not one of the press's settings:
    rows made with a retrained scorer say so."""
    found = {}
    for inner in [] if press is None else held_presses(press):
        entry = inner.__dict__.get(_SCORER_FILE) if hasattr(inner, "__dict__") else None
        if entry:
            found[entry[0]] = entry[1]
    return found


def research_presses(press) -> list[ResearchPress]:
    """The presses of this project that ``press`` is or holds (in a kvpress wrapper), outermost first."""
    return [] if press is None else [p for p in held_presses(press) if isinstance(p, ResearchPress)]


def export_decode_state(press, cache) -> tuple:
    """The decode-time state a prefill under ``press`` left with ``cache`` (one entry per layer), taken off it.

    Through the press contract (:meth:`presses.base.ResearchPress.export_decode_state`) of the press itself or of
    the press of this project a wrapper holds; ``(None,) * len(cache)`` for a press without decode-time state.
    """
    owners = [p for p in research_presses(press) if p.capabilities.decode_state]
    return owners[0].export_decode_state(cache) if owners else (None,) * len(cache)


@contextmanager
def sharing(press, memo):
    """Inside the block, every press of this project that ``press`` is or holds uses ``memo``
    (:meth:`presses.base.ResearchPress.sharing`, :class:`evaluation.memo.ReplayMemo`); other presses compute as
    always."""
    with ExitStack() as stack:
        for p in research_presses(press):
            stack.enter_context(p.sharing(memo))
        yield


def kept_entries(press, model, cache) -> list[float]:
    """The cache entries ``press`` kept per KV head, one number per layer of ``cache`` (mean over heads).

    A press of this project (or the one a wrapper holds) reports them in its summary (the contract's
    :data:`presses.base.KEPT_ENTRIES`; the probabilistic press pads its groups, so its cache is longer than what it
    keeps). kvpress's head-wise presses (AdaKV, CriticalAdaKV, KVzip) keep a dense cache and mask keys instead
    (``masked_key_indices`` on the attention modules, kvpress's own state, cleared by kvpress at every prefill):
    their masked entries are subtracted. Otherwise, the cache lengths.
    """
    lengths = [float(cache.get_seq_length(i)) for i in range(len(cache))]
    for p in research_presses(press):
        text = p.summary().get(KEPT_ENTRIES)
        if text:
            kept = [float(x) for x in str(text).split(",")]
            if len(kept) == len(lengths):
                return kept
    masked = [getattr(module, "masked_key_indices", None) for module in attention_modules(model)]
    if any(m is not None for m in masked):
        n_kv = text_config(model).num_key_value_heads
        return [n - (len(m[0]) / n_kv if m is not None else 0) for n, m in zip(lengths, masked)]
    return lengths


def install_delimiter(press, model, tokenizer, seed: int = 0) -> str:
    """Set up a press that needs a delimiter token (capability ``needs_delimiter``) on ``model`` and ``tokenizer``.

    kvpress's ``FinchPress.update_model_and_tokenizer`` adds the token to ``tokenizer`` (once) and resizes
    ``model``'s embeddings to the tokenizer's length, drawing the new rows at random (transformers' mean resizing):
    the draw is seeded with ``seed`` here, on a forked random state, so a run is reproducible and the caller's
    random state is untouched. Both objects are changed in place: give the press a model of its own
    (``evaluation.harness.get_model``'s ``variant``).

    Returns:
        The delimiter token's text, to insert between the document and the question.

    Raises:
        ValueError: a wrapper holding such a press (kvpress's pipeline sets a Finch press up only when it is the press
            itself).
    """
    if not isinstance(press, FinchPress):
        raise ValueError(
            f"{type(press).__name__} holds a press that needs a delimiter token (FinchPress), which works only as the "
            "press itself: run FinchPress alone"
        )
    with torch.random.fork_rng():  # the CPU's random state and every CUDA device's
        torch.manual_seed(seed)
        press.update_model_and_tokenizer(model, tokenizer)
    return press.delimiter_token
