"""RULER, generated locally and seeded (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", NVIDIA/RULER ``scripts/data/synthetic`` and ``scripts/synthetic.yaml``).

Tasks (RULER's names and settings): ``niah_single_1/2/3``, ``niah_multikey_1/2/3``, ``niah_multivalue``,
``niah_multiquery``, ``vt`` (variable tracking, 1 chain x 4 hops), ``cwe`` (common words extraction),
``fwe`` (frequent words extraction) and the hub-backed ``qa_1`` (SQuAD v2) / ``qa_2`` (HotpotQA).

Each prompt is split the kvpress way: ``context`` (the task instructions and the haystack, what gets
compressed), ``question`` and ``answer_prefix`` (RULER's answer prefix, e.g. " The special magic number
for X mentioned in the provided text is"); ``context + question + answer_prefix`` is RULER's input text.
Lengths are counted in the model's tokens as RULER does: the haystack grows (binary search) until
``tokens(context + question + answer_prefix) + max_new_tokens <= context_length``.

Deviations from RULER, mostly forced by running offline: the "essay" haystack is Python's bundled
documentation prose (``evaluation.datasets.prose``, sentence by sentence) instead of Paul Graham's essays
split by nltk; cwe draws extra words as ``adjective-noun`` pairs when it needs more words than wonderwords
has (RULER uses a Randle word list); the vt few-shot example is sized to ``min(500, context_length // 8)``
tokens (RULER: 500) so that short test lengths work; needle keys are drawn as an independent adjective and
noun rather than from the materialised list of all pairs.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

from evaluation.datasets.base import DataUnavailableError, Example, Question, place_question
from evaluation.datasets.prose import prose_sentences
from evaluation.datasets.tokens import count_tokens
from evaluation.metrics import ruler_postprocess, string_match_all, string_match_part

# --------------------------------------------------------------------------------------------------
# Task definitions (RULER scripts/synthetic.yaml + scripts/data/synthetic/constants.py)
# --------------------------------------------------------------------------------------------------

NOISE_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the "
        "above list?",
        " Answer: The top {num_cw} words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
    ),
}
"""RULER task template (``{context}`` then the question) and answer prefix, per task kind."""

QUESTION_MARKERS = {"niah": "What ", "vt": "Question: ", "cwe": "Question: ", "fwe": "Question: ", "qa": "Question: "}
"""Where the question starts in the template text after ``{context}``: the split context | question."""

MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
"""RULER's ``tokens_to_generate`` per task kind."""


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: its kind (niah, vt, cwe, fwe, qa) and RULER's arguments for it."""

    kind: str
    args: dict = field(default_factory=dict)

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.kind]

    @property
    def metric(self) -> Callable[[str, Sequence[str]], float]:
        return string_match_part if self.kind == "qa" else string_match_all


def _niah(haystack, key, value, k=1, v=1, q=1):
    return RulerTask(
        "niah",
        dict(
            type_haystack=haystack,
            type_needle_k=key,
            type_needle_v=value,
            num_needle_k=k,
            num_needle_v=v,
            num_needle_q=q,
        ),
    )


RULER_TASKS: dict[str, RulerTask] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", q=4),
    "vt": RulerTask("vt", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": RulerTask("cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": RulerTask("fwe", dict(alpha=2.0, coded_wordlen=6)),
    "qa_1": RulerTask("qa", dict(dataset="squad")),
    "qa_2": RulerTask("qa", dict(dataset="hotpotqa")),
}
"""RULER's 13 tasks with the arguments of its ``synthetic.yaml``."""

SYNTHETIC_TASKS = tuple(t for t, spec in RULER_TASKS.items() if spec.kind != "qa")
"""The 11 tasks generated fully offline."""

SHARED_TASKS = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt")
"""The tasks whose context holds several keys (or chains), which the shared-context protocol (``protocol=shared``,
:mod:`evaluation.shared`) asks about one by one: a context of K questions holds ``max(K, RULER's keys)`` keys with
RULER's values per key (vt: K chains of RULER's hops)."""

QA_SOURCES = {
    "squad": ("rajpurkar/squad_v2", None, "validation", "squad.json", "the official SQuAD 2.0 dev file dev-v2.0.json"),
    "hotpotqa": (
        "hotpotqa/hotpot_qa",
        "distractor",
        "validation",
        "hotpotqa.json",
        "the official HotpotQA dev distractor file hotpot_dev_distractor_v1.json",
    ),
}
"""qa source -> (hub id, hub config, split, local file name, what the local file is)."""

