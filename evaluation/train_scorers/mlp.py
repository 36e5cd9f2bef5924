"""KVzap's MLP surrogate: per layer, ``Linear(D, hidden) -> GELU -> Linear(hidden, G)`` (kvpress's ``KVzapModel``
with ``hidden_dim``) trained on the stored row subsample with AdamW, MSE loss, a cosine learning-rate schedule and
gradient-norm clipping at 1, as kvpress's ``kvzap/train.py`` (there through skorch; here a plain torch loop).

Inputs and targets are standardised per column for the optimisation (statistics of the training rows), and the
standardisation is folded into the first and last linear layers afterwards, so the saved model reads raw hidden
states and predicts raw log-scores. Seeded: the initialisation and the batch order come from
``torch.Generator`` seeded with ``(seed, layer)``; bit-equal for a fixed thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["MLPSettings", "train"]


@dataclass(frozen=True)
class MLPSettings:
    """The MLP's training settings (defaults: kvpress's recipe, ``kvzap/train.py``, but 10 epochs, not 15: the
    held-out fit, ``results/scorers/``, did not need more).

    Attributes:
        hidden: hidden width (kvpress: 512).
        epochs: passes over the rows.
        lr: AdamW's peak learning rate (kvpress: 5e-3), annealed to 0 by a cosine over all steps.
        batch_size: rows per step (kvpress: 512).
        weight_decay: AdamW's (torch's default, as kvpress's).
    """

    hidden: int = 512
    epochs: int = 10
    lr: float = 5e-3
    batch_size: int = 512
    weight_decay: float = 0.01

    def __post_init__(self):
        for name in ("hidden", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"mlp {name}={getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"mlp lr={self.lr} must be > 0")


def _train_layer(x: torch.Tensor, y: torch.Tensor, settings: MLPSettings, generator: torch.Generator) -> nn.Module:
    D, G = x.shape[1], y.shape[1]
    net = nn.Sequential(nn.Linear(D, settings.hidden), nn.GELU(), nn.Linear(settings.hidden, G))
    with torch.no_grad():  # torch's default initialisation, drawn from the layer's generator
        for linear in (net[0], net[2]):
            bound = 1 / linear.in_features**0.5
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
    opt = torch.optim.AdamW(net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    steps_per_epoch = -(-x.shape[0] // settings.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=settings.epochs * steps_per_epoch)
    for _ in range(settings.epochs):
        order = torch.randperm(x.shape[0], generator=generator)
        for i in range(0, x.shape[0], settings.batch_size):
            idx = order[i : i + settings.batch_size]
            loss = nn.functional.mse_loss(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            schedule.step()
    return net


def train(x: np.ndarray, y: np.ndarray, settings: MLPSettings, seed: int, log=None) -> list[dict[str, np.ndarray]]:
    """Train one MLP per layer.

    Args:
        x: ``(N, L, D)`` features (float16 or float32).
        y: ``(N, L, G)`` log-score targets (rows not finite in a layer are left out of that layer's fit).
        settings: the training settings.
        seed: the generators' seed.
        log: called with a line per layer (e.g. ``print``), or None.

    Returns:
        Per layer ``{"w1": (hidden, D), "b1": (hidden,), "w2": (G, hidden), "b2": (G,)}`` float32, reading raw
        features and predicting raw log-scores.

    Raises:
        ValueError: shapes that do not match, or a layer without rows.
    """
    if x.ndim != 3 or y.shape[:2] != x.shape[:2]:
        raise ValueError(f"features {x.shape} and targets {y.shape} must be (N, L, D) and (N, L, G)")
    layers = []
    for layer in range(x.shape[1]):
        keep = np.isfinite(y[:, layer]).all(-1)
        if not keep.any():
            raise ValueError(f"layer {layer} has no finite target to fit")
        xl = torch.from_numpy(x[keep, layer].astype(np.float32))
        yl = torch.from_numpy(y[keep, layer].astype(np.float32))
        mx, sx = xl.mean(0), xl.std(0).clamp_min(1e-6)
        my, sy = yl.mean(0), yl.std(0).clamp_min(1e-6)
        generator = torch.Generator().manual_seed(seed * 1000 + layer)
        net = _train_layer((xl - mx) / sx, (yl - my) / sy, settings, generator)
        with torch.no_grad():
            w1 = net[0].weight / sx  # folds (x - mx) / sx into the first layer
            b1 = net[0].bias - w1 @ mx
            w2 = net[2].weight * sy[:, None]  # and y = sy * out + my into the last
            b2 = net[2].bias * sy + my
            mse = nn.functional.mse_loss(net((xl - mx) / sx) * sy + my, yl).item()
        layers.append({k: v.detach().numpy().copy() for k, v in dict(w1=w1, b1=b1, w2=w2, b2=b2).items()})
        if log:
            log(f"mlp layer {layer}: {int(keep.sum())} rows, training MSE {mse:.4f}")
    return layers
