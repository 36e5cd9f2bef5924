"""KVzip's reconstruction scores evicted by pages (``presses.KVzipPagePress``, config ``kvzip_page``; docs/methods.md
§1.15): whole pages are masked, at KVzip's budget; its scores are KVzip's, so a sweep scores both from one
reconstruction pass, and ``evaluation.fused`` gives what ``evaluation.run`` gives."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from kvpress import KVzipPress
from test_harness import composed
from test_kvzip_path import _assert_fused_equals_separate, _runs, passes, tiny  # noqa: F401 (fixtures)
from transformers import DynamicCache

from evaluation import fused, kvzip_path, replay
from evaluation import run as entry
from evaluation.registry import capabilities
from presses import KVzipPagePress
from presses.kvzip_pages.press import page_expanded

pytestmark = pytest.mark.usefixtures("one_thread")


def test_page_expanded_is_the_block_max_of_each_page():
    scores = torch.tensor([[3.0, 1.0, 2.0, 5.0, 4.0, 0.0, 7.0]])
    assert page_expanded(scores, 3).tolist() == [[3.0, 3.0, 3.0, 5.0, 5.0, 5.0, 7.0]]
    assert torch.equal(page_expanded(scores, 1), scores)
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        page_expanded(scores, 0)
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        KVzipPagePress(0.5, page_size=0)


def test_config_and_capabilities():
    press = instantiate(composed("press=kvzip_page", "compression_ratio=0.5").press)
    assert isinstance(press, KVzipPagePress) and press.page_size == 32 and press.n_sink == KVzipPress.n_sink
    caps, kvzip = capabilities(press), capabilities(KVzipPress(0.5))
    assert caps == replace(kvzip, scores_as=KVzipPress, selection_fields=("page_size",))  # scored once, as KVzip
    assert kvzip_path.pass_key(press) == kvzip_path.pass_key(KVzipPress(0.25))
    assert kvzip_path.scores_key(press) == kvzip_path.scores_key(KVzipPress(0.25))
    assert kvzip_path.scores_key(press) != kvzip_path.scores_key(KVzipPress(0.25, kvzip_plus_normalization=True))


@pytest.mark.parametrize("page_size", [8, 32])
def test_whole_pages_are_masked_at_kvzips_budget(tiny, passes, page_size):  # noqa: F811 (fixtures)
    """One pass scores KVzip and the page variant; the variant's masks equal its own prefill's, hold KVzip's count,
    and cover whole pages of each head except where the cut falls (at most one page per tie at the cut)."""
    model, _ = tiny
    T, ratio = 300, 0.6
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(0))
    page = KVzipPagePress(ratio, page_size=page_size)
    with torch.inference_mode():
        with page(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        own = kvzip_path.take_masked_keys(model)
        passes.clear()
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        runs = [
            SimpleNamespace(press=KVzipPress(ratio)),
            SimpleNamespace(press=KVzipPagePress(ratio, page_size=page_size)),
        ]
        shared = list(kvzip_path.selected_runs(runs, model, capture, ids))
    assert len(passes) == 1  # one reconstruction pass for both presses
    (_, _, _, token_masks, _), (_, _, _, page_masks, _) = shared
    for a, b in zip(own, page_masks):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    count = sum(len(m[0]) for m in page_masks)
    assert count == sum(len(m[0]) for m in token_masks) == int(3 * 2 * T * ratio)  # KVzip's budget
    partial = 0
    for _, heads, positions in page_masks:
        for h in heads.unique():
            pos = positions[heads == h]
            for p in (pos // page_size).unique():
                start, end = int(p) * page_size, min(T, (int(p) + 1) * page_size)
                n = int(((pos >= start) & (pos < end)).sum())
                low = max(start, KVzipPress.n_sink)  # the sinks are never masked
                partial += n != end - low
    assert partial <= 1
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(token_masks, page_masks))  # pages change the choice


def test_fused_equals_separate_runs(tiny, tmp_path, passes):  # noqa: F811 (fixtures)
    presses, ratios = ["kvzip", "kvzip_page"], [0.5, 0.75]
    for cfg, names in _runs(presses, ratios, tmp_path / "separate"):
        entry.run(cfg, names)
    passes.clear()
    fused.run_fused(_runs(presses, ratios, tmp_path / "fused"), "test")
    assert len(passes) == 2  # one per example, for both presses and both ratios
    assert len(_assert_fused_equals_separate(tmp_path, presses, ratios)) > 1
