"""Page-EntroKV's account of a prefill: one statistics entry per layer (the press's ``summary()``) and, when the press
records, per-layer diagnostics per batch row (its ``records``; docs/methods.md §1)."""

from __future__ import annotations

import torch

from presses.base import KEPT_ENTRIES, kept_entries_text
from presses.core.paging import PageBudget, token_budget

__all__ = ["layer_records", "layer_stats", "summarise"]


def layer_stats(
    seq_len: int, kept: int, plan: PageBudget | None, bypass: str = "", observers: int = 0, fallback: int = 0
) -> dict:
    """One layer's statistics for :func:`summarise`.

    Args:
        seq_len: ``T``, the layer's prompt length.
        kept: tokens kept per KV group.
        plan: the layer's page plan, or ``None`` when nothing was evicted (``bypass`` says why).
        bypass: why nothing was scored, or ``""``.
        observers: observer queries behind the scores.
        fallback: groups pooled by the max over their heads.
    """
    return {
        "T": seq_len,
        "kept": kept,
        "budget": seq_len if plan is None else plan.budget,
        "protected": seq_len if plan is None else plan.protected_tokens,
        "conflict": False if plan is None else plan.conflict,
        "shrunk": False if plan is None else plan.shrunk,
        "partial": 0 if plan is None else plan.partial,
        "bypass": bypass,
        "observers": observers,
        "fallback": fallback,
    }


def summarise(stats: list[dict]) -> dict[str, float | int | str]:
    """The press's ``summary()`` from the last prefill's :func:`layer_stats`, one per layer: ``effective_compression``
    (mean over layers of ``1 - kept / T``), ``kept_tokens`` (per layer and group, mean over layers),
    ``context_length`` ``T``, ``budget_tokens`` ``b``, ``protected_tokens`` (after any shrinking),
    ``protection_shrunk`` (1 when protection shrank to fit the budget), ``budget_conflict`` (1 if the protected pages
    exceeded ``b`` in ``keep_protected`` mode), ``observers`` (observer queries), ``fallback_groups`` (groups pooled
    by max, over all layers), ``layers``, ``bypass`` (why nothing was evicted, or ``""``), ``kept_entries`` (per
    layer, the contract's :data:`presses.base.KEPT_ENTRIES`) and, only when a budget below one page kept a partial
    page of the best tokens instead of whole pages (docs/methods.md §1.12), ``partial_page`` = 1. Empty for no
    layers."""
    if not stats:
        return {}
    n = len(stats)
    last = stats[-1]
    return {
        "effective_compression": sum(1.0 - s["kept"] / s["T"] for s in stats if s["T"]) / n,
        "kept_tokens": round(sum(s["kept"] for s in stats) / n),
        "context_length": int(last["T"]),
        "budget_tokens": int(last["budget"]),
        "protected_tokens": int(last["protected"]),
        "protection_shrunk": int(any(s["shrunk"] for s in stats)),
        "budget_conflict": int(any(s["conflict"] for s in stats)),
        "observers": int(last["observers"]),
        "fallback_groups": int(sum(s["fallback"] for s in stats)),
        "layers": n,
        "bypass": last["bypass"],
        KEPT_ENTRIES: kept_entries_text(s["kept"] for s in stats),
        **({"partial_page": 1} if any(s["partial"] for s in stats) else {}),
    }


def layer_records(
    layer_idx: int,
    seq_len: int,
    batch_size: int,
    page_size: int,
    compression_ratio: float,
    plan: PageBudget | None = None,
    *,
    pages: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
    diag: dict | None = None,
    fallback: torch.Tensor | None = None,
    bypass: str = "",
    observers: int = 0,
    positions: torch.Tensor | None = None,
) -> list[dict]:
    """One diagnostics dict per batch row of one layer (:class:`presses.PageEntroKVPress`'s ``records``), with keys
    ``layer_idx``, ``batch_index``, ``T``, ``budget``, ``kept_tokens``, ``page_size``,
    ``protected_pages`` ``(n_protected,)``, ``kept_pages`` ``(G, n_kept_pages)`` (page ids, ascending),
    ``selected_pages`` ``(G, n)`` (each group's own selection, before a union), ``weights`` ``(G, r)``
    (``None`` for ``"max"``), ``entropy`` ``(H_Q,)`` (sink-isolated), ``raw_entropy`` ``(H_Q,)``, ``z``
    ``(H_Q,)`` (non-sink mass), ``fallback`` ``(G,)`` (groups pooled by max), ``observers``,
    ``effective_compression``, ``conflict``, ``shrunk``, ``partial`` (the tokens of a partial page kept instead of
    whole pages, else 0; then ``kept_pages`` and ``selected_pages`` are ``None`` and ``kept_positions``
    ``(G, n_kept)`` holds the kept positions), ``bypass`` (empty string or the reason nothing was
    scored). Tensors are on the CPU; the statistic entries are ``None`` when nothing was scored.

    Args:
        layer_idx, seq_len, batch_size, page_size, compression_ratio: the layer, ``T``, ``B_batch``, ``B``, the ratio.
        plan: the page plan, or ``None`` when nothing was evicted.
        pages: ``(B_batch, G, n)`` kept page ids, or ``None`` (a partial page, or nothing evicted).
        selected: ``(B_batch, G, n)`` each group's own selection before a union, or ``None`` (``pages``).
        diag: the pooling's diagnostics (``weights``, ``entropy``, ``raw_entropy``, ``z``), or ``None``.
        fallback: ``(B_batch, G)`` bool groups pooled by max, or ``None``.
        bypass: why nothing was scored, or ``""``.
        observers: observer queries behind the scores.
        positions: ``(B_batch, G, n_kept)`` the kept positions (``None``: the whole prompt).

    Returns:
        ``batch_size`` dicts, tensors on the CPU.
    """

    def row(x, b):
        return None if x is None else x[b].detach().cpu()

    def stat(name, b):
        return None if not diag or diag.get(name) is None else row(diag[name], b).float()

    T = seq_len
    partial = plan.partial if plan is not None else 0
    kept = T if positions is None else positions.shape[-1]
    return [
        {
            "layer_idx": layer_idx,
            "batch_index": b,
            "T": T,
            "budget": plan.budget if plan is not None else token_budget(T, compression_ratio),
            "kept_tokens": kept,
            "page_size": page_size,
            "protected_pages": None if plan is None else plan.protected.nonzero().squeeze(-1),
            "kept_pages": row(pages, b),
            "selected_pages": None if partial else row(selected if selected is not None else pages, b),
            "weights": stat("weights", b),
            "entropy": stat("entropy", b),
            "raw_entropy": stat("raw_entropy", b),
            "z": stat("z", b),
            "fallback": row(fallback, b),
            "observers": observers,
            "effective_compression": 1.0 - kept / T if T else 0.0,
            "conflict": bool(plan.conflict) if plan is not None else False,
            "shrunk": bool(plan.shrunk) if plan is not None else False,
            "partial": partial,
            "kept_positions": row(positions, b) if partial else None,
            "bypass": bypass,
        }
        for b in range(batch_size)
    ]
