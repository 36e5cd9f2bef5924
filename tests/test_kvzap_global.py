"""KVzip's selection on KVzap's learned scores (presses.KVzapGlobalPress, KVzapGlobalPagePress; docs/methods.md
§1.19): the scores are KVzap's on the prefill's hidden states, no reconstruction forward runs, the masks are KVzip's
global selection on them, a short prompt keeps an entry per head, and the harness runs them (run only). Tiny random
Llama and a random surrogate (mechanics only)."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from kvpress import AdaKVPress, ComposedPress, DMSPress, KnormPress, KVzapPress, KVzipPress
from omegaconf import OmegaConf
from test_harness import composed
from test_kvzip_path import SETTINGS, _assert_fused_equals_separate, _runs, passes, tiny  # noqa: F401 (fixtures)
from test_scorer_pages import random_kvzap
from transformers import DynamicCache

from evaluation import fused, kvzip_path
from evaluation import run as entry
from evaluation.registry import capabilities, held_press_problem
from presses import KVzapGlobalPagePress, KVzapGlobalPress, KVzipPagePress, PageEntroKVPress

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefill(model, press, ids):
    """Run the prefill of ``ids`` under ``press``; the masks it left (taken off the model) and the forwards the model's
    decoder ran inside the press."""
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.inference_mode(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
    finally:
        handle.remove()
    return kvzip_path.take_masked_keys(model), len(calls)


def _kvzap_scores(model, kvzap, ids):
    """KVzap's ``(L, 1, G, T)`` scores on the uncompressed prefill's attention inputs (computed here, not by the
    press)."""
    seen = {}

    def hook(module, args, kwargs):
        seen[module.layer_idx] = kvzap.score(module, kwargs["hidden_states"], None, None, None, kwargs).float()

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model.model(input_ids=ids, past_key_values=DynamicCache())
    finally:
        for h in handles:
            h.remove()
    return torch.stack([seen[i] for i in range(len(seen))])


def test_configs_capabilities_and_options():
    for name, cls in (("kvzap_global", KVzapGlobalPress), ("kvzap_global_page", KVzapGlobalPagePress)):
        press = instantiate(composed(f"press={name}", "compression_ratio=0.75").press)
        assert type(press) is cls and press.compression_ratio == 0.75 and press.press.model_type == "linear"
        assert press.n_sink == KVzipPress.n_sink and not press.layerwise  # KVzip's selection
        caps = capabilities(press)  # scored once per example in a sweep, from its shared prefill: no pass
        assert not caps.shares_prefill and caps.scores_once and not caps.extra_forwards
        assert caps.prefill_scores == press.scores_from_prefill
    assert KVzapGlobalPagePress(0.5).page_size == KVzipPagePress.page_size
    with pytest.raises(ValueError, match="must be a kvpress KVzapPress"):
        KVzapGlobalPress(0.5, press=KnormPress())
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        KVzapGlobalPagePress(0.5, page_size=0)


@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_masks_are_kvzips_selection_on_kvzaps_prefill_scores(tiny, ratio):  # noqa: F811 (fixtures)
    """One forward (the prefill), no reconstruction pass; the masked entries are the int(L G T ratio) lowest KVzap
    scores over all layers and heads, the sinks never, and layers lose different counts (the global budget)."""
    model, _ = tiny
    T = 200
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(1))
    kvzap = random_kvzap(model, seed=3)
    masks, forwards = _prefill(model, KVzapGlobalPress(ratio, press=kvzap), ids)
    assert forwards == 1  # the prefill only: no reconstruction forward
    scores = _kvzap_scores(model, kvzap, ids)  # (L, 1, G, T)
    L, _, G, _ = scores.shape
    n = int(L * G * T * ratio)
    ranked = scores.clone()
    ranked[..., : KVzipPress.n_sink] = float("inf")  # the sinks last
    masked = torch.zeros_like(ranked, dtype=torch.bool)
    for layer, (_, heads, positions) in enumerate(masks):
        masked[layer, 0, heads, positions] = True
    assert int(masked.sum()) == n
    # the lowest n over all layers and heads (tied scores either way: a layer's first hidden states repeat with the
    # tokens)
    assert float(ranked[masked].max()) <= float(ranked[~masked].min())
    assert not masked[..., : KVzipPress.n_sink].any()
    per_layer = masked.sum((1, 2, 3))
    assert len(set(per_layer.tolist())) > 1  # not the same count per layer: KVzip's allocation


def test_pages_are_masked_whole(tiny):  # noqa: F811 (fixtures)
    model, _ = tiny
    T, page = 256, 16
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(2))
    kvzap = random_kvzap(model, seed=5)
    tokens, _ = _prefill(model, KVzapGlobalPress(0.6, press=kvzap), ids)
    pages, forwards = _prefill(model, KVzapGlobalPagePress(0.6, press=kvzap, page_size=page), ids)
    assert forwards == 1
    assert sum(len(m[0]) for m in pages) == sum(len(m[0]) for m in tokens) == int(3 * 2 * T * 0.6)
    partial = 0
    for _, heads, positions in pages:
        for h in heads.unique():
            pos = positions[heads == h]
            for p in (pos // page).unique():
                start, end = int(p) * page, (int(p) + 1) * page
                partial += int(((pos >= start) & (pos < end)).sum()) != end - max(start, KVzipPress.n_sink)
    assert partial <= 1  # whole pages but where the budget's cut falls
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(tokens, pages))


def test_a_short_prompt_keeps_an_entry_per_head(tiny):  # noqa: F811 (fixtures)
    model, _ = tiny
    ids = torch.randint(4, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    masks, _ = _prefill(model, KVzapGlobalPress(0.9, press=random_kvzap(model), n_sink=0), ids)
    for _, heads, _ in masks:
        assert all(int((heads == h).sum()) < 6 for h in range(2))  # every KV head keeps one entry or more


@pytest.mark.parametrize("query_aware", [False, True])
def test_fused_equals_run(tiny, tmp_path, monkeypatch, passes, query_aware):  # noqa: F811 (fixtures)
    """evaluation.run and evaluation.fused with the configs, offline (the project's scorer for the model, here a
    random one saved where the harness looks): the sweep computes the scores from its shared prefill, runs no
    reconstruction pass, and gives the predictions and masked fractions the separate runs give, at two ratios and
    beside KVzip (whose pass it does not join), with the question after and inside the context."""
    from evaluation import scorers

    model, _ = tiny
    kvzap = random_kvzap(model).kvzap_model
    kvzap.config.base_model = scorers.model_key(model)
    kvzap.save_pretrained(tmp_path / "scorers" / scorers.model_key(model) / "kvzap_linear")
    monkeypatch.setattr(scorers, "SCORERS", tmp_path / "scorers")
    presses, ratios = ["kvzap_global", "kvzap_global_page", "kvzip"], [0.5, 0.75]
    settings = (*SETTINGS, f"query_aware={str(query_aware).lower()}")
    for cfg, names in _runs(presses, ratios, tmp_path / "separate", settings):
        entry.run(cfg, names)
    assert len(passes) == 2 * 2  # KVzip's reconstruction passes only: two examples, two ratios
    passes.clear()
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused", settings), "test")
    assert len(passes) == 2  # KVzip's, one per example
    predictions = _assert_fused_equals_separate(tmp_path, presses, ratios, "needle-qa" if query_aware else "needle")
    assert len(predictions) > 1  # compression changes what the model says: the comparison is not trivial


@pytest.mark.parametrize("wrapper", ["kvpress.DMSPress", "kvpress.KeyRerotationPress", "kvpress.AdaKVPress"])
def test_a_score_wrapper_around_it_is_refused_in_one_line(tmp_path, wrapper):
    """kvpress's score wrappers call their press's ``score``, which KVzip's presses lack: DMSPress builds and would fail
    in its first forward, KeyRerotationPress asserts without a message, AdaKVPress with its own. The harness says
    the same line for each, before the model loads."""
    cfg = composed("press=dms", f"output_dir={tmp_path}", *SETTINGS)
    cfg.press = OmegaConf.create(
        {"_target_": wrapper, "press": {"_target_": "presses.KVzapGlobalPress", "compression_ratio": 0.5}}
    )
    name = wrapper.split(".")[1]
    with pytest.raises(ValueError, match=rf"{name}: press.press=KVzapGlobalPress must be a kvpress ScorerPress"):
        entry.run(cfg, {"press": "dms", "dataset": "needle", "model": "smollm2-135m"})
    assert not any(tmp_path.rglob("metrics.json"))


def test_score_wrappers_take_scorer_presses():
    """The check refuses only what the field cannot hold: KVzap (kvpress's scorer) in DMSPress, Page-EntroKV (a
    ScorerPress of this project) in AdaKV, any press in ComposedPress's list."""
    assert held_press_problem(DMSPress, "press", KVzapPress(model_type="linear")) is None
    assert held_press_problem(AdaKVPress, "press", PageEntroKVPress(0.5)) is None
    assert held_press_problem(ComposedPress, "presses", [KVzapGlobalPress(0.5)]) is None
    assert "ScorerPress" in held_press_problem(DMSPress, "press", KVzipPress(0.5))
