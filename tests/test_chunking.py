"""Chunking (paper 001 section 2.1): each mode, protected spans, the protected-overlap rule, token
offsets, and the multi-document QA dataset built on the same passage markers."""

from __future__ import annotations

import pytest
import torch

from presses.entroprefill.chunking import (
    PASSAGE_PATTERN,
    find_question,
    passage_marker,
    plan_chunks,
    token_offsets,
)


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)


def char_plan(text, **kw):
    """Plan on a one-token-per-character tokenization (token index == character index)."""
    offsets = [(i, i + 1) for i in range(len(text))]
    return plan_chunks(text, offsets, **kw)


def spans_text(text, spans):
    return [text[s:e] for s, e in spans]


TEXT = (
    "Read the passages.\n\n"
    + passage_marker(1)
    + "\nalpha beta.\n\n"
    + passage_marker(2)
    + "\ngamma delta.\n\n"
    + passage_marker(3)
    + "\nepsilon.\n\nQuestion: what?"
)


def test_passage_mode_chunks_and_protection():
    q = find_question(TEXT, r"Question:")
    plan = char_plan(TEXT, mode="passage", question_start=q, n_sink=2)
    assert spans_text(TEXT, plan.chunks) == ["\nalpha beta.\n\n", "\ngamma delta.\n\n", "\nepsilon.\n\n"]
    assert plan.candidates == [0, 1, 2]
    prot = spans_text(TEXT, plan.protected)
    # instruction, each marker and the question are protected (the sinks lie inside the instruction)
    assert prot == ["Read the passages.\n\nPassage 1:", "Passage 2:", "Passage 3:", "Question: what?"]
    assert plan.question == (q, len(TEXT))
    # every token is either in a chunk or protected, never both
    covered = torch.zeros(len(TEXT), dtype=torch.int64)
    for s, e in plan.chunks + plan.protected:
        covered[s:e] += 1
    assert (covered == 1).all()
    R = plan.retained_indices([1])
    assert "".join(TEXT[i] for i in R.tolist()) == TEXT.replace("\ngamma delta.\n\n", "")
    with pytest.raises(ValueError, match="outside"):
        plan.retained_indices([3])


def test_protected_overlap_rule_and_sinks():
    q = find_question(TEXT, r"Question:")
    plan = char_plan(TEXT, mode="passage", question_start=q, n_sink=2, protect_pattern=r"gamma")
    assert plan.protected_chunk == [False, True, False]
    assert plan.candidates == [0, 2]
    with pytest.raises(ValueError, match="protected"):
        plan.retained_indices([1])
    # sinks that reach into the first chunk protect it
    text = "Passage 1:\nabc\n\nPassage 2:\ndef\n\nQuestion: q"
    plan = char_plan(text, mode="passage", question_start=text.index("Question"), n_sink=12)
    assert plan.protected_chunk == [True, False]
    plan = char_plan(text, mode="passage", question_start=text.index("Question"), n_sink=4)
    assert plan.protected_chunk == [False, False]


def test_paragraph_and_regex_modes():
    text = "Instruction line\n\nfirst para one\n\n  \nsecond para\n\nthird\n\nQuestion: x"
    plan = char_plan(text, mode="paragraph", question_start=text.index("Question"), n_sink=0)
    assert spans_text(text, plan.chunks) == ["first para one", "second para", "third"]
    assert spans_text(text, plan.protected)[0] == "Instruction line\n\n"
    text2 = "head ### one ### two ### three || Question: y"
    plan = char_plan(text2, mode="regex", delimiter=r"###|\|\|", question_start=text2.index("Question"), n_sink=0)
    assert spans_text(text2, plan.chunks) == [" one ", " two ", " three "]
    with pytest.raises(ValueError, match="delimiter"):
        char_plan(text2, mode="regex", question_start=0)


def test_block_mode():
    text = "S" * 4 + "x" * 50 + "Question: z"
    q = text.index("Question")
    plan = char_plan(text, mode="block", block_size=16, question_start=q, n_sink=4)
    assert plan.chunks == [(4, 20), (20, 36), (36, 52), (52, 54)]
    assert plan.candidates == [0, 1, 2, 3]
    # doc_start_pattern moves the documents after the instruction; a protect match protects a block
    text = "INSTR: read\n" + "y" * 40 + "KEEP" + "y" * 20 + "Question: z"
    plan = char_plan(
        text,
        mode="block",
        block_size=20,
        question_start=text.index("Question"),
        n_sink=2,
        doc_start_pattern=r"read\n",
        protect_pattern="KEEP",
    )
    assert plan.chunks[0][0] == text.index("y")
    keep = text.index("KEEP")
    assert [s <= keep < e for s, e in plan.chunks] == plan.protected_chunk
    assert sum(plan.protected_chunk) == 1
    with pytest.raises(ValueError, match="block_size"):
        char_plan(text, mode="block", block_size=0, question_start=0)
    with pytest.raises(ValueError, match="mode"):
        char_plan(text, mode="sentences")


