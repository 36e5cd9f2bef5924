"""EntroPrefill's page policy: evict the cache of the retained support after the prune (paper 001 Algorithm 1
step 7, "decode using the resulting cache and the configured page policy"; docs/methods.md §4 step 7).

The page policy is any kvpress press whose ``compress`` evicts one layer's cache from that layer's hidden
states, keys and values (:class:`presses.page_entrokv.PageEntroKVPress`, kvpress's ``ScorerPress`` family...).
It is held by :class:`presses.entroprefill.EntroPrefillPress` and driven by its hooks, never registered on the
model itself. :class:`PagePolicyDriver` runs it on every layer, on the cache EntroPrefill leaves there:

- layers after the accepted layer ``l*`` run on the retained support ``R`` only, so their attention hook sees
  ``T' = |R|`` rows and keys: the policy's own ``forward_hook`` runs there unchanged;
- layers ``0..l*`` ran on the whole prompt and are gathered at ``R`` when ``l*`` is accepted. Until then their
  eviction is DEFERRED: their hook stores the rows of the attention input the policy's observers can need, and
  at acceptance the policy compresses each of them from its rows at ``R``, its gathered keys and values, and
  the rotary embeddings of the original positions of ``R``. When no layer is accepted the deferred layers are
  compressed on the full prompt once the monitored window has passed (step 7's fallback).

So every layer is evicted exactly as the policy would evict the pruned cache on its own (the tests check
the kept entries and the logits against that reference).

What a page is after pruning: the policy sees the retained support in its compact storage order
(``0..T'-1``, ascending original positions), so a page of ``page_size`` entries is ``page_size`` consecutive
RETAINED tokens; it can straddle a removed chunk, so its tokens need not be contiguous in the original prompt.
That is the physical unit: after the prune the cache is stored compactly, and a paged allocator's block holds
consecutive stored entries. The protected pages are the first ``n_sink`` and the last ``window_size`` retained
entries; RoPE positions stay the original ones.
"""

from __future__ import annotations

from typing import Any

import torch
from kvpress import ObservedAttentionPress
from kvpress.presses.base_press import BasePress

from presses.base import ResearchPress

__all__ = ["PagePolicyDriver", "check_page_policy", "observer_tail_start"]


def check_page_policy(policy: Any) -> None:
    """Refuse a page policy EntroPrefill cannot drive.

    Accepted: a kvpress ``BasePress`` whose ``compress`` evicts a layer's cache from the layer's hidden states,
    keys and values, without attention weights (the deferred shallow layers have none over the retained
    support), without changing the prefill and without decode-time state.

    Raises:
        ValueError: naming the press and the reason.
    """
    name = type(policy).__name__
    if isinstance(policy, type) and issubclass(policy, BasePress):
        raise ValueError(
            f"page_policy={policy.__name__} is a class: pass an instance, e.g. "
            f"page_policy={policy.__name__}(compression_ratio=0.5)"
        )
    if not isinstance(policy, BasePress):
        raise ValueError(f"page_policy must be a kvpress press (a BasePress), got {name}")
    caps = getattr(policy, "capabilities", None)
    if isinstance(policy, ResearchPress) and (caps.changes_prefill or caps.decode_state or caps.needs_eager):
        raise ValueError(
            f"page_policy={name} cannot evict the retained support's cache after the prune: it "
            "changes the prefill or leaves decode-time state; use a press that only compresses "
            "each layer's cache (e.g. PageEntroKVPress)"
        )
    if isinstance(policy, ObservedAttentionPress):
        raise ValueError(
            f"page_policy={name} reads the prefill's eager attention weights, which the layers "
            "gathered at the retained support do not have"
        )


def observer_tail_start(n_tokens: int, candidate_chunks: list[tuple[int, int]], window_size: int | None) -> int:
    """First position whose attention-input rows the page policy's observers can need.

    Every retained support ``R`` holds every token outside the candidate chunks, so the last ``W`` entries of
    any ``R`` lie at or after the ``W``-th last such token: rows before it are never observers.

    Args:
        n_tokens: ``T``.
        candidate_chunks: the removable chunks as token ranges ``[start, end)``.
        window_size: ``W``, the policy's observer window, or ``None`` (the policy may read every row: 0).

    Returns:
        The position in ``[0, T)`` (0 when fewer than ``W`` tokens are always retained).
    """
    if window_size is None or n_tokens == 0:
        return 0
    keep = torch.ones(n_tokens, dtype=torch.bool)
    for s, e in candidate_chunks:
        keep[s:e] = False
    always = keep.nonzero().flatten()
    W = max(1, int(window_size))
    return int(always[-W]) if always.numel() >= W else 0


