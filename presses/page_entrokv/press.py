"""Page-EntroKV: sink-isolated Rényi-entropy pooling inside GQA groups, evicted by pages under a strict
token budget (paper 000; page policy paper 001 section 7; pooling paper 001 section 3.1; docs/methods.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import ComposedPress, ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from presses.base import Capabilities, ResearchPress
from presses.core.paging import (
    BUDGET_CONFLICT_MODES,
    PAGE_SCORES,
    PageBudget,
    page_budget,
    pages_to_positions,
    protected_page_mask,
    select_pages,
    token_budget,
)
from presses.core.pooling import POOLINGS
from presses.kernels import pooled_page_scores
from presses.observers import observer_attention

__all__ = ["PageEntroKVPress"]


@dataclass
class PageEntroKVPress(ResearchPress, ScorerPress):
    """Page-EntroKV (paper 000; docs/methods.md §1): one page selection per (layer, KV group) at prefill.

    The observer attention of the last ``window_size`` queries (averaged over the window) is pooled
    inside each GQA group with weights ``softmax(-H_alpha / tau)`` of the sink-isolated Rényi entropy,
    projected onto pages of ``page_size`` tokens by block-max, and the best pages are kept under the
    strict budget ``floor(T (1 - compression_ratio))`` on top of the protected sink and window pages
    (paper 001 section 7). Every group keeps the same count, so the cache stays dense and the
    intra-group UOR is exactly 1. Kept positions keep their original RoPE; decoding must continue at
    position ``T`` (kvpress's pipeline and ``model.generate`` do).

    Parameters:
        compression_ratio: fraction of the prompt to evict, in ``[0, 1)``; 0 leaves the cache untouched.
        window_size: ``W`` observer queries (the last ``W`` pages' positions are protected), ``>= 1``.
            A prompt with ``T <= W`` is kept whole.
        n_sink: leading attention-sink positions ``|S|`` (isolated from the entropy, protected), ``>= 0``.
        page_size: ``B`` tokens per page (vLLM's block size 16), ``>= 1``.
        alpha: Rényi order (2 = collision, 1 = Shannon, ``inf`` = min-entropy), ``> 0``.
        tau: group temperature ``tau_g > 0``; ``tau -> inf`` is mean pooling.
        pooling: ``"entropy"`` (default), ``"raw_entropy"`` (no sink isolation), ``"mean"`` (``1/r``),
            ``"max"`` (max over the group's heads).
        page_score: ``"block_max"`` (default) or ``"mass"``.
        on_budget_conflict: ``"raise"`` (default: ``ValueError`` when the protected pages alone exceed
            the budget) or ``"keep_protected"`` (keep only the protected pages, log a warning).
        record: keep per-layer diagnostics in ``self.records`` (reset at each prefill).

    kvpress's wrappers (the press contract, :mod:`presses.base`): it is a ``ScorerPress``. :meth:`score` spreads
    each group's page score over the page's tokens and ranks the protected pages first, so ``AdaKVPress``,
    ``ChunkPress``, ``BlockPress``, ``CriticalKVPress``, ``KeyRerotationPress`` and ``PerLayerCompressionPress``
    select with it (token-granular: page granularity is this press's own :meth:`compress`). ``DecodingPress``
    calls :meth:`compress` during decoding with its buffered hidden states as the observers. In a
    ``ComposedPress`` it must come first (it pages the prompt's own positions).

    Batches: supported; each row gets its own pages, with the same count for every row and group
    (the count depends only on ``T``). Padding tokens are not treated specially.

    ``self.records`` (when ``record``): one dict per layer and batch row of the last prefill with keys
    ``layer_idx``, ``batch_index``, ``T``, ``budget``, ``kept_tokens``, ``page_size``,
    ``protected_pages`` ``(n_protected,)``, ``kept_pages`` ``(G, n_kept_pages)`` (page ids, ascending),
    ``weights`` ``(G, r)`` (``None`` for ``"max"``), ``entropy`` ``(H_Q,)`` (sink-isolated),
    ``raw_entropy`` ``(H_Q,)``, ``z`` ``(H_Q,)`` (non-sink mass), ``effective_compression``,
    ``conflict``, ``bypass`` (empty string or the reason nothing was scored). Tensors are on the CPU;
    the statistic entries are ``None`` when nothing was scored (``T <= W`` or ratio 0).
    """

    compression_ratio: float = 0.0
    window_size: int = 64
    n_sink: int = 4
    page_size: int = 16
    alpha: float = 2.0
    tau: float = 0.5
    pooling: str = "entropy"
    page_score: str = "block_max"
    on_budget_conflict: str = "raise"
    record: bool = False
    capabilities: ClassVar[Capabilities] = Capabilities()
    records: list = field(default_factory=list, init=False, repr=False)
    _stats: list = field(default_factory=list, init=False, repr=False)
    _plan_cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if not (0.0 <= self.compression_ratio < 1.0):
            raise ValueError(f"compression_ratio={self.compression_ratio} must be in [0, 1)")
        for name, low in (("page_size", 1), ("window_size", 1), ("n_sink", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"{name}={value} must be an integer >= {low}")
            setattr(self, name, int(value))
        if not (self.alpha > 0):
            raise ValueError(f"alpha={self.alpha} must be > 0 (Rényi order; float('inf') = min-entropy)")
        if not (self.tau > 0):
            raise ValueError(f"tau={self.tau} must be > 0 (float('inf') = mean pooling)")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {POOLINGS}")
        if self.page_score not in PAGE_SCORES:
            raise ValueError(f"page_score={self.page_score!r} is not one of {PAGE_SCORES}")
        if self.on_budget_conflict not in BUDGET_CONFLICT_MODES:
            raise ValueError(f"on_budget_conflict={self.on_budget_conflict!r} is not one of {BUDGET_CONFLICT_MODES}")

    def reset(self) -> None:
        """Forget the previous request's records, statistics and page plan."""
        self.records = []
        self._stats = []
        self._plan_cache = {}

    def check_wrappers(self, path: list) -> None:
        """Refuse a place in a ``ComposedPress`` after another press (see the class docstring).

        Raises:
            ValueError: naming the position.
        """
        for wrapper, inner in zip(path, path[1:]):
            if isinstance(wrapper, ComposedPress) and wrapper.presses and wrapper.presses[0] is not inner:
                raise ValueError("PageEntroKVPress must be the first press of a ComposedPress: it pages the prompt's "
                                 "positions, which a press before it removes; got it at position "
                                 f"{wrapper.presses.index(inner)}")

    def _observer_attention(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                            attentions: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
        """Observer-averaged attention ``(B, H_Q, T)`` of the last ``min(window_size, n)`` rows of
        ``hidden_states`` (``n`` rows) over ``keys`` (docs/methods.md §1 step 1).

        At prefill the rows are the prompt's last positions. When a wrapper passes fewer rows than keys
        (``DecodingPress``'s buffered decode states, ``ChunkPress``/``BlockPress`` chunks), the observers are
        those rows, taken to be the last keys: at decode their positions end at ``cache_position[-1]`` (RoPE from
        the module's rotary embedding); otherwise the last positions of ``position_embeddings`` are used, as
        kvpress's SnapKV does.
        """
        n, T = hidden_states.shape[1], keys.shape[2]
        W = min(self.window_size, n, T)
        pe = kwargs.get("position_embeddings")
        if n == T or pe is None or attentions is not None:
            return observer_attention(module, hidden_states, keys, W, pe, attentions)
        cos, sin = pe
        if cos.shape[1] < W:  # decode steps: the buffered rows end at the current position
            last = int(kwargs["cache_position"][-1])
            positions = torch.arange(last - W + 1, last + 1, device=keys.device).unsqueeze(0)
            cos, sin = module.rotary_emb(hidden_states[:, -W:], positions)
        return observer_attention(module, hidden_states, keys, W, (cos[:, -W:], sin[:, -W:]), None)

    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
        """Per-token scores for kvpress's score-based wrappers (``ScorerPress.score``).

        Each token gets its group's page score (docs/methods.md §1 steps 1-6); the tokens of protected pages
        (sink pages and the pages touching the last ``window_size`` positions, step 7) get a score above every
        other, so a wrapper's top-k keeps them first.

        Args:
            module, hidden_states, keys, values, attentions, kwargs: as kvpress passes them to ``score``;
                ``keys`` ``(B, G, T, d)``.

        Returns:
            ``(B, G, T)`` float32 scores (higher = keep). When ``n_sink >= T`` every token ties.
        """
        B, G, T, _ = keys.shape
        if self.n_sink >= T:
            return keys.new_zeros(B, G, T, dtype=torch.float32)
        attn = self._observer_attention(module, hidden_states, keys, attentions, kwargs)
        _, pages, _ = pooled_page_scores(attn, G, self.n_sink, self.alpha, self.tau, self.pooling, self.page_size,
                                         self.page_score)
        tokens = pages.repeat_interleave(self.page_size, dim=-1)[..., :T]
        protected = protected_page_mask(T, self.page_size, self.n_sink, self.window_size).to(keys.device)
        protected = protected.repeat_interleave(self.page_size)[:T]
        return tokens.masked_fill(protected, float(tokens.max()) + 1.0)

    def _plan(self, seq_len: int) -> PageBudget:
        """The page plan for ``T`` (computed once per prefill, so a conflict is logged once)."""
        key = (seq_len, self.compression_ratio, self.page_size, self.n_sink, self.window_size, self.on_budget_conflict)
        if key not in self._plan_cache:
            self._plan_cache = {key: page_budget(seq_len, self.compression_ratio, self.page_size, self.n_sink,
                                                 self.window_size, self.on_budget_conflict)}
        return self._plan_cache[key]

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor | None, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
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
            ValueError: on a budget conflict in ``"raise"`` mode (see :func:`presses.core.paging.page_budget`).
        """
        layer_idx = getattr(module, "layer_idx", 0)
        Bsz, G, T, _ = keys.shape
        cache_position = kwargs.get("cache_position")
        if T != hidden_states.shape[1] and cache_position is not None and is_prefilling(cache_position, hidden_states.shape[1]):
            raise ValueError(f"PageEntroKVPress got {T} cache entries for a prefill of {hidden_states.shape[1]} "
                             "tokens: another press compressed this layer first; it must be the first press of "
                             "a ComposedPress")

        bypass = ""
        if self.compression_ratio == 0:
            bypass = "compression_ratio=0"
        elif T <= self.window_size:
            bypass = f"T={T}<=window_size={self.window_size}"
        if bypass:
            b = token_budget(T, self.compression_ratio)
            self._stats.append({"T": T, "kept": T, "budget": b, "protected": T, "conflict": False, "bypass": bypass})
            self._record(layer_idx, T, Bsz, None, None, None, bypass)
            return keys, values

        plan = self._plan(T)
        need_scores = plan.num_selected > 0 or self.record
        # with n_sink >= T every page is protected (plan.num_selected == 0): nothing to score
        can_score = self.n_sink < T
        diag = pages = None
        if need_scores and can_score:
            attn = self._observer_attention(module, hidden_states, keys, attentions, kwargs)
            # dispatch: Triton on CUDA, pooled_group_scores + page_scores elsewhere (presses.kernels)
            _, scores, diag = pooled_page_scores(attn, G, self.n_sink, self.alpha, self.tau, self.pooling,
                                                 self.page_size, self.page_score, diagnostics=self.record)
            pages = select_pages(scores, plan.protected, plan.num_selected)
        else:
            pages = select_pages(torch.zeros(Bsz, G, plan.num_pages, device=keys.device), plan.protected, 0)

        self._stats.append({"T": T, "kept": plan.kept_tokens, "budget": plan.budget,
                            "protected": plan.protected_tokens, "conflict": plan.conflict, "bypass": ""})
        self._record(layer_idx, T, Bsz, plan, pages, diag, "" if can_score else f"n_sink={self.n_sink}>=T={T}")
        if plan.kept_tokens == T:
            return keys, values
        positions = pages_to_positions(pages, T, self.page_size)  # (B, G, n_kept)
        index = positions.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    def _record(self, layer_idx: int, T: int, Bsz: int, plan: PageBudget | None, pages: torch.Tensor | None,
                diag: dict | None, bypass: str) -> None:
        """Append one diagnostics dict per batch row to ``self.records`` (only when ``record``)."""
        if not self.record:
            return

        def row(x, b):
            return None if x is None else x[b].detach().float().cpu()

        for b in range(Bsz):
            kept = plan.kept_tokens if plan is not None else T
            self.records.append({
                "layer_idx": layer_idx,
                "batch_index": b,
                "T": T,
                "budget": plan.budget if plan is not None else token_budget(T, self.compression_ratio),
                "kept_tokens": kept,
                "page_size": self.page_size,
                "protected_pages": None if plan is None else plan.protected.nonzero().squeeze(-1),
                "kept_pages": None if pages is None else pages[b].detach().cpu(),
                "weights": row(diag.get("weights") if diag else None, b),
                "entropy": row(diag.get("entropy") if diag else None, b),
                "raw_entropy": row(diag.get("raw_entropy") if diag else None, b),
                "z": row(diag.get("z") if diag else None, b),
                "effective_compression": 1.0 - kept / T if T else 0.0,
                "conflict": bool(plan.conflict) if plan is not None else False,
                "bypass": bypass,
            })

    def summary(self) -> dict[str, float | int | str]:
        """Statistics of the last prefill (project contract): ``effective_compression`` (mean over
        layers of ``1 - kept / T``), ``kept_tokens`` (per layer and group), ``context_length`` ``T``,
        ``budget_tokens`` ``b``, ``protected_tokens``, ``layers``, ``budget_conflict`` (1 if the
        protected pages exceeded ``b`` in ``keep_protected`` mode) and ``bypass`` (why nothing was
        evicted, or ``""``). Empty before the first prefill."""
        if not self._stats:
            return {}
        n = len(self._stats)
        return {
            "effective_compression": sum(1.0 - s["kept"] / s["T"] for s in self._stats) / n,
            "kept_tokens": round(sum(s["kept"] for s in self._stats) / n),
            "context_length": int(self._stats[-1]["T"]),
            "budget_tokens": int(self._stats[-1]["budget"]),
            "protected_tokens": int(self._stats[-1]["protected"]),
            "layers": n,
            "budget_conflict": int(any(s["conflict"] for s in self._stats)),
            "bypass": self._stats[-1]["bypass"],
        }
