"""KVPress presses for KV-cache compression research: Page-EntroKV, probabilistic SNIS eviction and
EntroPrefill, with their shared math (Rényi pooling, paging, budget search, proposals)."""

from presses.page_entrokv import PageEntroKVPress

__all__ = ["PageEntroKVPress"]
