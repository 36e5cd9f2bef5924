"""Union overhead of head-independent selection inside GQA groups, and its certificates.

Paper 000 section 6.2 (Table 2, Table 4, Theorem 1, Corollary 1, Remark 1, Fig. 4) and paper 001
section 7; docs/methods.md §2. Pure tensor math, no model: the analysis driver
(:mod:`evaluation.uor`) captures attention and calls these functions.

Notation: ``H_Q`` query heads, ``G`` KV groups, ``r = H_Q / G`` (query head ``h`` belongs to group
``h // r``), ``T`` key positions, ``s`` positions selected per head.

Head-independent replay: every query head of a group keeps its own top-``s`` positions ``K_h`` under a
per-head scorer; the shared KV buffer must hold the union, so the group pays
``UOR_g = |union_h K_h| / s`` with ``1 <= UOR <= min(r, T / s)``. Pairwise Jaccard SIMILARITY
``J(A, B) = |A & B| / |A | B|``; ``J_bar`` is its mean over the ``r (r - 1) / 2`` head pairs and
``J_max`` its max (the paper's disagreement is ``D = 1 - J``).

Certificates (Table 2):

- ``r = 2`` identity: ``UOR = 2 / (1 + J) = 2 / (2 - D)`` exactly.
- Bonferroni (Corollary 1): ``UOR >= max(1, r - r (r - 1) J_bar)``; certifies ``UOR >= 2`` when
  ``J_bar <= (r - 2) / (r (r - 1))`` (r = 4: 1/6, r = 8: 3/28).
- Sandwich (Theorem 1): ``r / (1 + 2 (r - 1) J_bar / (1 + J_bar)) <= UOR <= min(r, r - 2 J_max / (1 + J_max))``;
  certifies ``UOR >= 2`` when ``J_bar <= (r - 2) / (3 r - 2)`` (r = 4: 1/5, r = 8: 3/11).
  For ``r = 3`` the Bonferroni threshold (1/6) is the wider one (sandwich: 1/7): the sandwich
  threshold exceeds the Bonferroni one only for ``r > 2 + sqrt(2)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from presses.core.renyi import group_weights, renyi_entropy, sink_isolate

__all__ = [
    "SCORERS",
    "K_OVER_T",
    "HEAD_CLASSES",
    "selection_size",
    "top_s",
    "selection_masks",
    "set_statistics",
    "r2_identity",
    "bonferroni_bound",
    "bonferroni_threshold",
    "sandwich_bounds",
    "sandwich_threshold",
    "head_independent_replay",
    "pooled_replay",
    "summarize_cells",
    "accumulated_attention",
    "last_row_attention",
    "pages_touched",
    "tau_sweep",
    "alpha_sweep",
    "classify_heads",
]

#: Per-head scorers of the replay (docs/methods.md §2): ``h2o`` = column sums of the prefill attention,
#: ``last_row`` = attention of the last query, ``snapkv`` = window-averaged (observer) attention.
SCORERS = ("h2o", "last_row", "snapkv")
#: Budgets ``k / T`` of paper 000 Table 4.
K_OVER_T = (0.02, 0.05, 0.1, 0.2)
#: Sink-census classes (paper 000 Figs. 7-8), see :func:`classify_heads`.
HEAD_CLASSES = ("sink", "retrieval", "contextual")


def selection_size(seq_len: int, k_over_t: float) -> int:
    """``s = round(k/T * T)`` positions per head (docs/methods.md §2).

    Raises:
        ValueError: if ``k_over_t`` is outside ``(0, 1]`` or ``s`` rounds to 0.
    """
    if not (0.0 < k_over_t <= 1.0):
        raise ValueError(f"k_over_t={k_over_t} must be in (0, 1]")
    s = round(k_over_t * seq_len)
    if s < 1:
        raise ValueError(f"k_over_t={k_over_t} selects s={s} positions of T={seq_len}: need s >= 1")
    return s


def top_s(scores: torch.Tensor, s: int) -> torch.Tensor:
    """Indices of the ``s`` largest scores on the last axis; ties go to the lower index, NaN ranks last.

    Args:
        scores: ``(..., T)`` per-position scores.
        s: ``1 <= s <= T``.

    Returns:
        ``(..., s)`` long indices (in descending score order).

    Raises:
        ValueError: if ``s`` is outside ``[1, T]``.
    """
    T = scores.shape[-1]
    if not (1 <= s <= T):
        raise ValueError(f"s={s} must be in [1, T={T}]")
    x = scores.float().nan_to_num(nan=float("-inf"))
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :s]


def selection_masks(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Boolean membership masks of index sets.

    Args:
        indices: ``(..., s)`` long positions in ``[0, T)``.
        seq_len: ``T``.

    Returns:
        ``(..., T)`` bool, True at the selected positions.
    """
    mask = torch.zeros(*indices.shape[:-1], seq_len, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, indices, True)


