"""LongBench (Bai et al. 2023, "LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding",
THUDM/LongBench ``config/dataset2prompt.json``, ``config/dataset2maxlen.json``, ``pred.py``, ``eval.py``).

Each task uses its official prompt template, generation length and metric. The template is split the
kvpress way into ``context`` (instructions + the long document, what gets compressed), ``question`` and
``answer_prefix``; ``context + question + answer_prefix`` is exactly the official prompt (for trec,
triviaqa, samsum and lsht the trailing ``Type:`` / ``Answer:`` / ``Summary:`` / ``类别：`` of the few-shot
input becomes the answer prefix). Long prompts are cut in the middle (``pred.py``: keep head and tail) to
``max_context_length`` tokens. Official ``pred.py`` skips the chat template on trec, triviaqa, samsum, lsht,
lcc and repobench-p; examples carry ``metadata["chat_template"] = False`` there.

Data: a local directory of the official jsonl files (``<dir>/<task>.jsonl``, LongBench-E: ``<task>_e.jsonl``,
i.e. the unzipped ``data.zip`` of the hub repo) or the hub repo id (``THUDM/LongBench``), whose ``data.zip`` is
fetched with ``huggingface_hub`` (the repo is script-based, which ``datasets`` >= 4 no longer loads).
"""

from __future__ import annotations

import io
import json
import random
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from evaluation.datasets.base import DataUnavailableError, Example, place_question
from evaluation.datasets.tokens import count_tokens, truncate_middle
from evaluation.metrics import LONGBENCH_METRICS, longbench_score

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
"""LongBench's ``config/dataset2prompt.json``, verbatim."""

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}
"""LongBench's ``config/dataset2maxlen.json`` (generation length per task, in tokens)."""

SPLITS: dict[str, tuple[str, str]] = {
    "narrativeqa": ("Question: {input}", "Answer:"),
    "qasper": ("Question: {input}", "Answer:"),
    "multifieldqa_en": ("Question: {input}", "Answer:"),
    "multifieldqa_zh": ("问题：{input}", "回答："),
    "hotpotqa": ("Question: {input}", "Answer:"),
    "2wikimqa": ("Question: {input}", "Answer:"),
    "musique": ("Question: {input}", "Answer:"),
    "dureader": ("问题：{input}", "回答："),
    "gov_report": ("Now, write a one-page summary of the report.", "Summary:"),
    "qmsum": ("Query: {input}", "Answer:"),
    "multi_news": ("Now, write a one-page summary of all the news.", "Summary:"),
    "vcsum": ("会议总结：", "会议总结："),
    "trec": ("{input}", ""),
    "triviaqa": ("{input}", ""),
    "samsum": ("{input}", ""),
    "lsht": ("{input}", ""),
    "passage_count": ("Please enter the final count", "The final answer is: "),
    "passage_retrieval_en": ("{input}", "The answer is: "),
    "passage_retrieval_zh": ("{input}", "答案是："),
    "lcc": ("Next line of code:\n", "Next line of code:\n"),
    "repobench-p": ("{input}", "Next line of code:\n"),
}
"""task -> (where the question starts in the template, the template's trailing answer prefix)."""

INPUT_ANSWER_PREFIXES: dict[str, str] = {"trec": "Type:", "triviaqa": "Answer:", "samsum": "Summary:", "lsht": "类别："}
"""Few-shot tasks whose ``input`` ends with the answer cue; it is moved to ``answer_prefix``."""

NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
"""Tasks that official ``pred.py`` prompts without the chat template."""

ENGLISH_TASKS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
"""The 16 English (and code) tasks of LongBench."""

LONGBENCH_E_TASKS = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
"""Tasks that have a LongBench-E (length-balanced) file."""

HUB_ID = "THUDM/LongBench"


