"""EntroPrefill (paper 001 Algorithm 1, docs/methods.md §4): math properties, dual bound, forced-layer
equivalence on a tiny random Llama, fallbacks and the missing-question error."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

import presses.entroprefill.press as ep
from presses.core.observer import observer_attention_reference, window_queries
from presses.core.renyi import sink_isolate
from presses.entroprefill import EntroPrefillPress
from presses.entroprefill.dual import dual_bound, dual_certificate, greedy_feasible_scan
from presses.entroprefill.equations import (
    chunk_priorities,
    deletion_envelope,
    floor_weights,
    hoeffding_radius,
    pooled_proposal,
    row_attention,
    set_change,
)


class CharTokenizer:
    """ASCII characters as token ids (the tiny Llama has a 128-token vocabulary)."""

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)

    def encode(self, text):
        return [ord(c) for c in text]


TOK = CharTokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def prompt(n_passages=4, question=True, words=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    parts = ["Read the passages.\n\n"]
    for p in range(1, n_passages + 1):
        ws = ["".join(letters[int(i)] for i in torch.randint(0, 26, (4,), generator=g)) for _ in range(words)]
        parts.append(f"Passage {p}:\n" + " ".join(ws) + ".\n\n")
    if question:
        parts.append("Question: which word comes first?\nAnswer:")
    return torch.tensor([TOK.encode("".join(parts))])


def random_rows(H, W, T, g, sink_bias=0.0, n_sink=4):
    """Random causal-free attention rows (H, W, T) with optional extra sink mass."""
    logits = torch.randn(H, W, T, generator=g) * 2.0
    logits[..., :n_sink] += sink_bias
    return torch.softmax(logits, -1)


# ------------------------------------------------------------------------------------------
# Math: priorities, weights, envelope, dual
# ------------------------------------------------------------------------------------------


def test_kappa_in_unit_interval_and_prop_3_2_margin():
    g = torch.Generator().manual_seed(1)
    for trial in range(50):
        T = 200
        mu = torch.softmax(torch.randn(T, generator=g) * (0.5 + trial / 10), 0)
        cuts = sorted(torch.randperm(T - 1, generator=g)[:6].add(1).tolist())
        bounds = [0] + cuts + [T]
        chunks = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        lam = float(torch.rand(1, generator=g)) * 3
        pr = chunk_priorities(mu, chunks, smoothing=0.1, lam=lam)
        assert (pr["kappa"] >= -1e-12).all() and (pr["kappa"] <= 1 + 1e-12).all()
        S, ell = pr["S"], pr["ell"]
        # eq. 10: S_i - S_j >= ln(l_i / l_j) - lambda
        diff = S[:, None] - S[None, :] - (torch.log(ell[:, None] / ell[None, :]) - lam)
        assert (diff >= -1e-9).all()
    # singleton chunk: kappa = 0 by definition
    pr = chunk_priorities(torch.softmax(torch.randn(10, generator=g), 0), [(0, 1), (1, 10)], 0.1, 1.0)
    assert pr["kappa"][0] == 0


def test_uniform_attention_gives_zero_priorities():
    T = 120
    mu = torch.zeros(T)
    mu[4:110] = 1.0  # uniform on the documents (sinks / question carry no mass here)
    mu /= mu.sum()
    chunks = [(4, 30), (30, 31), (31, 77), (77, 110)]
    pr = chunk_priorities(mu, chunks, smoothing=0.3, lam=2.0)
    assert torch.allclose(pr["S"], torch.zeros(4, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(pr["ell"], torch.ones(4, dtype=torch.float64), atol=1e-12)


def test_floor_weights_normalised_and_floored():
    g = torch.Generator().manual_seed(2)
    H, G, T = 8, 2, 64
    a = random_rows(H, 1, T, g, sink_bias=1.0)[:, 0]
    fw = floor_weights(a, G, n_sink=4, tau=0.5, zeta=0.3, z_min=0.05)
    r = H // G
    assert torch.allclose(fw["w"].sum(-1), torch.ones(G), atol=1e-6)
    assert (fw["w"] >= 0.3 / r - 1e-7).all()
    mu = pooled_proposal(a, fw["w"])
    assert abs(float(mu.sum()) - 1) < 1e-5
    # all heads of group 0 ineligible -> v = 1/r there, and the other group is unaffected
    fw2 = floor_weights(a, G, n_sink=4, tau=0.5, zeta=0.3, z_min=float(fw["z"][r:].min()))
    assert fw2["group_fallback"].tolist() == [bool((fw["z"][:r] < fw["z"][r:].min()).all()), False]


def test_proposition_3_1_weight_bounds():
    g = torch.Generator().manual_seed(3)
    n_sink = 4
    for _trial in range(40):
        r = int(torch.randint(2, 6, (1,), generator=g))
        tau = float(torch.rand(1, generator=g)) * 1.5 + 0.2
        zeta = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        T = 80
        a = random_rows(r, 1, T, g)[:, 0]
        fw = floor_weights(a, 1, n_sink, tau, zeta, z_min=1e-3)
        a_t, _ = sink_isolate(a, n_sink)
        H2 = -torch.log((a_t.double() ** 2).sum(-1))
        hs = int(H2.argmin())
        delta = float((H2 - H2[hs]).sort().values[1])  # others have entropy >= H* + delta
        lower = zeta / r + (1 - zeta) / (1 + (r - 1) * math.exp(-delta / tau))  # eq. 6
        assert float(fw["w"].flatten()[hs]) >= lower - 1e-5
    # eq. 7: sink-dominated head with a uniform residual on n non-sinks vs a sibling of collision c0
    for n, tau, zeta in [(50, 0.5, 0.2), (400, 1.0, 0.1), (1000, 0.3, 0.5)]:
        T = n_sink + n
        sink_head = torch.full((T,), 0.02 / n)
        sink_head[:n_sink] = 0.98 / n_sink
        sib = torch.softmax(torch.randn(T, generator=g) * 3, 0)
        a = torch.stack([sink_head, sib])
        fw = floor_weights(a, 1, n_sink, tau, zeta, z_min=0.01)
        a_t, _ = sink_isolate(a, n_sink)
        c0 = float((a_t[1].double() ** 2).sum())
        upper = zeta / 2 + (1 - zeta) * n ** (-1 / tau) / (n ** (-1 / tau) + c0 ** (1 / tau))
        assert float(fw["w"][0, 0]) <= upper + 1e-6
        assert float(fw["w"][0, 0]) >= zeta / 2 - 1e-7  # the floor, not zero


def test_theorem_4_1_envelope_on_random_mixtures():
    g = torch.Generator().manual_seed(4)
    for _trial in range(30):
        H, G, W, T = 6, 3, 3, 60
        rows = random_rows(H, W, T, g, sink_bias=float(torch.rand(1, generator=g)) * 4)
        zeta = 0.1 + 0.8 * float(torch.rand(1, generator=g))
        a = rows.mean(1)
        fw = floor_weights(a, G, 4, 0.5, zeta, 0.01)
        mu = pooled_proposal(a, fw["w"])
        # eq. 5: mu is also the mixture of the individual rows with omega_{h,u} = w_h / (G W_p)
        omega = fw["w"].flatten() / (G * W)
        assert torch.allclose((omega[:, None, None] * rows).sum((0, 1)), mu, atol=1e-6)
        removed = torch.rand(T, generator=g) < 0.3
        q = float(mu[removed].sum())
        for h in range(H):
            for u in range(W):
                bound, chi2 = deletion_envelope(rows[h, u], mu, float(omega[h]), removed)
                assert float(rows[h, u][removed].sum()) <= bound + 1e-6
                assert chi2 <= 1 / float(omega[h]) - 1 + 1e-6
                assert float(rows[h, u][removed].sum()) <= min(1, H * W * q / zeta) + 1e-6  # corollary


def test_envelope_is_sharp():
    # a is a point mass, mu = omega a + (1 - omega) b with b off that point: eta = 1 = bound
    omega = 0.2
    a = torch.zeros(10)
    a[3] = 1
    b = torch.full((10,), 1 / 9)
    b[3] = 0
    mu = omega * a + (1 - omega) * b
    removed = torch.zeros(10, dtype=torch.bool)
    removed[3] = True
    bound, chi2 = deletion_envelope(a, mu, omega, removed)
    assert bound == pytest.approx(1.0, abs=1e-6)
    assert chi2 == pytest.approx(1 / omega - 1, rel=1e-5)


def test_dual_bound_never_below_greedy_or_optimum():
    g = torch.Generator().manual_seed(5)
    for _trial in range(60):
        k = int(torch.randint(1, 9, (1,), generator=g))
        A = int(torch.randint(1, 7, (1,), generator=g))
        sizes = torch.randint(1, 50, (k,), generator=g)
        masses = torch.rand(A, k, generator=g) * 0.3
        eps = torch.rand(A, generator=g) * 0.6
        m0 = int(torch.randint(0, k + 1, (1,), generator=g))
        pri = torch.randn(k, generator=g)
        removed, used = greedy_feasible_scan(pri, sizes, masses, eps, m0)
        D = int(sizes[removed].sum()) if removed else 0
        assert (used <= eps.double() + 1e-12).all() and len(removed) <= k - m0  # feasible
        # exact optimum by enumeration
        best = 0
        for mask in range(1 << k):
            x = torch.tensor([(mask >> i) & 1 for i in range(k)], dtype=torch.float64)
            if x.sum() <= k - m0 and (masses.double() @ x <= eps.double() + 1e-12).all():
                best = max(best, int((sizes.double() * x).sum()))
        U, y, t, method = dual_certificate(sizes, masses, eps, m0)
        assert method == "linprog"
        assert D <= best <= U + 1e-6
        U0, _, _, m = dual_certificate(sizes, masses, eps, m0, use_lp=False)
        assert m == "zero" and U0 == pytest.approx(float(sizes.sum())) and U <= U0 + 1e-6
        # any nonnegative prices give a valid bound
        yr = torch.rand(A, generator=g) * 100
        assert best <= dual_bound(yr, float(torch.rand(1, generator=g)) * 30, sizes, masses, eps, m0) + 1e-6


def test_greedy_order_and_target():
    sizes = torch.tensor([10, 30, 30, 5])
    masses = torch.zeros(1, 4)
    pri = torch.tensor([0.0, -1.0, -1.0, 0.0])
    removed, _ = greedy_feasible_scan(pri, sizes, masses, torch.tensor([1.0]), 0, target=35)
    assert removed == [1, 2]  # ties broken by size then index; stops at the target
    removed, _ = greedy_feasible_scan(pri, sizes, masses, torch.tensor([1.0]), 0, target=float("inf"))
    assert removed == [1, 2, 0, 3]
    # a row constraint skips a chunk but the scan continues
    masses = torch.tensor([[0.1, 0.5, 0.1, 0.1]])
    removed, _ = greedy_feasible_scan(pri, sizes, masses, torch.tensor([0.35]), 1)
    assert removed == [2, 0, 3]
    removed, _ = greedy_feasible_scan(pri, sizes, masses, torch.tensor([0.35]), 2)
    assert removed == [2, 0]  # count constraint k - m0 = 2


def test_hoeffding_radius_and_set_change():
    assert hoeffding_radius(8, 9, 0.1, 64) == pytest.approx(math.sqrt(math.log(720) / 128))
    with pytest.raises(ValueError, match="delta"):
        hoeffding_radius(1, 1, 1.0, 4)
    assert set_change({1, 2, 3}, {2, 3, 4}) == pytest.approx(2 / 4)
    assert set_change(set(), set()) == 0


def test_row_attention_matches_observer_attention(tiny_llama):
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="eager")
    ids = prompt(2)
    T = ids.shape[1]
    captured = {}

    def hook(module, args, kwargs, output):
        captured.update(
            hs=kwargs["hidden_states"],
            pe=kwargs["position_embeddings"],
            attn=output[1],
            keys=kwargs["past_key_values"].layers[module.layer_idx].keys,
            module=module,
        )

    h = model.model.layers[1].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(ids, past_key_values=DynamicCache())
    h.remove()
    W = 5
    pos = torch.arange(T - W, T)
    rows = row_attention(captured["module"], captured["hs"], captured["keys"], pos, captured["pe"])
    ref = observer_attention_reference(
        window_queries(captured["module"], captured["hs"], W, captured["pe"]), captured["keys"]
    )
    assert torch.allclose(rows.mean(2), ref, atol=1e-5)
    eager = row_attention(None, None, None, torch.tensor([3, 40, T - 1]), None, captured["attn"])
    recomputed = row_attention(
        captured["module"], captured["hs"], captured["keys"], torch.tensor([3, 40, T - 1]), captured["pe"]
    )
    assert torch.allclose(eager, recomputed, atol=1e-5)
    assert float(recomputed[0, 0, 0, 4:].abs().max().detach()) == 0  # causal: row 3 sees keys 0..3


# ------------------------------------------------------------------------------------------
# Mechanics on a tiny random Llama
# ------------------------------------------------------------------------------------------


def _causal(n):
    return torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)[None, None]


def forward_pruned(model, ids, layer, R, cache, trim_cache):
    """Run layers 0..layer on the full prompt, then the rest on R only (original positions), into ``cache``;
    with ``trim_cache`` the early layers' entries are cut to R at the switch. Returns the last prefill logits."""
    lm = model.model
    T = ids.shape[1]
    h = lm.embed_tokens(ids)
    pos = torch.arange(T)[None]
    cos, sin = lm.rotary_emb(h, pos)
    mask = _causal(T)
    for i, blk in enumerate(lm.layers):
        if i == layer + 1:
            h, pos, cos, sin, mask = h[:, R], pos[:, R], cos[:, R], sin[:, R], _causal(len(R))
            for j in range(layer + 1 if trim_cache else 0):
                cache.layers[j].keys = cache.layers[j].keys[:, :, R]
                cache.layers[j].values = cache.layers[j].values[:, :, R]
        h = blk(
            h,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(h.shape[1], device=h.device),
            position_embeddings=(cos, sin),
        )
    return model.lm_head(lm.norm(h))[0, -1]