def set_statistics(masks: torch.Tensor) -> dict[str, torch.Tensor]:
    """UOR and pairwise Jaccard similarity of ``r`` equal-size sets (docs/methods.md §2; paper 000 section 6.2).

    Args:
        masks: ``(..., r, T)`` bool; the ``r`` sets of one cell must all hold ``s >= 1`` elements.

    Returns:
        dict of ``(...)`` tensors: ``union`` (long ``|union_h K_h|``), ``s`` (long), ``uor`` (float64
        ``union / s``), ``j_bar`` and ``j_max`` (float64 mean and max pairwise Jaccard similarity;
        1.0 when ``r = 1``: a lone head agrees with itself).

    Raises:
        ValueError: if the sets of a cell differ in size or are empty.
    """
    sizes = masks.sum(-1)  # (..., r)
    s = sizes[..., 0]
    if bool((sizes != s.unsqueeze(-1)).any()) or bool((s < 1).any()):
        raise ValueError("every head of a cell must select the same number s >= 1 of positions")
    r = masks.shape[-2]
    union = masks.any(-2).sum(-1)
    f = masks.double()
    inter = f @ f.transpose(-1, -2)  # (..., r, r) pairwise intersections
    if r > 1:
        iu = torch.triu_indices(r, r, offset=1, device=masks.device)
        i_ab = inter[..., iu[0], iu[1]]
        u_ab = sizes[..., iu[0]].double() + sizes[..., iu[1]].double() - i_ab
        jac = i_ab / u_ab
        j_bar, j_max = jac.mean(-1), jac.amax(-1)
    else:
        j_bar = j_max = torch.ones(s.shape, dtype=torch.float64, device=masks.device)
    return {"union": union, "s": s, "uor": union.double() / s.double(), "j_bar": j_bar, "j_max": j_max}


def r2_identity(jaccard):
    """``UOR = 2 / (1 + J)`` for two equal-size sets of Jaccard similarity ``J`` (paper 000 Remark 1)."""
    return 2.0 / (1.0 + jaccard)


def _check_r(r: int) -> None:
    if isinstance(r, bool) or int(r) != r or r < 1:
        raise ValueError(f"group ratio r={r} must be an integer >= 1")


def bonferroni_bound(r: int, j_bar):
    """Bonferroni lower bound ``max(1, r - r (r - 1) J_bar)`` on UOR (paper 000 Corollary 1).

    Works on floats and tensors. Raises ``ValueError`` for ``r < 1``.
    """
    _check_r(r)
    lb = r - r * (r - 1) * j_bar
    return lb.clamp_min(1.0) if isinstance(lb, torch.Tensor) else max(1.0, lb)


def bonferroni_threshold(r: int) -> float:
    """Largest ``J_bar`` the Bonferroni bound certifies ``UOR >= 2`` at: ``(r - 2) / (r (r - 1))``.

    Raises:
        ValueError: for ``r < 2`` (no ``UOR >= 2`` is possible below two heads).
    """
    _check_r(r)
    if r < 2:
        raise ValueError(f"r={r}: UOR <= r < 2, nothing to certify")
    return (r - 2) / (r * (r - 1))


def sandwich_bounds(r: int, j_bar, j_max):
    """Two-sided bound of paper 000 Theorem 1 (Cauchy-Schwarz lower envelope, max-pair upper bound).

    ``lower = r / (1 + 2 (r - 1) J_bar / (1 + J_bar))``, ``upper = min(r, r - 2 J_max / (1 + J_max))``.
    Works on floats and tensors.

    Returns:
        ``(lower, upper)``.

    Raises:
        ValueError: for ``r < 1``.
    """
    _check_r(r)
    lower = r / (1.0 + 2.0 * (r - 1) * j_bar / (1.0 + j_bar))
    upper = r - 2.0 * j_max / (1.0 + j_max)
    upper = upper.clamp_max(float(r)) if isinstance(upper, torch.Tensor) else min(float(r), upper)
    return lower, upper


