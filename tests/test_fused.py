"""The shared-prefill sweep (evaluation/fused.py) gives exactly what separate harness runs give.

Tiny random-weight Llama (GQA, sdpa) with a character tokenizer: the hook replay must rebuild each press's
compressed cache bit for bit (the SNIS presses: the same entries, to float32 round-off, since a direct prefill
computes their proposal inside its attention and the replay recomputes it), and ``run_fused`` must write the same
predictions and compression as
``evaluation.run.run`` press by press, resume per run, and reject presses that change the prefill.
"""

from __future__ import annotations

import gc
import json
import sys

import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from conftest import decode_biases, make_sharp_tiny_llama
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from test_harness import composed
from transformers import DynamicCache

from evaluation import fused, harness, loop, replay
from evaluation import run as entry
from evaluation.loop import seed_example
from evaluation.memo import ReplayMemo
from evaluation.registry import sharing
from presses import attention

pytestmark = pytest.mark.usefixtures("one_thread")

PRESSES = [
    "no_press",
    "snapkv",
    "tova",
    "streaming_llm",
    "knorm",
    "expected_attention",
    "page_entrokv",
    "page_entrokv_paper000",
    "page_entrokv_mean",
    "snis_min",
    "snis_h2o_h_uncorrected",
    "snis_min_h",
    # kvpress's other presses that compress in their forward hooks (issue 29)
    "chunkkv",
    "entropy_gated_chunkkv",
    "chunk",
    "block_keydiff",
    "keydiff",
    "compactor",
    "leverage",
    "non_causal_attn",
    "lagkv",
    "cur",
    "random",
    "capkv",
    "criticalkv",
    "merging",
    "think",
]
# end-to-end equality on a representative subset (a scorer press, Page-EntroKV, SNIS with its decode-time
# correction, ChunkKV, and two presses drawing from torch's generator, which the loop seeds per example and run);
# the cache-level test above covers every press
RUN_PRESSES = ["no_press", "snapkv", "page_entrokv", "snis_min", "chunkkv", "random", "compactor"]
SETTINGS = ["n_samples=2", "dataset.context_length=512", "dataset.max_new_tokens=6", "dataset.depths=[0,50]"]


def _tiny(monkeypatch, attn_implementation: str):
    model = make_sharp_tiny_llama(attn_implementation)
    tok = char_tokenizer()
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    return model, tok


@pytest.fixture
def tiny(monkeypatch):
    return _tiny(monkeypatch, "sdpa")


@pytest.fixture
def tiny_eager(monkeypatch):
    return _tiny(monkeypatch, "eager")


def _runs(presses, ratios, out, *extra):
    runs = []
    for press in presses:
        for ratio in [0.0] if press == "no_press" else ratios:
            cfg = composed(f"press={press}", f"compression_ratio={ratio}", f"output_dir={out}", *SETTINGS, *extra)
            runs.append((cfg, {"press": press, "dataset": "needle", "model": "smollm2-135m"}))
    return runs


def _rows(out, press, ratio, dataset="needle"):
    path = out / dataset / "smollm2-135m" / press / f"cr{0.0 if press == 'no_press' else ratio:g}" / "predictions.jsonl"
    return {r["id"]: r for r in harness.read_predictions(path)}


