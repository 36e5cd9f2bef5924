"""Sink-isolated Rényi pooling inside GQA groups: docs/methods.md §1 steps 2-5 and the paper-000
properties (Table 10 needle bound, Table 5a temperature limit, Theorem 2 sink masquerade, entropy range).
Exercised through the press's pooling path :func:`presses.core.pooling.pooled_group_scores`."""

from __future__ import annotations

import math

import pytest
import torch

from evaluation.studies.needle_group import needle_group_attention
from presses.core.pooling import pooled_group_scores
from presses.core.renyi import group_weights, renyi_entropy, sink_isolate

# Paper 000 Table 10 (r = 8, tau_g = 0.5, 1 - eps = 0.95): T -> Delta(T), the bound's loss term.
TABLE10_DELTA = {4096: 1.59e-6, 8192: 3.97e-7, 16384: 9.92e-8, 32768: 2.48e-8, 65536: 6.20e-9, 131072: 1.63e-9}


@pytest.mark.parametrize("T", sorted(TABLE10_DELTA))
def test_table10_needle_bound(T):
    r, tau, eps = 8, 0.5, 0.05
    attn, needle = needle_group_attention(T, r)
    assert torch.allclose(attn.double().sum(-1), torch.ones(1, r, dtype=torch.float64), atol=1e-5)
    pooled, diag = pooled_group_scores(
        attn, num_groups=1, n_sink=4, alpha=2.0, tau=tau, pooling="entropy", diagnostics=True
    )
    mean, _ = pooled_group_scores(attn, num_groups=1, n_sink=4, alpha=2.0, tau=tau, pooling="mean")
    got, got_mean = pooled[0, 0, needle].item(), mean[0, 0, needle].item()

    # closed form in float64: w_0 = C_0^(1/tau) / (C_0^(1/tau) + (r-1) C_s^(1/tau)), C = collision
    N = T - 4
    c0 = (1 - eps) ** 2 + eps**2 / (N - 1)
    cs = 1.0 / (N - 1)
    w0 = c0 ** (1 / tau) / (c0 ** (1 / tau) + (r - 1) * cs ** (1 / tau))
    assert got == pytest.approx((1 - eps) * w0, abs=1e-6)  # float32 accumulation
    assert got >= 0.9499
    assert got >= (1 - eps) - TABLE10_DELTA[T] - 1e-7  # above the paper's finite-context bound
    assert got <= 1 - eps + 1e-7
    if T == 4096:
        assert got == pytest.approx(0.949998, abs=2e-6)  # Table 10, 4k row
    assert got_mean == pytest.approx(0.11875, abs=1e-7)  # (1 - eps) / r exactly
    assert round(got / got_mean, 2) == 8.00
    assert diag["weights"][0, 0].argmax().item() == 0


