"""The guards of the model and the data (issue 17 item 5): every input the model or the dataset cannot take is
refused with a ``ValueError`` naming the value and the limit, before any run directory is created (the README's
Limits lists each one with its test here). The press limits are tested in ``tests/test_robustness.py``."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny_models import make_tiny_family
from _tiny_tokenizer import char_tokenizer
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from test_harness import composed

from evaluation import guards, harness
from evaluation import run as entry
from evaluation.cli import input_error

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = "tests/fixtures/longbench"


def _refused(monkeypatch, tmp_path, message: str, *overrides, model=None, tokenizer=None, dataset="needle"):
    """Run the harness with ``overrides``; assert it raises ``message`` and leaves no file behind. The model is
    loaded only when ``model`` is given (else loading it fails the test)."""

    def serve(*args, **kwargs):
        assert model is not None, "the model must not be loaded for this input"
        return model, tokenizer or char_tokenizer()

    monkeypatch.setattr(harness, "get_model", serve)
    out = tmp_path / "runs"
    cfg = composed("press=knorm", "compression_ratio=0.5", f"output_dir={out}", f"dataset={dataset}", *overrides)
    with pytest.raises(ValueError) as info:
        entry.run(cfg, {"press": "knorm", "dataset": dataset, "model": "smollm2-135m"})
    assert message in str(info.value)
    assert not out.exists() or not any(out.rglob("*"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("n_samples=0", "n_samples=0 must be an integer >= 1"),
        ("n_samples=-3", "n_samples=-3 must be an integer >= 1"),
        ("max_new_tokens=0", "max_new_tokens=0 must be an integer >= 1"),
    ],
)
def test_run_settings(monkeypatch, tmp_path, override, message):
    _refused(monkeypatch, tmp_path, message, override)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_that_does_not_exist(monkeypatch, tmp_path):
    _refused(monkeypatch, tmp_path, "device=cuda:0 but torch sees 0 CUDA device(s)", "device=cuda:0")


def test_n_samples_beyond_longbench_rows(monkeypatch, tmp_path):
    """The fixture's trec file has 1 row: 2 per task cannot be drawn from it (before any model is loaded)."""
    _refused(
        monkeypatch,
        tmp_path,
        "n_samples=2 is more than the dataset can give: the rows of LongBench task 'trec' number 1; use n_samples<=1",
        "n_samples=2",
        f"dataset.source={FIXTURES}",
        "dataset.tasks=[hotpotqa,trec]",
        dataset="longbench",
    )


def test_n_samples_beyond_ruler_qa_questions(tmp_path):
    paragraphs = [
        {
            "context": f"Paragraph {i} says token{i}.",
            "qas": [
                {
                    "question": f"Which token is in paragraph {i}?",
                    "is_impossible": False,
                    "answers": [{"text": f"token{i}"}],
                }
            ],
        }
        for i in range(2)
    ]
    (tmp_path / "squad.json").write_text(json.dumps({"data": [{"paragraphs": paragraphs}]}))
    ds = instantiate(
        composed("dataset=ruler_smoke", "dataset.tasks=[qa_1,niah_single_1]", f"dataset.qa_data_dir={tmp_path}").dataset
    )
    guards.check_dataset(ds, 2)  # two questions: fine
    with pytest.raises(
        ValueError,
        match=r"n_samples=3 is more than the dataset can give: the questions of RULER "
        r"task 'qa_1' number 2",
    ):
        guards.check_dataset(ds, 3)
    guards.check_dataset(instantiate(composed("dataset=ruler_smoke").dataset), 10**6)  # synthetic: no limit


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.tasks=[nope]", "unknown LongBench tasks ['nope']"),
        ("dataset.max_context_length=0", "max_context_length=0 must be >= 1"),
    ],
)
def test_longbench_parameters(override, message):
    with pytest.raises(InstantiationException) as info:
        instantiate(composed("dataset=longbench", override).dataset)
    assert isinstance(input_error(info.value), ValueError) and message in str(input_error(info.value))


@pytest.mark.parametrize(
    "dataset, override, message",
    [
        ("ruler_smoke", "dataset.tasks=[nope]", "unknown RULER tasks ['nope']"),
        ("ruler_smoke", "dataset.context_lengths=[32]", "context_length=32 must be >= 64 tokens"),
        ("needle", "dataset.context_length=32", "context_length=32 tokens is too short for a needle (minimum 64)"),
        ("needle", "dataset.depths=[120]", "needle depths [120] must lie in [0, 100]"),
        ("multidoc", "dataset.context_lengths=[300]", "context_lengths [300] must be >= 2 * passage_tokens + 128"),
    ],
)
def test_dataset_parameters(dataset, override, message):
    with pytest.raises(InstantiationException) as info:
        instantiate(composed(f"dataset={dataset}", override).dataset)
    assert message in str(input_error(info.value))


