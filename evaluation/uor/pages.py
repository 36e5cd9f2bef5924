"""Physical page accounting of a page press (paper 001 section 7, Proposition 7.1; docs/methods.md §2): the pages
one layer's KV groups keep together, and the bytes of per-group allocation against union materialisation. Used by
the UOR study (:func:`evaluation.uor.study.page_accounting`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["page_union", "allocation_bytes", "union_bytes"]


def page_union(pages: torch.Tensor) -> int:
    """``U_l = |union_g K_{l,g}|``: distinct pages kept by any group of one layer (paper 001 eq. 30).

    Args:
        pages: ``(G, n)`` page ids of one layer (one batch row).
    """
    return int(torch.unique(pages).numel())


def allocation_bytes(pages_per_group: Iterable[int], head_dim: int, page_size: int, bytes_per_element: int) -> int:
    """Per-group page allocation payload ``2 e d B sum_{l,g} K_{l,g}`` bytes (paper 001 section 7).

    Args:
        pages_per_group: ``K_{l,g}`` page counts, one per (layer, group).
        head_dim: ``d``. page_size: ``B``. bytes_per_element: ``e`` (2 for fp16/bf16).

    Excludes metadata, padding, quantisation scales, allocator reservation (as the paper states).
    """
    return 2 * bytes_per_element * head_dim * page_size * int(sum(pages_per_group))


def union_bytes(
    union_pages_per_layer: Iterable[int], num_groups: int, head_dim: int, page_size: int, bytes_per_element: int
) -> int:
    """Union-materialisation payload ``2 e d B G sum_l U_l`` bytes, when a physical block holds all
    ``G`` groups of a layer (paper 001 section 7).

    Args:
        union_pages_per_layer: ``U_l`` per layer (:func:`page_union`).
        num_groups: ``G``. head_dim: ``d``. page_size: ``B``. bytes_per_element: ``e``.
    """
    return 2 * bytes_per_element * head_dim * page_size * num_groups * int(sum(union_pages_per_layer))