@pytest.mark.parametrize("press_name", PRESSES[1:])
def test_replay_rebuilds_the_compressed_cache_exactly(tiny, press_name):
    model, _ = tiny
    cfg = composed(f"press={press_name}", "compression_ratio=0.6")
    press = instantiate(cfg.press)
    ids = torch.randint(4, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        direct = DynamicCache()
        seed_example(42, "x")  # as the loop does before each run's prefill (Compactor, Random draw from torch)
        with press(model):
            model.model(input_ids=ids, past_key_values=direct)
        direct_bias = [b.clone() if b is not None else None for b in decode_biases(direct)]
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        torch.manual_seed(1)  # other draws in between (other presses' replays)
        torch.rand(100)
        seed_example(42, "x")
        replayed = replay.replay_prefill(model, press, capture)
    assert len(replayed) == len(direct) == 3
    # the SNIS presses compute their proposal inside the direct prefill's attention (presses.probabilistic.
    # prefill_attention) and recompute it in the replay: the same entries, equal to float32 round-off
    exact = direct_bias[0] is None

    def same(a, b):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    for i in range(3):
        keys = replayed.layers[i].keys
        # it did compress: fewer entries, or (ThinK) key channels zeroed in every entry
        assert keys.shape[2] < 400 or bool((keys == 0).all(dim=2).any())
        assert replayed.layers[i].keys.shape == direct.layers[i].keys.shape
        same(replayed.layers[i].keys, direct.layers[i].keys)
        same(replayed.layers[i].values, direct.layers[i].values)
        state = decode_biases(replayed)[i]
        if direct_bias[i] is None:
            assert state is None
        else:  # the SNIS correction left with the cache for decoding is the same too, kept slot for kept slot
            assert torch.equal(torch.isfinite(state), torch.isfinite(direct_bias[i]))
            same(state, direct_bias[i])


def test_shared_proposals_compute_once_and_change_nothing(tiny, monkeypatch):
    """Presses differing only in ratio and correction share one proposal per layer, bit for bit."""
    import presses.probabilistic.proposals as proposals

    model, _ = tiny
    calls = []
    real = proposals.head_proposals
    monkeypatch.setattr(proposals, "head_proposals", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    specs = [("snis_h2o_h", 0.5), ("snis_h2o_h_uncorrected", 0.75), ("snis_min", 0.5)]
    presses = [instantiate(composed(f"press={p}", f"compression_ratio={r}").press) for p, r in specs]
    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())

        def replay_all(memo=None):
            caches = []
            for press in presses:
                with sharing(press, memo):
                    cache = replay.replay_prefill(model, press, capture)
                biases = [b.clone() for b in decode_biases(cache)]
                caches.append(([layer.keys.clone() for layer in cache.layers], biases))
            return caches

        alone = replay_all()
        assert calls == ["h2o_h"] * 6 + ["min"] * 3  # 3 layers per press, nothing shared
        calls.clear()
        shared = replay_all(ReplayMemo())
        assert calls == ["h2o_h"] * 3 + ["min"] * 3  # h2o_h once per layer for its two presses
        calls.clear()
        replay_all(ReplayMemo())  # a new memo starts empty
        assert len(calls) == 6
    for (keys_a, bias_a), (keys_s, bias_s) in zip(alone, shared):
        assert all(torch.equal(a, b) for a, b in zip(keys_a, keys_s))
        assert all(torch.equal(a, b) for a, b in zip(bias_a, bias_s))
    corrected, uncorrected = alone[0][1][0], alone[1][1][0]  # layer 0's bias of the first two presses
    assert bool((uncorrected == 0).any()) and bool(((uncorrected == 0) | (uncorrected == float("-inf"))).all())
    assert bool((torch.isfinite(corrected) & (corrected != 0)).any())  # the shared proposal kept its own bias


def test_fused_predictions_equal_separate_runs_and_resume(tiny, tmp_path):
    ratios = [0.5, 0.75]
    for cfg, names in _runs(RUN_PRESSES, ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    runs = _runs(RUN_PRESSES, ratios, tmp_path / "fused")
    metrics = fused.run_fused(runs, "test")
    assert len(metrics) == len(runs) == 1 + 2 * (len(RUN_PRESSES) - 1)
    predictions = set()
    for press in RUN_PRESSES:
        for ratio in [0.0] if press == "no_press" else ratios:
            sep, fus = _rows(tmp_path / "separate", press, ratio), _rows(tmp_path / "fused", press, ratio)
            assert sorted(sep) == sorted(fus) and len(sep) == 2
            for i in sep:
                assert fus[i]["prediction"] == sep[i]["prediction"], (press, ratio, i)
                assert fus[i]["score"] == sep[i]["score"]
                assert fus[i]["effective_compression"] == pytest.approx(sep[i]["effective_compression"])
                assert fus[i]["press_stats"] == sep[i]["press_stats"]
                assert fus[i]["shared_prefill"] and 0 < fus[i]["prefill_seconds"] <= fus[i]["seconds"]
                predictions.add(fus[i]["prediction"])
                if press != "no_press":
                    assert fus[i]["effective_compression"] > 0.4
    assert len(predictions) > 3  # compression changes what the model says: the comparison is not trivial
    metrics_sep = json.loads((tmp_path / "separate/needle/smollm2-135m/snapkv/cr0.5/metrics.json").read_text())
    metrics_fus = json.loads((tmp_path / "fused/needle/smollm2-135m/snapkv/cr0.5/metrics.json").read_text())
    assert metrics_fus["score"] == metrics_sep["score"] and metrics_fus["n"] == 2
    assert metrics_fus["command"] == "test"

    # resume: one run loses its metrics and its last row; only that row is redone
    out = tmp_path / "fused/needle/smollm2-135m/page_entrokv/cr0.75"
    rows = harness.read_predictions(out / "predictions.jsonl")
    (out / "metrics.json").unlink()
    harness.write_atomic(out / "predictions.jsonl", json.dumps(rows[0]) + "\n")
    before = (tmp_path / "fused/needle/smollm2-135m/snapkv/cr0.5/predictions.jsonl").read_text()
    fused.run_fused(runs, "test resumed")
    # every command that wrote rows of the unfinished run is logged; finished runs are not touched again
    assert (out / harness.COMMANDS_NAME).read_text().splitlines() == ["test", "test resumed"]
    snap = tmp_path / "fused/needle/smollm2-135m/snapkv/cr0.5"
    assert (snap / harness.COMMANDS_NAME).read_text().splitlines() == ["test"]
    again = harness.read_predictions(out / "predictions.jsonl")
    assert [r["id"] for r in again] == [r["id"] for r in rows]
    assert again[1]["prediction"] == rows[1]["prediction"]
    assert (tmp_path / "fused/needle/smollm2-135m/snapkv/cr0.5/predictions.jsonl").read_text() == before
    assert (out / "metrics.json").exists()


def test_fused_query_aware_equals_separate_runs_and_lives_apart(tiny, tmp_path):
    """The question inside the compressed context (issue 14): the shared-prefill sweep still equals separate
    runs, and its run directories (``needle-qa``) never mix with the question-after protocol's."""
    for cfg, names in _runs(RUN_PRESSES, [0.75], tmp_path / "separate", "query_aware=true"):
        entry.run(cfg, names)
    fused.run_fused(_runs(RUN_PRESSES, [0.75], tmp_path / "fused", "query_aware=true"), "test")
    fused.run_fused(_runs(["snapkv"], [0.75], tmp_path / "fused"), "test")  # the other protocol, same output_dir
    predictions = set()
    for press in RUN_PRESSES:
        ratio = 0.0 if press == "no_press" else 0.75
        sep, fus = (
            _rows(tmp_path / "separate", press, ratio, "needle-qa"),
            _rows(tmp_path / "fused", press, ratio, "needle-qa"),
        )
        assert sorted(sep) == sorted(fus) and len(sep) == 2
        for i in sep:
            assert fus[i]["prediction"] == sep[i]["prediction"], (press, i)
            assert fus[i]["press_stats"] == sep[i]["press_stats"]
            predictions.add(fus[i]["prediction"])
    assert len(predictions) > 2
    qa = _rows(tmp_path / "fused", "snapkv", 0.75, "needle-qa")
    after = _rows(tmp_path / "fused", "snapkv", 0.75)
    assert sorted(qa) == sorted(after) and all(qa[i]["context_length"] > after[i]["context_length"] for i in qa)
    config = (tmp_path / "fused/needle-qa/smollm2-135m/snapkv/cr0.75/config.yaml").read_text()
    assert "query_aware: true" in config


@pytest.mark.parametrize(
    "press_name, why",
    [
        ("entroprefill", "changes the prefill"),
        ("pyramidkv", "different number of entries per layer"),
        ("critical_adakv", "masks evicted keys per head"),
        ("key_rerotation", "re-rotates the kept keys"),
    ],
)
def test_presses_that_cannot_share_a_prefill_are_rejected_with_the_reason(tiny, tmp_path, press_name, why):
    runs = _runs(["snapkv", press_name], [0.5], tmp_path)
    with pytest.raises(ValueError, match=f"{press_name}.*cannot share a prefill.*{why}.*python -m evaluation.run"):
        fused.run_fused(runs, "test")
    assert not (tmp_path / "needle").exists()


def test_runs_must_share_model_and_dataset_settings(tiny, tmp_path):
    a = composed("press=snapkv", f"output_dir={tmp_path}", "n_samples=2")
    b = composed("press=knorm", f"output_dir={tmp_path}", "n_samples=3")
    names = {"dataset": "needle", "model": "smollm2-135m"}
    with pytest.raises(ValueError, match="must share n_samples"):
        fused.run_fused([(a, {**names, "press": "snapkv"}), (b, {**names, "press": "knorm"})], "test")


def test_command_line_entry_point(tiny, tmp_path, monkeypatch):
    """``python -m evaluation.fused presses=[...] ratios=[...]`` composes one harness config per run."""
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "evaluation.fused",
            "presses=[no_press,snapkv,page_entrokv]",
            "ratios=[0.5]",
            f"output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/.hydra",
            *SETTINGS,
        ],
    )
    GlobalHydra.instance().clear()
    try:
        fused.main()
    finally:
        GlobalHydra.instance().clear()
    done = sorted(
        p.parent.parent.name + "/" + p.parent.name
        for p in (tmp_path / "needle" / "smollm2-135m").glob("*/*/metrics.json")
    )
    assert done == ["no_press/cr0", "page_entrokv/cr0.5", "snapkv/cr0.5"]
    metrics = json.loads((tmp_path / "needle/smollm2-135m/snapkv/cr0.5/metrics.json").read_text())
    assert metrics["command"].startswith("python -m evaluation.fused presses=[no_press,snapkv,page_entrokv]")
    config = (tmp_path / "needle/smollm2-135m/snapkv/cr0.5/config.yaml").read_text()
    assert "kvpress.SnapKVPress" in config and "context_length: 512" in config


