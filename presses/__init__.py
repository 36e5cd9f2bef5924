"""KVPress presses for KV-cache compression research: Page-EntroKV, probabilistic SNIS eviction and
EntroPrefill, with their shared math (Rényi pooling, paging, budget search, proposals)."""

from presses.entroprefill import EntroPrefillPress
from presses.page_entrokv import PageEntroKVPress
from presses.snis_press import ProbabilisticEvictionPress

__all__ = ["EntroPrefillPress", "PageEntroKVPress", "ProbabilisticEvictionPress"]
