"""Short prompts (issue 63 item 0, issue 65 item 2; docs/methods.md §1.12): no press of the project leaves a layer
of a non-empty prompt without entries, at any length, ratio, page size or protection; the page presses keep within
one page of their budget ``b = floor(T (1 - ratio))`` (a budget below one page: a partial page of the ``max(1, b)``
best tokens); a prompt that cannot keep its ratio by whole pages is logged once per press and setting, with the
shortest prompt length that keeps it (:func:`presses.core.paging.min_prompt_length`).

The page plan is checked exhaustively (every length 1..600, ten ratios, three page sizes, both protections: pure
arithmetic); the presses end to end on the tiny random Llama (2 layers, 4 query / 2 KV heads) on lengths at and
around page boundaries plus the issue's (96, 128, 202, 600), each (length, ratio) with one of the page sizes and
protections in turn so that every combination meets many lengths."""

from __future__ import annotations

import logging
import math
from itertools import cycle

import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from conftest import make_tiny_llama
from kvpress import KnormPress, KVzipPress
from test_entroprefill import TOK, prompt
from transformers import DynamicCache

from evaluation.studies.ladder import PageEntroKVLadderPress
from presses import (
    EntroPrefillPress,
    KVzipPagePress,
    KVzipSamplingPress,
    PageEntroKVPress,
    PageEntroKVReconstructionPress,
    ProbabilisticEvictionPress,
)
from presses.core.paging import (
    PROTECTIONS,
    min_prompt_length,
    page_budget,
    pages_to_positions,
    select_positions,
    select_tokens,
)
from presses.scorer_pages import GROUP_SELECTIONS, ScorerPagePress

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
PAGE_SIZES = (8, 16, 32)
#: 1, 2, around each page size's boundaries, the issue's lengths
LENGTHS = (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 128, 202, 600)
E2E_RATIOS = (0.1, 0.5, 0.8, 0.9, 0.95)
N_SINK, W = PageEntroKVPress.n_sink, PageEntroKVPress.window_size  # the press's defaults


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def kvzip_model(tmp_path_factory):
    """The tiny Llama with a checkpoint directory holding its tokenizer (kvpress's KVzip reloads it from there)."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    path = tmp_path_factory.mktemp("checkpoint")
    char_tokenizer().save_pretrained(path)
    model.config.name_or_path = str(path)
    return model


def ids_of(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(seed))


def prefill(model, press, T: int, seed: int = 0) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids_of(T, seed), past_key_values=cache)
    return cache


def cases(lengths=LENGTHS, ratios=E2E_RATIOS):
    """``(T, ratio, page_size, protect)``: every length and ratio, the page sizes and protections in turn."""
    combos = cycle([(B, p) for B in PAGE_SIZES for p in PROTECTIONS])
    return [(T, r, *next(combos)) for T in lengths for r in ratios]


def budget_of(T: int, ratio: float) -> int:
    return max(1, math.floor(T * (1 - ratio) + 1e-6))


def kept_per_head(model, cache) -> list[torch.Tensor]:
    """Per layer, ``(B, G)`` entries each KV head keeps: its cache length less kvpress's masked keys (KVzip)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        keys = cache.layers[i].keys
        kept = torch.full(keys.shape[:2], keys.shape[2], dtype=torch.long)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            rows, heads, _ = masked
            kept -= torch.bincount(rows * keys.shape[1] + heads, minlength=kept.numel()).view_as(kept)
        out.append(kept)
    return out


# ---------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("protect", PROTECTIONS)
@pytest.mark.parametrize("B", PAGE_SIZES)
def test_every_plan_keeps_at_least_one_token_and_within_a_page_of_its_budget(B, protect):
    """Every length 1..600 and ratio: ``1 <= kept``, ``b - B < kept < max(1, b) + B``; a partial page exactly when
    whole pages keep nothing; and every length from ``min_prompt_length`` on (and not the one below it) keeps its
    budget by whole pages, with no protection shrunk."""
    for ratio in RATIOS:
        shortest = min_prompt_length(ratio, B, N_SINK, W, protect)
        for T in range(1, 601):
            plan = page_budget(T, ratio, B, N_SINK, W, protect=protect)
            b, kept = plan.budget, plan.kept_tokens
            assert b == math.floor(T * (1 - ratio) + 1e-6)
            assert 1 <= kept < budget_of(T, ratio) + B and kept > b - B, (T, ratio, kept)
            whole = plan.protected_tokens + plan.num_selected * B
            assert plan.partial == (0 if whole else max(1, b)) and kept == (whole or plan.partial)
            keeps = not plan.shrunk and b >= B
            assert keeps or T < shortest, (T, ratio, shortest)
            assert not (T == shortest - 1 and keeps), (T, ratio, shortest)


