"""Next-line code completion on the standard library (evaluation/datasets/stdlib_code.py): every answer is the next
non-blank line of its file after the prompt's last line, LongBench's templates, lengths, the split, seeding."""

from __future__ import annotations

import ast
import re

import pytest
from _tiny_tokenizer import byte_tokenizer

from evaluation.datasets import stdlib
from evaluation.datasets.longbench import DATASET2PROMPT, split_prompt
from evaluation.datasets.stdlib_code import StdlibCodeDataset, cross_file_uses, is_answer_line, path_line
from evaluation.datasets.tokens import count_tokens

TOK = byte_tokenizer()  # one token per byte: lengths are byte counts
LENGTHS = [1200, 3000]


@pytest.fixture(scope="module")
def dev_examples():
    ds = StdlibCodeDataset(context_lengths=LENGTHS, split="dev", in_file_tokens=300)
    return ds, ds.examples(TOK, 4, seed=3, query_aware=False)


def _next_nonblank_line_after(text: str, code: str) -> tuple[int, str]:
    """The 0-based number and text of the first non-blank line of ``text`` after ``code``, which must end a line of
    ``text`` and occur in it once."""
    assert code.endswith("\n") and text.count(code) == 1
    end = text.index(code) + len(code)
    line_no = text[:end].count("\n")
    following = text[end:].split("\n")
    k = next(i for i, line in enumerate(following) if line.strip())
    return line_no + k, following[k]


def test_every_answer_is_the_next_nonblank_line_of_its_file(dev_examples):
    ds, exs = dev_examples
    assert [e.task for e in exs] == ["lcc"] * 8 + ["repobench-p"] * 8
    for e in exs:
        text = stdlib.read_source(e.metadata["file"])
        if e.task == "lcc":  # LongBench's lcc template around the file's head
            head = "Please complete the code given below. \n"
            assert e.context.startswith(head) and e.question == ""
            code = e.context[len(head) :]
            assert text.startswith(code)
        else:  # the input: the path line and the lines before the answer
            assert e.question.startswith(path_line(e.metadata["file"]))
            code = e.question[len(path_line(e.metadata["file"])) :]
            if text.count(code) != 1:  # a few short repeated lines: the recorded line pins the place
                lines = text.splitlines(keepends=True)
                assert "".join(lines[: e.metadata["answer_line"] - 1]).endswith(code)
                code = "".join(lines[: e.metadata["answer_line"] - 1])
        line_no, line = _next_nonblank_line_after(text, code)
        assert e.answers == [line.rstrip()] and line_no + 1 == e.metadata["answer_line"]
        assert is_answer_line(line) and ds.score(e.answers[0], e) == 1.0
        assert ds.score("\n" + e.answers[0] + "\nmore code", e) == 1.0  # LongBench scores the first code line
        assert e.context + e.question + e.answer_prefix == DATASET2PROMPT[e.task].format(
            context=e.context[len("Please complete the code given below. \n") :], input=e.question
        )


def _top_level_names(relpath: str) -> set[str]:
    """The module name of a file and the names its top level binds (definitions, assignments, imports)."""
    names = {relpath.rsplit("/", 1)[-1].removesuffix(".py")}
    for node in ast.parse(stdlib.read_source(relpath)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_lengths_templates_and_repobench_context(dev_examples):
    ds, exs = dev_examples
    for e in exs:
        tokens = count_tokens(TOK, e.context + e.question + e.answer_prefix)
        assert tokens == e.metadata["prompt_tokens"] and 0.9 * e.metadata["context_length"] <= tokens
        assert tokens <= e.metadata["context_length"] and not e.metadata["chat_template"]
        assert e.max_new_tokens == 64 and e.answer_prefix == "Next line of code:\n"
        assert e.metadata["python_version"] and e.metadata["split"] == "dev"
        if e.task == "repobench-p":
            assert count_tokens(TOK, e.question) <= ds.in_file_tokens
            files = e.metadata["context_files"]
            assert files and e.metadata["file"] not in files
            assert {stdlib.unit_of(f) for f in files} == {stdlib.unit_of(e.metadata["file"])}
            # RepoBench-P's cross-file-first line: it uses a name the file imports from the context's first files
            uses = dict(cross_file_uses(e.metadata["file"], tuple(stdlib.files_in_split("dev"))))
            sources = uses[e.metadata["answer_line"] - 1]
            assert files[: len(sources)] == list(sources[: len(files)])
            words = set(re.findall(r"\w+", e.answers[0]))
            assert any(words & _top_level_names(source) for source in sources), (e.answers, sources)
            for f in files:  # each context file: its path line and its head
                at = e.context.index(path_line(f)) + len(path_line(f))
                assert stdlib.read_source(f).startswith(e.context[at : at + 200].split("\n# Path: ")[0][:150])
            ctx, question, prefix = split_prompt(
                "repobench-p", e.context[len("Please complete the code given below. \n") :], e.question
            )
            assert (ctx, question, prefix) == (e.context, e.question, e.answer_prefix)


def test_split_disjoint_files_and_seeding():
    dev, test = set(stdlib.files_in_split("dev")), set(stdlib.files_in_split("test"))
    assert dev and test and not dev & test and dev | test == set(stdlib.source_files())
    assert not {stdlib.unit_of(f) for f in dev} & {stdlib.unit_of(f) for f in test}  # a package never straddles
    assert list(stdlib.source_files()) == sorted(stdlib.source_files())
    assert not any(part in stdlib.EXCLUDED_DIRS for f in stdlib.source_files() for part in f.split("/")[:-1])
    ds = StdlibCodeDataset(context_lengths=[1500], split="test", in_file_tokens=256)
    a = ds.examples(TOK, 3, seed=7, query_aware=False)
    assert all(e.metadata["file"] in test for e in a)
    assert all(f in test for e in a if e.task == "repobench-p" for f in e.metadata["context_files"])
    again = ds.examples(TOK, 3, seed=7, query_aware=False)
    assert [(e.id, e.context, e.question, e.answers) for e in a] == [
        (e.id, e.context, e.question, e.answers) for e in again
    ]
    more = ds.examples(TOK, 5, seed=7, query_aware=False)  # n_samples extends, never reshuffles
    assert [e.context for e in more if e.id.endswith(("-0", "-1", "-2"))] == [e.context for e in a]
    other = ds.examples(TOK, 3, seed=8, query_aware=False)
    assert [e.metadata["file"] for e in other] != [e.metadata["file"] for e in a]
    inside = ds.examples(TOK, 3, seed=7, query_aware=True)  # the input moves into the compressed context
    assert [e.context for e in inside] == [e.context + e.question for e in a]
    assert all(e.question == "" for e in inside)


def test_bad_parameters():
    with pytest.raises(ValueError, match="unknown stdlib_code tasks"):
        StdlibCodeDataset(tasks=["lcc", "trec"])
    with pytest.raises(ValueError, match="split='val'"):
        StdlibCodeDataset(split="val")
    with pytest.raises(ValueError, match="in_file_tokens=2000"):
        StdlibCodeDataset(context_lengths=[2048], in_file_tokens=2000)
    with pytest.raises(ValueError, match="n_samples=0"):
        StdlibCodeDataset(tasks=["lcc"], context_lengths=[1000]).examples(TOK, 0, seed=0, query_aware=False)
    with pytest.raises(ValueError, match="more than the dev split's files give for lcc at 200000 tokens: 0 qualify"):
        StdlibCodeDataset(tasks=["lcc"], context_lengths=[200000], split="dev").examples(TOK, 1, 0, False)
