"""KVzip's context-reconstruction scores with eviction by pages (docs/methods.md §1.15) and as the proposal of
probabilistic eviction (docs/methods.md §3.9)."""

from presses.kvzip_pages.press import KVzipPagePress
from presses.kvzip_pages.sampling import KVzipSamplingPress

__all__ = ["KVzipPagePress", "KVzipSamplingPress"]
