"""Page-EntroKV observed by the queries of KVzip's context-reconstruction pass
(``presses.PageEntroKVReconstructionPress``, config ``page_entrokv_reconstruction``; docs/methods.md §1.16), and
``PageEntroKVPress.compress_observed`` / ``score_observed``, which it relies on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from kvpress import KVzipPress
from test_harness import composed
from test_kvzip_path import _rows, _runs, _tiny_model, passes, tiny  # noqa: F401
from transformers import DynamicCache

from evaluation import fused, kvzip_path, replay
from evaluation import run as entry
from evaluation.registry import capabilities
from evaluation.studies.ladder import PageEntroKVLadderPress
from presses import PageEntroKVPress, PageEntroKVReconstructionPress
from presses.core.model import attention_modules

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(4, 128, (1, 300), generator=torch.Generator().manual_seed(1))


class _Observed(KVzipPress):
    """kvpress's own pass and its own reconstruction attention (``_compute_cross_attention``: ``(B, G, r, n, sink +
    chunk + n)``), its max over the chunk's queries per query head taken by hand: the scores the press should
    compute (the sinks: their max over the chunks)."""

    def prepare(self, model, tokenizer, prev_postfix_size=8):
        chunks = super().prepare(model, tokenizer, prev_postfix_size)
        self.rows = torch.zeros(
            model.config.num_hidden_layers, 1, model.config.num_attention_heads, self.context_length
        )
        return chunks

    def score_kvzip(self, module, hidden_states, keys, values, attentions, kwargs):
        sink, chunk = min(self.n_sink, self.start_idx), self.end_idx - self.start_idx
        attn = self._compute_cross_attention(module, hidden_states, keys, kwargs).float().amax(-2).flatten(1, 2)
        row = self.rows[module.layer_idx]
        row[..., self.start_idx : self.end_idx] = attn[..., sink : sink + chunk]
        row[..., :sink] = torch.maximum(row[..., :sink], attn[..., :sink])
        return keys[:, :, : self.context_length], values[:, :, : self.context_length]

    def compress_post(self, model):
        pass


def _prefill(model, press) -> DynamicCache:
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=IDS, past_key_values=cache)
    return cache


@pytest.fixture
def kept_scores(monkeypatch):
    """The press's raw scores (``score_val`` before its selection), per prefill."""
    kept = []
    real = PageEntroKVReconstructionPress.compress_post

    def keep(self, model):
        kept.append(self.score_val.clone())
        return real(self, model)

    monkeypatch.setattr(PageEntroKVReconstructionPress, "compress_post", keep)
    return kept


def _observed(model) -> tuple[torch.Tensor, DynamicCache]:
    observed = _Observed(0.6, chunk_size=128)
    cache = _prefill(model, observed)
    assert float(observed.rows[..., 10:].amin()) > 0  # every context position was observed
    return observed.rows, cache


def test_layerwise_scores_are_the_reconstruction_attention_and_the_selection_page_entrokvs(tiny, kept_scores):  # noqa: F811
    """``layerwise=True``: the press equals its parts: kvpress's reconstruction attention, its max over each chunk's
    queries per query head (computed here from kvpress's own ``_compute_cross_attention``), then Page-EntroKV's
    pooling, paging and selection (``compress_observed``) on an uncompressed cache; the cache keeps whole pages, the
    sinks and the last window, and the strict budget in every layer and group."""
    model, _ = tiny
    press = PageEntroKVReconstructionPress(  # three chunks; Page-EntroKV's pooling and protection
        0.6, page_size=16, chunk_size=128, layerwise=True, pooling="entropy", protect="sink_window"
    )
    cache = _prefill(model, press)
    rows, uncompressed = _observed(model)
    torch.testing.assert_close(kept_scores[0], rows, atol=1e-6, rtol=1e-5)
    pages = press.pages()
    T, budget = IDS.shape[1], int(IDS.shape[1] * 0.4)
    for module, layer, ref in zip(attention_modules(model), cache.layers, uncompressed.layers):
        keys, values = pages.compress_observed(module, ref.keys, ref.values, rows[module.layer_idx], 1)
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert budget - 16 <= layer.keys.shape[2] <= budget
        for g in range(keys.shape[1]):
            positions = (layer.keys[0, g][:, None, :] == ref.keys[0, g][None]).all(-1).float().argmax(-1)
            assert bool((positions[:4] == torch.arange(4)).all())  # the sinks
            assert int(positions[-1]) == T - 1  # the last window
            page_ids = positions // 16
            for p in page_ids.unique():
                assert int((page_ids == p).sum()) == min(16, T - 16 * int(p))
    summary = press.summary()
    assert summary["observers_from"] == "reconstruction" and summary["layers"] == 3
    assert summary["budget_over"] == "layer" and 0.55 < summary["effective_compression"] < 0.7


