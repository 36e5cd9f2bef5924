"""Probabilistic eviction press with SNIS decode-time correction (paper 003; docs/methods.md §3 items 2-6)."""

import math

import pytest
import torch
from conftest import decode_biases
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import presses.attention_bias as snis_attention
import presses.probabilistic.press as snis_press
from presses import attention
from presses.attention_bias import AttentionBias
from presses.probabilistic.budget import sample_counts
from presses.probabilistic.correction import snis_bias
from presses.probabilistic.press import ProbabilisticEvictionPress

T = 40  # prompt length of the model-level tests


class _Attn(torch.nn.Module):
    """Minimal attention module for calling the wrapped attention functions directly."""

    def __init__(self, r):
        super().__init__()
        self.num_key_value_groups = r
        self.layer_idx = 0
        self.is_causal = True
        self.eval()


def _attend(impl, module, q, k, v, mask, bias: AttentionBias | None = None):
    """The installed attention function on ``k``, ``v`` held by layer 0 of a cache that carries ``bias``."""
    attention.install()
    cache = DynamicCache()
    k, v = cache.update(k, v, 0)  # a decode-time bias belongs to the cache that holds these keys
    attention.set_decode_bias(cache, 0, bias)
    out, _ = ALL_ATTENTION_FUNCTIONS[impl](module, q, k, v, mask, dropout=0.0, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)  # (B, H, q, d)


def _prompt(seed=0, length=T, batch=1):
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(seed))


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


# ---------------------------------------------------------------------------------- Algorithm 1
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("tau,correction", [(1.0, True), (2.0, True), (1.0, False)])
def test_bias_softmax_equals_algorithm_1(impl, tau, correction):
    """Softmax with the additive bias == Algorithm 1 (eq. 10 weights), incl. padding and a causal question."""
    g = torch.Generator().manual_seed(0)
    B, G, r, d, t, n_after, q_len, m = 1, 2, 2, 8, 12, 3, 2, 20
    pi = torch.softmax(torch.randn(B, G, t, generator=g), -1)
    counts = sample_counts(pi, m, g)
    kept = counts > 0
    P = int(kept.sum(-1).max())
    order = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :P]
    valid = torch.arange(P) < kept.sum(-1, keepdim=True)
    keys_full = torch.randn(B, G, t, d, generator=g)
    vals_full = torch.randn(B, G, t, d, generator=g)
    post_k, post_v = torch.randn(B, G, n_after, d, generator=g), torch.randn(B, G, n_after, d, generator=g)
    idx = order.unsqueeze(-1).expand(-1, -1, -1, d)
    key = torch.cat([keys_full.gather(2, idx), post_k], 2)
    value = torch.cat([vals_full.gather(2, idx), post_v], 2)
    bias = snis_bias(counts, m, pi, tau, correction).gather(-1, order).masked_fill(~valid, float("-inf"))
    module = _Attn(r)
    query = torch.randn(B, G * r, q_len, d, generator=g)
    # the model's own boolean causal mask, built for ANOTHER layer's (wider) prefix: only its tail is ours
    wide = 30 + n_after
    model_mask = torch.arange(wide).view(1, wide) <= torch.arange(wide - q_len, wide).view(q_len, 1)
    out = _attend(impl, module, query, key, value, model_mask.view(1, 1, q_len, wide), AttentionBias(bias))

    expected = torch.zeros(B, G * r, q_len, d, dtype=torch.float64)
    for h in range(G * r):
        grp = h // r
        for u in range(q_len):
            qv = query[0, h, u].double()
            num, den = torch.zeros(d, dtype=torch.float64), 0.0
            for i in range(t):  # eviction-time entries: importance weights on the kept ones
                c = counts[0, grp, i].item()
                if c == 0:
                    continue
                w = (c / (m * pi[0, grp, i].item())) ** (1.0 / tau) if correction else 1.0
                p = math.exp(qv @ keys_full[0, grp, i].double() / math.sqrt(d))
                num += w * p * vals_full[0, grp, i].double()
                den += w * p
            for j in range(n_after - q_len + u + 1):  # decode-time entries, causal
                p = math.exp(qv @ post_k[0, grp, j].double() / math.sqrt(d))
                num += p * post_v[0, grp, j].double()
                den += p
            expected[0, h, u] = num / den
    assert torch.allclose(out.double(), expected, atol=1e-5)


