"""Paper 000 Table 10's synthetic needle group (docs/methods.md §1, the needle construction).

One KV group of ``r`` heads over ``T`` positions with ``n_sink`` sinks: head 0, the retrieval head, puts
``needle_mass`` on one needle position and the rest uniformly on the other non-sink positions; its ``r - 1``
siblings are uniform on the non-sink positions except the needle; no head puts mass on the sinks. Entropy
pooling should lift the needle to about ``needle_mass`` (Table 10 "pooled"), mean pooling leaves it at
``needle_mass / r``. Used by the claims ledger's Table 10 rows (:mod:`evaluation.studies.claims_ledger.analytic`)
and the Table 10 test (``tests/test_renyi.py``).
"""

from __future__ import annotations

import torch

__all__ = ["needle_group_attention"]


def needle_group_attention(
    T: int, r: int = 8, n_sink: int = 4, needle_mass: float = 0.95, needle: int | None = None
) -> tuple[torch.Tensor, int]:
    """The needle group's observer attention (paper 000 Table 10 setting: r = 8, 1 - eps = 0.95).

    Args:
        T: positions, ``> n_sink + 1``.
        r: heads in the group, ``>= 1``.
        n_sink: leading sink positions (no mass), ``>= 0``.
        needle_mass: head 0's mass on the needle, in ``[0, 1]``.
        needle: the needle's position, in ``[n_sink, T)``; default ``n_sink + (T - n_sink) // 3``.

    Returns:
        ``(attn, needle)``: ``attn`` ``(1, r, T)`` float32 (built in float64), each row summing to 1; the
        needle's position.

    Raises:
        ValueError: if ``T``, ``r``, ``n_sink``, ``needle_mass`` or ``needle`` is outside its range.
    """
    if r < 1 or n_sink < 0 or T <= n_sink + 1:
        raise ValueError(
            f"needle group needs r >= 1, n_sink >= 0 and T > n_sink + 1, got r={r}, n_sink={n_sink}, T={T}"
        )
    if not 0.0 <= needle_mass <= 1.0:
        raise ValueError(f"needle_mass={needle_mass} must be in [0, 1]")
    N = T - n_sink
    needle = n_sink + N // 3 if needle is None else needle
    if not n_sink <= needle < T:
        raise ValueError(f"needle={needle} must be in [n_sink={n_sink}, T={T})")
    attn = torch.zeros(1, r, T, dtype=torch.float64)
    attn[0, :, n_sink:] = 1.0 / (N - 1)
    attn[0, :, needle] = 0.0
    attn[0, 0, n_sink:] = (1.0 - needle_mass) / (N - 1)
    attn[0, 0, needle] = needle_mass
    return attn.float(), needle
