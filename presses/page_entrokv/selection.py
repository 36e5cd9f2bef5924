"""Page-EntroKV's selection of one layer: the kept pages (or a partial page of the best tokens) of each KV group from
the page plan and the scores (docs/methods.md §1 steps 7-9, §1.11's union, §1.12's partial page)."""

from __future__ import annotations

import torch

from presses.core.paging import PageBudget, pages_to_positions, select_pages, select_tokens

__all__ = ["kept_positions", "union_pages"]


def kept_positions(
    plan: PageBudget,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    num_groups: int,
    page_size: int,
    union: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The positions one layer keeps under ``plan``.

    Args:
        plan: the layer's page plan (:func:`presses.core.paging.page_budget`), with something to evict.
        scores: ``(B, G, P)`` page scores, or ``(B, 1, P)`` for one selection every group shares.
        tokens: ``(B, G, T)`` token scores (or ``(B, 1, T)``), read for a partial page (``plan.partial``).
        num_groups: ``G``.
        page_size: ``B``.
        union: paper 000's per-layer union (``group_selection="union"``): every group keeps the union of the groups'
            selections (:func:`union_pages`).

    Returns:
        ``(positions (B, G, n_kept) ascending, kept page ids (B, G, n) or None for a partial page, each group's own
        selection before the union (B, G, n) or None without one)``.
    """
    batch, T = scores.shape[0], tokens.shape[-1]
    selected = None
    if plan.partial:  # a budget below one page: each group's best tokens, one partial page (§1.12)
        positions = select_tokens(tokens, plan.partial).expand(batch, num_groups, -1)
        if union:
            selected, positions = positions, union_pages(positions, tokens)
        return positions, None, selected
    pages = select_pages(scores, plan.protected, plan.num_selected).expand(batch, num_groups, -1)
    if union and plan.num_selected > 0:
        selected, pages = pages, union_pages(pages, scores)
    return pages_to_positions(pages, T, page_size), pages, selected


def union_pages(pages: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Paper 000's per-layer union: every group keeps the union of the groups' selected pages (or positions).

    Args:
        pages: ``(B, G, n)`` each group's selected page ids.
        scores: ``(B, G, P)`` page scores (rows whose union is smaller than the batch's largest are filled with
            their best remaining pages by the max over groups).

    Returns:
        ``(B, G, U)`` ascending page ids, the same for every group of a row.
    """
    B, G, _ = pages.shape
    P = scores.shape[-1]
    member = torch.zeros(B, P, dtype=torch.bool, device=pages.device)
    member.scatter_(1, pages.reshape(B, -1), True)
    U = int(member.sum(-1).max())
    rank = scores.float().amax(1).nan_to_num(nan=float("-inf")).masked_fill(member, float("inf"))
    chosen = torch.sort(torch.sort(rank, dim=-1, descending=True, stable=True).indices[:, :U], dim=-1).values
    return chosen.unsqueeze(1).expand(B, G, U)
