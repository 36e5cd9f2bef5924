"""The continuation loss (evaluation/continuation.py, evaluation/datasets/continuation_loss.py): the set's contexts
and continuations are contiguous real text; the uncompressed loss is the model's own loss on that text; a compressed
cache changes it; evaluation.fused gives what evaluation.run gives; the report tables and plots it."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from _tiny_tokenizer import byte_tokenizer, char_tokenizer
from conftest import make_tiny_llama
from hydra.utils import instantiate
from kvpress import StreamingLLMPress
from test_harness import composed
from transformers import DynamicCache

from evaluation import continuation, fused, harness, report
from evaluation import run as entry
from evaluation.datasets import stdlib
from evaluation.datasets.base import Example
from evaluation.datasets.continuation_loss import ContinuationLossDataset, _docs_stream
from evaluation.datasets.tokens import count_tokens, encode

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = byte_tokenizer()  # one token per byte
SETTINGS = ["dataset=continuation_loss", "dataset.split=dev", "dataset.context_lengths=[300]", "n_samples=2"]
SETTINGS += ["dataset.continuation_tokens=24"]


def test_contexts_and_continuations_are_contiguous_real_text():
    ds = ContinuationLossDataset(context_lengths=[1000, 2500], split="dev", continuation_tokens=64)
    exs = ds.examples(TOK, 3, seed=2, query_aware=False)
    assert [e.task for e in exs] == ["docs"] * 6 + ["code"] * 6
    stream = "".join(_docs_stream(TOK, "dev").lines)
    for e in exs:
        n = count_tokens(TOK, e.context)
        assert n == e.metadata["prompt_tokens"] and 0.9 * e.metadata["context_length"] <= n
        assert n <= e.metadata["context_length"] and count_tokens(TOK, e.continuation) >= 65
        assert e.max_new_tokens == 64 and e.question == "" and not e.metadata["chat_template"]
        assert e.context.endswith("\n") and e.continuation.strip() and e.continuation[0] != "\n"
        if e.task == "code":  # a file's head, then its next lines
            assert stdlib.read_source(e.metadata["source"]).startswith(e.context + e.continuation)
            assert e.metadata["source"] in stdlib.files_in_split("dev")
        else:  # a window of the split's documentation stream
            assert e.context + e.continuation in stream
        assert e.metadata["python_version"] and e.metadata["stdlib"]
    assert ds.examples(TOK, 3, seed=2, query_aware=False) == exs  # determined by the seed
    assert [e.context for e in ds.examples(TOK, 2, seed=2, query_aware=False)] == [
        e.context for e in exs if e.id.endswith(("-0", "-1"))
    ]
    assert [e.context for e in ds.examples(TOK, 3, seed=3, query_aware=False)] != [e.context for e in exs]
    test_files = set(stdlib.files_in_split("test"))
    test = ContinuationLossDataset(tasks=["code"], context_lengths=[1000], split="test").examples(TOK, 3, 2, False)
    assert all(e.metadata["source"] in test_files for e in test)
    with pytest.raises(ValueError, match="query_aware=true does not apply"):
        ds.examples(TOK, 1, seed=2, query_aware=True)
    with pytest.raises(ValueError, match="scored by the loss"):
        ds.score("", exs[0])
    with pytest.raises(ValueError, match="unknown continuation_loss tasks"):
        ContinuationLossDataset(tasks=["prose"])


@pytest.fixture
def tiny(monkeypatch):
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, hidden=64, attn_implementation="sdpa", seed=4)
    with torch.no_grad():  # sharper predictions: the loss then depends on what the cache kept
        model.lm_head.weight.mul_(5.0)
    tok = char_tokenizer()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    return model, tok


def _example(tok):
    text = stdlib.read_source("calendar.py")
    return Example(id="x", context=text[:400], question="", answers=[], continuation=text[400:500])


def _own_loss(model, context_ids, ids) -> float:
    """The model's own loss on context + continuation (one forward, HF's shifted cross-entropy), on the
    continuation's tokens 1..n."""
    T = context_ids.shape[1]
    labels = torch.full((1, T + ids.shape[1]), -100)
    labels[0, T + 1 :] = ids[0, 1:]
    with torch.inference_mode():
        return model(input_ids=torch.cat([context_ids, ids], 1), labels=labels).loss.item()


def test_uncompressed_loss_is_the_models_own_loss_and_compression_changes_it(tiny):
    model, tok = tiny
    ex, n = _example(tok), 40
    context_ids = torch.tensor([encode(tok, ex.context)])
    ids = continuation.continuation_ids(tok, ex, n)
    assert ids.shape == (1, n + 1)
    T = context_ids.shape[1]
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=context_ids, past_key_values=cache)
    reference = continuation.teacher_forced_hidden(model, cache, ids, T)
    assert [cache.get_seq_length(i) for i in range(3)] == [T] * 3  # the fed tokens were cut off again
    own = _own_loss(model, context_ids, ids)  # one forward over context and continuation
    same = continuation.loss_stats(model, reference, reference, ids)
    assert same["nll_uncompressed"] == pytest.approx(own, abs=1e-5) and same["nll"] == same["nll_uncompressed"]
    assert same["kl"] == 0.0 and same["nll_increase"] == 0.0 and continuation.loss_score(same) == 1.0

    press = StreamingLLMPress(compression_ratio=0.6, n_sink=4)
    compressed = DynamicCache()
    with press(model), torch.inference_mode():
        model.model(input_ids=context_ids, past_key_values=compressed)
    assert compressed.get_seq_length(0) < 0.5 * T
    stats = continuation.loss_stats(
        model, continuation.teacher_forced_hidden(model, compressed, ids, T), reference, ids
    )
    assert stats["kl"] > 1e-3 and abs(stats["nll_increase"]) > 1e-4
    assert stats["nll_uncompressed"] == same["nll_uncompressed"]
    assert (
        continuation.loss_score(stats) == pytest.approx(math.exp(-stats["kl"])) and continuation.loss_score(stats) < 1
    )
    # the KL is the mean over positions of KL(p || q) of the next-token distributions
    with torch.inference_mode():
        full = F.log_softmax(model(input_ids=torch.cat([context_ids, ids[:, :-1]], 1)).logits[0, T:].float(), -1)
        q = F.log_softmax(model.lm_head(continuation.teacher_forced_hidden(model, compressed, ids, T))[0].float(), -1)
    kl = (full.exp() * (full - q)).sum(-1).mean().item()
    assert stats["kl"] == pytest.approx(kl, rel=1e-4)
    with pytest.raises(ValueError, match="fewer than max_new_tokens"):
        continuation.continuation_ids(tok, ex, 1000)