def decode_steps(model, cache, T, decode_ids):
    """Logits of greedy-free decode steps feeding ``decode_ids`` at positions T, T+1, ... (a list)."""
    return [
        model(
            input_ids=torch.tensor([[tok]], device=model.device),
            past_key_values=cache,
            position_ids=torch.tensor([[T + s]], device=model.device),
        ).logits[0, -1]
        for s, tok in enumerate(decode_ids)
    ]


def reference_pruned(model, ids, layer, R, decode_ids):
    """Run layers 0..layer on the full prompt, then the rest on R only (original positions);
    return the last prefill logits and the logits of greedy-free decode steps at T, T+1, ..."""
    cache = DynamicCache()
    with torch.no_grad():
        first = forward_pruned(model, ids, layer, R, cache, trim_cache=True)
        return torch.stack([first, *decode_steps(model, cache, ids.shape[1], decode_ids)]), cache


def run_press(model, ids, press, decode_ids):
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            out = model(input_ids=ids, past_key_values=cache)
        return torch.stack([out.logits[0, -1], *decode_steps(model, cache, ids.shape[1], decode_ids)]), cache


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forced_layer_equals_reference_on_retained_support(shared, attn):
    model = shared[0]
    if attn != "eager":
        model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=4, attn_implementation=attn)
    ids = shared[1]
    T = ids.shape[1]
    decode = [65, 66, 67]
    press = EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK, force_layer=1, force_chunks=[1, 3], n_sink=2)
    got, cache = run_press(model, ids, press, decode)
    st = press.summary()
    plan = press._plan
    R = plan.retained_indices([1, 3])
    assert st["accepted_layer"] == 1 and st["removed_chunks"] == "1,3"
    assert st["T_prime"] == len(R) == T - plan.sizes[1] - plan.sizes[3]
    assert all(cache.get_seq_length(i) == len(R) + len(decode) for i in range(4))
    ref, _ = reference_pruned(model, ids, 1, R, decode)
    assert torch.allclose(got, ref, atol=1e-4), float((got - ref).abs().max())
    if attn == "eager":  # pruning changed the output, so the comparison above can fail
        assert not torch.allclose(got[0], shared[2][0], atol=1e-3)
    assert 0 < st["analytic_saving"] < 1 - 2 / 4


