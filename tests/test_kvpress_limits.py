"""kvpress 0.5.5's other presses (issue 29): the input limits kvpress only asserts (or silently degrades past) are
one-line errors from the registry (:func:`evaluation.registry.press_input_problem`), each checked against what
kvpress does at the limit and one token above it; a bad parameter kvpress asserts at construction is one error
naming the press; the weights, statistics or data a press downloads are checked before any run directory exists
(:func:`evaluation.registry.press_download_problem`), without touching the network here (the hub is mocked).
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_tiny_llama
from hydra.utils import instantiate
from test_harness import composed
from transformers import DynamicCache

from evaluation import harness, hub
from evaluation import run as entry
from evaluation.guards import check_press_downloads
from evaluation.registry import press_download_problem, press_input_problem

pytestmark = pytest.mark.usefixtures("one_thread")


def _press(name: str, *overrides: str, ratio: float = 0.5):
    return instantiate(composed(f"press={name}", f"compression_ratio={ratio}", *overrides).press)


@pytest.fixture(scope="module")
def sdpa():
    return make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=1, attn_implementation="sdpa", seed=1)


@pytest.fixture(scope="module")
def eager():
    return make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=1, attn_implementation="eager", seed=1)


def _prefill(press, model, T: int) -> int:
    """Kept entries of layer 0 after a ``T``-token prefill under ``press`` (kvpress's own behaviour)."""
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(T))
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache.get_seq_length(0)


@pytest.mark.parametrize(
    "name, overrides, limit, match, kvpress_error",
    [
        (
            "chunkkv",
            (),
            64,
            r"ChunkKVPress\(SnapKVPress\): the context has T=64 tokens but needs more than "
            r"window_size=64: .* press.press.window_size",
            AssertionError,
        ),
        ("entropy_gated_chunkkv", (), 64, r"EntropyGatedChunkKVPress\(SnapKVPress\).*window_size=64", AssertionError),
        ("criticalkv", (), 64, r"CriticalKVPress\(SnapKVPress\).*window_size=64", AssertionError),
        ("merging", (), 64, r"MergingPress\(SnapKVPress\).*window_size=64", AssertionError),
        # ChunkPress scores each chunk on its own: with SnapKV, the last chunk must exceed the window too
        (
            "chunk",
            ("press.press._target_=kvpress.SnapKVPress", "++press.chunk_length=128"),
            128 + 64,
            r"ChunkPress\(SnapKVPress\): its last chunk has 64 tokens \(T=192 in chunks of chunk_length=128\)",
            AssertionError,
        ),
        (
            "compactor",
            (),
            12,
            r"CompactorPress: the context has T=12 tokens but needs more than sink_size_start "
            r"\+ sink_size_end = 12",
            RuntimeError,
        ),
        ("capkv", (), 4, r"CapPress: the context has T=4 tokens but needs more than n_sink=4", ValueError),
    ],
)
def test_input_limits_are_one_line_errors_where_kvpress_fails(sdpa, name, overrides, limit, match, kvpress_error):
    press = _press(name, *overrides)
    assert re.search(match, press_input_problem(press, sdpa, limit))
    with pytest.raises(kvpress_error):
        _prefill(press, sdpa, limit)
    assert press_input_problem(press, sdpa, limit + 1) is None
    assert _prefill(press, sdpa, limit + 1) < limit + 1  # one token more and kvpress compresses


def test_lagkv_below_two_partitions_is_refused_not_degraded(sdpa):
    """Below n_sink + 2 lag_size LagKV keeps the sinks and the most recent tokens (StreamingLLM), silently."""
    press = _press("lagkv", "+press.lag_size=32")  # 4 + 64 = 68
    assert "LagKV scores only T >= n_sink + 2 lag_size = 68" in press_input_problem(press, sdpa, 67)
    assert press_input_problem(press, sdpa, 68) is None
    keys = torch.randn(1, 2, 67, 8)
    scores = press.score(None, None, keys, keys, None, {})
    assert torch.equal(scores[..., 4:].argsort(-1), torch.arange(63).expand(1, 2, 63))  # recency order, no content
    scores = press.score(None, None, torch.randn(1, 2, 68, 8), torch.randn(1, 2, 68, 8), None, {})
    assert not torch.equal(scores[..., 4:36].argsort(-1), torch.arange(32).expand(1, 2, 32))


def test_chunk_wrappers_take_no_attention_weights(sdpa, eager):
    press = _press("chunkkv")
    assert "takes no attention weights" in press_input_problem(press, eager, 500)
    with pytest.raises(AssertionError, match="does not support attentions"):
        _prefill(press, eager, 100)
    observed = _press("chunkkv", "press.press._target_=kvpress.ObservedAttentionPress")
    assert "ObservedAttentionPress reads attention weights" in press_input_problem(observed, sdpa, 500)
    for name in ("chunkkv", "chunk", "block_keydiff"):
        field = "block_size" if name == "block_keydiff" else "chunk_length"
        assert f"{field}=0 must be >= 1" in press_input_problem(_press(name, f"++press.{field}=0"), sdpa, 500)


def test_head_masking_presses_refuse_eager(eager, sdpa):
    from kvpress import DMSPress, KnormPress

    dms = DMSPress(KnormPress(), threshold=-1.0, sliding_window_size=8)  # threshold-based: no ratio to read
    for press in (_press("critical_adakv"), _press("duo_attention"), dms):
        assert "does not support attn_implementation='eager'" in press_input_problem(press, eager, 500)
        assert press_input_problem(press, sdpa, 500) is None
    with pytest.raises(AssertionError, match="eager mode not supported"):
        _prefill(_press("critical_adakv"), eager, 100)
    with pytest.raises(AttributeError, match="masked_key_indices"):
        _prefill(dms, eager, 100)
    assert press_input_problem(_press("critical_adakv", ratio=0.0), eager, 500) is None  # ratio 0: nothing masked


