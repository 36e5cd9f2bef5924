"""LongBench loader on the hand-made fixture directory tests/fixtures/longbench/ (offline, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _tiny_tokenizer import byte_tokenizer, word_tokenizer

from evaluation.datasets.longbench import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    INPUT_ANSWER_PREFIXES,
    LongBenchDataset,
    load_rows,
    split_prompt,
)
from evaluation.datasets.tokens import count_tokens, truncate_middle

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"


@pytest.mark.parametrize("task", sorted(DATASET2PROMPT))
def test_split_reassembles_the_official_prompt(task):
    context = "DOC {input} text }"  # braces in the data must survive as str.format leaves them
    inp = "What is it?\n" + INPUT_ANSWER_PREFIXES.get(task, "")
    ctx, question, prefix = split_prompt(task, context, inp)
    assert ctx + question + prefix == DATASET2PROMPT[task].format(context=context, input=inp)
    assert context in ctx  # the long document is in the compressed part
    if "{input}" in DATASET2PROMPT[task]:
        assert "What is it?" in question  # the question is not compressed
    if task in INPUT_ANSWER_PREFIXES:
        assert prefix == INPUT_ANSWER_PREFIXES[task] and question.endswith("What is it?\n")


def test_split_examples():
    ctx, q, p = split_prompt("hotpotqa", "P1", "Who?")
    assert ctx.endswith(
        "P1\n\nAnswer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\n"
    )
    assert (q, p) == ("Question: Who?\n", "Answer:")
    assert split_prompt("lcc", "def f():\n", "")[1:] == ("", "Next line of code:\n")
    assert split_prompt("passage_count", "P", "")[2] == "The final answer is: "


def test_loader_reads_fixture_tasks():
    tasks = ["hotpotqa", "trec", "passage_retrieval_en", "passage_count", "lcc", "gov_report", "multifieldqa_zh"]
    ds = LongBenchDataset(tasks=tasks, source=str(FIXTURES))
    exs = ds.examples(word_tokenizer(), None, 0, False)
    assert [e.task for e in exs].count("hotpotqa") == 3 and len(exs) == 9
    by_id = {e.id: e for e in exs}
    hp = by_id["hotpotqa-hp0"]
    assert hp.answers == ["Paris"] and hp.max_new_tokens == DATASET2MAXLEN["hotpotqa"] == 32
    assert hp.question == "Question: Which city is the capital of the country where the Louvre is?\n"
    assert "The Louvre is the world's most-visited museum" in hp.context and hp.answer_prefix == "Answer:"
    assert by_id["hotpotqa-hp2"].context.count("{context}") == 1  # literal braces in the data are kept
    assert by_id["passage_count-pc0"].answers == ["2"]  # integer answers become strings
    assert by_id["gov_report-gr0"].max_new_tokens == 512
    assert not by_id["trec-tr0"].metadata["chat_template"] and not by_id["lcc-lc0"].metadata["chat_template"]
    assert hp.metadata["chat_template"] and hp.metadata["prompt_tokens"] == count_tokens(
        word_tokenizer(), hp.context + hp.question + hp.answer_prefix
    )
    assert by_id["trec-tr0"].metadata["all_classes"][2] == "City"


def test_scores_use_the_official_metric_per_task():
    ds = LongBenchDataset(
        tasks=["hotpotqa", "trec", "passage_retrieval_en", "passage_count", "lcc", "multifieldqa_zh"],
        source=str(FIXTURES),
    )
    by_id = {e.id: e for e in ds.examples(word_tokenizer(), None, 0, False)}
    # [answer, is, paris] vs [paris]: P = 1/3, R = 1 -> F1 = 2 * (1/3) / (4/3) = 1/2
    assert ds.score("The answer is Paris.", by_id["hotpotqa-hp0"]) == pytest.approx(0.5)
    assert ds.score("City\nCountry", by_id["trec-tr0"]) == 1.0  # first line only
    assert ds.score("Paragraph 2", by_id["passage_retrieval_en-pr0"]) == 1.0
    assert ds.score("3", by_id["passage_count-pc0"]) == 0.0
    assert ds.score("    return a + b\n", by_id["lcc-lc0"]) == 1.0
    assert ds.score("中国", by_id["multifieldqa_zh-mz0"]) == 1.0


def test_n_samples_is_a_seeded_subset_and_query_aware():
    ds = LongBenchDataset(tasks=["hotpotqa"], source=str(FIXTURES))
    a = [e.id for e in ds.examples(word_tokenizer(), 2, 7, False)]
    assert len(a) == 2 and a == [e.id for e in ds.examples(word_tokenizer(), 2, 7, False)]
    assert a == sorted(a, key=lambda i: int(i[-1]))  # file order kept
    (qa,) = LongBenchDataset(tasks=["passage_retrieval_en"], source=str(FIXTURES)).examples(
        word_tokenizer(), None, 0, True
    )
    assert qa.question == "" and qa.context.endswith(
        'The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\n'
    )


def test_middle_truncation_keeps_head_and_tail():
    tok = byte_tokenizer()  # one token per byte: the kept head and tail are exact character counts
    text = "HEAD " + "x" * 100 + " TAIL"
    assert truncate_middle(tok, text, 20) == text[:10] + text[-10:]
    assert truncate_middle(tok, text, 500) == text
    full = LongBenchDataset(tasks=["gov_report"], source=str(FIXTURES)).examples(tok, None, 0, False)[0]
    (ex,) = LongBenchDataset(tasks=["gov_report"], source=str(FIXTURES), max_context_length=300).examples(
        tok, None, 0, False
    )
    budget = 300 - len((ex.question + ex.answer_prefix).encode())
    assert ex.context == full.context[: budget // 2] + full.context[-(budget - budget // 2) :]
    assert ex.metadata["truncated"] and ex.metadata["prompt_tokens"] <= 300
    assert ex.metadata["original_tokens"] == full.metadata["prompt_tokens"] > 300
    assert ex.context.startswith("You are given a report") and "Section 20:" not in ex.context


def test_skip_longer_than_filters_long_prompts():
    ds = LongBenchDataset(tasks=["hotpotqa", "gov_report"], source=str(FIXTURES), skip_longer_than=150)
    tasks = [e.task for e in ds.examples(word_tokenizer(), None, 0, False)]
    assert tasks == ["hotpotqa"] * 3  # gov_report's ~600-token prompt is dropped


def test_errors():
    with pytest.raises(ValueError, match="unknown LongBench tasks"):
        LongBenchDataset(tasks=["nope"])
    with pytest.raises(ValueError, match="max_context_length=0"):
        LongBenchDataset(max_context_length=0)
    with pytest.raises(FileNotFoundError, match="narrativeqa.jsonl"):
        load_rows(str(FIXTURES), "narrativeqa")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a hub id"):
        load_rows("/no/such/dir", "hotpotqa")


def test_hub_offline_error_names_the_dataset_and_the_fix(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match=r"THUDM/LongBench.*dataset.source=<dir>"):
        LongBenchDataset(tasks=["hotpotqa"]).examples(word_tokenizer(), 1, 0, False)
