"""EntroPrefill with its page policy (paper 001 Algorithm 1 step 7; docs/methods.md §4 step 7): the composition
equals running the page policy on the pruned cache, a bypass equals the page policy alone, the two stages of
the compression, the observer rows the deferred layers keep, and the policies that are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from kvpress import KnormPress, ObservedAttentionPress, SnapKVPress
from test_entroprefill import TOK, decode_steps, forward_pruned, prompt, run_press
from transformers import DynamicCache

from presses.entroprefill import EntroPrefillPress
from presses.entroprefill.page_policy import check_page_policy, observer_tail_start
from presses.page_entrokv import PageEntroKVPress
from presses.probabilistic import ProbabilisticEvictionPress

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DECODE = [65, 66, 67]


def page_policy(**kw):
    """Page-EntroKV whose observer window (48) is longer than the question (41 tokens), so the observers of the
    retained support reach across the delimiter into the passage before a removed last passage."""
    return PageEntroKVPress(**{"compression_ratio": 0.4, "window_size": 48, "page_size": 8, "n_sink": 2, **kw})


def pruned_then_paged(model, ids, layer, R, policy, decode_ids):
    """Reference: layers 0..layer on the full prompt, the rest on R (original positions), then ``policy.compress``
    on every layer's pruned cache, fed the layer's attention input at R; then decode from position T."""
    lm = model.model
    cache = DynamicCache()
    inputs = {}

    def capture(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [blk.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for blk in lm.layers]
    with torch.no_grad():
        try:
            first = forward_pruned(model, ids, layer, R, cache, trim_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        for i, blk in enumerate(lm.layers):
            hs, (c, s) = inputs[i]
            keys, values = cache.layers[i].keys, cache.layers[i].values
            if i <= layer:  # ran on the full prompt: the pruned cache is its entries at R
                hs, c, s, keys, values = hs[:, R], c[:, R], s[:, R], keys[:, :, R], values[:, :, R]
            cache.layers[i].keys, cache.layers[i].values = policy.compress(
                blk.self_attn, hs, keys, values, None, {"position_embeddings": (c, s)}
            )
        return torch.stack([first, *decode_steps(model, cache, ids.shape[1], decode_ids)]), cache


@pytest.fixture(scope="module")
def tiny():
    return {
        attn: make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=4, attn_implementation=attn)
        for attn in ("eager", "sdpa")
    }


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("removed", [[1, 4], [0, 2]])
def test_composition_equals_page_policy_on_pruned_cache(tiny, attn, removed):
    model, ids = tiny[attn], prompt(5)
    T = ids.shape[1]
    press = EntroPrefillPress(
        compression_ratio=0.5, tokenizer=TOK, force_layer=1, force_chunks=removed, n_sink=2, page_policy=page_policy()
    )
    got, cache = run_press(model, ids, press, DECODE)
    R = press._plan.retained_indices(removed)
    ref, ref_cache = pruned_then_paged(model, ids, 1, R, page_policy(), DECODE)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):  # the same kept entries, decode steps included
        assert layer.keys.shape == ref_layer.keys.shape
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # the page policy evicted something at every layer: fewer entries than the pruned prefill's T'
    kept = cache.get_seq_length() - len(DECODE)
    assert kept < len(R) < T
    st = press.summary()
    assert st["T_prime"] == len(R) and st["page_kept_tokens"] == kept
    assert st["prune_compression"] == pytest.approx(1 - len(R) / T)
    assert st["page_compression"] == pytest.approx(1 - kept / len(R))
    assert st["compression"] == pytest.approx(1 - kept / T)
    assert 1 - st["compression"] == pytest.approx((1 - st["prune_compression"]) * (1 - st["page_compression"]))
    assert st["page_context_length"] == len(R) and st["page_layers"] == 4  # the policy's own summary, prefixed


def test_observers_of_the_retained_support_are_not_the_prompt_tail(tiny):
    """With the last passage removed, the policy's last 48 observers on R differ from the prompt's last 48
    positions: a driver that read the prompt's tail instead would keep other pages in the shallow layers."""
    ids = prompt(5)
    press = EntroPrefillPress(
        compression_ratio=0.5, tokenizer=TOK, force_layer=1, force_chunks=[1, 4], n_sink=2, page_policy=page_policy()
    )
    run_press(tiny["eager"], ids, press, [])
    R = press._plan.retained_indices([1, 4])
    assert not torch.equal(R[-48:], torch.arange(ids.shape[1] - 48, ids.shape[1]))


def _policy_alone(model, ids, policy):
    cache = DynamicCache()
    T = ids.shape[1]
    with torch.no_grad():
        with policy(model):
            out = model(input_ids=ids, past_key_values=cache)
        logits = [out.logits[0, -1]]
        for step, tok in enumerate(DECODE):
            logits.append(
                model(
                    input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[T + step]])
                ).logits[0, -1]
            )
    return torch.stack(logits), cache


