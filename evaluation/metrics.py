"""Scorers of the benchmark harness and the statistics the reports build on them.

* RULER (Hsieh et al. 2024, ``scripts/eval/synthetic/constants.py``): ``string_match_all`` (recall of the
  references, case-insensitive substring match) and ``string_match_part`` (1 when any reference is found),
  after RULER's ``postprocess_pred``.
* LongBench (Bai et al. 2023, ``metrics.py`` / ``eval.py``): qa F1 with SQuAD-style normalisation (and its
  Chinese variant), rouge-L, classification with credit split across the named labels, passage retrieval,
  passage count, code edit similarity over the first non-comment line; ``LONGBENCH_METRICS`` maps each task
  to its metric (``dataset2metric``) and :func:`longbench_score` applies ``eval.py``'s per-task rules.
* Win score (paper 003, section 7; docs/methods.md §5): per example a method's rank is the number of other
  methods it beats or ties, averaged per task, normalised by ``n - 1`` and averaged over tasks.
* 95 % intervals: Wilson for 0/1 scores, Student t otherwise (``score_interval`` picks).

Every score is a float in [0, 1] (the official scripts report 100x these).
"""

from __future__ import annotations

import math
import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache

# --------------------------------------------------------------------------------------------------
# RULER
# --------------------------------------------------------------------------------------------------

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, turn control characters into newlines, strip again."""
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


def _check_references(references: Sequence[str]) -> None:
    if isinstance(references, str):
        raise TypeError(f"references must be a list of strings, got the string {references!r}")
    if len(references) == 0:
        raise ValueError("references is empty: a score needs at least one reference answer")


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` found in ``prediction`` (case-insensitive substring match).

    RULER's ``string_match_all`` for one example (niah, vt, cwe, fwe): an answer listing every reference
    scores 1, one listing half of them 0.5.

    Raises:
        ValueError: ``references`` is empty. TypeError: ``references`` is a bare string.
    """
    _check_references(references)
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` is found in ``prediction`` (case-insensitive), else 0.0.

    RULER's ``string_match_part`` for one example (the qa tasks).

    Raises:
        ValueError: ``references`` is empty. TypeError: ``references`` is a bare string.
    """
    _check_references(references)
    pred = prediction.lower()
    return 1.0 if any(r.lower() in pred for r in references) else 0.0


# --------------------------------------------------------------------------------------------------
# LongBench
# --------------------------------------------------------------------------------------------------

_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
    "–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)
_EN_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower case, drop ASCII punctuation and articles, squash whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalisation: lower case, drop ASCII and CJK punctuation, delete all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def f1_score(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 = 2 P R / (P + R) with P = common / |prediction|, R = common / |ground truth|."""
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench ``qa_f1_score``: token F1 of the normalised prediction against one normalised reference."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


_CJK_OR_WORD = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|[^\s\u3400-\u9fff\uf900-\ufaff]+")


@lru_cache(maxsize=1)
def _jieba():
    try:
        import jieba

        jieba.setLogLevel(60)
        return jieba
    except ImportError:
        warnings.warn(
            "jieba is not installed: Chinese LongBench metrics segment text into single CJK characters "
            "(official LongBench uses jieba words; it is a dependency of this project: `pip install jieba`)",
            stacklevel=3,
        )
        return None


def zh_tokens(text: str, use_jieba: bool | None = None) -> list[str]:
    """Chinese word segmentation for the zh metrics: jieba (LongBench's choice) when installed.

    Without jieba (or with ``use_jieba=False``) each CJK character is a token and other runs of non-space
    characters are tokens; this is the documented fallback, not the official segmentation.

    Raises:
        ImportError: ``use_jieba=True`` and jieba is not installed.
    """
    jieba = _jieba() if use_jieba in (None, True) else None
    if use_jieba and jieba is None:
        raise ImportError("use_jieba=True but jieba is not installed (pip install jieba)")
    if jieba is not None:
        return list(jieba.cut(text, cut_all=False))
    return _CJK_OR_WORD.findall(text)


def qa_f1_zh_score(prediction: str, ground_truth: str, use_jieba: bool | None = None, **_) -> float:
    """LongBench ``qa_f1_zh_score``: F1 over segmented, normalised, non-empty Chinese tokens."""
    pred = [t for t in (normalize_zh_answer(t) for t in zh_tokens(prediction, use_jieba)) if t]
    ref = [t for t in (normalize_zh_answer(t) for t in zh_tokens(ground_truth, use_jieba)) if t]
    return f1_score(pred, ref)


class _WhitespaceTokenizer:
    """rouge-score tokenizer that splits on whitespace only (keeps CJK tokens produced by segmentation)."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


@lru_cache(maxsize=2)
def _rouge_scorer(whitespace: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WhitespaceTokenizer() if whitespace else None)


def rouge_l_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F-measure (rouge-score's ``rougeL``: lower-cased alphanumeric tokens, sentence-level LCS).

    LongBench computes ``Rouge().get_scores(...)["rouge-l"]["f"]`` with the ``rouge`` package; this uses
    the ``rouge-score`` package instead (same LCS F-measure, its own tokenisation). 0.0 when either side
    has no token.
    """
    return float(_rouge_scorer(False).score(ground_truth, prediction)["rougeL"].fmeasure)


def rouge_zh_score(prediction: str, ground_truth: str, use_jieba: bool | None = None, **_) -> float:
    """LongBench ``rouge_zh_score``: ROUGE-L F over segmented Chinese words (see :func:`zh_tokens`)."""
    pred = " ".join(zh_tokens(prediction, use_jieba))
    ref = " ".join(zh_tokens(ground_truth, use_jieba))
    return float(_rouge_scorer(True).score(ref, pred)["rougeL"].fmeasure)


def _numbers_matching(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench ``count_score``: fraction of the numbers in ``prediction`` equal to ``ground_truth``."""
    return _numbers_matching(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench ``retrieval_score``: fraction of the numbers in ``prediction`` equal to the reference's
    ``Paragraph N`` number.

    Raises:
        ValueError: ``ground_truth`` has no ``Paragraph N``.
    """
    match = re.search(r"Paragraph (\d+)", ground_truth)
    if match is None:
        raise ValueError(f"retrieval reference {ground_truth!r} has no 'Paragraph N'")
    return _numbers_matching(prediction, match.group(1))


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench ``retrieval_zh_score``: as :func:`retrieval_score` with the reference pattern ``段落N``.

    Raises:
        ValueError: ``ground_truth`` has no ``段落N``.
    """
    match = re.search(r"段落(\d+)", ground_truth)
    if match is None:
        raise ValueError(f"retrieval reference {ground_truth!r} has no '段落N'")
    return _numbers_matching(prediction, match.group(1))


def first_code_line(prediction: str) -> str:
    """LongBench's code line: the first line (after leading newlines) without a backtick, ``#`` or ``//``."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench ``code_sim_score``: ``fuzz.ratio(first_code_line(prediction), ground_truth) / 100``.

    fuzzywuzzy's ``ratio`` (LongBench) is ``round(100 * (1 - indel_distance / (len(a) + len(b))))``;
    rapidfuzz computes the same normalised indel similarity, rounded here the same way.
    """
    from rapidfuzz import fuzz

    return int(round(fuzz.ratio(first_code_line(prediction), ground_truth))) / 100


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **_) -> float:
    """LongBench ``classification_score``: credit ``1 / m`` when the reference is among the ``m`` labels named.

    Labels of ``all_classes`` found in ``prediction`` are collected; those that are proper substrings of
    ``ground_truth`` are dropped; the score is ``1 / len(matches)`` if ``ground_truth`` is among them, else 0.
    (The official loop removes items from the list it iterates, which can skip one; this removes them all.)

    Raises:
        ValueError: ``all_classes`` is missing or empty.
    """
    if not all_classes:
        raise ValueError(f"classification_score needs all_classes (the task's label set), got {all_classes!r}")
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in ground_truth and c != ground_truth)]
    return 1.0 / len(matches) if ground_truth in matches else 0.0


LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_l_score,
    "qmsum": rouge_l_score,
    "multi_news": rouge_l_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_l_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
"""LongBench's ``dataset2metric``: task name -> metric(prediction, ground_truth, all_classes=...)."""

LONGBENCH_FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""Few-shot tasks whose prediction is cut to its first line before scoring (LongBench ``eval.py``)."""


def longbench_score(
    task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """Score of one LongBench prediction: the task's metric, maximised over the reference ``answers``.

    Applies ``eval.py``'s rule: for trec, triviaqa, samsum and lsht only the first line of the prediction
    (after leading newlines) is scored. A ``-e`` suffix (LongBench-E) is ignored.

    Raises:
        KeyError: ``task`` is not a LongBench task. ValueError: ``answers`` is empty.
    """
    base = task.removesuffix("_e").removesuffix("-e")
    if base not in LONGBENCH_METRICS:
        raise KeyError(f"unknown LongBench task {task!r}; known: {sorted(LONGBENCH_METRICS)}")
    _check_references(answers)
    if base in LONGBENCH_FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[base]
    return max(float(metric(prediction, gt, all_classes=all_classes)) for gt in answers)


# --------------------------------------------------------------------------------------------------
# Win score (paper 003, section 7)
# --------------------------------------------------------------------------------------------------


def example_ranks(scores: Mapping[str, float]) -> dict[str, int]:
    """Rank of each method on one example: how many OTHER methods it beats or ties (``0 .. n-1``).

    Paper 003 section 7: the lowest score gets 0, the highest ``n - 1``, tied methods all get the rank of
    a win over the others they tie with. NaN scores are not allowed.

    Raises:
        ValueError: a score is NaN.
    """
    for method, s in scores.items():
        if s != s:  # NaN
            raise ValueError(f"score of method {method!r} is NaN")
    return {m: sum(1 for o, t in scores.items() if o != m and s >= t) for m, s in scores.items()}


def win_scores(per_task: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, float]:
    """Win score of each method (paper 003 section 7; docs/methods.md §5).

    Args:
        per_task: ``{task: {method: [score of example 0, example 1, ...]}}``; inside a task every method
            lists the SAME examples in the same order. Every task must have the same methods.

    Returns:
        ``{method: win score in [0, 1]}``: per example rank (:func:`example_ranks`), averaged over the
        task's examples, divided by ``n - 1``, averaged over tasks (tasks weigh equally).

    Raises:
        ValueError: fewer than 2 methods, no task, a task without examples, a method whose list length
            differs inside a task, or tasks with different method sets.

    Example (docs/methods.md §5): ``win_scores({"t": {"A": [1, 0], "B": [1, .5], "C": [0, 1]}})`` gives
    ``{"A": 0.5, "B": 0.75, "C": 0.5}``.
    """
    if not per_task:
        raise ValueError("win_scores needs at least one task")
    methods: list[str] | None = None
    totals: dict[str, float] = {}
    for task, table in per_task.items():
        names = sorted(table)
        if methods is None:
            methods = names
            if len(methods) < 2:
                raise ValueError(f"win score needs at least 2 methods, got {methods}")
            totals = {m: 0.0 for m in methods}
        elif names != methods:
            raise ValueError(f"task {task!r} has methods {names}, expected {methods}")
        lengths = {m: len(table[m]) for m in names}
        n_ex = lengths[names[0]]
        if any(v != n_ex for v in lengths.values()):
            raise ValueError(f"task {task!r}: methods list different numbers of examples {lengths}")
        if n_ex == 0:
            raise ValueError(f"task {task!r} has no examples")
        rank_sum = {m: 0 for m in names}
        for i in range(n_ex):
            for m, r in example_ranks({m: float(table[m][i]) for m in names}).items():
                rank_sum[m] += r
        for m in names:
            totals[m] += rank_sum[m] / n_ex / (len(names) - 1)
    return {m: totals[m] / len(per_task) for m in methods}


# --------------------------------------------------------------------------------------------------
# Intervals
# --------------------------------------------------------------------------------------------------


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``.

    Raises:
        ValueError: ``n < 1``, ``successes`` outside ``[0, n]`` or ``confidence`` outside (0, 1).
    """
    from scipy.stats import norm

    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must be in [0, n={n}]")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    z = float(norm.ppf(0.5 + confidence / 2))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean of ``values`` (degenerate ``(x, x)`` for one value or zero spread).

    Raises:
        ValueError: ``values`` is empty or ``confidence`` outside (0, 1).
    """
    from scipy.stats import t

    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    mean = sum(values) / n
    if n == 1:
        return mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def score_interval(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float, float, str]:
    """Mean of per-example scores in [0, 1] with its interval: Wilson when every score is 0 or 1, else
    Student t clipped to [0, 1].

    Returns:
        ``(mean, low, high, method)`` with ``method`` in ``{"wilson", "t"}``.

    Raises:
        ValueError: no value.
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("score_interval needs at least one score")
    mean = sum(vals) / len(vals)
    if all(v in (0.0, 1.0) for v in vals):
        lo, hi = wilson_interval(sum(vals), len(vals), confidence)
        return mean, lo, hi, "wilson"
    lo, hi = t_interval(vals, confidence)
    return mean, max(0.0, lo), min(1.0, hi), "t"
