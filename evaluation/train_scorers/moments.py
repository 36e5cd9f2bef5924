"""Sufficient statistics of a per-layer linear regression, accumulated document by document in float64.

A ridge regression of ``y`` (``G`` outputs) on ``x`` (``D`` features) with an intercept needs only the row count,
the means and the centred cross-products ``Cxx = sum (x - mx)(x - mx)^T``, ``Cxy`` and ``Cyy``
(:func:`evaluation.train_scorers.ridge.fit`). They are kept per layer and merged batch by batch with the pairwise
update of Chan, Golub and LeVeque ("Updating formulae and a pairwise algorithm for computing sample variances",
1979): centred products never subtract two large sums, so features with a large mean (a transformer's outlier
channels) lose no precision, unlike ``X^T X - n mx mx^T`` from raw sums. Merging is deterministic for a fixed order
of batches; :class:`Moments` of disjoint row sets merge into the moments of their union.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Moments"]


@dataclass
class Moments:
    """Per-layer moments of ``(x, y)`` rows.

    Attributes:
        count: ``(L,)`` int64, rows per layer.
        mean_x: ``(L, D)`` float64.
        mean_y: ``(L, G)`` float64.
        cxx: ``(L, D, D)`` float64, centred ``x`` cross-products.
        cxy: ``(L, D, G)`` float64.
        cyy: ``(L, G, G)`` float64.
    """

    count: np.ndarray
    mean_x: np.ndarray
    mean_y: np.ndarray
    cxx: np.ndarray
    cxy: np.ndarray
    cyy: np.ndarray

    @classmethod
    def zeros(cls, layers: int, features: int, outputs: int) -> Moments:
        """Empty moments for ``layers`` regressions of ``outputs`` targets on ``features`` features."""
        L, D, G = layers, features, outputs
        return cls(
            np.zeros(L, np.int64),
            np.zeros((L, D)),
            np.zeros((L, G)),
            np.zeros((L, D, D)),
            np.zeros((L, D, G)),
            np.zeros((L, G, G)),
        )

    def add(self, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Merge the rows ``x`` ``(n, D)`` and ``y`` ``(n, G)`` (any float dtype; computed in float64) into
        ``layer``'s moments. Nothing happens for ``n = 0``.

        Raises:
            ValueError: the shapes do not match the moments', or a value is not finite.
        """
        n = x.shape[0]
        if x.shape[1:] != self.mean_x.shape[1:] or y.shape != (n, self.mean_y.shape[1]):
            raise ValueError(
                f"rows x {tuple(x.shape)}, y {tuple(y.shape)} do not match moments of D, G = "
                f"{self.mean_x.shape[1]}, {self.mean_y.shape[1]}"
            )
        if n == 0:
            return
        x, y = x.to(torch.float64), y.to(torch.float64)
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise ValueError(f"layer {layer}: a row holds a value that is not finite")
        mx, my = x.mean(0), y.mean(0)
        xc, yc = x - mx, y - my
        batch = (xc.T @ xc, xc.T @ yc, yc.T @ yc)
        self._merge(layer, n, mx.numpy(), my.numpy(), *(b.numpy() for b in batch))

    def _merge(self, layer, n_b, mx_b, my_b, cxx_b, cxy_b, cyy_b) -> None:
        n_a = int(self.count[layer])
        n = n_a + n_b
        dx, dy = mx_b - self.mean_x[layer], my_b - self.mean_y[layer]
        w = n_a * n_b / n
        self.cxx[layer] += cxx_b + w * np.outer(dx, dx)
        self.cxy[layer] += cxy_b + w * np.outer(dx, dy)
        self.cyy[layer] += cyy_b + w * np.outer(dy, dy)
        self.mean_x[layer] += dx * (n_b / n)
        self.mean_y[layer] += dy * (n_b / n)
        self.count[layer] = n

    def merge(self, other: Moments) -> Moments:
        """``self`` updated with ``other``'s rows (disjoint from its own), in place; returns ``self``."""
        for layer in range(len(self.count)):
            if other.count[layer]:
                self._merge(
                    layer,
                    int(other.count[layer]),
                    other.mean_x[layer],
                    other.mean_y[layer],
                    other.cxx[layer],
                    other.cxy[layer],
                    other.cyy[layer],
                )
        return self

    def save(self, path: Path, **extra: np.ndarray | int) -> None:
        """Write to ``path`` (``.npz``, uncompressed) atomically, with ``extra`` arrays beside the moments (a resume
        point): a reader sees the old file or the new one."""
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npz")
        np.savez(tmp, **{k: getattr(self, k) for k in self.__dataclass_fields__}, **extra)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> tuple[Moments, dict[str, np.ndarray]]:
        """Read what :meth:`save` wrote: the moments and the extra arrays."""
        with np.load(path) as data:
            moments = cls(**{k: data[k].copy() for k in cls.__dataclass_fields__})
            return moments, {k: data[k].copy() for k in data.files if k not in cls.__dataclass_fields__}
