"""This project's presses inside kvpress's wrappers (issue 16; the press contract, presses/base.py).

- Alone in ``ComposedPress`` or as ``PrefillDecodingPress``'s prefilling press, each press gives the same cache
  and next-token logits as direct use (both budgets of the probabilistic press).
- ``ComposedPress([ProbabilisticEvictionPress(0.5, "h2o"), KnormPress(0.5)])`` keeps what it reports.
- Combinations a press cannot work in are refused with a ``ValueError`` before any compute.
- Page-EntroKV is a ``ScorerPress``: kvpress's score-based wrappers run it, with kvpress's generic checks (kept
  rows are rows of the original cache, exact kept length, hooks removed after use, the pipeline runs).
"""

from __future__ import annotations

import pytest
import torch
from conftest import decode_biases, make_tiny_llama
from kvpress import (
    AdaKVPress,
    BlockPress,
    ChunkPress,
    ComposedPress,
    CriticalKVPress,
    DecodingPress,
    KeyRerotationPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    PerLayerCompressionPress,
    PrefillDecodingPress,
)
from kvpress.utils import compute_n_kept
from test_entroprefill import TOK as CHAR_TOK
from test_entroprefill import prompt as passages_prompt
from transformers import DynamicCache

from presses import EntroPrefillPress, PageEntroKVPress, ProbabilisticEvictionPress
from presses.core.paging import page_budget

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

T = 192


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa", seed=1)


def _ids(n=T, seed=0):
    return torch.randint(4, 120, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, press, ids):
    """Prefill ``ids`` under ``press``, then the next-token logits of a 3-token question at positions ``T..``
    (outside the press block, as kvpress's pipeline decodes). Returns ``(cache keys/values, logits)``."""
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            model(input_ids=ids, past_key_values=cache)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        n = ids.shape[1]
        q = torch.tensor([[5, 6, 7]])
        logits = model(input_ids=q, past_key_values=cache, position_ids=torch.arange(n, n + 3).unsqueeze(0)).logits
    return kv, logits  # the next run's cache starts without a decode-time bias


