"""Any kvpress ``ScorerPress`` as the proposal of probabilistic eviction (issue 15 item 2; paper 003 appendix D;
docs/methods.md §3 item 1).

Tiny random-weight Llamas for the mechanics (per-group proposals, the budget's expected count, the correction, the
named adapters as instances of the one path, errors, capabilities, Hydra, the shared-prefill replay); the embedded
model for kvpress's pipeline end to end (``slow``).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import decode_biases
from hydra.utils import instantiate
from kvpress import (
    CriticalKVPress,
    ExpectedAttentionPress,
    KnormPress,
    ObservedAttentionPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from test_harness import composed
from transformers import DynamicCache

import presses.probabilistic.press as snis_press
from evaluation import replay
from evaluation.memo import ReplayMemo
from evaluation.registry import capabilities, press_input_problem
from presses import attention
from presses.core.coupon import expected_unique
from presses.probabilistic import ProbabilisticEvictionPress, proposals
from presses.probabilistic.proposals import compute_proposal

pytestmark = pytest.mark.usefixtures("one_thread")

T = 48  # prompt length of the model-level tests


def scorers():
    """Fresh kvpress scorers (window and sink sizes fitted to the tiny prompts); ObservedAttention needs eager."""
    return {
        "snapkv": SnapKVPress(window_size=8, kernel_size=3),
        "tova": TOVAPress(),
        "knorm": KnormPress(),
        "expected_attention": ExpectedAttentionPress(n_future_positions=16),
        "streaming_llm": StreamingLLMPress(compression_ratio=0.5, n_sink=2),
        "observed_attention": ObservedAttentionPress(),
    }


NAMES = list(scorers())
NON_NEGATIVE = {"snapkv", "tova", "expected_attention", "streaming_llm", "observed_attention"}  # "sum" applies


@pytest.fixture(scope="module")
def captured():
    """Layer-0 inputs of a tiny eager GQA Llama (H_Q=6, G=2, batch 2) with its attention weights."""
    from conftest import capture_layer0

    return capture_layer0(31)


def _model(tiny_llama, name, layers=2):
    return tiny_llama(num_layers=layers, attn_implementation="eager" if name == "observed_attention" else "sdpa")


def _prompt(seed=0, length=T):
    return torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(seed))


def _prefill(model, press, ids):
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def _decode(model, cache, ids, start):
    """Question forward (multi-token) then one greedy decode step; returns both logits."""
    with torch.no_grad():
        pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
        out = model(input_ids=ids, past_key_values=cache, position_ids=pos)
        nxt = out.logits[:, -1:].argmax(-1)
        out2 = model(input_ids=nxt, past_key_values=cache, position_ids=pos[:, -1:] + 1)
    return out.logits, out2.logits


def _record_draws(monkeypatch):
    """Record every ``(pi, m)`` the press draws from (real draws still happen)."""
    draws = []
    real = snis_press.sample_counts
    monkeypatch.setattr(
        snis_press,
        "sample_counts",
        lambda pi, m, generator=None: draws.append((pi.clone(), m.clone())) or real(pi, m, generator),
    )
    return draws


# ---------------------------------------------------------------------------------- the proposal itself
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("normalization", ["softmax", "sum"])
def test_scorer_proposal_is_the_normalised_score_per_group(captured, name, normalization):
    """pi = softmax(s / T) or s^(1/T) / sum s^(1/T) over the entries, one distribution per KV group (batch row x KV
    head), from the scorer's own score()."""
    if normalization == "sum" and name not in NON_NEGATIVE:
        pytest.skip("K-norm's scores are negative (see test_sum_of_negative_scores_names_the_scorer)")
    module, hs, keys, values, attn, kwargs = captured
    scorer = scorers()[name]
    scores = scorer.score(module, hs, keys, values, attn, kwargs).float()
    assert scores.shape == keys.shape[:3]  # per KV head
    pi = compute_proposal(
        scorer, module, hs, keys, values, attn, kwargs, temperature=0.7, score_normalization=normalization
    )
    assert pi.shape == (2, 2, keys.shape[2]) and pi.dtype == torch.float32
    assert torch.allclose(pi.sum(-1), torch.ones(2, 2), atol=1e-5)
    assert bool((pi >= 0).all())
    if normalization == "softmax":
        expected = torch.softmax(scores / 0.7, -1)
    else:
        powered = scores.pow(1 / 0.7)
        expected = powered / powered.sum(-1, keepdim=True)
    assert torch.allclose(pi, expected, atol=1e-6)
    mixed = compute_proposal(
        scorer,
        module,
        hs,
        keys,
        values,
        attn,
        kwargs,
        temperature=0.7,
        uniform_mix=0.2,
        score_normalization=normalization,
    )
    assert torch.allclose(mixed, 0.8 * pi + 0.2 / keys.shape[2], atol=1e-6)  # appendix D.1