def sandwich_threshold(r: int) -> float:
    """Largest ``J_bar`` the sandwich lower bound certifies ``UOR >= 2`` at: ``(r - 2) / (3 r - 2)``.

    Raises:
        ValueError: for ``r < 2``.
    """
    _check_r(r)
    if r < 2:
        raise ValueError(f"r={r}: UOR <= r < 2, nothing to certify")
    return (r - 2) / (3 * r - 2)


def _cells(masks: torch.Tensor, finite: torch.Tensor) -> dict[str, torch.Tensor]:
    """Statistics, bounds and certificates of ``(..., G, r, T)`` selection masks."""
    r = masks.shape[-2]
    st = set_statistics(masks)
    lo_b = bonferroni_bound(r, st["j_bar"])
    lo_s, hi_s = sandwich_bounds(r, st["j_bar"], st["j_max"])
    eps = 1e-12
    st.update(
        {
            "bonferroni_lower": lo_b,
            "sandwich_lower": lo_s,
            "sandwich_upper": hi_s,
            "cert_bonferroni": lo_b >= 2.0 - eps,
            "cert_sandwich": lo_s >= 2.0 - eps,
            "finite": finite,
        }
    )
    return st


def head_independent_replay(scores: torch.Tensor, num_groups: int, k_over_t: float) -> dict[str, torch.Tensor]:
    """Head-independent top-``s`` selection per query head, scored per (…, group) cell (docs/methods.md §2).

    Args:
        scores: ``(..., H_Q, T)`` per-head scores (any of :data:`SCORERS`), e.g. ``(L, H_Q, T)``.
        num_groups: ``G``, dividing ``H_Q``.
        k_over_t: budget ``k / T`` in ``(0, 1]``; ``s = round(k/T * T)``.

    Returns:
        dict of ``(..., G)`` tensors: ``union``, ``s``, ``uor``, ``j_bar``, ``j_max`` (see
        :func:`set_statistics`), ``bonferroni_lower``, ``sandwich_lower``, ``sandwich_upper``,
        ``cert_bonferroni`` / ``cert_sandwich`` (bool: the bound certifies ``UOR >= 2``), ``finite``
        (bool: every score of the cell was finite; non-finite scores rank last and the cell should be
        counted as skipped), plus ``indices`` ``(..., G, r, s)``.

    Raises:
        ValueError: if ``G`` does not divide ``H_Q`` or the budget selects no position.
    """
    HQ, T = scores.shape[-2:]
    if num_groups <= 0 or HQ % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of query heads H_Q={HQ}")
    r = HQ // num_groups
    s = selection_size(T, k_over_t)
    grouped = scores.reshape(*scores.shape[:-2], num_groups, r, T)
    idx = top_s(grouped, s)
    finite = torch.isfinite(grouped.float()).all(-1).all(-1)
    out = _cells(selection_masks(idx, T), finite)
    out["indices"] = idx
    return out


def pooled_replay(pooled: torch.Tensor, r: int, k_over_t: float) -> dict[str, torch.Tensor]:
    """The pooled (Page-EntroKV) row: one top-``s`` selection per group, shared by its ``r`` heads.

    Every head of a group holds the group's set, so the union is that set and ``UOR = 1`` exactly
    (paper 000 Theorem 3), ``J_bar = J_max = 1``. Same outputs as :func:`head_independent_replay`.

    Args:
        pooled: ``(..., G, T)`` pooled group scores (e.g. :func:`presses.core.pooling.pooled_group_scores`).
        r: heads per group, ``>= 1``.
        k_over_t: budget in ``(0, 1]``.
    """
    _check_r(r)
    T = pooled.shape[-1]
    s = selection_size(T, k_over_t)
    idx = top_s(pooled, s).unsqueeze(-2).expand(*pooled.shape[:-1], r, s)
    finite = torch.isfinite(pooled.float()).all(-1)
    out = _cells(selection_masks(idx, T), finite)
    out["indices"] = idx
    return out


