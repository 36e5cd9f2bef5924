"""Probabilistic eviction with a decode-time SNIS correction (paper 003; docs/methods.md §3): proposals,
the coupon-collector sample budget, sampling, and the press."""

from presses.probabilistic.press import ProbabilisticEvictionPress

__all__ = ["ProbabilisticEvictionPress"]