@pytest.mark.parametrize("name,kwargs", [("snapkv", {"window_size": 8, "kernel_size": 3}), ("tova", {}), ("knorm", {})])
@pytest.mark.parametrize("normalization", ["softmax", "sum"])
def test_named_adapters_are_the_instance_path_bit_for_bit(captured, name, kwargs, normalization):
    """The names snapkv, tova and knorm stand for SnapKVPress(window_size, kernel_size), TOVAPress(), KnormPress()
    through the one scorer path: equal proposals."""
    module, hs, keys, values, attn, kw = captured
    instance = {"snapkv": SnapKVPress(**kwargs), "tova": TOVAPress(), "knorm": KnormPress()}[name]
    if normalization == "sum" and name == "knorm":
        pytest.skip("negative scores")
    for attentions in (attn, None):  # SnapKV and TOVA read the weights when the attention returns them
        by_name = compute_proposal(
            name, module, hs, keys, values, attentions, kw, temperature=0.5, score_normalization=normalization, **kwargs
        )
        by_instance = compute_proposal(
            instance, module, hs, keys, values, attentions, kw, temperature=0.5, score_normalization=normalization
        )
        assert torch.equal(by_name, by_instance)
    press = ProbabilisticEvictionPress(proposal=name, **kwargs)
    assert type(press.scorer) is type(instance) and press.scorer == instance


@pytest.mark.parametrize("budget", ["global", "head"])
@pytest.mark.parametrize("name", ["snapkv", "tova", "knorm"])
def test_named_adapter_press_equals_instance_press_bit_for_bit(tiny_llama, name, budget):
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, question = _prompt(1), _prompt(2, 5)
    instance = {"snapkv": SnapKVPress(window_size=8, kernel_size=3), "tova": TOVAPress(), "knorm": KnormPress()}[name]
    common = dict(compression_ratio=0.6, budget=budget, seed=4, proposal_temperature=0.3)
    results = []
    for proposal in (name, instance):
        press = ProbabilisticEvictionPress(proposal=proposal, window_size=8, kernel_size=3, **common)
        cache = _prefill(model, press, ids)
        biases = [b.clone() for b in decode_biases(cache)]
        keys = [layer.keys.clone() for layer in cache.layers]
        results.append((keys, biases, _decode(model, cache, question, T)))
    (k_a, b_a, out_a), (k_b, b_b, out_b) = results
    assert all(torch.equal(a, b) for a, b in zip(k_a, k_b)) and all(torch.equal(a, b) for a, b in zip(b_a, b_b))
    assert all(torch.equal(a, b) for a, b in zip(out_a, out_b))
    assert k_a[0].shape[2] < T


# ---------------------------------------------------------------------------------- budget and correction
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", ["global", "head"])
def test_expected_count_meets_its_target(tiny_llama, monkeypatch, name, budget):
    """The number of draws m puts the expected kept count E[J(m)] = sum_i 1 - (1 - pi_i)^m at (1 - r) T (within
    Algorithm 2's tolerance 0.5): its mean over every group of every layer (global budget), or per group (head)."""
    draws = _record_draws(monkeypatch)
    model = _model(tiny_llama, name)
    r = 0.6
    press = ProbabilisticEvictionPress(compression_ratio=r, proposal=scorers()[name], budget=budget, uniform_mix=0.01)
    _prefill(model, press, _prompt(3))
    assert len(draws) == 2  # one draw per layer
    counts = torch.stack([expected_unique(pi.double(), m.expand(pi.shape[:-1]).double()) for pi, m in draws])
    for pi, _ in draws:
        assert pi.shape == (1, 2, T) and torch.allclose(pi.sum(-1), torch.ones(1, 2, dtype=pi.dtype), atol=1e-5)
    if budget == "global":
        assert all(torch.equal(m, draws[0][1]) for _, m in draws) and draws[0][1].unique().numel() == 1
        assert abs(counts.mean().item() - (1 - r) * T) <= 0.5 + 1e-6
    else:
        assert (counts - (1 - r) * T).abs().max().item() <= 0.5 + 1e-6
    assert press.summary()["proposal"] == type(scorers()[name]).__name__


