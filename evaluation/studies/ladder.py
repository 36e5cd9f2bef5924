"""The ablation ladder from kvpress's ChunkKV to Page-EntroKV (issue 30; docs/methods.md §1.14), one field per rung.

:class:`PageEntroKVLadderPress` is :class:`presses.PageEntroKVPress` with ChunkKV's options added, which no
Page-EntroKV variant uses, so they live here with the ladder's tuning (``results/tuning/ladder/``) and not in the
library. The rungs are the press configs :data:`LADDER` names (``configs/press/page_entrokv_rung*.yaml``), run as
any press (``python -m evaluation.fused "presses=[chunkkv32,page_entrokv_rung0_chunkkv,...]"``, the commands of
``results/tuning/ladder/README.md``). Rung 0 keeps ChunkKV's cache bit for bit, and the ladder press at its defaults
is Page-EntroKV itself (``tests/test_ablation_ladder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import SnapKVPress
from torch import nn

from presses import PageEntroKVPress
from presses.core.paging import BUDGETS, PAGE_SCORES, page_scores
from presses.core.pooling import POOLINGS
from presses.page_entrokv.press import GROUP_SELECTIONS

__all__ = ["LADDER", "PageEntroKVLadderPress"]

#: The ladder's press configs in order: rung 0 (ChunkKV as a ladder press) up to ``page_entrokv``, each rung one
#: field away from the one before.
LADDER = (
    "page_entrokv_rung0_chunkkv",
    "page_entrokv_rung1_per_group",
    "page_entrokv_rung2_mean_pool",
    "page_entrokv_rung3_entropy",
    "page_entrokv_rung4_block_max",
    "page_entrokv_rung5_protected",
    "page_entrokv",
)


@dataclass
class PageEntroKVLadderPress(PageEntroKVPress):
    """Page-EntroKV with ChunkKV's options, for the ablation ladder (docs/methods.md §1.14).

    ChunkKV (kvpress's ``ChunkKVPress(SnapKVPress, chunk_length)``, https://arxiv.org/abs/2502.00299) and
    Page-EntroKV both evict whole pages; they differ in five choices, and this class makes each one a field, so the
    ladder walks from one to the other a field at a time. The math is Page-EntroKV's and kvpress's: this class
    overrides only the steps the options change (:meth:`_scores`, :meth:`_budget_rule`); at its defaults it is
    :class:`presses.PageEntroKVPress`.

    Parameters (the others: :class:`presses.PageEntroKVPress`'s):
        pooling: Page-EntroKV's poolings, or ``"snapkv"``: SnapKV's scores instead of the pooled observer attention
            (kvpress's ``SnapKVPress(window_size=observers, kernel_size).score``: the window's attention averaged
            over the window, an average pool of ``kernel_size``, the mean over the group's heads, the window's own
            positions above every other).
        kernel_size: SnapKV's pooling kernel, ``>= 1`` (``pooling="snapkv"`` only).
        page_score: Page-EntroKV's page scores, or ``"mean"``: ChunkKV's chunk mean (a partial page over its own
            length).
        group_selection: Page-EntroKV's, or ``"shared"``: one selection for every group, from the token scores summed
            over the groups (ChunkKV, from SnapKV's per-KV-head scores).
        budget: ``"tokens"`` (default: the strict budget ``floor(T (1 - compression_ratio))`` tokens) or ``"pages"``
            (ChunkKV's ``max(1, int(P (1 - compression_ratio)))`` of the ``P`` pages, a partial one included).

    Raises:
        ValueError: for a value outside these (naming it), ``kernel_size < 1``; at prefill, ``pooling="snapkv"`` on
            fewer than 2 query rows; :meth:`compress_observed` and :meth:`score_observed` with ``pooling="snapkv"``
            (SnapKV scores the layer's own queries).
    """

    kernel_size: int = 5
    budget: str = "tokens"

    choices: ClassVar[dict[str, tuple[str, ...]]] = {
        **PageEntroKVPress.choices,
        "pooling": (*POOLINGS, "snapkv"),
        "page_score": PAGE_SCORES,
        "group_selection": (*GROUP_SELECTIONS, "shared"),
        "budget": BUDGETS,
    }
    ladder_note: ClassVar[str] = ""
    removed_fields: ClassVar[dict] = {}  # it has them
    minimums: ClassVar[dict[str, int]] = {**PageEntroKVPress.minimums, "kernel_size": 1}

    def _scores(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
        observed: tuple[torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict | None, torch.Tensor | None, int]:
        """:meth:`presses.PageEntroKVPress._scores`, or SnapKV's token scores for ``pooling="snapkv"``; with
        ``group_selection="shared"`` the token scores summed over the groups, one row, and its page scores.

        Returns:
            ``(page scores (B, G, P), or (B, 1, P) for "shared"; token scores (B, G, T), or (B, 1, T) for "shared";
            diagnostics or None; fallback (B, G) or None; observers)``.

        Raises:
            ValueError: for ``pooling="snapkv"`` on fewer than 2 query rows (SnapKV needs more rows than its window).
        """
        if self.pooling != "snapkv":
            pages, tokens, diag, fallback, observers = super()._scores(
                module, hidden_states, keys, values, attentions, kwargs, observed
            )
        else:
            n = hidden_states.shape[1]
            observers = min(self.observer_count(keys.shape[2]), n - 1)  # kvpress's SnapKV: more rows than its window
            if observers < 1:
                raise ValueError(f"pooling='snapkv' needs at least 2 query rows, got {n}")
            snapkv = SnapKVPress(window_size=observers, kernel_size=self.kernel_size)
            tokens = snapkv.score(module, hidden_states, keys, values, attentions, kwargs)
            pages = diag = fallback = None
        if self.group_selection == "shared":  # one selection for every group (ChunkKV: summed over the KV heads)
            tokens = tokens.sum(1, keepdim=True)
            pages = page_scores(tokens, self.page_size, self.page_score)
        elif pages is None:
            pages = page_scores(tokens, self.page_size, self.page_score)
        return pages, tokens, diag, fallback, observers

    def _budget_rule(self) -> dict:
        """Page-EntroKV's page plan settings with ``budget`` (:func:`presses.core.paging.page_budget`)."""
        return {**super()._budget_rule(), "budget": self.budget}

    def compress_observed(self, module, keys, values, attn, observers):
        """:meth:`presses.PageEntroKVPress.compress_observed`, refused for ``pooling="snapkv"``."""
        self._refuse_snapkv("compress_observed")
        return super().compress_observed(module, keys, values, attn, observers)

    def score_observed(self, attn, num_groups):
        """:meth:`presses.PageEntroKVPress.score_observed`, refused for ``pooling="snapkv"``."""
        self._refuse_snapkv("score_observed")
        return super().score_observed(attn, num_groups)

    def _refuse_snapkv(self, method: str) -> None:
        if self.pooling == "snapkv":
            raise ValueError(f"pooling='snapkv' scores the layer's own queries; {method} needs another pooling")
