"""Robustness suite (issue 8, deliverable 2): every press as the harness instantiates it from
``configs/press/*.yaml``, on tiny random-weight Llamas, under the edge cases of the issue.

Each case asserts today's behaviour of each press (keeps everything / compresses / raises a clear
error); the README's "Limits" section is the table of these results. Where a kvpress baseline fails with an
``assert`` or an obscure error, :func:`evaluation.guards.check_press_input` is the harness's guard and
is asserted to raise a ``ValueError`` naming the value and the limit.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import decode_biases, make_tiny_llama
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import DynamicCache

from evaluation import harness
from evaluation import run as entry
from evaluation.guards import check_model_layout, check_press_input
from evaluation.registry import capabilities
from presses import attention

CONFIG_DIR = Path(harness.__file__).resolve().parent.parent / "configs"
OURS = ("page_entrokv", "snis_h2o", "entroprefill")
BASELINES = (
    "snapkv",
    "tova",
    "knorm",
    "streaming_llm",
    "expected_attention",
    "observed_attention",
    "pyramidkv",
    "adakv",
)
PRESSES = OURS + BASELINES
VOCAB = 260  # 256 byte tokens + <s>, </s>
T_LONG = 320  # a multiple of the yaml's page sizes (16, 32); W=64, n_sink=4: at 0.5 Page-EntroKV keeps its
#              96 protected tokens and chooses 2 pages of 32 (page_entrokv_kept)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------- helpers
def _tokenizer():
    """The byte tokenizer of tests/_tiny_tokenizer.py plus <s> / </s> (the pipeline prepends bos_token)."""
    from _tiny_tokenizer import byte_tokenizer

    tok = copy.deepcopy(byte_tokenizer())
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return tok


TOK = _tokenizer()


def _prompt_text(n_tokens: int = T_LONG - 1) -> str:
    """A multi-passage prompt ending with ``Question: ...`` of exactly ``n_tokens`` bytes (EntroPrefill
    finds its passages and question in it; the other presses see plain tokens)."""
    words = "amber anchor brave badger calm candle dusty dolphin eager engine fancy falcon gentle garden".split()
    question = "\n\nQuestion: which word comes first?\nAnswer:"
    body, p = "Read the passages.", 0
    while len(body) + len(question) < n_tokens:
        p += 1
        body += f"\n\nPassage {p}: " + " ".join(words[(p + i) % len(words)] for i in range(6)) + "."
    body = body[: n_tokens - len(question)]
    return body + question


PROMPT = _prompt_text()
PROMPT_IDS = torch.tensor([[TOK.bos_token_id] + TOK.encode(PROMPT, add_special_tokens=False)])
assert PROMPT_IDS.shape[1] == T_LONG


def page_entrokv_kept(press, T: int) -> tuple[int, int]:
    """``(protected, kept)`` of a Page-EntroKV press on ``T`` tokens (``T`` a multiple of the page size): the
    protected tokens (the sink page and the pages touching the last ``W`` positions), and those plus as many
    whole pages as fit under the strict budget ``floor(T (1 - ratio))`` (docs/methods.md §1 steps 6-8)."""
    B, W = press.page_size, press.window_size
    assert T % B == 0 and B < T - W  # whole pages; the sink page is not a window page
    budget = int(T * (1 - press.compression_ratio))
    protected = B * (1 + -(-W // B))
    return protected, protected + max(0, budget - protected) // B * B


_MODELS: dict = {}


def model_for(name: str, attn: str = "sdpa", dtype=torch.float32, heads=(4, 2)):
    """The tiny 2-layer Llama (memoised) with the attention the harness would use for ``name``
    (the registry capability ``needs_eager``: eager for ObservedAttention)."""
    attn = "eager" if name == "observed_attention" else attn
    key = (attn, dtype, heads)
    if key not in _MODELS:
        _MODELS[key] = make_tiny_llama(
            num_heads=heads[0], num_kv_heads=heads[1], num_layers=2, vocab=VOCAB, attn_implementation=attn, dtype=dtype
        )
    return _MODELS[key]


def build(name: str, ratio: float, **overrides):
    """Instantiate ``configs/press/<name>.yaml`` as the harness does (``compression_ratio`` and ``seed``
    interpolated from the top level); EntroPrefill gets the byte tokenizer."""
    node = OmegaConf.to_container(harness.compose_config([f"press={name}"]).press, resolve=False)  # defaults merged
    root = OmegaConf.create({"compression_ratio": ratio, "seed": 0, "press": node})
    for key, value in overrides.items():
        OmegaConf.update(root, f"press.{key}", value)
    press = instantiate(root.press)
    if name == "entroprefill":
        press.tokenizer = TOK
    return press


def prefill(press, model, ids, attention_mask=None):
    """Run the prefill inside ``press(model)`` like kvpress's pipeline; returns the cache. A press that may keep
    different counts per layer gets the attention wrapper that fits each layer's mask, as the harness installs it
    (the registry's ``uneven_layers``)."""
    if capabilities(press).uneven_layers:
        attention.install()
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model.model(input_ids=ids, past_key_values=cache, attention_mask=attention_mask)
        else:
            with press(model):
                model.model(input_ids=ids, past_key_values=cache, attention_mask=attention_mask)
    return cache


def decode(model, cache, T: int, batch: int = 1, **kwargs):
    """One decode step at position ``T`` (after the prompt); returns the model output."""
    with torch.no_grad():
        return model(
            input_ids=torch.full((batch, 1), 65),
            past_key_values=cache,
            position_ids=torch.full((batch, 1), T),
            **kwargs,
        )


def logical_kept(model, cache) -> list[float]:
    """Per-layer kept prompt entries: the cache length, minus AdaKV's masked keys per KV head."""
    out = []
    for i, layer in enumerate(model.model.layers):
        n = cache.get_seq_length(i)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            n -= len(masked[0]) / (cache.layers[i].keys.shape[0] * cache.layers[i].keys.shape[1])
        out.append(n)
    return out


def random_ids(T: int, seed: int = 0, batch: int = 1):
    return torch.randint(3, 250, (batch, T), generator=torch.Generator().manual_seed(seed))


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception (Hydra wraps errors raised by a ``_target_``)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


# ---------------------------------------------------------------------------------------------- short contexts
# T values where the press fails on its own (kvpress asserts / TOVA's Tensor.max on an empty score);
# check_press_input turns them into ValueErrors. T = 64 is exactly the yaml observation window.
GUARDED_SHORT = {
    "snapkv": {1, 2, 64},
    "pyramidkv": {1, 2, 64},
    "adakv": {1, 2, 64},
    "tova": {1},
    "streaming_llm": {1, 2},
    "expected_attention": {1, 2},
}


@pytest.mark.parametrize("name", PRESSES)
def test_short_context(name):
    """T in {1, 2, W=64}: the press keeps a non-empty finite cache, or a clear error is raised."""
    model = model_for(name)
    for T in (1, 2, 64):
        ids = random_ids(T)
        press = build(name, 0.5)
        if name == "entroprefill":  # query-aware: no question in a random short context
            with pytest.raises(ValueError, match=r"found no question.*query_aware=true"):
                prefill(press, model, ids)
            continue
        if T in GUARDED_SHORT.get(name, ()):
            with pytest.raises((AssertionError, RuntimeError)):  # kvpress's own failure
                prefill(press, model, ids)
            with pytest.raises(ValueError, match=rf"T={T} tokens"):
                check_press_input(press, model, T)
            continue
        check_press_input(press, model, T)  # the guard does not reject what works
        cache = prefill(press, model, ids)
        kept = logical_kept(model, cache)
        assert all(1 <= k <= T for k in kept), (T, kept)
        if name == "page_entrokv":  # T <= window_size compresses: protection shrinks, a partial page stays
            assert kept == [{1: 1, 2: 2, 64: 32}[T]] * 2, (T, kept)
            assert press.summary()["protection_shrunk"] == (T == 64)
        assert torch.isfinite(decode(model, cache, T).logits).all()
    if name == "entroprefill":  # a short prompt WITH a question but no passage: full prefill, kept whole
        press = build(name, 0.5)
        ids = torch.tensor([TOK.encode("Question: why?", add_special_tokens=False)])
        cache = prefill(press, model, ids)
        assert logical_kept(model, cache) == [ids.shape[1]] * 2
        assert press.summary()["bypass_reason"] == "no_chunks"


# ---------------------------------------------------------------------------------------------- ratios
@pytest.mark.parametrize("name", PRESSES)
def test_ratio_zero_keeps_cache_and_099_stays_nonempty(name):
    model = model_for(name)
    T = T_LONG
    full = prefill(None, model, PROMPT_IDS)
    cache = prefill(build(name, 0.0), model, PROMPT_IDS)
    for a, b in zip(cache.layers, full.layers):  # ratio 0: the cache is unchanged, bit for bit
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in model.model.layers)

    if name == "page_entrokv":  # protected sink + window pages exceed b = floor(0.01 T) = 3
        press = build(name, 0.99)  # default: protection shrinks to what fits (no whole page fits in b)
        b = int(T * (1 - 0.99))
        protected, _ = page_entrokv_kept(press, T)
        cache = prefill(press, model, PROMPT_IDS)
        assert all(k <= b for k in logical_kept(model, cache))  # the strict budget holds
        assert press.summary()["protection_shrunk"] == 1
        assert torch.isfinite(decode(model, cache, T).logits).all()
        with pytest.raises(ValueError, match=rf"budget conflict.*{protected} tokens.*b={b}"):
            prefill(build(name, 0.99, on_budget_conflict="raise"), model, PROMPT_IDS)
        press = build(name, 0.99, on_budget_conflict="keep_protected")
        cache = prefill(press, model, PROMPT_IDS)
        assert logical_kept(model, cache) == [protected] * 2 and press.summary()["budget_conflict"] == 1
    else:
        press = build(name, 0.99)
        check_press_input(press, model, T)
        cache = prefill(press, model, PROMPT_IDS)
        kept = logical_kept(model, cache)
        if name == "entroprefill":  # the question and instruction are protected; pruning may bypass
            q0 = press._plan.question[0]
            assert all(T - q0 <= k <= T for k in kept)
        else:
            assert all(1 <= k <= 0.1 * T for k in kept), kept
    assert torch.isfinite(decode(model, cache, T).logits).all()


