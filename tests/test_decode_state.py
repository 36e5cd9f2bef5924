"""Decode-time state follows its cache through every cache operation (issue 63 items 1 to 4).

The probabilistic press leaves an SNIS correction and a ``-inf`` padding mask per layer (``presses.attention``): it
lives on the cache layer objects, whose class carries it through ``copy.deepcopy``, ``copy.copy``, pickling,
``crop``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``, ``offload`` / ``prefetch``, or
refuses in one line (a quantized, sliding or static layer; a stale state; a decode at positions inside the compressed
prompt; a batch of another size; a forward whose attention bypassed the wrapper). Each operation is checked by the
logits it decodes against the original cache's, and the original's against a copy without the correction, so every
check could fail. Then kvpress's pipeline features and ``model.generate`` (greedy, sampling, beams, a padded batch)
on a compressed cache, and the README's "Reusing a compressed cache" script on the tiny model.

Tiny random Llama (2 layers, 4 query / 2 KV heads, output layer scaled by 5), ``budget="head"`` at ratio 0.5: the
layers keep different counts, so the shorter rows are padded and masked.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from conftest import make_tiny_llama
from kvpress import KVPressTextGenerationPipeline
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, QuantizedLayer, StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from presses import KVzipSamplingPress, PageEntroKVPress, ProbabilisticEvictionPress, attention
from presses.attention_bias import AttentionBias, fit_mask

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
T = 48
CONTEXT = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(0))
CONTEXTS = torch.randint(4, 128, (2, T), generator=torch.Generator().manual_seed(1))  # a batch of two prompts
QUESTION = torch.randint(4, 128, (1, 5), generator=torch.Generator().manual_seed(2))
OTHER = torch.randint(4, 128, (1, 5), generator=torch.Generator().manual_seed(3))  # another question, same length
SHORT = torch.randint(4, 128, (1, 3), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def model():
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # sharper logits: greedy answers depend on what the cache kept
    return model


def _snis(**kwargs) -> ProbabilisticEvictionPress:
    return ProbabilisticEvictionPress(**{"compression_ratio": 0.5, "budget": "head", "proposal": "h2o_h", **kwargs})


def compressed(model, ids: torch.Tensor = CONTEXT, press=None) -> DynamicCache:
    """A new cache of ``ids`` compressed by ``press`` (the probabilistic press by default)."""
    cache = DynamicCache()
    with torch.no_grad(), (press or _snis())(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def logits(model, cache, ids: torch.Tensor, start: int = T) -> torch.Tensor:
    """``ids`` teacher-forced on ``cache`` (extending it) at positions ``start ...``: logits ``(B, n, V)``."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, position_ids=positions).logits


def lengths(cache) -> list[int]:
    return [cache.get_seq_length(i) for i in range(len(cache))]


def uncorrected(cache) -> DynamicCache:
    """A copy of ``cache`` without its decode-time state (what a copy decoded before issue 63)."""
    out = copy.deepcopy(cache)
    attention.take_decode_state(out, len(out))
    return out


def assert_corrected(got: torch.Tensor, want: torch.Tensor, without: torch.Tensor) -> None:
    """``got`` (decoded on the operated cache) equals ``want`` (on the original) and the state matters: decoding
    without it (``without``) gives other logits."""
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - without).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------- the state itself
def test_the_compressed_cache_has_padding_and_a_correction(model):
    cache = compressed(model)
    states = attention.decode_state(cache)
    assert len(set(lengths(cache))) == 2  # the layers keep different counts
    for layer, state in zip(cache.layers, states):
        assert isinstance(layer, DynamicLayer) and state.prefix_len == layer.keys.shape[2]
        assert state.context_length == T
    assert any(bool(torch.isinf(s.bias).any()) for s in states)  # padding masked
    assert all(bool((s.bias[torch.isfinite(s.bias)] != 0).any()) for s in states)  # SNIS log-weights


# ---------------------------------------------------------------------------------------------- copies
def test_deepcopy_decodes_as_the_original(model):
    cache = compressed(model)
    before = lengths(cache)
    got = logits(model, copy.deepcopy(cache), QUESTION)
    assert lengths(cache) == before  # the copy's decode left the original alone
    assert_corrected(got, logits(model, cache, QUESTION), logits(model, uncorrected(compressed(model)), QUESTION))


