"""Scorers on hand-made cases whose values are computed by hand in the comments."""

from __future__ import annotations

import math

import pytest

from evaluation import metrics as M

# ---------------------------------------------------------------------------------------------- RULER


def test_string_match_all_is_recall_over_references():
    assert M.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert M.string_match_all("APPLE-pie and 42", ["apple-PIE", "42"]) == 1.0  # case-insensitive, lists all
    assert M.string_match_all("nothing here", ["123"]) == 0.0


def test_string_match_part_is_any_reference():
    assert M.string_match_part("only 456", ["123", "456"]) == 1.0
    assert M.string_match_part("PARIS", ["paris", "lyon"]) == 1.0
    assert M.string_match_part("none", ["123", "456"]) == 0.0


def test_string_match_bad_references():
    with pytest.raises(ValueError, match="empty"):
        M.string_match_all("x", [])
    with pytest.raises(TypeError, match="list of strings"):
        M.string_match_part("x", "abc")


def test_ruler_postprocess():
    assert M.ruler_postprocess("  42\x01 43 \n") == "42\n 43"


# ------------------------------------------------------------------------------------------- LongBench


def test_normalisations():
    assert M.normalize_answer("The Eiffel Tower!") == "eiffel tower"
    assert M.normalize_answer("  a  b,  an C ") == "b c"
    assert M.normalize_zh_answer("中国，北京。 A b") == "中国北京ab"


def test_qa_f1():
    # prediction [eiffel, tower, in, paris], reference [eiffel, tower]: common 2, P=1/2, R=1 -> F1 = 2/3
    assert M.qa_f1_score("the Eiffel tower in Paris", "Eiffel Tower") == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: [x, x, y] vs [x, y, y]: common {x:1, y:1} = 2 -> P=R=2/3
    assert M.qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)
    assert M.qa_f1_score("London", "Paris") == 0.0
    assert M.qa_f1_score("", "Paris") == 0.0


def test_qa_f1_zh_character_fallback():
    # characters [中, 国, 北, 京] vs [中, 国]: common 2, P=1/2, R=1 -> 2/3; punctuation tokens are dropped
    assert M.qa_f1_zh_score("中国，北京", "中国", use_jieba=False) == pytest.approx(2 / 3)
    assert M.zh_tokens("北京 abc 12", use_jieba=False) == ["北", "京", "abc", "12"]


def test_rouge_l():
    # [the cat sat on the mat] vs [the cat lay on the mat]: LCS 5, P = R = 5/6 -> F = 5/6
    assert M.rouge_l_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # [a b c d] vs [a c]: LCS 2, P=2/4, R=1 -> F = 2/3 (order matters: [c a] vs [a c] has LCS 1)
    assert M.rouge_l_score("a b c d", "a c") == pytest.approx(2 / 3)
    assert M.rouge_l_score("c a", "a c") == pytest.approx(0.5)
    assert M.rouge_l_score("", "a c") == 0.0


def test_rouge_zh_character_fallback():
    # 北京是中国的首都 vs 中国的首都是北京: LCS 中国的首都 = 5 of 8 each side -> F = 5/8
    assert M.rouge_zh_score("北京是中国的首都", "中国的首都是北京", use_jieba=False) == pytest.approx(5 / 8)


def test_zh_metrics_segment_words_with_jieba_by_default():
    """jieba is a dependency (pyproject.toml), so the zh metrics segment words as LongBench's scorer does, not the
    single characters of the fallback."""
    import jieba

    assert M.zh_tokens("北京是中国的首都") == list(jieba.cut("北京是中国的首都", cut_all=False))
    assert M.zh_tokens("北京是中国的首都") == ["北京", "是", "中国", "的", "首都"]
    # words [北京 是 中国 的 首都] vs [中国 的 首都 是 北京]: LCS 中国 的 首都 = 3 of 5 each side -> F = 3/5 (5/8 in
    # characters, test_rouge_zh_character_fallback)
    assert M.rouge_zh_score("北京是中国的首都", "中国的首都是北京") == pytest.approx(3 / 5)
    # 北京大学 is one word, so it shares nothing with 北京 (2/3 in characters)
    assert M.qa_f1_zh_score("北京大学", "北京") == 0.0
    assert M.qa_f1_zh_score("北京大学", "北京", use_jieba=False) == pytest.approx(2 / 3)


CLASSES = ["Description of something", "Definition of something", "City", "Country", "Other location"]


def test_classification_splits_credit_across_named_labels():
    assert M.classification_score("City", "City", all_classes=CLASSES) == 1.0
    assert M.classification_score("City or Country", "City", all_classes=CLASSES) == 0.5
    assert M.classification_score("Country", "City", all_classes=CLASSES) == 0.0
    assert M.classification_score("no label", "City", all_classes=CLASSES) == 0.0
    # a label that is a proper substring of the reference is not counted against it
    assert M.classification_score("Other location", "Other location", all_classes=["location", "Other location"]) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        M.classification_score("City", "City", all_classes=None)


