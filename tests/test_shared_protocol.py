"""Compress once, ask many (issue 66): the shared-context protocol (evaluation/shared.py).

Tiny random-weight Llama (GQA, sdpa) with a character tokenizer, as tests/test_fused.py: one context compressed once
and asked K questions, each on the compressed context alone (multi-request, kvpress's ``questions=[...]``) or in
turn in one chat (multi-turn); ``evaluation.run`` (kvpress's pipeline) and ``evaluation.fused`` (one shared prefill,
replayed per press) write the same answers per question position; the sets with several questions per context; the
settings (committed runs keep their identity); the positions guard; the report's per-position and per-answer cost
tables.
"""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
import yaml
from _tiny_tokenizer import char_tokenizer, word_tokenizer
from test_harness import composed
from test_kvzip_path import _tiny_model
from transformers import DynamicCache

from evaluation import fused, guards, harness, settings
from evaluation import run as entry
from evaluation.datasets.needle import AGGREGATE_QUESTION, NeedleDataset
from evaluation.datasets.ruler import SHARED_TASKS, RulerDataset
from evaluation.pipeline import TextGenerationPipeline, next_turn_text
from evaluation.predictions import rows_file
from evaluation.shared import FOLLOWUP_SEPARATOR, Protocol, asked

pytestmark = pytest.mark.usefixtures("one_thread")

PRESSES = ["no_press", "snapkv", "page_entrokv", "snis_min", "kvzip"]
SETTINGS = ["n_samples=2", "dataset.context_length=384", "max_new_tokens=6", "protocol=shared"]


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """tests/test_kvzip_path.py's tiny Llama (sharp logits, a query direction every head shares, for KVzip's fake
    keys), its tokenizer saved where KVzip reloads it."""
    model, tok = _tiny_model(tmp_path / "checkpoint")
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    return model, tok


def _runs(presses, out, *extra, ratio=0.75):
    runs = []
    for press in presses:
        cfg = composed(
            f"press={press}",
            f"compression_ratio={0.0 if press == 'no_press' else ratio}",
            f"output_dir={out}",
            *SETTINGS,
            *extra,
        )
        runs.append((cfg, {"press": press, "dataset": "needle", "model": "smollm2-135m"}))
    return runs


def _rows(out, press, dataset="needle-shared", ratio=0.75):
    path = out / dataset / "smollm2-135m" / press / f"cr{0.0 if press == 'no_press' else ratio:g}" / "predictions.jsonl"
    return {r["id"]: r for r in harness.read_predictions(path)}


# ------------------------------------------------------------------------------------------------- run == fused


@pytest.mark.parametrize("mode", ["request", "turn"])
def test_fused_equals_separate_runs_per_question_position(tiny, tmp_path, mode):
    """Both paths give every press the same answer at every question position, one row per question, in the
    protocol's own directory; the rows carry the position, the kind, a score and the context's costs once."""
    extra = [f"shared_mode={mode}"]
    for cfg, names in _runs(PRESSES, tmp_path / "separate", *extra):
        entry.run(cfg, names)
    fused.run_fused(_runs(PRESSES, tmp_path / "fused", *extra), "test")
    dataset = "needle-shared" if mode == "request" else "needle-turns"
    answers = set()
    for press in PRESSES:
        sep, fus = _rows(tmp_path / "separate", press, dataset), _rows(tmp_path / "fused", press, dataset)
        assert sorted(sep) == sorted(fus) and len(sep) == 2 * 4, press
        for i, row in sep.items():
            assert fus[i]["prediction"] == row["prediction"], (press, mode, i)
            assert fus[i]["score"] == row["score"]
            assert row["id"] == f"{row['example_id']}#q{row['question_index']}"
            assert row["questions"] == 4 and row["shared_mode"] == mode
            assert row["question_kind"] == ("aggregate" if row["question_index"] == 4 else "retrieve")
            assert row["seconds"] == pytest.approx(row["prefill_seconds"] + row["decode_seconds"])
            assert fus[i]["seconds"] == pytest.approx(
                fus[i]["prefill_seconds"] + fus[i]["replay_seconds"] + fus[i]["decode_seconds"]
            )
            answers.add(row["prediction"])
        for example in {r["example_id"] for r in sep.values()}:  # the context's costs, once per context
            costs = {
                (r["prefill_seconds"], r.get("replay_seconds")) for r in fus.values() if r["example_id"] == example
            }
            assert len(costs) == 1
    assert len(answers) > 4  # the answers differ by question and press: the comparison is not trivial
    metrics = json.loads((tmp_path / f"fused/{dataset}/smollm2-135m/snapkv/cr0.75/metrics.json").read_text())
    assert metrics["n"] == 8 and metrics["n_contexts"] == 2 and sorted(metrics["per_question"]) == ["1", "2", "3", "4"]
    config = yaml.safe_load((tmp_path / f"fused/{dataset}/smollm2-135m/snapkv/cr0.75/config.yaml").read_text())
    assert (config["protocol"], config["questions"], config["shared_mode"]) == ("shared", 4, mode)