@pytest.mark.parametrize("name", PRESSES)
def test_ratio_outside_unit_interval_is_rejected(name):
    for bad in (1.0, 1.2, -0.1):
        with pytest.raises(Exception) as info:
            build(name, bad)
        err = root_cause(info.value)
        if name in OURS:
            assert isinstance(err, ValueError) and f"compression_ratio={bad} must be in [0, 1)" in str(err)
        else:  # kvpress's ScorerPress asserts; the harness's check_ratio is the guard
            assert isinstance(err, AssertionError)
        with pytest.raises(ValueError, match=rf"compression_ratio={bad} must be in \[0, 1\)"):
            harness.check_ratio(bad)


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_harness_rejects_bad_ratio_before_loading_a_model(monkeypatch, tmp_path):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded for a bad ratio")

    monkeypatch.setattr(harness, "get_model", no_model)
    cfg = _compose("press=snapkv", "compression_ratio=1.2", f"output_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"compression_ratio=1.2 must be in \[0, 1\)"):
        entry.run(cfg, {"press": "snapkv", "dataset": "needle", "model": "smollm2-135m"})
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize("name", PRESSES)
def test_pipeline_empty_question_and_decode_position(name):
    """kvpress's pipeline with question="" (the query-aware path of the harness): an answer comes back,
    the first new token sits at position T, and the model's cache_position is the compressed length."""
    from kvpress import KVPressTextGenerationPipeline

    model = model_for(name)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=TOK, device=torch.device("cpu"))
    seen = []

    def spy(module, args, kwargs):
        seen.append((kwargs["position_ids"][0].tolist(), kwargs["cache_position"].tolist()))

    press = build(name, 0.5)
    handle = model.model.layers[0].register_forward_pre_hook(spy, with_kwargs=True)
    cache = DynamicCache()
    try:
        with torch.no_grad():
            answer = pipe(PROMPT, question="", press=press, max_new_tokens=2, cache=cache)["answer"]
    finally:
        handle.remove()
    assert isinstance(answer, str)
    T = T_LONG
    kept = cache.get_seq_length(0)  # the pipeline removes question and answer from the cache afterwards
    assert 1 <= kept <= T
    if name not in ("adakv", "entroprefill"):
        assert kept < T  # compressed (AdaKV masks keys in a dense cache; EntroPrefill may bypass)
    (pre_pos, _), (q_pos, q_cache), (g_pos, g_cache) = seen[0], seen[1], seen[2]
    assert pre_pos[0] == 0 and len(pre_pos) == T  # prefill
    assert q_pos[0] == T and q_cache[0] == kept  # question "\n": RoPE position T, stored after the kept entries
    assert g_pos == [T + len(q_pos)] and g_cache == [kept + len(q_pos)]


