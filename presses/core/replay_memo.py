"""A memo for presses that replay one prefill several times (the harness's shared-prefill sweep).

Presses that differ only in options that do not change a layer's intermediate result (the compression ratio,
the correction, the protection, ...) can compute that result once per layer while they replay the same
recorded prefill. A :class:`ReplayMemo` holds such results inside a ``with memo.scope():`` block, keyed by
the identities of the tensors they were computed from; outside a block it computes every time.
Used by :func:`presses.observers.shared_observers` (Page-EntroKV's observer attention) and
:func:`presses.probabilistic.proposals.shared_proposals` (the SNIS proposals).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ReplayMemo"]


class ReplayMemo:
    """Results keyed by the caller, alive only inside :meth:`scope` blocks.

    The caller's key must identify everything the result depends on (tensor objects by ``id``). The memo
    also holds the objects passed as ``keep`` so that their ids cannot be reused by new objects while it
    lives. Valid only while the keyed tensors are not changed in place, so keep a block to one prefill.
    """

    def __init__(self) -> None:
        self._memo: dict | None = None

    @property
    def active(self) -> bool:
        """Whether a :meth:`scope` block is open."""
        return self._memo is not None

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Open a block; the memo is dropped when it exits. Blocks nest (the inner one starts empty)."""
        previous, self._memo = self._memo, {}
        try:
            yield
        finally:
            self._memo = previous

    def get(self, key: Hashable, compute: Callable[[], Any], *keep: Any) -> Any:
        """``compute()``, or inside a block the result already computed under ``key``.

        Args:
            key: identifies the result (hashable); ignored outside a block.
            compute: makes the result.
            keep: objects whose ``id`` the key uses, held as long as the block lives.
        """
        if self._memo is None:
            return compute()
        if key not in self._memo:
            self._memo[key] = (compute(), keep)
        return self._memo[key][0]
