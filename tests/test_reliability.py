"""Reliability (issue 32): per-layer cache lengths, chunked prefill, cache kinds, stop tokens, torch.compile, devices
and seeds, autograd, Triton's cache. Each test names the item of the issue it covers; the README's Limits section has
one row per item. Model families and sliding-window layers (items 1-2) are in ``tests/test_model_families.py``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama
from test_robustness import PROMPT_IDS, T_LONG, VOCAB, build, prefill
from transformers import Cache, DynamicCache, QuantizedCache
from transformers.cache_utils import QuantizedLayer

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


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_per_layer_compression_answers_through_the_harness(attn, monkeypatch, tmp_path):
    """kvpress's PerLayerCompressionPress (config ``per_layer_compression``): one ratio per layer of the 2-layer model,
    their mean the run's ratio; each layer keeps its own share, and the question forward answers."""
    from test_robustness import _tiny_harness

    from evaluation import run as entry

    ratios = "press.compression_ratios=[0.25,0.75]"
    cfg, names = _tiny_harness(
        monkeypatch, tmp_path, "per_layer_compression", ratios, f"model.attn_implementation={attn}"
    )
    metrics = entry.run(cfg, names)
    rows = [json.loads(line) for line in next(tmp_path.rglob("predictions.jsonl")).read_text().splitlines()]
    assert metrics["n"] == 2 == len(rows)
    for row in rows:
        assert isinstance(row["prediction"], str) and row["prediction"]
        assert 0.45 < row["effective_compression"] < 0.55, row["effective_compression"]  # (0.25 + 0.75) / 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["press.compression_ratios=[0.5,0.5,0.5]"], "compression_ratios has 3 values, the model has 2 layers"),
        (["press.compression_ratios=[0.25,0.5]"], "the mean of compression_ratios is 0.375, the run's compression_"),
    ],
)
def test_per_layer_compression_refuses_a_list_that_does_not_fit(overrides, message, monkeypatch, tmp_path):
    from test_robustness import _tiny_harness

    from evaluation import run as entry

    cfg, names = _tiny_harness(monkeypatch, tmp_path, "per_layer_compression", *overrides)
    with pytest.raises(ValueError, match=message):
        entry.run(cfg, names)
    assert not list(tmp_path.rglob("predictions.jsonl"))


# ---------------------------------------------------------------------------------------------- item 4
OURS = ("page_entrokv", "snis_h2o", "snis_h2o_page", "entroprefill")


@pytest.mark.parametrize("name", [*OURS, "snapkv"])
def test_a_prompt_in_chunks_is_refused(name):
    """Issue 32 item 4 (kvpress #186): a 320-token prompt prefilled as two 160-token forwards inside one
    ``with press(model)`` block kept 224 (Page-EntroKV), 245 (probabilistic) and 240 (kvpress SnapKV) entries against
    a budget of 160, silently; the second chunk is refused in one line, for this project's presses and kvpress's."""
    model = _llama()
    press = build(name, 0.5)
    cache = DynamicCache()
    half = T_LONG // 2
    # EntroPrefill needs the question in its prefill: the whole prompt first, then a chunk more
    first, second = (PROMPT_IDS, PROMPT_IDS[:, :half]) if name == "entroprefill" else PROMPT_IDS.split(half, dim=1)
    with torch.no_grad(), press(model):
        model.model(input_ids=first, past_key_values=cache)
        kept = cache.get_seq_length()
        with pytest.raises(ValueError, match=r"a forward of 160 tokens on a cache of .* prompt in chunks"):
            model.model(input_ids=second, past_key_values=cache)
        assert cache.get_seq_length() == kept  # nothing of the second chunk was stored
        position = torch.tensor([[first.shape[1]]])  # after the prompt (a compressed cache refuses positions inside it)
        model(input_ids=QUESTION[:, :1], past_key_values=cache, position_ids=position)  # one token inside: fine


