"""The ablation ladder from ChunkKV to Page-EntroKV (issue 30, deliverable 1; docs/methods.md §1.14).

- rung 0 (``page_entrokv_rung0_chunkkv``) is kvpress's ``ChunkKVPress(SnapKVPress, chunk_length=32)`` (``chunkkv32``)
  written as the ladder's press (``evaluation.studies.ladder.PageEntroKVLadderPress``): the same kept keys and
  values, bit for bit, on a tiny random Llama;
- every rung differs from the one before in exactly one field of the press it builds
  (:func:`evaluation.settings.press_settings`), the last rung being ``page_entrokv``: the ladder's press at its
  defaults, which keeps Page-EntroKV's cache bit for bit;
- the options the ladder adds (``pooling="snapkv"``, ``page_score="mean"``, ``group_selection="shared"``,
  ``budget="pages"``) compute what their documentation says, and ``PageEntroKVPress`` refuses them naming the
  ladder's press.

Where the two could differ: both rank chunks by the same float32 scores, but ChunkKV picks the top chunks with
``torch.topk`` and Page-EntroKV with a stable sort (the lower page wins a tie). They keep different chunks only when
two chunk scores tie exactly at the cut; the chunks a tie can occur between on a real model are the chunks inside
SnapKV's window (all scored max + 1), which rank above every other chunk and are all kept whenever the budget holds
as many chunks as the window covers (``T (1 - ratio) >= window_size + chunk_length``). With a bfloat16 or float16
model ChunkKV sums the scores in that dtype and Page-EntroKV in float32 (see docs/methods.md §1.14).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from hydra.utils import instantiate
from kvpress import ChunkKVPress, SnapKVPress
from test_harness import composed
from transformers import DynamicCache

from evaluation.settings import press_settings, public_path
from evaluation.studies.ladder import LADDER, PageEntroKVLadderPress
from presses import PageEntroKVPress
from presses.core.paging import page_budget, page_scores

pytestmark = pytest.mark.usefixtures("one_thread")


def _press(name: str, ratio: float = 0.5):
    return instantiate(composed(f"press={name}", f"compression_ratio={ratio}").press)


def _prefill(model, press, ids):
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=cache)
    return cache


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa", seed=2)


@pytest.mark.parametrize(
    ("T", "ratio"), [(T, r) for T in (300, 320, 1000) for r in (0.25, 0.5, 0.75)] + [(1000, 0.9), (2000, 0.95)]
)
def test_rung0_is_chunkkv_bit_for_bit(model, T, ratio):
    """(At ``T = 300``, ratio 0.9, ChunkKV keeps one of the two window chunks that tie at max + 1, by topk's choice,
    where Page-EntroKV keeps the partial last one: the tie of the module docstring.)"""
    ids = torch.randint(4, 120, (1, T), generator=torch.Generator().manual_seed(T))
    chunkkv, rung0 = _press("chunkkv32", ratio), _press(LADDER[0], ratio)
    assert isinstance(chunkkv, ChunkKVPress) and isinstance(chunkkv.press, SnapKVPress)
    a, b = _prefill(model, chunkkv, ids), _prefill(model, rung0, ids)
    for layer_a, layer_b in zip(a.layers, b.layers):
        assert layer_a.keys.shape[2] < T  # something was evicted
        assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)


def _as_ladder(press: PageEntroKVPress) -> dict:
    """The settings of the ladder's press with ``press``'s fields (its own at their defaults)."""
    fields = {k: v for k, v in press_settings(press).items() if k != "_target_"}
    return press_settings(PageEntroKVLadderPress(**fields))


def test_each_rung_changes_one_field():
    presses = [_press(name) for name in LADDER]
    assert all(type(p) is PageEntroKVLadderPress for p in presses[:-1]) and type(presses[-1]) is PageEntroKVPress
    settings = [press_settings(p) for p in presses[:-1]] + [_as_ladder(presses[-1])]
    changed = []
    for before, after in zip(settings, settings[1:]):
        diff = sorted(k for k in before if before[k] != after[k])
        assert len(diff) == 1, diff
        changed.append(diff[0])
    assert changed == ["group_selection", "pooling", "pooling", "page_score", "protect", "budget"]
    assert press_settings(presses[-1]) == press_settings(PageEntroKVPress(compression_ratio=0.5))  # the defaults
    assert settings[-1] == press_settings(PageEntroKVLadderPress(compression_ratio=0.5))  # the ladder's defaults
    for size in (16, 64):  # the page-size step, from the top rung
        other = _as_ladder(_press(f"page_entrokv_page{size}"))
        assert {k for k in other if other[k] != settings[-1][k]} == {"page_size"} and other["page_size"] == size


@pytest.mark.parametrize("options", [{}, {"group_selection": "union", "protect": "none", "page_size": 16}])
def test_the_ladder_press_at_its_defaults_is_page_entrokv_bit_for_bit(model, options):
    """The top of the ladder: the subclass with ChunkKV's options at their defaults keeps Page-EntroKV's cache."""
    for T, ratio in ((300, 0.5), (1000, 0.75), (90, 0.9)):
        ids = torch.randint(4, 120, (1, T), generator=torch.Generator().manual_seed(T))
        a = _prefill(model, PageEntroKVPress(ratio, **options), ids)
        ladder = PageEntroKVLadderPress(ratio, **options)
        b = _prefill(model, ladder, ids)
        assert ladder.summary()["kept_entries"] and a.get_seq_length() < T
        for layer_a, layer_b in zip(a.layers, b.layers):
            assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)


@pytest.mark.parametrize("options", [{"pooling": "snapkv"}, {"page_score": "mean"}, {"group_selection": "shared"}])
def test_the_library_press_refuses_the_ladders_options(options):
    """``PageEntroKVPress`` holds what Page-EntroKV uses: ChunkKV's values are refused naming the ladder's press,
    ChunkKV's fields (``kernel_size``, ``budget``) are not its own."""
    with pytest.raises(ValueError, match=r"is not one of .*evaluation\.studies\.ladder\.PageEntroKVLadderPress's"):
        PageEntroKVPress(**options)
    PageEntroKVLadderPress(**options)  # the ladder's press takes it
    for name, value in (("kernel_size", 3), ("budget", "pages")):
        with pytest.raises(TypeError, match=name):
            PageEntroKVPress(**{name: value})
        assert PageEntroKVPress.removed_fields[name].moved_to == public_path(PageEntroKVLadderPress)