@pytest.mark.parametrize("name", NAMES)
def test_correction_at_expected_counts_recovers_full_attention(tiny_llama, monkeypatch, name):
    """docs/methods.md §3 item 6: with counts at their expectation c_i = m pi_i the SNIS correction restores the
    uncompressed model exactly, whatever the scorer (full support through the softmax)."""
    monkeypatch.setattr(snis_press, "sample_counts", lambda pi, m, generator=None: m.unsqueeze(-1) * pi.double())
    model = _model(tiny_llama, name)
    ids, question = _prompt(4), _prompt(5, 5)
    press = ProbabilisticEvictionPress(compression_ratio=0.6, proposal=scorers()[name])
    got = _decode(model, _prefill(model, press, ids), question, T)
    ref = _decode(model, _prefill(model, ProbabilisticEvictionPress(compression_ratio=0.0), ids), question, T)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)


def test_global_budget_kept_count_hits_target_on_average(tiny_llama):
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, r = _prompt(6, 64), 0.5
    kept = []
    for seed in range(8):
        press = ProbabilisticEvictionPress(
            compression_ratio=r,
            proposal=ExpectedAttentionPress(n_future_positions=16),
            score_normalization="sum",
            seed=seed,
        )
        _prefill(model, press, ids)
        kept.append((1 - press.summary()["logical_compression"]) * 64)
    kept = torch.tensor(kept)
    assert abs(kept.mean().item() - (1 - r) * 64) <= 0.5 + 4 * kept.std().item() / math.sqrt(len(kept))


# ---------------------------------------------------------------------------------- errors
class _Wrapper(ScorerPress):
    """A ScorerPress that holds another press (as CriticalKVPress does)."""

    def __init__(self, press):
        self.press = press
        self.compression_ratio = 0.0

    def score(self, *args):
        return self.press.score(*args)


@pytest.mark.parametrize(
    "bad,match",
    [
        ("bogus", "proposal='bogus'"),
        (object(), "proposal=<object object"),
        (KnormPress, "proposal=<class 'kvpress.presses.knorm_press.KnormPress'>"),
        (ProbabilisticEvictionPress(), r"proposal=ProbabilisticEvictionPress\(.*ScorerPress instance"),
        (CriticalKVPress(KnormPress()), r"proposal=.*CriticalKVPress.* wraps another press \(field 'press'\)"),
        (_Wrapper(TOVAPress()), r"_Wrapper.* wraps another press .*TOVAPress"),
    ],
)
def test_bad_proposals_raise_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        ProbabilisticEvictionPress(compression_ratio=0.5, proposal=bad)


def test_sum_of_negative_scores_names_the_scorer(captured):
    module, hs, keys, values, attn, kwargs = captured
    with pytest.raises(ValueError, match=r"proposal=KnormPress\(.*normalization='sum' needs non-negative"):
        compute_proposal(KnormPress(), module, hs, keys, values, attn, kwargs, score_normalization="sum")
    with pytest.raises(ValueError, match="score_normalization='l1'"):
        ProbabilisticEvictionPress(proposal=KnormPress(), score_normalization="l1")


def test_scorer_input_limits_raise_naming_the_scorer(tiny_llama, captured):
    module, hs, keys, values, attn, kwargs = captured
    with pytest.raises(ValueError, match=r"proposal=SnapKVPress\(.*window_size=64.*cannot score this layer"):
        compute_proposal(SnapKVPress(), module, hs, keys, values, None, kwargs)
    model = tiny_llama(num_layers=1, attn_implementation="sdpa")
    for proposal, where in ((SnapKVPress(), "press.proposal.window_size"), ("snapkv", "press.window_size")):
        problem = press_input_problem(ProbabilisticEvictionPress(0.5, proposal=proposal), model, 40)
        assert "ProbabilisticEvictionPress(proposal=SnapKVPress)" in problem and where in problem
    assert press_input_problem(ProbabilisticEvictionPress(0.5, proposal=SnapKVPress()), model, 65) is None
    assert "n_sink=4" in press_input_problem(
        ProbabilisticEvictionPress(0.5, proposal=ExpectedAttentionPress()), model, 4
    )
    assert press_input_problem(ProbabilisticEvictionPress(0.5, proposal="h2o"), model, 2) is None


