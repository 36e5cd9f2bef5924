"""Paper 000's options on PageEntroKVPress (issue 14; docs/methods.md §1.11): observer_window, protect,
group_selection, max_fallback, and the config page_entrokv_paper000 that sets all four."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from hydra.utils import instantiate
from transformers import DynamicCache

from evaluation.harness import compose_config
from presses import PageEntroKVPress
from presses.core.observer import observer_attention_reference, window_queries
from presses.core.paging import page_budget
from presses.core.pooling import pooled_group_scores

pytestmark = pytest.mark.usefixtures("one_thread")


class _Spy(PageEntroKVPress):
    """Keeps every layer's observer attention and inputs (the press's own computation, not a copy of it)."""

    def __post_init__(self):
        super().__post_init__()
        self.seen = []

    def _observer_attention(self, module, hidden_states, keys, attentions, kwargs):
        out = super()._observer_attention(module, hidden_states, keys, attentions, kwargs)
        self.seen.append((module, hidden_states, keys, kwargs["position_embeddings"], out))
        return out


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa", seed=2)


def _prefill(model, press, T=100, seed=0):
    ids = torch.randint(4, 120, (1, T), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=cache)
    return cache


@pytest.mark.parametrize(("observer_window", "expected"), [(48, 48), ("all", 100), (None, 16)])
def test_observer_window_averages_the_last_queries_in_blocks(model, observer_window, expected):
    press = _Spy(
        compression_ratio=0.5,
        window_size=16,
        page_size=8,
        observer_window=observer_window,
        observer_block=16,
        record=True,
    )
    _prefill(model, press)
    assert press.summary()["observers"] == expected
    for module, hidden_states, keys, pe, out in press.seen:
        ref = observer_attention_reference(window_queries(module, hidden_states, expected, pe), keys)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        assert torch.allclose(out.sum(-1), torch.ones(()), atol=1e-5)


def test_protect_none_is_plain_top_k_over_pages(model):
    press = PageEntroKVPress(compression_ratio=0.5, window_size=16, page_size=8, protect="none", record=True)
    cache = _prefill(model, press, T=96)
    plan = page_budget(96, 0.5, 8, 4, 16, protect="none")
    assert plan.protected.sum() == 0 and cache.get_seq_length() == plan.kept_tokens == 48
    for rec in press.records:  # with protection the last (window) pages would always be kept
        assert rec["kept_pages"].shape[-1] == 6
    kept_last = [bool((rec["kept_pages"] == 11).any()) for rec in press.records]
    assert not all(kept_last)  # no page is kept by construction


def test_group_selection_union_keeps_every_groups_pages(model):
    press = PageEntroKVPress(compression_ratio=0.75, window_size=16, page_size=8, group_selection="union", record=True)
    cache = _prefill(model, press, T=128)
    alone = PageEntroKVPress(compression_ratio=0.75, window_size=16, page_size=8, record=True)
    _prefill(model, alone, T=128)
    for layer, rec, own in zip(cache.layers, press.records, alone.records):
        union = torch.unique(own["kept_pages"])
        assert torch.equal(rec["kept_pages"][0], union) and torch.equal(rec["kept_pages"][1], union)
        assert torch.equal(rec["selected_pages"], own["kept_pages"])  # each group still selects its own top-K
        assert layer.keys.shape[2] == rec["kept_tokens"] >= own["kept_tokens"]
    per_group = alone.summary()["effective_compression"]
    assert press.summary()["effective_compression"] <= per_group  # the union keeps at least as much


def test_group_selection_union_decodes_with_a_length_per_layer(model, monkeypatch):
    """The union's size differs from layer to layer, so the layers' cache lengths differ: the press says so
    (``uneven_layers``, which the harness reads) and installs the attention wrapper that fits each layer's mask, so a
    question forward after the prefill runs without the harness (with the mask transformers builds from layer 0's
    length it raised a size mismatch: ``page_entrokv_paper000`` alone through ``evaluation.run``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", getattr(sdpa, "__wrapped__", sdpa))  # as a fresh process
    press = PageEntroKVPress(compression_ratio=0.75, window_size=16, page_size=8, group_selection="union")
    assert press.capabilities.uneven_layers and not PageEntroKVPress(compression_ratio=0.75).capabilities.uneven_layers
    cache = _prefill(model, press, T=160, seed=0)
    assert len({layer.keys.shape[2] for layer in cache.layers}) > 1  # a prompt whose unions differ
    question = torch.randint(4, 120, (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=question, past_key_values=cache, position_ids=torch.arange(160, 165)[None]).logits
    assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()


def test_max_fallback_pools_indistinguishable_groups_by_max():
    g = torch.Generator().manual_seed(3)
    sharp = torch.softmax(torch.randn(1, 2, 64, generator=g) * 4, dim=-1)
    flat = torch.softmax(torch.randn(1, 1, 64, generator=g) * 0.1, dim=-1).expand(1, 2, 64)
    flat = flat * torch.linspace(0.9, 1.1, 64)  # two heads with the same entropy but different peaks
    flat = torch.cat([flat[:, :1], flat[:, :1].flip(-1)], dim=1)
    flat = flat / flat.sum(-1, keepdim=True)
    attn = torch.cat([sharp, flat], dim=1)  # group 0: distinct heads; group 1: mirror images, equal entropies
    press = PageEntroKVPress(compression_ratio=0.5, page_size=8, max_fallback=0.01)
    _, scores, diag, fallback = press._page_scores(attn, 2)
    assert fallback.tolist() == [[False, True]]
    entropy = diag["entropy"].view(2, 2)
    assert float(entropy[1].max() - entropy[1].min()) < 0.01 < float(entropy[0].max() - entropy[0].min())
    pooled_max, _ = pooled_group_scores(attn, 2, 4, 2.0, 0.5, "max")
    pooled_entropy, _ = pooled_group_scores(attn, 2, 4, 2.0, 0.5, "entropy")
    assert torch.allclose(scores[0, 1], pooled_max[0, 1].view(8, 8).amax(-1))
    assert torch.allclose(scores[0, 0], pooled_entropy[0, 0].view(8, 8).amax(-1))
    off = PageEntroKVPress(compression_ratio=0.5, page_size=8)._page_scores(attn, 2)[1]
    assert not torch.allclose(off[0, 1], scores[0, 1])  # the fallback changed something


def test_paper000_config_sets_all_four_and_runs(model):
    press = instantiate(compose_config(["press=page_entrokv_paper000", "compression_ratio=0.8"]).press)
    assert (press.observer_window, press.protect, press.group_selection) == ("all", "none", "union")
    assert press.max_fallback is not None
    press.record = True
    _prefill(model, press, T=160)
    s = press.summary()
    assert s["observers"] == 160 and s["protected_tokens"] == 0
    assert 0.5 < s["effective_compression"] <= 0.8  # the union keeps at least each group's 20 %


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="observer_window=0"):
        PageEntroKVPress(observer_window=0)
    with pytest.raises(ValueError, match="observer_window='some'"):
        PageEntroKVPress(observer_window="some")
    with pytest.raises(ValueError, match="protect='sinks'"):
        PageEntroKVPress(protect="sinks")
    with pytest.raises(ValueError, match="group_selection='layer'"):
        PageEntroKVPress(group_selection="layer")
    with pytest.raises(ValueError, match="max_fallback=-1"):
        PageEntroKVPress(max_fallback=-1)