def test_bias_values_and_errors():
    counts = torch.tensor([[3, 0, 1]])
    pi = torch.tensor([[0.5, 0.3, 0.2]])
    b = snis_bias(counts, 4, pi, tau=2.0)
    assert b[0, 0].item() == pytest.approx(math.log(3 / (4 * 0.5)) / 2, abs=1e-6)
    assert b[0, 1].item() == float("-inf")
    assert b[0, 2].item() == pytest.approx(math.log(1 / (4 * 0.2)) / 2, abs=1e-6)
    assert torch.equal(snis_bias(counts, 4, pi, tau=float("inf")), snis_bias(counts, 4, pi, correction=False))
    with pytest.raises(ValueError, match="tau=0"):
        snis_bias(counts, 4, pi, tau=0)
    with pytest.raises(ValueError, match="pi_i <= 0"):
        snis_bias(counts, 4, torch.tensor([[0.5, 0.5, 0.0]]))


# ---------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("budget", ["head", "global"])
def test_counts_at_expectation_give_full_attention(tiny_llama, monkeypatch, budget):
    """docs/methods.md §3 item 6: with c_i = m pi_i the corrected decode equals the uncompressed model."""
    monkeypatch.setattr(snis_press, "sample_counts", lambda pi, m, generator=None: m.unsqueeze(-1) * pi.double())
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, question = _prompt(0), _prompt(1, 5)
    press = ProbabilisticEvictionPress(compression_ratio=0.6, proposal="h2o_h", budget=budget, uniform_mix=0.05)
    got = _decode(model, _prefill(model, press, ids), question, T)
    ref = _decode(model, _prefill(model, ProbabilisticEvictionPress(compression_ratio=0.0), ids), question, T)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)


def test_corrected_error_shrinks_as_m_grows():
    """SNIS error vs full attention, averaged over seeds, falls clearly as the number of draws grows."""
    g = torch.Generator().manual_seed(0)
    B, G, r, d, t, n_after = 1, 2, 2, 16, 64, 2
    keys, values = torch.randn(B, G, t, d, generator=g) * 1.5, torch.randn(B, G, t, d, generator=g)
    post_k, post_v = torch.randn(B, G, n_after, d, generator=g), torch.randn(B, G, n_after, d, generator=g)
    query = torch.randn(B, G * r, 1, d, generator=g)
    full = _attend("sdpa", _Attn(r), query, torch.cat([keys, post_k], 2), torch.cat([values, post_v], 2), None)
    pi = 0.7 * torch.softmax(torch.randn(B, G, t, generator=g), -1) + 0.3 / t  # a mediocre proposal
    press = ProbabilisticEvictionPress(compression_ratio=0.5, budget="head")
    errors = []
    for m in (4, 32, 256, 2048):
        err = 0.0
        for seed in range(20):
            press._generator = torch.Generator().manual_seed(seed)
            module, cache = _Attn(r), DynamicCache()
            cache.update(keys, values, 0)  # the layer the eviction gives its correction
            k, v = press._evict(module, cache, keys, values, pi, torch.tensor(m))
            (bias,) = attention.take_decode_state(cache, 1)  # the correction the eviction gave the cache
            out = _attend("sdpa", module, query, torch.cat([k, post_k], 2), torch.cat([v, post_v], 2), None, bias)
            err += (out - full).abs().mean().item() / 20
        errors.append(err)
    assert all(b < 0.8 * a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.2 * errors[0], errors


def test_tau_inf_equals_uncorrected_and_correction_changes_output(tiny_llama):
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, question = _prompt(2), _prompt(3, 4)
    outs = {}
    for key, kw in {"cor": {}, "unc": {"correction": False}, "inf": {"tau": float("inf")}}.items():
        press = ProbabilisticEvictionPress(compression_ratio=0.7, proposal="h2o", budget="head", seed=3, **kw)
        outs[key] = _decode(model, _prefill(model, press, ids), question, T)[0]
    assert torch.equal(outs["unc"], outs["inf"])
    assert not torch.allclose(outs["cor"], outs["unc"], atol=1e-4)


# ---------------------------------------------------------------------------------- storage and masks
@pytest.mark.parametrize("budget", ["head", "global"])
def test_physical_length_is_largest_kept_count(tiny_llama, budget):
    model = tiny_llama(num_layers=3, attn_implementation="sdpa")
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="min_h", budget=budget, seed=1)
    cache = _prefill(model, press, _prompt(4, batch=2))
    kept_all, padded_all = [], []
    for layer in model.model.layers:
        bias = decode_biases(cache)[layer.self_attn.layer_idx]  # (B, G, P)
        kept = torch.isfinite(bias).sum(-1)
        P = cache.layers[layer.self_attn.layer_idx].keys.shape[2]
        assert P == bias.shape[-1] == int(kept.max())
        assert P < T
        # kept slots come first in each row; padding is a suffix
        assert torch.equal(torch.isfinite(bias), torch.arange(P).view(1, 1, P) < kept.unsqueeze(-1))
        kept_all.append(kept.double().mean().item())
        padded_all.append(P)
    s = press.summary()
    assert s["physical_compression"] == pytest.approx(sum(1 - p / T for p in padded_all) / 3)
    assert s["logical_compression"] == pytest.approx(sum(1 - k / T for k in kept_all) / 3)
    assert s["physical_compression"] <= s["logical_compression"]
    assert len(s["physical_compression_per_layer"].split(",")) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_padding_gets_zero_attention_and_logits_stay_finite(tiny_llama, dtype):
    model = tiny_llama(num_layers=2, attn_implementation="eager", dtype=dtype)
    for seed in range(10):  # a sharp proposal and per-group m: find a draw where groups keep different counts
        press = ProbabilisticEvictionPress(
            compression_ratio=0.6, proposal="min", budget="head", seed=seed, proposal_temperature=0.1
        )
        cache = _prefill(model, press, _prompt(5))
        pads = [~torch.isfinite(b) for b in decode_biases(cache)]
        if any(p.any() for p in pads):
            break
    assert any(p.any() for p in pads), "the test needs padding: groups with different kept counts"
    with torch.no_grad():
        out = model(
            input_ids=_prompt(6, 3),
            past_key_values=cache,
            position_ids=torch.arange(T, T + 3)[None],
            output_attentions=True,
        )
    assert torch.isfinite(out.logits).all()
    for pad, attn in zip(pads, out.attentions):  # attn (B, H_Q, q, K)
        P = pad.shape[-1]
        head_pad = pad.repeat_interleave(2, dim=1).unsqueeze(2).expand(-1, -1, 3, -1)
        assert torch.isfinite(attn).all()
        assert (attn[..., :P][head_pad] == 0).all()
        assert torch.allclose(attn.float().sum(-1), torch.ones(attn.shape[:-1]), atol=1e-2)