def test_query_aware_puts_the_first_question_inside_and_lives_apart(tiny, tmp_path):
    """With the first question inside the compressed context, run == fused still, in ``needle-shared-qa``; question 1
    is asked with an empty text, the later ones after :data:`FOLLOWUP_SEPARATOR`."""
    for cfg, names in _runs(["snapkv", "page_entrokv"], tmp_path / "separate", "query_aware=true"):
        entry.run(cfg, names)
    fused.run_fused(_runs(["snapkv", "page_entrokv"], tmp_path / "fused", "query_aware=true"), "test")
    for press in ("snapkv", "page_entrokv"):
        sep = _rows(tmp_path / "separate", press, "needle-shared-qa")
        fus = _rows(tmp_path / "fused", press, "needle-shared-qa")
        assert len(sep) == 8 and {i: r["prediction"] for i, r in sep.items()} == {
            i: r["prediction"] for i, r in fus.items()
        }
    assert not (tmp_path / "separate" / "needle-shared").exists()
    ex = NeedleDataset(context_length=384).examples(char_tokenizer(), 1, 42, True, questions=3)[0]
    texts, prefixes = asked(ex, Protocol(3, turns=False, query_aware=True))
    assert texts[0] == "" and ex.context.endswith(ex.questions[0].question)
    assert texts[1:] == [FOLLOWUP_SEPARATOR + q.question for q in ex.questions[1:]]
    assert prefixes == [q.answer_prefix for q in ex.questions]


def test_resume_redoes_only_the_missing_questions(tiny, tmp_path):
    """A run that lost its metrics and the rows of its last question resumes: only those rows are written again,
    equal to before."""
    runs = _runs(["snapkv"], tmp_path)
    fused.run_fused(runs, "test")
    out = tmp_path / "needle-shared/smollm2-135m/snapkv/cr0.75"
    rows = harness.read_predictions(out / "predictions.jsonl")
    (out / "metrics.json").unlink()
    kept = [r for r in rows if not (r["example_id"] == rows[-1]["example_id"] and r["question_index"] >= 3)]
    harness.write_atomic(out / "predictions.jsonl", "".join(json.dumps(r) + "\n" for r in kept))
    fused.run_fused(runs, "test resumed")
    again = harness.read_predictions(out / "predictions.jsonl")
    assert len(again) == len(rows) == 8 and again[: len(kept)] == kept
    assert {r["id"]: r["prediction"] for r in again} == {r["id"]: r["prediction"] for r in rows}


# --------------------------------------------------------------------------------------------- the pipeline


def _pipe(model, tok):
    return TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))


def _compressed(model, pipe, ids, press):
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids["context_ids"], past_key_values=cache)
    return cache


