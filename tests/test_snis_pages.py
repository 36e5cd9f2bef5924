"""Probabilistic eviction with pages as the sampling unit (presses/probabilistic/page_sampling.py; paper 003 Alg. 1-2,
eq. 10)."""

import math

import pytest
import torch
from conftest import decode_biases
from test_snis_press import _attend, _Attn, _decode, _prefill, _prompt
from transformers import DynamicCache

import presses.probabilistic.press as snis_press
from presses import attention
from presses.core.coupon import expected_unique
from presses.probabilistic import ProbabilisticEvictionPress
from presses.probabilistic.budget import search_num_samples
from presses.probabilistic.correction import snis_bias
from presses.probabilistic.page_sampling import expand_pages, page_proposal, page_target, page_tolerance

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

T = 42  # prompt length: with page_size 4 the last of the 11 pages holds 2 tokens


def _record_draws(monkeypatch):
    """Wrap the press's ``sample_counts``; returns the list of ``(pi, m, counts)`` of every call."""
    calls = []
    real = snis_press.sample_counts

    def wrapped(pi, m, generator=None):
        counts = real(pi, m, generator)
        calls.append((pi.clone(), m.clone(), counts.clone()))
        return counts

    monkeypatch.setattr(snis_press, "sample_counts", wrapped)
    return calls


# ---------------------------------------------------------------------------------- page_size = 1
@pytest.mark.parametrize("budget", ["head", "global"])
@pytest.mark.parametrize("proposal,ratio", [("min_h", 0.63), ("h2o", 0.5)])
def test_page_size_one_equals_token_unit(tiny_llama, monkeypatch, budget, proposal, ratio):
    """Same m, same draws for a seed, same kept entries (cache), same bias and same decode as the token unit.
    ``(1 - 0.63) * 42 = 15.54`` is fractional, so a floored or page-rounded target would differ."""
    model = tiny_llama(num_layers=3, attn_implementation="sdpa")
    ids, question = _prompt(20, T), _prompt(21, 4)
    runs = []
    for kw in ({}, {"unit": "page", "page_size": 1}):
        calls = _record_draws(monkeypatch)
        press = ProbabilisticEvictionPress(
            compression_ratio=ratio, proposal=proposal, budget=budget, seed=5, uniform_mix=0.01, **kw
        )
        cache = _prefill(model, press, ids)
        biases = [b.clone() for b in decode_biases(cache)]
        keys = [layer.keys.clone() for layer in cache.layers]
        logits = _decode(model, cache, question, T)
        runs.append((calls, biases, keys, logits, press.summary()))
        monkeypatch.undo()
    (tok_calls, tok_bias, tok_keys, tok_logits, tok_sum), (pg_calls, pg_bias, pg_keys, pg_logits, pg_sum) = runs
    assert len(tok_calls) == len(pg_calls) == 3
    for (pi_t, m_t, c_t), (pi_p, m_p, c_p) in zip(tok_calls, pg_calls):
        assert torch.equal(pi_t, pi_p) and torch.equal(m_t, m_p) and torch.equal(c_t, c_p)
    for a, b in zip(tok_bias, pg_bias):
        assert torch.equal(a, b)
    for a, b in zip(tok_keys, pg_keys):
        assert torch.equal(a, b)
    for a, b in zip(tok_logits, pg_logits):
        assert torch.equal(a, b)
    assert pg_sum["unit"] == "page" and tok_sum["unit"] == "token"
    for key in ("num_samples_mean", "logical_compression", "physical_compression", "logical_compression_per_layer"):
        assert pg_sum[key] == tok_sum[key]
    assert pg_sum["num_pages"] == T
    assert pg_sum["kept_pages_mean"] == pytest.approx((1 - pg_sum["logical_compression"]) * T)


