"""How well a KVzap surrogate predicts KVzip+ on the held-out documents: per layer, Spearman's rho (scipy) and the
top-25 % overlap between predicted and true scores, each per document and KV head, then averaged.

The features are recomputed by one prefill per document (float32, as ``KVzapPress.score`` receives them); the true
scores are the stored ones (:func:`evaluation.train_scorers.targets.heldout_scores`). The top-25 % overlap is the
fraction of the ``n // 4`` highest true scores that are among the ``n // 4`` highest predictions (0.25 for a random
ranking, 1 for a perfect one), the share of KVzip+'s kept keys at compression ratio 0.75 that the surrogate keeps.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import spearmanr

__all__ = ["TOP_FRACTION", "document_features", "metrics", "predict"]

#: The top fraction whose overlap is reported.
TOP_FRACTION = 0.25


def document_features(model, pipe, text: str, start: int, end: int) -> torch.Tensor:
    """``(L, end - start, D)`` float32: the attention layers' inputs at positions ``[start, end)`` of ``text``'s
    prefill as an evaluation context (the preprocessing of :func:`evaluation.train_scorers.targets.document_targets`).
    """
    from transformers import DynamicCache

    from evaluation.replay import PrefillCapture

    ids = pipe.preprocess(text, [""], "", max_context_length=10**9)["context_ids"].to(model.device)
    with torch.inference_mode(), PrefillCapture(model) as capture:
        model.model(input_ids=ids, past_key_values=DynamicCache())
    return torch.stack([layer[1]["hidden_states"][0, start:end] for layer in capture.layers]).float().cpu()


def predict(scorer, features: torch.Tensor) -> np.ndarray:
    """``(L, G, n)`` predicted log-scores of a ``KVzapModel`` on ``(L, n, D)`` features."""
    with torch.inference_mode():
        out = scorer.float()(features.transpose(0, 1))  # (n, L, G)
    return out.permute(1, 2, 0).numpy()


def metrics(predicted: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spearman's rho and the top-25 % overlap, ``(L, G)`` each, of ``predicted`` against ``scores`` (both
    ``(L, G, n)``; scores raw or logged: only their order counts).

    Raises:
        ValueError: the shapes differ, or ``n < 4`` (no top quarter).
    """
    if predicted.shape != scores.shape:
        raise ValueError(f"predicted {predicted.shape} and true scores {scores.shape} differ in shape")
    L, G, n = scores.shape
    if n < 4:
        raise ValueError(f"n={n} positions: at least 4 are needed for a top quarter")
    k = int(n * TOP_FRACTION)
    rho, overlap = np.empty((L, G)), np.empty((L, G))
    for layer in range(L):
        for head in range(G):
            p, t = predicted[layer, head], scores[layer, head]
            rho[layer, head] = spearmanr(p, t).statistic
            top_p, top_t = np.argpartition(-p, k - 1)[:k], np.argpartition(-t, k - 1)[:k]
            overlap[layer, head] = len(np.intersect1d(top_p, top_t)) / k
    return rho, overlap