def test_shallow_copy_shares_the_layers_and_their_state(model):
    cache = compressed(model)
    want = logits(model, copy.deepcopy(cache), QUESTION)
    shallow = copy.copy(cache)
    assert all(a is b for a, b in zip(shallow.layers, cache.layers))  # transformers' semantics: one set of layers
    assert_corrected(logits(model, shallow, QUESTION), want, logits(model, uncorrected(compressed(model)), QUESTION))


def test_pickle_and_torch_save_in_a_new_process(model, tmp_path, monkeypatch):
    """A pickled cache keeps its state; loading it installs the attention wrapper (a new process has none)."""
    cache = compressed(model)
    want = logits(model, copy.deepcopy(cache), QUESTION)
    without = logits(model, uncorrected(cache), QUESTION)
    torch.save(cache, tmp_path / "cache.pt")
    pickled = pickle.dumps(cache)
    for load in (lambda: torch.load(tmp_path / "cache.pt", weights_only=False), lambda: pickle.loads(pickled)):
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__)
        loaded = load()
        assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_kvpress_research_attention", False)
        assert_corrected(logits(model, loaded, QUESTION), want, without)
        monkeypatch.undo()


# ---------------------------------------------------------------------------------------------- crop
def test_negative_crop_removes_a_question_and_keeps_the_state(model):
    """The kvpress-pipeline pattern on the cache's own API: answer, cut the answer off every layer, answer again."""
    cache = compressed(model)
    want = logits(model, copy.deepcopy(cache), OTHER)
    before = lengths(cache)
    logits(model, cache, QUESTION)
    cache.crop(-QUESTION.shape[1])  # per-layer lengths differ: crop(-n) takes the same n entries off each
    assert lengths(cache) == before
    assert_corrected(logits(model, cache, OTHER), want, logits(model, uncorrected(compressed(model)), OTHER))


def test_crop_into_the_prompt_cuts_the_state(model):
    """``crop(m)`` below a layer's ``P`` keeps its first ``m`` slots with their own biases; 0 drops the state."""
    cache = compressed(model)
    m = min(lengths(cache)) - 4
    reference = DynamicCache()  # the cropped cache built by hand: first m slots, first m biases
    for i, (layer, state) in enumerate(zip(cache.layers, attention.decode_state(cache))):
        reference.update(layer.keys[:, :, :m].clone(), layer.values[:, :, :m].clone(), i)
        attention.set_decode_bias(reference, i, AttentionBias(state.bias[..., :m].clone(), T))
    cache.crop(10_000)  # longer than every layer: nothing changes
    cache.crop(m)
    assert lengths(cache) == [m, m] and all(s.prefix_len == m for s in attention.decode_state(cache))
    without = logits(model, uncorrected(reference), QUESTION)
    assert_corrected(logits(model, cache, QUESTION), logits(model, reference, QUESTION), without)
    emptied = compressed(model)
    emptied.crop(0)
    assert attention.decode_state(emptied) == (None, None)


