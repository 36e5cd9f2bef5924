"""Any kvpress scorer's per-token scores, evicted by pages under the strict budget (docs/methods.md §1.17)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress import ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from presses.base import KEPT_ENTRIES, Capabilities, ResearchPress, kept_entries_text
from presses.core.paging import (
    PAGE_SCORES,
    PROTECTIONS,
    check_compression_ratio,
    expand_pages,
    page_budget,
    protected_page_mask,
)
from presses.kernels import scorer_page_scores
from presses.page_entrokv.selection import kept_positions
from presses.probabilistic.proposals import needs_attention_weights

__all__ = ["ScorerPagePress", "GROUP_SELECTIONS"]

#: ``"group"``: each KV head keeps its own pages; ``"shared"``: one selection for every KV head of a layer, from the
#: scorer's scores averaged over the heads (ChunkKV's shared chunks, arXiv 2502.00299).
GROUP_SELECTIONS = ("group", "shared")


@dataclass
class ScorerPagePress(ResearchPress, ScorerPress):
    """Keep whole pages of the prompt, ranked by a kvpress scorer's per-token scores (docs/methods.md §1.17).

    Built for learned scorers that need one prefill, e.g. KVzap (``press=KVzapPress(model_type="linear")``, arXiv
    2601.07891: a linear layer per layer predicting KVzip+'s log-scores from the hidden states, trained for the
    model by ``python -m evaluation.train_scorers kvzap``), with Page-EntroKV's page policy (paper 000, page policy
    paper 001 section 7, https://arxiv.org/abs/2610.09757): each page of ``page_size`` positions scores its tokens'
    mean (``page_score``), one selection serves every KV head of a layer (``group_selection``), the sink and window
    pages are protected (``protect``), and the best pages are kept under the strict budget
    ``max(1, floor(T (1 - compression_ratio)))`` tokens, so the cache stays dense. These defaults were chosen on the
    development split among 12 candidates (``results/tuning/learned/``: the mean over the block max and its halo, one
    selection over one per head, protected pages over none); against kvpress's ``ChunkKVPress`` on the same scores
    (arXiv 2502.00299: the chunk mean, one selection, kvpress's budget of chunks) what differs is the protection and the
    strict token budget.

    Parameters:
        press: the kvpress ``ScorerPress`` whose ``score`` ranks the tokens (its own ``compression_ratio`` is not
            read). Its ``post_init_from_model`` runs with this press's (KVzap loads its weights there).
        compression_ratio: fraction of the prompt to evict, in ``[0, 1)``.
        page_size: ``B`` tokens per page, ``>= 1``.
        page_score: ``"block_max"``, ``"halo_max"``, ``"mean"`` or ``"mass"`` (:func:`presses.core.paging.page_scores`).
        group_selection: ``"group"`` or ``"shared"`` (:data:`GROUP_SELECTIONS`).
        protect: ``"sink_window"`` (the pages holding the first ``n_sink`` and the last ``window_size`` positions are
            kept first, shrunk to fit the budget) or ``"none"``.
        n_sink: leading positions protected, ``>= 0``.
        window_size: trailing positions protected, ``>= 1``.

    Raises:
        ValueError: for a ``press`` that is not a ``ScorerPress``, or an option outside the ranges above.
    """

    press: ScorerPress = None
    compression_ratio: float = 0.0
    page_size: int = 32
    page_score: str = "mean"
    group_selection: str = "shared"
    protect: str = "sink_window"
    n_sink: int = 4
    window_size: int = 64
    _stats: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError(f"press={self.press!r} must be a kvpress ScorerPress (e.g. KVzapPress())")
        check_compression_ratio(self.compression_ratio)
        for name, low in (("page_size", 1), ("n_sink", 0), ("window_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"{name}={value} must be an integer >= {low}")
            setattr(self, name, int(value))
        if self.page_score not in PAGE_SCORES:
            raise ValueError(f"page_score={self.page_score!r} is not one of {PAGE_SCORES}")
        if self.group_selection not in GROUP_SELECTIONS:
            raise ValueError(f"group_selection={self.group_selection!r} is not one of {GROUP_SELECTIONS}")
        if self.protect not in PROTECTIONS:
            raise ValueError(f"protect={self.protect!r} is not one of {PROTECTIONS}")

    @property
    def capabilities(self) -> Capabilities:
        """The press contract (:mod:`presses.base`): it compresses in kvpress's forward hooks, so a sweep replays it
        on a shared prefill, unless its scorer reads the attention weights (eager attention, its own prefill)."""
        if needs_attention_weights(self.press):
            return Capabilities(shares_prefill=False, needs_eager=True)
        return Capabilities()

    def post_init_from_model(self, model):
        """The scorer's setup (KVzap: its weights), then the contract's hooks (:mod:`presses.base`)."""
        self.press.post_init_from_model(model)
        super().post_init_from_model(model)

    def reset(self) -> None:
        """Forget the last prefill's statistics."""
        self._stats = []

    # ------------------------------------------------------------------ scoring
    def _page_scores(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values, attentions, kwargs: dict
    ) -> torch.Tensor:
        """``(B, G, P)`` page scores (``(B, 1, P)`` for ``"shared"``) from the scorer's ``(B, G, T)`` token scores,
        through the dispatch point :func:`presses.kernels.scorer_page_scores`."""
        tokens = self._token_scores(module, hidden_states, keys, values, attentions, kwargs)
        return scorer_page_scores(tokens, self.page_size, self.page_score, self.group_selection == "shared")

    def _token_scores(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """The scorer's ``(B, G, T)`` token scores (one call per layer of a sweep's example, :attr:`memo`)."""

        def compute():
            return self.press.score(module, hidden_states, keys, values, attentions, kwargs)

        memo = self.memo
        if memo is None:
            return compute()
        # one scorer call per layer for every ratio and page option of a sweep's example
        key = ("scorer", repr(self.press), id(module), id(hidden_states), tuple(keys.shape))
        return memo.get(key, compute, module, hidden_states)

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> torch.Tensor:
        """Per-token scores for kvpress's score-based wrappers: each token its page's score, the protected pages'
        tokens above every other (``(B, G, T)`` float32)."""
        B, G, T, _ = keys.shape
        pages = self._page_scores(module, hidden_states, keys, values, attentions, kwargs)
        tokens = expand_pages(pages, self.page_size, T).expand(B, G, T)
        protected = protected_page_mask(T, self.page_size, self.n_sink, self.window_size, self.protect)
        protected = expand_pages(protected.to(tokens.device), self.page_size, T)
        return tokens.masked_fill(protected, float(tokens.max()) + 1.0)

    # ------------------------------------------------------------------ selection
    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the protected pages plus the best pages of each KV head under the strict budget.

        Args:
            module: the attention layer; hidden_states ``(B, T, D)``; keys, values ``(B, G, T, d)``; attentions and
                kwargs as kvpress passes them.

        Returns:
            ``(keys, values)`` of shape ``(B, G, n_kept, d)``, positions ascending (the same count for every row and
            head: the cache stays dense).

        Raises:
            ValueError: when another press compressed the layer first (inside a ``ComposedPress``).
        """
        B, G, T, _ = keys.shape
        cache_position = kwargs.get("cache_position")
        n = hidden_states.shape[1]
        if T != n and cache_position is not None and is_prefilling(cache_position, n):
            raise ValueError(
                f"ScorerPagePress got {T} cache entries for a prefill of {n} tokens: another press compressed this "
                "layer first; it must be the first press of a ComposedPress"
            )
        if self.compression_ratio == 0 or T == 0:
            self._stats.append({"T": T, "kept": T, "budget": T})
            return keys, values
        plan = page_budget(
            T, self.compression_ratio, self.page_size, self.n_sink, self.window_size, "shrink", self.protect
        )
        tokens = self._token_scores(module, hidden_states, keys, values, attentions, kwargs)
        shared = self.group_selection == "shared"
        scores = scorer_page_scores(tokens, self.page_size, self.page_score, shared)
        tokens = tokens.float().mean(1, keepdim=True) if shared else tokens  # read for a partial page (§1.12)
        positions, _, _ = kept_positions(plan, scores, tokens, G, self.page_size, union=False)
        self._stats.append({"T": T, "kept": positions.shape[-1], "budget": plan.budget})
        if positions.shape[-1] == T:
            return keys, values
        index = positions.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    # ------------------------------------------------------------------ diagnostics
    def summary(self) -> dict[str, float | int | str]:
        """Statistics of the last prefill: ``effective_compression`` (mean over layers of ``1 - kept / T``),
        ``kept_tokens`` (mean over layers), ``context_length``, ``budget_tokens``, ``layers`` and
        ``kept_entries`` (:data:`presses.base.KEPT_ENTRIES`). Empty before the first prefill."""
        if not self._stats:
            return {}
        n = len(self._stats)
        last = self._stats[-1]
        return {
            "effective_compression": sum(1.0 - s["kept"] / s["T"] for s in self._stats if s["T"]) / n,
            "kept_tokens": round(sum(s["kept"] for s in self._stats) / n),
            "context_length": int(last["T"]),
            "budget_tokens": int(last["budget"]),
            "layers": n,
            KEPT_ENTRIES: kept_entries_text(s["kept"] for s in self._stats),
        }
