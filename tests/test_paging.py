"""Page policy under the strict budget: docs/methods.md §1 steps 6-9, paper 000 Theorem 3 (cardinality),
paper 001 section 7 (Proposition 7.1; its union and byte accounting: tests/test_uor.py)."""

from __future__ import annotations

import logging
import math
from fractions import Fraction

import pytest
import torch

from presses.core.paging import (
    page_budget,
    page_scores,
    protected_page_mask,
    select_pages,
    select_positions,
    token_budget,
)


def brute_force_plan(T: int, ratio: str, B: int, n_sink: int, W: int):
    """Independent plan from docs/methods.md §1 steps 7-8: (b, protected page set, protected tokens, K)."""
    b = math.floor(T * (1 - Fraction(ratio)))
    page_of = [j // B for j in range(T)]
    protected = {page_of[j] for j in range(T) if j < n_sink or j >= T - W}
    prot_tokens = sum(1 for j in range(T) if page_of[j] in protected)
    n_free = len(set(page_of) - protected)
    K = min((b - prot_tokens) // B, n_free) if prot_tokens <= b else None
    return b, protected, prot_tokens, K


def test_token_budget_is_exact_floor():
    assert token_budget(1000, 0.9) == 100  # 1000 * (1 - 0.9) = 99.999... in binary floating point
    assert token_budget(1001, 0.5) == 500
    assert token_budget(7, 0.0) == 7
    for bad in (1.0, -0.1, 1.2):
        with pytest.raises(ValueError, match=f"compression_ratio={bad} must be in \\[0, 1\\)"):
            token_budget(10, bad)


@pytest.mark.parametrize("B", [1, 8, 16, 32, 64])
def test_exact_cardinality(B):
    g = torch.Generator().manual_seed(B)
    n_sink, W, G = 4, 16, 3
    checked = 0
    for T in [17, 33, 64, 65, 100, 127, 128, 129, 255, 300, 511, 777, 1024, 1500]:
        for ratio in ["0.1", "0.25", "0.5", "0.7", "0.8", "0.9", "0.95"]:
            b, protected, prot_tokens, K = brute_force_plan(T, ratio, B, n_sink, W)
            scores = torch.rand(2, G, T, generator=g)
            if K is None:
                with pytest.raises(ValueError):
                    select_positions(scores, float(ratio), B, n_sink, W)
                continue
            pos, pages, plan = select_positions(scores, float(ratio), B, n_sink, W)
            n = prot_tokens + K * B
            assert (plan.budget, plan.protected_tokens, plan.num_selected, plan.kept_tokens) == (b, prot_tokens, K, n)
            assert pos.shape == (2, G, n) and n <= b  # same count for every row and group, never > b
            assert pages.shape == (2, G, len(protected) + K)
            assert bool((pos[..., 1:] > pos[..., :-1]).all())  # ascending, unique
            for row in pos.reshape(-1, n).tolist():
                kept_pages = {j // B for j in row}
                assert protected <= kept_pages  # sinks, window and the partial last page
                # whole pages only: each kept page contributes all of its positions
                assert sorted(row) == [j for j in range(T) if j // B in kept_pages]
            checked += 1
    assert checked > 20


def test_block_max_selects_top_pages_and_mass_ablation():
    B, T = 4, 40  # 10 pages; protected: page 0 (sink) and pages touching the last 4 positions (page 9)
    scores = torch.full((1, 1, T), 0.01)
    scores[0, 0, 4 * 3 + 1] = 0.5  # page 3: one spike
    scores[0, 0, 4 * 6 : 4 * 7] = 0.2  # page 6: high mass, lower max
    scores[0, 0, 4 * 5] = 0.3  # page 5
    ps_max = page_scores(scores, B, "block_max")
    ps_mass = page_scores(scores, B, "mass")
    assert ps_max.shape == ps_mass.shape == (1, 1, 10)
    assert ps_max[0, 0, 3].item() == pytest.approx(0.5) and ps_mass[0, 0, 6].item() == pytest.approx(0.8)
    # b = 20 tokens: protected = 8 tokens, K = 3 pages of 4
    _, pages, plan = select_positions(scores, 0.5, B, 2, 4, page_score="block_max")
    assert plan.num_selected == 3 and pages[0, 0].tolist() == [0, 3, 5, 6, 9]
    _, pages_mass, _ = select_positions(scores, 0.6, B, 2, 4, page_score="mass")  # b = 16: K = 2
    assert pages_mass[0, 0].tolist() == [0, 3, 6, 9]  # 0.53, 0.8 beat page 5's 0.33
    _, pages_max, _ = select_positions(scores, 0.6, B, 2, 4, page_score="block_max")
    assert pages_max[0, 0].tolist() == [0, 3, 5, 9]
    # partial last page: block-max uses only its existing positions
    ps = page_scores(torch.tensor([[1.0, 2.0, 3.0, -5.0, -6.0]]), 3, "block_max")
    assert ps.tolist() == [[3.0, -5.0]]
    with pytest.raises(ValueError, match="page_score='sum' is not one of"):
        page_scores(scores, B, "sum")


def test_halo_max_lets_a_page_share_a_score_at_its_neighbours_edge():
    """An answer cut by the page grid: its best token ends page 2; with the halo (B // 4 = 2 positions) page 3 scores
    it too, so both halves are kept; a score two positions inside page 2 is out of page 3's halo."""
    B, T = 8, 48  # 6 pages
    scores = torch.full((1, 1, T), 0.01)
    scores[0, 0, 3 * B - 1] = 0.9  # last position of page 2
    scores[0, 0, 5 * B - 3] = 0.5  # third-last of page 4: out of page 5's halo (two positions)
    halo = page_scores(scores, B, "halo_max")
    plain = page_scores(scores, B, "block_max")
    assert plain[0, 0].tolist() == pytest.approx([0.01, 0.01, 0.9, 0.01, 0.5, 0.01])
    assert halo[0, 0].tolist() == pytest.approx([0.01, 0.01, 0.9, 0.9, 0.5, 0.01])
    _, pages, _ = select_positions(scores, 1 - 2 * B / T, B, 0, 1, protect="none", page_score="halo_max")
    assert pages[0, 0].tolist() == [2, 3]  # both halves of the cut answer
    _, pages, _ = select_positions(scores, 1 - 2 * B / T, B, 0, 1, protect="none", page_score="block_max")
    assert pages[0, 0].tolist() == [2, 4]
    assert page_scores(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]), 4, "halo_max").tolist() == [
        [1.0, 1.0]
    ]  # partial last page


def test_ties_go_to_lower_page_index():
    T, B = 64, 4  # 16 pages; page 0 and page 15 protected (n_sink=1, W=1)
    scores = torch.zeros(1, 2, T)
    scores[0, 1, 40] = 1.0  # group 1: page 10 strictly best, rest tied
    _, pages, plan = select_positions(scores, 0.5, B, 1, 1)  # b = 32, protected 8 -> K = 6
    assert plan.num_selected == 6
    assert pages[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 15]
    assert pages[0, 1].tolist() == [0, 1, 2, 3, 4, 5, 10, 15]
    nan_scores = torch.rand(1, 1, 14)
    nan_scores[0, 0, 3] = float("nan")
    top = select_pages(nan_scores, torch.zeros(14, dtype=torch.bool), 13)
    assert 3 not in top[0, 0].tolist()  # NaN ranks last


def test_budget_conflict_message_and_keep_protected(caplog):
    # T=100, W=64, B=16, n_sink=4: protected pages 0 and 2..6 = 16 + 16*4 + 4 = 84 tokens > b = 50
    with pytest.raises(ValueError) as err:
        page_budget(100, 0.5, 16, 4, 64, on_budget_conflict="raise")
    msg = str(err.value)
    for needle in ("84 tokens", "b=50", "T=100", "page_size=16", "n_sink=4", "window_size=64"):
        assert needle in msg, (needle, msg)
    with caplog.at_level(logging.WARNING, logger="presses.core.paging"):
        pos, pages, plan = select_positions(torch.rand(1, 2, 100), 0.5, 16, 4, 64, on_budget_conflict="keep_protected")
    assert plan.conflict and plan.kept_tokens == 84 and plan.num_selected == 0
    assert pages[0, 0].tolist() == [0, 2, 3, 4, 5, 6] and pos.shape == (1, 2, 84)
    assert any("84 tokens" in rec.getMessage() for rec in caplog.records)
    with pytest.raises(ValueError, match="on_budget_conflict='ignore'"):
        page_budget(100, 0.5, 16, 4, 64, on_budget_conflict="ignore")


@pytest.mark.parametrize(
    ("T", "ratio", "expected"),
    [
        # T=100, B=16, W=64, n_sink=4, b=50: sink page 0 and window pages 2..6 (84 tokens). Window pages drop
        # oldest first until it fits: 2 (68), 3 (52), 4 (36 <= 50); K = floor(14 / 16) = 0.
        (100, 0.5, {"protected": [0, 5, 6], "K": 0, "kept": 36}),
        # T=128, b=25: pages 4..7 are window pages, 0 the sink page (80 tokens): 4, 5, 6, 7 drop, {0} = 16 fits.
        (128, 0.8, {"protected": [0], "K": 0, "kept": 16}),
        # T=23, b=4: page 0 (sink and window) drops, the partial last page (7 tokens > b) stays: one page over b.
        (23, 0.8, {"protected": [1], "K": 0, "kept": 7}),
        # T=23, b=11: the same, and 11 - 7 leaves no room for a full page.
        (23, 0.5, {"protected": [1], "K": 0, "kept": 7}),
        # T=32, b=3, two full pages: both drop (window first, then the sink page); nothing protected, K = 0: whole
        # pages would keep nothing, so a partial page keeps the 3 best tokens (never an empty layer).
        (32, 0.9, {"protected": [], "K": 0, "kept": 3}),
    ],
)
def test_protection_shrinks_window_first_sink_last(T, ratio, expected):
    """docs/methods.md §1.12, worked by hand: every length compresses, within one page of the budget."""
    plan = page_budget(T, ratio, 16, 4, 64)  # default on_budget_conflict="shrink"
    assert plan.shrunk and not plan.conflict
    assert plan.protected.nonzero().squeeze(-1).tolist() == expected["protected"]
    assert plan.num_selected == expected["K"] and plan.kept_tokens == expected["kept"]
    assert plan.kept_tokens <= plan.budget + 16 - 1
    pos, pages, _ = select_positions(torch.rand(2, 3, T), ratio, 16, 4, 64, on_budget_conflict="shrink")
    assert pos.shape == (2, 3, expected["kept"])


def test_protect_none_keeps_only_a_partial_last_page():
    assert protected_page_mask(100, 16, 4, 64, protect="none").nonzero().squeeze(-1).tolist() == [6]
    assert not protected_page_mask(96, 16, 4, 64, protect="none").any()
    plan = page_budget(96, 0.5, 16, 4, 64, protect="none")  # b = 48: plain top-3 of 6 pages
    assert plan.num_selected == 3 and plan.kept_tokens == 48 and not plan.shrunk
    scores = torch.arange(96.0).flip(0).view(1, 1, 96)  # earlier pages score higher
    pos, pages, _ = select_positions(scores, 0.5, 16, 4, 64, protect="none")
    assert pages[0, 0].tolist() == [0, 1, 2] and pos[0, 0].tolist() == list(range(48))


def test_everything_protected_and_fits_keeps_all():
    # T=40, B=16, W=30: pages 0..2 all protected (40 tokens); at ratio 0 they fit b = 40
    pos, pages, plan = select_positions(torch.rand(1, 2, 40), 0.0, 16, 4, 30)
    assert not plan.conflict and plan.kept_tokens == 40 and plan.num_selected == 0
    assert pos[0, 1].tolist() == list(range(40)) and pages[0, 0].tolist() == [0, 1, 2]
    # any positive ratio makes b < T = protected tokens: a conflict, never an empty cache
    with pytest.raises(ValueError, match="b=39"):
        select_positions(torch.rand(1, 2, 40), 0.02, 16, 4, 30, on_budget_conflict="raise")


def test_prop71_competitive_retention():
    """Paper 001 Prop. 7.1: with K >= 1 block-max pages kept, any token of pooled mass > 1/(K+1)
    keeps its page."""
    g = torch.Generator().manual_seed(7)
    hits = 0
    for trial in range(200):
        T = int(torch.randint(80, 400, (1,), generator=g))
        B = [1, 4, 8, 16][trial % 4]
        ratio = [0.5, 0.7, 0.8, 0.9][(trial // 4) % 4]
        conc = float(torch.empty(1).uniform_(0.02, 2.0, generator=g))
        p = torch.distributions.Dirichlet(torch.full((T,), conc)).sample((1, 3))  # (1, G=3, T)
        # plant competing spikes so that some token exceeds 1/(K+1)
        spikes = torch.randint(0, T, (3,), generator=g)
        p[0, torch.arange(3), spikes] += torch.rand(3, generator=g) * 2
        p = p / p.sum(-1, keepdim=True)
        try:
            _, pages, plan = select_positions(p, ratio, B, 4, 8)
        except ValueError:
            continue
        K = plan.num_selected
        if K < 1:
            continue
        for gi in range(3):
            heavy = (p[0, gi] > 1.0 / (K + 1)).nonzero().squeeze(-1)
            for j in heavy.tolist():
                assert j // B in pages[0, gi].tolist(), (T, B, ratio, K, j)
                hits += 1
    assert hits > 50
