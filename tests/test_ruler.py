"""RULER generator: lengths in model tokens, task correctness, scoring, determinism (offline tokenizer)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from _tiny_tokenizer import word_tokenizer

from evaluation.datasets.ruler import MAX_NEW_TOKENS, RULER_TASKS, SYNTHETIC_TASKS, RulerDataset
from evaluation.datasets.tokens import count_tokens

L = 1024


@pytest.fixture(scope="module")
def examples():
    ds = RulerDataset(context_lengths=[L], num_samples=2)
    return ds, ds.examples(word_tokenizer(), None, 0, False)


def _text(e):
    return e.context + e.question + e.answer_prefix


def test_every_task_fills_the_target_length(examples):
    ds, exs = examples
    assert sorted({e.task for e in exs}) == sorted(SYNTHETIC_TASKS) and len(exs) == 2 * len(SYNTHETIC_TASKS)
    tok = word_tokenizer()
    for e in exs:
        n = count_tokens(tok, _text(e))
        assert n == e.metadata["prompt_tokens"]
        assert n + e.max_new_tokens <= L, e.id  # RULER's max_seq_length includes generation
        assert n + e.max_new_tokens >= 0.9 * L, (e.id, n)  # the haystack filled the budget
        assert e.max_new_tokens == MAX_NEW_TOKENS[RULER_TASKS[e.task].kind]
        assert e.metadata["context_length"] == L and e.id.startswith(f"{e.task}_{L}_")


def test_niah_needles_questions_and_depth(examples):
    _, exs = examples
    for e in (e for e in exs if e.task.startswith("niah")):
        for a in e.answers:
            assert f"is: {a}." in e.context, e.id  # every answer sits in a needle of the haystack
        spec = RULER_TASKS[e.task].args
        assert len(e.answers) == spec["num_needle_v"] * spec["num_needle_q"]
        if len(e.answers) == 1:
            assert e.question.startswith("What is the special magic ") and e.answer_prefix.endswith(" is")
        else:
            assert e.question.startswith("What are all the special magic ") and e.answer_prefix.endswith(" are")
        keys = re.findall(r"special magic \w+ for (.+) mentioned", e.question)[0]
        assert keys in e.answer_prefix
        haystack = e.context[e.context.index("\n") + 1 : -1]  # between the instruction line and the question
        starts = [haystack.rfind("One of the special magic", 0, haystack.find(f"is: {a}.")) for a in e.answers]
        assert e.metadata["depth"] == pytest.approx(100 * min(starts) / len(haystack), abs=0.051)
    haystacks = {e.task: e.metadata["haystack"] for e in exs if e.task.startswith("niah")}
    assert haystacks["niah_single_1"] == "noise" and haystacks["niah_single_2"] == "essay"
    assert haystacks["niah_multikey_2"] == "needle"
    mk3 = next(e for e in exs if e.task == "niah_multikey_3")
    assert len(re.findall(r"One of the special magic uuids for [0-9a-f-]{36} is", mk3.context)) > 5  # distractors


def test_vt_chain_resolves_to_the_answers(examples):
    _, exs = examples
    for e in (e for e in exs if e.task == "vt"):
        value = re.search(r"assigned the value (\d+) in the text above", e.question).group(1)
        task_part = e.context[e.context.rfind("Memorize and track") :]  # after the few-shot example
        assign = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", task_part))
        found, frontier = set(), {value}
        while frontier:  # follow the chain from the value to every variable that holds it
            new = {v for v, src in assign.items() if src.removeprefix("VAR ") in frontier} - found
            found |= new
            frontier = new
        assert found == set(e.answers) and len(e.answers) == 5
        assert e.context.startswith("Memorize and track") and e.context.count("Memorize and track") == 2


def test_cwe_answers_are_the_most_common_words(examples):
    _, exs = examples
    for e in (e for e in exs if e.task == "cwe"):
        listing = e.context[e.context.rfind("Memorize the ones that appear most often.") :]
        counts = Counter(re.findall(r"\d+\. (\S+)", listing))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(e.answers) and min(counts[a] for a in e.answers) > max(
            c for w, c in counts.items() if w not in top
        )


def test_fwe_answers_are_the_most_frequent_coded_words(examples):
    _, exs = examples
    for e in (e for e in exs if e.task == "fwe"):
        words = e.context[e.context.find("coded words. ") + 13 :].split()
        counts = Counter(w for w in words if w != "...")
        assert [w for w, _ in counts.most_common(3)] == e.answers


def test_scores(examples):
    ds, exs = examples
    for e in exs:
        assert ds.score(" " + ", ".join(a.upper() for a in e.answers) + ".", e) == 1.0  # listing all
        assert ds.score("I do not know.", e) == 0.0
    mv = next(e for e in exs if e.task == "niah_multivalue")
    assert ds.score(" ".join(mv.answers[:2]), mv) == 0.5  # string_match_all is recall


def test_deterministic_in_seed_and_prefix_under_n_samples():
    tok = word_tokenizer()
    ds = RulerDataset(tasks=["niah_single_2", "vt"], context_lengths=[512], num_samples=3)
    a = ds.examples(tok, None, 1, False)
    assert [_text(e) for e in a] == [_text(e) for e in ds.examples(tok, None, 1, False)]
    b = ds.examples(tok, 2, 1, False)  # n_samples sets the count per task: the first two of each
    assert [_text(e) for e in b] == [_text(e) for e in a if e.metadata["index"] < 2]
    c = ds.examples(tok, 5, 1, False)  # more than num_samples: n_samples wins, a's examples are its prefix
    assert sorted(e.metadata["index"] for e in c if e.task == "vt") == [0, 1, 2, 3, 4]
    assert [_text(e) for e in c if e.metadata["index"] < 3] == [_text(e) for e in a]
    with pytest.raises(ValueError, match="n_samples=0"):
        ds.examples(tok, 0, 1, False)
    assert [_text(e) for e in ds.examples(tok, None, 2, False)] != [_text(e) for e in a]
    again = RulerDataset(tasks=["niah_single_2", "vt"], context_lengths=[512], num_samples=3)
    assert again.examples(tok, None, 1, False)[0] is a[0]  # memoised across instances (sweeps)


def test_query_aware_and_lengths_scale():
    tok = word_tokenizer()
    (e,) = RulerDataset(tasks=["niah_single_1"], context_lengths=[512], num_samples=1).examples(tok, None, 0, True)
    assert e.question == "" and e.context.endswith("mentioned in the provided text?")
    for length in (512, 2048):  # the prompt fills length - max_new_tokens at every length
        (ex,) = RulerDataset(tasks=["niah_single_3"], context_lengths=[length], num_samples=1).examples(
            tok, None, 0, False
        )
        assert 0.95 * (length - 128) <= ex.metadata["prompt_tokens"] <= length - 128


def test_errors():
    with pytest.raises(ValueError, match="unknown RULER tasks"):
        RulerDataset(tasks=["niah_single_9"])
    with pytest.raises(ValueError, match="context_length=32"):
        RulerDataset(context_lengths=[32])
    with pytest.raises(ValueError, match="context_length=256 is too short for RULER task 'cwe'"):
        RulerDataset(tasks=["cwe"], context_lengths=[256], num_samples=1).examples(word_tokenizer(), None, 0, False)


def test_qa_offline_error_names_the_dataset(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"'rajpurkar/squad_v2'.*qa_data_dir"):
        RulerDataset(tasks=["qa_1"], num_samples=1).examples(word_tokenizer(), None, 0, False)


def test_qa_from_a_local_squad_file(tmp_path):
    paragraphs = [
        {
            "context": f"Paragraph {i} says the code word is token{i}.",
            "qas": [
                {
                    "question": f"What is the code word of paragraph {i}?",
                    "is_impossible": False,
                    "answers": [{"text": f"token{i}"}],
                }
            ],
        }
        for i in range(30)
    ]
    (tmp_path / "squad.json").write_text(json.dumps({"data": [{"paragraphs": paragraphs}]}))
    ds = RulerDataset(tasks=["qa_1"], context_lengths=[512], num_samples=2, qa_data_dir=str(tmp_path))
    exs = ds.examples(word_tokenizer(), None, 0, False)
    for e in exs:
        assert e.answers[0] in e.context and e.question.startswith("Question: What is the code word")
        assert e.answer_prefix == " Answer:" and e.max_new_tokens == 32
        assert count_tokens(word_tokenizer(), _text(e)) + 32 <= 512
        assert ds.score(f"It is {e.answers[0].upper()}", e) == 1.0  # string_match_part
    with pytest.raises(FileNotFoundError, match="hotpotqa.json"):
        RulerDataset(tasks=["qa_2"], qa_data_dir=str(tmp_path)).examples(word_tokenizer(), None, 0, False)