def test_batched_decode_equals_one_by_one(tiny):
    """generate_answers on a batch of equal-length caches gives each cache's own greedy answer, leaves the
    caches holding only the context, and refuses caches of different lengths."""
    from kvpress import KVPressTextGenerationPipeline

    model, tok = tiny
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    question = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        presses = [
            instantiate(composed(f"press={p}", "compression_ratio=0.5").press)
            for p in ("snapkv", "knorm", "tova", "streaming_llm", "expected_attention")
        ]
        alone = []
        for press in presses:
            cache = replay.replay_prefill(model, press, capture)
            alone.append(replay.generate_answers(pipe, question, [cache], 300, 8)[0])
            assert cache.get_seq_length(0) == 150  # the answer was removed again
        caches = [replay.replay_prefill(model, press, capture) for press in presses]
        batched = replay.generate_answers(pipe, question, caches, 300, 8)
        assert all(c.get_seq_length(0) == 150 for c in caches)
        with pytest.raises(ValueError, match="equal per-layer cache lengths"):
            replay.generate_answers(pipe, question, [caches[0], replay.replay_prefill(model, None, capture)], 300, 8)
    assert batched == alone and len(set(alone)) > 1


def test_snis_runs_of_equal_lengths_decode_as_one_batch(tiny, tmp_path):
    """Corrected and uncorrected SNIS at one ratio keep the same entries: they decode as one batch, each row
    with its own correction, and write what separate harness runs write."""
    presses = ["snis_h2o_h", "snis_h2o_h_uncorrected"]
    for cfg, names in _runs(presses, [0.6], tmp_path / "separate"):
        entry.run(cfg, names)
    fused.run_fused(_runs(presses, [0.6], tmp_path / "fused"), "test")
    answers = {}
    for press in presses:
        sep, fus = _rows(tmp_path / "separate", press, 0.6), _rows(tmp_path / "fused", press, 0.6)
        assert sorted(sep) == sorted(fus) and len(sep) == 2
        for i in sep:
            assert fus[i]["decode_batch"] == 2
            assert fus[i]["prediction"] == sep[i]["prediction"], (press, i)
            assert fus[i]["press_stats"] == sep[i]["press_stats"]
            answers[press, i] = fus[i]["prediction"]
    # the rows differ somewhere, so a batch that applied one row's correction to both would be caught
    assert any(answers["snis_h2o_h", i] != answers["snis_h2o_h_uncorrected", i] for i in sep)