def test_generate_with_prefill_chunks_is_refused_and_plain_generate_is_not():
    """``model.generate(..., prefill_chunk_size=...)`` inside the block is refused; without chunks (one prefill, then
    one token per step) it runs, as kvpress's README uses it."""
    model = _llama()
    press = build("page_entrokv", 0.5)
    with torch.no_grad(), press(model):
        with pytest.raises(ValueError, match="prompt in chunks"):
            model.generate(PROMPT_IDS, max_new_tokens=2, do_sample=False, prefill_chunk_size=100, pad_token_id=0)
        out = model.generate(PROMPT_IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, T_LONG + 2)


# ---------------------------------------------------------------------------------------------- item 5
class _RoundingLayer(QuantizedLayer):
    """A quantized cache layer whose "quantization" rounds to float16 (transformers' quanto and hqq backends are not
    installed here); the storage works as QuantizedLayer's: a quantized part plus a residual of recent entries."""

    def _quantize(self, tensor, axis):
        return tensor.to(torch.float16)

    def _dequantize(self, qtensor):
        return qtensor.to(torch.float32)


class RoundingCache(QuantizedCache):
    def __init__(self, num_layers: int):
        Cache.__init__(self, layers=[_RoundingLayer(residual_length=16) for _ in range(num_layers)])


def _layer0_calls(model) -> list:
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("name", OURS)
def test_cache_kinds(name):
    """Issue 32 item 5 (kvpress #27, PR #30): a QuantizedCache works with Page-EntroKV (kvpress's forward hook prunes
    its quantized storage) and is refused by the others; a StaticCache and an offloading cache are refused by every
    press of this project; every refusal comes before the first layer runs, in one line."""
    from transformers import StaticCache

    model = make_tiny_llama(num_layers=2, vocab=VOCAB, attn_implementation="sdpa", seed=3)
    calls = _layer0_calls(model)
    caches = {  # the cache, and the reason a refusal names
        "QuantizedCache": (RoundingCache(2), "RoundingCache keeps the entries in quantized storage"),
        "StaticCache": (StaticCache(config=model.config, max_cache_len=T_LONG + 8), "StaticCache stores entries at"),
        "offloading": (DynamicCache(offloading=True), r"DynamicCache\(offloading=True\) moves each layer off"),
    }
    for kind, (cache, reason) in caches.items():
        press = build(name, 0.5)
        if kind == "QuantizedCache" and name == "page_entrokv":
            with torch.no_grad(), press(model):
                model.model(input_ids=PROMPT_IDS, past_key_values=cache)
            dense = prefill(build(name, 0.5), model, PROMPT_IDS)
            assert [cache.get_seq_length(i) for i in range(2)] == [dense.get_seq_length(i) for i in range(2)]
            with torch.no_grad():
                got = model(input_ids=QUESTION[:, :1], past_key_values=cache, position_ids=torch.tensor([[T_LONG]]))
            want = _question_logits(model, dense, T_LONG)[:, :1]
            torch.testing.assert_close(got.logits, want, atol=2e-2, rtol=0)  # float16 storage
            continue
        calls.clear()
        with pytest.raises(ValueError, match=rf"cannot compress this cache: {reason}.*; use a DynamicCache"):
            with torch.no_grad(), press(model):
                model.model(input_ids=PROMPT_IDS, past_key_values=cache)
        assert not calls  # refused before the prefill


# ---------------------------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_is_refused(how):
    """Issue 32 item 7 (pytorch #117758): hooks registered after torch.compile never run in the compiled graph, so a
    compiled model was silently not compressed; entering ``with press(model)`` refuses it in one line, for this
    project's presses and kvpress's. (Compilation is lazy: nothing is compiled here.)"""
    for name in (*OURS, "snapkv"):
        model = make_tiny_llama(num_layers=1, vocab=VOCAB, attn_implementation="sdpa")
        if how == "model.compile()":
            model.compile()
        else:
            model = torch.compile(model)
        with pytest.raises(ValueError, match=r"the model is compiled .*pytorch #117758"):
            with build(name, 0.5)(model):
                pass


