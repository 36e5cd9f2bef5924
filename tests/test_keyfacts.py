"""The key-value multi-passage set (evaluation/datasets/keyfacts.py): structure, seeding, the answer passage as
EntroPrefill's own chunking finds it, the three distractor modes, and its scorer."""

from __future__ import annotations

import re

import pytest
from _tiny_tokenizer import byte_tokenizer

from evaluation.datasets.keyfacts import KEYS, OTHER_KINDS, KeyFactsDataset
from presses.entroprefill.chunking import PASSAGE_PATTERN, find_question, plan_chunks, token_offsets

TOK = byte_tokenizer()  # one token per byte: lengths are character counts


def _holders(e, pattern):
    """Chunk indices (EntroPrefill's passage chunking) whose text matches ``pattern``."""
    q = find_question(e.context, "Question:")
    ids = TOK(e.context, add_special_tokens=False)["input_ids"]
    text, offs = token_offsets(TOK, ids)
    plan = plan_chunks(text, offs, mode="passage", question_start=q, n_sink=4)
    assert plan.candidates == list(range(len(plan.chunks)))
    return plan, [i for i, (s, c) in enumerate(plan.chunks) if re.search(pattern, text[offs[s][0] : offs[c - 1][1]])]


@pytest.mark.parametrize("mode", ["none", "other", "number"])
def test_structure_and_answer_passage(mode):
    ds = KeyFactsDataset(context_lengths=[1500, 3000], passage_tokens=150, distractor_facts=mode, num_samples=4)
    exs = ds.examples(TOK, 3, seed=5, query_aware=True)
    assert [e.metadata["target_length"] for e in exs] == [1500] * 3 + [3000] * 3
    for e in exs:
        ans, key, n = e.answers[0], e.metadata["key"], e.metadata["n_passages"]
        assert e.question == "" and e.context.endswith("Answer:")
        assert re.fullmatch(r"\d{7}", ans) and e.context.count(ans) == 1 and key in KEYS
        assert len(re.findall(PASSAGE_PATTERN, e.context)) == n >= 2
        assert e.context[find_question(e.context, "Question:") :].count(key) == 1  # the question names the key
        assert e.answer_prefix == f"The special magic number for {key} is"
        plan, holders = _holders(e, re.escape(f"The special magic number for {key} is {ans}."))
        assert len(plan.chunks) == n and holders == [e.metadata["answer_passage"] - 1]
        facts = _holders(e, r"The special magic \w+ for \w+ is")[1]
        numbers = _holders(e, r"The special magic number for")[1]
        if mode == "none":  # the only fact of the context
            assert facts == numbers == holders
        elif mode == "other":  # one fact per passage, the only magic NUMBER is the answer's
            assert facts == list(range(n)) and numbers == holders
        else:  # one magic number per passage, under distinct keys
            assert numbers == list(range(n))
            assert len(set(re.findall(r"The special magic number for (\w+) is", e.context))) == n
        if mode == "other":
            kinds = set(re.findall(r"The special magic (\w+) for", e.context)) - {"number"}
            assert kinds and kinds <= set(OTHER_KINDS)
        assert 0.85 * e.metadata["target_length"] < e.metadata["context_length"] <= e.metadata["target_length"]
        assert ds.score(f"{e.answer_prefix} {ans}.", e) == 1.0 and ds.score(ans[:-1], e) == 0.0


def test_seeding_prefixes_and_question_after_compression():
    ds = KeyFactsDataset(context_lengths=[2000], passage_tokens=100, num_samples=2)
    exs = ds.examples(TOK, None, seed=1, query_aware=True)
    assert len(exs) == 2
    more = ds.examples(TOK, 4, seed=1, query_aware=True)
    assert [e.context for e in more[:2]] == [e.context for e in exs]  # n_samples extends, never reshuffles
    other = ds.examples(TOK, 2, seed=2, query_aware=True)
    assert [e.answers for e in other] != [e.answers for e in exs]
    asked_later = ds.examples(TOK, None, seed=1, query_aware=False)
    assert [e.answers for e in asked_later] == [e.answers for e in exs]
    assert all(e.question.startswith("Answer the question") and "Question:" not in e.context for e in asked_later)
    many = ds.examples(TOK, 40, seed=1, query_aware=True)  # the answer passage is drawn over the whole context
    depths = [e.metadata["depth"] for e in many]  # 100 * (answer_passage - 1) / (n_passages - 1)
    assert min(depths) == 0 and max(depths) == 100 and 20 < sum(depths) / len(depths) < 80


def test_bad_parameters():
    with pytest.raises(ValueError, match="distractor_facts='colour'"):
        KeyFactsDataset(distractor_facts="colour")
    with pytest.raises(ValueError, match="passage_tokens=16"):
        KeyFactsDataset(passage_tokens=16)
    with pytest.raises(ValueError, match="room for two passages"):
        KeyFactsDataset(context_lengths=[200], passage_tokens=96)
    with pytest.raises(ValueError, match="n_samples=0"):
        KeyFactsDataset(context_lengths=[2000]).examples(TOK, 0, seed=0, query_aware=True)


@pytest.mark.usefixtures("one_thread")
def test_configured_lengths_fit_the_embedded_model(embedded_model):
    """Every length of configs/dataset/keyfacts.yaml passes the harness's input check on the embedded model (the
    chat template, answer prefix and answer within its 8192 positions), both question placements."""
    import torch
    from omegaconf import OmegaConf

    from evaluation import loop
    from evaluation.pipeline import TextGenerationPipeline

    model, tok = embedded_model
    cfg = OmegaConf.load("configs/dataset/keyfacts.yaml")
    ds = KeyFactsDataset(
        context_lengths=list(cfg.context_lengths),
        passage_tokens=cfg.passage_tokens,
        distractor_facts=cfg.distractor_facts,
        max_new_tokens=cfg.max_new_tokens,
    )
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    for query_aware in (True, False):
        loop._check_inputs(ds.examples(tok, 2, seed=0, query_aware=query_aware), [], pipe, model, tok, None)


@pytest.mark.usefixtures("one_thread")
def test_input_check_refuses_a_repeated_example_id(embedded_model):
    """The harness keys rows, resume and the tokenised inputs by example id: a dataset that repeats one is
    refused before anything runs, naming the id."""
    import torch

    from evaluation import loop
    from evaluation.pipeline import TextGenerationPipeline

    model, tok = embedded_model
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    (ex,) = KeyFactsDataset(context_lengths=[2000]).examples(tok, 1, seed=0, query_aware=True)
    assert len(loop._check_inputs([ex], [], pipe, model, tok, None)) == 1
    with pytest.raises(ValueError, match=re.escape(f"example id '{ex.id}' appears twice")):
        loop._check_inputs([ex, ex], [], pipe, model, tok, None)