# ---------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", PRESSES)
def test_low_precision_logits_finite(name, dtype):
    model = model_for(name, dtype=dtype)
    press = build(name, 0.5)
    cache = prefill(press, model, PROMPT_IDS)
    kept = logical_kept(model, cache)
    assert all(1 <= k <= T_LONG for k in kept)
    assert all(layer.keys.dtype == dtype for layer in cache.layers)
    out = decode(model, cache, T_LONG)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_snis_padded_entries_get_zero_attention(dtype):
    model = model_for("snis_h2o", attn="eager", dtype=dtype)
    press = build("snis_h2o", 0.5)
    cache = prefill(press, model, PROMPT_IDS)
    out = decode(model, cache, T_LONG, output_attentions=True)
    n_padded = 0
    for layer, attn in zip(model.model.layers, out.attentions):
        bias = decode_biases(cache)[layer.self_attn.layer_idx]  # (B, G, P): -inf on padding
        r = attn.shape[1] // bias.shape[1]
        pad = torch.isinf(bias).repeat_interleave(r, dim=1)  # (B, H_Q, P)
        probs = attn[:, :, -1, : bias.shape[-1]]
        n_padded += int(pad.sum())
        if pad.any():
            assert float(probs[pad].abs().max()) == 0.0
        assert torch.isfinite(attn).all()
    assert n_padded > 0  # the groups kept different counts, so some slots are padding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_adakv_masked_keys_get_zero_attention(dtype, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = model_for("adakv", dtype=dtype)
    cache = prefill(build("adakv", 0.5), model, PROMPT_IDS)
    masked = [layer.self_attn.masked_key_indices for layer in model.model.layers]
    captured = []
    inner = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        out = inner(module, query, key, value, attention_mask, *args, **kwargs)  # kvpress patches key in place
        captured.append((query.float(), key.float(), kwargs.get("scaling")))
        return out

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    assert torch.isfinite(decode(model, cache, T_LONG).logits).all()
    for (query, key, scaling), (b, h, s) in zip(captured, masked):
        r = query.shape[1] // key.shape[1]
        probs = torch.softmax(query @ key.repeat_interleave(r, 1).transpose(-1, -2) * scaling, -1)  # (B,H,1,K)
        probs = probs.view(query.shape[0], key.shape[1], r, -1)
        assert len(s) > 0 and float(probs[b, h, :, s].max()) < 1e-6