DEPTHS = [round(100 * i / 39) for i in range(40)]
"""RULER's 40 insertion depths (percent), ``np.round(np.linspace(0, 100, 40))``."""


# --------------------------------------------------------------------------------------------------
# Word lists and haystacks
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _wonderwords() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    from wonderwords import random_word

    return tuple(
        random_word._get_words_from_text_file(f) for f in ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    )


@lru_cache(maxsize=1)
def _adjs_nouns() -> tuple[tuple[str, ...], tuple[str, ...]]:
    nouns, adjs, _ = _wonderwords()
    return tuple(sorted(set(adjs))), tuple(sorted(set(nouns)))


def random_key_word(rng: random.Random) -> str:
    """A RULER needle key: a random ``adjective-noun`` pair of wonderwords words."""
    adjs, nouns = _adjs_nouns()
    return f"{rng.choice(adjs)}-{rng.choice(nouns)}"


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """RULER's cwe vocabulary: wonderwords nouns + adjectives + verbs, unique, sorted."""
    nouns, adjs, verbs = _wonderwords()
    return tuple(sorted(set(nouns) | set(adjs) | set(verbs)))


def essay_sentences(n: int) -> list[str]:
    """The first ``n`` sentences of the offline "essay" haystack (``evaluation.datasets.prose``), cycled
    when ``n`` exceeds the ~1.5k available sentences (RULER repeats its essays the same way)."""
    sents = prose_sentences()
    return list(itertools.islice(itertools.cycle(sents), n))


def _seed(*parts) -> int:
    """A 64-bit seed from any printable parts (stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


# --------------------------------------------------------------------------------------------------
# Generators: each returns (full template text with the haystack, answers, metadata)
# --------------------------------------------------------------------------------------------------


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return random_key_word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r} must be one of numbers, words, uuids")


def _join_query(queries: list[str]) -> str:
    return ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]


@dataclass
class _Rendered:
    context: str  # instructions + haystack (what gets compressed)
    question: str
    answer_prefix: str
    answers: list[str]
    metadata: dict
    questions: tuple = ()  # the shared-context protocol's questions (the first is question/answer_prefix/answers)

    @property
    def text(self) -> str:
        """RULER's input text: context + question + answer prefix."""
        return self.context + self.question + self.answer_prefix


def _render(
    kind: str,
    context: str,
    answers: list[str],
    metadata: dict,
    prefix_text: str = "",
    template: tuple[str, str] | None = None,
    **fmt,
) -> _Rendered:
    """Format the task template around ``context`` and split it into context | question | answer prefix."""
    body, prefix = template or TEMPLATES[kind]
    pre, post = body.split("{context}")
    q = post.find(QUESTION_MARKERS[kind])
    return _Rendered(
        prefix_text + pre.format(**fmt) + context + post[:q].format(**fmt),
        post[q:].format(**fmt),
        prefix.format(**fmt),
        answers,
        metadata,
    )


def _niah_needles(rng: random.Random, n: int, args: dict, num_k: int) -> tuple[list[str], list[list[str]], str]:
    """RULER's niah haystack of size ``n`` holding ``num_k`` keys with ``num_needle_v`` values each: the keys, their
    values and the haystack text."""
    num_v = args["num_needle_v"]
    tk, tv, hay = args["type_needle_k"], args["type_needle_v"], args["type_haystack"]
    keys, values, needles = [], [], []
    for _ in range(num_k):
        key = _random_value(rng, tk)
        while key in keys:
            key = _random_value(rng, tk)
        keys.append(key)
        vals = [_random_value(rng, tv) for _ in range(num_v)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=tv, key=key, value=v) for v in vals]
    rng.shuffle(needles)

    if hay == "essay":
        sents = essay_sentences(n)
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        cuts = [0] + [int(len(sents) * d / 100) for d in depths] + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(p for p in parts if p)
    else:
        if hay == "noise":
            sentences = [NOISE_HAYSTACK] * n
        elif hay == "needle":
            sentences = []
            for _ in range(n):
                key = _random_value(rng, tk)
                while key in keys:
                    key = _random_value(rng, tk)
                sentences.append(NEEDLE.format(type_needle_v=tv, key=key, value=_random_value(rng, tv)))
        else:
            raise ValueError(f"type_haystack={hay!r} must be one of noise, essay, needle")
        for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            sentences.insert(index, needle)
        context = "\n".join(sentences)
    return keys, values, context