@pytest.mark.parametrize("B", PAGE_SIZES)
def test_chunkkv_page_budget_and_kept_protected_pages_are_never_empty(B):
    """``budget="pages"`` (ChunkKV's count, at least one page) and ``keep_protected`` (the protected pages, more than
    the budget where they exceed it: ``conflict``) keep at least one token of every length."""
    for ratio in (0.5, 0.95):
        for T in range(1, 601):
            for protect in PROTECTIONS:
                plan = page_budget(T, ratio, B, N_SINK, W, protect=protect, budget="pages")
                assert 1 <= plan.kept_tokens < plan.budget + B and plan.budget >= B
            plan = page_budget(T, ratio, B, N_SINK, W, on_budget_conflict="keep_protected")
            assert plan.kept_tokens >= 1 and (plan.conflict or plan.kept_tokens < budget_of(T, ratio) + B)


def test_min_prompt_length_worked_by_hand():
    """Defaults (B=32, n_sink=4, W=64) at ratio 0.5: T=224 gives b=112 >= 96 protected tokens (sink page 0, window
    pages 5 and 6); T=223 gives b=111 < 127 (sink page, window pages 4, 5 and the 31-token page 6)."""
    assert min_prompt_length(0.5, 32, 4, 64) == 224
    assert page_budget(224, 0.5, 32, 4, 64).protected_tokens == 96
    assert page_budget(223, 0.5, 32, 4, 64).shrunk
    assert min_prompt_length(0.5, 32, 4, 64, protect="none") == 64  # only b >= B is needed: T (1 - 0.5) >= 32
    assert min_prompt_length(0.0, 32, 4, 64) == 1
    with pytest.raises(ValueError, match="compression_ratio=1.0 must be in"):
        min_prompt_length(1.0, 32, 4, 64)


def test_select_tokens_ranks_by_score_ties_to_the_lower_position():
    scores = torch.tensor([[1.0, 3.0, float("nan"), 3.0, 2.0]])
    assert select_tokens(scores, 2).tolist() == [[1, 3]]
    assert select_tokens(scores, 4).tolist() == [[0, 1, 3, 4]]  # NaN last
    with pytest.raises(ValueError, match=r"num_tokens=0 must be in \[1, 5\]"):
        select_tokens(scores, 0)
    # T=32 at 0.9 with pages of 16: b = 3 < 16, whole pages would keep nothing: a partial page of 3 tokens
    pos, pages, plan = select_positions(torch.rand(2, 3, 32), 0.9, 16, 4, 64, on_budget_conflict="shrink")
    assert plan.partial == 3 and pos.shape == (2, 3, 3) and pages.shape == (2, 3, 0)


# ---------------------------------------------------------------------------------------------- Page-EntroKV
def test_page_entrokv_never_leaves_a_layer_empty(model):
    """Each layer keeps the plan's count, ``1 <= kept``, within a page of the budget; the issue's cases: T=96 at
    0.8 and T=128 at 0.9 (default page size 32) keep their ``b`` best tokens, not nothing."""
    for T, ratio, B, protect in cases():
        press = PageEntroKVPress(ratio, page_size=B, protect=protect)
        cache = prefill(model, press, T)
        plan = page_budget(T, ratio, B, N_SINK, W, protect=protect)
        assert [cache.get_seq_length(i) for i in range(2)] == [plan.kept_tokens] * 2, (T, ratio, B, protect)
        assert 1 <= plan.kept_tokens < budget_of(T, ratio) + B and plan.kept_tokens > plan.budget - B
        assert press.summary().get("partial_page", 0) == int(plan.partial > 0)
    for T, ratio, b in ((96, 0.8, 19), (128, 0.9, 12)):
        press = PageEntroKVPress(ratio)
        assert prefill(model, press, T).get_seq_length(1) == b
        assert press.summary()["kept_entries"] == f"{float(b)},{float(b)}" and press.summary()["partial_page"] == 1