# ---------------------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("name", PRESSES)
def test_sdpa_and_eager_agree(name):
    if name == "observed_attention":  # reads the eager attention weights: the harness switches to eager
        press = build(name, 0.5)
        assert capabilities(press).needs_eager
        with pytest.raises(AssertionError, match="eager"):
            prefill(press, make_tiny_llama(num_layers=2, vocab=VOCAB, attn_implementation="sdpa"), PROMPT_IDS)
        return
    if name == "adakv":  # kvpress masks keys through sdpa/flash only
        eager = model_for(name, attn="eager")
        with pytest.raises(AssertionError, match="eager mode not supported"):
            prefill(build(name, 0.5), eager, PROMPT_IDS)
        with pytest.raises(ValueError, match="does not support attn_implementation='eager'"):
            check_press_input(build(name, 0.5), eager, T_LONG)
        return
    results = {}
    for attn in ("sdpa", "eager"):
        model = model_for(name, attn=attn)
        cache = prefill(build(name, 0.5), model, PROMPT_IDS)
        results[attn] = (cache, decode(model, cache, T_LONG).logits)
    (c_s, l_s), (c_e, l_e) = results["sdpa"], results["eager"]
    for a, b in zip(c_s.layers, c_e.layers):  # same kept entries (in the same slots)
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(l_s, l_e, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- batches
BATCH_EQUALS_SINGLE = {n for n in PRESSES if n not in ("entroprefill", "snis_h2o")}


@pytest.mark.parametrize("name", PRESSES)
def test_batch_of_two(name):
    """Equal-length rows (no padding): deterministic presses give per-row caches equal to single runs;
    SNIS supports batches with its own draws per batch; EntroPrefill raises."""
    model = model_for(name)
    rows = torch.cat([PROMPT_IDS, random_ids(T_LONG, seed=1)])
    if name == "entroprefill":
        with pytest.raises(ValueError, match="supports batch size 1, got 2"):
            prefill(build(name, 0.5), model, rows)
        return
    batch = prefill(build(name, 0.5), model, rows)
    n_batch = [batch.get_seq_length(i) for i in range(2)]
    assert torch.isfinite(decode(model, batch, T_LONG, batch=2).logits).all()  # appends one entry per layer
    if name == "snis_h2o":  # one generator for the batch, layer padded to the batch's largest kept count
        stats = build(name, 0.5)
        for b in range(2):
            single = prefill(stats, model, rows[b : b + 1])
            assert 1 <= single.get_seq_length(0) < T_LONG
        assert all(1 <= n < T_LONG for n in n_batch)
        return
    masked_batch = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    for b in range(2):
        single = prefill(build(name, 0.5), model, rows[b : b + 1])
        for i, (a, s) in enumerate(zip(batch.layers, single.layers)):
            assert n_batch[i] == s.keys.shape[2]
            if name != "adakv":
                torch.testing.assert_close(a.keys[b : b + 1, :, : n_batch[i]], s.keys, atol=1e-5, rtol=1e-5)
                continue
            # AdaKV: the same keys masked in row b as in the single run, and the same unmasked keys (a masked
            # slot holds a "fake key" that kvpress fits to the whole batch's queries, so it may differ)
            mb, ms = masked_batch[i], model.model.layers[i].self_attn.masked_key_indices
            got = {(int(h), int(t)) for bb, h, t in zip(*mb) if int(bb) == b}
            assert got == {(int(h), int(t)) for h, t in zip(ms[1], ms[2])}
            keep = torch.ones(s.keys.shape[1:3], dtype=torch.bool)
            for h, t in got:
                keep[h, t] = False
            torch.testing.assert_close(a.keys[b, :, : n_batch[i]][keep], s.keys[0][keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["page_entrokv", "streaming_llm"])
def test_left_padding_is_not_masked_in_scoring(name):
    """Caveat: presses ignore the attention mask when scoring, so left-padding can be KEPT (here the
    pads sit on the protected sink positions). The harness never batches (kvpress's pipeline is batch 1)."""
    model = model_for(name)
    n_pad = 8
    ids = PROMPT_IDS.repeat(2, 1)
    ids[1, :n_pad] = 0
    mask = torch.ones_like(ids)
    mask[1, :n_pad] = 0
    full = prefill(None, model, ids, attention_mask=mask)
    cache = prefill(build(name, 0.5), model, ids, attention_mask=mask)
    assert cache.get_seq_length(0) < T_LONG
    # the pads at the n_sink=4 first positions of row 1 are kept (in any slot: kvpress keeps top-k order)
    kept, pads = cache.layers[0].keys[1], full.layers[0].keys[1, :, :4]  # (G, n, d), (G, 4, d)
    assert (kept.unsqueeze(2) == pads.unsqueeze(1)).all(-1).any(1).all()


# ---------------------------------------------------------------------------------------------- MHA / MQA
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["MHA_r1", "MQA_rHQ"])
@pytest.mark.parametrize("name", PRESSES)
def test_mha_and_mqa(name, heads):
    model = model_for(name, heads=heads)
    press = build(name, 0.5)
    cache = prefill(press, model, PROMPT_IDS)
    kept = logical_kept(model, cache)
    assert all(layer.keys.shape[1] == heads[1] for layer in cache.layers)
    if name == "page_entrokv":  # pages are chosen beyond the protected ones (scoring runs with r = 1 and r = H_Q)
        protected, expected = page_entrokv_kept(press, T_LONG)
        assert expected > protected and kept == [expected] * len(kept), kept
    elif name == "entroprefill":
        assert all(1 <= k <= T_LONG for k in kept)
    else:
        assert all(1 <= k < T_LONG for k in kept), kept
    assert torch.isfinite(decode(model, cache, T_LONG).logits).all()


# ---------------------------------------------------------------------------------------------- GPU kernels
@pytest.mark.parametrize("name", PRESSES)
def test_which_presses_use_the_kernel_dispatch(name, monkeypatch):
    """GPU kernels: Page-EntroKV's scoring, the SNIS proposals' column sums and EntroPrefill's per-row chunk
    masses go through presses.kernels (Triton on CUDA; the SNIS decode step too, see tests/test_kernels.py);
    the others run torch code on every device."""
    import presses.kernels as kernels

    calls = []
    real = kernels.use_triton
    monkeypatch.setattr(kernels, "use_triton", lambda t: calls.append(t.device) or real(t))
    prefill(build(name, 0.25), model_for(name), PROMPT_IDS)  # 0.25: Page-EntroKV has pages left to choose
    assert bool(calls) == (name in ("page_entrokv", "snis_h2o", "entroprefill"))


# ---------------------------------------------------------------------------------------------- models
def test_unsupported_model_class_gets_a_clear_message():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    ids = random_ids(16)
    for name in PRESSES:
        press = build(name, 0.5)
        with pytest.raises(AttributeError, match="has no attribute 'model'"):  # the presses' own failure
            prefill(press, gpt2, ids)
        with pytest.raises(ValueError, match="model class GPT2LMHeadModel is not supported"):
            check_press_input(press, gpt2, 16)
    check_model_layout(model_for("knorm"))  # a Llama passes


# ---------------------------------------------------------------------------------------------- harness
def _tiny_harness(monkeypatch, tmp_path, press: str, *overrides, n_samples=2, depths="[0,100]"):
    """Compose the harness config (needle, tiny lengths) and serve the tiny Llama + byte tokenizer
    (saved next to the run, as ``name_or_path``, for EntroPrefill's tokenizer loading)."""
    tok_dir = tmp_path / "tokenizer"
    TOK.save_pretrained(tok_dir)

    def tiny(model_cfg, device, attn, variant=""):
        model = model_for(press, attn=attn)
        model.name_or_path = str(tok_dir)
        return model, TOK

    monkeypatch.setattr(harness, "get_model", tiny)
    cfg = _compose(
        f"press={press}",
        "compression_ratio=0.5",
        f"output_dir={tmp_path / 'runs'}",
        f"n_samples={n_samples}",
        "max_new_tokens=2",
        "dataset.context_length=640",
        f"dataset.depths={depths}",
        *overrides,
    )
    return cfg, {"press": press, "dataset": "needle", "model": "smollm2-135m"}


@pytest.mark.parametrize("name", PRESSES)
def test_needle_depth_0_and_100_through_the_harness(name, monkeypatch, tmp_path):
    """The harness's needle dataset (byte tokenizer, ~640 tokens) at depths 0 and 100 %, query-aware
    (empty question after compression) for EntroPrefill, whose needle question has no "Question:"."""
    extra = ["query_aware=true", "++press.question_pattern='What is the special'"] if name == "entroprefill" else []
    cfg, names = _tiny_harness(monkeypatch, tmp_path, name, *extra)
    if name == "adakv":  # kvpress's fake-key search finds no hyperplane for a random model's isotropic queries
        with pytest.raises(ValueError, match="Could not find fake keys"):
            entry.run(cfg, names)
        return
    metrics = entry.run(cfg, names)
    rows = [json.loads(line) for line in next(tmp_path.rglob("predictions.jsonl")).read_text().splitlines()]
    assert metrics["n"] == 2 and sorted(r["depth"] for r in rows) == [0.0, 100.0]
    for row in rows:
        assert isinstance(row["prediction"], str) and 0 <= row["score"] <= 1
        assert 0 <= row["effective_compression"] < 1
        if name in (
            "page_entrokv",
            "snapkv",
            "knorm",
            "tova",
            "streaming_llm",
            "expected_attention",
            "observed_attention",
        ):
            assert row["effective_compression"] >= 0.5 - 1 / row["context_length"]
        if name == "page_entrokv":
            assert row["press_stats"]["kept_tokens"] <= row["context_length"] // 2


def test_killed_run_resumes_without_lost_or_duplicated_rows(monkeypatch, tmp_path):
    """A run killed after its first row (no metrics.json) resumes with the missing rows only.
    (Complements test_harness.py: torn last line, and the slow embedded-model rerun.)"""
    cfg, names = _tiny_harness(monkeypatch, tmp_path, "page_entrokv", n_samples=3, depths="[0,50,100]")
    real_append = harness.append_row

    def killed_after_first(path, row):
        real_append(path, row)
        raise KeyboardInterrupt  # the job is killed right after the first row is fsynced

    monkeypatch.setattr(harness, "append_row", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        entry.run(cfg, names)
    pred = next(tmp_path.rglob("predictions.jsonl"))
    first = [json.loads(line) for line in pred.read_text().splitlines()]
    assert len(first) == 1 and not (pred.parent / "metrics.json").exists()
    monkeypatch.setattr(harness, "append_row", real_append)
    metrics = entry.run(cfg, names)
    rows = [json.loads(line) for line in pred.read_text().splitlines()]
    assert metrics["n"] == 3 and len(rows) == 3 and len({r["id"] for r in rows}) == 3
    assert rows[0] == first[0]  # the finished row was not redone
    assert math.isfinite(metrics["score"])


def test_harness_raises_clear_error_for_too_short_context(monkeypatch, tmp_path):
    cfg, names = _tiny_harness(monkeypatch, tmp_path, "snapkv", "++press.window_size=1024")
    with pytest.raises(
        ValueError, match=r"SnapKVPress: the context has T=\d+ tokens but needs more than window_size=1024"
    ):
        entry.run(cfg, names)
