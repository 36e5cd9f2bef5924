"""KVzip's reconstruction scores as the proposal of probabilistic eviction (docs/methods.md §3.9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from kvpress import KVzipPress

from presses import attention
from presses.base import Capabilities
from presses.core.model import attention_modules
from presses.kvzip_pages.base import KVzipResearchPress
from presses.probabilistic import ProbabilisticEvictionPress
from presses.probabilistic.proposals import adjust_proposal, score_to_proposal

__all__ = ["KVzipSamplingPress", "reconstruction_proposals"]

_DEFAULTS = ProbabilisticEvictionPress  # the sampling fields' defaults are the probabilistic press's

#: The fields of :class:`KVzipSamplingPress` the sampling reads (its :meth:`~KVzipSamplingPress.sampler`).
SAMPLING_FIELDS = (
    "compression_ratio",
    "unit",
    "page_size",
    "correction",
    "tau",
    "budget",
    "proposal_temperature",
    "uniform_mix",
    "seed",
    "draws",
)


def reconstruction_proposals(
    scores: torch.Tensor, n_sink: int, temperature: float = 1.0, uniform_mix: float = 0.0
) -> torch.Tensor:
    """KVzip's scores made proposals: ``pi ~ s ** (1 / T)`` per layer and KV head, mixed with the uniform.

    KVzip's score of a cached pair is the most attention any query of the context-reconstruction pass pays it (a
    probability, so non-negative): the proposal normalises it by its sum (paper 003 appendix D, eq. 17, the ``"sum"``
    normalisation of :func:`presses.probabilistic.proposals.score_to_proposal`; a softmax of values in ``[0, 1]``
    would be nearly uniform). The first ``n_sink`` positions get their row's highest score (kvpress's KVzip never
    evicts them; here they are drawn like the best entry), and ``uniform_mix`` mixes in the uniform (appendix D.1),
    which gives every position a chance (positions KVzip does not score, e.g. a chat template's prefix, score 0).

    Args:
        scores: ``(L, B, G, t)`` KVzip's ``score_val`` after the reconstruction pass.
        n_sink: positions raised to their row's maximum, ``>= 0``.
        temperature: ``T > 0`` (appendix D.1).
        uniform_mix: ``a`` in ``[0, 1]``.

    Returns:
        ``(L, B, G, t)`` float32 rows summing to 1.

    Raises:
        ValueError: for negative scores, ``temperature <= 0`` or ``uniform_mix`` outside ``[0, 1]`` (from
            ``score_to_proposal`` and ``adjust_proposal`` of :mod:`presses.probabilistic.proposals`).
    """
    scores = scores.float().clone()
    if n_sink > 0:
        scores[..., :n_sink] = scores.amax(-1, keepdim=True)
    return adjust_proposal(score_to_proposal(scores, temperature, "sum"), 1.0, uniform_mix)


@dataclass
class KVzipSamplingPress(KVzipResearchPress):
    """Probabilistic eviction whose proposal is KVzip's context-reconstruction importance, by pages, SNIS-corrected.

    kvpress's ``KVzipPress`` prefills the context, then runs the model again on the cache to reconstruct the context
    chunk by chunk and scores every cached pair by the most attention a reconstruction query pays it: observers that
    see every page whatever the question. Instead of masking the lowest-scored pairs, this press turns the scores
    into a proposal per layer and KV head (:func:`reconstruction_proposals`) and hands it to probabilistic eviction
    (:meth:`presses.ProbabilisticEvictionPress.evict_with_proposals`): ``m`` pages are drawn with replacement (one
    ``m`` for all layers with the global budget, expected kept count ``(1 - compression_ratio) t``), the drawn pages
    are kept whole, the cache is cut to them (padded per layer) and decoding gets the SNIS bias
    ``(log c - log m - log pi) / tau`` (paper 003, Algorithm 1, eq. 10; pages: docs/methods.md §3.8). So it asks
    whether sampling pages from a strong proposal beats choosing them (``kvzip``, ``kvzip_page``).

    Based on KVzip (https://arxiv.org/abs/2505.23416) and paper 003 (R. Geh et al., *A Probabilistic
    Interpretation of KV Cache Eviction*, 2026).

    Args:
        compression_ratio: target fraction of prompt entries evicted, ``[0, 1)``.
        n_sink, kvzip_plus_normalization, chunk_size: kvpress's ``KVzipPress`` (the scoring); ``layerwise`` is not
            read (the budget is ``budget``).
        unit: ``"page"`` (default) or ``"token"``; page_size, correction, tau, budget, uniform_mix, seed, draws:
            :class:`presses.ProbabilisticEvictionPress`'s, with its defaults.
        proposal_temperature: the probabilistic press's field, default 0.25 here (``pi ~ s ** 4``): tuned on the
            development splits of the needle and of RULER, where it beats ``pi ~ s`` (1.0) in all 8 cells
            (``results/tuning/snis_kvzip_page/``; config ``snis_kvzip_page_t1`` keeps 1.0).

    Raises:
        ValueError: for invalid sampling fields (naming the value, as the probabilistic press does), an attention
            implementation other than sdpa or eager, or a cache the probabilistic press cannot compress; kvpress's
            assertions for KVzip's fields.
    """

    unit: str = "page"
    page_size: int = _DEFAULTS.page_size
    correction: bool = _DEFAULTS.correction
    tau: float = _DEFAULTS.tau
    budget: str = _DEFAULTS.budget
    proposal_temperature: float = 0.25  # tuned on the development splits (results/tuning/snis_kvzip_page/)
    uniform_mix: float = _DEFAULTS.uniform_mix
    seed: int = _DEFAULTS.seed
    draws: str = _DEFAULTS.draws

    #: the contract (presses.base): decode-time bias, per-layer lengths, a reconstruction pass after the prefill,
    #: scored once per example in a sweep from KVzip's scores (evaluation/kvzip_path.py); only the sampling reads
    #: the sampling fields
    capabilities: ClassVar[Capabilities] = Capabilities(
        shares_prefill=False,
        decode_state=True,
        uneven_layers=True,
        extra_forwards=True,
        scores_once=True,
        scores_as=KVzipPress,
        selection_fields=SAMPLING_FIELDS,
    )

    def __post_init__(self):
        self.sampler()  # the probabilistic press checks the sampling fields, naming the value
        super().__post_init__()

    def sampler(self) -> ProbabilisticEvictionPress:
        """A probabilistic press with this press's sampling fields (its own ``proposal`` is not read)."""
        return ProbabilisticEvictionPress(**{name: getattr(self, name) for name in SAMPLING_FIELDS})

    def post_init_from_model(self, model):
        """Install the correcting attention (the SNIS bias is an additive mask, sdpa and eager).

        Raises:
            ValueError: for an attention implementation other than sdpa or eager.
        """
        attention.check_implementation(model, "KVzipSamplingPress")
        attention.install()

    def compress_post(self, model):
        """Sample the kept pages from the reconstruction scores (see the class) instead of kvpress's masking."""
        self.check_cache(self._cache)  # the contract's refusal (presses.base.ResearchPress.check_cache)
        sampler = self.sampler()
        self.record_selection(sampler)
        pi = reconstruction_proposals(self.score_val, self.n_sink, self.proposal_temperature, self.uniform_mix)
        sampler.evict_with_proposals(attention_modules(model), self._cache, list(pi))

    def summary(self) -> dict[str, Any]:
        """The sampling's statistics of the last prefill (:meth:`presses.ProbabilisticEvictionPress.summary`)."""
        last = self.selection()
        return {**last.summary(), "proposal": "kvzip"} if last is not None else {}