def summarize_cells(cells: Iterable[dict[str, torch.Tensor]]) -> dict[str, float | int]:
    """Table 4 row from replay cells (docs/methods.md §2): over the finite cells, mean and max UOR,
    ``frac(UOR > 1)``, the cells certified ``>= 2`` by each certificate, ``frac(UOR >= 2)``, mean
    ``J_bar`` and ``J_max``; ``cells`` and ``skipped`` (non-finite) counts.

    Args:
        cells: outputs of :func:`head_independent_replay` / :func:`pooled_replay` (any leading shape).
    """
    keys = ("uor", "j_bar", "j_max", "cert_bonferroni", "cert_sandwich", "finite")
    cat = {k: [] for k in keys}
    for c in cells:
        for k in keys:
            cat[k].append(c[k].reshape(-1))
    if not cat["uor"]:
        raise ValueError("summarize_cells needs at least one replay output")
    v = {k: torch.cat(x) for k, x in cat.items()}
    ok = v["finite"]
    uor = v["uor"][ok]
    n = int(ok.sum())
    if n == 0:
        nan = float("nan")
        return {
            "cells": 0,
            "skipped": int((~ok).sum()),
            "uor_mean": nan,
            "uor_max": nan,
            "frac_uor_gt1": nan,
            "cert_bonferroni": 0,
            "cert_sandwich": 0,
            "frac_uor_ge2": nan,
            "j_bar_mean": nan,
            "j_max_mean": nan,
        }
    eps = 1e-12
    return {
        "cells": n,
        "skipped": int((~ok).sum()),
        "uor_mean": float(uor.mean()),
        "uor_max": float(uor.max()),
        "frac_uor_gt1": float((uor > 1 + eps).double().mean()),
        "cert_bonferroni": int(v["cert_bonferroni"][ok].sum()),
        "cert_sandwich": int(v["cert_sandwich"][ok].sum()),
        "frac_uor_ge2": float((uor >= 2 - eps).double().mean()),
        "j_bar_mean": float(v["j_bar"][ok].mean()),
        "j_max_mean": float(v["j_max"][ok].mean()),
    }


def accumulated_attention(attentions: torch.Tensor) -> torch.Tensor:
    """H2O scorer: column sums of the causal prefill attention, ``sum_i A^h[i, j]`` (H2O, Zhang et al. 2023).

    Args:
        attentions: ``(..., T, T)`` attention weights (rows = queries).

    Returns:
        ``(..., T)`` float32 accumulated attention per key (sums to ``T`` over keys).
    """
    return attentions.float().sum(-2)


def last_row_attention(attentions: torch.Tensor) -> torch.Tensor:
    """``last_row`` scorer: the attention of the last prefill query, ``A^h[T - 1, j]``.

    Args:
        attentions: ``(..., T, T)``.

    Returns:
        ``(..., T)`` float32.
    """
    return attentions[..., -1, :].float()


