"""Q-filters and expected attention's query statistics made by the project from the model's own queries
(evaluation/train_scorers/queries.py, qfilter.py, ea_stats.py, query_fit.py) and attached to kvpress's QFilterPress
and ExpectedAttentionStatsPress (evaluation/registry.py attach_scorers, evaluation/scorers.py): the queries are
those the attention computes (before RoPE: kvpress's own collection; after: the eager attention weights), the
statistics are kvpress's formulas and the SVD's direction with its sign, the commands are deterministic in the seed
and save what kvpress loads, the presses run offline through the harness, and a missing or mismatched file is
refused in one line. Tiny random Llama and tiny documents (mechanics only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from kvpress import AdaKVPress, ExpectedAttentionStatsPress, QFilterPress
from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats, patch_rotary_embedding
from kvpress.presses.qfilter_press import QFilters
from test_harness import composed
from test_train_scorers import _docs, _tiny
from transformers import DynamicCache

from evaluation import guards, harness, registry, scorers
from evaluation import run as entry
from evaluation.pipeline import TextGenerationPipeline
from evaluation.train_scorers import cli, corpus, queries, query_fit, targets
from evaluation.train_scorers.qfilter import filters

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """The tiny model as every loader returns it, five training and two held-out tiny documents, the scorers under
    ``tmp_path / "scorers"``."""
    model, tok = _tiny(tmp_path / "checkpoint")
    monkeypatch.setattr("evaluation.models.load_model", lambda *a, **k: (model, tok))
    monkeypatch.setattr(harness, "get_model", lambda *a, **k: (model, tok))
    monkeypatch.setattr(corpus, "split", lambda seed: (_docs(5, seed), _docs(2, seed + 100)))
    monkeypatch.setattr(scorers, "SCORERS", tmp_path / "scorers")
    return model, tok


def _make(tmp_path: Path, command: str, name: str, *extra: str) -> Path:
    out = tmp_path / name
    argv = [command, "--model", "tiny", "--train-tokens", "600", "--growth", "200", "--heldout-docs", "2"]
    argv += ["--work-root", str(tmp_path / "work"), "--kvzip-root", str(tmp_path / "kvzip"), "--out", str(out)]
    assert cli.main([*argv, *extra]) == 0
    return out / "checkpoint"


def test_queries_are_the_attentions_own():
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, hidden=64, attn_implementation="eager")
    ids = torch.randint(4, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), patch_rotary_embedding(model) as before_rope:  # kvpress's own collection
        eager = model(ids, output_attentions=True).attentions
    capture = queries.prefill(model, ids)
    mine = queries.document_queries(capture, model, start=3)
    for layer, (pre, post) in enumerate(mine):
        torch.testing.assert_close(pre, before_rope[layer][0, :, 3:], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(pre, post)  # rotated
    start, mid = 5, 22  # the attention keys 5..21 receive from queries 22..39, summed over the group's heads
    received = query_fit.received_attention(model, capture, start, mid)
    for layer, weights in enumerate(eager):
        expected = weights[0, :, mid:, start:mid].sum(1).view(2, 2, -1).sum(1)  # (G, keys)
        np.testing.assert_allclose(received[layer], expected.numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="need 0 <= start < mid < T=40"):
        query_fit.received_attention(model, capture, 5, 40)


def test_statistics_are_kvpress_formulas_and_the_filter_is_the_signed_principal_direction():
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, hidden=64, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    docs = [
        queries.document_queries(queries.prefill(model, torch.randint(4, 128, (1, n), generator=gen)), model, 4)
        for n in (30, 50)
    ]
    moments = queries.QueryMoments.zeros(2, 4, 16)
    for d in docs:
        moments.add(d)
    assert moments.docs == 2 and moments.tokens == 26 + 46
    q_filters = filters(moments, kv_heads=2)
    for layer in range(2):
        pre = torch.cat([d[layer][0] for d in docs], dim=1).double()  # (H, N, d), as collect_queries concatenates
        mean = pre.mean(1)
        centred = pre - mean[:, None]
        np.testing.assert_allclose(moments.mean()[layer], mean.numpy(), rtol=1e-9, atol=1e-12)
        cov = centred.transpose(1, 2) @ centred / (pre.shape[1] - 1)
        np.testing.assert_allclose(moments.covariance()[layer], cov.numpy(), rtol=1e-9, atol=1e-12)
        post = torch.cat([d[layer][1] for d in docs], dim=1).double()
        for g in range(2):
            stacked = post[2 * g : 2 * g + 2].reshape(-1, 16)  # the group's queries, heads stacked
            v = torch.linalg.svd(stacked, full_matrices=False).Vh[0].numpy()
            f = q_filters[layer, g]
            assert abs(abs(f @ v) - 1) < 1e-8  # the first right singular vector, up to its sign
            assert (stacked.sum(0).numpy() @ -f) > 0  # the queries project positively on the negated filter


def test_the_filter_keeps_the_keys_the_queries_attend_to():
    """The sign, on queries with a known dominant direction: kvpress keeps the keys of the highest
    ``-(filter . key)``; these must be the keys that the queries pay the most attention."""
    rng = np.random.default_rng(0)
    direction = rng.normal(size=8)
    direction /= np.linalg.norm(direction)
    q = torch.from_numpy(3 * direction + 0.3 * rng.normal(size=(500, 8)))
    moments = queries.QueryMoments.zeros(1, 1, 8)
    moments.add([(q[None], q[None])])
    q_filters = torch.from_numpy(filters(moments, kv_heads=1)).float()
    keys = torch.from_numpy(rng.normal(size=(1, 1, 64, 8))).float()
    press = QFilterPress()
    press.q_filters = q_filters
    score = press.score(type("Module", (), {"layer_idx": 0})(), None, keys, None, None, {})[0, 0]
    attention = torch.softmax(q.float() @ keys[0, 0].T, dim=-1).sum(0)  # what the 500 queries pay each key
    top = set(score.topk(16).indices.tolist())
    assert len(top & set(attention.topk(16).indices.tolist())) >= 12
    assert not top & set(attention.topk(16, largest=False).indices.tolist())


def test_the_commands_are_deterministic_and_save_what_kvpress_loads(tiny, tmp_path):
    model, tok = tiny
    held = _docs(2, 100)[0]
    T = queries.context_ids(TextGenerationPipeline(model=model, tokenizer=tok, device=model.device), held.text).shape[1]
    kvzip = tmp_path / "kvzip" / "tiny" / "kvzap-0"  # KVzip+ scores the kvzap command would have stored
    (kvzip / "heldout").mkdir(parents=True)
    config = targets.KVZIP_PLUS_CONFIG.read_text()
    (kvzip / "settings.json").write_text(
        json.dumps({"seed": 0, "corpus_sha256": corpus.corpus_sha256(), "kvzip_plus_config": config})
    )
    scores = np.random.default_rng(0).random((2, 2, T - 10)).astype(np.float32)
    np.savez(kvzip / "heldout" / f"{held.id}.npz", scores=scores, start=10, end=T)

    first = _make(tmp_path, "qfilter", "a")
    again = _make(tmp_path, "qfilter", "b", "--work-root", str(tmp_path / "work2"))  # the queries again
    other = _make(tmp_path, "qfilter", "c", "--seed", "1", "--no-report")
    saved = (first / "qfilters" / "model.safetensors").read_bytes()
    assert (
        saved
        == (again / "qfilters" / "model.safetensors").read_bytes()
        != (other / "qfilters" / "model.safetensors").read_bytes()
    )
    loaded = QFilters.from_pretrained(first / "qfilters").q_filters
    assert loaded.shape == (2, 2, 16) and torch.allclose(loaded.norm(dim=-1), torch.ones(2, 2))
    record = json.loads((first / "qfilters" / "training.json").read_text())
    assert (
        record["base_model"] == "checkpoint" and record["train_docs"] >= 2 and "--train-tokens 600" in record["command"]
    )
    fit = (first / "qfilter_fit.csv").read_text().splitlines()
    assert len(fit) == 1 + 3 * 2 * 2  # 3 scorers x 2 layers x (attention: 2 documents, KVzip+: 1)
    assert sum(",kvzip,1," in row for row in fit) == 3 * 2
    assert "KVzip+" in (first / "qfilter_fit.md").read_text() and str(kvzip) in (first / "qfilter_fit.md").read_text()

    stats_dir = _make(tmp_path, "ea_stats", "a") / "ea_stats"
    stats = ExpectedAttentionStats.from_pretrained(stats_dir)
    assert stats.query_mean.shape == (2, 4, 16) and stats.query_cov.shape == (2, 4, 16, 16)
    assert stats.model_name == "checkpoint"
    torch.testing.assert_close(stats.query_cov, stats.query_cov.transpose(-1, -2))
    assert (torch.linalg.eigvalsh(stats.query_cov.double()) > -1e-6).all()  # covariances
    again = ExpectedAttentionStats.from_pretrained(_make(tmp_path, "ea_stats", "b", "--no-report") / "ea_stats")
    assert torch.equal(stats.query_cov, again.query_cov)
    rows = (stats_dir.parent / "ea_stats_fit.csv").read_text().splitlines()
    assert any(r.startswith("expected_attention (the document's own queries),kvzip") for r in rows)


def test_the_presses_run_offline_through_the_harness_and_wrappers(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    _make(tmp_path, "qfilter", "scorers", "--no-report")
    _make(tmp_path, "ea_stats", "scorers", "--no-report")
    loads = []
    for cls in (QFilters, ExpectedAttentionStats):
        real = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda c, p, _r=real, **k: loads.append(p) or _r(c, p)))
    hub = []
    monkeypatch.setattr(QFilterPress, "load_q_filters", staticmethod(lambda name: hub.append(name)))
    for name in ("qfilter", "expected_attention_stats"):
        cfg = composed(f"press={name}", "compression_ratio=0.5", f"output_dir={tmp_path / 'runs'}", "n_samples=2")
        cfg.dataset.context_length, cfg.dataset.max_new_tokens = 256, 4
        metrics = entry.run(cfg, {"press": name, "dataset": "needle", "model": "smollm2-135m"})
        assert metrics["n"] == 2
    assert not hub and loads and all(Path(p).parent.parent == tmp_path / "scorers" for p in loads)
    saved = QFilters.from_pretrained(tmp_path / "scorers" / "checkpoint" / "qfilters").q_filters.data
    stats = ExpectedAttentionStats.from_pretrained(tmp_path / "scorers" / "checkpoint" / "ea_stats")
    ids = torch.tensor([[ord(c) for c in "keys and values of every token " * 6]])
    for press in (QFilterPress(0.5), AdaKVPress(QFilterPress(0.5)), ExpectedAttentionStatsPress(0.5)):
        (inner,) = registry.attach_scorers(press, model)
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        if isinstance(inner, QFilterPress):
            assert torch.equal(inner.q_filters, saved)
        else:
            assert torch.equal(inner.mu, stats.query_mean.data) and torch.equal(inner.cov, stats.query_cov.data)
    assert not hub
    own = ExpectedAttentionStatsPress(0.5, stats_folder=str(tmp_path / "elsewhere"))
    assert registry.attach_scorers(own, model) == []  # a folder of the user's own: kvpress reads it


def test_missing_or_mismatched_statistics_are_refused_in_one_line(tiny, tmp_path):
    model, _ = tiny
    for press, file, command in (
        (QFilterPress(0.5), "qfilters/config.json", "qfilter"),
        (ExpectedAttentionStatsPress(0.5), "ea_stats/config.json", "ea_stats"),
    ):
        with pytest.raises(OSError) as err:
            guards.check_press_downloads(press, model)  # offline (the tests' hub)
        line = str(err.value)
        assert "\n" not in line and f"{file} is missing" in line and "checkpoint" in line
        assert f"python -m evaluation.train_scorers {command} --model {tmp_path / 'checkpoint'}" in line
        assert "nor can kvpress load its own" in line
        _make(tmp_path, command, "scorers", "--no-report")
        guards.check_press_downloads(press, model)  # the right one
    bigger, _ = _tiny(tmp_path / "other" / "checkpoint", layers=3, hidden=32)  # same name, another shape
    problem = scorers.qfilter_problem(bigger)
    assert "3 layers, 2 KV heads of 8" in problem and "2 layers, 2 KV heads of 16" in problem and "\n" not in problem
    with pytest.raises(OSError, match="make them again with python -m evaluation.train_scorers qfilter"):
        guards.check_press_downloads(QFilterPress(0.5), bigger)
    with pytest.raises(OSError, match="holds statistics for checkpoint \\(2 layers, 4 heads of 16\\)"):
        guards.check_press_downloads(ExpectedAttentionStatsPress(0.5), bigger)
    record = scorers.scorer_dir(model, scorers.QFILTER) / "training.json"
    record.write_text(json.dumps({"base_model": "another-model"}))
    assert "holds filters for another-model" in scorers.qfilter_problem(model)
    with pytest.raises(FileNotFoundError, match="another-model"):
        registry.attach_scorers(QFilterPress(0.5), model, required=False)


def test_the_pass_resumes_where_it_stopped(tiny, tmp_path, monkeypatch):
    calls = []
    real = queries.prefill
    monkeypatch.setattr(queries, "prefill", lambda model, ids: calls.append(1) or real(model, ids))
    settings = queries.Settings("tiny")
    work, first = queries.compute(settings, [300], tmp_path / "a")  # one document
    assert first[300].docs == 1 and len(calls) == 1
    _, more = queries.compute(settings, [300, 900], tmp_path / "a")  # two more, from the first's resume point
    assert more[900].docs == 3 and len(calls) == 3
    _, fresh = queries.compute(settings, [900], tmp_path / "b")
    for which in ("pre", "post"):
        assert np.array_equal(getattr(more[900], which).cxx, getattr(fresh[900], which).cxx)
    # a run stopped between the two files of its resume point: the pass again, the same moments
    (work / "running.pre.npz").write_bytes((work / "docs00001.pre.npz").read_bytes())
    calls.clear()
    _, again = queries.compute(settings, [1500], tmp_path / "a")
    assert again[1500].docs == 5 and len(calls) == 5
    _, fresh = queries.compute(settings, [1500], tmp_path / "c")
    assert np.array_equal(again[1500].post.cxx, fresh[1500].post.cxx)