@pytest.mark.parametrize("pooling, protect", [("entropy", "sink_window"), ("max", "none")])
def test_global_budget_masks_the_lowest_pages_over_all_layers(tiny, kept_scores, pooling, protect):  # noqa: F811
    """Default (``layerwise=False``, KVzip's budget): the ``int(L G T ratio)`` lowest entries of Page-EntroKV's page
    scores over all layers are masked, never a sink (nor a protected window page, with ``protect="sink_window"``),
    and the cache stays dense; for the class's pooling and protection (``max``, ``none``) and Page-EntroKV's."""
    model, _ = tiny
    press = PageEntroKVReconstructionPress(0.6, page_size=16, chunk_size=128, pooling=pooling, protect=protect)
    cache = _prefill(model, press)
    masks = kvzip_path.take_masked_keys(model)
    rows, _ = _observed(model)
    torch.testing.assert_close(kept_scores[0], rows, atol=1e-6, rtol=1e-5)
    T, G, L = IDS.shape[1], 2, 3
    assert all(layer.keys.shape[2] == T for layer in cache.layers)  # masked, not cut
    scores = torch.stack([press.pages().score_observed(rows[i], G) for i in range(L)])  # (L, 1, G, T)
    protected = torch.zeros(T, dtype=torch.bool)
    protected[:4] = True  # the sinks (KVzip never masks them)
    if protect == "sink_window":
        protected[:16] = True  # the sink page
        protected[T - 64 :] = True  # the window's pages: 300 = 18 * 16 + 12, the last 64 positions touch 5 pages
        protected[16 * ((T - 64) // 16) :] = True
    order = scores.masked_fill(protected, float("inf")).flatten().argsort(stable=True)
    expected = set(order[: int(L * G * T * 0.6)].tolist())
    masked = set()
    for layer, (_, h, s) in enumerate(masks):
        masked |= {layer * G * T + int(g) * T + int(t) for g, t in zip(h, s)}
        assert not bool(protected[s].any())
    assert len(masked) == int(L * G * T * 0.6)
    assert masked == expected or len(masked ^ expected) <= 2 * 16  # ties at the cut may differ within one page
    assert press.summary() == {"observers_from": "reconstruction", "budget_over": "layers"}


def test_layerwise_union_cuts_layers_to_their_own_lengths_and_decodes(tiny, monkeypatch):  # noqa: F811
    """``layerwise=True`` with ``group_selection="union"``: each layer keeps its own union, so the layers' lengths
    differ; the press says so (``uneven_layers``; the masked global budget and the per-group selection keep one
    length) and installs the attention wrapper that fits each layer's mask, so the question forward runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", getattr(sdpa, "__wrapped__", sdpa))  # as a fresh process
    model, _ = tiny
    press = PageEntroKVReconstructionPress(0.6, page_size=8, chunk_size=128, layerwise=True, group_selection="union")
    assert press.capabilities.uneven_layers
    assert not PageEntroKVReconstructionPress(0.6, group_selection="union").capabilities.uneven_layers
    assert not PageEntroKVReconstructionPress(0.6, layerwise=True).capabilities.uneven_layers
    cache = _prefill(model, press)
    assert len({layer.keys.shape[2] for layer in cache.layers}) > 1  # a prompt whose unions differ
    T = IDS.shape[1]
    with torch.inference_mode():
        logits = model(input_ids=IDS[:, :5], past_key_values=cache, position_ids=torch.arange(T, T + 5)[None]).logits
    assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()


@pytest.mark.parametrize("layerwise", [False, True])
def test_triton_kernel_under_the_interpreter_matches_the_reference(tiny, monkeypatch, layerwise):  # noqa: F811
    """The scoring's column maxima through the Triton kernel (``KVPRESS_RESEARCH_KERNELS=triton``, the interpreter on
    CPU) give the torch reference's kept cache and masks."""
    model, _ = tiny
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", mode)
        cache = _prefill(model, PageEntroKVReconstructionPress(0.5, page_size=8, chunk_size=256, layerwise=layerwise))
        masks = kvzip_path.take_masked_keys(model)
        results[mode] = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers], masks
    (ref, ref_masks), (tri, tri_masks) = results["reference"], results["triton"]
    for (kr, vr), (kt, vt) in zip(ref, tri):
        assert kr.shape == kt.shape and torch.equal(kr, kt) and torch.equal(vr, vt)
    for a, b in zip(ref_masks, tri_masks):
        assert (a is None) == (b is None) and (a is None or all(torch.equal(x, y) for x, y in zip(a, b)))
    assert (ref_masks[0] is None) == layerwise


