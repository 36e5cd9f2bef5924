"""EntroPrefill's math: paper 001 eqs. 1-5 (rows, proposal, floored pooling), 8-9 (chunk priorities),
Theorem 4.1 (deletion envelope), eq. 17 (Hoeffding audit radius), eq. 19 (set change) and eqs. 31-32
(layer cost and analytic saving). docs/methods.md §4. The greedy scan and the dual certificate (eqs. 14-16)
are in :mod:`presses.entroprefill.dual`, chunking in :mod:`presses.entroprefill.chunking`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from kvpress.utils import get_prerope_query_states

from presses.core.observer import apply_rope, attention_logit_options, softcap_logits
from presses.core.renyi import group_weights, pool_groups, renyi_entropy, sink_isolate
from presses.core.row_masses import chunk_masses_from_rows
from presses.kernels import row_chunk_masses

__all__ = [
    "row_attention",
    "row_queries",
    "row_chunk_statistics",
    "floor_weights",
    "pooled_proposal",
    "chunk_priorities",
    "deletion_envelope",
    "hoeffding_radius",
    "set_change",
    "layer_cost_coefficients",
    "analytic_saving",
]


def row_attention(
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    position_embeddings,
    attentions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention rows ``A^{l,h}_{u, .}`` of the prefill queries at ``positions`` (eq. 1).

    Unlike :func:`presses.observers.observer_attention` (window-AVERAGED rows of the last ``W``
    queries) this returns every row separately and accepts arbitrary query positions: EntroPrefill
    needs per-row masses for its proposal constraints (eq. 14) and rows at randomly drawn audit
    positions (eq. 17). Averaging the rows of the last ``W`` positions reproduces
    ``observer_attention``.

    Args:
        module: the Llama-like attention module of the layer.
        hidden_states: ``(B, T, D_model)`` input of the attention layer.
        keys: ``(B, G, T, d)`` RoPE'd keys of the layer (prefill: key ``j`` is token ``j``).
        positions: ``(P,)`` int64 token indices of the query rows.
        position_embeddings: ``(cos, sin)`` each ``(B, T, d)``.
        attentions: optional ``(B, H_Q, T, T)`` eager attention weights (then simply sliced).

    Returns:
        ``(B, H_Q, P, T)`` float32 rows, each summing to 1 over keys ``j <= positions[p]``.
    """
    if attentions is not None:
        return attentions[:, :, positions, :].float()
    q = row_queries(module, hidden_states, positions, position_embeddings).float()
    B, H, P, d = q.shape
    G, T = keys.shape[1], keys.shape[2]
    if H % G:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={H}")
    scaling, softcap = attention_logit_options(module)
    logits = torch.matmul(q.reshape(B, G, (H // G) * P, d), keys.float().transpose(-1, -2))
    logits = softcap_logits(logits * (d**-0.5 if scaling is None else scaling), softcap).reshape(B, H, P, T)
    future = torch.arange(T, device=keys.device).view(1, T) > positions.to(keys.device).view(P, 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def row_queries(module, hidden_states: torch.Tensor, positions: torch.Tensor, position_embeddings) -> torch.Tensor:
    """RoPE'd queries of the prefill rows at ``positions`` (paper 001 eq. 1's ``q^{l,h}_u``).

    Args:
        module: the Llama-like attention module of the layer.
        hidden_states: ``(B, T, D_model)`` input of the attention layer.
        positions: ``(P,)`` int64 token indices of the rows.
        position_embeddings: ``(cos, sin)`` each ``(B, T, d)``.

    Returns:
        ``(B, H_Q, P, d)`` in the dtype of ``hidden_states``.
    """
    q = get_prerope_query_states(module, hidden_states[:, positions])
    cos, sin = position_embeddings
    return apply_rope(module, q, cos[:, positions], sin[:, positions]).to(hidden_states.dtype)


def row_chunk_statistics(
    module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    position_embeddings,
    ids: torch.Tensor,
    num_chunks: int,
    row_weights: torch.Tensor | None = None,
    attentions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What Algorithm 1 reads from the causal rows at ``positions``: each row's mass on each chunk (eqs. 14, 17)
    and, with ``row_weights``, the rows' weighted average per head (eq. 2 with ``w = 1/W_p``).

    Recomputes the rows' queries and calls the kernel dispatch :func:`presses.kernels.row_chunk_masses` (Triton
    on CUDA, which never stores the ``P x T`` rows; the torch reference elsewhere); with eager attention
    weights it reads the rows from them instead.

    Args:
        module, hidden_states, keys, positions, position_embeddings, attentions: as :func:`row_attention`.
        ids: ``(T,)`` chunk of every key, ``-1`` outside the chunks
            (:func:`presses.core.row_masses.chunk_ids`).
        num_chunks: ``k``.
        row_weights: ``(P,)`` weights of the average, or ``None``.

    Returns:
        ``(masses (B, H_Q, P, k), average (B, H_Q, T) or None)`` float32.
    """
    if attentions is not None:
        rows = attentions[:, :, positions, :].float()
        average = None if row_weights is None else (rows * row_weights.to(rows).view(-1, 1)).sum(-2)
        return chunk_masses_from_rows(rows, ids.to(rows.device), num_chunks), average
    q = row_queries(module, hidden_states, positions, position_embeddings)
    scaling, softcap = attention_logit_options(module)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return row_chunk_masses(q, keys, positions, ids, num_chunks, row_weights, scaling, softcap)


def floor_weights(
    attn: torch.Tensor, num_groups: int, n_sink: int, tau: float, zeta: float, z_min: float
) -> dict[str, torch.Tensor]:
    """Sink-isolated collision weights with eligibility and floor (paper 001 eqs. 3-4).

    ``z_h = sum_{j not in S} a^h_j``; head ``h`` is eligible when ``z_h >= z_min``;
    ``C_h = sum_j (a^h_j / z_h)^2`` on the non-sinks; inside each group
    ``v_h = C_h^(1/tau) / sum_{eligible a} C_a^(1/tau)`` (0 for ineligible heads), ``v_h = 1/r``
    when the whole group is ineligible, and ``w_h = (1 - zeta) v_h + zeta / r``. Uses
    :func:`presses.core.renyi.renyi_entropy` (``C^(1/tau) = exp(-H_2 / tau)``) and
    :func:`presses.core.renyi.group_weights`.

    Args:
        attn: ``(H_Q, T)`` observer-averaged proposal rows ``a^{l,h}`` (eq. 2).
        num_groups: ``G``.
        n_sink: ``|S|``, leading sink positions.
        tau: entropy temperature ``tau > 0``.
        zeta: group floor ``zeta in (0, 1]``.
        z_min: eligibility threshold ``z_min > 0``.

    Returns:
        dict with ``w`` and ``v`` ``(G, r)``, ``z`` and ``eligible`` ``(H_Q,)``, ``group_fallback``
        ``(G,)`` (all heads of the group ineligible).

    Raises:
        ValueError: for ``tau <= 0``, ``zeta`` outside ``(0, 1]`` or ``z_min <= 0``.
    """
    if not zeta > 0 or zeta > 1:
        raise ValueError(f"zeta={zeta} must lie in (0, 1]")
    if not z_min > 0:
        raise ValueError(f"z_min={z_min} must be > 0")
    if not tau > 0:
        raise ValueError(f"tau={tau} must be > 0")
    a_tilde, z = sink_isolate(attn, n_sink)
    ent = renyi_entropy(a_tilde, 2.0)
    eligible = z >= z_min
    v = group_weights(torch.where(eligible, ent, torch.full_like(ent, float("inf"))), num_groups, tau)
    G, r = v.shape[-2:]
    fallback = ~eligible.reshape(G, r).any(-1)
    v = torch.where(fallback.unsqueeze(-1), torch.full_like(v, 1.0 / r), v)
    w = (1.0 - zeta) * v + zeta / r
    return {"w": w, "v": v, "z": z, "eligible": eligible, "group_fallback": fallback}


def pooled_proposal(attn: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Pooled proposal measure ``mu^l_j = (1/G) sum_g sum_{h in g} w_h a^{l,h}_j`` (paper 001 eq. 5).

    Args:
        attn: ``(H_Q, T)`` proposal rows (the ORIGINAL attention, sinks included).
        w: ``(G, r)`` head weights from :func:`floor_weights`.

    Returns:
        ``(T,)`` float32, a probability distribution when the rows are.
    """
    return pool_groups(attn, w).mean(-2)


def chunk_priorities(
    mu: torch.Tensor, chunks: Sequence[tuple[int, int]], smoothing: float, lam: float
) -> dict[str, torch.Tensor]:
    """Null-calibrated chunk priorities ``S_i = ln l_i + lambda kappa_i`` (paper 001 eqs. 8-9).

    With ``Z = mu(D)`` over the union ``D`` of the chunks, ``p_j = mu_j / Z``, chunk mass
    ``M_i = sum_{j in c_i} p_j``, null mass ``pi_i = n_i / N``:
    ``p^_ij = (p_j + eps_s pi_i / n_i) / (M_i + eps_s pi_i)``,
    ``l_i = (M_i + eps_s pi_i) / ((1 + eps_s) pi_i)``,
    ``kappa_i = (n_i sum_j p^_ij^2 - 1) / (n_i - 1)`` (0 for singletons). Float64.

    Args:
        mu: ``(T,)`` pooled proposal.
        chunks: ``k`` disjoint token ranges ``[start, end)``.
        smoothing: ``eps_s > 0``.
        lam: ``lambda >= 0``.

    Returns:
        dict with ``S``, ``ell``, ``kappa``, ``M`` ``(k,)`` float64 and ``Z`` (0-d), on the CPU whatever
        ``mu``'s device (found by the GPU check: ``n`` and ``mu`` met on two devices).

    Raises:
        ValueError: for ``smoothing <= 0``, ``lam < 0``, no chunks, or ``Z <= 0``.
    """
    if not smoothing > 0:
        raise ValueError(f"smoothing eps_s={smoothing} must be > 0")
    if not lam >= 0:
        raise ValueError(f"lambda={lam} must be >= 0")
    if len(chunks) == 0:
        raise ValueError("chunk_priorities needs at least one chunk")
    mu = mu.detach().double().cpu()  # k chunk sums: on the CPU, as the dual certificate (mu may be on a GPU)
    n = torch.tensor([e - s for s, e in chunks], dtype=torch.float64)
    mass_tok = [mu[s:e] for s, e in chunks]
    Z = torch.stack([m.sum() for m in mass_tok]).sum()
    if not Z > 0:
        raise ValueError(f"document mass Z={float(Z)} must be > 0")
    N = n.sum()
    pi = n / N
    M = torch.stack([m.sum() for m in mass_tok]) / Z
    ell = (M + smoothing * pi) / ((1 + smoothing) * pi)
    kappa = torch.zeros_like(n)
    for i, m in enumerate(mass_tok):
        if n[i] > 1:
            p_hat = (m / Z + smoothing * pi[i] / n[i]) / (M[i] + smoothing * pi[i])
            kappa[i] = (n[i] * (p_hat * p_hat).sum() - 1) / (n[i] - 1)
    S = torch.log(ell) + lam * kappa
    return {"S": S, "ell": ell, "kappa": kappa, "M": M, "Z": Z}


def deletion_envelope(
    a: torch.Tensor,
    mu: torch.Tensor,
    omega: float,
    removed: torch.Tensor,
) -> tuple[float, float]:
    """Mixture-to-row deletion envelope of paper 001 Theorem 4.1 (eqs. 11-12).

    For a row ``a`` with mixture coefficient ``omega`` in ``mu`` and a removal set ``E``:
    ``a(E) <= min{1, q / omega, q + sqrt(chi2 q (1 - q))}`` with ``q = mu(E)`` and
    ``chi2 = D_chi2(a || mu) <= 1/omega - 1``.

    Args:
        a: ``(T,)`` constituent row.
        mu: ``(T,)`` mixture.
        omega: ``> 0`` coefficient of ``a`` in ``mu``.
        removed: ``(T,)`` bool mask of ``E``.

    Returns:
        ``(bound, chi2)``.
    """
    a, mu = a.double(), mu.double()
    q = float(mu[removed].sum().clamp(0.0, 1.0))
    support = mu > 0
    chi2 = float(((a[support] - mu[support]) ** 2 / mu[support]).sum())
    bound = min(1.0, q / omega, q + math.sqrt(max(chi2, 0.0) * q * (1.0 - q)))
    return bound, chi2


def hoeffding_radius(num_layers: int, num_heads: int, delta: float, audit_size: int) -> float:
    """Simultaneous one-sided Hoeffding radius ``b = sqrt(ln(J H_Q / delta) / (2 m_a))`` (eq. 17).

    Raises:
        ValueError: for ``delta`` outside ``(0, 1)``, ``audit_size < 1`` or non-positive counts.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must lie in (0, 1)")
    if audit_size < 1:
        raise ValueError(f"audit_size m_a={audit_size} must be >= 1")
    if num_layers < 1 or num_heads < 1:
        raise ValueError(f"J={num_layers} monitored layers and H_Q={num_heads} heads must be >= 1")
    return math.sqrt(math.log(num_layers * num_heads / delta) / (2 * audit_size))


def set_change(retained: set[int], previous: set[int]) -> float:
    """Set-change statistic ``d_l = |R_l xor R_l-| / max(1, |R_l u R_l-|)`` (paper 001 eq. 19)."""
    return len(retained ^ previous) / max(1, len(retained | previous))


def layer_cost_coefficients(config) -> tuple[float, float]:
    """FLOP coefficients ``(a, b)`` of one decoder layer, ``F(T) = a T + b T^2`` (paper 001 eq. 31).

    ``a = 2 (2 D H_Q d + 2 D G d + 3 D D_ff)`` (q/o, k/v and gated-MLP projections, 2 FLOPs per
    multiply-add); ``b = 2 H_Q d`` (causal ``QK^T`` and ``AV``, half of ``T^2`` each).
    """
    D = config.hidden_size
    H = config.num_attention_heads
    G = getattr(config, "num_key_value_heads", None) or H
    d = getattr(config, "head_dim", None) or D // H
    ff = getattr(config, "intermediate_size", 4 * D)
    return 2.0 * (2 * D * H * d + 2 * D * G * d + 3 * D * ff), 2.0 * H * d


def analytic_saving(full_layers: int, num_layers: int, T: int, T_prime: int, a: float, b: float) -> float:
    """Ideal fraction of prefill FLOPs saved (paper 001 eq. 32).

    ``(1 - l*/L) (a T (1 - xi) + b T^2 (1 - xi^2)) / (a T + b T^2)`` with ``xi = T'/T``, where
    ``l* = full_layers`` is the number of layers run on the full prompt.
    """
    if T <= 0:
        return 0.0
    xi = T_prime / T
    return (1 - full_layers / num_layers) * (a * T * (1 - xi) + b * T * T * (1 - xi * xi)) / (a * T + b * T * T)