def test_multi_request_answers_each_question_as_on_a_copy(tiny):
    """kvpress's ``questions=[...]`` with one prefix per question: each answer is the question's on a deepcopy of the
    compressed cache (the probabilistic press's correction follows the cut-back cache), and the pipeline leaves the
    compressed context."""
    from hydra.utils import instantiate

    model, tok = tiny
    pipe = _pipe(model, tok)
    ex = NeedleDataset(context_length=320).examples(tok, 1, 3, False, questions=3)[0]
    texts, prefixes = asked(ex, Protocol(3, turns=False, query_aware=False))
    press = instantiate(composed("press=snis_min", "compression_ratio=0.6").press)
    cache = DynamicCache()
    with torch.inference_mode():
        together = pipe(
            ex.context, questions=texts, answer_prefixes=prefixes, press=press, max_new_tokens=6, cache=cache
        )
    ids = pipe.preprocess(ex.context, texts, "", int(1e10), answer_prefixes=prefixes)
    T = ids["context_ids"].shape[1]
    assert len(pipe.answer_seconds) == 3 and all(s > 0 for s in pipe.answer_seconds)
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    assert max(lengths) < T  # the compressed context, no answer left in it
    with torch.inference_mode():
        alone = [pipe.generate_answer(q, copy.deepcopy(cache), T, 6) for q in ids["questions_ids"]]
    assert together["answers"] == alone and len(set(alone)) > 1
    with pytest.raises(ValueError, match="answer_prefixes has 2 prefixes for 3 questions"):
        pipe(ex.context, questions=texts, answer_prefixes=prefixes[:2], press=press, max_new_tokens=2)


def test_multi_turn_keeps_each_question_and_answer_for_the_next(tiny):
    """In turn, question k's answer is the one a copy of the compressed cache gives after the earlier turns were
    fed through the model (their questions, as chat turns, and the generated answers' tokens); the first equals the
    multi-request answer, and the cache ends holding the compressed context again."""
    from hydra.utils import instantiate

    model, tok = tiny
    pipe = _pipe(model, tok)
    ex = NeedleDataset(context_length=320).examples(tok, 1, 5, False, questions=3)[0]
    protocol = Protocol(3, turns=True, query_aware=False)
    texts, prefixes = asked(ex, protocol)
    ids = pipe.preprocess(ex.context, texts, "", int(1e10), answer_prefixes=prefixes, turns=True)
    assert ids["questions_ids"][1][0].tolist() == tok.encode(next_turn_text(tok, texts[1], prefixes[1]))
    T = ids["context_ids"].shape[1]
    press = instantiate(composed("press=page_entrokv", "compression_ratio=0.5").press)
    cache = _compressed(model, pipe, ids, press)
    before = [cache.get_seq_length(i) for i in range(len(cache))]
    with torch.inference_mode():
        turns = pipe.answer_questions(copy.deepcopy(cache), ids["questions_ids"], T, 5, turns=True)
        requests = pipe.answer_questions(copy.deepcopy(cache), ids["questions_ids"][:1], T, 5)
    assert turns[0] == requests[0]
    # by hand: feed turn 1's question and its answer's tokens, then ask question 2 on that cache
    work = copy.deepcopy(cache)
    with torch.inference_mode():
        q1 = ids["questions_ids"][0]
        out = model(input_ids=q1, past_key_values=work, position_ids=torch.arange(T, T + q1.shape[1])[None])
        tokens = [int(out.logits[0, -1].argmax())]
        for step in range(4):
            pos = T + q1.shape[1] + step
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]), past_key_values=work, position_ids=torch.tensor([[pos]])
            )
            tokens.append(int(out.logits[0, -1].argmax()))
            if tokens[-1] in pipe.stop_token_ids:
                break
        assert tok.decode(tokens, skip_special_tokens=True) == turns[0]
        pending = [] if tokens[-1] in pipe.stop_token_ids else tokens[-1:]
        second = pipe.answer_questions(
            work,
            [torch.cat([torch.tensor([pending], dtype=torch.long), ids["questions_ids"][1]], 1)],
            T + q1.shape[1] + len(tokens) - 1,
            5,
        )
    assert second[0] == turns[1]
    chat = copy.deepcopy(cache)
    with torch.inference_mode():
        pipe.answer_questions(chat, ids["questions_ids"], T, 5, turns=True)
    assert [chat.get_seq_length(i) for i in range(len(chat))] == before


