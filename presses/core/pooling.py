"""Pooling of observer attention inside each GQA group: the group score ``p_g`` of Page-EntroKV.

docs/methods.md §1 steps 2-5 (paper 000 section 3; paper 001 eqs. 3-5). Shared by the press, its Triton
kernel's torch reference (:mod:`presses.kernels.references`) and the UOR analysis.
"""

from __future__ import annotations

import torch

from presses.core.renyi import group_weights, pool_groups, renyi_entropy, sink_isolate

__all__ = ["POOLINGS", "pooled_group_scores"]


POOLINGS = ("entropy", "raw_entropy", "mean", "max")


def pooled_group_scores(
    attn: torch.Tensor,
    num_groups: int,
    n_sink: int,
    alpha: float,
    tau: float,
    pooling: str,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict | None]:
    """Group scores ``p_g[j]`` from observer attention (docs/methods.md §1 steps 2-5; paper 000 sec. 3, paper 001 eqs.
    3-5).

    ``pooling``:
      - ``"entropy"``: ``w_h = softmax_{h in g}(-H_alpha(a~^h) / tau)`` on the sink-isolated rows ``a~^h``;
      - ``"raw_entropy"``: the same on the raw rows ``a^h`` (no sink isolation; ablation);
      - ``"mean"``: ``w_h = 1/r``;
      - ``"max"``: ``p_g[j] = max_{h in g} a^h[j]`` (no weights).
    The weighted poolings sum the ORIGINAL rows: ``p_g[j] = sum_h w_h a^h[j]``.
    No tuning value has a default here: :class:`presses.page_entrokv.PageEntroKVPress`'s fields are their one
    source, and the press passes every one of them.

    Args:
        attn: ``(B, H_Q, T)`` observer attention (rows sum to 1).
        num_groups: ``G`` KV groups; query head ``h`` belongs to group ``h // r``.
        n_sink: leading sink positions ``|S|`` (``< T`` whenever sink isolation is computed).
        alpha: Rényi order ``> 0`` or ``inf``.
        tau: group temperature ``tau_g > 0`` (``inf`` gives mean pooling).
        pooling: one of :data:`POOLINGS`.
        diagnostics: also return per-head statistics.

    Returns:
        ``(pooled, diag)``: ``(B, G, T)`` float32 pooled scores; ``diag`` is ``None`` unless
        ``diagnostics``, then a dict of float32 tensors: ``weights`` ``(B, G, r)`` (``None`` for
        ``"max"``), ``entropy`` ``(B, H_Q)`` sink-isolated entropies, ``raw_entropy`` ``(B, H_Q)``,
        ``z`` ``(B, H_Q)`` non-sink mass.

    Raises:
        ValueError: for an unknown ``pooling``, ``alpha <= 0``, ``tau <= 0``, ``G`` not dividing
            ``H_Q``, or ``n_sink >= T`` when sink isolation is needed.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not one of {POOLINGS}")
    Bsz, HQ, T = attn.shape
    if num_groups <= 0 or HQ % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of query heads H_Q={HQ}")
    r = HQ // num_groups
    attn = attn.float()
    entropy = z = raw_entropy = None
    if pooling == "entropy" or diagnostics:
        a_tilde, z = sink_isolate(attn, n_sink)
        entropy = renyi_entropy(a_tilde, alpha)
    if pooling == "raw_entropy" or diagnostics:
        raw_entropy = renyi_entropy(attn, alpha)

    weights = None
    if pooling == "entropy":
        weights = group_weights(entropy, num_groups, tau)
    elif pooling == "raw_entropy":
        weights = group_weights(raw_entropy, num_groups, tau)
    elif pooling == "mean":
        weights = attn.new_full((Bsz, num_groups, r), 1.0 / r)
    if pooling == "max":
        pooled = attn.reshape(Bsz, num_groups, r, T).amax(2)
    else:
        pooled = pool_groups(attn, weights)
    if not diagnostics:
        return pooled, None
    return pooled, {"weights": weights, "entropy": entropy, "raw_entropy": raw_entropy, "z": z}
