"""Questions over standard library sources and documentation (evaluation/datasets/stdlib_docs.py): every answer
occurs in its context exactly once, the facts are what the interpreter itself says, both protocols, the split,
seeding."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
from _tiny_tokenizer import byte_tokenizer

from evaluation.datasets import stdlib
from evaluation.datasets.stdlib_docs import QUESTIONS, TASKS, StdlibDocsDataset, file_facts, unique_problem
from evaluation.datasets.tokens import count_tokens

TOK = byte_tokenizer()  # one token per byte: lengths are byte counts
LENGTHS = [1500, 4000]


@pytest.fixture(scope="module")
def generated():
    ds = StdlibDocsDataset(tasks=TASKS, context_lengths=LENGTHS, split="dev", window_tokens=400)
    return ds, ds.examples(TOK, 3, seed=5, query_aware=False), ds.examples(TOK, 3, seed=5, query_aware=True)


def test_every_answer_occurs_in_its_context_exactly_once(generated):
    ds, after, inside = generated
    assert [e.task for e in after] == [t for t in TASKS for _ in range(6)]
    for a, b in zip(after, inside):
        answer = a.answers[0].lower()
        for whole in (a.context + a.question, b.context):  # what the model reads, in either protocol
            assert whole.lower().count(answer) == 1, (a.id, answer)
            assert answer not in whole[whole.index("Question: ") :].lower()  # not in the question itself
        assert b.question == "" and b.context == a.context + "\n\n" + a.question
        assert a.answers == b.answers and a.answer_prefix == b.answer_prefix
        subject = re.escape(a.metadata["subject"])
        pattern = rf"(?<![\w.]){subject}\s*=(?!=)" if a.task == "constant_value" else rf"\bdef\s+{subject}\s*\("
        assert len(re.findall(pattern, a.context)) == 1  # the subject is defined once
        assert f"`{a.metadata['subject']}`" in a.question
        question, prefix = (
            s.format(subject=a.metadata["subject"], param=a.metadata["param"]) for s in QUESTIONS[a.task]
        )
        assert a.question.endswith(f"Question: {question}\nAnswer:") and a.answer_prefix == prefix
        # the fact's lines stand in the context as the file has them
        first, last = a.metadata["fact_lines"]
        lines = stdlib.read_source(a.metadata["file"]).splitlines(keepends=True)
        assert "".join(lines[first - 1 : last]).rstrip("\n") in a.context
        assert answer in "".join(lines[first - 1 : last]).lower()
        tokens = count_tokens(TOK, a.context + "\n\n" + a.question)
        assert tokens == a.metadata["prompt_tokens"] and 0.9 * a.metadata["context_length"] <= tokens
        assert tokens <= a.metadata["context_length"]
        assert ds.score(f"{a.answer_prefix} {a.answers[0]}.", a) == 1.0
        assert ds.score(a.answer_prefix + " something else", a) == 0.0
        assert ds.score(a.answers[0].upper(), a) == 1.0  # string_match_all ignores case


def test_uniqueness_check_refuses_repeats():
    fact = next(f for f in file_facts("calendar.py") if f.task == "constant_value")
    line = f"{fact.subject} = {fact.answer}\n"
    assert unique_problem(fact, line, "Question?") is None
    assert unique_problem(fact, line + "# " + fact.answer + "\n", "Question?") == "the answer occurs 2 times"
    assert unique_problem(fact, line + line, "Q") == "the answer occurs 2 times"
    assert unique_problem(fact, line, f"what is {fact.answer}?") == "the question holds the answer"


@pytest.mark.parametrize("module", ["calendar", "textwrap", "json.encoder", "ftplib", "smtplib"])
def test_facts_agree_with_the_interpreter(module):
    """What the syntax tree gives is what ``inspect.signature`` and the imported module say."""
    mod = importlib.import_module(module)
    relpath = module.replace(".", "/") + ".py"
    facts = file_facts(relpath)
    assert facts
    checked = 0
    for fact in facts:
        if fact.task == "constant_value":
            value = getattr(mod, fact.subject)
            assert value == (fact.answer if isinstance(value, str) else eval(fact.answer)), fact
            checked += 1
        elif fact.task == "method_class":
            cls = getattr(mod, fact.answer, None)
            if isinstance(cls, type):
                assert fact.subject in vars(cls)
                checked += 1
        else:
            owner = getattr(mod, fact.owner, None) if fact.owner else mod
            function = getattr(owner, fact.subject, None)
            if not callable(function) or getattr(function, "__module__", None) != mod.__name__:
                continue  # a nested function, or a name the module rebinds
            default = inspect.signature(function).parameters[fact.param].default
            if isinstance(default, str) and default == fact.answer:  # a string literal, without its quotes
                checked += 1
                continue
            assert eval(fact.answer, vars(mod)) == default, fact  # the source text evaluates to the default
            checked += 1
    assert checked >= 2


def test_split_and_seeding():
    dev, test = set(stdlib.topics_in_split("dev")), set(stdlib.topics_in_split("test"))
    assert dev and test and not dev & test
    ds = StdlibDocsDataset(tasks=["param_default"], context_lengths=[1500], split="test", window_tokens=300)
    a = ds.examples(TOK, 4, seed=11, query_aware=False)
    files = set(stdlib.files_in_split("test"))
    for e in a:
        assert e.metadata["file"] in files
        titles = re.findall(r"^File (\S+), lines \d+-\d+:$", e.context, flags=re.M)
        topics = re.findall(r"^Documentation topic '(.+)':$", e.context, flags=re.M)
        assert titles and set(titles) <= files and set(topics) <= test
    again = ds.examples(TOK, 4, seed=11, query_aware=False)
    assert [(e.context, e.question, e.answers) for e in a] == [(e.context, e.question, e.answers) for e in again]
    assert [e.context for e in ds.examples(TOK, 2, seed=11, query_aware=False)] == [e.context for e in a[:2]]
    assert [e.answers for e in ds.examples(TOK, 4, seed=12, query_aware=False)] != [e.answers for e in a]


def test_bad_parameters():
    with pytest.raises(ValueError, match="unknown stdlib_docs tasks"):
        StdlibDocsDataset(tasks=["param_default", "nope"])
    with pytest.raises(ValueError, match="split='train'"):
        StdlibDocsDataset(split="train")
    with pytest.raises(ValueError, match="window_tokens=10"):
        StdlibDocsDataset(window_tokens=10)
    with pytest.raises(ValueError, match=r"context_lengths \[500\] must be >= 800 tokens \(2 \* window_tokens\)"):
        StdlibDocsDataset(context_lengths=[500])
    with pytest.raises(ValueError, match="n_samples=0"):
        StdlibDocsDataset(context_lengths=[1000]).examples(TOK, 0, seed=0, query_aware=False)
