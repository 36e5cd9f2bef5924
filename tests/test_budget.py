"""Sample budget of probabilistic eviction (paper 003 appendix F, Alg. 2; docs/methods.md §3 items 2-3)."""

import math

import pytest
import torch

from presses.core.coupon import expected_unique, expected_unique_from_log
from presses.probabilistic.budget import MAX_SAMPLES, sample_counts, search_num_samples

# docs/methods.md §3 item 3 worked example (the paper's F.1 example with the ratios put right)
PI_EXAMPLE = torch.tensor([0.8, 0.0998, 0.0001, 0.0001], dtype=torch.float64)


def _naive_expected(pi, m):
    return sum(1.0 - (1.0 - float(p)) ** m for p in pi)


def test_expected_unique_matches_definition_and_is_monotone():
    pi = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    for m in (0, 1, 7, 100, 5000):
        e = expected_unique(pi, m)
        for row in range(3):
            assert e[row].item() == pytest.approx(_naive_expected(pi[row], m), rel=1e-9, abs=1e-9)
    es = [expected_unique(pi, m) for m in range(0, 200)]
    diffs = torch.stack([b - a for a, b in zip(es, es[1:])])
    # paper eq. 31: E[J(m+1)] - E[J(m)] = sum_i pi_i (1 - pi_i)^m, in [0, sum_i pi_i]; float32 softmax rows sum to 1
    # only within float32 rounding (how far depends on the CPU's summation order), so the bound is the row's own sum
    total = pi.double().sum(-1)
    assert (diffs >= 0).all() and (diffs <= total + 1e-12).all()
    assert torch.allclose(diffs[0], total, rtol=0, atol=1e-12)  # the first draw always adds a new entry
    # stable where the naive power underflows: E[J] -> number of positive entries
    assert expected_unique(PI_EXAMPLE, 10**12).item() == pytest.approx(4.0)
    assert expected_unique(torch.tensor([1e-18, 1.0 - 1e-18]), 10**6).item() == pytest.approx(1.0 + 1e-12, abs=1e-14)


def test_worked_example_quarter_compression():
    # r* = 0.25 keeps 3 of 4: the tolerated set is [2877, 13862] and the search from [0, 1e12] stops at 7449
    ok = [m for m in range(0, 20000) if abs(_naive_expected(PI_EXAMPLE, m) - 3.0) <= 0.5]
    assert (min(ok), max(ok)) == (2877, 13862)
    m = int(search_num_samples(PI_EXAMPLE, 0.25))
    assert m == 7449
    assert abs(expected_unique(PI_EXAMPLE, m).item() - 3.0) <= 0.5


def test_worked_example_three_quarter_compression():
    ok = [m for m in range(0, 1000) if abs(_naive_expected(PI_EXAMPLE, m) - 1.0) <= 0.5]
    assert (min(ok), max(ok)) == (1, 6)
    m = int(search_num_samples(PI_EXAMPLE, 0.75))
    assert 1 <= m <= 6


def test_head_search_rows_are_independent_and_within_tolerance():
    g = torch.Generator().manual_seed(1)
    pi = torch.softmax(3 * torch.randn(2, 3, 64, generator=g), -1)
    for r in (0.1, 0.5, 0.9):
        m = search_num_samples(pi, r)
        assert m.shape == (2, 3) and m.dtype == torch.int64
        err = (expected_unique(pi, m) - (1 - r) * 64).abs()
        assert (err <= 0.5).all()
        for b in range(2):
            for h in range(3):
                assert int(search_num_samples(pi[b, h], r)) == int(m[b, h])


def test_global_search_matches_mean_expectation():
    g = torch.Generator().manual_seed(2)
    # heads with very different concentration: one m for all, criterion on the MEAN E[J] (F.1 eq. 33)
    pi = torch.softmax(torch.randn(2, 4, 3, 80, generator=g) * torch.tensor([0.1, 1.0, 3.0, 6.0]).view(1, 4, 1, 1), -1)
    m = search_num_samples(pi, 0.6, pool_dims=(1, 2))
    assert m.shape == (2, 1, 1)
    mean_e = expected_unique(pi, m).mean(dim=(1, 2))
    assert ((mean_e - 0.4 * 80).abs() <= 0.5).all()
    # the per-head expectations themselves differ widely (budget moves between heads)
    per_head = expected_unique(pi, m)
    assert (per_head.amax(dim=(1, 2)) - per_head.amin(dim=(1, 2)) > 10).all()


def test_global_budget_kept_count_on_average_over_seeds():
    g = torch.Generator().manual_seed(3)
    t = 60
    pi = torch.softmax(torch.randn(1, 5, 2, t, generator=g) * 2, -1)
    r = 0.7
    m = search_num_samples(pi, r, pool_dims=(1, 2))
    kept = []
    for seed in range(200):
        counts = sample_counts(pi, m.view(1, 1, 1), torch.Generator().manual_seed(seed))
        kept.append((counts > 0).double().sum(-1).mean().item())
    kept = torch.tensor(kept)
    se = kept.std().item() / math.sqrt(len(kept))
    assert abs(kept.mean().item() - (1 - r) * t) <= 0.5 + 4 * se