class PagePolicyDriver:
    """Runs a page policy on every layer of an EntroPrefill prefill (see the module docstring).

    Args:
        policy: the page policy (checked by :func:`check_page_policy`).
    """

    def __init__(self, policy):
        check_page_policy(policy)
        self.policy = policy
        self.reset()

    def reset(self) -> None:
        """Forget the previous request (and reset the policy's own statistics when it has a ``reset``)."""
        self._tail = 0
        self._deferred: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pe: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kept: dict[int, int] = {}
        if hasattr(self.policy, "reset"):
            self.policy.reset()

    def start(self, n_tokens: int, candidate_chunks: list[tuple[int, int]]) -> None:
        """Fix, at the start of a prefill, which rows the deferred layers keep (:func:`observer_tail_start`)."""
        window = getattr(self.policy, "window_size", None)  # Page-EntroKV, SnapKV: the last W rows observe
        # one row more than the window: kvpress's SnapKV asserts more rows than its window
        rows = window + 1 if isinstance(window, int) and not isinstance(window, bool) else None
        self._tail = observer_tail_start(n_tokens, candidate_chunks, rows)

    @property
    def pending(self) -> bool:
        """Whether some layer's eviction is deferred."""
        return bool(self._deferred)

    def defer(self, module, hidden_states: torch.Tensor, position_embeddings) -> None:
        """Keep what the policy will need to evict ``module``'s layer later: its attention input's rows from the
        observer tail on (and the prompt's rotary embeddings, shared by every layer)."""
        rows = hidden_states[:, self._tail :]
        self._deferred[module.layer_idx] = (module, rows.clone() if self._tail else rows)  # free the full rows
        if self._pe is None:
            self._pe = position_embeddings

    def flush(self, cache, retained: torch.Tensor | None) -> None:
        """Evict every deferred layer's cache, now holding the entries at ``retained`` (ascending original
        positions; ``None``: the whole prompt), and forget the deferred rows.

        Args:
            cache: the prefill's ``DynamicCache``.
            retained: ``(T',)`` int64 retained support, or ``None``.
        """
        if not self._deferred:
            return
        cos, sin = self._pe
        T = cos.shape[1]
        rows = torch.arange(self._tail, T, device=cos.device) if retained is None else retained[retained >= self._tail]
        local = rows - self._tail
        pe = (cos[:, rows], sin[:, rows])
        for idx, (module, hs) in sorted(self._deferred.items()):
            layer = cache.layers[idx]
            kwargs = {"hidden_states": hs[:, local], "position_embeddings": pe, "past_key_values": cache}
            layer.keys, layer.values = self.policy.compress(
                module, kwargs["hidden_states"], layer.keys, layer.values, None, kwargs
            )
            self.kept[idx] = int(layer.keys.shape[2])
        self._deferred.clear()
        self._pe = None

    def forward(self, module, input, kwargs: dict, output):
        """The policy's own attention hook on a layer that runs on the retained support (or on the whole prompt
        when EntroPrefill bypassed before the first layer)."""
        output = self.policy.forward_hook(module, input, kwargs, output)
        cache = kwargs["past_key_values"]
        self.kept[module.layer_idx] = int(cache.get_seq_length(module.layer_idx))
        return output

    def stats(self, n_tokens: int, n_retained: int) -> dict[str, float | int | str]:
        """The two stages and the total: ``prune_compression = 1 - T'/T``, ``page_compression = 1 - mean kept / T'``
        and ``compression = 1 - mean kept / T`` (means over the evicted layers), ``page_kept_tokens`` (mean
        kept entries per layer), plus the policy's own ``summary()`` keys prefixed ``page_``."""
        out: dict[str, float | int | str] = {}
        if hasattr(self.policy, "summary"):
            out.update({f"page_{k}": v for k, v in self.policy.summary().items()})
        if self.kept and n_tokens and n_retained:
            kept = sum(self.kept.values()) / len(self.kept)
            out.update(
                prune_compression=1.0 - n_retained / n_tokens,
                page_compression=1.0 - kept / n_retained,
                compression=1.0 - kept / n_tokens,
                page_kept_tokens=round(kept),
            )
        return out