# ---------------------------------------------------------------------------------------------- item 6
def _chat_tokenizer():
    """The tests' byte tokenizer with a chat template that ends each turn with its own special token ``<eot>``."""
    import copy

    from test_robustness import TOK

    tok = copy.deepcopy(TOK)
    tok.add_special_tokens({"additional_special_tokens": ["<eot>"]})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<eot>{% endfor %}"
    return tok


def _always(model, token: int):
    """Make ``model`` answer ``token`` at every step (a hook on its output head)."""

    def hook(module, args, output):
        output = output.clone()
        output[..., token] += 1e4
        return output

    return model.lm_head.register_forward_hook(hook)


def test_stop_tokens_are_the_union_and_an_empty_union_names_the_model():
    """Issue 32 item 6: the stop tokens are the union of the model config's, the generation config's and the
    tokenizer's eos_token_id and the chat template's end-of-turn token; none at all is an error naming the model."""
    import copy

    from evaluation.guards import check_model
    from evaluation.pipeline import end_of_turn_token, stop_token_ids

    tok = _chat_tokenizer()
    eot = tok.convert_tokens_to_ids("<eot>")
    model = make_tiny_llama(num_layers=1, vocab=VOCAB, attn_implementation="sdpa")
    model.generation_config.eos_token_id = [5, 2]
    assert end_of_turn_token(tok) == eot
    assert stop_token_ids(model, tok) == sorted({2, 5, tok.eos_token_id, eot})
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    bare.eos_token = None
    model.name_or_path = "tiny/no-eos"
    with pytest.raises(ValueError, match="model 'tiny/no-eos' has no stop token"):
        stop_token_ids(model, bare)
    with pytest.raises(ValueError, match="has no stop token"):
        check_model(model, bare)  # the harness refuses it before any run directory