def _algorithm_2(pi, ratio, dims=(), tol=0.5):
    """Algorithm 2 written out with :func:`expected_unique` at every midpoint (no shortcut)."""
    j_star = (1.0 - ratio) * pi.shape[-1]
    shape = [1 if d in dims else s for d, s in enumerate(pi.shape[:-1])]
    low = torch.zeros(shape, dtype=torch.int64)
    high = torch.full_like(low, MAX_SAMPLES)
    found = torch.full_like(low, -1)
    active = torch.ones_like(low, dtype=torch.bool)
    while bool(active.any()):
        mid = torch.div(low + high, 2, rounding_mode="floor")
        e = expected_unique(pi, mid)
        e = e.mean(dim=dims, keepdim=True) if dims else e
        hit = active & ((e - j_star).abs() <= tol)
        found = torch.where(hit, mid, found)
        low = torch.where(active & ~hit & (e < j_star), mid + 1, low)
        high = torch.where(active & ~hit & (e > j_star), mid - 1, high)
        active = active & ~hit & (low <= high)
    return torch.where(found >= 0, found, low)


def test_expected_unique_from_log_equals_expected_unique_bit_for_bit():
    pi = torch.softmax(3 * torch.randn(2, 3, 400, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    log_q = torch.log1p(-pi)
    buf = torch.empty_like(log_q)
    for m in (0, 1, 5, 999, 123457, 10**9, MAX_SAMPLES):
        per_row = torch.full((2, 3), m) + torch.arange(3)  # one m per row, broadcast over the batch
        assert torch.equal(expected_unique_from_log(log_q, per_row, buf), expected_unique(pi, per_row))
        assert torch.equal(expected_unique_from_log(log_q, torch.tensor(m)), expected_unique(pi, m))


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.75, 0.9])
def test_search_equals_algorithm_2_with_expected_unique(ratio):
    """The search takes ``log(1 - pi)`` once instead of at every midpoint: the same ``E[J]`` values bit for bit,
    so the same ``m`` as Algorithm 2 evaluated with :func:`expected_unique`, head-wise and pooled (global)."""
    pi = torch.softmax(3 * torch.randn(1, 4, 3, 300, generator=torch.Generator().manual_seed(2)), -1)
    assert torch.equal(search_num_samples(pi, ratio), _algorithm_2(pi.double(), ratio))
    assert torch.equal(search_num_samples(pi, ratio, pool_dims=(1, 2)), _algorithm_2(pi.double(), ratio, (1, 2)))


def test_unreachable_target_returns_capped_samples():
    pi = torch.tensor([0.5, 0.5, 0.0, 0.0])  # at most 2 distinct entries, target keeps 3
    m = int(search_num_samples(pi, 0.25))
    assert m == MAX_SAMPLES
    assert int(search_num_samples(pi, 0.25, max_samples=1000)) == 1000


def test_sample_counts_sum_and_expectation():
    g = torch.Generator().manual_seed(4)
    pi = torch.softmax(torch.randn(3, 37, generator=g), -1)
    m = torch.tensor([0, 5, 1000])
    c = sample_counts(pi, m, torch.Generator().manual_seed(0))
    assert c.dtype == torch.int64 and c.shape == pi.shape
    assert c.sum(-1).tolist() == [0, 5, 1000]
    # mean over many draws approaches m * pi (within 5 standard errors per entry)
    n = 400
    cs = torch.stack([sample_counts(pi[2], 1000, torch.Generator().manual_seed(s)) for s in range(n)]).double()
    mean = cs.mean(0)
    se = (1000 * pi[2].double() * (1 - pi[2].double()) / n).sqrt()
    assert ((mean - 1000 * pi[2].double()).abs() <= 5 * se + 1e-9).all()
    # zero-probability entries are never drawn; huge m is cheap and exact in total
    pz = torch.tensor([0.0, 0.3, 0.0, 0.7])
    big = sample_counts(pz, 10**12, torch.Generator().manual_seed(1))
    assert big[0] == 0 and big[2] == 0 and int(big.sum()) == 10**12
    assert abs(big[1].item() / 1e12 - 0.3) < 1e-4


def test_sample_counts_reproducible():
    pi = torch.softmax(torch.randn(2, 2, 50), -1)
    a = sample_counts(pi, 30, torch.Generator().manual_seed(7))
    b = sample_counts(pi, 30, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="compression_ratio=1.0"):
        search_num_samples(PI_EXAMPLE, 1.0)
    with pytest.raises(ValueError, match="tol"):
        search_num_samples(PI_EXAMPLE, 0.5, tol=-1)
    with pytest.raises(ValueError, match="pool_dims"):
        search_num_samples(PI_EXAMPLE.view(1, 4), 0.5, pool_dims=(-1,))
    with pytest.raises(ValueError, match="num_samples"):
        sample_counts(PI_EXAMPLE, -1)
    with pytest.raises(ValueError, match="non-negative"):
        sample_counts(torch.tensor([0.5, -0.5, 1.0]), 3)