def test_attention_weight_scorer_needs_eager(tiny_llama, captured):
    model = tiny_llama(num_layers=1, attn_implementation="sdpa")
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal=ObservedAttentionPress())
    with pytest.raises(ValueError, match=r"proposal=ObservedAttentionPress\(.*attn_implementation='eager'"):
        with press(model):
            pass
    module, hs, keys, values, _, kwargs = captured
    with pytest.raises(ValueError, match=r"ObservedAttentionPress.*attention weights"):
        compute_proposal(ObservedAttentionPress(), module, hs, keys, values, None, kwargs)


# ---------------------------------------------------------------------------------- the press contract
@pytest.mark.parametrize("name", NAMES)
def test_capabilities_follow_the_scorer_as_the_registry_states_it(name):
    """A scorer that reads attention weights makes the press need eager attention, as the registry says of that
    scorer alone, and stop sharing a prefill (the scorer alone replays from an eager capture; the press with it is
    not tested to); every other scorer leaves the press's own capabilities."""
    scorer = scorers()[name]
    caps = capabilities(ProbabilisticEvictionPress(0.5, proposal=scorer))
    assert caps.decode_state and caps.needs_eager == capabilities(scorer).needs_eager
    assert capabilities(scorer).shares_prefill
    assert caps.shares_prefill == (name != "observed_attention")
    if caps.needs_eager:
        with pytest.raises(ValueError, match="cannot share a prefill"):
            replay.check_shareable(ProbabilisticEvictionPress(0.5, proposal=scorer), "snis_observed")


def test_scorer_setup_runs_and_no_fused_statistics_are_requested(tiny_llama):
    """The scorer's own post_init_from_model runs (kvpress scorers that load weights do it there), and the prefill's
    attention is not asked for the attention proposals' statistics."""
    seen = []

    class Recording(KnormPress):
        def post_init_from_model(self, model):
            seen.append(model)

    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    requests = []

    def compress_spy(module, *args):
        found = attention.requests_of(args[-1]["past_key_values"])  # the prefill's cache, from the hook's kwargs
        requests.append(None if found is None else found.prefill)
        return real(module, *args)

    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal=Recording())
    real = press.compress
    press.compress = compress_spy
    _prefill(model, press, _prompt(7))
    assert seen == [model] and requests == [None, None]


@pytest.mark.parametrize("name", ["expected_attention", "snapkv", "tova"])
def test_replay_of_one_prefill_is_exact(tiny_llama, name):
    """shares_prefill holds: replaying the press's hooks on a recorded uncompressed prefill (evaluation.fused) gives
    the direct prefill's cache and correction bit for bit (a scorer proposal has no fused prefill statistics)."""
    model = tiny_llama(num_layers=3, attn_implementation="sdpa")
    press = ProbabilisticEvictionPress(compression_ratio=0.6, proposal=scorers()[name], seed=2)
    ids = _prompt(8, 96)
    with torch.inference_mode():
        direct = DynamicCache()
        with press(model):
            model.model(input_ids=ids, past_key_values=direct)
        direct_bias = [b.clone() for b in decode_biases(direct)]
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        replayed = replay.replay_prefill(model, press, capture)
    for i in range(3):
        assert replayed.layers[i].keys.shape[2] < 96
        assert torch.equal(replayed.layers[i].keys, direct.layers[i].keys)
        assert torch.equal(replayed.layers[i].values, direct.layers[i].values)
        assert torch.equal(decode_biases(replayed)[i], direct_bias[i])


def test_shared_proposals_share_equal_scorers_only(captured, monkeypatch):
    module, hs, keys, values, attn, kwargs = captured
    calls = []
    real = proposals.scorer_scores
    monkeypatch.setattr(
        proposals, "scorer_scores", lambda s, *a, **k: calls.append(type(s).__name__) or real(s, *a, **k)
    )
    memo = ReplayMemo()
    a = compute_proposal(ExpectedAttentionPress(), module, hs, keys, values, attn, kwargs, memo=memo)
    b = compute_proposal(ExpectedAttentionPress(), module, hs, keys, values, attn, kwargs, memo=memo)  # equal: shared
    c = compute_proposal(ExpectedAttentionPress(n_sink=2), module, hs, keys, values, attn, kwargs, memo=memo)
    d = compute_proposal("tova", module, hs, keys, values, attn, kwargs, memo=memo)
    e = compute_proposal(TOVAPress(), module, hs, keys, values, attn, kwargs, memo=memo)  # the name's scorer: shared
    assert calls == ["ExpectedAttentionPress", "ExpectedAttentionPress", "TOVAPress"]
    assert a is b and not torch.equal(a, c) and d is e