def test_next_turn_text_with_a_chat_template():
    """A ChatML template: the assistant's turn closes, a user turn holds the question, the assistant's header and the
    answer prefix follow; without a template, a new paragraph."""
    tok = copy.deepcopy(char_tokenizer())
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert next_turn_text(tok, "Q?", "A:") == "<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\nA:"
    assert next_turn_text(char_tokenizer(), "Q?", "A:") == "\n\nQ?\nA:"


# --------------------------------------------------------------------------------------------------- the sets


def test_needle_holds_k_needles_at_spread_depths_and_an_aggregate_question():
    tok = word_tokenizer()
    data = NeedleDataset(context_length=1024)
    examples = data.examples(tok, 3, 42, False, questions=4)
    assert examples == data.examples(tok, 3, 42, False, questions=4)  # the same seed, the same examples
    assert [e.id for e in data.examples(tok, 2, 42, False, questions=4)] == [e.id for e in examples[:2]]
    for ex in examples:
        assert len(ex.questions) == 4 and ex.max_new_tokens == data.aggregate_max_new_tokens
        depths = ex.metadata["needle_depths"]
        assert ex.metadata["target_length"] == 1024 and ex.metadata["context_length"] <= 1024
        assert all(100 * j / 4 <= d <= 100 * (j + 1) / 4 for j, d in enumerate(depths))
        assert [q.kind for q in ex.questions] == ["retrieve"] * 3 + ["aggregate"]
        values = ex.questions[3].answers
        assert len(set(values)) == 4 and all(ex.context.count(v) == 1 for v in values)
        assert {q.answers[0] for q in ex.questions[:3]} < set(values) and ex.questions[3].question == AGGREGATE_QUESTION
        assert (ex.question, ex.answers) == (ex.questions[0].question, ex.questions[0].answers)
    agg = examples[0].questions[3]
    view = type(examples[0])(id="x", context="", question="", answers=agg.answers)
    assert data.score(f"{agg.answers[0]} and {agg.answers[2]}", view) == 0.5  # recall
    plain = NeedleDataset(context_length=1024, aggregate=False).examples(tok, 1, 42, False, questions=4)[0]
    assert [q.kind for q in plain.questions] == ["retrieve"] * 4 and len({q.answers[0] for q in plain.questions}) == 4


def test_ruler_shared_tasks_hold_several_keys_and_refuse_the_others():
    tok = word_tokenizer()
    data = RulerDataset(tasks=["niah_multikey_1", "niah_multivalue", "vt"], context_lengths=[1024])
    examples = data.examples(tok, 1, 42, False, questions=3)
    assert [e.id for e in examples] == ["niah_multikey_1_1024_k3_0", "niah_multivalue_1024_k3_0", "vt_1024_k3_0"]
    for ex in examples:
        assert len(ex.questions) == 3 and ex.metadata["prompt_tokens"] <= 1024 - ex.max_new_tokens
        for q in ex.questions:
            assert all(a in ex.context for a in q.answers) and q.question not in ex.context
    multikey, multivalue, vt = examples
    assert [q.kind for q in multikey.questions] == ["retrieve", "retrieve", "aggregate"]
    assert set(multikey.questions[2].answers) >= {a for q in multikey.questions[:2] for a in q.answers}
    assert all(len(q.answers) == 4 for q in multivalue.questions[:2])  # RULER's 4 values per key
    assert len({tuple(q.answers) for q in vt.questions}) == 3  # three chains, one asked each time
    assert data.score(" ".join(vt.questions[1].answers), type(vt)(**{**vars(vt), "answers": vt.questions[1].answers}))
    assert data.shared_problem(4) is None and set(SHARED_TASKS) >= set(data.tasks)
    with pytest.raises(ValueError, match=r"RULER tasks \['niah_single_1'\] hold one key"):
        RulerDataset(tasks=["niah_single_1"], context_lengths=[1024]).examples(tok, 1, 42, False, questions=2)