def test_accepted_run_records_certificates(shared):
    model, ids = shared[0], prompt(6)
    T = ids.shape[1]
    press = EntroPrefillPress(
        tokenizer=TOK,
        compression_ratio=0.3,
        n_sink=2,
        epsilon=0.9,
        epsilon_audit=0.95,
        stability_streak=0,
        monitored_layers=[0, 1, 2],
        audit_size=512,
        min_chunks=1,
    )
    _, cache = run_press(model, ids, press, [])
    st = press.summary()
    assert st["bypass_reason"] == "", st
    assert st["accepted_layer"] == 0
    assert st["D_l"] >= st["target_saving"] > 0
    assert st["D_l"] <= st["U_l"] + 1e-6
    assert st["T_prime"] == T - st["D_l"] == cache.get_seq_length()
    assert st["eta_hat_max"] + st["audit_bound"] <= 0.95
    assert st["prefill_time_s"] > 0 and st["dual_method"] == "linprog"
    # the question (everything from "Question:") is retained
    q0 = press._plan.question[0]
    assert torch.isin(torch.arange(q0, T), press._retained).all()


def test_audit_positions_are_seeded_and_in_question(tiny_llama):
    model = tiny_llama(num_layers=2)
    ids = prompt(3)
    pos = []
    for _ in range(2):
        press = EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK, seed=7, audit_size=32)
        run_press(model, ids, press, [])
        pos.append(press._audit_pos.clone())
        q0, q1 = press._plan.question
        assert pos[-1].min() >= q0 and pos[-1].max() < q1
    assert torch.equal(pos[0], pos[1])