def _niah_render(rng_seed: int, n: int, args: dict) -> _Rendered:
    rng = random.Random(rng_seed)
    num_k = max(args["num_needle_k"], args["num_needle_q"])
    num_v, num_q = args["num_needle_v"], args["num_needle_q"]
    tv = args["type_needle_v"]
    keys, values, context = _niah_needles(rng, n, args, num_k)
    indices = rng.sample(range(num_k), num_q)
    answers = [a for i in indices for a in values[i]]
    body, prefix = TEMPLATES["niah"]
    type_v = tv
    if num_q * num_v == 1:  # RULER's singular rewrite of the whole template
        full = (body + "\x00" + prefix).replace("Some", "A").replace("are all", "is").replace("are", "is")
        body, prefix = full.replace("answers", "answer").split("\x00")
        type_v = tv[:-1]
    # depth of the earliest queried needle, in percent of the haystack characters
    first = min(context.find(NEEDLE.format(type_needle_v=tv, key=keys[i], value=v)) for i in indices for v in values[i])
    meta = {"depth": round(100 * first / max(1, len(context)), 1), "haystack": args["type_haystack"]}
    return _render(
        "niah",
        context,
        answers,
        meta,
        template=(body, prefix),
        type_needle_v=type_v,
        query=_join_query([keys[i] for i in indices]),
    )


def _niah_question(keys: list[str], values: list[list[str]], tv: str) -> tuple[str, str, list[str]]:
    """RULER's niah question and answer prefix for ``keys`` (its singular rewrite when they hold one value), and the
    answers: every value of every key."""
    body, prefix = TEMPLATES["niah"]
    post = body.split("{context}")[1]
    question = post[post.find(QUESTION_MARKERS["niah"]) :]
    answers = [v for vals in values for v in vals]
    type_v = tv
    if len(answers) == 1:  # as _niah_render's rewrite, on the question's part
        full = (question + "\x00" + prefix).replace("Some", "A").replace("are all", "is").replace("are", "is")
        question, prefix = full.replace("answers", "answer").split("\x00")
        type_v = tv[:-1]
    fmt = {"type_needle_v": type_v, "query": _join_query(keys)}
    return question.format(**fmt), prefix.format(**fmt), answers


