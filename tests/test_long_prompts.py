"""A prompt longer than the model's positions (issue 65 item 2): the harness refuses such an example
(``evaluation.guards.check_model_input``); on the Python path every press of the project refuses it when its
prefill starts, with one line naming the prompt length and ``max_position_embeddings`` (a RoPE model computes
positions past it without an error): directly, inside a kvpress wrapper, and through kvpress's pipeline."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from conftest import make_tiny_llama
from kvpress import ComposedPress, KVPressTextGenerationPipeline
from test_entroprefill import TOK
from transformers import DynamicCache

from presses import (
    EntroPrefillPress,
    KVzipPagePress,
    KVzipSamplingPress,
    PageEntroKVPress,
    PageEntroKVReconstructionPress,
    ProbabilisticEvictionPress,
)
from presses.core.model import max_positions

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LIMIT = 48  # the tiny model's max_position_embeddings here


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Llama with ``max_position_embeddings=48`` and a checkpoint directory holding its tokenizer (kvpress's
    KVzip reloads it from there)."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    model.config.max_position_embeddings = LIMIT
    path = tmp_path_factory.mktemp("checkpoint")
    char_tokenizer().save_pretrained(path)
    model.config.name_or_path = str(path)
    return model


PRESSES = {
    "page_entrokv": lambda: PageEntroKVPress(0.5, page_size=8, window_size=8),
    "page_entrokv_in_composed": lambda: ComposedPress([PageEntroKVPress(0.5, page_size=8, window_size=8)]),
    "probabilistic": lambda: ProbabilisticEvictionPress(0.5),
    "entroprefill": lambda: EntroPrefillPress(0.5, tokenizer=TOK, n_sink=2),
    "kvzip_page": lambda: KVzipPagePress(0.5, page_size=8),
    "page_entrokv_reconstruction": lambda: PageEntroKVReconstructionPress(0.5, page_size=8),
    "kvzip_sampling": lambda: KVzipSamplingPress(0.5, page_size=8),
}


@pytest.mark.parametrize("name", PRESSES)
def test_every_press_refuses_a_prompt_longer_than_the_models_positions(model, name):
    ids = torch.randint(4, 128, (1, LIMIT + 1), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"the prompt has {LIMIT + 1} tokens.*max_position_embeddings={LIMIT}"):
        with torch.no_grad(), PRESSES[name]()(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
    if name != "entroprefill":  # a prompt of exactly the model's positions goes through (EntroPrefill needs a
        cache = DynamicCache()  # question in it, tests/test_entroprefill.py)
        with torch.no_grad(), PRESSES[name]()(model):
            model.model(input_ids=ids[:, :LIMIT], past_key_values=cache)
        assert cache.get_seq_length() >= 1


def test_kvpress_pipeline_with_a_press_of_ours_refuses_it(model):
    """kvpress's pipeline truncates the context only to the tokenizer's ``model_max_length`` (1e30 for many
    tokenizers): the press's prefill refuses what the model cannot take; a context that fits is answered."""
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=char_tokenizer(), device=torch.device("cpu"))
    press = PageEntroKVPress(0.5, page_size=8, window_size=8)
    with pytest.raises(ValueError, match=rf"PageEntroKVPress: the prompt has {LIMIT + 1} tokens"):
        pipe("x" * LIMIT, question="", press=press, max_new_tokens=1)  # the BOS token makes LIMIT + 1
    assert isinstance(pipe("x" * 20, question="", press=press, max_new_tokens=1)["answer"], str)


def test_max_positions_reads_rope_scaling(model):
    assert max_positions(model) == LIMIT == max_positions(model.model)  # the causal LM or its decoder stack
    cfg = copy.deepcopy(model.config)
    cfg.rope_scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert max_positions(SimpleNamespace(config=cfg)) == 128  # 4 x 32 > 48
