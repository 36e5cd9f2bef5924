"""KVzap's linear surrogate: ridge regression per layer (scikit-learn's ``Ridge``, ``alpha = 1``, as kvpress's
``kvzap/train.py``), solved exactly from the moments of the rows (:class:`evaluation.train_scorers.moments.Moments`)
instead of the rows themselves.

scikit-learn's ``Ridge(alpha, fit_intercept=True)`` centres ``X`` and ``y`` and solves
``(Xc^T Xc + alpha I) W = Xc^T yc``, intercept ``mean(y) - mean(X) W``: with ``Cxx = Xc^T Xc`` and ``Cxy = Xc^T yc``
the same system, so the weights are scikit-learn's to rounding (``tests/test_train_scorers.py``).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from evaluation.train_scorers.moments import Moments

__all__ = ["ALPHA", "fit"]

#: scikit-learn's default ``alpha``, which kvpress's recipe uses.
ALPHA = 1.0


def fit(moments: Moments, alpha: float = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Ridge weights ``(L, G, D)`` and intercepts ``(L, G)`` (float64) of every layer.

    Raises:
        ValueError: ``alpha`` is not positive, or a layer has no rows.
    """
    if not alpha > 0:
        raise ValueError(f"alpha={alpha} must be > 0")
    empty = [layer for layer, n in enumerate(moments.count) if n == 0]
    if empty:
        raise ValueError(f"layers {empty} have no rows to fit")
    L, D = moments.mean_x.shape
    weights = np.empty((L, moments.mean_y.shape[1], D))
    for layer in range(L):
        A = moments.cxx[layer] + alpha * np.eye(D)
        weights[layer] = scipy.linalg.solve(A, moments.cxy[layer], assume_a="pos").T
    intercepts = moments.mean_y - np.einsum("lgd,ld->lg", weights, moments.mean_x)
    return weights, intercepts