def real_ish_attention(T: int = 384, heads: int = 8, n_sink: int = 4, seed: int = 0) -> torch.Tensor:
    """Softmax rows with head-dependent sharpness and a sink bump: ``(1, heads, T)``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 4.0, heads).view(1, heads, 1)
    logits = torch.randn(1, heads, T, generator=g) * scale
    logits[..., :n_sink] += torch.rand(1, heads, 1, generator=g) * 6
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("r", [2, 4, 8])
def test_tau_limit_and_monotone_sharpness(r):
    attn = real_ish_attention(heads=2 * r)
    taus = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 100.0, 1e4]
    maxw = []
    for tau in taus:
        _, diag = pooled_group_scores(attn, 2, n_sink=4, alpha=2.0, tau=tau, pooling="entropy", diagnostics=True)
        maxw.append(diag["weights"].amax(-1))  # (1, G)
    maxw = torch.stack(maxw)  # (n_tau, 1, G)
    assert bool((maxw[1:] < maxw[:-1] + 1e-7).all()), maxw.squeeze(1).T  # Table 5a: monotone in tau
    assert bool((maxw[0] > 1.0 / r + 0.05).all())  # sharp at small tau
    assert torch.allclose(maxw[-1], torch.full_like(maxw[-1], 1.0 / r), atol=1e-3)  # toward 1/r
    pooled_inf, diag_inf = pooled_group_scores(
        attn, 2, n_sink=4, alpha=2.0, tau=math.inf, pooling="entropy", diagnostics=True
    )
    pooled_mean, _ = pooled_group_scores(attn, 2, n_sink=4, alpha=2.0, tau=0.5, pooling="mean")
    assert torch.equal(diag_inf["weights"], torch.full_like(diag_inf["weights"], 1.0 / r))
    assert torch.allclose(pooled_inf, pooled_mean, atol=1e-7)
    assert torch.allclose(pooled_mean, attn.reshape(1, 2, r, -1).mean(2), atol=1e-7)


def test_alpha2_weights_are_collision_powers():
    """docs/methods.md §1 step 4: for alpha = 2, w_h = C_h^(1/tau) / sum C^(1/tau) with C_h = sum a~^2."""
    attn = real_ish_attention(heads=6)
    tau = 0.7
    _, diag = pooled_group_scores(attn, 2, n_sink=4, alpha=2.0, tau=tau, pooling="entropy", diagnostics=True)
    a = attn.double()[..., 4:]
    a = a / a.sum(-1, keepdim=True)
    c = (a * a).sum(-1).reshape(1, 2, 3) ** (1 / tau)
    assert torch.allclose(diag["weights"].double(), c / c.sum(-1, keepdim=True), atol=1e-5)


def test_sink_masquerade():
    """Theorem 2: a sink-heavy head with a uniform residual loses weight after isolation; a sharp
    non-sink head wins."""
    T, S, r = 512, 4, 4
    N = T - S
    g = torch.Generator().manual_seed(1)
    attn = torch.zeros(1, r, T, dtype=torch.float64)
    attn[0, 0, :S] = 0.9 / S  # sink head: 90% on the sinks, uniform residual
    attn[0, 0, S:] = 0.1 / N
    attn[0, 1, S:] = 0.7 / (N - 1)  # sharp retrieval head, no sink mass
    attn[0, 1, S + 100] = 0.3
    attn[0, 2:] = torch.softmax(torch.randn(2, T, generator=g, dtype=torch.float64) * 0.3, -1)  # diffuse
    attn = attn.float()
    _, raw = pooled_group_scores(attn, 1, n_sink=S, alpha=2.0, tau=0.5, pooling="raw_entropy", diagnostics=True)
    _, iso = pooled_group_scores(attn, 1, n_sink=S, alpha=2.0, tau=0.5, pooling="entropy", diagnostics=True)
    w_raw, w_iso = raw["weights"][0, 0], iso["weights"][0, 0]
    assert w_raw.argmax().item() == 0  # the masquerade: raw entropy favours the sink head
    assert w_iso[0] < w_raw[0]
    assert w_iso.argmax().item() == 1
    # the isolated sink head is uniform on the residual: it sits at the ceiling ln(T - |S|)
    assert iso["entropy"][0, 0].item() == pytest.approx(math.log(N), abs=1e-4)
    assert iso["z"][0, 0].item() == pytest.approx(0.1, abs=1e-6)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, math.inf])
def test_entropy_range_after_isolation(alpha):
    T, S = 300, 4
    N = T - S
    g = torch.Generator().manual_seed(2)
    rows = [torch.softmax(torch.randn(T, generator=g) * s, -1) for s in (0.1, 1.0, 3.0, 10.0)]
    onehot = torch.zeros(T)
    onehot[S + 7] = 1.0
    uniform = torch.zeros(T)
    uniform[S:] = 1.0 / N
    sinky = torch.full((T,), 0.01 / N)
    sinky[:S] = 0.99 / S
    sinky[S:] = 0.01 / N
    attn = torch.stack(rows + [onehot, uniform, sinky]).unsqueeze(0)  # (1, 7, T)
    a_tilde, _ = sink_isolate(attn, S)
    h = renyi_entropy(a_tilde, alpha)
    assert bool((h >= 0).all()) and bool((h <= math.log(N) + 1e-6).all())
    # independent float64 evaluation agrees (the range is not an artefact of clamping)
    p = a_tilde.double()
    if math.isinf(alpha):
        ref = -torch.log(p.amax(-1))
    elif alpha == 1.0:
        ref = -torch.special.xlogy(p, p).sum(-1)
    else:
        ref = torch.log((p**alpha).sum(-1)) / (1 - alpha)
    assert torch.allclose(h.double(), ref, atol=2e-4)
    assert h[0, 4].item() == pytest.approx(0.0, abs=1e-6)  # one-hot
    assert h[0, 5].item() == pytest.approx(math.log(N), abs=1e-4)  # uniform
    assert h[0, 6].item() == pytest.approx(math.log(N), abs=1e-4)  # sink-heavy, uniform residual


def test_group_layout_and_errors():
    """Query head h belongs to group h // r; weights sum to 1 per group; bad inputs raise."""
    attn = real_ish_attention(heads=6)
    pooled, diag = pooled_group_scores(attn, 3, n_sink=4, alpha=2.0, tau=0.5, pooling="entropy", diagnostics=True)
    w = diag["weights"]
    assert w.shape == (1, 3, 2)
    assert torch.allclose(w.sum(-1), torch.ones(1, 3))
    manual = w[0, 1, 0] * attn[0, 2] + w[0, 1, 1] * attn[0, 3]
    assert torch.allclose(pooled[0, 1], manual, atol=1e-7)
    mx, _ = pooled_group_scores(attn, 3, n_sink=4, alpha=2.0, tau=0.5, pooling="max")
    assert torch.equal(mx[0, 2], torch.maximum(attn[0, 4], attn[0, 5]))
    with pytest.raises(ValueError, match="pooling='median'"):
        pooled_group_scores(attn, 3, n_sink=4, alpha=2.0, tau=0.5, pooling="median")
    with pytest.raises(ValueError, match="num_groups=4"):
        pooled_group_scores(attn, 4, n_sink=4, alpha=2.0, tau=0.5, pooling="entropy")
    with pytest.raises(ValueError, match="tau=0"):
        group_weights(torch.zeros(1, 4), 2, tau=0)