def split_prompt(task: str, context: str, inp: str) -> tuple[str, str, str]:
    """Official prompt of one row split into ``(context, question, answer_prefix)``.

    ``context + question + answer_prefix == DATASET2PROMPT[task].format(context=context, input=inp)``.

    Raises:
        KeyError: unknown task.
    """
    if task not in DATASET2PROMPT:
        raise KeyError(f"unknown LongBench task {task!r}; known: {sorted(DATASET2PROMPT)}")
    template = DATASET2PROMPT[task]
    marker, prefix = SPLITS[task]
    body = template[: len(template) - len(prefix)]
    cut = body.index(marker) if marker != prefix else len(body)
    fill = {"{context}": context, "{input}": inp}

    def render(part: str) -> str:  # like str.format: inserted text is never re-read
        return "".join(fill.get(piece, piece) for piece in re.split(r"(\{context\}|\{input\})", part))

    ctx, question = render(body[:cut]), render(body[cut:])
    cue = INPUT_ANSWER_PREFIXES.get(task)
    if cue is not None:
        stripped = question.rstrip()
        if stripped.endswith(cue):
            at = len(stripped) - len(cue)
            question, prefix = question[:at], question[at:] + prefix
    return ctx, question, prefix


def _read_jsonl(text: str, where: str) -> list[dict]:
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON may hold raw U+2028
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}:{n} is not valid JSON ({err})") from err
    return rows


def load_rows(source: str, task: str, longbench_e: bool = False) -> list[dict]:
    """Rows of one task file (``<task>.jsonl`` or ``<task>_e.jsonl``) from a directory or the hub.

    Args:
        source: a directory of the official jsonl files, or a hub dataset id (``THUDM/LongBench``) whose
            ``data.zip`` holds them.

    Raises:
        FileNotFoundError: the directory lacks the file, or ``source`` is neither a directory nor a hub id.
        DataUnavailableError: the hub could not be reached and the file is not cached (checked in seconds,
            :func:`evaluation.hub.hub_reachable`); the message says how to provide the files.
    """
    online = False
    fname = f"{task}_e.jsonl" if longbench_e else f"{task}.jsonl"
    path = Path(source)
    if path.is_dir():
        file = path / fname
        if not file.is_file():
            raise FileNotFoundError(f"LongBench file {file} not found (source={source!r} must hold <task>.jsonl)")
        return _read_jsonl(file.read_text(encoding="utf-8"), str(file))
    if source.count("/") != 1 or path.suffix:
        raise FileNotFoundError(f"LongBench source={source!r} is neither a directory nor a hub id like {HUB_ID!r}")
    try:
        import huggingface_hub

        from evaluation.hub import hub_reachable

        online = hub_reachable()  # seconds; offline, the download below reads the local cache only
        archive = huggingface_hub.hf_hub_download(repo_id=source, filename="data.zip", repo_type="dataset")
    except Exception as err:  # any hub/network failure becomes one actionable error
        why = (
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if online
            else "the hub is unreachable and it is not in the local cache"
        )
        raise DataUnavailableError(
            f"LongBench needs the Hugging Face dataset {source!r} (its data.zip), which could not be loaded "
            f"({why}). Either run once with hub access so it is cached, "
            f"or download https://huggingface.co/datasets/{source}/resolve/main/data.zip, unzip it and pass "
            f"dataset.source=<dir> (the directory holding {fname})."
        ) from err
    with zipfile.ZipFile(archive) as zf:
        names = [n for n in zf.namelist() if n == fname or n.endswith("/" + fname)]
        if not names:
            raise FileNotFoundError(f"{fname} is not in {source!r}'s data.zip")
        with zf.open(names[0]) as fh:
            return _read_jsonl(io.TextIOWrapper(fh, encoding="utf-8").read(), f"{source}:{names[0]}")