def test_stdlib_docs_asks_k_facts_of_k_files():
    from evaluation.datasets.stdlib_docs import StdlibDocsDataset, unique_problem  # noqa: F401

    tok = word_tokenizer()
    data = StdlibDocsDataset(tasks=["constant_value"], context_lengths=[2048], split="dev")
    (ex,) = data.examples(tok, 1, 42, False, questions=3)
    files = [q.metadata["file"] for q in ex.questions]
    assert len(set(files)) == 3 and ex.id == "constant_value-2048-k3-0"
    every = "".join(q.question for q in ex.questions)
    for q in ex.questions:
        answer = q.answers[0].lower()
        assert (ex.context + every).lower().count(answer) == 1 and answer not in every.lower()
        assert f"File {q.metadata['file']}" in ex.context
    assert ex.metadata["prompt_tokens"] <= 2048
    with pytest.raises(ValueError, match="do not fit the shortest context_length=2048"):
        data.examples(tok, 1, 42, False, questions=5)


# ----------------------------------------------------------------------------------------- settings, guards


def test_the_protocols_settings_and_directories(tmp_path):
    single = composed(f"output_dir={tmp_path}")
    shared = composed(f"output_dir={tmp_path}", "protocol=Shared")
    settings.normalise(single), settings.normalise(shared)
    assert (single.protocol, single.questions, single.shared_mode) == ("single", None, None)
    assert (shared.protocol, shared.questions, shared.shared_mode) == ("shared", 4, "request")
    names = {"press": "snapkv", "dataset": "needle", "model": "m"}
    turns = settings.normalise(
        composed(f"output_dir={tmp_path}", "protocol=shared", "shared_mode=turn", "query_aware=1")
    )
    assert [harness.run_dir(c, names).parts[-4] for c in (single, shared, turns)] == [
        "needle",
        "needle-shared",
        "needle-turns-qa",
    ]
    for override, message in [
        ("questions=3", r"questions=3 is read only with protocol=shared"),
        ("shared_mode=turn", r"shared_mode='turn' is read only with protocol=shared"),
        ("protocol=many", r"protocol='many' must be one of single, shared"),
    ]:
        with pytest.raises(ValueError, match=message):
            guards.check_setting_values(settings.normalise(composed(override)))
    for override, message in [("questions=0", r"questions=0 must be an integer >= 1"), ("shared_mode=x", "one of")]:
        with pytest.raises(ValueError, match=message):
            guards.check_setting_values(settings.normalise(composed("protocol=shared", override)))


