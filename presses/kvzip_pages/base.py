"""The press contract (:mod:`presses.base`) for this project's subclasses of kvpress's ``KVzipPress``."""

from __future__ import annotations

from kvpress import KVzipPress

from presses.base import ResearchPress

__all__ = ["KVzipResearchPress"]


class KVzipResearchPress(ResearchPress, KVzipPress):
    """A kvpress ``KVzipPress`` that is also a :class:`presses.base.ResearchPress`: the harness reads its
    capabilities from the press (scored by KVzip's pass, ``scores_as``; the fields only its selection reads,
    ``selection_fields``), and it keeps its statistics and decode-time state through the contract.

    KVzip's own ``__call__`` does the prefill's bookkeeping (it records the context and the cache, runs the
    reconstruction pass, then ``compress_post``), and it does not enter through kvpress's ``BasePress.__call__``,
    which :mod:`presses.base` tracks: so these presses register no model hooks and reset nothing per prefill
    themselves (``compress_post`` replaces what a previous request left).
    """

    def model_hooks(self, model) -> list:
        """None (see the class)."""
        return []

    def selection(self):
        """The press that made the last prefill's selection (the subclass's ``compress_post`` records it with
        :meth:`record_selection`), for its statistics; None before the first prefill or after :meth:`reset`."""
        return self.__dict__.get("_last")

    def record_selection(self, press) -> None:
        """Keep ``press`` as the last prefill's selection (outside the dataclass fields: not a setting)."""
        self.__dict__["_last"] = press

    def reset(self) -> None:
        """Forget the last prefill's selection and its statistics."""
        self.__dict__.pop("_last", None)