@dataclass
class LongBenchDataset:
    """LongBench with its official prompts, generation lengths and metrics.

    Args:
        tasks: LongBench task names (keys of ``DATASET2PROMPT``); default the 16 English tasks.
        source: directory of the official jsonl files, or the hub id ``THUDM/LongBench``.
        max_context_length: cut the context in the middle (head + tail) so that context + question + answer
            prefix have at most this many tokens; None keeps everything.
        skip_longer_than: drop examples whose full prompt has more tokens than this (paper 003 section 7
            keeps LongBench prompts shorter than 3000 tokens); None keeps all. Applied before truncation.
        longbench_e: read LongBench-E files (``<task>_e.jsonl``).

    Raises:
        ValueError: unknown task, or a non-positive length limit.
    """

    name: ClassVar[str] = "longbench"

    tasks: Sequence[str] = ENGLISH_TASKS
    source: str = HUB_ID
    max_context_length: int | None = None
    skip_longer_than: int | None = None
    longbench_e: bool = False
    _rows: dict | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.tasks = [str(t) for t in self.tasks]
        unknown = [t for t in self.tasks if t not in DATASET2PROMPT]
        if unknown:
            raise ValueError(f"unknown LongBench tasks {unknown}; known: {sorted(DATASET2PROMPT)}")
        for key in ("max_context_length", "skip_longer_than"):
            value = getattr(self, key)
            if value is not None and int(value) < 1:
                raise ValueError(f"{key}={value} must be >= 1 (or None)")
        self.source = str(self.source)

    def prepare(self) -> None:
        """Read every task's file now (from ``source``, or the hub's ``data.zip``; the local cache when the hub is
        unreachable), so that missing data fails before a model is loaded.

        Raises:
            FileNotFoundError / DataUnavailableError: see :func:`load_rows`.
        """
        if self._rows is None:
            self._rows = {task: load_rows(self.source, task, self.longbench_e) for task in self.tasks}

    def sample_limit(self) -> tuple[int, str]:
        """The most ``n_samples`` every task can give: the row count of the smallest task file."""
        self.prepare()
        task = min(self.tasks, key=lambda t: len(self._rows[t]))
        return len(self._rows[task]), f"the rows of LongBench{'-E' if self.longbench_e else ''} task {task!r}"

    def examples(
        self, tokenizer, n_samples: int | None = None, seed: int = 0, query_aware: bool = False
    ) -> list[Example]:
        """Examples of every task, in file order; ``n_samples`` keeps a seeded random subset per task.

        The subset is drawn before ``skip_longer_than`` filtering (so at most ``n_samples`` remain).
        ``query_aware=True`` appends the question to the context (and leaves ``question`` empty).
        Metadata: ``prompt_tokens`` (context + question + answer prefix, after truncation),
        ``original_tokens`` (before),
        ``truncated``, ``length`` (LongBench's word count), ``language``, ``all_classes``, ``chat_template``,
        ``longbench_e`` (the report's by-length-range table reads it).

        Raises:
            FileNotFoundError / DataUnavailableError: see :func:`load_rows`.
            ValueError: ``max_context_length`` leaves no room for the context.
        """
        out: list[Example] = []
        self.prepare()
        for task in self.tasks:
            rows = self._rows[task]
            keep = list(range(len(rows)))
            if n_samples is not None and n_samples < len(rows):
                keep = sorted(random.Random(f"longbench|{seed}|{task}").sample(keep, int(n_samples)))
            for i in keep:
                example = self._example(task, rows[i], i, tokenizer, query_aware)
                if example is not None:
                    out.append(example)
        return out

    def _example(self, task: str, row: dict, index: int, tokenizer, query_aware: bool) -> Example | None:
        context, question, prefix = split_prompt(task, row["context"], row["input"])
        full = count_tokens(tokenizer, context + question + prefix)
        if self.skip_longer_than is not None and full > self.skip_longer_than:
            return None
        truncated = False
        if self.max_context_length is not None and full > self.max_context_length:
            budget = self.max_context_length - count_tokens(tokenizer, question + prefix)
            if budget < 1:
                raise ValueError(
                    f"max_context_length={self.max_context_length} leaves no room for the context of "
                    f"{task} example {index} (question + answer prefix fill it)"
                )
            context, truncated = truncate_middle(tokenizer, context, budget), True
        length = count_tokens(tokenizer, context + question + prefix) if truncated else full
        context, question, question_start = place_question(context, question, query_aware)
        row_id = row.get("_id", index)
        meta = {
            "prompt_tokens": length,
            "original_tokens": full,
            "truncated": truncated,
            "length": row.get("length"),
            "language": row.get("language"),
            "all_classes": row.get("all_classes"),
            "chat_template": task not in NO_CHAT_TEMPLATE,
            "index": index,
            "longbench_e": self.longbench_e,
        }
        return Example(
            id=f"{task}-{row_id}",
            context=context,
            question=question,
            answers=[str(a) for a in row["answers"]],
            answer_prefix=prefix,
            max_new_tokens=DATASET2MAXLEN[task],
            task=task,
            metadata=meta,
            question_start=question_start,
        )

    def score(self, prediction: str, example: Example) -> float:
        """The task's official metric (``LONGBENCH_METRICS``), max over the reference answers."""
        return longbench_score(example.task, prediction, example.answers, example.metadata.get("all_classes"))


assert set(DATASET2PROMPT) == set(DATASET2MAXLEN) == set(SPLITS) == set(LONGBENCH_METRICS)