def test_install_snis_states_refuses_mismatched_runs():
    from presses.attention_bias import AttentionBias

    cache = DynamicCache()
    for i in range(3):  # three layers of two rows (the two runs), five entries each
        cache.update(torch.zeros(2, 2, 5, 4), torch.zeros(2, 2, 5, 4), i)
    a = tuple(AttentionBias(torch.zeros(1, 2, 5)) for _ in range(3))
    b = tuple(AttentionBias(torch.zeros(1, 2, 6)) for _ in range(3))
    with pytest.raises(ValueError, match="equal padded length"):
        attention.put_decode_state(cache, [a, b])
    with pytest.raises(ValueError, match="equal padded length"):
        attention.put_decode_state(cache, [a, (None, None, None)])
    attention.put_decode_state(cache, [a, a])
    assert attention.decode_state(cache)[0].bias.shape == (2, 2, 5)
    taken = attention.take_decode_state(cache, 3)
    assert taken[0].bias.shape == (2, 2, 5) and attention.decode_state(cache) == (None, None, None)


def test_batched_decode_never_stops_at_the_first_token(tiny):
    """Like ``generate_answer``, the batched decode does not treat the first generated token as a stop,
    even when it is the EOS token, and stops at a later one."""
    from kvpress import KVPressTextGenerationPipeline

    model, tok = tiny
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    question = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    # two rows whose first token is EOS: a batch that counted it as a stop would end after one token
    presses = [instantiate(composed(f"press={p}", "compression_ratio=0.5").press) for p in ("snapkv", "snapkv")]
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        cache = replay.replay_prefill(model, presses[0], capture)
        # make the first token this cache generates the EOS token
        first = (
            model(input_ids=question, past_key_values=cache, position_ids=torch.arange(300, 312).unsqueeze(0))
            .logits[0, -1]
            .argmax()
            .item()
        )
        model.generation_config.eos_token_id = first
        try:
            alone = [
                replay.generate_answers(pipe, question, [replay.replay_prefill(model, p, capture)], 300, 8)[0]
                for p in presses
            ]
            batched = replay.generate_answers(
                pipe, question, [replay.replay_prefill(model, p, capture) for p in presses], 300, 8
            )
        finally:
            model.generation_config.eos_token_id = eos
    assert batched == alone
    assert len(alone[0]) > 1  # the snapkv row went on past its first token, the EOS