@pytest.fixture(scope="module")
def shared():
    """One 4-layer tiny Llama, a 5-passage prompt and its full-prefill logits (no pruning)."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=4)
    ids = prompt(5)
    ref, _ = run_press(model, ids, EntroPrefillPress(tokenizer=TOK, compression_ratio=0.0), [70])
    return model, ids, ref


def _check_full_prefill(shared, press, reason, ids=None):
    model, ids0, ref = shared
    if ids is not None:
        ref, _ = run_press(model, ids, EntroPrefillPress(tokenizer=TOK, compression_ratio=0.0), [70])
    ids = ids0 if ids is None else ids
    got, cache = run_press(model, ids, press, [70])
    st = press.summary()
    assert st["bypass_reason"] == reason, st
    assert st["accepted_layer"] == -1 and st["T_prime"] == ids.shape[1]
    assert cache.get_seq_length() == ids.shape[1] + 1
    assert torch.allclose(got, ref, atol=1e-5)
    return st


def test_fallback_no_chunks(shared):
    ids = torch.tensor([TOK.encode("Some text without passage markers.\n\nQuestion: why?")])
    _check_full_prefill(shared, EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK), "no_chunks", ids=ids)


def test_fallback_all_heads_ineligible(shared):
    st = _check_full_prefill(
        shared, EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK, z_min=1.0), "all_heads_ineligible"
    )
    # default monitored layers of L=4: L//2-2 .. L//2+2 clipped to [0, L-2] = [0, 1, 2]
    assert st["layer_reasons"] == "0:all_heads_ineligible;1:all_heads_ineligible;2:all_heads_ineligible"


def test_fallback_nonfinite(shared, monkeypatch):
    real = ep.row_chunk_statistics

    def nan_rows(*args, **kwargs):
        masses, average = real(*args, **kwargs)
        return masses * float("nan"), None if average is None else average * float("nan")

    monkeypatch.setattr(ep, "row_chunk_statistics", nan_rows)
    _check_full_prefill(shared, EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK), "nonfinite")


def test_fallback_target_infeasible(shared):
    st = _check_full_prefill(
        shared, EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK, epsilon=0.0), "target_infeasible"
    )
    assert st["U_l"] < st["target_saving"]


def test_fallback_no_layer_accepted(shared):
    # the audit can never pass: b alone exceeds the tolerance
    st = _check_full_prefill(
        shared,
        EntroPrefillPress(
            compression_ratio=0.5,
            tokenizer=TOK,
            epsilon=0.9,
            epsilon_audit=0.05,
            stability_streak=0,
            monitored_layers=[0, 1, 2],
            audit_size=16,
        ),
        "audit_failed",
    )
    assert st["audit_bound"] > 0.05
    assert st["layer_reasons"] == "0:audit_failed;1:audit_failed;2:audit_failed"
    # mixed reasons (first layer unstable, later audit failures) -> no_layer_accepted
    st = _check_full_prefill(
        shared,
        EntroPrefillPress(
            compression_ratio=0.5,
            tokenizer=TOK,
            epsilon=0.9,
            epsilon_audit=0.05,
            stability_streak=1,
            theta=1.0,
            monitored_layers=[0, 1, 2],
            audit_size=16,
        ),
        "no_layer_accepted",
    )
    assert st["layer_reasons"].startswith("0:unstable;")


def test_missing_question_raises(shared):
    with pytest.raises(ValueError, match="query_aware=true"):
        run_press(shared[0], prompt(3, question=False), EntroPrefillPress(compression_ratio=0.5, tokenizer=TOK), [])


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="compression_ratio"):
        EntroPrefillPress(compression_ratio=1.2)
    with pytest.raises(ValueError, match="zeta"):
        EntroPrefillPress(compression_ratio=0.5, zeta=0.0)
    with pytest.raises(ValueError, match="chunking"):
        EntroPrefillPress(compression_ratio=0.5, chunking="sentences")
    with pytest.raises(ValueError, match="force_chunks"):
        EntroPrefillPress(compression_ratio=0.5, force_chunks=[0])


def test_proposal_observers_suffix_or_whole_query(shared):
    """Algorithm 1 step 1: the proposal observers are the last ``proposal_window`` query positions ("suffix") or
    every position of the query span ("query"); the audit draws from the same span either way."""
    model, ids = shared[0], shared[1]
    T = ids.shape[1]
    for mode, window in (("suffix", 5), ("query", 5)):
        press = EntroPrefillPress(
            compression_ratio=0.5, tokenizer=TOK, proposal_window=window, proposal_observers=mode, n_sink=2
        )
        run_press(model, ids, press, [])
        q0, q1 = press._plan.question
        assert q1 == T and q1 - q0 > window
        expected = torch.arange(T - window, T) if mode == "suffix" else torch.arange(q0, T)
        assert torch.equal(press._proposal_pos, expected)
    with pytest.raises(ValueError, match="proposal_observers='all'"):
        EntroPrefillPress(compression_ratio=0.5, proposal_observers="all")
