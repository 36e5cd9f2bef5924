"""Needle generator (placement, length, special tokens) and its scorer, on the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from evaluation.datasets.needle import NeedleDataset


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from evaluation.models import embedded_model_dir

    try:
        return AutoTokenizer.from_pretrained(embedded_model_dir())
    except ImportError as err:  # pragma: no cover
        pytest.skip(str(err))


def sublist_at(seq, sub):
    """Indices where ``sub`` starts inside ``seq``."""
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


@pytest.mark.parametrize("length, tol", [(256, 0.3), (1024, 0.1)])
def test_length_placement_and_intact_needle(tokenizer, length, tol):
    """Depth is placed at a sentence boundary, so it is exact up to one sentence (coarse at 256 tokens)."""
    ds = NeedleDataset(context_length=length, depths=[0, 25, 50, 75, 100], n_per_depth=1)
    examples = ds.examples(tokenizer, None, seed=3, query_aware=False)
    assert [e.metadata["depth"] for e in examples] == [0, 25, 50, 75, 100]
    for ex in examples:
        ids = tokenizer.encode(ex.context, add_special_tokens=False)
        # counted in the model's tokens: never above the target, and within one sentence of it
        assert length - 80 <= len(ids) <= length
        assert ex.metadata["context_length"] == len(ids)
        assert ex.metadata["target_length"] == length  # what a report groups rows by (evaluation.report.row_length)
        needle_ids = tokenizer.encode(" " + ex.metadata["needle"], add_special_tokens=False)
        if ex.metadata["depth"] == 0:
            needle_ids = tokenizer.encode(ex.metadata["needle"], add_special_tokens=False)
        starts = sublist_at(ids, needle_ids)
        assert len(starts) == 1, "the needle's tokens appear exactly once, unsplit"
        assert starts[0] == ex.metadata["needle_token_start"]
        rel = starts[0] / len(ids)
        assert abs(rel - ex.metadata["depth"] / 100) < tol
        assert ex.metadata["needle"].split(": ")[1].rstrip(".") == ex.answers[0]
        assert len(ex.answers[0]) == 7 and ex.answers[0].isdigit()


def test_single_bos_through_pipeline_preprocessing(tokenizer):
    from kvpress import KVPressTextGenerationPipeline
    from transformers import LlamaConfig, LlamaForCausalLM

    ex = NeedleDataset(context_length=256, n_per_depth=1).examples(tokenizer, 1, seed=0, query_aware=False)[0]
    assert tokenizer.bos_token not in ex.context and tokenizer.eos_token not in ex.context
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    ids = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))["context_ids"][0].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    # the chat template reuses <|im_start|> as its turn marker: one per turn (system, user), none from the data
    assert ids.count(tokenizer.bos_token_id) == 2
    assert ex.question not in ex.context


def test_query_aware_and_seed_determinism(tokenizer):
    ds = NeedleDataset(context_length=256, n_per_depth=2)
    a = ds.examples(tokenizer, 3, seed=1, query_aware=False)
    b = ds.examples(tokenizer, 3, seed=1, query_aware=False)
    c = ds.examples(tokenizer, 3, seed=2, query_aware=False)
    assert [e.context for e in a] == [e.context for e in b]
    assert [e.answers for e in a] != [e.answers for e in c]
    qa = ds.examples(tokenizer, 3, seed=1, query_aware=True)
    for plain, aware in zip(a, qa):
        assert aware.question == "" and aware.context.endswith(plain.question)


def test_scorer():
    ds = NeedleDataset()
    from evaluation.datasets.base import Example

    ex = Example(id="x", context="", question="", answers=["1234567"])
    assert ds.score(" 1234567.", ex) == 1.0
    assert ds.score("the number is 123456", ex) == 0.0
    assert ds.score("", ex) == 0.0


@pytest.mark.parametrize(
    "kwargs, match", [({"depths": [-5]}, r"\[-5\].*\[0, 100\]"), ({"context_length": 10}, "context_length=10")]
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NeedleDataset(**kwargs)


def test_docs_haystack_keeps_the_needle_and_seeds_and_reads_only_its_split(tokenizer):
    """``haystack="docs"`` (issue 64 item 4): the same needles, depths and seeds as the prose haystack, in lines of
    CPython's documentation of one split only; the prose examples are unchanged by the option."""
    from evaluation.datasets.needle import haystack_units
    from evaluation.datasets.stdlib import topic_text, topics_in_split

    prose = NeedleDataset(context_length=1024).examples(tokenizer, 5, seed=3, query_aware=False)
    docs = NeedleDataset(context_length=1024, haystack="docs").examples(tokenizer, 5, seed=3, query_aware=False)
    dev = NeedleDataset(context_length=1024, haystack="docs", split="dev").examples(tokenizer, 5, 3, False)
    assert [e.id for e in prose][0] == "needle-1024-d0-0" and docs[0].id == "needle-docs-test-1024-d0-0"
    for p, d in zip(prose, docs):
        assert (p.answers, p.question, p.metadata["depth"]) == (d.answers, d.question, d.metadata["depth"])
        assert 1024 - 80 <= len(tokenizer.encode(d.context, add_special_tokens=False)) <= 1024
        lines = d.context.split("\n")
        assert d.metadata["needle"] in lines  # a whole line of its own
    test_lines = set(haystack_units("docs", "test")[0])
    dev_lines = set(haystack_units("docs", "dev")[0]) - test_lines
    for d in docs:
        hay = [line for line in d.context.split("\n") if line != d.metadata["needle"]]
        assert set(hay) <= test_lines and not set(hay) & dev_lines
    assert all(
        set(d.context.split("\n")) - {d.metadata["needle"]} <= set(haystack_units("docs", "dev")[0]) for d in dev
    )
    whole = "\n".join(topic_text(t) for t in topics_in_split("test"))
    assert docs[1].context.split("\n")[0] in whole
    with pytest.raises(ValueError, match="haystack='web' is not one of"):
        NeedleDataset(haystack="web")
    with pytest.raises(ValueError, match="split='train' must be one of"):
        NeedleDataset(haystack="docs", split="train")