def test_compress_observed_refuses_bad_input(tiny):  # noqa: F811
    model, _ = tiny
    module = attention_modules(model)[0]
    keys = torch.zeros(1, 2, 50, 16)
    with pytest.raises(ValueError, match=r"attn has shape \(1, 4, 49\); expected \(B=1, H_Q, T=50\) with G=2"):
        PageEntroKVPress(0.5).compress_observed(module, keys, keys, torch.ones(1, 4, 49), 1)
    ladder = PageEntroKVLadderPress(0.5, pooling="snapkv")  # the ablation ladder's SnapKV scores
    with pytest.raises(ValueError, match="pooling='snapkv' scores the layer's own queries; compress_observed"):
        ladder.compress_observed(module, keys, keys, torch.ones(1, 4, 50), 1)
    with pytest.raises(ValueError, match="pooling='snapkv' scores the layer's own queries; score_observed"):
        ladder.score_observed(torch.ones(1, 4, 50), 2)


def test_config_capabilities_and_refusals():
    press = instantiate(composed("press=page_entrokv_reconstruction", "compression_ratio=0.5").press)
    assert isinstance(press, PageEntroKVReconstructionPress) and press.compression_ratio == 0.5
    for name in ("page_size", "tau", "alpha", "window_size", "n_sink"):
        assert getattr(press, name) == getattr(PageEntroKVPress, name)  # one source: Page-EntroKV's defaults
    assert (press.pooling, press.protect) == ("max", "none")  # but these two, tuned on the development split
    entropy = instantiate(composed("press=page_entrokv_reconstruction_entropy", "compression_ratio=0.5").press)
    assert (entropy.pooling, entropy.protect) == (PageEntroKVPress.pooling, PageEntroKVPress.protect)
    for variant, fields in {  # the variants tried on the development split keep their meaning
        "layerwise": {"layerwise": True},
        "max_pool": {"pooling": "max"},
        "mean_pool": {"pooling": "mean"},
        "unprotected": {"protect": "none"},
    }.items():
        built = instantiate(composed(f"press=page_entrokv_reconstruction_{variant}", "compression_ratio=0.5").press)
        first = {"pooling": "entropy", "protect": "sink_window"}  # the first defaults, Page-EntroKV's
        assert built == PageEntroKVReconstructionPress(0.5, **{**first, **fields})
    caps = capabilities(press)
    assert caps.scores_once and caps.extra_forwards and not caps.shares_prefill and caps.scores_as is None
    with pytest.raises(ValueError, match="cannot share a prefill"):  # only KVzip's path (evaluation.kvzip_path)
        replay.check_shareable(press, "page_entrokv_reconstruction")
    other = PageEntroKVReconstructionPress(0.75, page_size=16, tau=2.0, protect="none")
    assert kvzip_path.scores_key(press) == kvzip_path.scores_key(other)  # one score tensor for the page options
    assert kvzip_path.scores_key(press) != kvzip_path.scores_key(KVzipPress(0.5))  # its own scores
    assert kvzip_path.pass_key(press) == kvzip_path.pass_key(KVzipPress(0.5))  # from KVzip's pass (caps.pass_as)
    assert kvzip_path.pass_key(press) != kvzip_path.pass_key(KVzipPress(0.5, chunk_size=128))
    assert kvzip_path.pass_key(press) == kvzip_path.pass_key(PageEntroKVReconstructionPress(0.5, n_sink=8))
    assert kvzip_path.scores_key(press) != kvzip_path.scores_key(PageEntroKVReconstructionPress(0.5, n_sink=8))
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        PageEntroKVReconstructionPress(0.5, page_size=0)
    with pytest.raises(ValueError, match="pooling='snapkv'"):
        PageEntroKVReconstructionPress(0.5, pooling="snapkv")
    with pytest.raises(ValueError, match="kvzip_plus_normalization=True"):
        PageEntroKVReconstructionPress(0.5, kvzip_plus_normalization=True)


