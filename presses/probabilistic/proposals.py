"""Proposal distributions ``pi`` over the ``t`` prompt entries for probabilistic eviction.

Paper 003 appendix H (the four proposals ``min``, ``min_h``, ``h2o``, ``h2o_h`` with the harmonic
prior), appendix D (any kvpress top-k scorer turned into a proposal, D.1 temperature and uniform
mixing) and section 5 (one proposal per GQA group: the mixture of its heads' proposals);
docs/methods.md §3 item 1.

A proposal is a name of :data:`ATTENTION_PROPOSALS`, a name of :data:`SCORER_PROPOSALS` (a kvpress scorer with
fixed settings, :func:`named_scorer`) or any kvpress ``ScorerPress`` instance (:func:`check_scorer`). Scorers
give one score per KV head, i.e. per group, which :func:`score_to_proposal` normalises over the entries.

Shapes: ``B`` batch, ``H_Q`` query heads, ``G`` KV groups, ``r = H_Q / G``, ``t`` prompt entries,
``d`` head dim. Query head ``h`` belongs to group ``h // r``. Column sums over all prompt rows are
computed in query blocks (``block_size`` rows at a time), never as a full ``t x t`` matrix per head.
"""

from __future__ import annotations

import dataclasses

import torch
from kvpress import KnormPress, ObservedAttentionPress, ScorerPress, SnapKVPress, TOVAPress
from kvpress.presses.base_press import BasePress

from presses import kernels
from presses.core.columns import harmonic_prior
from presses.core.observer import attention_logit_options, window_queries
from presses.core.renyi import pool_groups
from presses.probabilistic.prefill_attention import take_prefill_stats

__all__ = [
    "ATTENTION_PROPOSALS",
    "SCORER_PROPOSALS",
    "PROPOSALS",
    "harmonic_prior",
    "attention_column_sums",
    "head_proposals",
    "group_mixture",
    "adjust_proposal",
    "score_to_proposal",
    "NORMALIZATIONS",
    "ATTENTION_WEIGHT_SCORERS",
    "named_scorer",
    "check_scorer",
    "check_proposal",
    "proposal_scorer",
    "proposal_label",
    "needs_attention_weights",
    "scorer_scores",
    "compute_proposal",
]

ATTENTION_PROPOSALS = ("min", "min_h", "h2o", "h2o_h")
#: Names of kvpress scorers with fixed settings (:func:`named_scorer`); any other ``ScorerPress`` is passed as an
# instance.
SCORER_PROPOSALS = ("snapkv", "tova", "knorm")
PROPOSALS = ATTENTION_PROPOSALS + SCORER_PROPOSALS
#: How a scorer's scores become a proposal (:func:`score_to_proposal`).
NORMALIZATIONS = ("softmax", "sum")
#: kvpress scorers that read the layer's attention weights (``attn_implementation="eager"``). In kvpress 0.5.5 only
#: ObservedAttentionPress needs them; SnapKV and TOVA use them when the attention returns them and recompute their
#: window's attention otherwise.
ATTENTION_WEIGHT_SCORERS: tuple[type, ...] = (ObservedAttentionPress,)


