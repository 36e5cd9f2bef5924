"""Proposal distributions ``pi`` over the ``t`` prompt entries for probabilistic eviction.

Paper 003 appendix H (the four proposals ``min``, ``min_h``, ``h2o``, ``h2o_h`` with the harmonic
prior), appendix D (kvpress top-k scorers turned into proposals, D.1 temperature and uniform
mixing) and section 5 (one proposal per GQA group: the mixture of its heads' proposals);
docs/methods.md §3 item 1.

Shapes: ``B`` batch, ``H_Q`` query heads, ``G`` KV groups, ``r = H_Q / G``, ``t`` prompt entries,
``d`` head dim. Query head ``h`` belongs to group ``h // r``. Column sums over all prompt rows are
computed in query blocks (``block_size`` rows at a time), never as a full ``t x t`` matrix per head.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from presses import kernels
from presses.core.columns import harmonic_prior  # noqa: F401  (part of this module's interface)
from presses.core.observer import window_queries
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
    "scorer_scores",
    "compute_proposal",
    "shared_proposals",
]

ATTENTION_PROPOSALS = ("min", "min_h", "h2o", "h2o_h")
SCORER_PROPOSALS = ("snapkv", "tova", "knorm")
PROPOSALS = ATTENTION_PROPOSALS + SCORER_PROPOSALS

_shared: dict | None = None  # the memo of an active shared_proposals() block


def _check_block(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")


def attention_column_sums(module, hidden_states: torch.Tensor, keys: torch.Tensor, position_embeddings,
                          row_weights: torch.Tensor | None = None, block_size: int = 128,
                          scaling: float | None = None) -> torch.Tensor:
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
        scaling: logit scale, default ``module.scaling`` or ``d ** -0.5``.

    Returns:
        ``(B, H_Q, t)`` float32.

    Raises:
        ValueError: if ``block_size < 1`` or ``hidden_states`` and ``keys`` disagree on ``t``.
    """
    _check_block(block_size)
    t = keys.shape[2]
    if hidden_states.shape[1] != t:
        raise ValueError(f"hidden_states has {hidden_states.shape[1]} rows but keys have t={t}: "
                         "proposals need the whole prefill in one forward")
    scaling = getattr(module, "scaling", None) if scaling is None else scaling
    cos, sin = position_embeddings
    out = None
    for start in range(0, t, block_size):
        end = min(start + block_size, t)
        q = window_queries(module, hidden_states[:, :end], end - start, (cos[:, :end], sin[:, :end]))
        w = None if row_weights is None else row_weights[start:end]
        part = kernels.column_sums(q, keys, w, torch.arange(start, end, device=keys.device), scaling)  # dispatch
        out = part if out is None else out + part
    return out


def _normalize(scores: torch.Tensor) -> torch.Tensor:
    """Normalise non-negative scores on the last axis (uniform where a row sums to 0)."""
    total = scores.sum(-1, keepdim=True)
    uniform = torch.full_like(scores, 1.0 / scores.shape[-1])
    return torch.where(total > 0, scores / total.clamp_min(torch.finfo(scores.dtype).tiny), uniform)


def head_proposals(name: str, module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   position_embeddings, block_size: int = 128) -> torch.Tensor:
    """Per-head proposals of paper 003 appendix H.

    - ``min``:   ``pi^h(i) ~ p^h_t(i) ||v_i||`` (last row; the minimum-variance proposal at ``t``)
    - ``min_h``: ``pi^h(i) ~ sum_j h_j p^h_j(i) ||v_i||``
    - ``h2o``:   ``pi^h(i) ~ sum_j p^h_j(i)`` (normalised H2O score, eq. 17)
    - ``h2o_h``: ``pi^h(i) ~ sum_j h_j p^h_j(i)``

    When the layer's prefill attention already computed the statistic (:mod:`presses.probabilistic.prefill_attention`,
    inside the press's prefill) it is used as is; otherwise the column sums are recomputed through the dispatch
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

    Returns:
        ``(B, H_Q, t)`` float32, each row summing to 1.

    Raises:
        ValueError: for an unknown ``name`` or ``block_size < 1``.
    """
    if name not in ATTENTION_PROPOSALS:
        raise ValueError(f"proposal={name!r} must be one of {ATTENTION_PROPOSALS}")
    _check_block(block_size)
    t = keys.shape[2]
    scores = take_prefill_stats(module, keys, name)  # computed by the prefill's own attention, if it could
    if scores is None and name == "min":
        cos, sin = position_embeddings
        q = window_queries(module, hidden_states, 1, (cos, sin))
        scores = kernels.column_sums(q, keys, scaling=getattr(module, "scaling", None))  # dispatch
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