@pytest.mark.parametrize("lead", ["kvzip", "reconstruction"])
def test_one_pass_scores_kvzip_and_the_reconstruction_observers_exactly(tiny, passes, lead):  # noqa: F811
    """KVzip, KVzip+ and this press (one ``chunk_size``) share one reconstruction pass, whichever leads it: each run's
    masks equal those of the press's own prefill, tensor for tensor."""
    model, _ = tiny
    kvzip_press = KVzipPress(0.6, chunk_size=128)
    ours_press = PageEntroKVReconstructionPress(0.6, page_size=16, chunk_size=128)
    presses = [
        kvzip_press,
        KVzipPress(0.5, chunk_size=128, kvzip_plus_normalization=True),
        ours_press,
        PageEntroKVReconstructionPress(0.75, page_size=8, chunk_size=128, pooling="entropy"),
    ]
    if lead == "reconstruction":
        presses = presses[2:] + presses[:2]
    own = []
    for press in presses:
        _prefill(model, press)
        own.append(kvzip_path.take_masked_keys(model))
    passes.clear()
    with torch.inference_mode(), replay.PrefillCapture(model) as capture:
        model.model(input_ids=IDS, past_key_values=DynamicCache())
    runs = [SimpleNamespace(press=press) for press in presses]
    shared = list(kvzip_path.selected_runs(runs, model, capture, IDS))
    assert len(passes) == 1
    for press, mine, (_, _, _, masks, _) in zip(presses, own, shared):
        assert sum(len(m[0]) for m in masks) == int(3 * 2 * IDS.shape[1] * press.compression_ratio)
        for a, b in zip(mine, masks):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), press
    masks = {id(press): item[3] for press, item in zip(presses, shared)}
    kvzip, ours = masks[id(kvzip_press)], masks[id(ours_press)]
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(kvzip, ours))  # not trivial: other scores, other masks


def test_fused_equals_separate_runs(tiny, tmp_path, passes):  # noqa: F811 (fixtures)
    """``evaluation.fused`` scores both budgets at two ratios, and KVzip beside them, from one reconstruction pass
    per example and gives the predictions, compression and statistics of separate ``evaluation.run`` runs; the
    global budget masks, the per-layer one evicts."""
    presses, ratios = ["page_entrokv_reconstruction", "page_entrokv_reconstruction_layerwise"], [0.5, 0.75]
    for cfg, names in _runs([*presses, "kvzip"], ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    assert len(passes) == 2 * 6  # two examples, six runs
    passes.clear()
    fused.run_fused(_runs([*presses, "kvzip"], ratios, tmp_path / "fused"), "test")
    assert len(passes) == 2  # one per example for both budgets, both ratios and KVzip
    for ratio in ratios:
        sep, fus = _rows(tmp_path / "separate", "kvzip", ratio), _rows(tmp_path / "fused", "kvzip", ratio)
        assert sorted(sep) == sorted(fus) and sep
        assert all(fus[i]["prediction"] == sep[i]["prediction"] for i in sep)
    for press in presses:
        for ratio in ratios:
            sep, fus = _rows(tmp_path / "separate", press, ratio), _rows(tmp_path / "fused", press, ratio)
            assert sorted(sep) == sorted(fus) and sep
            for i in sep:
                assert fus[i]["prediction"] == sep[i]["prediction"] and fus[i]["score"] == sep[i]["score"]
                assert fus[i]["press_stats"] == sep[i]["press_stats"]
                assert fus[i]["effective_compression"] == pytest.approx(sep[i]["effective_compression"], abs=1e-12)
                assert fus[i]["physical_compression"] == sep[i]["physical_compression"]
                assert (sep[i]["physical_compression"] > 0) == press.endswith("layerwise")  # evicted, or masked
                assert abs(sep[i]["effective_compression"] - ratio) < 0.1