def test_reset_and_emptied_layers_drop_the_state(model):
    """``reset()`` and ``crop(0)`` drop the state; layers emptied by hand drop it at the next prefill (their update
    starts from no entries), which then decodes as an uncompressed cache."""
    for empty in (lambda cache: cache.reset(), lambda cache: cache.crop(0)):
        cache = compressed(model)
        empty(cache)
        assert attention.decode_state(cache) == (None, None)
    plain = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=CONTEXT, past_key_values=plain)
    cache = compressed(model)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]
    with torch.no_grad():
        model.model(input_ids=CONTEXT, past_key_values=cache)  # an uncompressed prefill from position 0
    assert attention.decode_state(cache) == (None, None)
    torch.testing.assert_close(logits(model, cache, QUESTION), logits(model, plain, QUESTION), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- batch rows
def test_beam_reordering_and_row_selection_move_the_state_rows(model):
    cache = compressed(model, CONTEXTS)  # two prompts: each row has its own kept entries, padding and weights
    question = QUESTION.expand(2, -1)
    want = logits(model, copy.deepcopy(cache), question)
    without = logits(model, uncorrected(cache), question)
    assert (want[0] - want[1]).abs().max() > 1e-2
    swapped = copy.deepcopy(cache)
    swapped.reorder_cache(torch.tensor([1, 0]))
    assert_corrected(logits(model, swapped, question), want.flip(0), without.flip(0))
    second = copy.deepcopy(cache)
    second.batch_select_indices(torch.tensor([1]))
    assert_corrected(logits(model, second, QUESTION), want[1:], without[1:])


def test_repeated_rows_answer_several_questions_at_once(model):
    cache = compressed(model)
    alone = torch.cat([logits(model, copy.deepcopy(cache), q) for q in (QUESTION, OTHER)])
    without = torch.cat([logits(model, uncorrected(cache), q) for q in (QUESTION, OTHER)])
    repeated = copy.deepcopy(cache)
    repeated.batch_repeat_interleave(2)
    assert_corrected(logits(model, repeated, torch.cat([QUESTION, OTHER])), alone, without)


def test_a_batch_of_another_size_is_refused_in_one_line(model):
    cache = compressed(model)
    with pytest.raises(ValueError, match=r"3 rows on a compressed cache of 1: .*batch_repeat_interleave\(3\)") as err:
        logits(model, cache, QUESTION.expand(3, -1))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- storage and devices
class _StoringCopies(DynamicCache):
    """Stands for offloading on a GPU: after each update the layer stores another tensor than the one its update
    returned to the attention (``offload()`` moves it to the CPU), so a layer is not found by its stored keys."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        out = super().update(key_states, value_states, layer_idx, cache_kwargs)
        layer = self.layers[layer_idx]
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        return out


def test_offloaded_layers_keep_their_state(model):
    cache = compressed(model)
    want = logits(model, copy.deepcopy(cache), QUESTION)
    without = logits(model, uncorrected(cache), QUESTION)
    moved = copy.deepcopy(cache)
    for layer in moved.layers:
        layer.offload()
        layer.prefetch()
    assert_corrected(logits(model, moved, QUESTION), want, without)
    storing = copy.deepcopy(cache)
    storing.__class__ = _StoringCopies
    assert_corrected(logits(model, storing, QUESTION), want, without)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cache_moved_to_another_device_keeps_its_state(model):
    """CPU -> CUDA: keys and values moved by hand, the bias stays where it was (each call moves it to the query's
    device); the offloading cache of transformers moves each layer to the CPU after its update. The question, then
    one token (on CUDA the Triton decode kernel's path)."""

    def two_steps(model, cache) -> torch.Tensor:
        device = model.device
        first = logits(model, cache, QUESTION.to(device))
        return torch.cat([first, logits(model, cache, OTHER[:, :1].to(device), start=T + QUESTION.shape[1])], 1).cpu()

    cache = compressed(model)
    want = two_steps(model, copy.deepcopy(cache))
    without = two_steps(model, uncorrected(cache))
    gpu = copy.deepcopy(model).cuda()
    moved = copy.deepcopy(cache)
    for layer in moved.layers:
        layer.keys, layer.values = layer.keys.cuda(), layer.values.cuda()
        layer.device = layer.keys.device
    offloading = DynamicCache(offloading=True)
    offloading.layers = copy.deepcopy(moved).layers
    assert (want - without).abs().max() > 1e-2
    for cache in (moved, offloading):  # CUDA against CPU: another order of the sums
        torch.testing.assert_close(two_steps(gpu, cache), want, atol=1e-4, rtol=1e-4)


class _RoundingLayer(QuantizedLayer):
    def _quantize(self, tensor, axis):
        return tensor.to(torch.float16)

    def _dequantize(self, qtensor):
        return qtensor.to(torch.float32)


@pytest.mark.parametrize(
    ("layer", "reason"),
    [
        (_RoundingLayer(), "_RoundingLayer keeps its entries in quantized storage"),
        (DynamicSlidingWindowLayer(sliding_window=8), "DynamicSlidingWindowLayer drops its oldest entries"),
        (StaticLayer(max_cache_len=16), "StaticLayer stores entries at fixed slots"),
    ],
)
def test_layers_that_cannot_carry_a_state_are_refused_in_one_line(layer, reason):
    cache = Cache(layers=[layer])
    cache.update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 0)
    with pytest.raises(ValueError, match=f"layer 0 cannot carry a decode-time bias: a {reason}") as err:
        attention.put_decode_state(cache, [(AttentionBias(torch.zeros(1, 2, 4)),)])
    assert "\n" not in str(err.value) and attention.decode_state(cache) == (None,)


# ---------------------------------------------------------------------------------------------- stale or missing
def test_a_stale_state_raises(model):
    for change in ("shorter", "groups"):
        cache = compressed(model)
        layer = cache.layers[1]
        if change == "shorter":  # fewer entries than the bias covers, even after the question's
            layer.keys, layer.values = layer.keys[:, :, :3], layer.values[:, :, :3]
        else:  # one KV group instead of two
            layer.keys, layer.values = layer.keys[:, :1], layer.values[:, :1]
        with pytest.raises((ValueError, RuntimeError)) as err:
            logits(model, cache, QUESTION)
        if change == "shorter":
            assert re.search(r"decode-time bias \(B=1, G=2, P=\d+\) does not match the layer's cache", str(err.value))
    with pytest.raises(ValueError, match=r"layer 0: decode-time bias \(B=2, G=2, P=\d+\) does not match"):
        attention.put_decode_state(compressed(model), [attention.decode_state(compressed(model, CONTEXTS))])


def test_attention_that_bypasses_the_wrapper_is_refused_at_the_next_step(model, monkeypatch):
    """e.g. a model switched to flash attention: the first forward cannot be caught, the cache's next one is."""
    cache = compressed(model)
    inner = ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__

    def unbiased(module, query, key, value, mask, *args, **kwargs):  # each layer's own mask, no bias
        return inner(module, query, key, value, fit_mask(mask, key.shape[2]), *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", unbiased)
    logits(model, cache, QUESTION)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="the previous forward did not apply this cache layer's decode-time bias"):
        logits(model, cache, OTHER, start=T + QUESTION.shape[1])


def test_a_decode_inside_the_compressed_prompt_is_refused(model):
    """Without position_ids the model numbers the new tokens from the cache's length (below T): refused, as is
    transformers' prompt-reuse recipe (the whole prompt to generate, which feeds the prompt's tail again)."""
    cache = compressed(model)
    P = cache.get_seq_length()
    with pytest.raises(ValueError, match=f"position {P} on a cache compressed from a {T}-token prompt") as err:
        with torch.no_grad():
            model(input_ids=QUESTION, past_key_values=copy.deepcopy(cache))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"compressed from a {T}-token prompt"), torch.no_grad():
        model.generate(torch.cat([CONTEXT, QUESTION], 1), past_key_values=copy.deepcopy(cache), max_new_tokens=2)


