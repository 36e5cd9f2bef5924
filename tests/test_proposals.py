"""Proposals of probabilistic eviction (paper 003 appendix H, D, D.1; docs/methods.md §3 item 1)."""

import math

import pytest
import torch
from kvpress import KnormPress, SnapKVPress, TOVAPress

from presses.core.columns import column_sums
from presses.probabilistic.proposals import (
    adjust_proposal,
    attention_column_sums,
    compute_proposal,
    group_mixture,
    harmonic_prior,
    head_proposals,
    score_to_proposal,
)


@pytest.fixture(scope="module")
def captured():
    """Layer-0 inputs of a tiny eager GQA Llama (H_Q=6, G=2) with its full attention matrices."""
    from conftest import capture_layer0

    return capture_layer0(23, output_attentions=True)


def _naive_column_sums(attn, weights=None):
    """Full-matrix reference: attn (B, H, t, t) causal rows; weights (t,) over rows."""
    w = torch.ones(attn.shape[-2]) if weights is None else weights
    return (attn.double() * w.double().view(-1, 1)).sum(-2)


def test_harmonic_prior_values():
    t = 7
    h = harmonic_prior(t)
    H_t = sum(1.0 / k for k in range(1, t + 1))
    expected = torch.tensor([1.0 / ((t - j + 1) * H_t) for j in range(1, t + 1)])
    assert torch.allclose(h, expected.float(), atol=1e-7)
    assert h.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert h[-1].item() == pytest.approx(1.0 / H_t) and h[0].item() == pytest.approx(1.0 / (t * H_t))
    with pytest.raises(ValueError, match="t=0"):
        harmonic_prior(0)


@pytest.mark.parametrize("block_size", [1, 4, 7, 23, 64])
def test_block_column_sums_equal_full_matrix(captured, block_size):
    module, hs, keys, values, attn, kwargs = captured
    t = keys.shape[2]
    for weights in (None, harmonic_prior(t), torch.rand(t, generator=torch.Generator().manual_seed(1))):
        blocked = attention_column_sums(module, hs, keys, kwargs["position_embeddings"], weights, block_size)
        assert blocked.shape == (2, 6, t) and blocked.dtype == torch.float32
        assert torch.allclose(blocked.double(), _naive_column_sums(attn, weights), atol=1e-5)


