"""KVPress presses for KV-cache compression research: Page-EntroKV, probabilistic eviction with a SNIS
correction, and EntroPrefill, with the contract they share (:mod:`presses.base`). ARCHITECTURE.md shows the
layout; docs/methods.md explains each method."""

from presses.entroprefill import EntroPrefillPress
from presses.kvzip_pages import (
    KVzapGlobalPagePress,
    KVzapGlobalPress,
    KVzipFastPress,
    KVzipPagePress,
    KVzipSamplingPress,
)
from presses.page_entrokv import PageEntroKVPress, PageEntroKVReconstructionPress
from presses.probabilistic import ProbabilisticEvictionPress
from presses.scorer_pages import ScorerPagePress

__all__ = [
    "EntroPrefillPress",
    "KVzapGlobalPagePress",
    "KVzapGlobalPress",
    "KVzipFastPress",
    "KVzipPagePress",
    "KVzipSamplingPress",
    "PageEntroKVPress",
    "PageEntroKVReconstructionPress",
    "ProbabilisticEvictionPress",
    "ScorerPagePress",
]