@pytest.mark.parametrize("path", ["pipeline", "batched"])
def test_answers_stop_at_the_chat_templates_end_of_turn(path):
    """Issue 32 item 6 (KVCache-Factory #12, lighteval #1278): a chat model whose end-of-turn token is not its
    generation config's eos_token_id stops there (before, it ran to max_new_tokens with the next turn's text), through
    kvpress's pipeline (evaluation.run) and the batched decode of evaluation.fused, also with eos_token_id None (which
    raised a TypeError in evaluation/replay.py)."""
    from evaluation.pipeline import TextGenerationPipeline
    from evaluation.replay import generate_answers

    tok = _chat_tokenizer()
    eot = tok.convert_tokens_to_ids("<eot>")
    model = make_tiny_llama(num_layers=1, vocab=VOCAB, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None if path == "batched" else tok.eos_token_id
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    caches = [prefill(None, model, PROMPT_IDS[:, :40]) for _ in range(1 if path == "pipeline" else 2)]
    steps = []
    handles = [_always(model, eot), model.model.register_forward_pre_hook(lambda *a: steps.append(1))]
    try:
        with torch.no_grad():
            answers = generate_answers(pipe, QUESTION, caches, 40, max_new_tokens=8)
    finally:
        for handle in handles:
            handle.remove()
    assert answers == [""] * len(caches)  # <eot> <eot>, special tokens skipped
    assert len(steps) == 2  # the question forward and one decode step: the second <eot> stops it


# ---------------------------------------------------------------------------------------------- item 8
#: sha256 prefixes of the synthetic draws below, recorded with the code before issue 32 (commit 53b2c5e): the CPU
#: draws of every committed run must not change
DRAWS_BEFORE = {
    ("global", "token"): "9edf05ef1b91f4cc",
    ("global", "page"): "379ea6ecd88aff1c",
    ("head", "token"): "249fc8c3b67cda25",
    ("head", "page"): "daec68deb6f646c5",
}


def _synthetic_draws(
    budget: str, unit: str, other_device: dict | None = None, draws: str = "sequential", order=(0, 1, 2)
) -> tuple[str, list]:
    """Evict three layers of fixed proposals with the press's own eviction (``finalize`` for the global budget,
    ``_evict`` layer by layer for the head budget, in ``order``); keys hold their positions, so the kept rows show
    the draws. ``other_device`` maps a layer to the device its proposal reports. Returns the digest and the kept
    positions of the layers in ``order`` (layer order)."""
    import hashlib
    import types

    from presses import ProbabilisticEvictionPress
    from presses.probabilistic.budget import search_num_samples

    press = ProbabilisticEvictionPress(0.5, budget=budget, unit=unit, page_size=4, draws=draws)
    press.reset()
    gen = torch.Generator().manual_seed(7)
    B, G, t, d, L = 2, 2, 48, 4, 3
    cache = DynamicCache()
    layers = []
    for i in range(L):
        keys = torch.arange(B * G * t, dtype=torch.float32).view(B, G, t, 1).expand(B, G, t, d).contiguous()
        cache.update(keys, keys.clone(), i)
        n = t if unit == "token" else t // 4
        pi = torch.rand(B, G, n, generator=gen, dtype=torch.float64).pow(3).float()
        layers.append((types.SimpleNamespace(layer_idx=i), pi / pi.sum(-1, keepdim=True)))
    press._seq_len = t
    with _reported_devices({id(layers[j][1]): device for j, device in (other_device or {}).items()}):
        if budget == "global":
            for i in order:
                module, pi = layers[i]
                press._pending[i] = (module, cache, pi, cache.layers[i].keys, None)
            press.finalize()
        else:
            for module, pi in (layers[i] for i in order):
                layer = cache.layers[module.layer_idx]
                m = search_num_samples(pi, 0.5, **press._search_options())
                layer.keys, layer.values = press._evict(module, cache, layer.keys, layer.values, pi, m)
    digest = hashlib.sha256()
    kept = []
    for i, state in enumerate(attention.take_decode_state(cache, L)):
        if i not in order:
            continue
        kept.append(cache.layers[i].keys[..., 0].to(torch.int64))
        digest.update(kept[-1].numpy().tobytes())
        digest.update(state.bias.numpy().tobytes())
    return digest.hexdigest()[:16], kept


class _reported_devices:
    """Inside the block, the tensors whose ``id`` is a key report the mapped device as ``.device`` (a device torch
    places on the CPU, e.g. ``cpu:1``): a stand-in for a layer on a second device of a ``device_map``, on a machine
    with one device. Every operation still runs on the CPU."""

    def __init__(self, devices: dict):
        self.devices = devices

    def __enter__(self):
        real = torch._C.TensorBase.device.__get__
        devices = self.devices
        torch.Tensor.device = property(lambda t: devices.get(id(t)) or real(t))
        return self

    def __exit__(self, *exc):
        del torch.Tensor.device
        return False


@pytest.mark.parametrize("budget", ["global", "head"])
@pytest.mark.parametrize("unit", ["token", "page"])
def test_draws_do_not_depend_on_devices(budget, unit):
    """Issue 32 item 8 (kvpress #240; pytorch #196613, #194676): the draws come from CPU generators, so (1) the
    sequential scheme of the committed runs draws what it drew before (digests recorded with the code before the
    change), (2) a layer whose proposal lives on another device draws exactly what it draws on one device (the
    generator was re-created, re-seeded, at each device change, so that layer replayed layer 0's draws), in both
    schemes, and the global budget's search stacks every layer's proposal on one device."""
    digest, kept = _synthetic_draws(budget, unit)
    assert digest == DRAWS_BEFORE[(budget, unit)]
    for draws in ("sequential", "per_layer"):
        digest, kept = _synthetic_draws(budget, unit, draws=draws)
        moved_digest, moved = _synthetic_draws(budget, unit, other_device={1: torch.device("cpu", 1)}, draws=draws)
        for a, b in zip(kept, moved):
            assert torch.equal(a, b)
        assert moved_digest == digest


@pytest.mark.parametrize("unit", ["token", "page"])
def test_a_layers_draws_depend_only_on_seed_and_layer(unit):
    """Issue 32 item 8: with per-layer streams (the default) a layer draws the same entries whatever other layers
    evict, and in whatever order; the sequential scheme, one stream consumed in layer order, does not (which is why
    it is kept only to reproduce the runs committed with it)."""
    _, alone = _synthetic_draws("head", unit, draws="per_layer", order=(2,))
    _, forward = _synthetic_draws("head", unit, draws="per_layer", order=(0, 1, 2))
    _, backward = _synthetic_draws("head", unit, draws="per_layer", order=(2, 1, 0))
    assert torch.equal(alone[0], forward[2])
    for a, b in zip(forward, backward):
        assert torch.equal(a, b)
    _, seq_alone = _synthetic_draws("head", unit, draws="sequential", order=(2,))
    _, seq_forward = _synthetic_draws("head", unit, draws="sequential", order=(0, 1, 2))
    assert not torch.equal(seq_alone[0], seq_forward[2])


@pytest.mark.parametrize("budget", ["global", "head"])
def test_each_layer_draws_from_its_own_seeded_stream(budget, monkeypatch):
    """Both budgets: every draw of layer ``i`` starts from the state of ``layer_generator(seed, i)``, a CPU generator;
    distinct layers and seeds give distinct streams."""
    from presses.probabilistic import press as snis_press
    from presses.probabilistic.budget import layer_generator

    states = []
    real = snis_press.sample_counts

    def spy(pi, m, generator=None):
        states.append((generator.device.type, generator.get_state().clone()))
        return real(pi, m, generator)

    monkeypatch.setattr(snis_press, "sample_counts", spy)
    _synthetic_draws(budget, "token", draws="per_layer", order=(0, 1, 2))
    assert [device for device, _ in states] == ["cpu"] * 3
    for i, (_, state) in enumerate(states):
        assert torch.equal(state, layer_generator(42, i).get_state())
    seeds = {(seed, layer): layer_generator(seed, layer).initial_seed() for seed in (0, 1, 42) for layer in (0, 1, 29)}
    assert len(set(seeds.values())) == len(seeds)
    with pytest.raises(ValueError, match="seed=-1"):
        layer_generator(-1, 0)


def test_runs_saved_before_per_layer_streams_keep_their_scheme(tmp_path):
    """A run directory saved before the ``draws`` field existed ran the sequential scheme: its settings read as
    ``draws: sequential`` (migrate writes it), so the per-layer default never resumes it silently."""
    from omegaconf import OmegaConf

    from evaluation.harness import config_changes
    from evaluation.migrate import migrate

    old = {"press": {"_target_": "presses.ProbabilisticEvictionPress", "compression_ratio": 0.5, "tau": 1.0}}
    new = {"press": {"_target_": "presses.ProbabilisticEvictionPress", "compression_ratio": 0.5}}
    assert config_changes(old, new) == ["press.draws: 'sequential' -> 'per_layer'"]
    assert config_changes(old, old, both_saved=True) == []  # two shards saved before: the same run
    assert config_changes({"press": {**new["press"], "draws": "per_layer"}}, new) == []
    run = tmp_path / "ruler" / "tiny" / "snis_min_h" / "cr0.5"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    (run / "metrics.json").write_text("{}")
    assert migrate(tmp_path)["configs"] == 1
    assert OmegaConf.load(run / "config.yaml").press.draws == "sequential"
    assert migrate(tmp_path)["configs"] == 0  # idempotent


# ---------------------------------------------------------------------------------------------- item 9
@pytest.mark.parametrize("name", [*OURS, "snis_min_h"])
@pytest.mark.parametrize("budget", ["global", "head"])
def test_presses_compress_with_autograd_on(name, budget):
    """Issue 32 item 9: kvpress's own tests call the model without torch.no_grad(); the probabilistic press raised
    ``RuntimeError: mul(): functions with out=... don't support automatic differentiation`` from its budget search
    (both budgets). Every press of this project compresses with gradients enabled; the selection needs none."""
    if budget == "head" and not name.startswith("snis"):
        pytest.skip("the budget is an option of the probabilistic press")
    model = _llama()
    press = build(name, 0.5, **({"budget": budget} if name.startswith("snis") else {}))
    assert torch.is_grad_enabled()
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=PROMPT_IDS, past_key_values=cache)
    kept = [cache.get_seq_length(i) for i in range(len(cache))]
    assert all(1 <= k <= T_LONG for k in kept)
    if name != "entroprefill":  # EntroPrefill may keep everything on a random model (a bypass)
        assert min(kept) < T_LONG