@pytest.mark.parametrize("budget", ["head", "global"])
def test_sdpa_and_eager_agree_with_bias(tiny_llama, budget):
    ids, question = _prompt(7), _prompt(8, 4)
    outs = []
    for impl in ("sdpa", "eager"):
        model = tiny_llama(num_layers=2, attn_implementation=impl)
        press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o_h", budget=budget, seed=2)
        outs.append(_decode(model, _prefill(model, press, ids), question, T))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_question_forward_keeps_causal_mask(tiny_llama, impl):
    """A multi-token question in one forward == the same tokens fed one by one (causality kept)."""
    model = tiny_llama(num_layers=2, attn_implementation=impl)
    ids, question = _prompt(9), _prompt(10, 5)

    def make():
        return ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o", budget="global", seed=4)

    cache = _prefill(model, make(), ids)
    with torch.no_grad():
        joint = model(input_ids=question, past_key_values=cache, position_ids=torch.arange(T, T + 5)[None]).logits
    cache = _prefill(model, make(), ids)
    steps = []
    with torch.no_grad():
        for u in range(5):
            steps.append(
                model(
                    input_ids=question[:, u : u + 1], past_key_values=cache, position_ids=torch.tensor([[T + u]])
                ).logits
            )
    assert torch.allclose(joint, torch.cat(steps, 1), atol=1e-4)


def test_generate_positions_continue_from_prompt_length(tiny_llama):
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    model.generation_config.pad_token_id = 0
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["position_ids"].flatten().tolist()), with_kwargs=True
    )
    press = ProbabilisticEvictionPress(compression_ratio=0.6, proposal="min_h", seed=0)
    with torch.no_grad(), press(model):
        out = model.generate(_prompt(11), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    hook.remove()
    assert seen[0] == list(range(T))
    assert seen[1:] == [[T], [T + 1], [T + 2]]
    assert out.past_key_values.layers[0].keys.shape[2] < T


def test_pipeline_applies_bias_after_the_press_context(tiny_llama, monkeypatch):
    from kvpress import KVPressTextGenerationPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    calls = []
    real = snis_attention.bias_mask
    monkeypatch.setattr(
        snis_attention,
        "bias_mask",
        lambda state, q, k, mask: calls.append((q.shape[2], k.shape[2])) or real(state, q, k, mask),
    )
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    context = " ".join(f"w{4 + (7 * i) % 120}" for i in range(T))
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o_h", seed=0)
    pipe(context, question="w5 w6 w7", press=press, max_new_tokens=3)
    # question forward (3 tokens + "\n" suffix -> unk) then decode steps, every layer, outside `with press`
    q_lens = [q for q, _ in calls]
    assert q_lens.count(1) >= 2 * 1 and q_lens[0] > 1 and len(calls) >= 2 * 2
    # a later request without the press decodes without a bias (its cache carries none)
    calls.clear()
    pipe(context, question="w5", press=None, max_new_tokens=1)
    assert calls == []


def test_new_prefill_without_press_is_uncompressed(tiny_llama):
    model = tiny_llama(num_layers=2, attn_implementation="eager")
    ids, question = _prompt(12), _prompt(13, 3)
    ref = _decode(model, _prefill(model, ProbabilisticEvictionPress(compression_ratio=0.0), ids), question, T)
    _prefill(model, ProbabilisticEvictionPress(compression_ratio=0.7, budget="head"), ids)
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
    got = _decode(model, cache, question, T)
    assert attention.requests_of(cache) is None and not any(attention.decode_state(cache))
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)


