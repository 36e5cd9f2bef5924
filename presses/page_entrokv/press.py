"""Page-EntroKV: sink-isolated Rényi-entropy pooling inside GQA groups, evicted by pages under a strict
token budget (paper 000; page policy paper 001 section 7; pooling paper 001 section 3.1; docs/methods.md §1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import ComposedPress, ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from presses.base import Capabilities, RemovedField, ResearchPress, cache_problem
from presses.core.observer import attention_logit_options, rotary_embeddings, window_queries
from presses.core.paging import (
    BUDGET_CONFLICT_MODES,
    PROTECTIONS,
    PageBudget,
    check_compression_ratio,
    expand_pages,
    min_prompt_length,
    page_budget,
    protected_page_mask,
)
from presses.core.pooling import POOLINGS
from presses.kernels import column_sums, pooled_page_scores
from presses.observers import memoized_observers, observer_attention
from presses.page_entrokv.records import layer_records, layer_stats, summarise
from presses.page_entrokv.selection import kept_positions

__all__ = ["PageEntroKVPress", "GROUP_SELECTIONS", "LADDER_PRESS", "MAX_OBSERVERS", "PAGE_SCORE_CHOICES"]

logger = logging.getLogger(__name__)

#: ``group_selection``: each KV group its own pages, or paper 000's per-layer union of the groups' pages.
GROUP_SELECTIONS = ("group", "union")
#: ``page_score``: the page rules of :data:`presses.core.paging.PAGE_SCORES` that Page-EntroKV and its variants use
#: (``"mean"``, ChunkKV's chunk mean, is the ablation ladder's: :data:`LADDER_PRESS`).
PAGE_SCORE_CHOICES = ("block_max", "mass", "halo_max")
#: Paper 000 observes with the prompt's queries up to its prefill observation window of 4096 positions.
MAX_OBSERVERS = 4096
#: The ablation ladder's subclass (docs/methods.md §1.14), which lives with its tuning, outside the library: it adds
#: ChunkKV's options (SnapKV's scores, one selection shared by the groups, the chunk mean, ChunkKV's page count).
LADDER_PRESS = "evaluation.studies.ladder.PageEntroKVLadderPress"


@dataclass
class PageEntroKVPress(ResearchPress, ScorerPress):
    """Page-EntroKV (paper 000; docs/methods.md §1): one page selection per (layer, KV group) at prefill.

    Paper: Inbasekaran S., *Page-EntroKV: Hardware-Aligned, Entropy-Weighted KV-Cache Eviction under Grouped-Query
    Attention* (2026; the text we work from names no arXiv id), with its page policy from paper 001 section 7,
    https://arxiv.org/abs/2610.09757. Method, defaults and the choices we settled: ``docs/methods.md`` §1.

    The observer attention (the last ``observer_window`` prompt queries, averaged over the observers) is pooled
    inside each GQA group with weights ``softmax(-H_alpha / tau)`` of the sink-isolated Rényi entropy, projected
    onto pages of ``page_size`` tokens by block-max, and the best pages are kept under the strict budget
    ``floor(T (1 - compression_ratio))`` on top of the protected sink and window pages (paper 001 section 7).
    Every group keeps the same count, so the cache stays dense and the intra-group UOR is exactly 1. Kept
    positions keep their original RoPE; decoding must continue at position ``T`` (kvpress's pipeline and
    ``model.generate`` do). Any prompt length compresses at any ratio: when the protected pages exceed the
    budget, protection shrinks (window pages first, the sink page last; docs/methods.md §1.12), and no layer is
    ever left empty: a budget below one page keeps one partial page of the ``max(1, b)`` best tokens of each
    group (by the pooled token score; kvpress's ``ScorerPress`` keeps ``int(T (1 - ratio))`` tokens). Prompts
    shorter than :func:`presses.core.paging.min_prompt_length` (for the defaults: 224 tokens at ratio 0.5, 608 at
    0.8, 1248 at 0.9) may therefore keep fewer tokens than the budget by up to a page (effective compression
    above the ratio) or a partial page; the press logs it once per press and setting with the numbers, and
    ``summary()`` reports ``protection_shrunk``, ``budget_tokens`` and ``effective_compression``.

    The ablation ladder from kvpress's ChunkKV to this press (docs/methods.md §1.14) is a subclass that lives with its
    tuning, ``evaluation/studies/ladder.py`` (:data:`LADDER_PRESS`): it adds ChunkKV's options, which no Page-EntroKV
    variant uses, and overrides the steps they change.

    Parameters:
        compression_ratio: fraction of the prompt to evict, in ``[0, 1)``; 0 leaves the cache untouched.
        window_size: ``W``: the pages touching the last ``W`` positions are protected, and the default observers
            are the last ``W`` queries; ``>= 1``.
        n_sink: leading attention-sink positions ``|S|`` (isolated from the entropy, protected), ``>= 0``.
        page_size: ``B`` tokens per page, ``>= 1``; default 32, chosen by win score on a development split
            (``results/tuning/page_entrokv``; paper 000 and vLLM's block size use 16).
        alpha: Rényi order (2 = collision, 1 = Shannon, ``inf`` = min-entropy), ``> 0``.
        tau: group temperature ``tau_g > 0``; ``tau -> inf`` is mean pooling.
        pooling: ``"entropy"`` (default), ``"raw_entropy"`` (no sink isolation), ``"mean"`` (``1/r``) or
            ``"max"`` (max over the group's heads).
        page_score: ``"block_max"`` (default), ``"mass"`` (the page's total) or ``"halo_max"`` (the block max with a
            quarter page of each neighbour): docs/methods.md §1 step 6.
        observer_window: the observers: ``None`` (the last ``window_size`` queries), an int (the last that many
            queries), or ``"all"`` (every prompt query, at most the last 4096: paper 000's prefill observation
            window, docs/methods.md §1.11). Windows above ``observer_block`` rows are averaged block by block
            through the column-sum kernel, so memory stays ``O(observer_block x T)`` per head.
        protect: ``"sink_window"`` (default; docs/methods.md §1 step 7) or ``"none"`` (paper 000 Algorithm 1:
            plain top-K over pages; a partial last page, which every group must keep, stays).
        group_selection: ``"group"`` (default: each KV group keeps its own pages) or ``"union"`` (paper 000: each
            group selects its top-K, and the layer keeps the union of the groups' pages for every group; the
            budget then holds per group selection, not per layer: ``summary()`` reports what was kept).
        max_fallback: ``None`` (default, off) or a threshold in nats: a group whose sink-isolated head entropies
            span less than it (``max_h H_h - min_h H_h``) is pooled by the max over its heads instead (paper
            000's fallback for indistinguishable heads; docs/methods.md §1.11).
        on_budget_conflict: ``"shrink"`` (default: protection shrinks to fit the budget), ``"raise"``
            (``ValueError`` when the protected pages alone exceed the budget) or ``"keep_protected"``.
        observer_block: query rows per block when averaging many observers, ``>= 1``.
        record: keep per-layer diagnostics in ``self.records`` (reset at each prefill).

    kvpress's wrappers (the press contract, :mod:`presses.base`): it is a ``ScorerPress``. :meth:`score` spreads
    each group's page score over the page's tokens and ranks the protected pages first, so ``AdaKVPress``,
    ``ChunkPress``, ``BlockPress``, ``CriticalKVPress``, ``KeyRerotationPress`` and ``PerLayerCompressionPress``
    select with it (token-granular: page granularity is this press's own :meth:`compress`). ``DecodingPress``
    calls :meth:`compress` during decoding with its buffered hidden states as the observers. In a
    ``ComposedPress`` it must come first (it pages the prompt's own positions).

    Batches: supported; each row gets its own pages, with the same count for every row and group (with
    ``"union"``, rows whose union is smaller are filled with their next-best pages). Padding tokens are not
    treated specially.

    Saved runs: ``kernel_size`` and ``budget`` were fields until the ladder moved out (:attr:`removed_fields`); a run
    directory that lists them at the only values this press ran with is read as today's press
    (``evaluation.settings.saved_press``).

    ``self.records`` (when ``record``): one dict per layer and batch row of the last prefill, its keys those of
    :func:`presses.page_entrokv.records.layer_records`.
    """

    compression_ratio: float = 0.0
    window_size: int = 64
    n_sink: int = 4
    page_size: int = 32
    alpha: float = 2.0
    tau: float = 0.5
    pooling: str = "entropy"
    page_score: str = "block_max"
    observer_window: int | str | None = None
    protect: str = "sink_window"
    group_selection: str = "group"
    max_fallback: float | None = None
    on_budget_conflict: str = "shrink"
    observer_block: int = 256
    record: bool = False
    records: list = field(default_factory=list, init=False, repr=False)
    _stats: list = field(default_factory=list, init=False, repr=False)
    _plan_cache: dict = field(default_factory=dict, init=False, repr=False)

    #: The values of the fields that take one of a few (the ladder's subclass adds ChunkKV's).
    choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "pooling": POOLINGS,
        "page_score": PAGE_SCORE_CHOICES,
        "group_selection": GROUP_SELECTIONS,
        "protect": PROTECTIONS,
        "on_budget_conflict": BUDGET_CONFLICT_MODES,
    }
    #: Said where a value of ``pooling``, ``page_score`` or ``group_selection`` is refused.
    ladder_note: ClassVar[str] = f" (ChunkKV's values, the ablation ladder's, are {LADDER_PRESS}'s)"
    #: The integer fields and their minimums.
    minimums: ClassVar[dict[str, int]] = {"page_size": 1, "window_size": 1, "n_sink": 0, "observer_block": 1}
    #: The ladder's fields, which saved runs list at the only values this press ran with.
    removed_fields: ClassVar[dict[str, RemovedField]] = {
        "kernel_size": RemovedField(5, LADDER_PRESS),
        "budget": RemovedField("tokens", LADDER_PRESS),
    }

    def __post_init__(self):
        check_compression_ratio(self.compression_ratio)
        for name, low in self.minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"{name}={value} must be an integer >= {low}")
            setattr(self, name, int(value))
        if self.observer_window is not None and self.observer_window != "all":
            ok = isinstance(self.observer_window, int) and not isinstance(self.observer_window, bool)
            if not ok or self.observer_window < 1:
                raise ValueError(f"observer_window={self.observer_window!r} must be None, 'all' or an integer >= 1")
        if not (self.alpha > 0):
            raise ValueError(f"alpha={self.alpha} must be > 0 (Rényi order; float('inf') = min-entropy)")
        if not (self.tau > 0):
            raise ValueError(f"tau={self.tau} must be > 0 (float('inf') = mean pooling)")
        for name, allowed in self.choices.items():
            value = getattr(self, name)
            if value not in allowed:
                note = self.ladder_note if name in ("pooling", "page_score", "group_selection") else ""
                raise ValueError(f"{name}={value!r} is not one of {allowed}{note}")
        if self.max_fallback is not None and not self.max_fallback >= 0:
            raise ValueError(f"max_fallback={self.max_fallback} must be None or a threshold >= 0 (nats)")

    @property
    def capabilities(self) -> Capabilities:
        """The press contract (:mod:`presses.base`): it compresses in kvpress's forward hooks; with
        ``group_selection="union"`` each layer keeps the union of its groups' pages, whose size differs from layer
        to layer, so the layers' cache lengths differ (``uneven_layers``)."""
        return Capabilities(uneven_layers=self.group_selection == "union")

    def reset(self) -> None:
        """Forget the previous request's records, statistics and page plan."""
        self.records = []
        self._stats = []
        self._plan_cache = {}

    def check_cache(self, cache) -> None:
        """Accept a ``QuantizedCache`` too: this press compresses through kvpress's ``forward_hook``, which dequantizes
        the layer and prunes its quantized storage (:func:`presses.base.cache_problem`).

        Raises:
            ValueError: for a static or offloading cache.
        """
        problem = cache_problem(cache, quantized=True)
        if problem:
            raise ValueError(f"PageEntroKVPress cannot compress this cache: {problem}; use a DynamicCache")

    def check_wrappers(self, path: list) -> None:
        """Refuse a place in a ``ComposedPress`` after another press (see the class docstring).

        Raises:
            ValueError: naming the position.
        """
        for wrapper, inner in zip(path, path[1:]):
            if isinstance(wrapper, ComposedPress) and wrapper.presses and wrapper.presses[0] is not inner:
                raise ValueError(
                    "PageEntroKVPress must be the first press of a ComposedPress: it pages the prompt's "
                    "positions, which a press before it removes; got it at position "
                    f"{wrapper.presses.index(inner)}"
                )

    # ------------------------------------------------------------------ scoring
    def observer_count(self, seq_len: int) -> int:
        """The number of observer queries for a prompt of ``T`` rows (``observer_window`` resolved, at most ``T``)."""
        wanted = (
            self.window_size
            if self.observer_window is None
            else (MAX_OBSERVERS if self.observer_window == "all" else self.observer_window)
        )
        return max(1, min(wanted, seq_len))

    def _observer_attention(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> torch.Tensor:
        """Observer-averaged attention ``(B, H_Q, T)`` of the last observers among the ``n`` rows of
        ``hidden_states`` over ``keys`` (docs/methods.md §1 step 1).

        At prefill the rows are the prompt's last positions; more than ``observer_block`` observers are averaged
        block by block (:func:`presses.kernels.column_sums`). When a wrapper passes fewer rows than keys
        (``DecodingPress``'s buffered decode states, ``ChunkPress``/``BlockPress`` chunks), the observers are
        those rows, taken to be the last keys: at decode their positions end at ``cache_position[-1]`` (RoPE from
        the module's rotary embedding); otherwise the last positions of ``position_embeddings`` are used, as
        kvpress's SnapKV does.
        """
        n, T = hidden_states.shape[1], keys.shape[2]
        W = min(self.observer_count(T), n)
        pe = kwargs.get("position_embeddings")
        return memoized_observers(
            self.memo,
            module,
            hidden_states,
            keys,
            W,
            lambda: self._compute_observers(module, hidden_states, keys, attentions, kwargs, W),
            attentions,
            pe,
            self.observer_block,
        )

    def _compute_observers(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
        W: int,
    ) -> torch.Tensor:
        """The observer attention of :meth:`_observer_attention` (``W`` observers), computed."""
        n, T = hidden_states.shape[1], keys.shape[2]
        pe = kwargs.get("position_embeddings")
        if attentions is not None:
            return observer_attention(module, hidden_states, keys, W, pe, attentions)
        if n == T and pe is not None and W > self.observer_block:
            cos, sin = pe
            scaling, softcap = attention_logit_options(module)
            total = None
            for start in range(T - W, T, self.observer_block):  # column sums of one block of observer rows
                end = min(start + self.observer_block, T)
                q = window_queries(module, hidden_states[:, :end], end - start, (cos[:, :end], sin[:, :end]))
                part = column_sums(q, keys, None, torch.arange(start, end, device=keys.device), scaling, softcap)
                total = part if total is None else total + part
            return total / W
        if n == T or pe is None:
            return observer_attention(module, hidden_states, keys, W, pe, None)
        cos, sin = pe
        if cos.shape[1] < W:  # decode steps: the buffered rows end at the current position
            last = int(kwargs["cache_position"][-1])
            positions = torch.arange(last - W + 1, last + 1, device=keys.device).unsqueeze(0)
            cos, sin = rotary_embeddings(module, hidden_states[:, -W:], positions)
        return observer_attention(module, hidden_states, keys, W, (cos[:, -W:], sin[:, -W:]), None)

    def _page_scores(
        self, attn: torch.Tensor, num_groups: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict | None, torch.Tensor]:
        """Pooled scores ``(B, G, T)`` and page scores ``(B, G, P)`` of the observer attention (docs/methods.md §1
        steps 2-6), with the max-pooling fallback for groups whose head entropies span less than ``max_fallback``
        (§1.11).

        Returns:
            ``(pooled, page scores, diagnostics or None, fallback (B, G) bool)``.
        """
        need_diag = self.record or self.max_fallback is not None
        # dispatch: Triton on CUDA, pooled_group_scores + page_scores elsewhere (presses.kernels)
        pooled, scores, diag = pooled_page_scores(
            attn,
            num_groups,
            self.n_sink,
            self.alpha,
            self.tau,
            self.pooling,
            self.page_size,
            self.page_score,
            diagnostics=need_diag,
        )
        B = attn.shape[0]
        fallback = torch.zeros(B, num_groups, dtype=torch.bool, device=scores.device)
        if self.max_fallback is not None and self.pooling != "max":
            entropy = diag["entropy"].view(B, num_groups, -1)
            fallback = (entropy.amax(-1) - entropy.amin(-1)) < self.max_fallback
            if bool(fallback.any()):
                max_pooled, max_scores, _ = pooled_page_scores(
                    attn, num_groups, self.n_sink, self.alpha, self.tau, "max", self.page_size, self.page_score
                )
                pooled = torch.where(fallback.unsqueeze(-1), max_pooled, pooled)
                scores = torch.where(fallback.unsqueeze(-1), max_scores, scores)
        return pooled, scores, diag, fallback

    def _scores(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
        observed: tuple[torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict | None, torch.Tensor, int]:
        """Page scores of one layer (docs/methods.md §1 steps 1-6); with ``observed`` (:meth:`compress_observed`),
        from that observer attention ``(B, H_Q, T)`` and observer count instead of the layer's own queries. The
        ladder's subclass overrides this step (SnapKV's scores, one selection shared by the groups).

        Returns:
            ``(page scores (B, G, P), token scores (B, G, T), diagnostics or None, fallback (B, G), observers)``.
        """
        if observed is not None:
            attn, observers = observed
        else:
            observers = min(self.observer_count(keys.shape[2]), hidden_states.shape[1])
            attn = self._observer_attention(module, hidden_states, keys, attentions, kwargs)
        tokens, pages, diag, fallback = self._page_scores(attn, keys.shape[1])
        return pages, tokens, diag, fallback, observers

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> torch.Tensor:
        """Per-token scores for kvpress's score-based wrappers (``ScorerPress.score``).

        Each token gets its group's page score (docs/methods.md §1 steps 1-6); the tokens of protected pages
        (step 7, per ``protect``) get a score above every other, so a wrapper's top-k keeps them first.

        Args:
            module, hidden_states, keys, values, attentions, kwargs: as kvpress passes them to ``score``;
                ``keys`` ``(B, G, T, d)``.

        Returns:
            ``(B, G, T)`` float32 scores (higher = keep). When ``n_sink >= T`` every token ties.
        """
        B, G, T, _ = keys.shape
        if self.n_sink >= T:
            return keys.new_zeros(B, G, T, dtype=torch.float32)
        pages = self._scores(module, hidden_states, keys, values, attentions, kwargs)[0]
        return self._token_scores(pages, B, G, T)

    def score_observed(self, attn: torch.Tensor, num_groups: int) -> torch.Tensor:
        """:meth:`score` from an observer attention computed elsewhere (:meth:`compress_observed`'s ``attn``).

        Args:
            attn: ``(B, H_Q, T)`` observer attention.
            num_groups: ``G``, dividing ``H_Q``.

        Returns:
            ``(B, G, T)`` float32: each token its group's page score, the protected pages' tokens above every other.

        Raises:
            ValueError: for ``G`` not dividing ``H_Q``.
        """
        B, HQ, T = attn.shape
        if num_groups < 1 or HQ % num_groups:
            raise ValueError(f"num_groups={num_groups} must divide the number of query heads H_Q={HQ}")
        if self.n_sink >= T:
            return attn.new_zeros(B, num_groups, T, dtype=torch.float32)
        keys = attn.new_empty(B, num_groups, T, 0)  # only the shape is read
        pages = self._scores(None, None, keys, None, None, {}, (attn, 0))[0]
        return self._token_scores(pages, B, num_groups, T)

    def protected_positions(self, seq_len: int, device=None) -> torch.Tensor:
        """``(T,)`` bool: the positions of the pages :meth:`score` ranks first (the sink and window pages of
        ``protect``; docs/methods.md §1 step 7, before any shrinking to fit the budget)."""
        protected = protected_page_mask(seq_len, self.page_size, self.n_sink, self.window_size, self.protect)
        return expand_pages(protected.to(device), self.page_size, seq_len)

    def _token_scores(self, pages: torch.Tensor, B: int, G: int, T: int) -> torch.Tensor:
        """Page scores spread over their tokens, protected pages first (:meth:`score`)."""
        tokens = expand_pages(pages, self.page_size, T).expand(B, G, T)
        return tokens.masked_fill(self.protected_positions(T, pages.device), float(tokens.max()) + 1.0)

    # ------------------------------------------------------------------ selection
    def _budget_rule(self) -> dict:
        """The page plan's settings besides ``T`` and the conflict mode, as :func:`presses.core.paging.page_budget`
        and :func:`presses.core.paging.min_prompt_length` take them (the strict token budget; the ladder's subclass
        adds ChunkKV's page count)."""
        return {
            "compression_ratio": self.compression_ratio,
            "page_size": self.page_size,
            "n_sink": self.n_sink,
            "window_size": self.window_size,
            "protect": self.protect,
        }

    def _plan(self, seq_len: int) -> PageBudget:
        """The page plan for ``T`` (computed once per prefill, so a conflict is logged once)."""
        rule = self._budget_rule()
        key = (seq_len, self.on_budget_conflict, *rule.items())
        if key not in self._plan_cache:
            self._plan_cache = {key: page_budget(seq_len, on_budget_conflict=self.on_budget_conflict, **rule)}
            self._warn_short_prompt(self._plan_cache[key], rule)
        return self._plan_cache[key]

    def _warn_short_prompt(self, plan: PageBudget, rule: dict) -> None:
        """Log once per press and setting (``rule``, :meth:`_budget_rule`) when a prompt cannot keep the budget by
        whole pages: protection shrank to fit it, or the budget is below one page (docs/methods.md §1.12). A
        ``keep_protected`` conflict is logged by :func:`presses.core.paging.page_budget` itself."""
        T, B = plan.seq_len, self.page_size
        if T == 0 or plan.conflict or not (plan.shrunk or plan.budget < B):
            return
        setting = tuple(rule.items())
        warned = self.__dict__.setdefault("_warned_settings", set())  # not a field: outlives reset()
        if setting in warned:
            return
        warned.add(setting)
        shortest = min_prompt_length(**rule)
        how = (
            f"a partial page of its {plan.partial} best tokens"
            if plan.partial
            else f"{plan.kept_tokens} tokens ({plan.protected_tokens} protected)"
        )
        logger.warning(
            "%s: a prompt of T=%d tokens cannot keep compression_ratio=%s by pages of page_size=%d: budget b=%d, "
            "kept %s, effective compression %.3f; prompts of at least %d tokens keep it (docs/methods.md §1.12; "
            "logged once per press and setting)",
            type(self).__name__,
            T,
            self.compression_ratio,
            B,
            plan.budget,
            how,
            plan.effective_compression,
            shortest,
        )

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the protected pages plus the best ``K`` pages of each KV group (docs/methods.md §1 steps 1-9).

        Args:
            module: the attention layer (``layer_idx``, ``q_proj``, ``head_dim``, ``config``).
            hidden_states: ``(B, T, D_model)``.
            keys, values: ``(B, G, T, d)``.
            attentions: ``(B, H_Q, T, T)`` eager attention weights, or ``None`` (recomputed).
            kwargs: the hook's kwargs (``position_embeddings``).

        Returns:
            ``(keys, values)`` of shape ``(B, G, n_kept, d)``, positions ascending.

        Raises:
            ValueError: on a budget conflict in ``"raise"`` mode (see :func:`presses.core.paging.page_budget`), or
                when another press compressed the layer first (inside a ``ComposedPress``).
        """
        T = keys.shape[2]
        cache_position = kwargs.get("cache_position")
        if (
            T != hidden_states.shape[1]
            and cache_position is not None
            and is_prefilling(cache_position, hidden_states.shape[1])
        ):
            raise ValueError(
                f"PageEntroKVPress got {T} cache entries for a prefill of {hidden_states.shape[1]} "
                "tokens: another press compressed this layer first; it must be the first press of "
                "a ComposedPress"
            )
        return self._evict(
            module, keys, values, lambda: self._scores(module, hidden_states, keys, values, attentions, kwargs)
        )

    def compress_observed(
        self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor, attn: torch.Tensor, observers: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compress` with the observer attention computed elsewhere (e.g. the queries of a context-reconstruction
        pass, :class:`presses.PageEntroKVReconstructionPress`): pooled, paged, protected and selected as
        :meth:`compress` does (docs/methods.md §1 steps 2-9).

        Args:
            module: the attention layer (``layer_idx``).
            keys, values: ``(B, G, T, d)`` the layer's cache.
            attn: ``(B, H_Q, T)`` float observer attention (each row's non-sink mass is what the entropy normalises).
            observers: the number of observer queries behind ``attn`` (statistics only).

        Returns:
            ``(keys, values)`` of shape ``(B, G, n_kept, d)``, positions ascending.

        Raises:
            ValueError: for an ``attn`` whose shape is not ``(B, H_Q, T)`` with ``G`` dividing ``H_Q``, or a budget
                conflict in ``"raise"`` mode.
        """
        B, G, T, _ = keys.shape
        if attn.dim() != 3 or attn.shape[0] != B or attn.shape[-1] != T or attn.shape[1] % G:
            raise ValueError(
                f"attn has shape {tuple(attn.shape)}; expected (B={B}, H_Q, T={T}) with G={G} dividing H_Q"
            )
        return self._evict(
            module, keys, values, lambda: self._scores(module, None, keys, values, None, {}, (attn, observers))
        )

    def _evict(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor, scored) -> tuple:
        """The selection of :meth:`compress` (steps 7-9, :func:`presses.page_entrokv.selection.kept_positions`) on
        the page scores ``scored()`` returns (see :meth:`_scores`), with the layer's statistics and records
        (:mod:`presses.page_entrokv.records`)."""
        layer_idx = getattr(module, "layer_idx", 0)
        Bsz, G, T, _ = keys.shape
        if self.compression_ratio == 0 or T == 0:
            bypass = "compression_ratio=0" if T else "T=0"
            self._stats.append(layer_stats(T, T, None, bypass))
            if self.record:
                self.records += layer_records(layer_idx, T, Bsz, self.page_size, self.compression_ratio, bypass=bypass)
            return keys, values

        plan = self._plan(T)
        need_scores = plan.num_selected > 0 or 0 < plan.partial < T or self.record
        can_score = self.n_sink < T  # with n_sink >= T nothing is left to isolate: pages tie, lower ids win
        diag, fallback, observers = None, None, 0
        if need_scores and can_score:
            scores, tokens, diag, fallback, observers = scored()
        else:
            scores = torch.zeros(Bsz, G, plan.num_pages, device=keys.device)
            tokens = torch.zeros(Bsz, G, T, device=keys.device)
        union = self.group_selection == "union" and G > 1
        positions, pages, selected = kept_positions(plan, scores, tokens, G, self.page_size, union)
        kept = positions.shape[-1]
        groups = 0 if fallback is None else int(fallback.sum())
        self._stats.append(layer_stats(T, kept, plan, "", observers, groups))
        if self.record:
            self.records += layer_records(
                layer_idx,
                T,
                Bsz,
                self.page_size,
                self.compression_ratio,
                plan,
                pages=pages,
                selected=selected,
                diag=diag,
                fallback=fallback,
                bypass="" if can_score else f"n_sink={self.n_sink}>=T={T}",
                observers=observers,
                positions=positions,
            )
        if kept == T:
            return keys, values
        index = positions.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    # ------------------------------------------------------------------ statistics
    def summary(self) -> dict[str, float | int | str]:
        """Statistics of the last prefill (the press contract; its keys:
        :func:`presses.page_entrokv.records.summarise`). Empty before the first prefill."""
        return summarise(self._stats)
