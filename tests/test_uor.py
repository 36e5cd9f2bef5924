"""UOR analysis: certificates (paper 000 Table 2, Theorem 1, Corollary 1, Remark 1), head-independent
replay on synthetic selections, the pooled row, byte accounting (paper 001 section 7), the ablation
and census helpers, and the capture driver on a tiny random GQA Llama (docs/methods.md §2)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from evaluation.uor.pages import allocation_bytes, page_union, union_bytes
from evaluation.uor.replay import (
    alpha_sweep,
    bonferroni_bound,
    bonferroni_threshold,
    classify_heads,
    head_independent_replay,
    pages_touched,
    pooled_replay,
    r2_identity,
    sandwich_bounds,
    sandwich_threshold,
    selection_masks,
    selection_size,
    set_statistics,
    summarize_cells,
    tau_sweep,
    top_s,
)
from presses.core.paging import select_positions


def random_sets(r: int, s: int, T: int, n: int, seed: int) -> torch.Tensor:
    """``(n, r, T)`` masks of ``r`` random ``s``-subsets of ``range(T)`` per cell."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(n, r, T, generator=g).argsort(-1)[..., :s]
    return selection_masks(idx, T)


# -- certificates: Table 2 ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("r", "bonf", "sand"), [(4, Fraction(1, 6), Fraction(1, 5)), (8, Fraction(3, 28), Fraction(3, 11))]
)
def test_table2_thresholds(r, bonf, sand):
    assert bonferroni_threshold(r) == pytest.approx(float(bonf), abs=1e-15)
    assert sandwich_threshold(r) == pytest.approx(float(sand), abs=1e-15)
    # the thresholds are where each lower bound equals 2
    assert bonferroni_bound(r, float(bonf)) == pytest.approx(2.0, abs=1e-12)
    assert sandwich_bounds(r, float(sand), 0.0)[0] == pytest.approx(2.0, abs=1e-12)
    # and just beyond them the certificate no longer holds
    assert bonferroni_bound(r, float(bonf) + 1e-3) < 2.0
    assert sandwich_bounds(r, float(sand) + 1e-3, 0.0)[0] < 2.0


def test_table2_extremes():
    for r in (2, 3, 4, 6, 8):
        # disjoint: both lower bounds are r (tight); consensus: sandwich is 1 without a clamp
        assert bonferroni_bound(r, 0.0) == r
        assert sandwich_bounds(r, 0.0, 0.0) == (r, r)
        assert sandwich_bounds(r, 1.0, 1.0)[0] == pytest.approx(1.0)
        assert sandwich_bounds(r, 1.0, 1.0)[1] == pytest.approx(r - 1.0)
        assert bonferroni_bound(r, 1.0) == 1.0  # needs the clamp at consensus when r > 2


def test_r3_bonferroni_is_the_wider_certificate():
    # (r-2)/(r(r-1)) vs (r-2)/(3r-2): the sandwich threshold is wider only for r > 2 + sqrt(2)
    assert bonferroni_threshold(3) == pytest.approx(1 / 6)
    assert sandwich_threshold(3) == pytest.approx(1 / 7)
    assert sandwich_threshold(4) > bonferroni_threshold(4)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_group_ratio(bad):
    with pytest.raises(ValueError, match=f"r={bad}"):
        bonferroni_bound(bad, 0.5)


def test_thresholds_need_two_heads():
    with pytest.raises(ValueError, match="r=1"):
        bonferroni_threshold(1)
    with pytest.raises(ValueError, match="r=1"):
        sandwich_threshold(1)


# -- r = 2 identity and the bounds on random set families -------------------------------------------


@pytest.mark.parametrize(("s", "T"), [(1, 3), (3, 8), (5, 10), (20, 64), (7, 7)])
def test_r2_identity_on_random_pairs(s, T):
    st = set_statistics(random_sets(2, s, T, 200, seed=s * 31 + T))
    expected = r2_identity(st["j_bar"])
    assert torch.allclose(st["uor"], expected, rtol=0, atol=1e-12)
    assert torch.equal(st["j_bar"], st["j_max"])
    # the sandwich upper bound is exact at r = 2
    _, hi = sandwich_bounds(2, st["j_bar"], st["j_max"])
    assert torch.allclose(hi, st["uor"], atol=1e-12)