def _no_hooks(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


FACTORIES = {
    "page_entrokv": lambda: PageEntroKVPress(compression_ratio=0.5, window_size=16, page_size=8),
    "snis_global": lambda: ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o", seed=3),
    "snis_head": lambda: ProbabilisticEvictionPress(compression_ratio=0.5, proposal="min_h", budget="head", seed=3),
}
WRAPPERS = {
    "composed": lambda p: ComposedPress([p]),
    "prefill_decoding": lambda p: PrefillDecodingPress(prefilling_press=p),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_wrapped_equals_direct(model, name, wrapper):
    ids = _ids()
    kv, logits = _run(model, FACTORIES[name](), ids)
    kv_w, logits_w = _run(model, WRAPPERS[wrapper](FACTORIES[name]()), ids)
    assert kv[0][0].shape[2] < T  # the press compressed
    for (k, v), (k_w, v_w) in zip(kv, kv_w):
        assert torch.equal(k, k_w) and torch.equal(v, v_w)
    assert torch.equal(logits, logits_w)
    assert _no_hooks(model)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrapped_entroprefill_equals_direct(wrapper):
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa", seed=0)
    ids = passages_prompt(n_passages=5)

    def press():
        return EntroPrefillPress(tokenizer=CHAR_TOK, force_layer=1, force_chunks=[1, 3], n_sink=2)

    direct = press()
    kv, logits = _run(model, direct, ids)
    wrapped = press()
    kv_w, logits_w = _run(model, WRAPPERS[wrapper](wrapped), ids)
    keys = ("accepted_layer", "removed_chunks", "T", "T_prime", "bypass_reason")
    assert direct.summary()["accepted_layer"] == 1
    assert {k: wrapped.summary()[k] for k in keys} == {k: direct.summary()[k] for k in keys}
    assert kv[0][0].shape[2] < ids.shape[1]
    for (k, v), (k_w, v_w) in zip(kv, kv_w):
        assert torch.equal(k, k_w) and torch.equal(v, v_w)
    assert torch.equal(logits, logits_w)
    assert _no_hooks(model)


def test_entroprefill_with_autograd_on():
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa", seed=0)
    press = EntroPrefillPress(tokenizer=CHAR_TOK, n_sink=2, compression_ratio=0.2, stability_streak=0)
    with torch.enable_grad(), press(model):
        model(input_ids=passages_prompt(n_passages=5), past_key_values=DynamicCache())
    assert press.summary()["T"] == passages_prompt(n_passages=5).shape[1]  # the prefill went through


def _logical_kept(cache, T):
    """Mean over layers and groups of the kept (finite-bias) prompt entries of ``cache``, as a fraction of ``T``."""
    kept = [torch.isfinite(bias).sum(-1).double().mean() for bias in decode_biases(cache)]
    return float(torch.stack(kept).mean()) / T


def test_composed_snis_then_knorm_keeps_what_it_reports(model):
    n = 512
    ids = _ids(n, seed=4)
    composed = ComposedPress(
        [ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o", seed=1), KnormPress(compression_ratio=0.5)]
    )
    cache = DynamicCache()
    with torch.no_grad(), composed(model):
        model(input_ids=ids, past_key_values=cache)
    assert composed.compression_ratio == pytest.approx(0.75)
    kept = _logical_kept(cache, n)
    assert abs((1 - kept) - composed.compression_ratio) < 0.03, kept
    biases = decode_biases(cache)
    # every kept entry is one that Knorm kept
    knorm_cache = DynamicCache()
    with torch.no_grad(), KnormPress(compression_ratio=0.5)(model):
        model(input_ids=ids, past_key_values=knorm_cache)
    for layer, knorm_layer, bias in zip(cache.layers, knorm_cache.layers, biases):
        finite = torch.isfinite(bias)  # (1, G, P)
        for g in range(finite.shape[1]):
            rows = layer.keys[0, g][finite[0, g]]
            allowed = knorm_layer.keys[0, g]
            assert bool((rows.unsqueeze(1) == allowed.unsqueeze(0)).all(-1).any(-1).all())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ComposedPress([KnormPress(0.5), ProbabilisticEvictionPress(0.5, proposal="h2o")]), "first press"),
        (lambda: ComposedPress([ProbabilisticEvictionPress(0.5, budget="head"), KnormPress(0.5)]), "budget='head'"),
        (
            lambda: PrefillDecodingPress(
                prefilling_press=ProbabilisticEvictionPress(0.5),
                decoding_press=DecodingPress(base_press=KnormPress(), target_size=64),
            ),
            "decoding press",
        ),
        (lambda: ComposedPress([KnormPress(0.5), PageEntroKVPress(0.5, window_size=16)]), "first press"),
        (lambda: ComposedPress([ProbabilisticEvictionPress(0.5, unit="page"), KnormPress(0.5)]), "unit='page'"),
        (lambda: ComposedPress([EntroPrefillPress(tokenizer=CHAR_TOK), KnormPress(0.5)]), "cannot share"),
    ],
)
def test_refused_combinations(model, make, match):
    press = make()
    with pytest.raises(ValueError, match=match), torch.no_grad(), press(model):
        model(input_ids=_ids(), past_key_values=DynamicCache())
    model(input_ids=_ids(8), past_key_values=DynamicCache())  # a later forward removes what the failed one left
    assert _no_hooks(model)


# ---------------------------------------------------------------- Page-EntroKV in the score-based wrappers
def _inner():
    return PageEntroKVPress(compression_ratio=0.5, window_size=16, page_size=8)


def _rows_of(kept: torch.Tensor, original: torch.Tensor) -> bool:
    """Every row of ``kept (G, n, d)`` is a row of ``original (G, T, d)`` of the same group."""
    return all(
        bool((kept[g].unsqueeze(1) == original[g].unsqueeze(0)).all(-1).any(-1).all()) for g in range(kept.shape[0])
    )