def test_ruler_length_below_a_tasks_smallest_prompt(monkeypatch, tmp_path):
    _refused(
        monkeypatch,
        tmp_path,
        "context_length=256 is too short for RULER task 'niah_single_1'",
        "dataset.tasks=[niah_single_1]",
        "dataset.context_lengths=[256]",
        "n_samples=1",
        model=make_tiny_family("llama-3.2-3b", vocab=128),
        dataset="ruler_smoke",
    )


def test_an_empty_shard(monkeypatch, tmp_path):
    _refused(
        monkeypatch,
        tmp_path,
        "shard=3/4 is empty: the dataset gives 2 example(s), so shard i/n needs i < 2",
        "n_samples=2",
        "shard=3/4",
        "dataset.context_length=128",
        model=make_tiny_family("llama-3.2-3b", vocab=128),
    )


def test_filters_that_drop_every_example(monkeypatch, tmp_path):
    _refused(
        monkeypatch,
        tmp_path,
        "the dataset gives no example for these settings",
        f"dataset.source={FIXTURES}",
        "dataset.tasks=[trec]",
        "dataset.skip_longer_than=5",
        model=make_tiny_family("llama-3.2-3b", vocab=128),
        dataset="longbench",
    )


def test_a_tokenizer_larger_than_the_models_vocabulary(monkeypatch, tmp_path):
    model = make_tiny_family("llama-3.2-3b", vocab=64)  # the char tokenizer has 99 tokens, letters above 64
    _refused(
        monkeypatch,
        tmp_path,
        "is not below the model's vocab_size=64 (its embedding rows): the tokenizer does not fit the model",
        "n_samples=1",
        "dataset.context_length=128",
        model=model,
    )
    guards.check_model(model, char_tokenizer())  # a tokenizer may hold unused tokens beyond the embedding
    guards.check_model_input(model, 10, 2, 2, "x", max_token_id=63)
    with pytest.raises(ValueError, match="example x: token id 64 is not below the model's vocab_size=64"):
        guards.check_model_input(model, 10, 2, 2, "x", max_token_id=64)


def test_an_unsupported_model_class_without_a_press(monkeypatch, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=512, n_embd=32, n_layer=2, n_head=2)).eval()
    _refused(
        monkeypatch,
        tmp_path,
        "model class GPT2LMHeadModel is not supported",
        "press=no_press",
        "n_samples=1",
        "dataset.context_length=128",
        model=gpt2,
    )


def test_a_prompt_longer_than_the_models_positions(monkeypatch, tmp_path):
    model = make_tiny_family("llama-3.2-3b", vocab=128)
    model.config.max_position_embeddings = 256
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    _refused(
        monkeypatch,
        tmp_path,
        "positions, more than the model's max_position_embeddings=256",
        "n_samples=1",
        "dataset.context_length=240",
        "max_new_tokens=8",
        model=model,
    )


def test_max_positions_follows_rope_scaling():
    model = make_tiny_family("qwen2.5-1.5b", vocab=128)
    assert guards.max_positions(model) == 32768
    model.config.rope_parameters = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "rope_theta": 1e6,
    }  # Qwen2.5's documented YaRN setting for 128k
    assert guards.max_positions(model) == 131072
    assert guards.max_positions(make_tiny_family("llama-3.1-8b", vocab=128)) == 131072  # llama3: already extended
    guards.check_model_input(model, 131000, 40, 32)
    with pytest.raises(
        ValueError,
        match=r"example x: context 131000 \+ question 60 \+ max_new_tokens 32 = 131092 "
        r"positions, more than the model's max_position_embeddings=131072",
    ):
        guards.check_model_input(model, 131000, 60, 32, "x")


def test_config_arguments_that_do_not_fit_the_target_are_input_errors():
    """A nested ``_target_`` whose arguments do not fit (e.g. a proposal scorer that needs a wrapped press) is an
    input error: the CLI prints Hydra's message, which names the target and the config key, on one line; any other
    exception raised inside a target stays a crash."""
    with pytest.raises(InstantiationException) as info:
        instantiate(composed("press=snis_expected_attention", "press.proposal._target_=kvpress.CriticalKVPress").press)
    err = input_error(info.value)
    assert err is info.value and "CriticalKVPress" in str(err) and "press.proposal" in str(err)
    assert input_error(RuntimeError("boom")) is None
