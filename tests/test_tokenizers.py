"""Tokenizers with and without a BOS token, with and without a chat template (issue 17 item 1).

Qwen2.5 and Qwen3 have no BOS token; kvpress's pipeline prepends ``bos_token`` when there is no chat template
(LongBench's trec, triviaqa, samsum, lsht, lcc, repobench-p drop it), which failed with ``None + str``. Every dataset
runs with every tokenizer flavour, and nothing is prepended where the tokenizer has no BOS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _tiny_models import make_tiny_family
from _tiny_tokenizer import char_tokenizer_flavour
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from kvpress import KVPressTextGenerationPipeline
from test_harness import composed

from evaluation import harness
from evaluation import run as entry
from evaluation.pipeline import TextGenerationPipeline

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
FLAVOURS = [(True, True), (True, False), (False, True), (False, False)]
FLAVOUR_IDS = ["bos-chat", "bos-nochat", "nobos-chat", "nobos-nochat"]
CHAT_HEADER = "<|im_start|>user\n"  # what CHATML_TEMPLATE puts before the user's text


@pytest.fixture(scope="module")
def model():
    return make_tiny_family("qwen2.5-1.5b", vocab=128, seed=3)


def _expected_context_ids(tok, context: str, template: bool) -> list[int]:
    """The context ids the pipeline must feed: the chat header, else the BOS token if there is one, else nothing."""
    if template:
        return tok.encode(CHAT_HEADER + context, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token is not None else []
    return bos + tok.encode(context, add_special_tokens=False)


@pytest.mark.parametrize("bos,chat", FLAVOURS, ids=FLAVOUR_IDS)
def test_preprocess_prepends_bos_only_when_the_tokenizer_has_one(model, bos, chat):
    tok = char_tokenizer_flavour(bos, chat)
    context = "Some context.\n\nWith lines."
    ids = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu")).preprocess(
        context, ["Q?"], "A:", int(1e10)
    )
    assert ids["context_ids"][0].tolist() == _expected_context_ids(tok, context, chat)
    if not bos and not chat:  # kvpress's own pipeline: None + str
        with pytest.raises(TypeError):
            KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu")).preprocess(
                context, ["Q?"], "A:", int(1e10)
            )


def test_trec_row_runs_through_evaluation_run_without_bos(model, monkeypatch, tmp_path):
    """``python -m evaluation.run dataset=longbench`` on the trec row (no chat template) with a BOS-less tokenizer
    that has a chat template, as Qwen2.5's: the example runs, and nothing is prepended to its context."""
    tok = char_tokenizer_flavour(bos=False, chat_template=True)
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "evaluation.run",
            "dataset=longbench",
            f"dataset.source={FIXTURES}",
            "dataset.tasks=[trec]",
            "press=snapkv",
            "n_samples=1",
            "max_new_tokens=2",
            f"output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/.hydra/run",
        ],
    )
    GlobalHydra.instance().clear()
    try:
        entry.main()
    finally:
        GlobalHydra.instance().clear()
    (row,) = [
        json.loads(line)
        for line in (tmp_path / "longbench/smollm2-135m/snapkv/cr0.5/predictions.jsonl").read_text().splitlines()
    ]
    (ex,) = instantiate(
        composed("dataset=longbench", f"dataset.source={FIXTURES}", "dataset.tasks=[trec]").dataset
    ).examples(tok, 1, 42, False)
    assert row["id"] == ex.id and ex.task == "trec" and not ex.metadata["chat_template"]
    assert row["context_length"] == len(tok.encode(ex.context, add_special_tokens=False))  # nothing prepended
    assert row["effective_compression"] >= 0.5 - 1 / row["context_length"]


DATASETS = {
    "needle": ["dataset=needle", "dataset.context_length=256", "dataset.depths=[50]"],
    "ruler": ["dataset=ruler_smoke", "dataset.tasks=[niah_single_1]", "dataset.context_lengths=[768]"],
    "longbench": ["dataset=longbench", f"dataset.source={FIXTURES}", "dataset.tasks=[trec,hotpotqa]"],
    "multidoc": [
        "dataset=multidoc",
        "dataset.context_lengths=[1200]",
        "dataset.passage_tokens=96",
        "dataset.fact_kinds=[city]",
    ],
}


@pytest.mark.parametrize("bos,chat", FLAVOURS, ids=FLAVOUR_IDS)
@pytest.mark.parametrize("dataset", DATASETS)
def test_every_dataset_runs_with_every_tokenizer_flavour(model, dataset, bos, chat, monkeypatch, tmp_path):
    tok = char_tokenizer_flavour(bos, chat)
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    cfg = composed(
        "press=knorm",
        "compression_ratio=0.5",
        "n_samples=1",
        "max_new_tokens=2",
        f"output_dir={tmp_path}",
        *DATASETS[dataset],
    )
    name = DATASETS[dataset][0].split("=")[1]
    metrics = entry.run(cfg, {"press": "knorm", "dataset": name, "model": "smollm2-135m"})
    rows = {
        r["id"]: r
        for r in harness.read_predictions(tmp_path / name / "smollm2-135m" / "knorm" / "cr0.5" / "predictions.jsonl")
    }
    examples = instantiate(cfg.dataset).examples(tok, 1, cfg.seed, False)
    assert metrics["n"] == len(rows) == len(examples) >= 1
    for ex in examples:
        template = chat and ex.metadata.get("chat_template", True)
        assert rows[ex.id]["context_length"] == len(_expected_context_ids(tok, ex.context, template))
