"""EntroPrefill (paper 001; docs/methods.md §4): query-aware pruning of whole chunks in the middle of
prefill, with a dual certificate and an independent audit."""

from presses.entroprefill.press import EntroPrefillPress

__all__ = ["EntroPrefillPress"]