def test_rows_that_stop_leave_the_batch_and_the_others_decode_as_alone(tiny):
    """A row that reaches its stop token leaves the batch (cache rows and SNIS bias rows dropped); the rows
    still decoding, padded and corrected, give what each gives alone, to their own stop or to the limit."""
    from kvpress import KVPressTextGenerationPipeline

    from evaluation.registry import export_decode_state

    model, tok = tiny
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    question = torch.randint(4, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    presses = [
        instantiate(composed(f"press={p}", "compression_ratio=0.5").press)
        for p in ("snis_min", "snapkv", "page_entrokv", "snis_h2o_h", "tova")
    ]
    eos = model.generation_config.eos_token_id

    def replayed():
        caches, states = [], []
        for press in presses:
            caches.append(replay.replay_prefill(model, press, capture))
            states.append(export_decode_state(press, caches[-1]))
        return replay.pad_to_common_lengths(caches, states)

    def decode(rows, max_new):
        caches, states = replayed()
        out = []
        for group in rows:
            group_caches, group_states = [caches[k] for k in group], [states[k] for k in group]
            out += replay.generate_answers(pipe, question, group_caches, 300, max_new, group_states)
        return out

    with torch.inference_mode():
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        model.generation_config.eos_token_id = 0  # never generated (the tokenizer's pad id): full-length rows
        try:
            free = decode([[k] for k in range(len(presses))], 12)
            # the stop token: a character one row generates early and another row does not generate at all
            stop = next(c for c in free[0][1:6] if c not in free[1])
            model.generation_config.eos_token_id = tok.convert_tokens_to_ids(stop)
            alone = decode([[k] for k in range(len(presses))], 12)
            batched = decode([list(range(len(presses)))], 12)
        finally:
            model.generation_config.eos_token_id = eos
    assert batched == alone
    stopped = [a != f for a, f in zip(alone, free)]  # a row that never met the stop token ran to the limit
    assert any(stopped) and not all(stopped)


def test_pad_to_common_lengths_masks_only_the_padding(tiny):
    """Caches of different per-layer lengths are padded at their end to the longest; the padded slots get a
    -inf bias, real slots keep the run's SNIS bias (or 0); equal lengths come back untouched."""
    from presses.attention_bias import AttentionBias

    def cache(lengths):
        c = DynamicCache()
        for i, n in enumerate(lengths):
            c.update(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), i)
        return c

    a, b = cache([5, 7]), cache([6, 7])
    snis = (AttentionBias(torch.randn(1, 2, 5)), None)
    caches, states = replay.pad_to_common_lengths([a, b], [snis, (None, None)])
    assert [c.get_seq_length(0) for c in caches] == [6, 6] and [c.get_seq_length(1) for c in caches] == [7, 7]
    assert a.get_seq_length(0) == 5  # the run's own cache is not modified
    assert torch.equal(caches[0].layers[0].keys[:, :, :5], a.layers[0].keys)
    assert torch.equal(states[0][0].bias[..., :5], snis[0].bias) and torch.isneginf(states[0][0].bias[..., 5]).all()
    assert torch.equal(states[1][0].bias, torch.zeros(1, 2, 6))  # b's layer 0 is the longest: nothing masked
    assert states[0][1] is None and states[1][1] is None  # layer 1: equal lengths, no SNIS state
    same = [cache([4, 4]), cache([4, 4])]
    assert replay.pad_to_common_lengths(same, [(None, None)] * 2)[0] is same
    with pytest.raises(ValueError, match="covers 4 slots but the cache holds 5"):
        replay.pad_to_common_lengths([a, b], [(AttentionBias(torch.zeros(1, 2, 4)), None), (None, None)])