# ---------------------------------------------------------------------------------- Hydra
def test_hydra_config_with_a_nested_scorer_target():
    cfg = composed("press=snis_expected_attention", "compression_ratio=0.5")
    assert cfg.press.proposal._target_ == "kvpress.ExpectedAttentionPress"
    press = instantiate(cfg.press)
    assert isinstance(press, ProbabilisticEvictionPress) and press.compression_ratio == 0.5
    assert type(press.proposal) is ExpectedAttentionPress and press.score_normalization == "sum"
    cfg = composed(
        "press=snis_expected_attention",
        "compression_ratio=0.25",
        "press.proposal._target_=kvpress.SnapKVPress",
        "+press.proposal.window_size=16",
        "++press.score_normalization=softmax",
    )
    press = instantiate(cfg.press)
    assert press.proposal == SnapKVPress(window_size=16) and press.score_normalization == "softmax"
    press = instantiate(composed("press=snis_h2o", "++press.proposal=tova").press)
    assert press.proposal == "tova" and press.scorer == TOVAPress()


def test_harness_runs_the_config_and_the_shared_prefill_sweep_equals_it(tmp_path, monkeypatch):
    """``python -m evaluation.run press=snis_expected_attention`` through the harness (the nested config saved and
    resumed), and the shared-prefill sweep gives the same rows (its capability ``shares_prefill`` is true)."""
    from _tiny_tokenizer import char_tokenizer
    from conftest import make_sharp_tiny_llama
    from test_fused import _rows, _runs

    from evaluation import fused, harness
    from evaluation import run as entry

    model = make_sharp_tiny_llama()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, char_tokenizer()))
    presses = ["no_press", "snis_expected_attention"]
    for cfg, names in _runs(presses, [0.5], tmp_path / "separate"):
        entry.run(cfg, names)
    saved = (tmp_path / "separate/needle/smollm2-135m/snis_expected_attention/cr0.5/config.yaml").read_text()
    assert "_target_: kvpress.ExpectedAttentionPress" in saved
    for cfg, names in _runs(presses, [0.5], tmp_path / "separate"):  # finished: resumes without complaint
        entry.run(cfg, names)
    fused.run_fused(_runs(presses, [0.5], tmp_path / "fused"), "test")
    sep, fus = _rows(tmp_path / "separate", presses[1], 0.5), _rows(tmp_path / "fused", presses[1], 0.5)
    assert sorted(sep) == sorted(fus) and len(sep) == 2
    for i in sep:
        assert fus[i]["prediction"] == sep[i]["prediction"] and fus[i]["press_stats"] == sep[i]["press_stats"]
        assert fus[i]["press_stats"]["proposal"] == "ExpectedAttentionPress"
        assert fus[i]["effective_compression"] > 0.3


# ---------------------------------------------------------------------------------- the embedded model
@pytest.mark.slow
def test_expected_attention_proposal_through_kvpress_pipeline(embedded_model):
    """Issue 15's acceptance: ProbabilisticEvictionPress(compression_ratio=0.5, proposal=ExpectedAttentionPress())
    compresses through kvpress's pipeline on the embedded model."""
    from kvpress import KVPressTextGenerationPipeline

    model, tokenizer = embedded_model
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    context = (
        "The quick brown fox jumps over the lazy dog. " * 30
        + "The secret word is pineapple. "
        + "The quick brown fox jumps over the lazy dog. " * 10
    )
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal=ExpectedAttentionPress())
    cache = DynamicCache()
    answer = pipe(context, question="What is the secret word?", press=press, max_new_tokens=6, cache=cache)["answer"]
    stats = press.summary()
    T_ctx = stats["context_length"]
    assert isinstance(answer, str) and answer.strip()
    assert stats["proposal"] == "ExpectedAttentionPress" and stats["num_layers_evicted"] == len(model.model.layers)
    assert abs(stats["logical_compression"] - 0.5) < 0.1  # the target holds on average over groups and layers
    assert cache.layers[0].keys.shape[2] < T_ctx  # the cache did shrink (padded to the layer's largest kept count)
    assert all(not layer.self_attn._forward_hooks for layer in model.model.layers)