@pytest.mark.parametrize(("r", "s", "T"), [(3, 4, 12), (4, 5, 20), (6, 3, 30), (8, 6, 24), (3, 10, 10)])
def test_bounds_hold_on_random_families(r, s, T):
    st = set_statistics(random_sets(r, s, T, 300, seed=r * 100 + s))
    lo_b = bonferroni_bound(r, st["j_bar"])
    lo_s, hi_s = sandwich_bounds(r, st["j_bar"], st["j_max"])
    eps = 1e-12
    assert bool((lo_b <= st["uor"] + eps).all())
    assert bool((lo_s <= st["uor"] + eps).all())
    assert bool((st["uor"] <= hi_s + eps).all())
    assert bool((st["uor"] >= 1).all()) and bool((st["uor"] <= min(r, T / s) + eps).all())


def test_set_statistics_rejects_unequal_sets():
    masks = torch.zeros(2, 6, dtype=torch.bool)
    masks[0, :2] = True
    masks[1, :3] = True
    with pytest.raises(ValueError, match="same number s >= 1"):
        set_statistics(masks)


# -- replay on synthetic selections with a known union -----------------------------------------------


def synthetic_scores() -> torch.Tensor:
    """``(2, 6, 40)``: 2 layers, H_Q = 6, G = 2 (r = 3), s = 5 at k/T = 0.125.

    Layer 0, group 0: heads pick {0..4}, {0..4}, {5..9}   -> union 10, UOR 2, J = (1, 0, 0)
    Layer 0, group 1: heads pick {10..14}, {15..19}, {20..24} -> union 15, UOR 3, J = 0
    Layer 1: every head of both groups picks {30..34}       -> UOR 1, J = 1
    """
    x = torch.rand(2, 6, 40, generator=torch.Generator().manual_seed(0)) * 0.1
    picks = [[range(0, 5), range(0, 5), range(5, 10), range(10, 15), range(15, 20), range(20, 25)], [range(30, 35)] * 6]
    for layer, heads in enumerate(picks):
        for h, pos in enumerate(heads):
            x[layer, h, list(pos)] += 1.0 + torch.arange(5) * 0.01
    return x


