"""KVzip's context-reconstruction scores with eviction by pages (docs/methods.md §1.15)."""

from presses.kvzip_pages.press import KVzipPagePress

__all__ = ["KVzipPagePress"]