# ---------------------------------------------------------------------------------- estimator
@pytest.mark.parametrize("budget", ["head", "global"])
def test_counts_at_expectation_give_full_attention(tiny_llama, monkeypatch, budget):
    """With c_p = m pi_p every page is kept with weight c_p / (m pi_p) = 1: the corrected decode equals the
    uncompressed model (also with a partial last page)."""
    seen = []

    def expected_counts(pi, m, generator=None):
        seen.append(pi.shape[-1])
        return m.unsqueeze(-1) * pi.double()

    monkeypatch.setattr(snis_press, "sample_counts", expected_counts)
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, question = _prompt(22, T), _prompt(23, 5)
    press = ProbabilisticEvictionPress(
        compression_ratio=0.6, proposal="h2o_h", budget=budget, uniform_mix=0.05, unit="page", page_size=4
    )
    got = _decode(model, _prefill(model, press, ids), question, T)
    assert seen == [11, 11]  # the draws are over ceil(42 / 4) = 11 pages
    ref = _decode(model, _prefill(model, ProbabilisticEvictionPress(compression_ratio=0.0), ids), question, T)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)


def _page_setup(seed=0, t=64, d=16, G=2, r=2, n_after=2):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, G, t, d, generator=g) * 1.5, torch.randn(1, G, t, d, generator=g)
    post_k, post_v = torch.randn(1, G, n_after, d, generator=g), torch.randn(1, G, n_after, d, generator=g)
    query = torch.randn(1, G * r, 1, d, generator=g)
    full = _attend("sdpa", _Attn(r), query, torch.cat([keys, post_k], 2), torch.cat([values, post_v], 2), None)
    token_pi = 0.7 * torch.softmax(torch.randn(1, G, t, generator=g), -1) + 0.3 / t  # a mediocre proposal
    return keys, values, post_k, post_v, query, full, token_pi, r


def _page_error(press, keys, values, post_k, post_v, query, full, pi, r, m, seeds=20):
    """Mean |corrected - full| over ``seeds`` draws of ``m`` pages through the press's eviction."""
    err = 0.0
    for seed in range(seeds):
        press._generator = torch.Generator().manual_seed(seed)
        module, cache = _Attn(r), DynamicCache()
        cache.update(keys, values, 0)  # the layer the eviction gives its correction
        k, v = press._evict(module, cache, keys, values, pi, torch.tensor(m))
        (bias,) = attention.take_decode_state(cache, 1)  # the correction the eviction gave the cache
        out = _attend("sdpa", module, query, torch.cat([k, post_k], 2), torch.cat([v, post_v], 2), None, bias)
        err += (out - full).abs().mean().item() / seeds
    return err


