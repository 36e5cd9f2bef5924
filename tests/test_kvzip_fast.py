"""KVzip's scores at a lower cost (``presses.KVzipFastPress``, configs ``kvzip_fast`` / ``kvzip_plus_fast``;
docs/methods.md §1.18): its scores are kvpress's KVzip scores (KVzip+'s with the normalisation) to float round-off,
fused into the reconstruction forward's attention or recomputed, so it masks what kvpress's KVzip masks; it runs
in kvpress's pipeline and in ``evaluation.fused`` as ``evaluation.run`` runs it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _tiny_models import make_tiny_family
from _tiny_tokenizer import char_tokenizer
from hydra.utils import instantiate
from kvpress import KVzipPress
from test_harness import composed
from test_kvzip_path import _assert_fused_equals_separate, _runs, passes, tiny  # noqa: F401 (fixtures)
from transformers import DynamicCache

from evaluation import fused, kvzip_path
from evaluation import run as entry
from evaluation.registry import capabilities
from presses import KVzipFastPress
from presses.core.kvzip_scores import (
    attention_with_lse,
    attention_with_lse_reference,
    reconstruction_column_maxes,
    value_output_norms,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _scored(press, model, ids):
    """The press's raw scores ``(L, 1, G, T)`` (before the sinks are raised) and its masks, from its own prefill."""
    kept = {}
    real = type(press).compress_post

    def keep(self, model):
        kept["scores"] = self.score_val.clone()
        real(self, model)

    type(press).compress_post, restore = keep, real
    try:
        with torch.inference_mode(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
    finally:
        type(press).compress_post = restore
    return kept["scores"], kvzip_path.take_masked_keys(model)


def _kept(masks, model, T: int) -> set:
    L, G = len(masks), model.config.num_key_value_heads
    masked = {(layer, int(h), int(p)) for layer, m in enumerate(masks) for _, h, p in zip(*m)}
    return {(layer, h, p) for layer in range(L) for h in range(G) for p in range(T)} - masked


@pytest.fixture(params=["llama", "qwen3-4b", "qwen2.5-1.5b"])
def family(request, tmp_path):
    """A tiny random-weight model (the project's tiny Llama, or a family of tests/_tiny_models.py: Qwen3's q/k norms,
    Qwen2's biases) whose checkpoint path holds the character tokenizer KVzip reloads."""
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    if request.param == "llama":
        from conftest import make_tiny_llama

        model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa", seed=4)
    else:
        model = make_tiny_family(request.param, vocab=128, seed=1)
    model.config.name_or_path = str(tmp_path)
    return model


def test_attention_with_lse_is_softmax_attention_and_its_normaliser():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 9, 8, generator=g) for _ in range(3))
    for causal in (False, True):
        logits = q @ k.transpose(-1, -2) * 0.3
        if causal:
            logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        for fn in (attention_with_lse, attention_with_lse_reference):
            out, lse = fn(q, k, v, causal, 0.3)
            torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
            torch.testing.assert_close(out, torch.softmax(logits, -1) @ v)


def test_column_maxes_are_the_weighted_softmax_maxima():
    """Against the explicit ``(H, n, keys)`` weights: a softmax over more keys than those scored, row and column
    weights (KVzip+), the max over the group's heads."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 6, 700, 8, generator=g), torch.randn(1, 2, 50, 8, generator=g)
    extra = torch.randn(1, 2, 30, 8, generator=g)  # in the softmax, not scored
    allk = torch.cat([k, extra], 2).repeat_interleave(3, dim=1)
    logits = q @ allk.transpose(-1, -2) * 0.35
    probs = torch.softmax(logits, -1)[..., :50]  # (1, 6, 700, 50)
    rows, cols = torch.rand(1, 700, generator=g) + 0.5, torch.rand(1, 6, 50, generator=g)
    lse = torch.logsumexp(logits, -1)
    plain = reconstruction_column_maxes(q, k, lse, 0.35)
    torch.testing.assert_close(plain, probs.view(1, 2, 3, 700, 50).amax(dim=(2, 3)))
    weighted = reconstruction_column_maxes(q, k, lse, 0.35, rows, cols)
    expected = (probs * rows[:, None, :, None] * cols[:, :, None, :]).view(1, 2, 3, 700, 50).amax(dim=(2, 3))
    torch.testing.assert_close(weighted, expected)
    with pytest.raises(ValueError, match="num_kv_heads=4 must divide num_heads=6"):
        reconstruction_column_maxes(q, torch.randn(1, 4, 5, 8), lse, 0.35)


def test_value_output_norms_are_kvpress_ones(family):
    module = family.model.layers[0].self_attn
    G, d = family.config.num_key_value_heads, module.head_dim
    values = torch.randn(1, G, 20, d, generator=torch.Generator().manual_seed(2))
    expected = KVzipPress._compute_value_output_norm(None, module, values)  # (1, G, r, 20)
    torch.testing.assert_close(value_output_norms(module, values), expected.reshape(1, -1, 20), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("plus", [False, True])
@pytest.mark.parametrize("fused_attention", [True, False])
@pytest.mark.parametrize("chunk_size", [2048, 96])
def test_scores_and_kept_sets_are_kvpress_kvzips(family, plus, fused_attention, chunk_size, monkeypatch):
    """One chunk and three (sinks, a skipped rest of the cache, the previous chunk's postfix in the prompt); fused,
    the hooks recompute nothing."""
    T = 250
    recomputed = []
    real = KVzipFastPress._queries_and_lse
    monkeypatch.setattr(KVzipFastPress, "_queries_and_lse", lambda *a: recomputed.append(1) or real(*a))
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(3))
    settings = dict(compression_ratio=0.6, kvzip_plus_normalization=plus, chunk_size=chunk_size)
    expected, expected_masks = _scored(KVzipPress(**settings), family, ids)
    scores, masks = _scored(KVzipFastPress(**settings, fused=fused_attention), family, ids)
    assert scores.shape == expected.shape and float(expected.abs().max()) > 0
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)
    assert _kept(masks, family, T) == _kept(expected_masks, family, T)
    assert len(recomputed) == (0 if fused_attention else family.config.num_hidden_layers * -(-T // chunk_size))


def test_the_fused_pass_leaves_the_attention_functions_and_the_model_output_as_they_were(family):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = torch.randint(4, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    before = dict(ALL_ATTENTION_FUNCTIONS.items())
    with torch.inference_mode():
        reference = family(ids).logits
        with KVzipFastPress(0.5)(family):
            family.model(input_ids=ids, past_key_values=DynamicCache())
        kvzip_path.take_masked_keys(family)
        assert dict(ALL_ATTENTION_FUNCTIONS.items()) == before
        torch.testing.assert_close(family(ids).logits, reference)


@pytest.mark.parametrize("registered", [False, True])
def test_refusals(family, registered, monkeypatch):
    """An eager model is refused by name, also when some module has put an "eager" entry in transformers' attention
    registry (an eager model never calls through it: the first full-suite run failed on that order)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if registered:
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "eager", ALL_ATTENTION_FUNCTIONS["sdpa"])
    family.config._attn_implementation = "eager"
    ids = torch.randint(4, 128, (1, 40))
    with pytest.raises(ValueError, match="attn_implementation='eager': KVzipFastPress\\(fused=True\\) needs sdpa"):
        with torch.inference_mode(), KVzipFastPress(0.5)(family):
            family.model(input_ids=ids, past_key_values=DynamicCache())


