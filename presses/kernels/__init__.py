"""Scoring kernels: one dispatch point per kernel, Triton on CUDA and the torch reference elsewhere.

Set ``KVPRESS_RESEARCH_KERNELS=reference`` to force the torch references on any device.
"""

from __future__ import annotations

import os

import torch

__all__ = ["use_triton", "window_attention"]


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on CUDA, Triton imports, and the reference is not forced."""
    if os.environ.get("KVPRESS_RESEARCH_KERNELS", "").lower() == "reference" or not tensor.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def window_attention(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Dispatch for the observer-averaged window attention; see
    :func:`presses.observer.observer_attention_reference` for shapes, errors and source."""
    from presses.observer import observer_attention_reference

    return observer_attention_reference(queries, keys)