VARIANTS = [
    (PageEntroKVPress, {"pooling": "mean"}),
    (PageEntroKVPress, {"pooling": "max", "page_score": "mass"}),
    (PageEntroKVPress, {"page_score": "halo_max"}),
    (PageEntroKVPress, {"protect": "none", "n_sink": 0}),
    (PageEntroKVPress, {"group_selection": "union", "record": True}),
    (PageEntroKVPress, {"observer_window": "all", "max_fallback": 0.05}),
    (PageEntroKVPress, {"on_budget_conflict": "keep_protected"}),
    # the ablation ladder's ChunkKV options (evaluation/studies/ladder.py)
    (PageEntroKVLadderPress, {"pooling": "snapkv"}),
    (PageEntroKVLadderPress, {"page_score": "mean"}),
    (PageEntroKVLadderPress, {"budget": "pages"}),
    (PageEntroKVLadderPress, {"group_selection": "shared"}),
]


def _variant_id(value) -> str:
    return ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value.__name__


@pytest.mark.parametrize(("cls", "options"), VARIANTS, ids=_variant_id)
def test_page_entrokv_variants_never_leave_a_layer_empty(model, cls, options):
    """Every option of the press and of the ablation ladder's: each layer keeps at least one token; ``union`` keeps
    the union of its groups' selections (each within the plan), ``keep_protected`` its protected pages
    (``budget_conflict``)."""
    for T, ratio, B, _ in cases((1, 2, 9, 33, 96, 202), (0.5, 0.9, 0.95)):
        press = cls(ratio, page_size=B, **options)
        cache = prefill(model, press, T)
        plan = press._plan_cache and next(iter(press._plan_cache.values()))
        kept = [cache.get_seq_length(i) for i in range(2)]
        assert min(kept) >= 1, (T, ratio, B, kept)
        if options.get("group_selection") == "union":
            assert all(plan.kept_tokens <= k <= 2 * plan.kept_tokens for k in kept)  # G = 2 groups' selections
            for rec in press.records:
                chosen = plan.partial or pages_to_positions(rec["selected_pages"], T, B).shape[-1]
                assert chosen < budget_of(T, ratio) + B
        elif plan.conflict:
            assert kept == [plan.protected_tokens] * 2 and press.summary()["budget_conflict"] == 1
        else:
            budget = plan.budget if options.get("budget") == "pages" else budget_of(T, ratio)
            assert kept == [plan.kept_tokens] * 2 and plan.kept_tokens < budget + B


def test_a_short_prompt_is_logged_once_per_press_and_setting(model, caplog):
    """issue 65: T=202 at 0.5 keeps only its 74 protected tokens (sink page 32, window pages 32 + 10; effective
    compression 0.634): logged once with the numbers and the shortest length that keeps the ratio (224); a second
    short prompt is not logged again, another ratio of the same press is, a long enough prompt never is."""
    press = PageEntroKVPress(0.5)
    with caplog.at_level(logging.WARNING, logger="presses.page_entrokv.press"):
        prefill(model, press, 202)
        prefill(model, press, 150, seed=1)
        prefill(model, PageEntroKVPress(0.5), 224)  # keeps its budget: nothing to say
    messages = [r.getMessage() for r in caplog.records if r.name == "presses.page_entrokv.press"]
    assert len(messages) == 1, messages
    for part in ("T=202", "compression_ratio=0.5", "page_size=32", "b=101", "kept 74 tokens", "0.634", "at least 224"):
        assert part in messages[0], (part, messages[0])
    caplog.clear()
    press.compression_ratio = 0.8
    with caplog.at_level(logging.WARNING, logger="presses.page_entrokv.press"):
        prefill(model, press, 96)
        prefill(model, press, 97)
    messages = [r.getMessage() for r in caplog.records if r.name == "presses.page_entrokv.press"]
    assert len(messages) == 1 and "a partial page of its 19 best tokens" in messages[0]
    assert f"at least {min_prompt_length(0.8, 32, N_SINK, W)}" in messages[0]


