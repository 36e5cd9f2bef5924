"""Which recorded cache entries survive another press: exact row fingerprints of keys.

When probabilistic eviction with the global budget is the first press of a kvpress ``ComposedPress``, the
presses after it select entries of each layer before its deferred eviction runs (docs/methods.md §3,
"Inside kvpress's wrappers"). It then needs the original position of every surviving entry, to draw
among them with their proposal. Kept entries are rows gathered from the recorded keys, bit for bit, so an
exact integer fingerprint of each row identifies it: the row's bits, read as integers, dotted with fixed
pseudo-random 64-bit weights in wrapping integer arithmetic. RoPE makes the keys of different positions
differ, so two positions of one layer and group never share a row in practice; a collision or a press that
changed the keys (not only selected them) is detected and raised.
"""

from __future__ import annotations

import torch

__all__ = ["row_fingerprints", "surviving_positions"]

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _weights(d: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0x5EED)
    return torch.randint(-(2**62), 2**62, (d,), generator=gen, dtype=torch.int64).to(device)


def row_fingerprints(keys: torch.Tensor) -> torch.Tensor:
    """Exact 64-bit fingerprints of the rows of ``keys``.

    Args:
        keys: ``(B, G, t, d)`` keys of one layer (any float dtype).

    Returns:
        ``(B, G, t)`` int64; equal rows (bit for bit) give equal fingerprints.
    """
    bits = keys.contiguous().view(_INT_VIEW[keys.element_size()]).long()
    return (bits * _weights(keys.shape[-1], keys.device)).sum(-1)


def surviving_positions(fingerprints: torch.Tensor, kept_keys: torch.Tensor) -> torch.Tensor:
    """Original positions of the rows of ``kept_keys`` among the rows that ``fingerprints`` describes.

    Args:
        fingerprints: ``(B, G, t)`` :func:`row_fingerprints` of the recorded keys.
        kept_keys: ``(B, G, t', d)`` keys a later press kept (rows of the recorded keys, in any order).

    Returns:
        ``(B, G, t')`` int64 positions in ``[0, t)``, one per kept row.

    Raises:
        ValueError: if a kept row is not a row of the recorded keys (a press changed the keys), two
            recorded rows share a fingerprint, or the batch / group sizes differ.
    """
    if kept_keys.shape[:2] != fingerprints.shape[:2]:
        raise ValueError(
            f"kept keys {tuple(kept_keys.shape)} and recorded rows {tuple(fingerprints.shape)} "
            "differ in batch or group size"
        )
    kept = row_fingerprints(kept_keys)
    order = fingerprints.argsort(dim=-1)
    sorted_fp = fingerprints.gather(-1, order)
    if bool((sorted_fp[..., 1:] == sorted_fp[..., :-1]).any()):
        raise ValueError("two recorded cache rows are identical: surviving entries cannot be told apart")
    slot = torch.searchsorted(sorted_fp, kept).clamp_max(fingerprints.shape[-1] - 1)
    if not bool((sorted_fp.gather(-1, slot) == kept).all()):
        raise ValueError(
            "a press after ProbabilisticEvictionPress changed the cache's keys instead of selecting "
            "entries: the surviving entries cannot be matched to their proposal"
        )
    return order.gather(-1, slot)