SCORE_WRAPPERS = {
    "adakv": (lambda: AdaKVPress(_inner()), lambda T, r: T),  # masks instead of removing
    "chunk": (
        lambda: ChunkPress(_inner(), chunk_length=64),
        lambda T, r: sum(max(1, int(min(64, T - i) * (1 - r))) for i in range(0, T, 64)),
    ),
    "key_rerotation": (lambda: KeyRerotationPress(_inner()), compute_n_kept),
    "critical": (lambda: CriticalKVPress(_inner()), compute_n_kept),
    "block": (lambda: BlockPress(_inner(), block_size=32), compute_n_kept),
}


@pytest.mark.parametrize("name", sorted(SCORE_WRAPPERS))
def test_page_entrokv_in_score_wrappers(model, name):
    make, expected = SCORE_WRAPPERS[name]
    ids = _ids()
    full = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full)
    press = make()
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=cache)
    assert _no_hooks(model)
    for layer, full_layer, mod in zip(cache.layers, full.layers, model.model.layers):
        assert layer.values.shape[2] == expected(T, 0.5)
        assert _rows_of(layer.values[0], full_layer.values[0])  # values are never re-rotated
        if name == "adakv":
            masked = mod.self_attn.masked_key_indices
            assert len(masked[0]) == 2 * (T - compute_n_kept(T, 0.5))
            mod.self_attn.masked_key_indices = None


def test_page_entrokv_per_layer_ratios_keep_its_page_plan(model):
    ratios = [0.25, 0.5, 0.75]
    press = PerLayerCompressionPress(_inner(), compression_ratios=ratios)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=_ids(), past_key_values=cache)
    for layer, ratio in zip(cache.layers, ratios):
        assert layer.keys.shape[2] == page_budget(T, ratio, 8, 4, 16).kept_tokens
    assert _no_hooks(model)


def test_page_entrokv_as_decoding_press(model):
    press = DecodingPress(
        base_press=PageEntroKVPress(window_size=16, page_size=8), compression_interval=4, target_size=96
    )
    cache = DynamicCache()
    ids = _ids()
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
        for step in range(8):
            out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[T + step]]))
            token = out.logits[:, -1:].argmax(-1)
    lengths = {layer.keys.shape[2] for layer in cache.layers}
    # compressed twice (every 4 steps) to at most 96 entries, then nothing more was appended
    assert max(lengths) <= 96 and min(lengths) >= 96 - 8
    assert _no_hooks(model)


def test_page_entrokv_score_ranks_protected_pages_first(model):
    press = _inner()
    seen = {}

    class Spy(AdaKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            seen[module.layer_idx] = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    with torch.no_grad(), Spy(press)(model):
        model(input_ids=_ids(), past_key_values=DynamicCache())
    for scores in seen.values():
        protected = torch.zeros(T, dtype=torch.bool)
        protected[:8] = True  # the sink page (n_sink=4, page_size=8)
        protected[(T - 16) // 8 * 8 :] = True  # pages touching the last window_size=16 positions
        assert float(scores[..., protected].min()) > float(scores[..., ~protected].max())
        pages = scores[..., ~protected].reshape(*scores.shape[:2], -1, 8)
        assert bool((pages == pages[..., :1]).all())  # one score per page


def test_page_entrokv_adakv_pipeline_with_cache(model):
    from _tiny_tokenizer import char_tokenizer

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=char_tokenizer(), device=torch.device("cpu"))
    cache = DynamicCache()
    out = pipe("some context " * 20, question="why?", press=AdaKVPress(_inner()), max_new_tokens=3, cache=cache)
    assert isinstance(out["answer"], str) and cache.get_seq_length() > 0
    assert _no_hooks(model)


@pytest.mark.slow
def test_adakv_page_entrokv_on_the_embedded_model(embedded_model):
    model, tokenizer = embedded_model
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    context = (
        "The quick brown fox jumps over the lazy dog. " * 40
        + "The secret word is pineapple. "
        + "The quick brown fox jumps over the lazy dog. " * 10
    )
    press = AdaKVPress(PageEntroKVPress(compression_ratio=0.5))
    answer = pipe(context, question="What is the secret word?", press=press, max_new_tokens=8)["answer"]
    assert isinstance(answer, str) and answer.strip()
    masked = [layer.self_attn.masked_key_indices for layer in model.model.layers]
    assert all(m is not None and len(m[0]) > 0 for m in masked)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
