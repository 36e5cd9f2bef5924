"""Probabilistic eviction with KVzip's reconstruction scores as the proposal (``presses.KVzipSamplingPress``, config
``snis_kvzip_page``; docs/methods.md §3.9), and the probabilistic press's eviction from proposals computed elsewhere
(``ProbabilisticEvictionPress.evict_with_proposals``), which it relies on."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.utils import instantiate
from kvpress import KVzipPress
from test_harness import composed
from test_kvzip_path import _assert_fused_equals_separate, _rows, _runs, _tiny_model, passes, tiny  # noqa: F401
from transformers import DynamicCache

from evaluation import fused, kvzip_path, replay
from evaluation import run as entry
from evaluation.registry import capabilities
from presses import KVzipSamplingPress, ProbabilisticEvictionPress, attention
from presses.core.model import attention_modules
from presses.kvzip_pages.sampling import reconstruction_proposals

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(0))


def _state(cache) -> list:
    """Per layer: keys, values and the decode-time bias (None where there is none)."""
    states = attention.take_decode_state(cache, len(cache))
    return [
        (layer.keys.clone(), layer.values.clone(), None if s is None else s.bias.clone())
        for layer, s in zip(cache.layers, states)
    ]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (ka, va, ba), (kb, vb, bb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert (ba is None) == (bb is None) and (ba is None or torch.equal(ba, bb))


@pytest.mark.parametrize(
    ("budget", "unit"), [("global", "token"), ("global", "page"), ("head", "token"), ("head", "page")]
)
def test_eviction_from_given_proposals_equals_the_prefills(tiny, monkeypatch, budget, unit):  # noqa: F811
    """Given the token proposals its own prefill computes, ``evict_with_proposals`` on an uncompressed cache leaves the
    same kept entries, padding and SNIS bias, tensor for tensor, as the prefill with the press."""
    model, _ = tiny
    recorded = {}
    real = ProbabilisticEvictionPress._schedule

    def record(self, module, cache, keys, values, pi):
        recorded[module.layer_idx] = pi.clone()
        return real(self, module, cache, keys, values, pi)

    monkeypatch.setattr(ProbabilisticEvictionPress, "_schedule", record)
    settings = dict(compression_ratio=0.6, budget=budget, unit=unit, page_size=8, seed=3)
    with torch.inference_mode():
        cache = DynamicCache()
        with ProbabilisticEvictionPress(**settings)(model):
            model.model(input_ids=IDS, past_key_values=cache)
        own = _state(cache)
        proposals = [recorded[i] for i in range(len(cache))]
        monkeypatch.setattr(ProbabilisticEvictionPress, "_schedule", real)
        cache = DynamicCache()
        model.model(input_ids=IDS, past_key_values=cache)
        press = ProbabilisticEvictionPress(**settings)
        press.evict_with_proposals(attention_modules(model), cache, proposals)
    given = _state(cache)
    _assert_same(own, given)
    assert own[0][0].shape[2] < IDS.shape[1]  # something was evicted
    assert press.summary()["num_layers_evicted"] == 3


def test_eviction_from_given_proposals_refuses_mismatched_inputs(tiny):  # noqa: F811
    model, _ = tiny
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=IDS, past_key_values=cache)
    press = ProbabilisticEvictionPress(0.5)
    pi = torch.full((1, 2, 300), 1 / 300)
    with pytest.raises(ValueError, match="3 attention modules and 2 proposals for a cache of 3 layers"):
        press.evict_with_proposals(attention_modules(model), cache, [pi, pi])
    with pytest.raises(ValueError, match="layer 0: a proposal over 299 entries for 300 cached entries"):
        press.evict_with_proposals(attention_modules(model), cache, [pi[..., :299]] * 3)


def test_reconstruction_proposals():
    scores = torch.tensor([[[[0.1, 0.0, 0.3, 0.6, 0.0, 0.2]]]])  # (L, B, G, t)
    pi = reconstruction_proposals(scores, n_sink=1)
    expected = torch.tensor([0.6, 0.0, 0.3, 0.6, 0.0, 0.2]) / 1.7  # the sink takes its row's highest score
    assert torch.allclose(pi[0, 0, 0], expected)
    mixed = reconstruction_proposals(scores, n_sink=0, uniform_mix=0.5)
    assert torch.allclose(mixed[0, 0, 0], 0.5 * scores[0, 0, 0] / 1.2 + 0.5 / 6)
    assert bool((mixed > 0).all()) and torch.allclose(mixed.sum(-1), torch.ones(1, 1, 1))
    sharp = reconstruction_proposals(scores, n_sink=0, temperature=0.5)
    assert torch.allclose(sharp[0, 0, 0], scores[0, 0, 0] ** 2 / (scores[0, 0, 0] ** 2).sum())
    with pytest.raises(ValueError, match="non-negative scores"):
        reconstruction_proposals(-scores, n_sink=0)


def test_samples_pages_from_kvzips_scores(tiny):  # noqa: F811
    """The press equals its parts: kvpress's reconstruction scores (an unchanged ``KVzipPress`` pass on the same
    prefill), :func:`reconstruction_proposals` and ``evict_with_proposals``; the kept entries are whole pages drawn
    where KVzip scores, and the cache length follows the ratio."""
    model, _ = tiny

    class Scores(KVzipPress):  # kvpress's pass, its scores kept instead of masking
        def compress_post(self, model):
            self.kept = self.score_val.clone()

    with torch.inference_mode():
        cache = DynamicCache()
        press = KVzipSamplingPress(0.6, seed=5)
        with press(model):
            model.model(input_ids=IDS, past_key_values=cache)
        own = _state(cache)
        cache, scorer = DynamicCache(), Scores(0.6)
        with scorer(model):
            model.model(input_ids=IDS, past_key_values=cache)
        uncompressed = [layer.keys.clone() for layer in cache.layers]
        pi = reconstruction_proposals(scorer.kept, KVzipPress.n_sink, press.proposal_temperature, press.uniform_mix)
        press.sampler().evict_with_proposals(attention_modules(model), cache, list(pi))
    _assert_same(own, _state(cache))
    summary = press.summary()
    assert summary["unit"] == "page" and summary["page_size"] == 16 and summary["proposal"] == "kvzip"
    kept = [float(x) for x in summary["kept_entries"].split(",")]
    assert abs(sum(kept) / len(kept) / 300 - 0.4) < 0.1  # the global budget's expected count, (1 - 0.6) T
    for layer, (keys, _, bias) in enumerate(own):
        for g in range(keys.shape[1]):
            valid = torch.isfinite(bias[0, g])
            rows = keys[0, g][valid]  # the kept entries: find their positions in the uncompressed cache
            positions = (rows[:, None, :] == uncompressed[layer][0, g][None]).all(-1).float().argmax(-1)
            pages = positions // 16
            for p in pages.unique():  # whole pages (the last one is 300 - 18 * 16 = 12 positions long)
                assert int((pages == p).sum()) == min(16, 300 - 16 * int(p))
            assert bool((pi[layer, 0, g].view(-1)[positions] > 0).all())


def test_config_capabilities_and_refusals():
    press = instantiate(composed("press=snis_kvzip_page", "compression_ratio=0.5", "seed=7").press)
    assert isinstance(press, KVzipSamplingPress) and press.unit == "page" and press.seed == 7
    assert press.page_size == ProbabilisticEvictionPress.page_size and press.tau == ProbabilisticEvictionPress.tau
    assert press.proposal_temperature == 0.25 != ProbabilisticEvictionPress.proposal_temperature  # tuned here
    for variant in ("snis_kvzip_page_t1", "snis_kvzip_page_uncorrected", "snis_kvzip_token"):  # as they were tried
        built = instantiate(composed(f"press={variant}", "compression_ratio=0.5").press)
        assert built.proposal_temperature == 1.0, variant
    caps = capabilities(press)
    assert caps.decode_state and caps.extra_forwards and caps.scores_once and not caps.shares_prefill
    with pytest.raises(ValueError, match="cannot share a prefill"):  # only KVzip's path (evaluation.kvzip_path)
        replay.check_shareable(press, "snis_kvzip_page")
    assert kvzip_path.pass_key(press) == kvzip_path.pass_key(KVzipPress(0.25))  # one pass and one score for both
    assert kvzip_path.scores_key(press) == kvzip_path.scores_key(KVzipPress(0.25))
    assert kvzip_path.scores_key(press) != kvzip_path.scores_key(KVzipSamplingPress(0.5, n_sink=8))
    with pytest.raises(ValueError, match="budget='tokens' must be one of"):
        KVzipSamplingPress(0.5, budget="tokens")
    with pytest.raises(ValueError, match="page_size=0 must be >= 1"):
        KVzipSamplingPress(0.5, page_size=0)


def test_refuses_flash_attention(tmp_path):
    model, _ = _tiny_model(tmp_path)
    model.config._attn_implementation = "flash_attention_2"
    for press in (KVzipSamplingPress(0.5), ProbabilisticEvictionPress(0.5)):  # one check, presses.attention's
        name = type(press).__name__
        with pytest.raises(ValueError, match=f"attn_implementation='flash_attention_2' is not supported by {name}"):
            press.post_init_from_model(model)


def test_runs_through_the_harness(tiny, tmp_path):  # noqa: F811
    """``evaluation.run press=snis_kvzip_page``: answers written, the kept entries read from the press's summary."""
    for cfg, names in _runs(["snis_kvzip_page"], [0.75], tmp_path):
        entry.run(cfg, names)
    (metrics,) = list(tmp_path.rglob("metrics.json"))
    result = json.loads(metrics.read_text())
    assert result["n"] == 2 and 0.6 < result["effective_compression"] < 0.9
    rows = [json.loads(line) for line in metrics.with_name("predictions.jsonl").read_text().splitlines()]
    assert all(row["press_stats"]["unit"] == "page" and row["press_stats"]["proposal"] == "kvzip" for row in rows)


def test_fused_equals_separate_runs(tiny, tmp_path, passes):  # noqa: F811 (fixtures)
    """``evaluation.fused`` scores KVzip and the sampling press from one reconstruction pass per example and gives,
    per run, the predictions, compression and sampling statistics of separate ``evaluation.run`` runs."""
    presses, ratios = ["kvzip", "snis_kvzip_page"], [0.5, 0.75]
    for cfg, names in _runs(presses, ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    assert len(passes) == 2 * 4  # two examples, four runs
    passes.clear()
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused"), "test")
    assert len(passes) == 2  # one per example, for both presses and both ratios
    _assert_fused_equals_separate(tmp_path, presses, ratios)
    for ratio in ratios:
        sep = _rows(tmp_path / "separate", "snis_kvzip_page", ratio, "needle")
        fus = _rows(tmp_path / "fused", "snis_kvzip_page", ratio, "needle")
        for i in sep:
            assert fus[i]["press_stats"] == sep[i]["press_stats"] and "kept_pages_mean" in sep[i]["press_stats"]
            assert fus[i]["physical_compression"] > 0  # evicted, not masked