# ---------------------------------------------------------------------------------------------- item 10
def test_parallel_workers_get_triton_caches_of_their_own(tmp_path):
    """Issue 32 item 10 (triton #2688, PR #11319): workers started by a process that set its Triton cache (Hydra's
    joblib workers, pytest-xdist workers, shards) each compile into a directory of their own, removed at exit; a
    directory the user chose is kept."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from presses.kernels import process_cache

    source = Path(process_cache.__file__)
    child = (
        "import importlib.util, os; "
        f"spec = importlib.util.spec_from_file_location('pc', {str(source)!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "path = m.use_process_cache(); print(path, os.path.isdir(path))"
    )
    parent = process_cache.use_process_cache()  # this process's (tests/conftest.py set it)
    env = dict(os.environ)
    workers = [
        subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, text=True) for _ in "ab"
    ]
    dirs = [w.communicate(timeout=60)[0].split() for w in workers]
    assert all(ok == "True" for _, ok in dirs)
    paths = {path for path, _ in dirs}
    assert len(paths) == 2 and parent not in paths and all("kvpress-research-triton" in p for p in paths)
    assert not any(Path(p).exists() for p in paths)  # removed when each worker exited
    user = dict(env, TRITON_CACHE_DIR=str(tmp_path))
    user.pop(process_cache.OWNER, None)
    out = subprocess.run([sys.executable, "-c", child], env=user, capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[0] == str(tmp_path)


def test_the_harness_takes_a_triton_cache_of_its_own(monkeypatch, tmp_path):
    """Every parallel path of the harness (a joblib or SLURM job, a shard) runs evaluation.loop.evaluate, which takes
    a Triton cache of the process's own before any kernel compiles, also when it inherited its parent's."""
    import os

    from test_robustness import _tiny_harness

    from evaluation import run as entry
    from presses.kernels import process_cache

    inherited = tmp_path / "parent-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(inherited))
    monkeypatch.setenv(process_cache.OWNER, "1")  # set by another process (a launcher's)
    seen = []
    cfg, names = _tiny_harness(monkeypatch, tmp_path, "knorm", n_samples=1, depths="[0]")
    real = __import__("evaluation.harness", fromlist=["get_model"]).get_model
    monkeypatch.setattr(
        "evaluation.harness.get_model", lambda *a: seen.append(os.environ["TRITON_CACHE_DIR"]) or real(*a)
    )
    entry.run(cfg, names)
    assert seen and seen[0] != str(inherited) and os.environ[process_cache.OWNER] == str(os.getpid())


def test_bad_draws_and_seed_are_refused():
    """The draws scheme and the seed are checked when the press is built, naming the value."""
    from presses import ProbabilisticEvictionPress

    with pytest.raises(ValueError, match=r"draws='random' must be one of \('per_layer', 'sequential'\)"):
        ProbabilisticEvictionPress(0.5, draws="random")
    with pytest.raises(ValueError, match="seed=-1 must be >= 0"):
        ProbabilisticEvictionPress(0.5, seed=-1)
