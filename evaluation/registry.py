"""The one registry of press capabilities the harness reads: nowhere else in ``evaluation/`` is a press
recognised by its class or its name (``no_press``, the uncompressed baseline, aside).

- This project's presses state their capabilities themselves (the press contract, :mod:`presses.base`); a
  probabilistic-eviction press with a kvpress scorer as its proposal states the scorer's need of eager attention
  (``tests/test_scorer_proposals.py`` checks it against :data:`KVPRESS`), and gets the scorer's input limits here.
- kvpress's presses get theirs from :data:`KVPRESS`, by class, and their input limits from
  :func:`press_input_problem`: kvpress checks its inputs with ``assert`` (skipped under ``python -O``) or not
  at all, so the harness turns each limit into a ``ValueError`` naming the value and the limit before the
  prefill (``evaluation.guards.check_press_input``).

A press the registry does not know runs through kvpress's pipeline (it may not share a prefill), and only the
model layout is checked for it.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from kvpress import (
    AdaKVPress,
    ComposedPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    ExpectedAttentionPress,
    FinchPress,
    KVzipPress,
    ObservedAttentionPress,
    PrefillDecodingPress,
    PyramidKVPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)

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
    "press_input_problem",
    "export_decode_state",
    "install_delimiter",
]

#: kvpress presses by class, most specific first. Scorer presses compress in their forward hooks after the
#: attention output is computed, so one recorded uncompressed prefill can be replayed for them
#: (``evaluation.fused``). ObservedAttention (H2O) reads the eager attention weights its hook receives: a shared
#: prefill run on eager attention records them and replays them exactly. PyramidKV keeps per-layer lengths, which
#: the attention masks of the question forward fit only through the project's attention wrapper
#: (``uneven_layers``); it runs through kvpress's pipeline (no shared prefill). KVzip scores the prefill's cache
#: with a context-reconstruction pass after the prefill (its ``__call__``) and selects per ratio: a sweep scores
#: once per example (``evaluation.kvzip_path``). Finch finds the question by a delimiter token that the harness adds
#: to the tokenizer and the model's embeddings and inserts between the document and the question
#: (``evaluation.prompt_delimiter``); the delimiter's removal changes the prefill, so it shares none.
KVPRESS: tuple[tuple[type, Capabilities], ...] = (
    (ObservedAttentionPress, Capabilities(needs_eager=True)),
    (PyramidKVPress, Capabilities(shares_prefill=False, uneven_layers=True)),
    (KVzipPress, Capabilities(shares_prefill=False, scores_once=True)),
    (
        FinchPress,
        Capabilities(shares_prefill=False, needs_question=True, changes_prefill=True, needs_delimiter=True),
    ),
    (ScorerPress, Capabilities()),
)

#: Anything else (kvpress's other wrappers and presses, user presses): run it through kvpress's pipeline, with the
#: attention wrapper that fits each layer's mask to its own cache length (it may keep different counts per layer).
UNKNOWN = Capabilities(shares_prefill=False, uneven_layers=True)

#: kvpress wrappers that hold one press in a field (their capabilities follow the inner press for eager).
_SINGLE_WRAPPERS = (AdaKVPress, CriticalKVPress, CriticalAdaKVPress)


def inner_press(press):
    """The press a single-press kvpress wrapper (AdaKV, CriticalKV) holds, else ``press`` itself."""
    return press.press if isinstance(press, _SINGLE_WRAPPERS) else press


def capabilities(press) -> Capabilities:
    """What ``press`` (None = no compression) can do, as the harness reads it.

    Returns:
        The press's own :attr:`presses.base.ResearchPress.capabilities`; kvpress's from :data:`KVPRESS`;
        wrappers combine their inner presses' (eager if any inner press needs it; a prefill is shared only by a
        ``ComposedPress`` / ``PrefillDecodingPress`` of presses that all share one); :data:`UNKNOWN` otherwise.
    """
    if press is None:
        return Capabilities()
    if isinstance(press, ResearchPress):
        return press.capabilities
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
        uneven_layers=any(c.uneven_layers for c in caps),
    )


def press_input_problem(press, model, context_length: int, multi_token_forward: bool = False) -> str | None:
    """Why kvpress's ``press`` cannot compress a ``T``-token context on ``model``, or None.

    The limits (kvpress 0.5.5): SnapKV, PyramidKV and AdaKV over a windowed scorer need ``T > window_size``;
    StreamingLLM and ExpectedAttention need ``T > n_sink``; TOVA needs ``T >= 2``; AdaKV does not run on eager
    attention, nor KVzip, which masks keys as AdaKV does; ExpectedAttention, and SnapKV, TOVA, PyramidKV and AdaKV
    without eager attention weights, recompute attention in ways that fail or differ from the model's on
    Phi-4-mini, Gemma2 and Gemma3 (:func:`_recompute_problem`). (PyramidKV's per-layer lengths need the attention
    wrapper the harness installs for it, ``uneven_layers``, and nothing else.)
    This project's presses compress any input they accept, and validate their own parameters, except that a
    :class:`presses.probabilistic.ProbabilisticEvictionPress` whose proposal is a kvpress scorer (``snapkv``,
    ``tova``, ``knorm`` or a ``ScorerPress`` instance) has that scorer's limits.

    Args:
        press: the instantiated press (not None).
        model: the causal LM.
        context_length: ``T``.
        multi_token_forward: a forward of more than one token follows the prefill on the compressed cache (no
            limit of kvpress 0.5.5 depends on it since the attention wrapper fits per-layer masks).

    Returns:
        A one-line message naming the press, the value and the limit, or None.
    """
    inner = inner_press(press)
    if not getattr(inner, "compression_ratio", None):
        return None
    label = type(press).__name__ if inner is press else f"{type(press).__name__}({type(inner).__name__})"
    T = int(context_length)
    eager = getattr(model.config, "_attn_implementation", None) == "eager"
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
    if isinstance(press, (AdaKVPress, KVzipPress)) and eager:
        return (
            f"{label} does not support attn_implementation='eager' (its key masking patches sdpa and flash "
            "attention only): use sdpa"
        )
    return _score_problem(inner, label, T)


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


def _score_problem(scorer, label: str, T: int, where: str = "press.window_size") -> str | None:
    """The limits of a kvpress scorer's ``score`` at ``T`` tokens (see :func:`press_input_problem`), or None."""
    if isinstance(scorer, SnapKVPress) and T <= scorer.window_size:  # PyramidKVPress subclasses SnapKVPress
        return (
            f"{label}: the context has T={T} tokens but needs more than window_size={scorer.window_size}: use "
            f"a longer context or a smaller {where}"
        )
    if isinstance(scorer, (StreamingLLMPress, ExpectedAttentionPress)) and T <= scorer.n_sink:
        return f"{label}: the context has T={T} tokens but needs more than n_sink={scorer.n_sink}"
    if isinstance(scorer, TOVAPress) and T < 2:
        return f"{label}: the context has T={T} tokens but needs at least 2 (it scores the keys before the last token)"
    return None


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
