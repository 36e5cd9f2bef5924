"""Every model family that ``configs/model/`` names (issue 17 item 7), as tiny random-weight models with the real
configs' shape ratios (``tests/_tiny_models.py``: Qwen2's q/k/v biases and r = 6, Qwen3's per-head q/k norms and
``H_Q d != hidden``, Llama 3's RoPE scaling, 64- vs 128-wide heads), through each press of this project and every
kvpress press the harness offers: prefill, kept counts, decode, and eager equal to sdpa. The harness run on a
saved Qwen2 checkpoint is in ``tests/test_cli.py``."""

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
#: The hub families of configs/model/; the embedded SmolLM2 (a Llama) runs end to end in other tests, and its
#: 64-wide heads here in test_window_queries_are_the_models_own_queries.
CONFIG_FAMILIES = [f for f in FAMILIES if f != "smollm2-135m"]
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


@pytest.mark.parametrize("name", PRESSES)
@pytest.mark.parametrize("family", CONFIG_FAMILIES)
def test_every_press_on_every_family(family, name):
    results = {}
    for attn in _attentions(name):
        model = _model(family, attn)
        check_model(model, TOK)
        press = build(name, RATIO.get(name, 0.5))
        check_press_input(press, model, T_LONG)
        cache = prefill(press, model, PROMPT_IDS)
        kept = logical_kept(model, cache)
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
        for a, b in zip(c_s.layers, c_e.layers):  # the same entries kept, in the same slots
            assert a.keys.shape == b.keys.shape
            torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(l_s, l_e, atol=1e-4, rtol=1e-4)


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