def test_config_and_capabilities():
    fast = instantiate(composed("press=kvzip_fast", "compression_ratio=0.5").press)
    plus = instantiate(composed("press=kvzip_plus_fast", "compression_ratio=0.5").press)
    assert isinstance(fast, KVzipFastPress) and fast.fused and not fast.kvzip_plus_normalization
    assert isinstance(plus, KVzipFastPress) and plus.kvzip_plus_normalization
    assert (fast.chunk_size, fast.n_sink, fast.layerwise) == (KVzipPress.chunk_size, KVzipPress.n_sink, False)
    assert capabilities(fast) == replace(capabilities(KVzipPress(0.5)), scores_as=None)
    assert kvzip_path.pass_key(fast) != kvzip_path.pass_key(KVzipPress(0.5))  # its own pass: its forwards differ
    assert kvzip_path.pass_key(fast) == kvzip_path.pass_key(plus)


def test_fused_equals_separate_runs(tiny, tmp_path, passes):  # noqa: F811 (fixtures)
    """``evaluation.fused`` with kvzip_fast and kvzip_plus_fast (one pass, each its scores) gives what
    ``evaluation.run`` gives, with kvpress's KVzip beside them."""
    presses, ratios = ["kvzip", "kvzip_fast", "kvzip_plus_fast"], [0.5]
    for cfg, names in _runs(presses, ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    assert len(passes) == 2 * 3
    passes.clear()
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused"), "test")
    assert len(passes) == 2 * 2  # per example: kvpress's KVzip pass and the fast presses' one
    _assert_fused_equals_separate(tmp_path, presses, ratios)


@pytest.mark.parametrize("n_sink", [0, KVzipPress.n_sink])
def test_prompts_of_a_few_tokens_score_as_kvpress_and_keep_an_entry_per_head(family, n_sink):
    for T in (1, 2, 3, 9):
        ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(T))
        expected, _ = _scored(KVzipPress(0.95, n_sink=n_sink), family, ids)
        scores, masks = _scored(KVzipFastPress(0.95, n_sink=n_sink), family, ids)
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)
        kept = _kept(masks, family, T)
        heads = {
            (layer, h)
            for layer in range(family.config.num_hidden_layers)
            for h in range(family.config.num_key_value_heads)
        }
        assert {(layer, h) for layer, h, _ in kept} >= heads, T


def test_the_cost_study_counts_kept_sets_from_kvpress_masks():
    from evaluation.studies.kvzip_fast import RATIOS, VARIANTS, jaccard, kept_mask, readme

    masks = ((torch.tensor([0, 0]), torch.tensor([1, 0]), torch.tensor([2, 0])), None)
    kept = kept_mask(masks, (2, 2, 3))
    assert int(kept.sum()) == 10 and not kept[0, 1, 2] and not kept[0, 0, 0] and kept[1].all()
    other = kept.clone()
    other[1, 0, 0] = False
    assert jaccard(kept, kept) == 1.0 and jaccard(kept, other) == 9 / 10
    rows = [
        {"example": "e", "tokens": 9, "variant": v, "prefill_cpu_s": "2", "cpu_s": str(4 + i)}
        | {f"jaccard_{r:g}": "1" for r in RATIOS}
        for i, v in enumerate(VARIANTS)
    ]
    text = readme(rows, ["1", "8", "out"], "x")
    assert "`python scripts/kvzip_fast.py 1 8 out`" in text
    assert f"| {next(iter(VARIANTS))} | 4.0 | 2.00 |" in text