@pytest.mark.parametrize("group_selection", GROUP_SELECTIONS)
def test_scorer_pages_never_leave_a_layer_empty(model, group_selection):
    """Any kvpress scorer's token scores by pages (``ScorerPagePress``, here K-norm's): the same plan, so the same
    partial page of the best tokens where whole pages would keep nothing."""
    for T, ratio, B, protect in cases((1, 2, 9, 31, 33, 96, 128, 202), (0.5, 0.8, 0.9, 0.95)):
        press = ScorerPagePress(
            press=KnormPress(), compression_ratio=ratio, page_size=B, protect=protect, group_selection=group_selection
        )
        cache = prefill(model, press, T)
        plan = page_budget(T, ratio, B, N_SINK, W, protect=protect)
        assert [cache.get_seq_length(i) for i in range(2)] == [plan.kept_tokens] * 2, (T, ratio, B, protect)
        assert 1 <= plan.kept_tokens < budget_of(T, ratio) + B


# ---------------------------------------------------------------------------------------------- KVzip's pass
@pytest.mark.parametrize("layerwise", [False, True])
def test_page_entrokv_reconstruction_never_leaves_a_head_empty(kvzip_model, layerwise, caplog):
    """Per layer (``layerwise``): Page-EntroKV's plan, a partial page below one page. Over all layers (kvpress's
    masking): every KV head keeps at least one entry, and the mean kept count stays within a page of ``b``."""
    for T, ratio, B, protect in cases((1, 2, 9, 33, 96, 202), (0.5, 0.9, 0.95)):
        press = PageEntroKVReconstructionPress(ratio, layerwise=layerwise, page_size=B, protect=protect)
        cache = prefill(kvzip_model, press, T)
        kept = kept_per_head(kvzip_model, cache)
        assert min(int(k.min()) for k in kept) >= 1, (T, ratio, B, protect, kept)
        mean = float(torch.stack(kept).double().mean())
        assert mean < budget_of(T, ratio) + B, (T, ratio, mean)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="presses.page_entrokv.press"):
        press = PageEntroKVReconstructionPress(0.9, layerwise=True)
        prefill(kvzip_model, press, 96)
        prefill(kvzip_model, press, 128)
    assert len([r for r in caplog.records if "best tokens" in r.getMessage()]) == 1  # once per press and setting


@pytest.mark.parametrize("n_sink", [0, KVzipPress.n_sink])
@pytest.mark.parametrize("layerwise", [False, True])
def test_kvzip_page_never_leaves_a_head_empty(kvzip_model, layerwise, n_sink, caplog):
    """kvpress masks ``int(L G T ratio)`` entries (per layer with ``layerwise``); on a prompt of a few tokens it can
    mask every entry of a head: that head keeps its best one, the others stay as kvpress masked them."""
    fixed = []
    with caplog.at_level(logging.WARNING, logger="presses.kvzip_pages.base"):
        for T, ratio, B, _ in cases((1, 2, 3, 9, 33, 96), (0.5, 0.9, 0.95)):
            press = KVzipPagePress(ratio, page_size=B, layerwise=layerwise, n_sink=n_sink)
            real = press.keep_one_per_head
            press.keep_one_per_head = lambda model, real=real: fixed.append(real(model)) or fixed[-1]
            cache = prefill(kvzip_model, press, T)
            kept = kept_per_head(kvzip_model, cache)
            assert min(int(k.min()) for k in kept) >= 1, (T, ratio, B, kept)
            masked = T * 4 - sum(int(k.sum()) for k in kept)  # L G T entries, 2 layers x 2 heads
            per = 2 * T if layerwise else 4 * T
            expected = int(per * ratio) * (2 if layerwise else 1)
            assert masked == expected - fixed[-1]  # kvpress's count, less the entries given back
    assert sum(fixed) > 0  # the case the guard is for did occur (e.g. T=1, 2 at 0.95)
    assert any("keeps its best entry" in r.getMessage() for r in caplog.records)


