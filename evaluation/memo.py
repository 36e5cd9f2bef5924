"""A memo for a sweep that replays one recorded prefill for several presses (``evaluation.fused``).

Presses that differ only in options that do not change a layer's intermediate result (the compression ratio,
the correction, the protection, ...) compute that result once per layer while they replay the same recorded
prefill: the loop makes one :class:`ReplayMemo` per example and hands it to every press of the example
(the press contract's ``sharing``, through :func:`evaluation.registry.sharing`). Page-EntroKV keys its observer
attention by it (:func:`presses.observers.memoized_observers`), the probabilistic press its proposals
(:func:`presses.probabilistic.proposals.compute_proposal`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["ReplayMemo"]


class ReplayMemo:
    """Results keyed by the caller, for the replays of one prefill.

    The caller's key must identify everything the result depends on (tensor objects by ``id``). The memo also
    holds the objects passed as ``keep`` so that their ids cannot be reused by new objects while it lives. Valid
    only while the keyed tensors are not changed in place: make a new memo for every prefill.
    """

    def __init__(self) -> None:
        self._memo: dict = {}

    def get(self, key: Hashable, compute: Callable[[], Any], *keep: Any) -> Any:
        """``compute()``, or the result already computed under ``key``.

        Args:
            key: identifies the result (hashable).
            compute: makes the result.
            keep: objects whose ``id`` the key uses, held as long as the memo lives.
        """
        if key not in self._memo:
            self._memo[key] = (compute(), keep)
        return self._memo[key][0]

    def __len__(self) -> int:
        """The number of results held."""
        return len(self._memo)