def test_column_sums_random_tensors_match_naive():
    g = torch.Generator().manual_seed(5)
    B, HQ, G, t, d = 2, 4, 2, 11, 8
    q, k = torch.randn(B, HQ, t, d, generator=g), torch.randn(B, G, t, d, generator=g)
    kr = k.repeat_interleave(HQ // G, dim=1)
    logits = (q @ kr.transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.softmax(logits, -1).sum(-2)
    parts = sum(column_sums(q[:, :, s : s + 3], k, rows=torch.arange(s, min(s + 3, t))) for s in range(0, t, 3))
    assert torch.allclose(parts, full, atol=1e-5)
    with pytest.raises(ValueError, match="row positions"):
        column_sums(q[:, :, :2], k, rows=torch.tensor([3, 11]))


@pytest.mark.parametrize("name", ["min", "min_h", "h2o", "h2o_h"])
def test_head_proposals_match_appendix_h(captured, name):
    module, hs, keys, values, attn, kwargs = captured
    t = keys.shape[2]
    a = attn.double()  # (B, H, t, t), row j = p_j
    if name == "min":
        score = a[:, :, -1]
    elif name in ("h2o", "min_h", "h2o_h"):
        score = _naive_column_sums(a, harmonic_prior(t) if name.endswith("_h") else None)
    if name.startswith("min"):
        score = score * values.double().norm(dim=-1).repeat_interleave(3, dim=1)
    expected = score / score.sum(-1, keepdim=True)
    got = head_proposals(name, module, hs, keys, values, kwargs["position_embeddings"], block_size=5)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(2, 6), atol=1e-5)


def test_group_mixture_is_mean_of_heads_and_covers_support():
    head = torch.zeros(1, 4, 5)
    head[0, 0, 0] = head[0, 1, 1] = head[0, 2, 2] = head[0, 3, 3] = 1.0  # disjoint one-hot heads
    pi = group_mixture(head, 2)
    assert torch.allclose(pi, torch.tensor([[[0.5, 0.5, 0, 0, 0], [0, 0, 0.5, 0.5, 0]]]))
    w = torch.tensor([[[0.25, 0.75], [1.0, 0.0]]])
    assert torch.allclose(group_mixture(head, 2, w), torch.tensor([[[0.25, 0.75, 0, 0, 0], [0, 0, 1.0, 0, 0]]]))
    with pytest.raises(ValueError, match="num_groups=3"):
        group_mixture(head, 3)


def test_temperature_and_uniform_mixing():
    pi = torch.tensor([[0.7, 0.2, 0.1, 0.0]])
    assert torch.allclose(adjust_proposal(pi), pi)
    hot = adjust_proposal(pi, temperature=2.0)
    expected = pi.sqrt() / pi.sqrt().sum()
    assert torch.allclose(hot, expected, atol=1e-6)
    assert hot[0, 0] < pi[0, 0]  # T > 1 flattens
    assert adjust_proposal(pi, temperature=0.5)[0, 0] > pi[0, 0]  # T < 1 sharpens
    mixed = adjust_proposal(pi, uniform_mix=0.2)
    assert torch.allclose(mixed, 0.8 * pi + 0.2 / 4)
    assert (mixed > 0).all() and mixed.sum().item() == pytest.approx(1.0)
    assert torch.allclose(adjust_proposal(pi, uniform_mix=1.0), torch.full((1, 4), 0.25))
    with pytest.raises(ValueError, match="temperature=0"):
        adjust_proposal(pi, temperature=0)
    with pytest.raises(ValueError, match="uniform_mix=1.5"):
        adjust_proposal(pi, uniform_mix=1.5)


def test_score_to_proposal():
    s = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(score_to_proposal(s), torch.softmax(s, -1))
    assert torch.allclose(score_to_proposal(s, temperature=0.5), torch.softmax(2 * s, -1))
    assert torch.allclose(score_to_proposal(s, normalization="sum"), s / 6)
    with pytest.raises(ValueError, match="non-negative"):
        score_to_proposal(-s, normalization="sum")
    with pytest.raises(ValueError, match="normalization='l1'"):
        score_to_proposal(s, normalization="l1")


@pytest.mark.parametrize(
    "name,scorer",
    [("snapkv", SnapKVPress(window_size=4, kernel_size=3)), ("tova", TOVAPress()), ("knorm", KnormPress())],
)
def test_scorer_adapters_are_softmax_of_kvpress_scores(captured, name, scorer):
    module, hs, keys, values, attn, kwargs = captured
    scores = scorer.score(module, hs, keys, values, attn, kwargs)
    pi = compute_proposal(name, module, hs, keys, values, attn, kwargs, temperature=0.3, window_size=4, kernel_size=3)
    assert pi.shape == (2, 2, keys.shape[2])
    assert torch.allclose(pi, torch.softmax(scores.float() / 0.3, -1), atol=1e-6)


@pytest.mark.parametrize("name", ["min", "min_h", "h2o", "h2o_h"])
def test_compute_proposal_shape_sums_and_support(captured, name):
    module, hs, keys, values, attn, kwargs = captured
    pi = compute_proposal(name, module, hs, keys, values, None, kwargs, uniform_mix=0.1, block_size=8)
    assert pi.shape == (2, 2, keys.shape[2]) and pi.dtype == torch.float32
    assert torch.allclose(pi.sum(-1), torch.ones(2, 2), atol=1e-5)
    assert (pi >= 0.1 / keys.shape[2] - 1e-7).all()
    head = head_proposals(name, module, hs, keys, values, kwargs["position_embeddings"])
    assert torch.allclose(pi, 0.9 * head.view(2, 2, 3, -1).mean(2) + 0.1 / keys.shape[2], atol=1e-6)
    with pytest.raises(ValueError, match="proposal='bogus'"):
        compute_proposal("bogus", module, hs, keys, values, None, kwargs)