def test_replay_known_union():
    out = head_independent_replay(synthetic_scores(), num_groups=2, k_over_t=0.125)
    assert out["s"].tolist() == [[5, 5], [5, 5]]
    assert out["union"].tolist() == [[10, 15], [5, 5]]
    assert out["uor"].tolist() == [[2.0, 3.0], [1.0, 1.0]]
    assert torch.allclose(out["j_bar"], torch.tensor([[1 / 3, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert out["j_max"].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    # group (0, 0): Bonferroni 3 - 6/3 = 1, sandwich 3 / (1 + 4 * (1/3) / (4/3)) = 1.5: neither certifies 2
    assert out["bonferroni_lower"][0, 0].item() == pytest.approx(1.0)
    assert out["sandwich_lower"][0, 0].item() == pytest.approx(1.5)
    assert out["sandwich_upper"][0, 0].item() == pytest.approx(2.0)  # 3 - 2 * 1 / 2
    assert out["cert_bonferroni"].tolist() == [[False, True], [False, False]]
    assert out["cert_sandwich"].tolist() == [[False, True], [False, False]]
    row = summarize_cells([out])
    assert row["cells"] == 4 and row["skipped"] == 0
    assert row["uor_mean"] == pytest.approx(7 / 4)
    assert row["uor_max"] == 3.0
    assert row["frac_uor_gt1"] == pytest.approx(0.5)
    assert row["frac_uor_ge2"] == pytest.approx(0.5)
    assert (row["cert_bonferroni"], row["cert_sandwich"]) == (1, 1)


def test_replay_counts_non_finite_cells_as_skipped():
    x = synthetic_scores()
    x[1, 0, 3] = float("nan")
    row = summarize_cells([head_independent_replay(x, 2, 0.125)])
    assert row["skipped"] == 1 and row["cells"] == 3


def test_top_s_ties_go_to_lower_index():
    assert top_s(torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0]), 2).tolist() == [1, 2]


@pytest.mark.parametrize(
    ("k", "T", "match"),
    [(0.0, 100, r"k_over_t=0.0 must be in \(0, 1\]"), (1.5, 100, r"k_over_t=1.5"), (0.02, 10, "selects s=0")],
)
def test_selection_size_errors(k, T, match):
    with pytest.raises(ValueError, match=match):
        selection_size(T, k)


def test_replay_rejects_bad_groups():
    with pytest.raises(ValueError, match="num_groups=4 must divide"):
        head_independent_replay(torch.rand(6, 20), 4, 0.1)


# -- the pooled Page-EntroKV row is exactly 1 ---------------------------------------------------------


@pytest.mark.parametrize("k", [0.02, 0.05, 0.1, 0.2])
def test_pooled_row_is_exactly_one(k):
    from presses.core.pooling import pooled_group_scores

    attn = torch.softmax(torch.randn(4, 9, 300, generator=torch.Generator().manual_seed(1)) * 3, -1)
    pooled, _ = pooled_group_scores(attn, 3, n_sink=4, alpha=2.0, tau=0.5, pooling="entropy")
    out = pooled_replay(pooled, r=3, k_over_t=k)
    assert bool((out["uor"] == 1.0).all()) and bool((out["j_bar"] == 1.0).all())
    row = summarize_cells([out])
    assert row["uor_mean"] == 1.0 and row["uor_max"] == 1.0 and row["frac_uor_gt1"] == 0.0
    assert row["cert_bonferroni"] == row["cert_sandwich"] == 0
    # while the head-independent replay of the same rows does pay a union
    assert summarize_cells([head_independent_replay(attn, 3, k)])["uor_mean"] > 1.0


# -- bytes --------------------------------------------------------------------------------------------


def test_bytes_formulas():
    d, B, e = 64, 16, 2
    # per-group allocation 2 e d B sum K_{l,g}
    assert allocation_bytes([3, 4, 5], d, B, e) == 2 * 2 * 64 * 16 * 12 == 49152
    # union materialisation 2 e d B G sum U_l
    assert union_bytes([5, 7], 3, d, B, e) == 2 * 2 * 64 * 16 * 3 * 12 == 147456
    pages = torch.tensor([[0, 1, 2, 9], [0, 1, 3, 9], [0, 2, 4, 9]])
    assert page_union(pages) == 6
    assert pages_touched(torch.tensor([[0, 1, 15, 16, 47], [3, 3, 3, 3, 3]]), 16).tolist() == [3, 1]


def test_union_and_byte_accounting():
    """Prop. 7.1 second part: K <= U_l <= min(G K, N_P); payload formulas of paper 001 section 7."""
    g = torch.Generator().manual_seed(3)
    T, B, G = 512, 16, 4
    _, pages, plan = select_positions(torch.rand(1, G, T, generator=g), 0.75, B, 4, 32)
    n_pages = pages.shape[-1]
    U = page_union(pages[0])
    assert n_pages <= U <= min(G * n_pages, plan.num_pages)
    identical = pages[0, :1].expand(G, -1)
    assert page_union(identical) == n_pages  # one shared selection: union equals the group's own set
    K = [n_pages] * G * 2  # two layers
    d, e = 64, 2
    assert allocation_bytes(K, d, B, e) == 2 * e * d * B * n_pages * G * 2
    assert union_bytes([U, U], G, d, B, e) == 2 * e * d * B * G * 2 * U
    assert union_bytes([U, U], G, d, B, e) >= allocation_bytes(K, d, B, e)


def test_page_accounting_from_records():
    from evaluation.uor.study import page_accounting

    recs = [
        {"layer_idx": 0, "kept_pages": torch.tensor([[0, 1, 5], [0, 2, 5], [0, 1, 5]])},
        {"layer_idx": 1, "kept_pages": torch.tensor([[0, 3, 5], [0, 3, 5], [0, 3, 5]])},
    ]
    rows = page_accounting(recs, head_dim=64, page_size=16, bytes_per_element=2)
    assert [r["union_pages"] for r in rows] == [4, 3]
    assert [r["pages_per_group"] for r in rows] == [3, 3]
    unit = 2 * 2 * 64 * 16
    assert [r["allocation_bytes"] for r in rows] == [unit * 9, unit * 9]
    assert [r["union_bytes"] for r in rows] == [unit * 3 * 4, unit * 3 * 3]
    assert rows[0]["union_ratio"] == pytest.approx(12 / 9) and rows[1]["union_ratio"] == 1.0


# -- ablations and census -----------------------------------------------------------------------------


def test_tau_sweep_monotone_to_mean_pooling():
    ent = torch.rand(5, 9, generator=torch.Generator().manual_seed(2)) * 4
    out = tau_sweep(ent, 3, [2.0, 0.1, 0.5, float("inf"), 1.0])
    assert out["taus"] == [0.1, 0.5, 1.0, 2.0, float("inf")]
    assert out["monotone"] and out["violations"] == 0
    assert torch.allclose(out["max_w"][-1], torch.full((5, 3), 1 / 3))
    assert torch.allclose(out["std_w"][-1], torch.zeros(5, 3), atol=1e-7)
    means = [float(m.mean()) for m in out["max_w"]]
    assert all(a > b for a, b in zip(means, means[1:]))


def test_alpha_sweep_range_and_order():
    T = 200
    attn = torch.softmax(torch.randn(3, 9, T, generator=torch.Generator().manual_seed(3)) * 2, -1)
    out = alpha_sweep(attn, 3, n_sink=4, alphas=[0.5, 1.0, 2.0, float("inf")])
    for v in out.values():
        assert v["violations"] == 0 and 0 <= v["h_min"] <= v["h_max"] <= math.log(T - 4)
    # Rényi entropy is non-increasing in the order, head by head
    hs = [out[a]["entropy"] for a in (0.5, 1.0, 2.0, float("inf"))]
    assert all(bool((b <= a + 1e-5).all()) for a, b in zip(hs, hs[1:]))


def test_classify_heads_rule():
    T, n_sink = 50, 4
    attn = torch.full((4, T), 1.0 / T)
    attn[0] = 0.1 / (T - n_sink)  # sink: 0.9 of the mass on the first 4 positions
    attn[0, :n_sink] = 0.9 / n_sink
    attn[1] = 0.5 / (T - 1)  # retrieval: peak on the needle position 20
    attn[1, 20] = 0.5
    attn[2] = 0.5 / (T - 1)  # contextual: peak elsewhere
    attn[2, 30] = 0.5
    attn[3, :n_sink] = 0.6 / n_sink  # sink whose residual peaks on the needle: still a sink
    attn[3, n_sink:] = 0.3 / (T - n_sink - 1)
    attn[3, 20] = 0.1
    attn[3] /= attn[3].sum()
    labels = classify_heads(attn, n_sink, 0.5, torch.tensor([20, 21]))
    assert labels.tolist() == [0, 1, 2, 0]
    assert classify_heads(attn, n_sink, 0.5, None).tolist() == [0, 2, 2, 0]
    with pytest.raises(ValueError, match="sink_threshold=0 must be in"):
        classify_heads(attn, n_sink, 0, None)


# -- capture driver on a tiny random GQA Llama --------------------------------------------------------


def test_capture_on_tiny_llama(tiny_llama):
    from evaluation.uor.study import capture
    from presses.observers import observer_attention  # noqa: F401  (the capture must agree with it)
    from presses.page_entrokv import PageEntroKVPress

    torch.manual_seed(0)
    model = tiny_llama(num_heads=6, num_kv_heads=2, num_layers=2, attn_implementation="eager")
    T, W = 96, 16
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(0))
    presses = {
        "entropy": PageEntroKVPress(compression_ratio=0.5, window_size=W, page_size=8, record=True),
        "mean": PageEntroKVPress(compression_ratio=0.5, window_size=W, page_size=8, pooling="mean", record=True),
    }
    cap = capture(model, ids, presses, window_size=W)
    for name in ("h2o", "last_row", "snapkv"):
        assert cap.scores[name].shape == (2, 6, T)
    # column sums of a row-stochastic causal matrix sum to T; observer rows to 1
    assert torch.allclose(cap.scores["h2o"].sum(-1), torch.full((2, 6), float(T)), atol=1e-3)
    assert torch.allclose(cap.scores["last_row"].sum(-1), torch.ones(2, 6), atol=1e-5)
    assert torch.allclose(cap.scores["snapkv"].sum(-1), torch.ones(2, 6), atol=1e-5)
    # the full cache is untouched; each press cache holds exactly its strict budget
    assert [cap.full_cache.get_seq_length(i) for i in range(2)] == [T, T]
    for name in presses:
        assert len(cap.records[name]) == 2
        kept = cap.records[name][0]["kept_tokens"]
        assert kept <= T // 2
        assert [cap.caches[name].get_seq_length(i) for i in range(2)] == [kept, kept]
    # the snapkv scorer is the press's observer attention: same entropies as the press recorded
    from presses.core.pooling import pooled_group_scores

    p = presses["entropy"]
    _, diag = pooled_group_scores(cap.scores["snapkv"], 2, p.n_sink, p.alpha, p.tau, p.pooling, diagnostics=True)
    rec = torch.stack([r["entropy"] for r in cap.records["entropy"]])
    assert torch.allclose(diag["entropy"], rec, atol=1e-5)


def test_capture_needs_eager(tiny_llama):
    from evaluation.uor.study import capture

    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=1, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="eager"):
        capture(model, torch.randint(3, 128, (1, 40)), {}, window_size=8)