def test_retrieval_and_count():
    assert M.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert M.retrieval_score("Paragraph 2 or Paragraph 3", "Paragraph 2") == 0.5
    assert M.retrieval_score("I do not know", "Paragraph 2") == 0.0
    assert M.retrieval_score("Paragraph 12", "Paragraph 2") == 0.0  # whole numbers, not digits
    assert M.retrieval_zh_score("段落3", "段落3") == 1.0
    with pytest.raises(ValueError, match="Paragraph N"):
        M.retrieval_score("1", "the first one")
    assert M.count_score("There are 2 unique paragraphs out of 3", "2") == 0.5
    assert M.count_score("2", "2") == 1.0
    assert M.count_score("two", "2") == 0.0


def test_code_similarity_on_first_code_line():
    # the comment line is skipped; the next line equals the reference
    assert M.code_sim_score("\n# add them\n    return a + b\nprint(1)", "    return a + b") == 1.0
    # backtick line skipped; "return a+b" (10 chars) vs "return a + b" (12): indel distance 2 ->
    # 100 * (1 - 2 / 22) = 90.9 -> fuzzywuzzy rounds to 91
    assert M.code_sim_score("```python\nreturn a+b", "return a + b") == pytest.approx(0.91)
    assert M.first_code_line("// c\n# p\n`x`") == ""
    assert M.code_sim_score("# only comments", "return a") == 0.0


def test_longbench_score_rules():
    # trec/triviaqa/samsum/lsht keep only the first line: "City\nCountry" -> "City" -> 1 (not 1/2)
    assert M.longbench_score("trec", "City\nCountry", ["City"], CLASSES) == 1.0
    assert M.LONGBENCH_METRICS["trec"]("City\nCountry", "City", all_classes=CLASSES) == 0.5
    # maximum over the references: F1("paris france", "paris") = 2/3 but the second reference matches
    assert M.longbench_score("hotpotqa", "Paris, France", ["Paris", "Paris, France"]) == 1.0
    assert M.longbench_score("passage_count", "3", ["3"]) == 1.0
    with pytest.raises(KeyError, match="unknown LongBench task"):
        M.longbench_score("nope", "x", ["x"])


# ----------------------------------------------------------------------------------------- win score


def test_win_score_spec_worked_case():
    # docs/methods.md §5: ex1 A=1, B=1, C=0; ex2 A=0, B=0.5, C=1 -> A=0.50, B=0.75, C=0.50
    ws = M.win_scores({"task": {"A": [1, 0], "B": [1, 0.5], "C": [0, 1]}})
    assert ws == pytest.approx({"A": 0.5, "B": 0.75, "C": 0.5})


def test_win_score_ties_count_as_wins_and_tasks_weigh_equally():
    assert M.example_ranks({"A": 0.3, "B": 0.3, "C": 0.3}) == {"A": 2, "B": 2, "C": 2}
    assert M.example_ranks({"A": 0.9, "B": 0.3, "C": 0.3}) == {"A": 2, "B": 1, "C": 1}
    # task t1 (1 example): A wins -> A=1, B=0; task t2 (3 examples): B wins each -> A=0, B=1.
    # Tasks average equally -> 0.5 each (an average over the 4 examples would give A = 0.25).
    ws = M.win_scores({"t1": {"A": [1], "B": [0]}, "t2": {"A": [0, 0, 0], "B": [1, 1, 1]}})
    assert ws == pytest.approx({"A": 0.5, "B": 0.5})


def test_win_score_errors():
    with pytest.raises(ValueError, match="at least 2 methods"):
        M.win_scores({"t": {"A": [1]}})
    with pytest.raises(ValueError, match="different numbers of examples"):
        M.win_scores({"t": {"A": [1, 0], "B": [1]}})
    with pytest.raises(ValueError, match="expected"):
        M.win_scores({"t": {"A": [1], "B": [0]}, "u": {"A": [1], "C": [0]}})
    with pytest.raises(ValueError, match="NaN"):
        M.example_ranks({"A": math.nan, "B": 1.0})


# ----------------------------------------------------------------------------------------- intervals


def test_wilson_interval_hand_values():
    # 5/10, z = 1.96: centre 0.5, half-width 1.96 * sqrt(.025 + 3.8415/400) / 1.38415 = 0.2634
    lo, hi = M.wilson_interval(5, 10)
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    # 0/10: [0, z^2/n / (1 + z^2/n)] = [0, 0.38415 / 1.38415] = [0, 0.2775]
    lo, hi = M.wilson_interval(0, 10)
    assert (lo, hi) == pytest.approx((0.0, 0.2775), abs=1e-4)
    with pytest.raises(ValueError, match="successes=11"):
        M.wilson_interval(11, 10)


def test_t_interval_and_choice():
    # [.2, .4, .6]: mean .4, sd .2, se .11547, t(.975, 2) = 4.3027 -> half 0.4968
    lo, hi = M.t_interval([0.2, 0.4, 0.6])
    assert (lo, hi) == pytest.approx((0.4 - 0.4968, 0.4 + 0.4968), abs=1e-4)
    assert M.score_interval([1, 0, 1, 1])[3] == "wilson"
    mean, lo, hi, method = M.score_interval([0.2, 0.4, 0.6])
    assert method == "t" and mean == pytest.approx(0.4) and lo == 0.0  # clipped to [0, 1]
    with pytest.raises(ValueError, match="at least one"):
        M.score_interval([])
