"""KVzip's reconstruction scores, evicted by pages (docs/methods.md §1.15)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import KVzipPress

from presses.base import Capabilities
from presses.core.paging import expand_pages, page_scores
from presses.kvzip_pages.base import KVzipResearchPress

__all__ = ["KVzipPagePress", "page_expanded"]


def page_expanded(scores: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every position's score replaced by its page's block max.

    Args:
        scores: ``(..., T)`` per-position scores (KVzip's ``score_val``: ``(L, B, G, T)``).
        page_size: tokens per page, ``>= 1``; a partial last page takes the max of its own positions.

    Returns:
        ``(..., T)`` float32, constant on each page (:func:`presses.core.paging.page_scores`, ``"block_max"``).

    Raises:
        ValueError: for ``page_size < 1``.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be an integer >= 1")
    return expand_pages(page_scores(scores, page_size, "block_max"), page_size, scores.shape[-1])


@dataclass
class KVzipPagePress(KVzipResearchPress):
    """KVzip's importance (the most attention a query of the context-reconstruction pass pays each cached pair),
    kept and evicted in pages of ``page_size`` positions, as Page-EntroKV and ChunkKV evict.

    Each page of each KV head scores its highest-scoring position (block max, docs/methods.md §1 step 6); kvpress's
    selection then runs unchanged on those page scores: the ``int(L B G T ratio)`` lowest-scored pairs over all
    layers and heads are masked (per layer with ``layerwise=True``), the first ``n_sink`` positions last, and a head
    that would lose every entry (a prompt of a few tokens) keeps its best one. So whole pages go, except where the
    budget's cut falls inside a page (at most the pages tied at the cut). The
    reconstruction pass, its cost (about 6 x a prefill here, ``results/kvzip_cost/``) and the masking are kvpress's
    ``KVzipPress``: the reconstruction queries observe every page, whatever the question, so pages are chosen
    without it.

    Based on KVzip (https://arxiv.org/abs/2505.23416) and ChunkKV (https://arxiv.org/abs/2502.00299).

    Args:
        compression_ratio: fraction of the cached pairs masked, ``[0, 1)``.
        page_size: positions per page, ``>= 1``. 32, Page-EntroKV's tuned page size; not tuned for this press.
        layerwise, n_sink, kvzip_plus_normalization, chunk_size: kvpress's ``KVzipPress``.

    Raises:
        ValueError: for ``page_size < 1``; kvpress's assertions for the other fields.
    """

    page_size: int = 32

    #: KVzip's (kvpress's registry entry), its scores KVzip's: a sweep scores both from one reconstruction pass
    #: (evaluation/kvzip_path.py); only the selection reads ``page_size``
    capabilities: ClassVar[Capabilities] = Capabilities(
        shares_prefill=False,
        scores_once=True,
        extra_forwards=True,
        scores_as=KVzipPress,
        selection_fields=("page_size",),
    )

    def __post_init__(self):
        if isinstance(self.page_size, bool) or int(self.page_size) != self.page_size or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be an integer >= 1")
        super().__post_init__()

    def compress_post(self, model):
        """kvpress's selection on page scores (see the class); a head that would lose every entry keeps its best
        one (:meth:`presses.kvzip_pages.base.KVzipResearchPress.keep_one_per_head`)."""
        if self.compression_ratio > 0:
            self.score_val = page_expanded(self.score_val, self.page_size).to(self.score_val.dtype)
        super().compress_post(model)