# ---------------------------------------------------------------------------------- budget on the model
def test_global_budget_hits_target_on_average(tiny_llama):
    model = tiny_llama(num_layers=2, attn_implementation="sdpa")
    ids, r = _prompt(14, 64), 0.6
    kept = []
    for seed in range(8):
        press = ProbabilisticEvictionPress(compression_ratio=r, proposal="min", budget="global", seed=seed)
        _prefill(model, press, ids)
        s = press.summary()
        assert s["context_length"] == 64
        kept.append((1 - s["logical_compression"]) * 64)
    kept = torch.tensor(kept)
    se = kept.std().item() / math.sqrt(len(kept))
    assert abs(kept.mean().item() - (1 - r) * 64) <= 0.5 + 4 * se


def test_global_uses_one_m_for_all_layers(tiny_llama, monkeypatch):
    used = []
    real = snis_press.sample_counts
    monkeypatch.setattr(
        snis_press, "sample_counts", lambda pi, m, generator=None: used.append(m.clone()) or real(pi, m, generator)
    )
    model = tiny_llama(num_layers=3, attn_implementation="sdpa")
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="min", budget="global")
    _prefill(model, press, _prompt(15))
    assert len(used) == 3 and all(torch.equal(u, used[0]) for u in used)
    assert used[0].unique().numel() == 1
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="min", budget="head", proposal_temperature=0.1)
    used.clear()
    _prefill(model, press, _prompt(15))
    assert any(u.unique().numel() > 1 for u in used)  # one m per group


# ---------------------------------------------------------------------------------- errors
def test_bad_parameters_raise(tiny_llama):
    with pytest.raises(ValueError, match="compression_ratio=1.0"):
        ProbabilisticEvictionPress(compression_ratio=1.0)
    with pytest.raises(ValueError, match="proposal='top'"):
        ProbabilisticEvictionPress(proposal="top")
    with pytest.raises(ValueError, match="budget='layer'"):
        ProbabilisticEvictionPress(budget="layer")
    with pytest.raises(ValueError, match="tau=0"):
        ProbabilisticEvictionPress(tau=0)
    with pytest.raises(ValueError, match="uniform_mix=-0.1"):
        ProbabilisticEvictionPress(uniform_mix=-0.1)
    model = tiny_llama(num_layers=1, attn_implementation="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        with ProbabilisticEvictionPress(compression_ratio=0.5)(model):
            pass


@pytest.mark.parametrize("r", [1, 3])
@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_sdpa_equals_repeat_kv_sdpa_and_wrapper_uses_it(r, q_len, monkeypatch):
    """The corrected sdpa path folds a group's query heads into query rows instead of copying K/V per head:
    equal to transformers' sdpa on repeat_kv'd keys with the same mask, and taken by the wrapper."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(r * 10 + q_len)
    B, G, P, n_after, d = 2, 2, 9, 3 + q_len, 8
    q = torch.randn(B, G * r, q_len, d, generator=g)
    k, v = torch.randn(B, G, P + n_after, d, generator=g), torch.randn(B, G, P + n_after, d, generator=g)
    bias = torch.randn(B, G, P, generator=g)
    bias[0, 1, 4:] = float("-inf")  # padding
    state = AttentionBias(bias)
    mask = snis_attention.bias_mask(state, q, k, None)
    module = _Attn(r)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=d**-0.5)
    out, _ = snis_attention.grouped_sdpa(q, k, v, mask, d**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    calls, real = [], snis_attention.grouped_sdpa

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(snis_attention, "grouped_sdpa", counting)
    wrapped = _attend("sdpa", module, q, k, v, None, state)
    assert calls == [1]
    torch.testing.assert_close(wrapped, ref.transpose(1, 2))
