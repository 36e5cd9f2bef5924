"""Page eviction from any kvpress scorer's per-token scores (e.g. KVzap's learned scores; docs/methods.md §1.17)."""

from presses.scorer_pages.press import GROUP_SELECTIONS, ScorerPagePress

__all__ = ["GROUP_SELECTIONS", "ScorerPagePress"]