def test_slot_mass_from_records_and_pooled_rows():
    """Fig. 6's table: pooled mass summed by in-page slot over the kept full pages (a partial last page and
    pages not kept do not count), normalised; protected pages are left out of the unprotected share."""
    from evaluation.uor.study import Capture, pooled_rows, slot_mass_rows

    L, G, r, B, T = 2, 2, 2, 4, 18  # 4 full pages and a partial one
    rows = torch.full((L, G * r, T), 1.0)
    rows[..., 0::B] = 5.0  # slot 0 of every page carries more
    rows[..., 1] = 20.0  # slot 1 of page 0, the protected page: only in the share over all kept pages
    rows[..., 16:] = 100.0  # the partial page: never counted
    rows = rows / rows.sum(-1, keepdim=True)
    records = [
        {
            "layer_idx": layer,
            "T": T,
            "page_size": B,
            "protected_pages": torch.tensor([0]),
            "kept_pages": torch.tensor([[0, 2, 4], [1, 3, 4]]),
        }
        for layer in range(L)
    ]
    cap = Capture(
        scores={"snapkv": rows}, full_cache=None, caches={}, records={"page_entrokv": records}, cache_lengths={}
    )
    out = slot_mass_rows([cap], pooled_rows([cap], G, n_sink=1, alpha=2.0, tau=0.5))
    assert [x["slot"] for x in out] == [0, 1, 2, 3]
    # every head has the same row, so the pooled row is that row (the scale cancels in the shares); kept full
    # pages per layer: 0, 2 (group 0) and 1, 3 (group 1), slot sums 5 + 20 + 1 + 1 on page 0, 5 + 1 + 1 + 1 on others
    assert [x["share_kept"] for x in out] == pytest.approx([20 / 51, 23 / 51, 4 / 51, 4 / 51])
    assert [x["share_unprotected"] for x in out] == pytest.approx([5 / 8, 1 / 8, 1 / 8, 1 / 8])
    assert out[0]["pages_kept"] == L * 4 and out[0]["pages_unprotected"] == L * 3  # page 0 of group 0 protected
    assert sum(x["share_kept"] for x in out) == pytest.approx(1.0) and out[0]["uniform"] == 0.25
    bare = Capture({"snapkv": rows}, None, {}, {}, {})
    assert slot_mass_rows([bare], pooled_rows([bare], G, 1, 2.0, 0.5)) == []