def test_one_ratio_decodes_as_one_padded_batch(tiny, tmp_path):
    """pad_decode: every run of one ratio (kvpress, Page-EntroKV with its page-rounded lengths, SNIS with its
    per-layer lengths and correction) decodes in one batch and writes what separate harness runs write."""
    presses = ["snapkv", "page_entrokv", "snis_min", "snis_h2o_h_uncorrected"]
    for cfg, names in _runs(presses, [0.6], tmp_path / "separate"):
        entry.run(cfg, names)
    fused.run_fused(_runs(presses, [0.6], tmp_path / "fused"), "test", pad_decode=True)
    lengths = set()
    for press in presses:
        sep, fus = _rows(tmp_path / "separate", press, 0.6), _rows(tmp_path / "fused", press, 0.6)
        assert sorted(sep) == sorted(fus) and len(sep) == 2
        for i in sep:
            assert fus[i]["decode_batch"] == len(presses)
            assert fus[i]["prediction"] == sep[i]["prediction"], (press, i)
            assert fus[i]["effective_compression"] == sep[i]["effective_compression"]
            lengths.add(round(fus[i]["physical_compression"], 6))
    assert len(lengths) > 2  # the batch really mixed cache lengths


def test_only_the_runs_of_one_decode_batch_hold_a_cache(tiny, tmp_path, monkeypatch, replayed_caches):
    """The runs are replayed batch by batch (one ratio's runs with pad_decode, the default): when a batch decodes,
    no cache of an earlier batch is alive, so an example's memory grows with one ratio's runs, not with the
    sweep's; the predictions stay those of separate runs (above)."""
    decode, seen = loop._decode_group, []

    def counted(group, *args):
        gc.collect()
        seen.append((len(group), len(replayed_caches)))
        return decode(group, *args)

    monkeypatch.setattr(loop, "_decode_group", counted)
    presses, ratios = ["snapkv", "page_entrokv", "snis_min"], [0.25, 0.5, 0.75]
    fused.run_fused(_runs(["no_press", *presses], ratios, tmp_path), "test")
    # per example: no_press alone (ratio 0), then each ratio's three runs as one batch
    assert seen == [(1, 1), (3, 3), (3, 3), (3, 3)] * 2
    for press in presses:  # every run wrote its two rows
        assert all(len(_rows(tmp_path, press, ratio)) == 2 for ratio in ratios)