def _niah_shared_render(rng_seed: int, n: int, args: dict, K: int, aggregate: bool) -> _Rendered:
    """A niah context of ``max(K, RULER's keys)`` keys asked K questions: one key each in a seeded order, the last
    asking for every key's values at once with ``aggregate`` (RULER's multiquery question over all the keys, scored
    by recall as every niah question)."""
    rng = random.Random(rng_seed)
    num_k = max(args["num_needle_k"], args["num_needle_q"], K)
    tv = args["type_needle_v"]
    keys, values, context = _niah_needles(rng, n, args, num_k)
    order = rng.sample(range(num_k), num_k)
    aggregate = aggregate and K > 1
    questions = []
    for i in order[: K - 1 if aggregate else K]:
        question, prefix, answers = _niah_question([keys[i]], [values[i]], tv)
        where = min(context.find(NEEDLE.format(type_needle_v=tv, key=keys[i], value=v)) for v in values[i])
        depth = round(100 * where / max(1, len(context)), 1)
        questions.append(Question(question, answers, prefix, "retrieve", {"depth": depth, "key": keys[i]}))
    if aggregate:
        question, prefix, answers = _niah_question(keys, values, tv)
        questions.append(Question(question, answers, prefix, "aggregate", {"depth": None}))
    body = TEMPLATES["niah"][0]
    pre, post = body.split("{context}")
    text = pre.format(type_needle_v=tv) + context + post[: post.find(QUESTION_MARKERS["niah"])]
    first = questions[0]
    meta = {"depth": first.metadata["depth"], "haystack": args["type_haystack"], "keys": num_k}
    return _Rendered(text, first.question, first.answer_prefix, first.answers, meta, tuple(questions))


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, is_icl: bool):
    k = 3 if is_icl else 5
    hops = min(10, num_hops) if is_icl else num_hops
    names: list[str] = []
    while len(names) < num_chains * (hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names:
            names.append(name)
    variables, chains = [], []
    for c in range(num_chains):
        vs = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        value = "12345" if is_icl else str(rng.randint(10000, 99998))
        variables.append(vs)
        chains.append([f"VAR {vs[0]} = {value}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)])
    return variables, chains


def _vt_haystack(rng: random.Random, n: int, chains: list[list[str]]) -> str:
    """RULER's vt noise haystack of size ``n`` with every chain's assignments inserted in order."""
    sentences = [NOISE_HAYSTACK] * n
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, pos in enumerate(positions):
            sentences.insert(pos + j, chain[j])
    return "\n".join(sentences).replace(". \n", ".\n")


def _vt_render(rng_seed: int, n: int, args: dict, icl: str = "", is_icl: bool = False) -> _Rendered:
    rng = random.Random(rng_seed)
    variables, chains = _vt_chains(rng, args["num_chains"], args["num_hops"], is_icl)
    value = chains[0][0].split("=")[-1].strip()
    context = _vt_haystack(rng, n, chains)
    return _render(
        "vt", context, list(variables[0]), {"haystack": "noise"}, prefix_text=icl, query=value, num_v=len(variables[0])
    )


def _vt_shared_render(rng_seed: int, n: int, args: dict, K: int, icl: str) -> _Rendered:
    """A vt context of K chains (RULER's hops each) asked K questions, one chain's value each in a seeded order (the
    answers: every variable assigned that value)."""
    rng = random.Random(rng_seed)
    variables, chains = _vt_chains(rng, K, args["num_hops"], False)
    context = _vt_haystack(rng, n, chains)
    body, prefix = TEMPLATES["vt"]
    pre, post = body.split("{context}")
    at = post.find(QUESTION_MARKERS["vt"])
    chain_values = [chain[0].split("=")[-1].strip() for chain in chains]
    questions = []
    for c in rng.sample(range(K), K):
        value = chain_values[c]
        answers = [v for vs, val in zip(variables, chain_values) if val == value for v in vs]
        fmt = {"query": value, "num_v": len(answers)}
        questions.append(Question(post[at:].format(**fmt), answers, prefix.format(**fmt), "retrieve", {}))
    first = questions[0]
    text = icl + pre + context + post[:at]
    return _Rendered(text, first.question, first.answer_prefix, first.answers, {"haystack": "noise"}, tuple(questions))


def _vt_icl(rng_seed: int, n: int, args: dict) -> str:
    """RULER's vt few-shot example: a solved small instance, names and value re-randomised."""
    r = _vt_render(rng_seed, n, args, is_icl=True)
    text = r.text + " " + " ".join(r.answers) + "\n"
    rng = random.Random(rng_seed + 1)
    for name in r.answers:
        text = text.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return text.replace("12345", str(rng.randint(10000, 99998)))


def _cwe_words(num_words: int) -> tuple[str, ...]:
    words = common_words()
    if num_words <= len(words):
        return words
    adjs, nouns = _adjs_nouns()  # more words than wonderwords has: add adjective-noun pairs
    extra = itertools.islice((f"{a}-{n}" for n in nouns for a in adjs), num_words - len(words))
    return words + tuple(extra)


def _cwe_example(
    rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int, num_cw: int
) -> tuple[str, list[str]]:
    chosen = rng.sample(_cwe_words(num_words), num_words)
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    word_list = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(word_list)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common


def _cwe_render(rng_seed: int, n: int, args: dict, context_length: int) -> _Rendered:
    rng = random.Random(rng_seed)
    num_cw = args["num_cw"]
    if context_length < 4096:  # RULER's short-context setting
        shot = _cwe_example(rng, 20, 3, 1, num_cw)
        context, answers = _cwe_example(rng, n, 6, 1, num_cw)
    else:
        shot = _cwe_example(rng, 40, 10, 3, num_cw)
        context, answers = _cwe_example(rng, n, args["freq_cw"], args["freq_ucw"], num_cw)
    body, prefix = TEMPLATES["cwe"]
    shot_text = (
        body.format(context=shot[0], num_cw=num_cw)
        + prefix.format(num_cw=num_cw)
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot[1]))
    )
    return _render("cwe", context, answers, {}, prefix_text=shot_text + "\n", num_cw=num_cw)


def _fwe_render(rng_seed: int, n: int, args: dict, context_length: int) -> _Rendered:
    from scipy.special import zeta

    rng = random.Random(rng_seed)
    alpha, wordlen = float(args["alpha"]), int(args["coded_wordlen"])
    vocab_size = max(10, (context_length - MAX_NEW_TOKENS["fwe"]) // 50)  # RULER: max_seq_length // 50
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # RULER: the top-ranked word is noise
    z = float(zeta(alpha))
    sampled = [w for k, w in enumerate(words, start=1) for _ in range(int(n * k**-alpha / z))]
    rng.shuffle(sampled)
    return _render("fwe", " ".join(sampled), words[1:4], {})


# --------------------------------------------------------------------------------------------------
# QA (hub-backed)
# --------------------------------------------------------------------------------------------------


def _qa_from_squad_json(data: dict) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad`` on the official SQuAD 2.0 JSON."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False) and qa["answers"]:
                    own = index[p["context"]]
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [a["text"] for a in qa["answers"]],
                            "context": [own],
                            "more_context": [i for i in more if i != own],
                        }
                    )
    return qas, docs