def test_kvzip_sampling_state_follows_a_deepcopy(tmp_path):
    from test_kvzip_path import _tiny_model

    model, _ = _tiny_model(tmp_path / "checkpoint")
    ids = torch.randint(4, 128, (1, 160), generator=torch.Generator().manual_seed(5))
    cache = compressed(model, ids, KVzipSamplingPress(0.5, budget="head", seed=1))
    assert any(isinstance(s, AttentionBias) for s in attention.decode_state(cache))
    got = logits(model, copy.deepcopy(cache), QUESTION, start=160)
    without = logits(model, uncorrected(cache), QUESTION, start=160)
    assert_corrected(got, logits(model, cache, QUESTION, start=160), without)


# ---------------------------------------------------------------------------------------------- kvpress's pipeline
PRESSES = {"probabilistic": _snis, "page_entrokv": lambda: PageEntroKVPress(compression_ratio=0.5, page_size=8)}
TEXT = "".join(f"room {i} has code {1000 + 37 * i}. " for i in range(6))
QUESTIONS = ["code of room 2?", "room of 1037?", "code of room 5?"]


@pytest.mark.parametrize("name", PRESSES)
def test_pipeline_answers_several_questions_from_one_compressed_cache(model, name):
    """kvpress's pipeline trims the cache back to the compressed context between questions (its keys sliced): the
    answers are those of each question alone, and of the question decoded on a copy of the compressed cache."""
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=char_tokenizer())
    cache = DynamicCache()
    together = pipe(TEXT, questions=QUESTIONS, press=PRESSES[name](), max_new_tokens=8, cache=cache)["answers"]
    alone = [pipe(TEXT, question=q, press=PRESSES[name](), max_new_tokens=8)["answer"] for q in QUESTIONS]
    assert together == alone
    inputs = pipe.preprocess(TEXT, QUESTIONS, answer_prefix="", max_context_length=10_000)
    context_length = inputs["context_ids"].shape[1]
    for question_ids, answer in zip(inputs["questions_ids"], together):
        assert pipe.generate_answer(question_ids, copy.deepcopy(cache), context_length, 8) == answer
    if name == "probabilistic":  # the state matters, and the cache kept it through the questions
        assert all(s is not None for s in attention.decode_state(cache))
        press = _snis(correction=False)
        assert together != [pipe(TEXT, question=q, press=press, max_new_tokens=8)["answer"] for q in QUESTIONS]
    else:
        assert attention.decode_state(cache) == (None, None)