def test_a_bad_press_parameter_is_one_error_naming_the_press(tmp_path):
    cfg = composed(
        "press=entropy_gated_chunkkv", "++press.chunk_length=4", f"output_dir={tmp_path}", "n_samples=1"
    )  # kvpress asserts chunk_length > low_entropy_chunk_length (4)
    names = {"press": "entropy_gated_chunkkv", "dataset": "needle", "model": "smollm2-135m"}
    with pytest.raises(
        ValueError,
        match=r"press entropy_gated_chunkkv \(kvpress.EntropyGatedChunkKVPress\): .*"
        r"chunk_length > low_entropy_chunk_length",
    ):
        entry.run(cfg, names)
    assert not list(tmp_path.glob("needle"))


# ------------------------------------------------------------------------------------- downloads (offline)
def _named(name: str, heads=(4, 2)):
    model = make_tiny_llama(num_heads=heads[0], num_kv_heads=heads[1], num_layers=1, attn_implementation="sdpa")
    model.config.name_or_path = name
    return model


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub and an empty Hugging Face cache (``tmp_path/hub``); returns a function that caches a file there."""
    from huggingface_hub import constants

    monkeypatch.setattr(hub, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def cache(repo: str, filename: str) -> None:
        root = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / "main").write_text("0" * 40)
        path = root / "snapshots" / ("0" * 40) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")

    return cache


LLAMA = "meta-llama/Meta-Llama-3.1-8B-Instruct"


@pytest.mark.parametrize(
    "name, repo, filename",
    [
        ("qfilter", "nthngdy/Llama-3.1-8B-Instruct_qfilt", "model.safetensors"),
        ("kvzap", "nvidia/KVzap-mlp-Meta-Llama-3.1-8B-Instruct", "model.safetensors"),
        ("dms", "nvidia/KVzap-mlp-Meta-Llama-3.1-8B-Instruct", "model.safetensors"),
        ("fastkvzip", "Jang-Hyun/Fast-KVzip", "meta-llama-3.1-8b-instruct/q2_dim16_sink16.pt"),
        (
            "expected_attention_stats",
            "alessiodevoto/exp_att_stats_meta-llama_Meta-Llama-3.1-8B-Instruct_kmfoda_booksum_100_1000_4",
            "model.safetensors",
        ),
    ],
)
def test_hub_weights_offline_are_one_line_naming_what_to_download(offline, name, repo, filename):
    model, press = _named(LLAMA), _press(name)
    problem = press_download_problem(press, model)
    assert repo in problem and filename in problem and "hub is unreachable" in problem
    assert f"hf download {repo}" in problem and "\n" not in problem
    with pytest.raises(OSError, match="not in the local Hugging Face cache"):
        check_press_downloads(press, model)
    offline(repo, filename)  # a copy in the local cache is enough
    assert press_download_problem(press, model) is None


def test_hub_weights_that_do_not_exist_for_the_model(monkeypatch, offline):
    import huggingface_hub

    monkeypatch.setattr(hub, "hub_reachable", lambda *a, **k: True)
    asked = []
    monkeypatch.setattr(huggingface_hub, "file_exists", lambda repo, filename: asked.append(repo) or False)
    problem = press_download_problem(_press("kvzap"), _named("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert asked == ["nvidia/KVzap-mlp-SmolLM2-135M-Instruct"] and "the hub has no" in problem
    assert "python -m evaluation.train_scorers kvzap --model HuggingFaceTB/SmolLM2-135M-Instruct" in problem
    monkeypatch.setattr(huggingface_hub, "file_exists", lambda repo, filename: True)
    assert press_download_problem(_press("kvzap"), _named("HuggingFaceTB/SmolLM2-135M-Instruct")) is None


def test_github_downloads_and_models_without_published_data(offline):
    duo, lukv = _press("duo_attention"), _press("lukv")
    assert "published attention patterns only for" in press_download_problem(duo, _named("my/model"))
    assert "this machine is offline" in press_download_problem(duo, _named("mistralai/Mistral-7B-Instruct-v0.3"))
    fly = _press("duo_attention", "+press.on_the_fly_scoring=true")
    assert "BookSum" in press_download_problem(fly, _named("my/model"))
    assert "budget curves only for meta-llama/Llama-3.1-8B-Instruct with ExpectedAttentionPress" in (
        press_download_problem(lukv, _named("my/model"))
    )
    assert "budget curve" in press_download_problem(lukv, _named("meta-llama/Llama-3.1-8B-Instruct"))
    assert press_download_problem(_press("snapkv"), _named("my/model")) is None
    assert (
        press_download_problem(_press("chunkkv", "press.press._target_=kvpress.KVzapPress"), _named(LLAMA)) is not None
    )  # found inside


def test_a_run_needing_weights_stops_before_any_run_directory(offline, monkeypatch, tmp_path):
    model = _named(LLAMA)
    tok = __import__("_tiny_tokenizer").char_tokenizer()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    cfg = composed("press=qfilter", f"output_dir={tmp_path}", "n_samples=1", "dataset.context_length=256")
    with pytest.raises(OSError, match="nthngdy/Llama-3.1-8B-Instruct_qfilt"):
        entry.run(cfg, {"press": "qfilter", "dataset": "needle", "model": "smollm2-135m"})
    assert not (tmp_path / "needle").exists()
