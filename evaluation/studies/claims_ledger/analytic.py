"""The ledger's ``analytic`` pointers (:mod:`evaluation.studies.claims_ledger`): the papers' worked examples,
constants and bounds computed exactly with the project's code, each function ``fn(root, **args) -> (values,
agrees)``; registered by name in :data:`ANALYTIC`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from evaluation.studies.claims_ledger.artifacts import Value

#: analytic pointer functions by name
ANALYTIC: dict[str, Callable] = {}


def analytic(fn):
    ANALYTIC[fn.__name__] = fn
    return fn


def _frac(x: float, limit: int = 1000) -> str:
    f = Fraction(x).limit_denominator(limit)
    return f"{f.numerator}/{f.denominator}" if f.denominator != 1 else str(f.numerator)


@analytic
def table2_thresholds(root: Path, r: int, paper_bonferroni: float, paper_sandwich: float, digits: int = 3):
    """Largest J_bar each certificate certifies UOR >= 2 at (paper 000 Table 2)."""
    from evaluation.uor.replay import bonferroni_threshold, sandwich_threshold

    b, s = bonferroni_threshold(r), sandwich_threshold(r)
    tol = 0.5 * 10**-digits
    return [Value("Bonferroni", f"{_frac(b)} = {b:.4f}", b), Value("sandwich", f"{_frac(s)} = {s:.4f}", s)], abs(
        b - paper_bonferroni
    ) <= tol and abs(s - paper_sandwich) <= tol


@analytic
def table2_extremes(root: Path, rs: list[int]):
    """Both certificates at J_bar = 0 (disjoint heads) and J_bar = 1 (consensus)."""
    from evaluation.uor.replay import bonferroni_bound, sandwich_bounds

    vals, ok = [], True
    for r in rs:
        b0, s0 = bonferroni_bound(r, 0.0), sandwich_bounds(r, 0.0, 0.0)[0]
        b1, s1 = bonferroni_bound(r, 1.0), sandwich_bounds(r, 1.0, 1.0)[0]
        raw1 = r - r * (r - 1) * 1.0
        ok &= b0 == r and s0 == r and b1 == 1 and abs(s1 - 1) < 1e-12 and raw1 < 1
        vals.append(Value(f"r = {r}", f"J=0: {b0:g} / {s0:g}; J=1: {b1:g} (unclamped {raw1:g}) / {s1:g}"))
    return vals, ok


@analytic
def sandwich_crossover(root: Path, r: int):
    """At which group ratios the sandwich threshold exceeds the Bonferroni one."""
    from evaluation.uor.replay import bonferroni_threshold, sandwich_threshold

    wider = [q for q in range(3, 17) if sandwich_threshold(q) > bonferroni_threshold(q)]
    b, s = bonferroni_threshold(r), sandwich_threshold(r)
    return [
        Value(f"r = {r}", f"Bonferroni {_frac(b)} vs sandwich {_frac(s)}", s - b),
        Value("sandwich wider for", f"r >= {min(wider)} (r > 2 + sqrt 2)"),
    ], s > b


@analytic
def r2_identity(root: Path, trials: int = 200, T: int = 64):
    """``UOR = 2 / (2 - D) = 2 / (1 + J)`` for two equal-size sets, on random pairs (paper 000 Remark 1)."""
    import torch

    from evaluation.uor.replay import r2_identity as ident
    from evaluation.uor.replay import set_statistics

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(trials):
        s = int(torch.randint(1, T, (1,), generator=g))
        masks = torch.zeros(2, T, dtype=torch.bool)
        for h in range(2):
            masks[h, torch.randperm(T, generator=g)[:s]] = True
        st = set_statistics(masks)
        worst = max(
            worst,
            abs(float(st["uor"]) - float(ident(st["j_bar"]))),
            abs(float(st["uor"]) - 2.0 / (2.0 - (1.0 - float(st["j_bar"])))),
        )
    return [Value("max |UOR - 2/(2-D)|", f"{worst:.1e} over {trials} random pairs", worst)], worst < 1e-12


@analytic
def arithmetic_intensity(root: Path, cases: list):
    """Decode-phase attention FLOPs per cache byte, ``2 r / b_el`` (paper 000 eq. 1)."""
    vals = []
    for name, r, b_el in cases:
        vals.append(Value(name, f"2 x {r} / {b_el} = {2 * r / b_el:g} FLOP/B", 2 * r / b_el))
    return vals, vals[0].number == 4.0


@analytic
def peak_fraction(root: Path, intensity: float, ridge: float, paper_bound: float):
    """Share of peak compute reachable at a given arithmetic intensity (roofline): ``intensity / ridge``."""
    x = intensity / ridge
    return [Value("intensity / ridge", f"{intensity:g} / {ridge:g} = {x:.2%}", x)], x < paper_bound


def _table10_rows(Ts, r, tau, eps):
    from evaluation.studies.needle_group import needle_group_attention
    from presses.core.pooling import pooled_group_scores

    rows = []
    for T in Ts:
        attn, needle = needle_group_attention(T, r, needle_mass=1 - eps)
        pooled, _ = pooled_group_scores(attn, num_groups=1, n_sink=4, alpha=2.0, tau=tau, pooling="entropy")
        mean, _ = pooled_group_scores(attn, num_groups=1, n_sink=4, alpha=2.0, tau=tau, pooling="mean")
        N = T - 4
        c0, cs = (1 - eps) ** 2 + eps**2 / (N - 1), 1.0 / (N - 1)
        exact = (1 - eps) * c0 ** (1 / tau) / (c0 ** (1 / tau) + (r - 1) * cs ** (1 / tau))
        rows.append(
            {
                "T": T,
                "pooled": float(pooled[0, 0, needle]),
                "mean": float(mean[0, 0, needle]),
                "exact": exact,
                "D": (r - 1) * cs ** (1 / tau),
            }
        )
    return rows


def _k(T: int) -> str:
    return f"{T // 1024}k"


@analytic
def table10_pooled(
    root: Path, Ts: list[int], paper: list[float], r: int = 8, tau: float = 0.5, eps: float = 0.05, tol: float = 2e-6
):
    """Entropy-pooled needle mass from the press's pooling code on paper 000's Table 10 construction."""
    rows = _table10_rows(Ts, r, tau, eps)
    ok = all(abs(row["pooled"] - p) <= tol for row, p in zip(rows, paper))
    return [Value(_k(row["T"]), f"{row['pooled']:.7f}", row["pooled"]) for row in rows], ok


@analytic
def table10_mean(root: Path, Ts: list[int], r: int = 8, tau: float = 0.5, eps: float = 0.05):
    """Mean-pooled needle mass and the pooled / mean ratio on the same construction."""
    rows = _table10_rows(Ts, r, tau, eps)
    means = [row["mean"] for row in rows]
    ratios = [row["pooled"] / row["mean"] for row in rows]
    ok = all(abs(m - 0.11875) < 5e-7 for m in means) and all(round(x, 2) == 8.00 for x in ratios)
    return [
        Value("mean pooling", f"{min(means):.6f}..{max(means):.6f}", means[0]),
        Value("ratio", f"{min(ratios):.3f}x..{max(ratios):.3f}x", ratios[0]),
    ], ok


@analytic
def table10_terms(
    root: Path,
    Ts: list[int],
    paper_D: list[float],
    paper_Delta: list[float],
    r: int = 8,
    tau: float = 0.5,
    eps: float = 0.05,
    eta: float = math.log(2),
):
    """Table 10's D(T) and Delta(T), reconstructed as ``D = (r-1) (N-1)^(-1/tau)`` and
    ``Delta = (1-eps) e^(eta/tau) D`` (the paper prints them without a formula)."""

    def sig3(x):
        return float(f"{x:.2e}")

    vals, hits, total = [], 0, 0
    for T, pd_, pde in zip(Ts, paper_D, paper_Delta):
        N = T - 4
        D = (r - 1) * (1.0 / (N - 1)) ** (1 / tau)
        Delta = (1 - eps) * math.exp(eta / tau) * D
        hits += (sig3(D) == pd_) + (sig3(Delta) == pde)
        total += 2
        vals.append(Value(_k(T), f"D {D:.2e}, Delta {Delta:.2e}", D))
    return [Value("printed values reproduced", f"{hits} of {total}", hits / total)] + vals, hits == total


@analytic
def fig9a_gap(root: Path, Ts: list[int], r: int = 8, tau: float = 0.5, eps: float = 0.05, tol: float = 1e-6):
    """The press's pooled needle mass against the closed form (1 - eps) w_0, and its margin above the bound
    (1 - eps) - Delta(T), up to 128k."""
    rows = _table10_rows(Ts, r, tau, eps)
    gap = max(abs(row["pooled"] - row["exact"]) for row in rows)
    margin = min(row["pooled"] - ((1 - eps) - 4 * (1 - eps) * row["D"]) for row in rows)
    return [
        Value("max |press - closed form|", f"{gap:.1e} (float32 pooling)", gap),
        Value("smallest margin above the bound", f"{margin:+.1e}", margin),
        Value("contexts", ", ".join(_k(T) for T in Ts)),
    ], gap <= tol and margin >= -1e-7


@analytic
def eq32_endpoint(root: Path, L: int, l_star: int, xi: float, term: str, paper: float):
    """Paper 001 eq. 32 with only the linear (``b = 0``) or only the quadratic (``a = 0``) cost term."""
    from presses.entroprefill.equations import analytic_saving

    T = 1 << 20
    a, b = (1.0, 0.0) if term == "linear" else (0.0, 1.0)
    x = analytic_saving(l_star, L, T, int(T * xi), a, b)
    return [Value(None, f"{100 * x:.4f} %", 100 * x)], abs(100 * x - paper) < 1e-9


@analytic
def prop31_sink_floor(
    root: Path,
    ns: list[int],
    r: int = 3,
    zeta: float = 0.2,
    tau: float = 0.5,
    c0_mass: float = 0.5,
    sink_mass: float = 0.9,
    z_min: float = 0.05,
):
    """Paper 001 eq. 7: a sink head with a uniform residual on n positions gets at most
    ``zeta/r + (1-zeta) n^(-1/tau) / (n^(-1/tau) + c0^(1/tau))``, which tends to the floor zeta/r."""
    import torch

    from presses.entroprefill.equations import floor_weights

    vals, ok = [], True
    for n in ns:
        T = 4 + n
        attn = torch.zeros(r, T, dtype=torch.float64)
        attn[0, :4] = sink_mass / 4
        attn[0, 4:] = (1 - sink_mass) / n
        for h in range(1, r):  # siblings: c0_mass on one position, the rest uniform
            attn[h, 4:] = (1 - c0_mass) / (n - 1)
            attn[h, 4 + h] = c0_mass
        c0 = c0_mass**2 + (1 - c0_mass) ** 2 / (n - 1)
        w = float(floor_weights(attn.float(), 1, 4, tau, zeta, z_min)["w"][0, 0])
        bound = zeta / r + (1 - zeta) * n ** (-1 / tau) / (n ** (-1 / tau) + c0 ** (1 / tau))
        ok &= w <= bound + 1e-6
        vals.append(Value(f"n = {n}", f"w_sink {w:.5f} <= {bound:.5f}", w))
    ok &= abs(vals[-1].number - zeta / r) < 1e-3
    return vals + [Value("floor zeta/r", f"{zeta / r:.5f}", zeta / r)], ok


@analytic
def prop32_uniform(root: Path, sizes: list[int], smoothing: float = 0.1, lam: float = 0.5):
    """Uniform attention on the documents gives every chunk priority S_i = 0 (paper 001 Prop. 3.2)."""
    import torch

    from presses.entroprefill.equations import chunk_priorities

    T = 10 + sum(sizes)
    mu = torch.zeros(T, dtype=torch.float64)
    mu[10:] = 1.0 / sum(sizes)
    chunks, s = [], 10
    for n in sizes:
        chunks.append((s, s + n))
        s += n
    S = chunk_priorities(mu, chunks, smoothing, lam)["S"]
    worst = float(S.abs().max())
    return [Value("max |S_i|", f"{worst:.1e} over {len(sizes)} chunks", worst)], worst < 1e-12


@analytic
def thm41_sharp(root: Path, omegas: list[float], T: int = 32):
    """Paper 001 Theorem 4.1's sharp case: a point-mass row of weight omega; removing its support gives
    eta = 1 and the envelope equals 1."""
    import torch

    from presses.entroprefill.equations import deletion_envelope

    vals, ok = [], True
    for om in omegas:
        a = torch.zeros(T, dtype=torch.float64)
        a[0] = 1.0
        b = torch.zeros(T, dtype=torch.float64)
        b[1:] = 1.0 / (T - 1)
        mu = om * a + (1 - om) * b
        removed = torch.zeros(T, dtype=torch.bool)
        removed[0] = True
        bound, chi2 = deletion_envelope(a, mu, om, removed)
        eta = float(a[removed].sum())
        ok &= abs(bound - 1.0) < 1e-12 and abs(eta - 1) < 1e-12 and abs(chi2 - (1 / om - 1)) < 1e-9
        vals.append(Value(f"omega {om:g}", f"eta {eta:g}, envelope {bound:g}, chi2 {chi2:.4g} = 1/omega - 1", bound))
    return vals, ok


@analytic
def lemma42_factor_two(root: Path, etas: list[float], V: float = 3.0, T: int = 16):
    """Paper 001 Lemma 4.2: ``||o - o_R|| <= 2 V eta``, with equality for values +V e (removed) and -V e (kept)."""
    import torch

    vals, ok = [], True
    for eta in etas:
        k = 4
        a = torch.full((T,), (1 - eta) / (T - k), dtype=torch.float64)
        a[:k] = eta / k
        e = torch.zeros(8, dtype=torch.float64)
        e[0] = 1.0
        v = torch.where(torch.arange(T).unsqueeze(-1) < k, V * e, -V * e)
        o = (a.unsqueeze(-1) * v).sum(0)
        keep = torch.arange(T) >= k
        o_r = (a[keep].unsqueeze(-1) * v[keep]).sum(0) / (1 - eta)
        ratio = float(torch.linalg.vector_norm(o - o_r)) / (V * eta)
        ok &= abs(ratio - 2) < 1e-12
        vals.append(Value(f"eta {eta:g}", f"||o - o_R|| / (V eta) = {ratio:.6f}", ratio))
    return vals, ok


@analytic
def appb_divergence(root: Path, alphas: list[float]):
    """Paper 001 appendix B: ``Phi_2(c) - mean_P Psi(P) = ln((1-a)^2 + a^2) - ln(a (1-a)) / 2`` (b cancels)."""
    vals, prev, ok = [], -float("inf"), True
    for a in alphas:
        gap = math.log((1 - a) ** 2 + a**2) - 0.5 * math.log(a * (1 - a))
        ok &= gap > prev
        prev = gap
        vals.append(Value(f"alpha {a:g}", f"{gap:.3f}", gap))
    return vals, ok


@analytic
def np_reduction(root: Path, n: int = 4, values: int = 5):
    """Paper 003 section 3 / appendix B: with K = Q = 1, d = 1, r = 1/2, eps = 0 every logit is equal, the softmax
    is uniform, and KVEviction asks for |I| = n/2 entries whose mean equals the mean of all: yes exactly when
    Partition says yes. Checked in exact arithmetic on every length-n sequence over 1..values."""
    agree = total = yes = 0
    for seq in itertools.product(range(1, values + 1), repeat=n):
        full = Fraction(sum(seq), n)  # softmax(1) . V over all n entries
        kv = part = False
        for keep in itertools.combinations(range(n), n // 2):
            kept = [seq[i] for i in keep]
            kv |= Fraction(sum(kept), len(kept)) == full  # softmax(1) . V_I, eps = 0
            part |= sum(kept) == sum(seq) - sum(kept)
        agree += kv == part
        yes += part
        total += 1
    return [
        Value("instances where KVEviction = Partition", f"{agree} of {total} ({yes} yes-instances)", agree / total)
    ], agree == total


@analytic
def alg2_tolerance(root: Path, sizes: list[int], ratios: list[float], trials: int = 20):
    """Paper 003 Algorithm 2's guarantee ``|E[J(m)] - j*| <= 0.5`` with the project's search, on random proposals."""
    import torch

    from presses.core.coupon import expected_unique
    from presses.probabilistic.budget import search_num_samples

    g = torch.Generator().manual_seed(0)
    worst, n = 0.0, 0
    for t in sizes:
        for _ in range(trials):
            scale = float(torch.rand(1, generator=g)) * 4
            pi = torch.softmax(torch.randn(t, generator=g, dtype=torch.float64) * scale, -1)
            for r in ratios:
                m = search_num_samples(pi, r)
                worst = max(worst, abs(float(expected_unique(pi, m)) - (1 - r) * t))
                n += 1
    return [Value("max |E[J(m)] - j*|", f"{worst:.3f} over {n} searches", worst)], worst <= 0.5


def _pi_example():
    import torch

    return torch.tensor([0.8, 0.0998, 0.0001, 0.0001], dtype=torch.float64)


@analytic
def worked_m100(root: Path, m: int = 100):
    """Paper 003 appendix F.1: E[J(100)] for pi = (0.8, 0.0998, 0.0001, 0.0001) and its compression ratio."""
    from presses.core.coupon import expected_unique

    e = float(expected_unique(_pi_example(), m))
    cr = 1 - e / 4
    return [Value("E[J(100)]", f"{e:.3f}", e), Value("compression", f"{cr:.3f}", cr)], round(cr, 1) == 0.5


def _tolerated(target: float, upto: int):
    import torch

    from presses.core.coupon import expected_unique

    ms = torch.arange(upto, dtype=torch.float64)
    e = expected_unique(_pi_example().expand(upto, 4), ms)
    ok = ((e - target).abs() <= 0.5).nonzero().flatten()
    return int(ok.min()), int(ok.max())


@analytic
def worked_search(root: Path, ratio: float, paper_m: float, upto: int):
    """Paper 003 appendix F.1: the m Algorithm 2 returns for a target ratio, and every m within 0.5 of j*."""
    from presses.core.coupon import expected_unique
    from presses.probabilistic.budget import search_num_samples

    m = int(search_num_samples(_pi_example(), ratio))
    e = float(expected_unique(_pi_example(), m))
    lo, hi = _tolerated((1 - ratio) * 4, upto)
    return [
        Value("Algorithm 2 returns", f"m = {m:,} (E[J] = {e:.2f})", m),
        Value(f"m within 0.5 of j* = {(1 - ratio) * 4:g}", f"[{lo:,}, {hi:,}]"),
    ], lo <= paper_m <= hi