def _generate_inputs(cache, questions: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """``model.generate``'s inputs on a compressed cache: it feeds the tokens after ``cache.get_seq_length()`` (layer
    0's entries), so the questions follow that many placeholder tokens; their positions start at ``T``."""
    B, n = questions.shape
    P = cache.get_seq_length()
    mask = torch.ones(B, n, dtype=torch.long) if mask is None else mask
    positions = T + (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: pads at T, never inside the prompt
    return dict(
        input_ids=torch.cat([torch.full((B, P), 4), questions], 1),
        attention_mask=torch.cat([torch.ones(B, P, dtype=torch.long), mask], 1),
        position_ids=positions,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )


def _assert_steps_are_teacher_forced(model, cache, out, question: torch.Tensor, row: int, steps: list) -> None:
    """Each step's logits ``steps[s]`` (generate's, for returned sequence ``row``) equal the teacher-forced logits of
    that sequence on a copy of the compressed cache (its row ``row`` alone when the cache has several)."""
    new = out.sequences[row, -len(steps) :]
    if (new == model.generation_config.eos_token_id).any():  # a finished sequence: its steps up to the EOS
        steps = steps[: int((new == model.generation_config.eos_token_id).nonzero()[0]) + 1]
        new = new[: len(steps)]
    forced = copy.deepcopy(cache)
    if forced.layers[0].keys.shape[0] > 1:
        forced.batch_select_indices(torch.tensor([row]))
    want = logits(model, forced, torch.cat([question, new[None, :-1]], 1))[0, question.shape[1] - 1 :]
    torch.testing.assert_close(torch.stack(steps), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", PRESSES)
@pytest.mark.parametrize("mode", ["greedy", "sampling", "beams"])
def test_generate_on_a_compressed_cache(model, name, mode):
    cache = compressed(model, press=PRESSES[name]())
    work = copy.deepcopy(cache)
    options = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, top_k=0)}
    options["beams"] = dict(do_sample=False, num_beams=3, num_return_sequences=3)
    if mode == "beams":
        work.batch_repeat_interleave(3)  # generate expands the inputs, not a cache it is given
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **_generate_inputs(cache, QUESTION), past_key_values=work, max_new_tokens=4, **options[mode]
        )
    for row in range(out.sequences.shape[0]):
        beam = out.beam_indices[row] if mode == "beams" else [row] * len(out.logits)
        steps = [out.logits[s][int(beam[s])] for s in range(len(out.logits)) if int(beam[s]) >= 0]
        _assert_steps_are_teacher_forced(model, cache, out, QUESTION, row, steps)


@pytest.mark.parametrize("name", PRESSES)
def test_generate_a_batch_of_prompts_with_padded_questions(model, name):
    """Two prompts compressed in one prefill, two questions of different lengths (left-padded) in one generate."""
    cache = compressed(model, CONTEXTS, PRESSES[name]())
    questions = torch.cat([QUESTION, torch.cat([torch.zeros(1, 2, dtype=torch.long), SHORT], 1)])
    mask = (questions != 0).long()
    with torch.no_grad():
        out = model.generate(
            **_generate_inputs(cache, questions, mask), past_key_values=copy.deepcopy(cache), max_new_tokens=4
        )
    for row, question in enumerate((QUESTION, SHORT)):
        _assert_steps_are_teacher_forced(model, cache, out, question, row, [step[row] for step in out.logits])


# ---------------------------------------------------------------------------------------------- README
def test_the_readme_script_runs_on_the_tiny_model(model, monkeypatch, capsys):
    """README, "Reusing a compressed cache": its script as written, with ``load_model`` giving the tiny model."""
    from evaluation import models

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Reusing a compressed cache", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (model, char_tokenizer()))
    namespace: dict = {}
    with torch.set_grad_enabled(True):  # the script turns gradients off; they come back after it
        exec(compile(code, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.endswith("same on the original: True") for line in printed) == 3, printed
    cache = namespace["cache"]  # the original, back to its compressed entries and still corrected
    assert lengths(cache) == namespace["kept"] and len(set(namespace["kept"])) > 1
    assert all(state is not None for state in attention.decode_state(cache))
