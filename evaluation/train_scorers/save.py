"""Trained surrogate parameters as kvpress's ``KVzapModel``, saved where ``evaluation.scorers`` finds them.

``KVzapModel.save_pretrained`` writes ``config.json`` and ``model.safetensors`` (float32), which
``KVzapModel.from_pretrained`` reads; ``config.json`` also names the model the scorer was trained for
(``base_model``, the last part of its ``name_or_path``, as ``evaluation.scorers.model_key``) and the training's
record (``training``), so a scorer for another model is refused rather than used.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from evaluation.atomic import write_atomic

__all__ = ["kvzap_model", "save"]


def kvzap_model(layers: list[dict[str, np.ndarray]] | tuple[np.ndarray, np.ndarray], base_model: str, training: dict):
    """A ``KVzapModel`` holding trained parameters.

    Args:
        layers: the linear surrogate's ``(weights (L, G, D), intercepts (L, G))``
            (:func:`evaluation.train_scorers.ridge.fit`) or the MLP's per-layer dicts
            (:func:`evaluation.train_scorers.mlp.train`).
        base_model: the model's key (``evaluation.scorers.model_key``).
        training: the record stored in ``config.json`` (command, seed, threads, tokens, seconds, corpus).
    """
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    if isinstance(layers, tuple):
        weights, intercepts = layers
        L, G, D = weights.shape
        config = KVzapConfig(input_dim=D, output_dim=G, n_modules=L, hidden_dim=None)
        params = [{"weight": w, "bias": b} for w, b in zip(weights, intercepts)]
        names = {"weight": "weight", "bias": "bias"}
    else:
        L, (H, D), G = len(layers), layers[0]["w1"].shape, layers[0]["w2"].shape[0]
        config = KVzapConfig(input_dim=D, output_dim=G, n_modules=L, hidden_dim=H)
        params = layers
        names = {"w1": "0.weight", "b1": "0.bias", "w2": "2.weight", "b2": "2.bias"}
    config.base_model = base_model
    config.training = training
    model = KVzapModel(config)
    state = {}
    for i, layer in enumerate(params):
        for key, name in names.items():
            state[f"layers.{i}.{name}"] = torch.as_tensor(np.asarray(layer[key]), dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def save(model, where: Path, readme: str) -> None:
    """``model.save_pretrained(where)`` and ``where/README.md``."""
    where.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(where)
    write_atomic(where / "README.md", readme)