def _qa_from_hotpot_json(data: list) -> tuple[list[dict], list[str]]:
    """RULER's ``read_hotpotqa`` on the official HotpotQA dev (distractor) JSON."""
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
        }
        for d in data
    ]
    return qas, docs


def _qa_from_hub(source: str):
    """Convert the hub rows to the official JSON layout RULER reads."""
    import datasets

    hub_id, config, split, _, _ = QA_SOURCES[source]
    rows = datasets.load_dataset(hub_id, config, split=split)
    if source == "squad":
        by_title: dict[str, dict[str, list]] = {}
        for r in rows:
            paras = by_title.setdefault(r["title"], {})
            paras.setdefault(r["context"], []).append(
                {
                    "question": r["question"],
                    "answers": [{"text": t} for t in r["answers"]["text"]],
                    "is_impossible": len(r["answers"]["text"]) == 0,
                }
            )
        data = {
            "data": [
                {"paragraphs": [{"context": c, "qas": q} for c, q in paras.items()]} for paras in by_title.values()
            ]
        }
        return _qa_from_squad_json(data)
    data = [
        {
            "question": r["question"],
            "answer": r["answer"],
            "context": list(zip(r["context"]["title"], r["context"]["sentences"])),
        }
        for r in rows
    ]
    return _qa_from_hotpot_json(data)


@lru_cache(maxsize=4)
def load_qa(source: str, data_dir: str | None = None) -> tuple[list[dict], list[str]]:
    """Questions and document pool of a RULER qa task, from ``data_dir`` or the Hugging Face hub.

    Args:
        source: ``"squad"`` (qa_1) or ``"hotpotqa"`` (qa_2).
        data_dir: a directory holding RULER's files ``squad.json`` (official SQuAD 2.0 dev JSON) and/or
            ``hotpotqa.json`` (official HotpotQA dev distractor JSON); None loads from the hub.

    Raises:
        ValueError: unknown ``source``. FileNotFoundError: ``data_dir`` lacks the file.
        DataUnavailableError: the hub could not be reached (checked in seconds) and the data is not cached; the
            message says how to provide it.
    """
    if source not in QA_SOURCES:
        raise ValueError(f"qa dataset {source!r} must be one of {sorted(QA_SOURCES)}")
    hub_id, config, split, filename, what = QA_SOURCES[source]
    if data_dir is not None:
        path = Path(data_dir) / filename
        if not path.is_file():
            raise FileNotFoundError(f"RULER qa needs {path} ({what}); qa_data_dir={data_dir!r} does not hold it")
        data = json.loads(path.read_text(encoding="utf-8"))
        return _qa_from_squad_json(data) if source == "squad" else _qa_from_hotpot_json(data)
    try:
        from evaluation.hub import hub_reachable

        hub_reachable()  # seconds; offline, datasets reads its local cache only
        return _qa_from_hub(source)
    except Exception as err:  # any hub/network failure becomes one actionable error
        cfg = f", config {config!r}" if config else ""
        raise DataUnavailableError(
            f"RULER qa task needs the Hugging Face dataset {hub_id!r}{cfg} (split {split!r}), which could not be "
            f"loaded ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Either run once with "
            f"hub access so it is "
            f"cached, or download {what}, save it as <dir>/{filename} and pass dataset.qa_data_dir=<dir>."
        ) from err