def scorer_scores(name: str, module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  attentions: torch.Tensor | None, kwargs: dict, window_size: int = 64,
                  kernel_size: int = 5) -> torch.Tensor:
    """Scores of a kvpress top-k scorer, to be turned into a proposal (paper 003 appendix D).

    ``snapkv`` -> :class:`kvpress.SnapKVPress` (``window_size``, ``kernel_size``), ``tova`` ->
    :class:`kvpress.TOVAPress`, ``knorm`` -> :class:`kvpress.KnormPress` (negative key norm).

    Returns:
        ``(B, G, t)`` scores, higher = keep.

    Raises:
        ValueError: for an unknown ``name``.
    """
    from kvpress import KnormPress, SnapKVPress, TOVAPress

    scorers = {
        "snapkv": lambda: SnapKVPress(window_size=window_size, kernel_size=kernel_size),
        "tova": TOVAPress,
        "knorm": KnormPress,
    }
    if name not in scorers:
        raise ValueError(f"scorer proposal={name!r} must be one of {SCORER_PROPOSALS}")
    return scorers[name]().score(module, hidden_states, keys, values, attentions, kwargs)


def compute_proposal(name: str, module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     attentions: torch.Tensor | None, kwargs: dict, temperature: float = 1.0,
                     uniform_mix: float = 0.0, block_size: int = 128, window_size: int = 64,
                     kernel_size: int = 5, score_normalization: str = "softmax") -> torch.Tensor:
    """The group proposal ``pi`` of one layer (docs/methods.md §3 item 1): head proposals -> group mixture (``1/r``)
    -> temperature -> uniform mixing; scorer adapters give group scores -> softmax(score / T) ->
    uniform mixing.

    Args:
        name: one of :data:`PROPOSALS`.
        module, hidden_states, keys, values, attentions, kwargs: as passed to a kvpress ``compress``
            (``kwargs["position_embeddings"]`` is used).
        temperature: proposal temperature ``T > 0``.
        uniform_mix: weight ``a`` of the uniform component, in ``[0, 1]``.
        block_size: query rows per block for the all-row proposals.
        window_size, kernel_size: SnapKV adapter parameters.
        score_normalization: ``"softmax"`` or ``"sum"`` for the scorer adapters.

    Returns:
        ``(B, G, t)`` float32 rows summing to 1 (full support when ``uniform_mix > 0``).

    Raises:
        ValueError: for an unknown ``name`` or invalid option (see the helpers).
    """
    memo_key = None
    if _shared is not None:
        memo_key = (name, id(module), id(hidden_states), id(attentions), tuple(keys.shape), float(temperature),
                    float(uniform_mix), int(block_size), int(window_size), int(kernel_size), score_normalization)
        if memo_key in _shared:
            return _shared[memo_key][0]
    if name in ATTENTION_PROPOSALS:
        pi = head_proposals(name, module, hidden_states, keys, values, kwargs["position_embeddings"], block_size)
        pi = adjust_proposal(group_mixture(pi, keys.shape[1]), temperature, uniform_mix)
    elif name in SCORER_PROPOSALS:
        scores = scorer_scores(name, module, hidden_states, keys, values, attentions, kwargs, window_size,
                               kernel_size)
        pi = adjust_proposal(score_to_proposal(scores, temperature, score_normalization), 1.0, uniform_mix)
    else:
        raise ValueError(f"proposal={name!r} must be one of {PROPOSALS}")
    if not bool(torch.isfinite(pi).all()):
        raise FloatingPointError(f"proposal {name!r} produced non-finite values")
    if memo_key is not None:
        # the memo holds the keyed objects, so their ids cannot be reused by other objects while it lives
        _shared[memo_key] = (pi, module, hidden_states, attentions)
    return pi


@contextmanager
def shared_proposals():
    """Compute each layer's proposal once for several presses that replay the same prefill.

    Inside the block, :func:`compute_proposal` returns the proposal it already computed for the same
    attention module, the same ``hidden_states`` tensor object (and ``attentions``) and the same proposal
    options. The proposal does not depend on ``compression_ratio``, ``correction``, ``tau``, ``budget`` or
    ``seed``, so e.g. the corrected and uncorrected presses at two ratios share one computation. Used by
    :mod:`evaluation.fused`, whose replays pass the recorded (never modified) inputs of one prefill; it is
    only valid while the tensors a call sees are not changed in place, so keep the block to one prefill.
    The memo is dropped when the block exits; blocks nest (the inner one starts empty).
    """
    global _shared
    previous, _shared = _shared, {}
    try:
        yield
    finally:
        _shared = previous

