"""Reliability (issue 32): per-layer cache lengths, chunked prefill, cache kinds, stop tokens, torch.compile, devices
and seeds, autograd, Triton's cache. Each test names the item of the issue it covers; the README's Limits section has
one row per item. Model families and sliding-window layers (items 1-2) are in ``tests/test_model_families.py``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama
from test_robustness import PROMPT_IDS, T_LONG, VOCAB, build, prefill
from transformers import DynamicCache

from presses import attention
from presses.attention_bias import AttentionBias

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = torch.tensor([[70, 71, 72, 73, 74]])

_MODELS: dict = {}


def _llama(attn: str = "sdpa", layers: int = 3):
    key = (attn, layers)
    if key not in _MODELS:
        _MODELS[key] = make_tiny_llama(num_layers=layers, vocab=VOCAB, attn_implementation=attn, seed=3)
    return _MODELS[key]


def _question_logits(model, cache, T: int) -> torch.Tensor:
    positions = torch.arange(T, T + QUESTION.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=QUESTION, past_key_values=cache, position_ids=positions).logits


def _copy(cache) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


def _padded_with_bias(cache) -> DynamicCache:
    """The same cache with every layer padded at its end to the longest layer, the padding masked by a ``-inf``
    decode bias (the biased path of presses.attention_bias, which reads only the question's own mask columns)."""
    longest = max(layer.keys.shape[2] for layer in cache.layers)
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        B, G, K, _ = layer.keys.shape
        pad = longest - K
        out.update(*(torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (layer.keys, layer.values)), i)
        bias = torch.zeros(B, G, longest).masked_fill(torch.arange(longest) >= K, float("-inf"))
        attention.set_decode_bias(out, i, AttentionBias(bias))
    return out


# ---------------------------------------------------------------------------------------------- item 3
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_per_layer_lengths_answer_the_question(attn):
    """Issue 32 item 3: after PyramidKV (a different count per layer) the question forward, whose mask transformers
    builds from layer 0's length, gives every layer its own mask (presses.attention_bias.fit_mask): the logits equal
    those of the same cache padded to equal lengths with the padding masked. Without the fit, sdpa raises a size
    mismatch and eager reads the first columns (the question's causal pattern is lost)."""
    attention.install()  # what the harness does for a press with uneven_layers (evaluation.loop)
    model = _llama(attn)
    cache = prefill(build("pyramidkv", 0.5), model, PROMPT_IDS)
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    assert len(set(lengths)) == len(lengths), lengths  # every layer keeps its own count
    got = _question_logits(model, _copy(cache), T_LONG)
    want = _question_logits(model, _padded_with_bias(cache), T_LONG)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_mask_fit_changes_nothing_without_a_press():
    """A model without a press computes bit for bit what it computes without the wrapper (prefill, question,
    decode), with sdpa and eager."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention.install()
    for attn in ("sdpa", "eager"):
        model = _llama(attn)
        outs = []
        for wrapped in (True, False):
            saved = ALL_ATTENTION_FUNCTIONS.get(attn)
            if not wrapped:  # the function the wrapper wraps (kvpress's patch, or the modeling file's eager)
                if saved.__wrapped__ is None:
                    del ALL_ATTENTION_FUNCTIONS[attn]
                else:
                    ALL_ATTENTION_FUNCTIONS[attn] = saved.__wrapped__
            try:
                cache = DynamicCache()
                with torch.no_grad():
                    a = model(input_ids=PROMPT_IDS[:, :100], past_key_values=cache).logits
                b = _question_logits(model, cache, 100)
                with torch.no_grad():
                    c = model(input_ids=QUESTION[:, :1], past_key_values=cache).logits
                outs.append((a, b, c))
            finally:
                ALL_ATTENTION_FUNCTIONS[attn] = saved
        for x, y in zip(*outs):
            assert torch.equal(x, y)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pyramidkv_answers_through_the_harness(attn, monkeypatch, tmp_path):
    """Issue 32 item 3: ``python -m evaluation.run press=pyramidkv`` answers (the question forward after per-layer
    budgets) with eager and sdpa; before, the harness refused it (README Limits)."""
    from test_robustness import _tiny_harness

    from evaluation import run as entry

    cfg, names = _tiny_harness(monkeypatch, tmp_path, "pyramidkv", f"model.attn_implementation={attn}")
    metrics = entry.run(cfg, names)
    rows = [json.loads(line) for line in next(tmp_path.rglob("predictions.jsonl")).read_text().splitlines()]
    assert metrics["n"] == 2 == len(rows)
    for row in rows:
        assert isinstance(row["prediction"], str) and row["prediction"]
        assert 0.45 < row["effective_compression"] < 0.55, row["effective_compression"]  # 0.5, averaged over layers
