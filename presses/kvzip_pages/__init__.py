"""KVzip's context-reconstruction scores with eviction by pages (docs/methods.md §1.15) and as the proposal of
probabilistic eviction (docs/methods.md §3.9); KVzip's own scores at a lower cost (docs/methods.md §1.18); KVzip's
selection on KVzap's learned scores (docs/methods.md §1.19)."""

from presses.kvzip_pages.fast import KVzipFastPress
from presses.kvzip_pages.kvzap_scored import KVzapGlobalPagePress, KVzapGlobalPress
from presses.kvzip_pages.press import KVzipPagePress
from presses.kvzip_pages.sampling import KVzipSamplingPress

__all__ = ["KVzapGlobalPagePress", "KVzapGlobalPress", "KVzipFastPress", "KVzipPagePress", "KVzipSamplingPress"]