def test_kvzip_sampling_never_leaves_a_layer_empty(kvzip_model):
    """Random draws: at least one draw per group (``m >= 1``), so every layer keeps an entry; the budget holds in
    expectation only (the draw count's search target, ``tests/test_budget.py``)."""
    for T, ratio, B, _ in cases((1, 2, 9, 33, 96), (0.5, 0.9, 0.95)):
        press = KVzipSamplingPress(ratio, page_size=B)
        prefill(kvzip_model, press, T)
        kept = [float(k) for k in press.summary()["kept_entries"].split(",")]
        assert len(kept) == 2 and min(kept) >= 1, (T, ratio, B, kept)


# ---------------------------------------------------------------------------------------------- probabilistic
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # the interpreter's log(0)
def test_one_sure_entry_ends_the_draw_count_search():
    """A one-token prompt (or a prompt of one page) gives ``pi = [1]`` (or ``1 + 1e-7`` from float32 page sums):
    ``E[J(0)]`` was ``0 * log(0) = NaN`` and the search for ``m`` never ended. Now ``E[J(0)] = 0``, ``E[J(m)] = 1``
    for ``m >= 1``, in the torch reference and the Triton kernel (the interpreter on the CPU), and the search stops
    at the one draw every group makes."""
    from presses.core.coupon import expected_unique
    from presses.kernels.expected_unique import expected_unique_many_triton
    from presses.probabilistic.budget import search_num_samples

    for p in (1.0, 1.0 + 1e-7):
        pi = torch.tensor([[p, 0.0]], dtype=torch.float64)
        assert expected_unique(pi, 0).tolist() == [0.0] and expected_unique(pi, 3).tolist() == [1.0]
        got = expected_unique_many_triton(pi, torch.tensor([[0, 1, 7]]))
        assert got.tolist() == [[0.0, 1.0, 1.0]]
        assert int(search_num_samples(pi.float(), 0.95).max()) <= 1
    with pytest.raises(ValueError, match="E\\[J\\(m\\)\\] is NaN"):
        search_num_samples(torch.tensor([[float("nan"), 1.0]]), 0.5)


@pytest.mark.parametrize("budget", ["global", "head"])
@pytest.mark.parametrize("unit", ["token", "page"])
def test_probabilistic_never_leaves_a_layer_empty(model, unit, budget):
    """Random draws: kept > 0 in every layer and group always (at least one draw, ``m >= 1``, from a proposal with
    full mass); the budget ``(1 - ratio) T`` holds in expectation only, the draw count's search target
    (``presses.probabilistic.budget.search_num_samples``, tested in ``tests/test_budget.py``), not per draw."""
    for T, ratio, B, _ in cases((1, 2, 9, 17, 33, 96, 202, 600), (0.5, 0.9, 0.95)):
        press = ProbabilisticEvictionPress(ratio, unit=unit, budget=budget, page_size=B)
        cache = prefill(model, press, T)
        kept = [float(k) for k in press.summary()["kept_entries"].split(",")]
        assert len(kept) == 2 and min(kept) >= 1, (T, ratio, B, kept)
        assert all(1 <= cache.get_seq_length(i) <= T for i in range(2))


# ---------------------------------------------------------------------------------------------- EntroPrefill
def test_entroprefill_never_leaves_a_layer_empty():
    """The question is never pruned, so the retained support is never empty; its page policy (Page-EntroKV) keeps
    a partial page where its budget is below one page: after a prune (forced), after a bypass, on a prompt that
    is only a question."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=4, attn_implementation="sdpa")
    only_question = torch.tensor([TOK.encode("Question: which word comes first?\nAnswer:")])
    for ids, forced in ((prompt(2, words=2), 1), (prompt(4), 1), (prompt(3), None), (only_question, None)):
        for ratio in (0.5, 0.9, 0.95):
            for policy in (None, PageEntroKVPress(ratio, page_size=8, window_size=16, n_sink=2)):
                press = EntroPrefillPress(0.5, tokenizer=TOK, n_sink=2, force_layer=forced, page_policy=policy)
                cache = DynamicCache()
                with torch.no_grad(), press(model):
                    model.model(input_ids=ids, past_key_values=cache)
                kept = [cache.get_seq_length(i) for i in range(4)]
                assert min(kept) >= 1, (ids.shape[1], ratio, policy, kept)
                if policy is not None:  # each layer within a page of the policy's budget on the support T'
                    T_prime = press.summary()["T_prime"]
                    assert max(kept) < budget_of(T_prime, ratio) + 8, (T_prime, kept)
