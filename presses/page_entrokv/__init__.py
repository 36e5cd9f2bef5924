"""Page-EntroKV (paper 000; docs/methods.md §1): entropy-weighted, sink-isolated head pooling inside each GQA
group, with eviction at page granularity."""

from presses.page_entrokv.press import PageEntroKVPress
from presses.page_entrokv.reconstruction import PageEntroKVReconstructionPress

__all__ = ["PageEntroKVPress", "PageEntroKVReconstructionPress"]