@pytest.mark.parametrize(
    "make_policy",
    [page_policy, lambda: SnapKVPress(compression_ratio=0.4, window_size=6), lambda: KnormPress(compression_ratio=0.3)],
    ids=["page_entrokv", "snapkv", "knorm"],
)
@pytest.mark.parametrize("bypass", ["zero_target", "audit_failed"])
def test_bypass_evicts_the_full_prefill_like_the_policy_alone(tiny, make_policy, bypass):
    """Step 7: without an accepted layer the page policy evicts the full prefill's cache, as it would alone (before
    any layer: every hook evicts at once; after the monitored window: the deferred layers are evicted then)."""
    model, ids = tiny["sdpa"], prompt(5)
    if bypass == "zero_target":
        press = EntroPrefillPress(tokenizer=TOK, compression_ratio=0.0, page_policy=make_policy())
    else:
        press = EntroPrefillPress(
            compression_ratio=0.5,
            tokenizer=TOK,
            epsilon=0.9,
            epsilon_audit=0.05,
            stability_streak=0,
            monitored_layers=[0, 1, 2],
            audit_size=16,
            page_policy=make_policy(),
        )
    got, cache = run_press(model, ids, press, DECODE)
    st = press.summary()
    assert st["bypass_reason"] == bypass and st["T_prime"] == ids.shape[1]
    ref, ref_cache = _policy_alone(model, ids, make_policy())
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        assert torch.equal(layer.keys, ref_layer.keys) and torch.equal(layer.values, ref_layer.values)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert st["prune_compression"] == 0 and st["compression"] > 0
    assert st["page_compression"] == pytest.approx(st["compression"])


def test_page_policy_statistics_reset_per_request(tiny):
    model = tiny["sdpa"]
    policy = page_policy()
    press = EntroPrefillPress(
        compression_ratio=0.5, tokenizer=TOK, force_layer=1, force_chunks=[1], n_sink=2, page_policy=policy
    )
    run_press(model, prompt(5), press, [])
    first = press.summary()
    run_press(model, prompt(3), press, [])
    second = press.summary()
    assert len(policy._stats) == 4  # one entry per layer of the last prefill only
    assert second["page_context_length"] == second["T_prime"] < first["T_prime"]


def test_observer_tail_start():
    chunks = [(4, 8), (10, 16)]  # always retained: 0..3, 8, 9, 16..19
    assert observer_tail_start(20, chunks, 3) == 17
    assert observer_tail_start(20, chunks, 6) == 8
    assert observer_tail_start(20, chunks, 11) == 0
    assert observer_tail_start(20, chunks, None) == 0


def test_refused_page_policies():
    with pytest.raises(ValueError, match="decode-time state"):
        EntroPrefillPress(page_policy=ProbabilisticEvictionPress(compression_ratio=0.5))
    with pytest.raises(ValueError, match="changes the prefill"):
        EntroPrefillPress(compression_ratio=0.5, page_policy=EntroPrefillPress())
    with pytest.raises(ValueError, match="eager attention weights"):
        check_page_policy(ObservedAttentionPress(compression_ratio=0.5))
    with pytest.raises(ValueError, match="must be a kvpress press"):
        EntroPrefillPress(compression_ratio=0.5, page_policy="page_entrokv")


def test_composed_press_error_points_to_page_policy(tiny):
    from kvpress import ComposedPress

    press = ComposedPress([EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK), page_policy()])
    with pytest.raises(ValueError, match=r"page_policy=\.\.\."):
        run_press(tiny["sdpa"], prompt(3), press, [])


def test_hydra_config_nests_the_page_policy():
    from hydra.utils import instantiate

    from evaluation.harness import compose_config

    cfg = compose_config(["press=entroprefill_page", "compression_ratio=0.3", "++press.page_policy.page_size=8"])
    press = instantiate(cfg.press)
    assert isinstance(press, EntroPrefillPress) and isinstance(press.page_policy, PageEntroKVPress)
    assert press.compression_ratio == press.page_policy.compression_ratio == 0.3
    assert press.page_policy.page_size == 8 and press.epsilon == 0.35  # EntroPrefill's defaults are inherited


def test_hydra_page_policy_is_page_entrokvs_config_and_swaps_by_group():
    """The nested policy is press/page_entrokv.yaml itself (its tuned defaults, not a copy), and a user swaps it for
    another press config with ``press@press.page_policy=<name>``."""
    from hydra.utils import instantiate

    from evaluation.harness import compose_config

    alone = compose_config(["press=page_entrokv", "compression_ratio=0.3"]).press
    nested = compose_config(["press=entroprefill_page", "compression_ratio=0.3"]).press.page_policy
    assert nested == alone
    cfg = compose_config(["press=entroprefill_page", "compression_ratio=0.3", "press@press.page_policy=snapkv"])
    press = instantiate(cfg.press)
    assert isinstance(press.page_policy, SnapKVPress) and press.page_policy.compression_ratio == 0.3


def test_a_page_policy_class_or_a_ratio_string_is_refused_by_name():
    from presses import EntroPrefillPress, PageEntroKVPress

    with pytest.raises(ValueError, match=r"page_policy=PageEntroKVPress is a class: pass an instance"):
        EntroPrefillPress(compression_ratio=0.5, page_policy=PageEntroKVPress)
    with pytest.raises(ValueError, match=r"compression_ratio='0.5' must be a number in \[0, 1\), not str"):
        PageEntroKVPress(compression_ratio="0.5")