def test_page_mean_and_chunkkv_page_count():
    scores = torch.arange(10.0).view(1, 1, 10)
    assert page_scores(scores, 4, "mean").tolist() == [[[1.5, 5.5, 8.5]]]  # the partial page over its 2 positions
    assert page_scores(scores, 4, "mass").tolist() == [[[6.0, 22.0, 17.0]]]
    # ChunkKV keeps max(1, int(P (1 - ratio))) pages, a partial page counted as one
    for T, ratio, pages in [(100, 0.5, 3), (100, 0.9, 1), (96, 0.75, 1), (1000, 0.75, 15)]:
        plan = page_budget(T, ratio, 16, 4, 8, protect="none", budget="pages")
        assert int(plan.protected.sum()) + plan.num_selected == pages, (T, ratio)
    with pytest.raises(ValueError, match="budget='chunks' is not one of"):
        page_budget(100, 0.5, 16, 4, 8, budget="chunks")


def test_shared_selection_keeps_one_page_set_for_all_groups(model):
    ids = torch.randint(4, 120, (1, 300), generator=torch.Generator().manual_seed(0))
    press = PageEntroKVLadderPress(0.75, window_size=16, page_size=8, group_selection="shared", record=True)
    cache = _prefill(model, press, ids)
    for record in press.records:
        assert (record["kept_pages"] == record["kept_pages"][0]).all()  # every group the same pages
    group = PageEntroKVPress(compression_ratio=0.75, window_size=16, page_size=8, record=True)
    _prefill(model, group, ids)
    assert any(not (r["kept_pages"] == r["kept_pages"][0]).all() for r in group.records)  # which "shared" removes
    assert [layer.keys.shape[2] for layer in cache.layers] == [r["kept_tokens"] for r in press.records]


def test_snapkv_pooling_ranks_pages_by_snapkvs_scores(model):
    """``pooling="snapkv"`` keeps, per group, the pages with the best chunk means of kvpress's SnapKV scores."""
    ids = torch.randint(4, 120, (1, 300), generator=torch.Generator().manual_seed(1))
    seen = []
    real = SnapKVPress.score

    def spy(self, *args):
        out = real(self, *args)
        seen.append((self.window_size, self.kernel_size, out))
        return out

    press = PageEntroKVLadderPress(0.5, window_size=16, pooling="snapkv", kernel_size=3, page_score="mean")
    press.record = True
    try:
        SnapKVPress.score = spy
        _prefill(model, press, ids)
    finally:
        SnapKVPress.score = real
    assert len(seen) == 3 and all(w == 16 and k == 3 for w, k, _ in seen)
    for (_, _, scores), record in zip(seen, press.records):
        pages = page_scores(scores, 32, "mean")[0]  # (G, P)
        free = ~torch.isin(torch.arange(pages.shape[-1]), record["protected_pages"])
        for g in range(pages.shape[0]):
            kept = set(record["kept_pages"][g].tolist()) - set(record["protected_pages"].tolist())
            best = pages[g][free].topk(len(kept)).values.min()
            assert all(float(pages[g][k]) >= float(best) for k in kept)


def test_bad_ablation_options_name_the_value():
    for kwargs, match in [
        ({"pooling": "snap"}, "pooling='snap' is not one of"),
        ({"budget": "chunks"}, "budget='chunks' is not one of"),
        ({"page_score": "median"}, "page_score='median' is not one of"),
        ({"group_selection": "all"}, "group_selection='all' is not one of"),
        ({"kernel_size": 0}, "kernel_size=0 must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            PageEntroKVLadderPress(**kwargs)