def _qa_render(rng_seed: int, n: int, qa: dict, docs: list[str]) -> _Rendered:
    rng = random.Random(rng_seed)
    own, more = qa["context"], qa.get("more_context", [])
    if n < len(docs):
        if n - len(own) > len(more):
            taken = set(own + more)
            extra = [i for i in range(len(docs)) if i not in taken]
            chosen = own + more + rng.sample(extra, max(0, n - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, max(0, n - len(own)))
        all_docs = [docs[i] for i in chosen]
    else:
        all_docs = (docs * (n // len(docs) + 1))[:n]
    rng.shuffle(all_docs)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(all_docs))
    return _render("qa", context, list(qa["outputs"]), {}, query=qa["query"])


# --------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------


def _increment(task: RulerTask, context_length: int) -> int:
    """RULER's haystack step (units of the haystack: words, sentences, documents)."""
    if task.kind == "niah":
        if task.args["type_haystack"] == "essay":  # sentences (RULER: 500 words, about 25 sentences)
            return 25 if context_length >= 4096 else 5
        return 25 if context_length >= 4096 else 5
    return {"vt": 10 if context_length >= 4096 else 5, "cwe": 10, "fwe": 10, "qa": 10}[task.kind]


def _min_size(task: RulerTask) -> int:
    if task.kind == "niah":
        return max(task.args["num_needle_k"], task.args["num_needle_q"]) * task.args["num_needle_v"]
    if task.kind == "cwe":
        return task.args["num_cw"] + 1
    if task.kind == "vt":
        return task.args["num_hops"] + 1
    return 10 if task.kind == "fwe" else 1


@dataclass
class RulerDataset:
    """RULER generated locally (see the module docstring for the tasks and the deviations).

    Args:
        tasks: RULER task names (``RULER_TASKS``); default the 11 offline tasks.
        context_lengths: target lengths in model tokens (prompt + ``max_new_tokens``, RULER's
            ``max_seq_length``); every task is generated at every length.
        num_samples: examples per task and length when the run leaves ``n_samples`` unset.
        qa_data_dir: local directory of RULER's qa files (``squad.json``, ``hotpotqa.json``); None = hub.
        aggregate: with several questions per context (``protocol=shared``, :data:`SHARED_TASKS`), a niah context's
            last question asks for every key's values (RULER's multiquery question over all its keys).

    Raises:
        ValueError: unknown task, a context length < 64, or ``num_samples < 1``.
    """

    #: a smaller n_samples gives a subset of a larger one (ids and contents): grow=true may extend a run
    nested_samples: ClassVar[bool] = True

    name: ClassVar[str] = "ruler"

    tasks: Sequence[str] = SYNTHETIC_TASKS
    context_lengths: Sequence[int] = (4096,)
    num_samples: int = 10
    qa_data_dir: str | None = None
    aggregate: bool = True

    def __post_init__(self):
        self.tasks = [str(t) for t in self.tasks]
        self.context_lengths = [int(c) for c in self.context_lengths]
        unknown = [t for t in self.tasks if t not in RULER_TASKS]
        if unknown:
            raise ValueError(f"unknown RULER tasks {unknown}; known: {list(RULER_TASKS)}")
        for c in self.context_lengths:
            if c < 64:
                raise ValueError(f"context_length={c} must be >= 64 tokens")
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1")

    def prepare(self) -> None:
        """Load the qa tasks' questions (``qa_data_dir`` or the hub) now, before a model is loaded.

        Raises:
            FileNotFoundError / DataUnavailableError: see :func:`load_qa`.
        """
        for name in self.tasks:
            if RULER_TASKS[name].kind == "qa":
                load_qa(RULER_TASKS[name].args["dataset"], self.qa_data_dir)

    def shared_problem(self, questions: int) -> str | None:
        """Why these tasks cannot put ``questions`` questions on one context (``protocol=shared``), or None: every
        task must hold several keys (:data:`SHARED_TASKS`)."""
        other = [t for t in self.tasks if t not in SHARED_TASKS]
        if other:
            return (
                f"RULER tasks {other} hold one key (or one answer) per context; the tasks of several keys are "
                f"{list(SHARED_TASKS)} (configs/dataset/ruler_shared.yaml)"
            )
        for name in self.tasks:  # an essay haystack takes one needle per depth of RULER's DEPTHS
            args = RULER_TASKS[name].args
            needles = max(args.get("num_needle_k", 0), args.get("num_needle_q", 0), questions)
            total = needles * args.get("num_needle_v", 1)
            if args.get("type_haystack") == "essay" and total > len(DEPTHS):
                return f"RULER task {name!r} would hold {total} needles, more than its {len(DEPTHS)} depths"
        return None

    def sample_limit(self) -> tuple[int, str] | None:
        """For qa tasks, the number of questions of the smallest qa source (example ``i`` asks question ``i``);
        None when every task is synthetic (any number)."""
        qa = [name for name in self.tasks if RULER_TASKS[name].kind == "qa"]
        if not qa:
            return None
        name = min(qa, key=lambda t: len(load_qa(RULER_TASKS[t].args["dataset"], self.qa_data_dir)[0]))
        return len(
            load_qa(RULER_TASKS[name].args["dataset"], self.qa_data_dir)[0]
        ), f"the questions of RULER task {name!r}"

    # -- generation ------------------------------------------------------------------------------

    def _renderer(
        self, name: str, context_length: int, seed: int, index: int, tokenizer, questions: int | None = None
    ) -> tuple[Callable[[int], _Rendered], int]:
        """A function haystack-size -> rendered prompt for one example, and the example's minimum size; with
        ``questions`` (K) the shared-context protocol's (:data:`SHARED_TASKS`), seeded by K besides."""
        task = RULER_TASKS[name]
        rseed = _seed("ruler", seed, name, context_length, index)
        if questions is not None:
            K, rseed = int(questions), _seed("ruler-shared", seed, name, context_length, questions, index)
            if task.kind == "niah":
                keys = max(task.args["num_needle_k"], task.args["num_needle_q"], K)
                render = functools.partial(_niah_shared_render, rseed, args=task.args, K=K, aggregate=self.aggregate)
                return render, keys * task.args["num_needle_v"]
        if task.kind == "niah":
            return (lambda n: _niah_render(rseed, n, task.args)), _min_size(task)
        if task.kind == "vt":
            icl_seed = _seed("ruler-vt-icl", seed, context_length, index)
            min_n = _min_size(task)
            n_icl = _fit(
                lambda n: _vt_render(icl_seed, n, task.args, is_icl=True),
                tokenizer,
                min(500, context_length // 8),
                min_n,
                5,
                strict=False,
            )
            icl = _vt_icl(icl_seed, n_icl, task.args)
            if questions is not None:  # K chains
                render = functools.partial(_vt_shared_render, rseed, args=task.args, K=int(questions), icl=icl + "\n")
                return render, min_n * int(questions)
            return (lambda n: _vt_render(rseed, n, task.args, icl=icl + "\n")), min_n
        if task.kind == "cwe":
            return (lambda n: _cwe_render(rseed, n, task.args, context_length)), _min_size(task)
        if task.kind == "fwe":
            return (lambda n: _fwe_render(rseed, n, task.args, context_length)), _min_size(task)
        qas, docs = load_qa(task.args["dataset"], self.qa_data_dir)
        qa = qas[index % len(qas)]
        return (lambda n: _qa_render(rseed, n, qa, docs)), len(qa["context"])

    def examples(
        self,
        tokenizer,
        n_samples: int | None = None,
        seed: int = 0,
        query_aware: bool = False,
        questions: int | None = None,
    ) -> list[Example]:
        """Generate ``n_samples`` (default ``num_samples``) examples per task and context length.

        With ``questions`` (K, the shared-context protocol: :mod:`evaluation.shared`) every example holds K questions
        on one context (:data:`SHARED_TASKS` only; ids ``<task>_<length>_k<K>_<i>``, seeded by K besides); the
        context fits its first question as RULER fits its one.

        Deterministic in ``seed``: example ``i`` of a (task, length) only depends on
        ``(seed, task, length, i)``, so a smaller ``n_samples`` yields a prefix of a larger one.
        ``query_aware=True`` appends the question to the context (and leaves ``question`` empty).
        Results are memoised per process (same parameters and tokenizer object), so the runs of a sweep
        generate each set once.
        Metadata: ``context_length`` (target), ``prompt_tokens`` (measured), ``depth`` (niah: where the
        earliest queried needle starts, in percent of the haystack characters), ``haystack``, ``index``.

        Raises:
            ValueError: a length too short for a task's smallest prompt; with ``questions``, a task outside
                :data:`SHARED_TASKS`.
            DataUnavailableError: a qa task without hub access or ``qa_data_dir``.
        """
        count = self.num_samples if n_samples is None else int(n_samples)
        if count < 1:
            raise ValueError(f"n_samples={count} must be >= 1 (examples per task and length)")
        problem = self.shared_problem(int(questions)) if questions is not None else None
        if problem:
            raise ValueError(problem)
        key = (
            tuple(self.tasks),
            tuple(self.context_lengths),
            self.qa_data_dir,
            count,
            seed,
            query_aware,
            questions,
            self.aggregate,
            id(tokenizer),
            getattr(tokenizer, "name_or_path", None),
            len(tokenizer),
        )
        if key not in _EXAMPLE_CACHE:  # a multirun re-instantiates the dataset for every press and ratio
            if len(_EXAMPLE_CACHE) >= 4:
                _EXAMPLE_CACHE.pop(next(iter(_EXAMPLE_CACHE)))
            _EXAMPLE_CACHE[key] = self._generate(tokenizer, count, seed, query_aware, questions)
        return list(_EXAMPLE_CACHE[key])

    def _generate(self, tokenizer, count: int, seed: int, query_aware: bool, questions=None) -> list[Example]:
        out: list[Example] = []
        for length in self.context_lengths:
            for name in self.tasks:
                task = RULER_TASKS[name]
                budget = length - task.max_new_tokens
                size = None
                for i in range(count):
                    render, min_n = self._renderer(name, length, seed, i, tokenizer, questions)
                    if size is None:  # RULER: binary search the haystack size once per task and length
                        size = _fit(
                            render, tokenizer, budget, min_n, _increment(task, length), name=name, length=length
                        )
                    n, step = size, _increment(task, length)
                    rendered = render(n)
                    tokens = count_tokens(tokenizer, rendered.text)
                    while tokens > budget:  # RULER: shrink by the increment until this sample fits
                        if n == min_n:
                            raise ValueError(_too_short(name, length, tokens + task.max_new_tokens))
                        n = max(min_n, n - step)
                        rendered = render(n)
                        tokens = count_tokens(tokenizer, rendered.text)
                    out.append(self._example(name, length, i, rendered, tokens, query_aware, questions))
        return out

    def _example(
        self, name: str, length: int, index: int, r: _Rendered, tokens: int, query_aware: bool, questions=None
    ) -> Example:
        task = RULER_TASKS[name]
        context, question, question_start = place_question(r.context, r.question, query_aware)
        meta = {"context_length": length, "prompt_tokens": tokens, "index": index, **r.metadata}
        return Example(
            id=f"{name}_{length}_{index}" if questions is None else f"{name}_{length}_k{questions}_{index}",
            context=context,
            question=question,
            answers=r.answers,
            answer_prefix=r.answer_prefix,
            max_new_tokens=task.max_new_tokens,
            task=name,
            metadata=meta,
            question_start=question_start,
            questions=r.questions,
        )

    # -- scoring ---------------------------------------------------------------------------------

    def score(self, prediction: str, example: Example) -> float:
        """RULER score: ``string_match_part`` for qa tasks, ``string_match_all`` otherwise, on the
        post-processed prediction (``ruler_postprocess``)."""
        return RULER_TASKS[example.task].metric(ruler_postprocess(prediction), example.answers)


_EXAMPLE_CACHE: dict[tuple, list[Example]] = {}


def _too_short(name: str, length: int, needed: int) -> str:
    return (
        f"context_length={length} is too short for RULER task {name!r}: its smallest prompt plus "
        f"max_new_tokens={RULER_TASKS[name].max_new_tokens} needs {needed} tokens"
    )


def _fit(
    render: Callable[[int], _Rendered],
    tokenizer,
    budget: int,
    min_n: int,
    step: int,
    strict: bool = True,
    name: str = "",
    length: int = 0,
) -> int:
    """Largest haystack size ``n >= min_n`` whose rendered prompt has at most ``budget`` tokens.

    Exponential then binary search (prompt length grows with ``n``). With ``strict=False`` a prompt
    that does not fit even at ``min_n`` returns ``min_n`` instead of raising.

    Raises:
        ValueError: ``strict`` and the prompt at ``min_n`` exceeds ``budget``.
    """

    def fits(n: int) -> bool:
        return count_tokens(tokenizer, render(n).text) <= budget

    if not fits(min_n):
        if not strict:
            return min_n
        needed = count_tokens(tokenizer, render(min_n).text) + RULER_TASKS[name].max_new_tokens
        raise ValueError(_too_short(name, length, needed))
    lo, hi = min_n, max(min_n + 1, step)
    while fits(hi):
        if hi > 10**8:
            raise RuntimeError(f"RULER task {name!r}: the prompt does not grow with the haystack size")
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
