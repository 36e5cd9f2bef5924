"""Page-granular KV selection under a strict token budget (one job: pages).

docs/methods.md §1 steps 6-9; paper 001 section 7 (eq. 29, Proposition 7.1; its union and byte accounting is the
UOR study's, :mod:`evaluation.uor.pages`); paper 000 Theorem 3 (cardinality exactness). Page ``k`` holds positions
``[kB, (k+1)B)``; the last page may be partial. Shapes use ``B`` for the batch, ``G`` KV groups, ``T`` positions,
``P`` pages (``P = ceil(T / page_size)``).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

__all__ = [
    "PAGE_SCORES",
    "BUDGETS",
    "BUDGET_CONFLICT_MODES",
    "PROTECTIONS",
    "PageBudget",
    "token_budget",
    "num_pages",
    "page_scores",
    "expand_pages",
    "protected_page_mask",
    "page_budget",
    "min_prompt_length",
    "select_pages",
    "select_tokens",
    "pages_to_positions",
    "select_positions",
]

logger = logging.getLogger(__name__)

PAGE_SCORES = ("block_max", "mass", "mean", "halo_max")
#: How many pages a layer keeps: ``"tokens"`` (the strict token budget ``floor(T (1 - ratio))``, docs/methods.md §1
#: step 8) or ``"pages"`` (ChunkKV's count ``max(1, int(P (1 - ratio)))`` of the ``P`` pages, a partial one included).
BUDGETS = ("tokens", "pages")
BUDGET_CONFLICT_MODES = ("shrink", "raise", "keep_protected")
PROTECTIONS = ("sink_window", "none")


def check_compression_ratio(value, name: str = "compression_ratio") -> None:
    """Refuse a compression ratio that is not a number in ``[0, 1)`` (kvpress's range: the fraction of the
    prompt's KV entries removed).

    Raises:
        ValueError: naming the value (a string, ``None`` or ``nan`` included) and the range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a number in [0, 1), not {type(value).__name__}")
    if not 0 <= value < 1:
        raise ValueError(f"{name}={value} must be in [0, 1)")


def token_budget(seq_len: int, compression_ratio: float) -> int:
    """Strict token budget ``b = floor(T * (1 - compression_ratio))`` (docs/methods.md §1 step 8).

    A tolerance of ``1e-6`` tokens absorbs binary round-off (``1000 * (1 - 0.9)`` is ``99.999...``
    in floating point and must give ``100``).

    Raises:
        ValueError: if ``compression_ratio`` is outside ``[0, 1)`` or ``seq_len < 0``.
    """
    check_compression_ratio(compression_ratio)
    if seq_len < 0:
        raise ValueError(f"seq_len={seq_len} must be >= 0")
    return math.floor(seq_len * (1.0 - compression_ratio) + 1e-6)


def num_pages(seq_len: int, page_size: int) -> int:
    """``ceil(T / page_size)``: the number of pages, the last one possibly partial."""
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    return -(-seq_len // page_size)


def page_scores(scores: torch.Tensor, page_size: int, method: str = "block_max") -> torch.Tensor:
    """Page priorities from per-position scores (docs/methods.md §1 step 6, paper 001 eq. 29).

    Args:
        scores: ``(..., T)`` per-position scores (e.g. the pooled ``p_g``).
        page_size: ``B`` tokens per page, ``>= 1``.
        method: ``"block_max"`` (``max_{j in page} p[j]``, default), ``"mass"`` (``sum_{j in page} p[j]``) or
            ``"mean"`` (the page's mean, a partial last page over its own positions: ChunkKV's chunk score,
            arXiv 2502.00299, computed as kvpress's ``ChunkKVPress`` computes it, so the two agree bit for bit), or
            ``"halo_max"`` (the block max over the page and a halo of ``max(1, B // 4)`` positions of each neighbour:
            a page next to a high score at its neighbour's edge shares it, so an answer the page grid cuts in two can
            keep both halves; docs/methods.md §1 step 6, this project's variant, measured in
            ``results/tuning/page_halo/``).

    Returns:
        ``(..., P)`` float32 page scores; a partial last page uses only its existing positions.

    Raises:
        ValueError: for ``page_size < 1`` or an unknown ``method``.
    """
    if method not in PAGE_SCORES:
        raise ValueError(f"page_score={method!r} is not one of {PAGE_SCORES}")
    T = scores.shape[-1]
    P = num_pages(T, page_size)
    pad = P * page_size - T
    s = scores.float()
    if method == "mean":  # full pages by one reshape, the partial page on its own (kvpress's ChunkKVPress)
        full = T // page_size
        means = [s[..., : full * page_size].reshape(*s.shape[:-1], full, page_size).mean(-1)]
        if pad:
            means.append(s[..., full * page_size :].mean(-1, keepdim=True))
        return torch.cat(means, dim=-1)
    if method == "halo_max":
        halo = max(1, page_size // 4)
        s = torch.nn.functional.max_pool1d(s.reshape(-1, 1, T), 2 * halo + 1, stride=1, padding=halo).reshape(s.shape)
    if method in ("block_max", "halo_max"):
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
        return s.reshape(*s.shape[:-1], P, page_size).amax(-1)
    s = torch.nn.functional.pad(s, (0, pad), value=0.0)
    return s.reshape(*s.shape[:-1], P, page_size).sum(-1)


def expand_pages(x: torch.Tensor, page_size: int, seq_len: int) -> torch.Tensor:
    """Give every token the value of its page: ``out[..., i] = x[..., i // B]`` for ``i < T``.

    Used for page scores handed to kvpress's per-token selection (Page-EntroKV's ``score``, KVzip's pages), and for
    page SNIS's draw counts ``c_p`` (a token is kept iff its page was drawn) and page proposal ``pi_p``, so that
    :func:`presses.probabilistic.correction.snis_bias` gives every token of page ``p`` the bias
    ``(log c_p - log m - log pi_p) / tau``.

    Args:
        x: ``(..., P)`` per-page values, ``P = ceil(T / B)``.
        page_size: ``B >= 1``.
        seq_len: ``T``.

    Returns:
        ``(..., T)`` tensor of ``x``'s dtype.

    Raises:
        ValueError: if ``page_size < 1`` or ``x`` does not have ``ceil(T / B)`` pages.
    """
    P = num_pages(seq_len, page_size)
    if x.shape[-1] != P:
        raise ValueError(
            f"expected ceil(T / page_size) = {P} pages (T={seq_len}, page_size={page_size}), got {x.shape[-1]}"
        )
    if page_size == 1:
        return x
    return x.repeat_interleave(page_size, dim=-1)[..., :seq_len]


def protected_page_mask(
    seq_len: int, page_size: int, n_sink: int, window_size: int, protect: str = "sink_window"
) -> torch.Tensor:
    """Protected pages (docs/methods.md §1 step 7).

    ``protect="sink_window"``: every page holding a sink position ``j < n_sink`` and every page touching the last
    ``window_size`` positions (this includes the final, partial page). ``protect="none"`` (paper 000's plain
    top-K over pages, docs/methods.md §1.11): only a partial last page, the page the next tokens are written
    into, which every group must keep for the cache to stay one dense tensor.

    Returns:
        ``(P,)`` bool mask on the CPU.

    Raises:
        ValueError: for ``page_size < 1``, ``n_sink < 0``, ``window_size < 1`` or an unknown ``protect``.
    """
    if n_sink < 0:
        raise ValueError(f"n_sink={n_sink} must be >= 0")
    if window_size < 1:
        raise ValueError(f"window_size={window_size} must be >= 1")
    if protect not in PROTECTIONS:
        raise ValueError(f"protect={protect!r} is not one of {PROTECTIONS}")
    P = num_pages(seq_len, page_size)
    mask = torch.zeros(P, dtype=torch.bool)
    if P == 0:
        return mask
    if protect == "none":
        mask[-1] = seq_len % page_size != 0
        return mask
    n_sink_pages = num_pages(min(n_sink, seq_len), page_size)
    mask[:n_sink_pages] = True
    first_window_page = max(seq_len - window_size, 0) // page_size
    mask[first_window_page:] = True
    return mask


def shrink_protection(
    protected: torch.Tensor, page_len: torch.Tensor, n_sink_pages: int, budget: int, page_size: int
) -> torch.Tensor:
    """Unprotect pages until the protected tokens fit ``budget`` (docs/methods.md §1.12).

    Window pages lose protection first, oldest first; then the sink pages, latest first. A partial last page
    keeps its protection whatever the budget (every group must keep it for the cache to stay dense), so the
    kept count can exceed ``budget`` by less than one page.

    Args:
        protected: ``(P,)`` bool mask (:func:`protected_page_mask`).
        page_len: ``(P,)`` tokens per page.
        n_sink_pages: the leading pages that hold sink positions.
        budget: ``b`` tokens.
        page_size: ``B`` (a last page shorter than ``B`` is partial).

    Returns:
        A new ``(P,)`` bool mask.
    """
    protected = protected.clone()
    P = protected.numel()
    pinned = P - 1 if P and int(page_len[-1]) < page_size else None  # a partial last page
    window = [k for k in range(n_sink_pages, P) if protected[k] and k != pinned]
    sinks = [k for k in reversed(range(min(n_sink_pages, P))) if protected[k] and k != pinned]
    for k in window + sinks:
        if int(page_len[protected].sum()) <= budget:
            break
        protected[k] = False
    return protected


@dataclass(frozen=True)
class PageBudget:
    """The page plan of one prefill length (identical for every layer, group and batch row).

    Attributes:
        seq_len: ``T``.
        budget: ``b = floor(T (1 - compression_ratio))`` tokens.
        page_size: ``B``.
        protected: ``(P,)`` bool mask of protected pages.
        protected_tokens: tokens on protected pages.
        num_selected: ``K``, unprotected pages kept per group.
        kept_tokens: ``protected_tokens + K * B`` (``<= budget`` unless ``conflict``, or by less than one page for
            a protected partial last page), or ``partial``.
        conflict: True when the protected pages alone exceed ``budget`` (``keep_protected`` mode).
        shrunk: True when pages lost their protection to fit ``budget`` (``shrink`` mode).
        partial: 0, or the tokens of the one partial page kept when whole pages would keep nothing (a budget below
            one page and no protected page left): ``max(1, budget)``, each group's best tokens by token score
            (:func:`select_tokens`; docs/methods.md §1.12). Then ``protected`` is empty and ``num_selected`` 0.
    """

    seq_len: int
    budget: int
    page_size: int
    protected: torch.Tensor
    protected_tokens: int
    num_selected: int
    kept_tokens: int
    conflict: bool
    shrunk: bool = False
    partial: int = 0

    @property
    def num_pages(self) -> int:
        """``P``."""
        return int(self.protected.numel())

    @property
    def effective_compression(self) -> float:
        """``1 - kept / T`` (0 for an empty context)."""
        return 1.0 - self.kept_tokens / self.seq_len if self.seq_len else 0.0


def page_budget(
    seq_len: int,
    compression_ratio: float,
    page_size: int,
    n_sink: int,
    window_size: int,
    on_budget_conflict: str = "shrink",
    protect: str = "sink_window",
    budget: str = "tokens",
) -> PageBudget:
    """Strict budget plan (docs/methods.md §1 step 8 and §1.12, paper 000 Theorem 3).

    Keeps all protected pages plus ``K = floor((b - protected_tokens) / B)`` unprotected pages (capped by the
    number of unprotected pages), so the kept count never exceeds ``b``, except by less than one page when a
    partial last page alone exceeds it. Unprotected pages are always full: a partial last page is protected.
    Never an empty layer: when that keeps nothing of a non-empty prompt (``b < B`` and no page left protected),
    the plan keeps one partial page of ``max(1, b)`` tokens instead (``partial``: each group's best tokens, as
    kvpress's ``ScorerPress`` keeps ``int(T (1 - ratio))`` tokens, at least one; docs/methods.md §1.12).
    Prompts shorter than :func:`min_prompt_length` may keep less than ``b - B`` (protection shrunk) or a
    partial page.

    Args:
        seq_len: ``T``.
        compression_ratio: in ``[0, 1)``.
        page_size: ``B >= 1``.
        n_sink: sink positions ``>= 0``.
        window_size: observer window ``W >= 1`` (its pages are protected).
        on_budget_conflict: what to do when the protected pages alone exceed ``b``: ``"shrink"`` (default:
            protection shrinks until it fits, :func:`shrink_protection`), ``"raise"``, or ``"keep_protected"``
            (keep only the protected pages and log a warning).
        protect: ``"sink_window"`` or ``"none"`` (:func:`protected_page_mask`).
        budget: ``"tokens"`` (``b = floor(T (1 - compression_ratio))``) or ``"pages"`` (ChunkKV's count of
            ``n = max(1, int(P (1 - compression_ratio)))`` pages, kvpress's ``ChunkKVPress``: ``b = n B`` tokens, so
            the kept pages, a protected partial page counted as one, number ``n``).

    Returns:
        A :class:`PageBudget`.

    Raises:
        ValueError: when the protected tokens exceed ``b`` in ``"raise"`` mode (the message names ``T``, ``b``,
            the protected tokens, ``page_size``, ``n_sink``, ``window_size`` and :func:`min_prompt_length`), or for
            invalid arguments.
    """
    if on_budget_conflict not in BUDGET_CONFLICT_MODES:
        raise ValueError(f"on_budget_conflict={on_budget_conflict!r} is not one of {BUDGET_CONFLICT_MODES}")
    b = _budget_tokens(seq_len, compression_ratio, page_size, budget)
    protected = protected_page_mask(seq_len, page_size, n_sink, window_size, protect)
    page_len = _page_lengths(seq_len, page_size)
    protected_tokens = int(page_len[protected].sum())
    shrunk = False
    if protected_tokens > b:
        if on_budget_conflict in ("raise", "keep_protected"):
            shortest = min_prompt_length(compression_ratio, page_size, n_sink, window_size, protect, budget)
            msg = (
                f"Page-EntroKV budget conflict: the protected pages hold {protected_tokens} tokens but the "
                f"budget is b={b} (T={seq_len}, compression_ratio={compression_ratio}, page_size={page_size}, "
                f"n_sink={n_sink}, window_size={window_size}; prompts of at least {shortest} tokens fit); lower "
                f"compression_ratio, window_size, n_sink or page_size, or set on_budget_conflict='shrink' or "
                f"'keep_protected'"
            )
            if on_budget_conflict == "raise":
                raise ValueError(msg)
            logger.warning("%s. Keeping only the protected pages (effective budget %d tokens).", msg, protected_tokens)
            return PageBudget(seq_len, b, page_size, protected, protected_tokens, 0, protected_tokens, True)
        n_sink_pages = num_pages(min(n_sink, seq_len), page_size) if protect == "sink_window" else 0
        shrunk_mask = shrink_protection(protected, page_len, n_sink_pages, b, page_size)
        shrunk = not torch.equal(shrunk_mask, protected)  # a partial last page alone cannot shrink
        protected, protected_tokens = shrunk_mask, int(page_len[shrunk_mask].sum())
    n_free = int((~protected).sum())
    K = min(max(b - protected_tokens, 0) // page_size, n_free)
    kept = protected_tokens + K * page_size
    partial = max(1, b) if kept == 0 and seq_len > 0 else 0  # never an empty layer (docs/methods.md §1.12)
    return PageBudget(seq_len, b, page_size, protected, protected_tokens, K, kept or partial, False, shrunk, partial)


def _budget_tokens(seq_len: int, compression_ratio: float, page_size: int, budget: str) -> int:
    """``b`` of :func:`page_budget`: ``floor(T (1 - ratio))`` tokens, or ChunkKV's ``max(1, int(P (1 - ratio)))``
    pages of ``B`` tokens for ``budget="pages"``.

    Raises:
        ValueError: for an unknown ``budget`` or an invalid ratio.
    """
    if budget not in BUDGETS:
        raise ValueError(f"budget={budget!r} is not one of {BUDGETS}")
    b = token_budget(seq_len, compression_ratio)
    if budget == "pages" and seq_len:  # ChunkKV's expression, float for float
        b = max(1, int(num_pages(seq_len, page_size) * (1 - compression_ratio))) * page_size
    return b


def _page_lengths(seq_len: int, page_size: int) -> torch.Tensor:
    """``(P,)`` long: the tokens of every page, ``B`` but for a partial last page."""
    P = num_pages(seq_len, page_size)
    page_len = torch.full((P,), page_size, dtype=torch.long)
    if P:
        page_len[-1] = seq_len - (P - 1) * page_size
    return page_len


@functools.lru_cache(maxsize=1024)
def min_prompt_length(
    compression_ratio: float,
    page_size: int,
    n_sink: int,
    window_size: int,
    protect: str = "sink_window",
    budget: str = "tokens",
) -> int:
    """The shortest prompt from which every longer one keeps its budget by whole pages (docs/methods.md §1.12).

    A prompt of ``T`` tokens keeps its budget when its protected pages fit ``b`` (:func:`page_budget` shrinks no
    protection and has no conflict) and ``b`` is at least one page (``b >= B``): it then keeps
    ``b - B < kept <= b`` tokens by whole pages (or more, by less than one page, for a protected partial last
    page). Shorter prompts may not: they keep fewer tokens than ``b`` (protection shrunk) or a partial page.
    The protected tokens are at most ``ceil(n_sink / B) B + W + B - 1`` (sink pages and the pages touching the
    last ``W`` positions; ``B - 1``, a partial last page, with ``protect="none"``), and ``b`` never decreases
    with ``T``, so the answer is found by a short scan below the first ``T`` whose ``b`` covers that bound.

    Args:
        compression_ratio, page_size, n_sink, window_size, protect, budget: as :func:`page_budget`.

    Returns:
        ``T0 >= 1``: every ``T >= T0`` keeps its budget, ``T0 - 1`` does not (1 when ``compression_ratio`` is 0:
        nothing is evicted).

    Raises:
        ValueError: for invalid arguments (as :func:`page_budget`).
    """
    check_compression_ratio(compression_ratio)
    protected_page_mask(1, page_size, n_sink, window_size, protect)  # validates page_size, n_sink, W, protect
    _budget_tokens(1, compression_ratio, page_size, budget)  # validates budget
    if compression_ratio == 0:
        return 1

    def keeps_budget(T: int) -> bool:
        b = _budget_tokens(T, compression_ratio, page_size, budget)
        mask = protected_page_mask(T, page_size, n_sink, window_size, protect)
        return b >= page_size and int(_page_lengths(T, page_size)[mask].sum()) <= b

    if protect == "sink_window":
        most = num_pages(n_sink, page_size) * page_size + window_size + page_size - 1
    else:
        most = page_size - 1
    bound = max(most, page_size)
    high = max(1, math.ceil(bound / (1.0 - compression_ratio)))  # b(high) >= bound, up to round-off
    while _budget_tokens(high, compression_ratio, page_size, budget) < bound:
        high *= 2
    low = 1  # b never decreases with T: the first T whose b covers the bound, by bisection
    while low < high:
        mid = (low + high) // 2
        if _budget_tokens(mid, compression_ratio, page_size, budget) >= bound:
            high = mid
        else:
            low = mid + 1
    T0 = high
    while T0 > 1 and keeps_budget(T0 - 1):
        T0 -= 1
    return T0


def select_pages(scores: torch.Tensor, protected: torch.Tensor, num_selected: int) -> torch.Tensor:
    """Protected pages plus the ``num_selected`` best unprotected pages of every row (docs/methods.md §1 step 8).

    Ties go to the lower page index; NaN scores rank last.

    Args:
        scores: ``(..., P)`` page scores.
        protected: ``(P,)`` bool mask.
        num_selected: ``K``, ``0 <= K <= #unprotected``.

    Returns:
        ``(..., n_protected + K)`` long page ids, ascending in every row.

    Raises:
        ValueError: if ``K`` is negative or exceeds the unprotected pages, or shapes disagree.
    """
    P = scores.shape[-1]
    if protected.shape != (P,):
        raise ValueError(f"protected mask has shape {tuple(protected.shape)}, expected ({P},)")
    protected = protected.to(scores.device)
    free = (~protected).nonzero().squeeze(-1)
    if not (0 <= num_selected <= free.numel()):
        raise ValueError(f"num_selected={num_selected} must be in [0, {free.numel()}] (unprotected pages)")
    prot = protected.nonzero().squeeze(-1).expand(*scores.shape[:-1], -1)
    if num_selected == 0:
        return prot.clone()
    cand = scores.float()[..., free].nan_to_num(nan=float("-inf"))
    # stable descending sort: equal scores keep ascending page order, so the lower index wins
    order = torch.sort(cand, dim=-1, descending=True, stable=True).indices[..., :num_selected]
    chosen = free[order]
    return torch.sort(torch.cat([prot, chosen], dim=-1), dim=-1).values


def select_tokens(scores: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The ``num_tokens`` best positions of every row, ascending: a plan's partial page (:attr:`PageBudget.partial`).

    Ties go to the lower position; NaN scores rank last.

    Args:
        scores: ``(..., T)`` per-position scores.
        num_tokens: ``n``, ``1 <= n <= T``.

    Returns:
        ``(..., n)`` long positions, ascending in every row.

    Raises:
        ValueError: if ``n`` is outside ``[1, T]``.
    """
    T = scores.shape[-1]
    if not 1 <= num_tokens <= T:
        raise ValueError(f"num_tokens={num_tokens} must be in [1, {T}] (the prompt's positions)")
    cand = scores.float().nan_to_num(nan=float("-inf"))
    order = torch.sort(cand, dim=-1, descending=True, stable=True).indices[..., :num_tokens]
    return torch.sort(order, dim=-1).values


def pages_to_positions(pages: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Expand ascending page ids to ascending token positions (docs/methods.md §1 step 9).

    When the last page is partial, every row must contain it (as the protected set guarantees), so all rows
    keep the same number of positions.

    Args:
        pages: ``(..., n_pages)`` ascending page ids, each row ending with page ``P - 1``.
        seq_len: ``T``.
        page_size: ``B``.

    Returns:
        ``(..., n_kept)`` long positions, ascending (``n_pages * B``, less the missing tail of a partial
        last page).

    Raises:
        ValueError: if the last page is partial and some row does not end with it.
    """
    P = num_pages(seq_len, page_size)
    if pages.shape[-1] == 0:
        return pages.new_zeros(*pages.shape[:-1], 0)
    last = seq_len - (P - 1) * page_size
    if last < page_size and not bool((pages[..., -1] == P - 1).all()):
        raise ValueError(
            f"every row of pages must end with the partial last page {P - 1} (T={seq_len}, page_size={page_size})"
        )
    offs = torch.arange(page_size, device=pages.device)
    pos = (pages.unsqueeze(-1) * page_size + offs).flatten(-2)
    if last == page_size:
        return pos
    n = (pages.shape[-1] - 1) * page_size + last
    return pos[..., :n]


def select_positions(
    scores: torch.Tensor,
    compression_ratio: float,
    page_size: int,
    n_sink: int,
    window_size: int,
    page_score: str = "block_max",
    on_budget_conflict: str = "raise",
    protect: str = "sink_window",
) -> tuple[torch.Tensor, torch.Tensor, PageBudget]:
    """Per-group page selection under the strict budget (docs/methods.md §1 steps 6-9).

    Args:
        scores: ``(B, G, T)`` per-position pooled scores.
        compression_ratio, page_size, n_sink, window_size, on_budget_conflict, protect: see :func:`page_budget`.
        page_score: ``"block_max"`` or ``"mass"`` (:func:`page_scores`).

    Returns:
        ``(positions, pages, budget)``: ``(B, G, n_kept)`` ascending kept positions, the same count
        for every row; ``(B, G, n_kept_pages)`` ascending kept page ids (``(B, G, 0)`` for a plan's partial page,
        whose positions are each group's best tokens, :func:`select_tokens`); the :class:`PageBudget`.

    Raises:
        ValueError: see :func:`page_budget` and :func:`page_scores`.
    """
    T = scores.shape[-1]
    plan = page_budget(T, compression_ratio, page_size, n_sink, window_size, on_budget_conflict, protect)
    if plan.partial:
        return select_tokens(scores, plan.partial), scores.new_zeros(*scores.shape[:-1], 0, dtype=torch.long), plan
    ps = page_scores(scores, page_size, page_score)
    pages = select_pages(ps, plan.protected, plan.num_selected)
    return pages_to_positions(pages, T, page_size), pages, plan
