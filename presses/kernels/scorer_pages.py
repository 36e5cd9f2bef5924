"""Triton: page scores of a scorer's per-token scores, the optional mean over KV heads fused in (docs/methods.md
§1.17).

What :class:`presses.scorer_pages.ScorerPagePress` ranks pages by: for each (batch row, KV head or the heads' mean,
page) the block max, the block max over the page and a halo of ``max(1, B // 4)`` positions on each side
(``halo_max``), the mean or the sum of the page's token scores, a partial last page over its own positions.
Reference: :func:`presses.kernels.references.scorer_page_scores_reference` (:func:`presses.core.paging.page_scores`
on the scores, averaged over the heads first for ``shared``). One program per (row, head, block of pages): it loads
each page's positions (and halo) once per head, in float32, so the ``(B, G, T)`` mean for ``shared`` is never
stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from presses.core.paging import PAGE_SCORES, num_pages
from presses.kernels.references import check_scorer_page_args

__all__ = ["scorer_page_scores_triton"]

_METHOD = {name: k for k, name in enumerate(PAGE_SCORES)}  # block_max 0, mass 1, mean 2, halo_max 3
_BLOCK_P = 16


@triton.jit
def _page_kernel(
    x_ptr,
    out_ptr,
    G,
    T,
    P,
    sx_b,
    sx_g,
    sx_t,
    so_b,
    so_g,
    so_p,
    PAGE: tl.constexpr,
    HALO: tl.constexpr,
    SPAN: tl.constexpr,
    METHOD: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)  # the head (0 when SHARED: the mean over the heads)
    pages = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs = tl.arange(0, SPAN)  # a page and its halo: positions page * PAGE - HALO + offs
    pos = pages[:, None] * PAGE - HALO + offs[None, :]
    inside = (offs[None, :] >= HALO) & (offs[None, :] < HALO + PAGE)  # the page's own positions
    if METHOD != 3:
        valid = inside & (pos < T) & (pages[:, None] < P)
    else:
        valid = (pos >= 0) & (pos < T) & (offs[None, :] < 2 * HALO + PAGE) & (pages[:, None] < P)
    acc = tl.zeros((BLOCK_P, SPAN), dtype=tl.float32)
    if SHARED:
        for h in range(0, G):
            acc += tl.load(x_ptr + b * sx_b + h * sx_g + pos * sx_t, mask=valid, other=0.0).to(tl.float32)
        acc = acc / G
    else:
        acc = tl.load(x_ptr + b * sx_b + g * sx_g + pos * sx_t, mask=valid, other=0.0).to(tl.float32)
    if METHOD == 0 or METHOD == 3:
        out = tl.max(tl.where(valid, acc, float("-inf")), axis=1)
    else:
        total = tl.sum(tl.where(valid, acc, 0.0), axis=1)
        if METHOD == 1:
            out = total
        else:
            count = tl.sum(valid.to(tl.float32), axis=1)
            out = total / tl.maximum(count, 1.0)
    tl.store(out_ptr + b * so_b + g * so_g + pages * so_p, out, mask=pages < P)


def scorer_page_scores_triton(tokens: torch.Tensor, page_size: int, method: str, shared: bool) -> torch.Tensor:
    """:func:`presses.kernels.references.scorer_page_scores_reference` in one Triton launch (same arguments, result
    and errors)."""
    check_scorer_page_args(tokens, page_size, method)
    page_size = int(page_size)
    B, G, T = tokens.shape
    P = num_pages(T, page_size)
    out = torch.empty(B, 1 if shared else G, P, dtype=torch.float32, device=tokens.device)
    if P == 0 or B == 0:
        return out
    halo = max(1, page_size // 4) if method == "halo_max" else 0
    span = triton.next_power_of_2(page_size + 2 * halo)
    grid = (B, out.shape[1], triton.cdiv(P, _BLOCK_P))
    _page_kernel[grid](
        tokens,
        out,
        G,
        T,
        P,
        *tokens.stride(),
        *out.stride(),
        PAGE=page_size,
        HALO=halo,
        SPAN=span,
        METHOD=_METHOD[method],
        SHARED=bool(shared),
        BLOCK_P=_BLOCK_P,
    )
    return out