def test_corrected_error_shrinks_as_m_grows():
    """Page SNIS error vs full attention, averaged over seeds, falls clearly as the number of page draws grows."""
    keys, values, post_k, post_v, query, full, token_pi, r = _page_setup()
    pi = page_proposal(token_pi, 5)  # 13 pages, the last one of 4 tokens
    press = ProbabilisticEvictionPress(compression_ratio=0.5, budget="head", unit="page", page_size=5)
    errors = [_page_error(press, keys, values, post_k, post_v, query, full, pi, r, m) for m in (2, 16, 128, 1024)]
    assert all(b < 0.8 * a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.2 * errors[0], errors


# ---------------------------------------------------------------------------------- budget
def test_page_budget_worked_example():
    """Worked example (by hand). T = 10 tokens, page_size B = 4: pages {0..3}, {4..7}, {8, 9} (partial).

    Token proposal pi = (.2, .1, .1, .1 | .05, .05, .1, .1 | .1, .1) -> page proposal (.5, .3, .2).
    E[J(m)] = 3 - .5^m - .7^m - .8^m (eq. 24 over pages):
        m:      0     1     2     3      4        5
        E[J]:   0     1.0   1.62  2.02   2.2878   2.473
    Tolerance 0.5 / B = 0.125 pages (the token unit's 0.5 tokens).

    r = 0.6: j* = (1 - 0.6) * 10 / 4 = 1.0 page. The search over [0, 1e12] halves its midpoints 5e11,
    2.5e11 - 1, ..., 13, 6 (all E[J] > 1.125, so high = mid - 1), then mid 2 (E = 1.62 > 1.125: high = 1),
    mid 0 (E = 0 < 0.875: low = 1), mid 1 (E = 1.0, within 0.125): m = 1.

    r = 0.25: j* = 0.75 * 10 / 4 = 1.875 pages. No m is within 0.125 (E(2) = 1.62, E(3) = 2.02); the
    midpoints go 5e11 ... 6 as above, then 2 (E = 1.62 < 1.75: low = 3), then 4 (E = 2.2878 > 2.0:
    high = 3), then 3 (E = 2.02 > 2.0: high = 2); the search ends with low = 3: m = 3, the smallest m
    it could not rule out. Expected kept tokens at m = 3: 4 (1 - .5^3) + 4 (1 - .7^3) + 2 (1 - .8^3)
    = 3.5 + 2.628 + 0.976 = 7.104 (= B E[J] - (4 - 2) P(last page drawn) = 8.08 - 0.976), against
    (1 - r) T = 7.5: the partial last page keeps fewer tokens.
    """
    pi = torch.tensor([0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.1, 0.1, 0.1, 0.1])
    pages = page_proposal(pi, 4)
    assert torch.allclose(pages, torch.tensor([0.5, 0.3, 0.2]))
    by_hand = [0.0, 1.0, 1.62, 2.02, 2.2878, 2.473]
    for m, e in enumerate(by_hand):
        assert expected_unique(pages, m).item() == pytest.approx(e, abs=1e-6)
    assert page_tolerance(4) == 0.125
    assert page_target(10, 0.6, 4) == pytest.approx(1.0)
    assert int(search_num_samples(pages, 0.6, target=page_target(10, 0.6, 4), tol=page_tolerance(4))) == 1
    assert page_target(10, 0.25, 4) == 1.875
    assert int(search_num_samples(pages, 0.25, target=1.875, tol=page_tolerance(4))) == 3
    lengths = torch.tensor([4.0, 4.0, 2.0])
    kept_tokens = (lengths * (1 - (1 - pages.double()) ** 3)).sum().item()
    assert kept_tokens == pytest.approx(7.104, abs=1e-5)
    # the token unit on the same proposal targets 7.5 of 10 tokens: a different m
    assert int(search_num_samples(pi, 0.25)) != 3


@pytest.mark.parametrize("budget", ["head", "global"])
def test_press_searches_pages_with_page_target(tiny_llama, monkeypatch, budget):
    """The press's m meets (1 - r) T / B expected distinct pages (per group, or on the mean over layers and
    groups for the global budget), within the 0.5 / B tolerance or by the smallest m above it."""
    calls = _record_draws(monkeypatch)
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    r, B = 0.5, 4
    press = ProbabilisticEvictionPress(compression_ratio=r, proposal="min_h", budget=budget, unit="page", page_size=B)
    _prefill(model, press, _prompt(24, T))
    target, tol = (1 - r) * T / B, 0.5 / B
    assert all(pi.shape[-1] == 11 for pi, _, _ in calls)
    if budget == "global":
        assert all(torch.equal(c[1], calls[0][1]) for c in calls) and calls[0][1].unique().numel() == 1
        pis, m = torch.stack([pi for pi, _, _ in calls], 1), calls[0][1][:, :1].view(1, 1, 1)  # (1, L, G, 11)
        rows = [(expected_unique(pis, m).mean(), expected_unique(pis, m - 1).mean())]
    else:
        rows = [
            (e, e_less)
            for pi, m, _ in calls
            for e, e_less in zip(expected_unique(pi, m).flatten(), expected_unique(pi, m - 1).flatten())
        ]
    for e, e_less in rows:  # a hit of Algorithm 2, or the smallest m above the band
        assert abs(e - target) <= tol or (e > target + tol and e_less < target - tol), (e, e_less, target)


# ---------------------------------------------------------------------------------- storage, padding, bias
def test_drawn_pages_are_kept_whole_with_one_bias_per_page(tiny_llama, monkeypatch):
    """Every token of a drawn page is kept (the cache holds exactly those keys, in order), each gets its page's
    bias (log c_p - log m - log pi_p) / tau, and padded slots get -inf."""
    calls = _record_draws(monkeypatch)
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, B, tau = _prompt(25, T), 4, 2.0
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
    press = ProbabilisticEvictionPress(
        compression_ratio=0.6,
        proposal="min",
        budget="head",
        unit="page",
        page_size=B,
        tau=tau,
        proposal_temperature=0.3,
        seed=3,
    )
    cache = _prefill(model, press, ids)
    assert len(calls) == 2
    n_pages_kept = []
    for layer, (pi, m, counts) in zip(model.model.layers, calls):
        idx = layer.self_attn.layer_idx
        bias = decode_biases(cache)[idx][0]  # (G, P)
        for g in range(bias.shape[0]):
            drawn = (counts[0, g] > 0).nonzero().flatten().tolist()
            positions = [i for p in drawn for i in range(p * B, min((p + 1) * B, T))]
            n = len(positions)
            assert torch.isfinite(bias[g, :n]).all() and torch.isinf(bias[g, n:]).all() and (bias[g, n:] < 0).all()
            assert torch.equal(cache.layers[idx].keys[0, g, :n], full.layers[idx].keys[0, g, positions])
            want = [
                (math.log(counts[0, g, i // B].item()) - math.log(m[0, g].item()) - math.log(pi[0, g, i // B].item()))
                / tau
                for i in positions
            ]
            assert torch.allclose(bias[g, :n].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
            n_pages_kept.append(len(drawn))
    s = press.summary()
    assert s["unit"] == "page" and s["page_size"] == B and s["num_pages"] == 11
    assert s["kept_pages_mean"] == pytest.approx(sum(n_pages_kept) / len(n_pages_kept))
    assert len(s["kept_pages_per_layer"].split(",")) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_gets_zero_attention_and_pages_share_weights(tiny_llama, dtype):
    """Padded slots get exactly zero attention (eager weights), logits stay finite, rows still sum to 1,
    and the kept tokens of one page share one bias."""
    model = tiny_llama(num_layers=2, attn_implementation="eager", dtype=dtype)
    for seed in range(10):  # a sharp proposal and per-group m: find a draw where groups keep different counts
        press = ProbabilisticEvictionPress(
            compression_ratio=0.6,
            proposal="min",
            budget="head",
            seed=seed,
            proposal_temperature=0.1,
            unit="page",
            page_size=4,
        )
        cache = _prefill(model, press, _prompt(26, T))
        biases = decode_biases(cache)
        pads = [~torch.isfinite(b) for b in biases]
        if any(p.any() for p in pads):
            break
    assert any(p.any() for p in pads), "the test needs padding: groups with different kept counts"
    for bias in biases:  # kept counts are whole pages (plus possibly the 2-token last page)
        kept = torch.isfinite(bias).sum(-1)
        assert bool(((kept % 4 == 0) | (kept % 4 == 2)).all())
    with torch.no_grad():
        out = model(
            input_ids=_prompt(27, 3),
            past_key_values=cache,
            position_ids=torch.arange(T, T + 3)[None],
            output_attentions=True,
        )
    assert torch.isfinite(out.logits).all()
    for pad, attn in zip(pads, out.attentions):  # attn (B, H_Q, q, K)
        P = pad.shape[-1]
        head_pad = pad.repeat_interleave(2, dim=1).unsqueeze(2).expand(-1, -1, 3, -1)
        assert (attn[..., :P][head_pad] == 0).all()
        assert torch.allclose(attn.float().sum(-1), torch.ones(attn.shape[:-1]), atol=1e-2)


def test_snis_bias_of_expanded_pages_is_per_page():
    """expand_pages + snis_bias: one value per page, equal to the page's log weight; undrawn pages -inf."""
    counts = torch.tensor([[3, 0, 1]])
    pi = torch.tensor([[0.5, 0.3, 0.2]])
    b = snis_bias(expand_pages(counts, 4, 10), 4, expand_pages(pi, 4, 10), tau=1.0)
    assert b.shape == (1, 10)
    assert torch.allclose(b[0, :4], torch.full((4,), math.log(3 / (4 * 0.5))))
    assert torch.isinf(b[0, 4:8]).all()
    assert torch.allclose(b[0, 8:], torch.full((2,), math.log(1 / (4 * 0.2))))


# ---------------------------------------------------------------------------------- helpers and errors
def test_page_helpers():
    pi = torch.softmax(torch.randn(2, 3, 37, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(page_proposal(pi, 1), pi)
    pages = page_proposal(pi, 8)
    assert pages.shape == (2, 3, 5)
    assert torch.allclose(pages[..., -1], pi[..., 32:].sum(-1)) and torch.allclose(pages.sum(-1), torch.ones(2, 3))
    x = torch.arange(5).view(1, 5)
    assert expand_pages(x, 8, 37).tolist() == [[i // 8 for i in range(37)]]
    assert expand_pages(x, 1, 5) is x
    assert page_target(2050, 0.75, 1) == (1 - 0.75) * 2050
    assert page_target(2050, 0.75, 16) == pytest.approx(512.5 / 16)


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="unit='block'"):
        ProbabilisticEvictionPress(unit="block")
    with pytest.raises(ValueError, match="page_size=0"):
        ProbabilisticEvictionPress(unit="page", page_size=0)
    with pytest.raises(ValueError, match="page_size=0"):
        page_proposal(torch.ones(4) / 4, 0)
    with pytest.raises(ValueError, match="compression_ratio=1.0"):
        page_target(10, 1.0, 4)
    with pytest.raises(ValueError, match="seq_len=-1"):
        page_target(-1, 0.5, 4)
    with pytest.raises(ValueError, match="tol_tokens=-1"):
        page_tolerance(4, -1)
    with pytest.raises(ValueError, match="expected ceil"):
        expand_pages(torch.ones(1, 4), 4, 10)


def test_config_instantiates_page_unit():
    """configs/press/snis_min_page.yaml and snis_min_h_page.yaml build the page unit with 16-token pages."""
    from hydra.utils import instantiate

    from evaluation import harness

    for name, correction in (
        ("snis_min_page", True),
        ("snis_min_h_page", True),
        ("snis_min_h_page_uncorrected", False),
        ("snis_h2o_page", True),
        ("snis_h2o_h_page", True),
    ):
        press = instantiate(harness.compose_config([f"press={name}", "compression_ratio=0.5", "seed=1"]).press)
        assert (press.unit, press.page_size, press.correction) == ("page", 16, correction)


@pytest.mark.parametrize("budget", ["head", "global"])
def test_batch_and_extreme_ratios(tiny_llama, budget):
    """A batch of 2 rows, padded to the layer's largest kept count; at 0.99 at least one page (>= 1 draw) is
    kept per group; at 0 the cache is unchanged."""
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids = _prompt(28, T, batch=2)
    press = ProbabilisticEvictionPress(compression_ratio=0.99, proposal="h2o", budget=budget, unit="page", page_size=4)
    cache = _prefill(model, press, ids)
    for layer in model.model.layers:
        bias = decode_biases(cache)[layer.self_attn.layer_idx]  # (2, G, P)
        kept = torch.isfinite(bias).sum(-1)
        assert bias.shape[0] == 2 and bool((kept >= 2).all())  # one page: 4 tokens, or the 2-token last page
        assert cache.layers[layer.self_attn.layer_idx].keys.shape[2] == bias.shape[-1] == int(kept.max())
    press = ProbabilisticEvictionPress(compression_ratio=0.0, unit="page", page_size=4)
    assert all(layer.keys.shape[2] == T for layer in _prefill(model, press, ids).layers)