def test_straddling_tokens_belong_to_one_side():
    # multi-character tokens: ".\n\nPass" straddles a chunk end and a marker
    text = "intro\n\nPassage 1:\nab.\n\nPassage 2:\ncd\n\nQuestion: q"
    cuts = [0, 5, 7, 14, 17, 21, 27, 34, 36, 37, 38, 41, 48]  # arbitrary token boundaries
    cuts = sorted(set(cuts + [len(text)]))
    offsets = list(zip(cuts[:-1], cuts[1:]))
    plan = plan_chunks(text, offsets, mode="passage", question_start=text.index("Question"), n_sink=1)
    tokens_in = [set(range(s, e)) for s, e in plan.chunks] + [set(range(s, e)) for s, e in plan.protected]
    allt = [t for s in tokens_in for t in s]
    assert len(allt) == len(set(allt)) == len(offsets)  # a partition of the tokens
    assert plan.candidates == [0, 1]


def test_token_offsets_exact_and_fallback():
    from _tiny_tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    text = "Passage 1:\nabc é\n\nQuestion: x?"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    dec, offs = token_offsets(tok, ids)
    assert dec == text and len(offs) == len(ids)
    assert offs[0][0] == 0 and offs[-1][1] == len(text)
    dec2, offs2 = token_offsets(CharTokenizer(), [ord(c) for c in "ab\nc"])
    assert dec2 == "ab\nc" and offs2 == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_find_question_takes_last_match():
    assert find_question("Question: a\nQuestion: b", r"Question:") == 12
    assert find_question("no question here", r"Question:") is None


# --------------------------------------------------------------------------------------------
# The multi-document QA dataset
# --------------------------------------------------------------------------------------------


def test_multidoc_dataset_structure():
    import re

    from _tiny_tokenizer import byte_tokenizer

    from evaluation.datasets.multidoc import MultiDocQADataset

    tok = byte_tokenizer()  # one token per byte: lengths are character counts
    ds = MultiDocQADataset(context_lengths=[1500, 3000], passage_tokens=300, num_samples=3)
    exs = ds.examples(tok, 1, seed=3, query_aware=True)  # n_samples=1 per task and length
    assert [e.metadata["target_length"] for e in exs] == [1500, 1500, 3000, 3000]
    assert [e.task for e in exs] == ["multidoc_city", "multidoc_code"] * 2
    for e in exs:
        ans = e.answers[0]
        n = e.metadata["n_passages"]
        assert e.question == "" and e.context.rstrip().endswith("Answer:")
        assert len(re.findall(PASSAGE_PATTERN, e.context)) == n >= 2
        assert e.context.lower().count(ans.lower()) == 1
        q = find_question(e.context, "Question:")
        assert e.metadata["person"] in e.context[q:]
        # the answer lies in the announced passage, found by the press's own chunking
        ids = tok(e.context, add_special_tokens=False)["input_ids"]
        text, offs = token_offsets(tok, ids)
        plan = plan_chunks(text, offs, mode="passage", question_start=q, n_sink=4)
        assert len(plan.chunks) == n and plan.candidates == list(range(n))
        holders = [i for i, (s, c) in enumerate(plan.chunks) if ans in text[offs[s][0] : offs[c - 1][1]]]
        assert holders == [e.metadata["answer_passage"] - 1]
        assert e.metadata["context_length"] <= e.metadata["target_length"]
        assert e.metadata["context_length"] > 0.8 * e.metadata["target_length"]
        assert ds.score(f"It is {ans.upper()}.", e) == 1.0 and ds.score("Paris", e) == 0.0
    again = ds.examples(tok, None, seed=3, query_aware=False)
    assert len(again) == 12
    assert [e.answers for e in again if e.id in {x.id for x in exs}] == [e.answers for e in exs]
    assert all(e.question.startswith("Answer the question") and "Question:" not in e.context for e in again)
    more = MultiDocQADataset(context_lengths=[1500], passage_tokens=300, num_samples=1).examples(
        tok, 2, seed=3, query_aware=True
    )  # n_samples replaces num_samples (no silent cap)
    assert len(more) == 4 and [e.answers for e in more[:2]] == [e.answers for e in exs[:2]]
    with pytest.raises(ValueError, match="n_samples=0"):
        ds.examples(tok, 0, seed=3, query_aware=True)
    with pytest.raises(ValueError, match="fact_kinds"):
        MultiDocQADataset(fact_kinds=["color"])