def pages_touched(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages a set of positions occupies: ``|{j // B : j in K}|`` per row (paper 001 section 7).

    Args:
        indices: ``(..., n)`` long positions (a row may repeat a position).
        page_size: ``B >= 1``.

    Returns:
        ``(...)`` long page counts.

    Raises:
        ValueError: for ``page_size < 1``.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    pages = indices // page_size
    n_pages = int(pages.max()) + 1 if pages.numel() else 1
    return selection_masks(pages, n_pages).sum(-1)


def tau_sweep(entropy: torch.Tensor, num_groups: int, taus: Sequence[float]) -> dict[str, object]:
    """Temperature ablation (paper 000 Table 5a, Proposition 2): ``max_h w_h`` and the std of ``w``.

    Args:
        entropy: ``(..., H_Q)`` per-head (sink-isolated) entropies.
        num_groups: ``G``.
        taus: temperatures ``tau_g > 0`` (``inf`` = mean pooling), any order.

    Returns:
        dict with ``taus`` (sorted ascending), ``max_w`` and ``std_w`` (lists of ``(..., G)`` float32
        tensors, one per tau: the largest weight of each group and the population std of its ``r``
        weights), ``violations`` (cells where ``max_h w_h`` increases between consecutive taus by more
        than ``1e-6``) and ``monotone`` (``violations == 0``).

    Raises:
        ValueError: for an empty ``taus`` or a ``tau <= 0`` (from :func:`presses.core.renyi.group_weights`).
    """
    taus = sorted(float(t) for t in taus)
    if not taus:
        raise ValueError("taus must not be empty")
    max_w, std_w = [], []
    for tau in taus:
        w = group_weights(entropy, num_groups, tau)
        max_w.append(w.amax(-1))
        std_w.append(w.std(-1, correction=0))
    violations = sum(int((b > a + 1e-6).sum()) for a, b in zip(max_w, max_w[1:]))
    return {"taus": taus, "max_w": max_w, "std_w": std_w, "violations": violations, "monotone": violations == 0}


def alpha_sweep(
    attn: torch.Tensor, num_groups: int, n_sink: int, alphas: Sequence[float], tau: float = 0.5
) -> dict[float, dict[str, object]]:
    """Rényi-order ablation (paper 000 Table 5b) on sink-isolated observer attention.

    Args:
        attn: ``(..., H_Q, T)`` observer attention (rows sum to 1).
        num_groups: ``G``.
        n_sink: sink positions isolated before the entropy (``0 <= n_sink < T``).
        alphas: Rényi orders (``> 0`` or ``inf``).
        tau: the group temperature of the weights.

    Returns:
        ``{alpha: {"entropy": (..., H_Q), "max_w": (..., G), "h_min", "h_max", "violations",
        "at_clamp"}}``: the entropies, the largest weight per group, their range, the count outside
        ``[0, ln T]`` and the count lying on the clamp edges ``0`` or ``ln(T - n_sink)`` of
        :func:`presses.core.renyi.renyi_entropy` (within ``1e-6``; a non-zero count means the clamp may
        have hidden round-off).

    Raises:
        ValueError: for a bad ``alpha``, ``tau`` or ``n_sink``.
    """
    T = attn.shape[-1]
    a_tilde, _ = sink_isolate(attn, n_sink)
    ln_n, ln_t = math.log(T - n_sink), math.log(T)
    out = {}
    for alpha in alphas:
        h = renyi_entropy(a_tilde, float(alpha))
        w = group_weights(h, num_groups, tau)
        out[float(alpha)] = {
            "entropy": h,
            "max_w": w.amax(-1),
            "h_min": float(h.min()),
            "h_max": float(h.max()),
            "violations": int(((h < 0) | (h > ln_t)).sum()),
            "at_clamp": int(((h <= 1e-6) | (h >= ln_n - 1e-6)).sum()),
        }
    return out


def classify_heads(
    attn: torch.Tensor, n_sink: int, sink_threshold: float, needle_positions: torch.Tensor | None
) -> torch.Tensor:
    """Operational sink census (paper 000 section 6.3, Figs. 7-8).

    Rule, per head: ``sink`` when at least ``sink_threshold`` of its observer mass lies on the first
    ``n_sink`` positions (``1 - z_h >= X``); otherwise ``retrieval`` when its top-1 non-sink position
    (ties to the lower index) is a needle position; otherwise ``contextual``.

    Args:
        attn: ``(..., H_Q, T)`` observer attention.
        n_sink: ``|S|``, ``0 <= n_sink < T``.
        sink_threshold: ``X`` in ``(0, 1]``.
        needle_positions: ``(n,)`` long needle token positions, or ``None`` (no retrieval class).

    Returns:
        ``(..., H_Q)`` long class ids indexing :data:`HEAD_CLASSES` (0 sink, 1 retrieval, 2 contextual).

    Raises:
        ValueError: for ``sink_threshold`` outside ``(0, 1]`` or a bad ``n_sink``.
    """
    if not (0.0 < sink_threshold <= 1.0):
        raise ValueError(f"sink_threshold={sink_threshold} must be in (0, 1]")
    a_tilde, z = sink_isolate(attn, n_sink)
    sink = (1.0 - z) >= sink_threshold
    labels = torch.full(z.shape, 2, dtype=torch.long, device=attn.device)
    if needle_positions is not None and needle_positions.numel():
        top = top_s(a_tilde, 1)[..., 0] + n_sink
        hit = torch.isin(top, needle_positions.to(top.device))
        labels[hit] = 1
    labels[sink] = 0
    return labels