def test_the_reference_is_computed_once_per_example(tiny, tmp_path, monkeypatch):
    calls = []
    real = continuation.teacher_forced_hidden
    monkeypatch.setattr(continuation, "teacher_forced_hidden", lambda *a: calls.append(a[2].shape) or real(*a))
    for press in ("snapkv", "streaming_llm"):
        cfg = composed(f"press={press}", "compression_ratio=0.5", f"output_dir={tmp_path}", *SETTINGS)
        entry.run(cfg, {"press": press, "dataset": "continuation_loss", "model": "smollm2-135m"})
    assert len(calls) == 4 * 2 + 4  # each run's 4 examples, and 4 references for both runs


def _runs(presses, out):
    runs = []
    for press in presses:
        for ratio in [0.0] if press == "no_press" else [0.6]:
            cfg = composed(f"press={press}", f"compression_ratio={ratio}", f"output_dir={out}", *SETTINGS)
            runs.append((cfg, {"press": press, "dataset": "continuation_loss", "model": "smollm2-135m"}))
    return runs


def _rows(out, press):
    ratio = 0.0 if press == "no_press" else 0.6
    path = out / "continuation_loss" / "smollm2-135m" / press / f"cr{ratio:g}" / "predictions.jsonl"
    return {r["id"]: r for r in harness.read_predictions(path)}


def test_fused_holds_one_press_cache_at_a_time(tiny, tmp_path, monkeypatch, replayed_caches):
    """evaluation.fused replays each run of a continuation example just before its teacher-forced forward: no other
    press cache is alive then (the reference's forward comes first, with none), whatever the number of runs."""
    forward, alive = continuation.teacher_forced_hidden, []

    def counted(*args):
        gc.collect()
        alive.append(len(replayed_caches))
        return forward(*args)

    monkeypatch.setattr(continuation, "teacher_forced_hidden", counted)
    fused.run_fused(_runs(["no_press", "snapkv", "streaming_llm", "snis_min"], tmp_path), "test")
    assert alive == [0, 1, 1, 1, 1] * 4  # per example: the reference, then the four runs one by one


def test_fused_equals_run_and_the_report_tables_it(tiny, tmp_path):
    presses = ["no_press", "snapkv", "streaming_llm", "snis_min"]
    for cfg, names in _runs(presses, tmp_path / "separate"):
        entry.run(cfg, names)
    fused.run_fused(_runs(presses, tmp_path / "fused"), "test")
    model, tok = tiny
    cfg = _runs(["no_press"], tmp_path)[0][0]
    examples = {e.id: e for e in harness.run_examples(cfg, instantiate(cfg.dataset), tok)}
    for press in presses:
        sep, fus = _rows(tmp_path / "separate", press), _rows(tmp_path / "fused", press)
        assert sorted(sep) == sorted(fus) and len(sep) == 4
        for i in sep:
            for key in harness.CONTINUATION_FIELDS:
                assert fus[i][key] == pytest.approx(sep[i][key], abs=1e-5), (press, i, key)
            assert fus[i]["effective_compression"] == pytest.approx(sep[i]["effective_compression"])
            assert fus[i]["score"] == pytest.approx(math.exp(-fus[i]["kl"]))
            if press == "no_press":  # the uncompressed run is its own reference, and the model's own loss
                assert sep[i]["nll_increase"] == fus[i]["nll_increase"] == 0.0 and sep[i]["kl"] == fus[i]["kl"] == 0.0
                ex = examples[i]
                context_ids = torch.tensor([encode(tok, tok.bos_token + ex.context)])  # the pipeline's BOS
                ids = continuation.continuation_ids(tok, ex, 24)
                assert sep[i]["nll"] == pytest.approx(_own_loss(model, context_ids, ids), abs=1e-5)
            else:
                assert fus[i]["kl"] > 1e-4 and fus[i]["effective_compression"] > 0.5
    readme = report.build_report(tmp_path / "fused", tmp_path / "report")
    text = readme.read_text()
    assert "### Continuation loss" in text and "NLL increase:" in text
    table = (tmp_path / "report/tables/continuation_loss__smollm2-135m__continuation.csv").read_text()
    header = "dataset,model,press,ratio,context_length,task,n,nll_increase,nll_increase_low"
    assert table.splitlines()[0].startswith(header)
    assert len(table.splitlines()) == 1 + 4 * 3  # per run: all, code, docs
    assert (tmp_path / "report/plots/continuation_loss__smollm2-135m__loss.png").stat().st_size > 1000