def _check_block(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")


def attention_column_sums(
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    position_embeddings,
    row_weights: torch.Tensor | None = None,
    block_size: int = 128,
    scaling: float | None = None,
) -> torch.Tensor:
    """Weighted column sums over ALL prefill rows, recomputing queries block by block.

    ``s^h[i] = sum_{j=1..t} w_j p^h_j(i)`` with ``p_j`` the causal attention row of query ``j``
    (paper 003 eqs. 16, 36). Queries are re-projected from ``hidden_states`` with RoPE
    (:func:`presses.core.observer.window_queries`) ``block_size`` rows at a time, so peak memory is
    ``O(B H_Q block_size t)`` instead of ``O(B H_Q t^2)``.

    Args:
        module: the Llama-like attention module of the layer.
        hidden_states: ``(B, t, D_model)`` input of the attention layer (prefill from position 0).
        keys: ``(B, G, t, d)`` RoPE'd keys.
        position_embeddings: ``(cos, sin)`` each ``(B, t, d)``.
        row_weights: ``(t,)`` row weights ``w_j`` or ``None`` for 1.
        block_size: query rows per block, ``>= 1``.
        scaling: logit scale, default ``module.scaling`` or ``d ** -0.5``; the module's soft-cap (Gemma2) applies.

    Returns:
        ``(B, H_Q, t)`` float32.

    Raises:
        ValueError: if ``block_size < 1`` or ``hidden_states`` and ``keys`` disagree on ``t``.
    """
    _check_block(block_size)
    t = keys.shape[2]
    if hidden_states.shape[1] != t:
        raise ValueError(
            f"hidden_states has {hidden_states.shape[1]} rows but keys have t={t}: "
            "proposals need the whole prefill in one forward"
        )
    module_scaling, softcap = attention_logit_options(module)
    scaling = module_scaling if scaling is None else scaling
    cos, sin = position_embeddings
    out = None
    for start in range(0, t, block_size):
        end = min(start + block_size, t)
        q = window_queries(module, hidden_states[:, :end], end - start, (cos[:, :end], sin[:, :end]))
        w = None if row_weights is None else row_weights[start:end]
        part = kernels.column_sums(q, keys, w, torch.arange(start, end, device=keys.device), scaling, softcap)
        out = part if out is None else out + part
    return out


def _normalize(scores: torch.Tensor) -> torch.Tensor:
    """Normalise non-negative scores on the last axis (uniform where a row sums to 0)."""
    total = scores.sum(-1, keepdim=True)
    uniform = torch.full_like(scores, 1.0 / scores.shape[-1])
    return torch.where(total > 0, scores / total.clamp_min(torch.finfo(scores.dtype).tiny), uniform)


def head_proposals(
    name: str,
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position_embeddings,
    block_size: int = 128,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head proposals of paper 003 appendix H.

    - ``min``:   ``pi^h(i) ~ p^h_t(i) ||v_i||`` (last row; the minimum-variance proposal at ``t``)
    - ``min_h``: ``pi^h(i) ~ sum_j h_j p^h_j(i) ||v_i||``
    - ``h2o``:   ``pi^h(i) ~ sum_j p^h_j(i)`` (normalised H2O score, eq. 17)
    - ``h2o_h``: ``pi^h(i) ~ sum_j h_j p^h_j(i)``

    When the layer's prefill attention already computed the statistic (``scores``, taken from the cache with
    :func:`presses.probabilistic.prefill_attention.take_prefill_stats` inside the press's prefill) it is used as
    is; otherwise the column sums are recomputed through the dispatch
    point :func:`presses.kernels.column_sums` (Triton on CUDA, :func:`presses.core.columns.column_sums`
    elsewhere). With the harmonic prior ``h_j`` of :func:`harmonic_prior` and ``||v_i||`` the L2 norm of the
    value of entry ``i`` in the head's KV group.

    Args:
        name: one of :data:`ATTENTION_PROPOSALS`.
        module: the attention module (query projection, ``head_dim``, ``config``).
        hidden_states: ``(B, t, D_model)``.
        keys: ``(B, G, t, d)`` RoPE'd keys.
        values: ``(B, G, t, d)``.
        position_embeddings: ``(cos, sin)``.
        block_size: query rows per block for the all-row proposals.
        scores: ``(B, H_Q, t)`` the column sums (or last row) the prefill's attention computed, or None.

    Returns:
        ``(B, H_Q, t)`` float32, each row summing to 1.

    Raises:
        ValueError: for an unknown ``name`` or ``block_size < 1``.
    """
    if name not in ATTENTION_PROPOSALS:
        raise ValueError(f"proposal={name!r} must be one of {ATTENTION_PROPOSALS}")
    _check_block(block_size)
    t = keys.shape[2]
    if scores is None and name == "min":
        cos, sin = position_embeddings
        q = window_queries(module, hidden_states, 1, (cos, sin))
        scaling, softcap = attention_logit_options(module)
        scores = kernels.column_sums(q, keys, scaling=scaling, softcap=softcap)  # dispatch
    elif scores is None:
        prior = harmonic_prior(t, keys.device) if name.endswith("_h") else None
        scores = attention_column_sums(module, hidden_states, keys, position_embeddings, prior, block_size)
    if name.startswith("min"):
        HQ, G = scores.shape[1], keys.shape[1]
        norms = torch.linalg.vector_norm(values.float(), dim=-1)  # (B, G, t)
        scores = scores * norms.repeat_interleave(HQ // G, dim=1)
    return _normalize(scores)


def group_mixture(head_pi: torch.Tensor, num_groups: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """GQA group proposal ``pi^G(i) = sum_{j in G} alpha_j pi^{h_j}(i)`` (paper 003 section 5).

    Args:
        head_pi: ``(..., H_Q, t)`` per-head proposals.
        num_groups: ``G``, dividing ``H_Q``.
        weights: ``(..., G, r)`` mixture weights on the simplex; default ``alpha_j = 1 / r``.

    Returns:
        ``(..., G, t)`` float32; its support contains every head's support when all ``alpha_j > 0``.

    Raises:
        ValueError: if ``G`` does not divide ``H_Q``.
    """
    hq = head_pi.shape[-2]
    if num_groups <= 0 or hq % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of query heads H_Q={hq}")
    r = hq // num_groups
    if weights is None:
        weights = torch.full((*head_pi.shape[:-2], num_groups, r), 1.0 / r, device=head_pi.device)
    return pool_groups(head_pi, weights)


def adjust_proposal(pi: torch.Tensor, temperature: float = 1.0, uniform_mix: float = 0.0) -> torch.Tensor:
    """Temperature and uniform mixing of a proposal (paper 003 appendix D.1).

    ``pi_T ~ pi ** (1 / T)`` (i.e. ``softmax(log pi / T)``: ``T > 1`` flattens, ``T < 1`` sharpens),
    then ``pi' = (1 - a) pi_T + a / t`` with ``a = uniform_mix`` (the paper's ``alpha = 1 - a``);
    ``a > 0`` gives full support.

    Args:
        pi: ``(..., t)`` proposals (rows summing to 1).
        temperature: ``T > 0``.
        uniform_mix: ``a`` in ``[0, 1]``.

    Returns:
        ``(..., t)`` float32 rows summing to 1.

    Raises:
        ValueError: if ``temperature <= 0`` or ``uniform_mix`` is outside ``[0, 1]``.
    """
    if not (temperature > 0):
        raise ValueError(f"temperature={temperature} must be > 0")
    if not (0.0 <= uniform_mix <= 1.0):
        raise ValueError(f"uniform_mix={uniform_mix} must be in [0, 1]")
    pi = pi.float()
    if temperature != 1.0:
        pi = torch.softmax(torch.log(pi) / temperature, dim=-1)
    if uniform_mix > 0:
        pi = (1.0 - uniform_mix) * pi + uniform_mix / pi.shape[-1]
    return pi / pi.sum(-1, keepdim=True)


def score_to_proposal(scores: torch.Tensor, temperature: float = 1.0, normalization: str = "softmax") -> torch.Tensor:
    """Turn top-k eviction scores into a proposal (paper 003 appendix D and D.1; docs/methods.md §3 item 1).

    ``normalization="softmax"``: ``pi = softmax(score / T)`` (docs/methods.md §3 item 1; eq. 18 for K-norm);
    ``normalization="sum"``: ``pi ~ score ** (1 / T)`` for non-negative scores (eqs. 17 and 20).

    Args:
        scores: ``(..., t)`` scores (higher = keep).
        temperature: ``T > 0``.
        normalization: ``"softmax"`` or ``"sum"``.

    Returns:
        ``(..., t)`` float32 rows summing to 1.

    Raises:
        ValueError: for ``temperature <= 0``, an unknown ``normalization``, or negative scores with
            ``"sum"``.
    """
    if not (temperature > 0):
        raise ValueError(f"temperature={temperature} must be > 0")
    scores = scores.float()
    if normalization == "softmax":
        return torch.softmax(scores / temperature, dim=-1)
    if normalization == "sum":
        if bool((scores < 0).any()):
            raise ValueError(f"normalization='sum' needs non-negative scores, min is {float(scores.min())}")
        return _normalize(scores.pow(1.0 / temperature))
    raise ValueError(f"normalization={normalization!r} must be 'softmax' or 'sum'")


def named_scorer(name: str, window_size: int = 64, kernel_size: int = 5) -> ScorerPress:
    """The kvpress scorer a name of :data:`SCORER_PROPOSALS` stands for.

    ``snapkv`` -> ``SnapKVPress(window_size=window_size, kernel_size=kernel_size)``, ``tova`` -> ``TOVAPress()``,
    ``knorm`` -> ``KnormPress()`` (negative key norm).

    Raises:
        ValueError: for an unknown ``name``.
    """
    if name == "snapkv":
        return SnapKVPress(window_size=window_size, kernel_size=kernel_size)
    if name == "tova":
        return TOVAPress()
    if name == "knorm":
        return KnormPress()
    raise ValueError(f"scorer proposal={name!r} must be one of {SCORER_PROPOSALS}")


def _held_presses(press) -> list[str]:
    """Public attributes of ``press`` that hold another kvpress press (a wrapper's inner press)."""
    held = []
    for key, value in vars(press).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if not key.startswith("_") and any(isinstance(v, BasePress) for v in values):
            held.append(key)
    return held


def check_scorer(scorer) -> ScorerPress:
    """Return ``scorer`` if it can serve as a proposal: a kvpress ``ScorerPress`` whose ``score`` is its own.

    Only ``score`` is called (paper 003 appendix D): a scorer's own ``compression_ratio`` is not used for eviction,
    though a score that reads it (StreamingLLMPress's window) sees the value the scorer was built with.

    Raises:
        ValueError: naming the value, for anything but a ``ScorerPress`` instance, and for a ``ScorerPress`` that wraps
            another press (e.g. ``CriticalKVPress(press=...)``: its score depends on its own compression ratio and
            its inner press; pass the inner scorer itself).
    """
    if isinstance(scorer, type) or not isinstance(scorer, ScorerPress):
        raise ValueError(
            f"proposal={scorer!r} must be one of {PROPOSALS} or a kvpress ScorerPress instance "
            "(e.g. kvpress.ExpectedAttentionPress()), whose score() becomes the proposal"
        )
    held = _held_presses(scorer)
    if held:
        raise ValueError(
            f"proposal={scorer!r} is a ScorerPress that wraps another press (field {held[0]!r}): "
            "its score depends on its own compression ratio and wrapped press; pass a plain scorer "
            f"(e.g. the wrapped one, {getattr(scorer, held[0])!r})"
        )
    return scorer


def check_proposal(proposal) -> None:
    """Raise a ``ValueError`` naming ``proposal`` unless it is a name of :data:`PROPOSALS` or a scorer
    :func:`check_scorer` accepts."""
    if isinstance(proposal, str):
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal={proposal!r} must be one of {PROPOSALS} or a kvpress ScorerPress instance")
        return
    check_scorer(proposal)


def proposal_scorer(proposal, window_size: int = 64, kernel_size: int = 5) -> ScorerPress | None:
    """The kvpress scorer behind ``proposal``: the instance itself, the scorer a name of :data:`SCORER_PROPOSALS`
    stands for (:func:`named_scorer`), or None for an attention proposal (:data:`ATTENTION_PROPOSALS`)."""
    if isinstance(proposal, str):
        return named_scorer(proposal, window_size, kernel_size) if proposal in SCORER_PROPOSALS else None
    return check_scorer(proposal)


def proposal_label(proposal) -> str:
    """A short label of ``proposal`` for statistics rows: the name, or the scorer's class name."""
    return proposal if isinstance(proposal, str) else type(proposal).__name__


def needs_attention_weights(scorer) -> bool:
    """Whether ``scorer`` reads the layer's attention weights (:data:`ATTENTION_WEIGHT_SCORERS`)."""
    return isinstance(scorer, ATTENTION_WEIGHT_SCORERS)


def scorer_scores(
    proposal,
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attentions: torch.Tensor | None,
    kwargs: dict,
    window_size: int = 64,
    kernel_size: int = 5,
) -> torch.Tensor:
    """Scores of a kvpress top-k scorer, to be turned into a proposal (paper 003 appendix D).

    Args:
        proposal: a name of :data:`SCORER_PROPOSALS` (``window_size`` and ``kernel_size`` set ``snapkv``'s
            SnapKVPress) or a ``ScorerPress`` instance.
        module, hidden_states, keys, values, attentions, kwargs: as passed to a kvpress ``compress``; the scorer's
            ``score`` gets them unchanged.

    Returns:
        ``(B, G, t)`` scores, higher = keep.

    Raises:
        ValueError: for an unknown name or a value :func:`check_scorer` refuses; naming the scorer, when it needs
            attention weights the attention did not return, when its own input check fails (kvpress asserts, e.g.
            ``T > window_size``), and when its scores do not have the shape ``(B, G, t)``.
    """
    scorer = proposal_scorer(proposal, window_size, kernel_size)
    if scorer is None:
        raise ValueError(f"scorer proposal={proposal!r} must be one of {SCORER_PROPOSALS} or a ScorerPress instance")
    if attentions is None and needs_attention_weights(scorer):
        raise ValueError(
            f"proposal={scorer!r} reads the layer's attention weights, which this attention did not "
            "return: load the model with attn_implementation='eager'"
        )
    try:
        scores = scorer.score(module, hidden_states, keys, values, attentions, kwargs)
    except AssertionError as err:  # kvpress checks its inputs with assert
        raise ValueError(f"proposal={scorer!r} cannot score this layer ({keys.shape[2]} entries): {err}") from err
    if tuple(scores.shape) != tuple(keys.shape[:3]):
        raise ValueError(
            f"proposal={scorer!r} returned scores of shape {tuple(scores.shape)}, expected one per KV "
            f"head and entry {tuple(keys.shape[:3])}"
        )
    return scores


def _scorer_key(scorer: ScorerPress) -> tuple:
    """What identifies a scorer's scores in a sweep's memo (:func:`compute_proposal`): its class and field values
    when it is a dataclass of plain values (equal scorers share), else the object itself (held by the memo entry)."""
    if dataclasses.is_dataclass(scorer):
        values = tuple((f.name, getattr(scorer, f.name, None)) for f in dataclasses.fields(scorer))
        if all(v is None or isinstance(v, (bool, int, float, str)) for _, v in values):
            return (type(scorer), values)
    return ("object", id(scorer))


def compute_proposal(
    name,
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attentions: torch.Tensor | None,
    kwargs: dict,
    temperature: float = 1.0,
    uniform_mix: float = 0.0,
    block_size: int = 128,
    window_size: int = 64,
    kernel_size: int = 5,
    score_normalization: str = "softmax",
    memo=None,
) -> torch.Tensor:
    """The group proposal ``pi`` of one layer (docs/methods.md §3 item 1): head proposals -> group mixture (``1/r``)
    -> temperature -> uniform mixing; scorer proposals give group scores -> ``score_normalization`` at temperature
    ``T`` (:func:`score_to_proposal`) -> uniform mixing.

    Args:
        name: one of :data:`PROPOSALS` or a kvpress ``ScorerPress`` instance (:func:`check_scorer`).
        module, hidden_states, keys, values, attentions, kwargs: as passed to a kvpress ``compress``
            (``kwargs["position_embeddings"]`` is used).
        temperature: proposal temperature ``T > 0``.
        uniform_mix: weight ``a`` of the uniform component, in ``[0, 1]``.
        block_size: query rows per block for the all-row proposals.
        window_size, kernel_size: SnapKV adapter parameters.
        score_normalization: ``"softmax"`` or ``"sum"`` for the scorer proposals.
        memo: a memo of a sweep that replays one recorded prefill for several presses (``memo.get(key, compute,
            *keep)``, e.g. ``evaluation.memo.ReplayMemo``), or None. The proposal does not depend on
            ``compression_ratio``, ``correction``, ``tau``, ``budget`` or ``seed``, so the presses that differ only
            there compute it once per layer; the key holds the module, the ``hidden_states`` and ``attentions``
            tensor objects and the proposal options.

    Returns:
        ``(B, G, t)`` float32 rows summing to 1 (full support when ``uniform_mix > 0``).

    Raises:
        ValueError: for an unknown ``name`` or invalid option (see the helpers).
    """
    check_proposal(name)
    scorer = proposal_scorer(name, window_size, kernel_size)

    def compute() -> torch.Tensor:
        if scorer is None:
            stats = take_prefill_stats(kwargs.get("past_key_values"), module.layer_idx, keys, name)
            pi = head_proposals(
                name, module, hidden_states, keys, values, kwargs["position_embeddings"], block_size, stats
            )
            pi = adjust_proposal(group_mixture(pi, keys.shape[1]), temperature, uniform_mix)
        else:
            scores = scorer_scores(scorer, module, hidden_states, keys, values, attentions, kwargs)
            try:
                pi = score_to_proposal(scores, temperature, score_normalization)
            except ValueError as err:  # e.g. "sum" of negative scores: say whose
                raise ValueError(f"proposal={scorer!r}: {err}") from err
            pi = adjust_proposal(pi, 1.0, uniform_mix)
        if not bool(torch.isfinite(pi).all()):
            raise FloatingPointError(f"proposal {proposal_label(name)!r} produced non-finite values")
        return pi

    if memo is None:
        return compute()
    memo_key = (
        name if scorer is None else _scorer_key(scorer),
        id(module),
        id(hidden_states),
        id(attentions),
        tuple(keys.shape),
        float(temperature),
        float(uniform_mix),
        int(block_size),
        score_normalization,
    )
    return memo.get(memo_key, compute, module, hidden_states, attentions, scorer)
