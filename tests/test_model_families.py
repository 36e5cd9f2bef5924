"""Every model family that ``configs/model/`` and ``evaluation.guards`` name (issue 17 item 7, issue 32 items 1-2), as
tiny random-weight models with the real configs' shape ratios and features (``tests/_tiny_models.py``: Qwen2's q/k/v
biases and r = 6, Qwen3's per-head q/k norms and ``H_Q d != hidden``, Llama 3's RoPE scaling, 64- vs 128-wide heads,
Gemma2's soft-cap and alternating sliding layers, Gemma3's per-layer-type RoPE and ``query_pre_attn_scalar``,
Mistral's sliding window on every layer, Phi-3.5's MHA and LongRoPE, Phi-4-mini's partial rotary embedding), through
each press of this project and every kvpress press the harness offers: prefill, kept counts, decode, and eager equal
to sdpa; sliding-window layers stay whole; each press's recomputed observer rows equal the model's own attention rows.
A combination that cannot run is refused before the prefill with one ``ValueError``. The harness run on a saved
Qwen2 checkpoint is in ``tests/test_cli.py``."""

from __future__ import annotations

import pytest
import torch
from _tiny_models import FAMILIES, make_tiny_family
from test_robustness import (
    PRESSES,
    PROMPT_IDS,
    T_LONG,
    TOK,
    VOCAB,
    build,
    decode,
    logical_kept,
    page_entrokv_kept,
    prefill,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from evaluation.guards import check_model, check_press_input
from presses.core.model import sliding_layers
from presses.core.observer import window_queries

pytestmark = pytest.mark.usefixtures("one_thread")

HALF = T_LONG - int(T_LONG * 0.5)  # kvpress's ScorerPress keeps int(T (1 - ratio)) entries per head
EXACT = {
    "snapkv": HALF,
    "tova": HALF,
    "knorm": HALF,
    "streaming_llm": HALF,
    "expected_attention": HALF,
    "observed_attention": HALF,
    "adakv": HALF,
}  # AdaKV: the same count on average over the heads
#: Page-EntroKV runs at 0.25 here: more pages to choose beyond the protected ones than at 0.5
RATIO = {"page_entrokv": 0.25}
#: The families beyond the embedded SmolLM2 (a Llama, run end to end in other tests; its 64-wide heads here in
#: test_window_queries_are_the_models_own_queries).
CONFIG_FAMILIES = [f for f in FAMILIES if f != "smollm2-135m"]
#: Families whose attention soft-cap transformers' sdpa ignores: eager only (evaluation.guards refuses sdpa).
SOFTCAPPED = {f for f, (_, values) in FAMILIES.items() if values.get("attn_logit_softcapping")}
#: kvpress presses that recompute attention with RoPE over the whole head and logits / sqrt(head_dim)
#: (evaluation.registry._recompute_problem), always or without eager attention weights: refused on a partial rotary
#: embedding (Phi-4-mini), a scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar) or a soft-cap.
RECOMPUTES = {"expected_attention": ("sdpa", "eager"), "snapkv": ("sdpa",), "tova": ("sdpa",)}
RECOMPUTES |= {"pyramidkv": ("sdpa",), "adakv": ("sdpa",)}
_MODELS: dict = {}


def _model(family: str, attn: str):
    if (family, attn) not in _MODELS:
        # float64: eager and sdpa then differ by ~1e-15, so a near tie between two scores does not flip the choice
        _MODELS[(family, attn)] = make_tiny_family(
            family, vocab=VOCAB, attn_implementation=attn, seed=2, dtype=torch.float64
        )
    return _MODELS[(family, attn)]


def _attentions(name: str) -> tuple[str, ...]:
    """The attention implementations the harness runs ``name`` with (the registry's limits, README Limits)."""
    if name == "observed_attention":
        return ("eager",)  # reads the attention weights
    if name == "adakv":
        return ("sdpa",)  # kvpress's key masking patches sdpa
    return ("sdpa", "eager")


def _refusal(family: str, name: str, attn: str) -> str | None:
    """The one-line refusal the guards or the press give ``name`` on ``family`` with ``attn``, or None."""
    values = FAMILIES[family][1]
    if family in SOFTCAPPED and attn != "eager":
        return "soft-caps its attention logits"
    own_scale = values.get("query_pre_attn_scalar", values.get("head_dim")) == values.get("head_dim")
    special = values.get("partial_rotary_factor", 1) < 1 or not own_scale or family in SOFTCAPPED
    if special and attn in RECOMPUTES.get(name, ()):
        return "recomputes attention"
    if name == "entroprefill" and sliding_layers(_model(family, attn)):
        return "does not support sliding-window layers"
    return None


@pytest.mark.parametrize("name", PRESSES)
@pytest.mark.parametrize("family", CONFIG_FAMILIES)
def test_every_press_on_every_family(family, name):
    results = {}
    for attn in _attentions(name):
        model = _model(family, attn)
        press = build(name, RATIO.get(name, 0.5))
        refusal = _refusal(family, name, attn)
        if refusal is not None:  # refused before the prefill, in one line
            with pytest.raises(ValueError, match=refusal):
                check_model(model, TOK)
                check_press_input(press, model, T_LONG)
                prefill(press, model, PROMPT_IDS)
            continue
        check_model(model, TOK)
        check_press_input(press, model, T_LONG)
        cache = prefill(press, model, PROMPT_IDS)
        kept = logical_kept(model, cache)
        sliding = sliding_layers(model)
        assert [kept[i] for i in sliding] == [T_LONG] * len(sliding), kept  # sliding-window layers stay whole
        kept = [k for i, k in enumerate(kept) if i not in sliding]
        if name == "page_entrokv":
            protected, expected = page_entrokv_kept(press, T_LONG)
            assert T_LONG % press.page_size == 0 and kept == [expected] * len(kept), kept
            assert expected > protected, "some pages are chosen, not only the protected ones"
        elif name in EXACT:
            assert kept == pytest.approx([EXACT[name]] * len(kept)), kept
        elif name == "entroprefill":  # the question and instructions are protected; may keep everything
            assert all(1 <= k <= T_LONG for k in kept), kept
        else:  # SNIS (one global number of draws), PyramidKV (per-layer budgets)
            assert all(1 <= k < T_LONG for k in kept), kept
        logits = decode(model, cache, T_LONG).logits
        assert logits.shape == (1, 1, VOCAB) and torch.isfinite(logits).all()
        results[attn] = (cache, logits)
    if len(results) == 2:
        (c_s, l_s), (c_e, l_e) = results["sdpa"], results["eager"]
        for a, b in zip(c_s.layers, c_e.layers):  # the same entries kept (kvpress's top-k orders them by score)
            assert a.keys.shape == b.keys.shape
            torch.testing.assert_close(_as_set(a.keys), _as_set(b.keys), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(l_s, l_e, atol=1e-4, rtol=1e-4)


def _as_set(keys: torch.Tensor) -> torch.Tensor:
    """A layer's kept keys ``(B, G, n, d)`` in a canonical order (by their first coordinate): scores that nearly tie
    may order the same entries differently under eager and sdpa (whose logits differ by float32 rounding)."""
    order = keys[..., 0].argsort(dim=-1)
    return keys.gather(2, order.unsqueeze(-1).expand_as(keys))


@pytest.mark.parametrize("family", FAMILIES)
def test_window_queries_are_the_models_own_queries(family, monkeypatch):
    """The presses' observer queries (kvpress's pre-RoPE projection, then RoPE) equal the queries the model's
    attention computes: Qwen2's biases and Qwen3's q_norm included."""
    model = _model(family, "sdpa")
    attn = model.model.layers[1].self_attn
    seen = {}
    handle = attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(h=kwargs["hidden_states"], pe=kwargs["position_embeddings"]),
        with_kwargs=True,
    )
    inner = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, *args, **kwargs):
        if module is attn:
            seen["q"] = query
        return inner(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    try:
        with torch.no_grad():
            model(PROMPT_IDS[:, :48])
            got = window_queries(attn, seen["h"], 8, seen["pe"])
    finally:
        handle.remove()
    heads, width = FAMILIES[family][1]["num_attention_heads"], attn.head_dim
    assert got.shape == seen["q"][:, :, -8:].shape == (1, heads, 8, width)
    torch.testing.assert_close(got, seen["q"][:, :, -8:], atol=1e-5, rtol=1e-5)


def _sharpened(family: str):
    """The eager tiny ``family`` with query and key projections 4x larger, so that attention logits reach Gemma2's
    soft-cap and a wrong scale shows; cached per family."""
    key = (family, "sharp")
    if key not in _MODELS:
        model = make_tiny_family(family, vocab=VOCAB, attn_implementation="eager", seed=5, dtype=torch.float64)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in ("q_proj", "k_proj", "qkv_proj"):
                    if hasattr(layer.self_attn, proj):
                        getattr(layer.self_attn, proj).weight.mul_(4.0)
        _MODELS[key] = model
    return _MODELS[key]


#: Families with a layer the presses compress (every layer of the tiny Mistral attends a sliding window)
COMPRESSED_FAMILIES = [f for f in FAMILIES if f != "mistral-7b-v0.1"]


@pytest.mark.parametrize("family", COMPRESSED_FAMILIES)
def test_recomputed_observer_rows_are_the_models_own_rows(family):
    """Issue 32 item 1: the attention rows each press of this project recomputes (Page-EntroKV's observer average,
    blocked or not; probabilistic eviction's column sums and last row; EntroPrefill's rows and their average) equal
    the model's own eager attention weights at a full-attention layer: its scale (Gemma's query_pre_attn_scalar), its
    rotary embedding (Gemma3's per layer type, Phi-4-mini's partial one) and its soft-cap (Gemma2) included."""
    from kvpress.presses.base_press import BasePress
    from transformers import DynamicCache

    from presses import PageEntroKVPress
    from presses.core.observer import observer_attention_reference
    from presses.entroprefill.equations import row_attention, row_chunk_statistics
    from presses.probabilistic.proposals import attention_column_sums, head_proposals

    model = _sharpened(family)
    layer = max(set(range(len(model.model.layers))) - set(sliding_layers(model)))
    seen = {}

    class Capture(BasePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if module.layer_idx == layer:
                seen.update(module=module, h=hidden_states, keys=keys, values=values, w=attentions, kwargs=kwargs)
            return keys, values

    ids = PROMPT_IDS[:, :96]
    with torch.no_grad(), Capture()(model):
        model.model(input_ids=ids, past_key_values=DynamicCache(), output_attentions=True)
    module, h, keys, w, kwargs = seen["module"], seen["h"], seen["keys"], seen["w"].float(), seen["kwargs"]
    pe, T = kwargs["position_embeddings"], ids.shape[1]
    close = dict(atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        if family.startswith("gemma"):  # with logits / sqrt(d) and no soft-cap (kvpress's convention) rows differ
            plain = observer_attention_reference(window_queries(module, h, 8, pe), keys)
            assert float((plain - w[..., -8:, :].mean(-2)).abs().max()) > 1e-3
        for block in (256, 3):  # one pass over the observers; blocks of 3 rows (column sums)
            press = PageEntroKVPress(window_size=8, observer_block=block)
            got = press._observer_attention(module, h, keys, None, kwargs)
            torch.testing.assert_close(got, w[..., -8:, :].mean(-2), **close)
        prior = torch.linspace(0.5, 1.5, T, dtype=torch.float32)
        got = attention_column_sums(module, h, keys, pe, prior, block_size=40)
        torch.testing.assert_close(got, (w * prior.view(T, 1)).sum(-2), **close)
        norms = torch.linalg.vector_norm(seen["values"].float(), dim=-1).repeat_interleave(
            w.shape[1] // keys.shape[1], 1
        )
        want = w[..., -1, :] * norms
        got = head_proposals("min", module, h, keys, seen["values"], pe)
        torch.testing.assert_close(got, want / want.sum(-1, keepdim=True), **close)
        positions = torch.tensor([5, 40, 77, T - 1])
        torch.testing.assert_close(row_attention(module, h, keys, positions, pe), w[:, :, positions], **close)
        ids_chunks = (torch.arange(T) // 24).to(torch.int32)
        weights = torch.full((4,), 0.25)
        masses, average = row_chunk_statistics(module, h, keys, positions, pe, ids_chunks, 4, weights)
        torch.testing.assert_close(average, w[:, :, positions].mean(-2), **close)
        want = torch.stack([w[:, :, positions][..., ids_chunks == c].sum(-1) for c in range(4)], -1)
        torch.testing.assert_close(masses, want, **close)


def test_page_entrokv_under_decoding_press_on_gemma3():
    """kvpress issue #274 (PR #275): Page-EntroKV scored by kvpress's DecodingPress rotates its buffered observers
    with the rotary embedding of the layer's type (Gemma3 has one per type); it raised AttributeError
    'None_inv_freq'."""
    from kvpress import DecodingPress

    from presses import PageEntroKVPress

    model = _model("gemma-3-27b", "sdpa")
    press = DecodingPress(PageEntroKVPress(window_size=4, page_size=4), compression_interval=4, target_size=48)
    cache = prefill(None, model, PROMPT_IDS[:, :64])
    with torch.no_grad(), press(model):
        for step in range(8):
            model(input_ids=torch.full((1, 1), 65), past_key_values=cache, position_ids=torch.full((1, 1), 64 + step))
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    assert lengths[0] == 72 and lengths[1] < 72, lengths  # the sliding layer stays whole, the full one is compressed


@pytest.mark.parametrize("name", ["page_entrokv", "snis_h2o", "snapkv", "knorm"])
def test_sliding_window_layers_are_never_widened(name):
    """Issue 32 item 2 (transformers PR #40039): transformers masks a sliding-window layer by cache slot, so after
    eviction a decoded token's last ``window`` slots would reach positions outside its window. On the tiny Mistral
    (a 16-position window on every layer) every press leaves every layer whole: the decode is the uncompressed one,
    bit for bit."""
    model = _model("mistral-7b-v0.1", "sdpa")
    assert sliding_layers(model) == {0: 16, 1: 16}
    full = prefill(None, model, PROMPT_IDS)
    cache = prefill(build(name, 0.5), model, PROMPT_IDS)
    for a, b in zip(cache.layers, full.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(decode(model, cache, T_LONG).logits, decode(model, full, T_LONG).logits)


def test_a_sliding_mask_built_from_a_compressed_layer_is_refused():
    """Qwen2 with ``use_sliding_window`` slides layers from ``max_window_layers`` on, while layer 0 (whose cache
    length transformers builds every mask from) is a full layer a press would shorten: refused in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=16, max_window_layers=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert sliding_layers(model) == {1: 16}
    with pytest.raises(ValueError, match=r"layers \[1\] use a sliding window but layer 0 does not"):
        prefill(build("knorm", 0.5), model, PROMPT_IDS[:, :32])