def test_committed_runs_keep_their_identity():
    """Every committed run was saved before the protocol's keys existed: read as ``protocol=single`` with the other two
    unset, which is what today's configs give a run of one question per context, so its settings check finds no
    change in them (and every spelling of ``questions`` is one run)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "results"
    today = settings.run_settings(composed())
    checked = 0
    for config in sorted(root.rglob("config.yaml"))[::25]:
        saved = yaml.safe_load(config.read_text(encoding="utf-8"))
        if rows_file(config.parent) is None or "protocol" in saved:  # rows plain or compressed
            continue
        node = settings.normalise(saved)
        assert {k: node[k] for k in ("protocol", "questions", "shared_mode")} == {
            k: today[k] for k in ("protocol", "questions", "shared_mode")
        }
        changes = harness.config_changes(saved, composed())
        assert not [c for c in changes if c.split(":")[0] in ("protocol", "questions", "shared_mode")], config
        checked += 1
    assert checked > 10
    assert settings.normalise({"protocol": "shared", "questions": 4.0})["questions"] == 4


def test_a_context_whose_questions_do_not_fit_is_refused_before_any_model_work(tiny, tmp_path, monkeypatch):
    """Multi-turn keeps every question and answer in the cache: a context that fits one question at a time but not
    all of them in turn is refused in one line naming the lengths, before any forward or run directory."""
    model, _ = tiny
    monkeypatch.setattr(model.config, "max_position_embeddings", 520)
    calls = []
    monkeypatch.setattr(model.model, "forward", lambda *a, **k: calls.append(1))
    runs = _runs(["snapkv"], tmp_path, "shared_mode=turn", "dataset.context_length=320")
    with pytest.raises(
        ValueError,
        match=r"example needle-320-k4-0: context \d+ \+ questions \[.*\] \+ max_new_tokens 6 "
        r"each \(all in turn\) = \d+ positions, more than the model's max_position_embeddings=520",
    ):
        entry.run(*runs[0])
    assert not calls and not (tmp_path / "needle-turns").exists()
    with pytest.raises(ValueError, match=r"on dataset continuation_loss: it has one question per context"):
        entry.run(
            composed("dataset=continuation_loss", "protocol=shared", f"output_dir={tmp_path}"),
            {"press": "snapkv", "dataset": "continuation_loss", "model": "smollm2-135m"},
        )


# ------------------------------------------------------------------------------------------------------ report


def test_report_gives_the_score_per_position_and_the_cost_per_answer(tiny, tmp_path):
    """The report's per-position table matches the rows, and the cost per answer pays the context's prefill and
    compression once over k answers (k = 1 and K), over the uncompressed run's at the same k."""
    from evaluation import shared_report
    from evaluation.report import build_report, scan

    fused.run_fused(_runs(["no_press", "snapkv", "page_entrokv"], tmp_path / "runs"), "test")
    readme = build_report(tmp_path / "runs", tmp_path / "report", plots=False).read_text()
    assert "### Score per question position" in readme and "### Cost per answered question" in readme
    assert "cr 0.75, k = 4: on the frontier" in readme
    with open(tmp_path / "report/tables/needle-shared__smollm2-135m__by_question.csv", newline="") as f:
        positions = list(csv.DictReader(f))
    rows = list(_rows(tmp_path / "runs", "snapkv").values())
    for q in (1, 4):
        (cell,) = [r for r in positions if r["press"] == "snapkv" and int(r["question_index"]) == q]
        scores = [r["score"] for r in rows if r["question_index"] == q]
        assert float(cell["score"]) == pytest.approx(sum(scores) / len(scores)) and int(cell["n"]) == 2
    costs = shared_report.answer_cost_table(scan(tmp_path / "runs"))
    assert {(r["press"], r["k"]) for r in costs} == {(p, k) for p in ("snapkv", "page_entrokv") for k in (1, 4)}

    def per_answer(rows, k):
        out = []
        for example in {r["example_id"] for r in rows}:
            asked = [r for r in rows if r["example_id"] == example and r["question_index"] <= k]
            once = asked[0]["prefill_seconds"] + asked[0]["replay_seconds"]
            out.append((once + sum(r["decode_seconds"] for r in asked)) / k)
        return sum(out) / len(out)

    base = list(_rows(tmp_path / "runs", "no_press").values())
    for k in (1, 4):
        (cell,) = [r for r in costs if r["press"] == "snapkv" and r["k"] == k]
        assert cell["seconds_per_answer"] == pytest.approx(per_answer(rows, k))
        assert cell["cost_vs_uncompressed"] == pytest.approx(per_answer(rows, k) / per_answer(base, k))
        assert cell["score"] == pytest.approx(sum(r["score"] for r in rows if r["question_index"] <= k) / (2 * k))
    # the later questions against the first, context by context (issue 66's third goal), with its interval
    assert "### The later questions against the first" in readme
    with open(tmp_path / "report/tables/needle-shared__smollm2-135m__question_drop.csv", newline="") as f:
        (drop,) = [r for r in csv.DictReader(f) if r["press"] == "snapkv"]
    per_context = []
    for example in {r["example_id"] for r in rows}:
        asked = {r["question_index"]: r["score"] for r in rows if r["example_id"] == example}
        per_context.append(asked[1] - sum(asked[q] for q in (2, 3, 4)) / 3)
    mean = sum(per_context) / len(per_context)
    assert int(drop["contexts"]) == 2 and float(drop["drop"]) == pytest.approx(mean)
    assert float(drop["low"]) <= mean <= float(drop["high"])