def test_round_robin_by_task_interleaves_and_keeps_every_example():
    from types import SimpleNamespace

    exs = [SimpleNamespace(task=t, id=f"{t}{i}") for t, n in (("a", 3), ("b", 1), ("c", 2)) for i in range(n)]
    order = [e.id for e in replay.round_robin_by_task(exs)]
    assert order == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert replay.round_robin_by_task([]) == []


def test_shared_observers_compute_once_and_change_nothing(tiny, monkeypatch):
    """Page-EntroKV at two ratios and two protections shares one observer attention per layer, bit for bit."""
    from presses import PageEntroKVPress

    model, _ = tiny
    calls = []
    real = PageEntroKVPress._compute_observers
    monkeypatch.setattr(
        PageEntroKVPress, "_compute_observers", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    presses = [
        PageEntroKVPress(
            compression_ratio=r, window_size=32, page_size=8, protect=p, observer_window="all", observer_block=64
        )
        for r in (0.5, 0.75)
        for p in ("sink_window", "none")
    ]
    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        alone = [[layer.keys.clone() for layer in replay.replay_prefill(model, p, capture).layers] for p in presses]
        assert len(calls) == 3 * len(presses)
        calls.clear()
        memo = ReplayMemo()
        shared = []
        for p in presses:
            with sharing(p, memo):
                shared.append([layer.keys.clone() for layer in replay.replay_prefill(model, p, capture).layers])
        assert len(calls) == 3  # once per layer
    assert len({tuple(k[0].shape) for k in alone}) > 1  # the presses keep different entries
    for a, b in zip(alone, shared):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_h2o_replays_exactly_from_an_eager_capture(tiny_eager, tiny):
    """H2O (ObservedAttentionPress) reads the attention weights its hook receives: a prefill captured on eager
    attention holds them, so the replay rebuilds its cache bit for bit; a capture without them (sdpa) is refused."""
    press = instantiate(composed("press=observed_attention", "compression_ratio=0.6").press)
    ids = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        with replay.PrefillCapture(tiny[0]) as sdpa_capture:
            tiny[0].model(input_ids=ids, past_key_values=DynamicCache())
        with pytest.raises(ValueError, match="eager"):
            replay.replay_prefill(tiny[0], press, sdpa_capture)
        model = tiny_eager[0]
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        direct = DynamicCache()
        with press(model):
            model.model(input_ids=ids, past_key_values=direct)
        replayed = replay.replay_prefill(model, press, capture)
    for i in range(3):
        assert replayed.layers[i].keys.shape[2] == 120  # it did compress: 300 x (1 - 0.6)
        assert torch.equal(replayed.layers[i].keys, direct.layers[i].keys)
        assert torch.equal(replayed.layers[i].values, direct.layers[i].values)


def test_fused_h2o_equals_separate_runs(tiny_eager, tmp_path, monkeypatch):
    """The sweep runs H2O from one eager prefill per example with the predictions of separate pipeline runs, and
    refuses an example whose captured attention weights would exceed the memory limit."""
    ratios = [0.5, 0.75]
    for cfg, names in _runs(["observed_attention"], ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    fused.run_fused(_runs(["observed_attention", "snapkv"], ratios, tmp_path / "fused"), "test")
    predictions = set()
    for ratio in ratios:
        sep, fus = (
            _rows(tmp_path / "separate", "observed_attention", ratio),
            _rows(tmp_path / "fused", "observed_attention", ratio),
        )
        assert sorted(sep) == sorted(fus) and len(sep) == 2
        for i in sep:
            assert fus[i]["prediction"] == sep[i]["prediction"], (ratio, i)
            assert fus[i]["effective_compression"] == pytest.approx(sep[i]["effective_compression"])
            assert fus[i]["shared_prefill"] and fus[i]["effective_compression"] > 0.4
            predictions.add(fus[i]["prediction"])
    assert len(predictions) > 1
    monkeypatch.setattr(replay, "MAX_EAGER_CAPTURE_BYTES", 1000)
    with pytest.raises(ValueError, match="GiB of attention weights, above the limit"):
        fused.run_fused(_runs(["observed_attention"], [0.6], tmp_path / "limit"), "test")
    assert not (tmp_path / "limit").exists()  # refused before any run directory


def test_grow_adds_only_the_missing_examples_and_equals_a_fresh_run(tiny, tmp_path):
    """``grow=true`` takes finished runs from one example per task to two: the first rows stay byte for byte, only
    the new examples run, and the grown runs hold what a fresh run of two gives (issue 31's cells of 50 -> 100)."""

    def runs(out, n, *extra, lengths="[700]"):
        ruler = ["dataset=ruler_smoke", f"dataset.context_lengths={lengths}", "dataset.tasks=[niah_single_1]"]
        return [
            (
                composed(f"press={p}", f"compression_ratio={r}", f"output_dir={out}", f"n_samples={n}", *ruler, *extra),
                {"press": p, "dataset": "ruler_smoke", "model": "smollm2-135m"},
            )
            for p, r in (("no_press", 0.0), ("snapkv", 0.5), ("page_entrokv", 0.5))
        ]

    fused.run_fused(runs(tmp_path / "grown", 1), "small")
    run = tmp_path / "grown/ruler_smoke/smollm2-135m/page_entrokv/cr0.5"
    first = (run / "predictions.jsonl").read_text()
    with pytest.raises(ValueError, match="grow=true"):
        fused.run_fused(runs(tmp_path / "grown", 2), "refused")
    metrics = fused.run_fused(runs(tmp_path / "grown", 2, "grow=true"), "grown")
    fused.run_fused(runs(tmp_path / "fresh", 2), "fresh")
    assert [m["n"] for m in metrics] == [2, 2, 2]
    assert (run / "predictions.jsonl").read_text().startswith(first)
    assert (run / harness.COMMANDS_NAME).read_text().splitlines() == ["small", "grown"]
    for press, ratio in (("no_press", 0.0), ("snapkv", 0.5), ("page_entrokv", 0.5)):
        grown = _rows(tmp_path / "grown", press, ratio, "ruler_smoke")
        fresh = _rows(tmp_path / "fresh", press, ratio, "ruler_smoke")
        assert sorted(grown) == sorted(fresh) and len(grown) == 2
        assert all(grown[i]["prediction"] == fresh[i]["prediction"] for i in grown), press
    assert fused.run_fused(runs(tmp_path / "grown", 2, "grow=true"), "again") == metrics  # finished: nothing to do
    # another length: the 700-token rows stay, the 800-token ones run and equal a fresh run of both lengths
    grown_rows = (run / "predictions.jsonl").read_text()
    longer = fused.run_fused(runs(tmp_path / "grown", 2, "grow=true", lengths="[700,800]"), "longer")
    fused.run_fused(runs(tmp_path / "fresh2", 2, lengths="[700,800]"), "fresh")
    assert [m["n"] for m in longer] == [4, 4, 4]
    assert (run / "predictions.jsonl").read_text().startswith(grown_rows)
    for press, ratio in (("no_press", 0.0), ("snapkv", 0.5), ("page_entrokv", 0.5)):
        grown = _rows(tmp_path / "grown", press, ratio, "ruler_smoke")
        fresh = _rows(tmp_path / "fresh2", press, ratio, "ruler_smoke")
        assert sorted(grown) == sorted(fresh) and len(grown) == 4
        assert all(grown[i]["prediction"] == fresh[i]["prediction"] for i in grown), press
