"""The ledger's ``derived`` pointers (:mod:`evaluation.studies.claims_ledger`): numbers read from committed
artifacts, each function ``fn(root, **args) -> (values, agrees)``; registered by name in :data:`DERIVED`."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from evaluation.studies.claims_ledger.artifacts import (
    UOR_RUN,
    Missing,
    Unreadable,
    Value,
    artifact_path,
    bools,
    filter_rows,
    jsonl_rows,
    model_shape,
    read_csv,
    read_json,
)

#: derived pointer functions by name
DERIVED: dict[str, Callable] = {}
#: the UOR study's scorers whose selection does not depend on the head
HEAD_INDEPENDENT = ("h2o", "last_row", "snapkv")


def derived(fn):
    DERIVED[fn.__name__] = fn
    return fn


@derived
def uor_ceiling(root: Path, file: str):
    """Max head-independent UOR against the ceiling r, and the share of cells inside ``[1, min(r, T/s)]``."""
    df = read_csv(root, file)
    r = model_shape(root)["r"]
    hi = df[df.scorer.isin(HEAD_INDEPENDENT) & bools(df.finite)]
    if hi.empty:
        raise Missing(f"{file}: no head-independent cells")
    ceiling = (hi["T"] / hi["s"]).clip(upper=r)
    inside = ((hi.uor >= 1 - 1e-9) & (hi.uor <= ceiling + 1e-9)).mean()
    mx = float(hi.uor.max())
    return [
        Value("max UOR", f"{mx:.3f}", mx),
        Value("r", str(r), r),
        Value("max UOR / r", f"{mx / r:.2f}"),
        Value("cells in [1, min(r, T/s)]", f"{inside:.3f} of {len(hi):,}"),
    ], bool(inside == 1.0 and mx <= r)


@derived
def uor_max_at(root: Path, file: str, k_over_t: float):
    """Max UOR over the head-independent scorers at one budget, and that max over r."""
    df = filter_rows(read_csv(root, file), {"k_over_t": k_over_t}, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT)]
    if df.empty:
        raise Missing(f"{file}: no head-independent row at k/T = {k_over_t}")
    r = model_shape(root)["r"]
    row = df.loc[df.uor_max.idxmax()]
    mx = float(row.uor_max)
    return [
        Value("max UOR", f"{mx:.3f}", mx),
        Value("scorer", str(row.scorer)),
        Value("max UOR / r", f"{mx / r:.2f} (r = {r})", mx / r),
        Value("cells", f"{int(df.cells.sum()):,}"),
    ], None


@derived
def census_sink_weight(root: Path, file: str):
    """Sink-class weight raw -> isolated and its ratio (the abstract's 'masquerade')."""
    df = read_csv(root, file).set_index("class")
    if "sink" not in df.index or "contextual" not in df.index:
        raise Missing(f"{file}: no sink/contextual class")
    raw, iso = float(df.loc["sink", "raw_weight"]), float(df.loc["sink", "isolated_weight"])
    return [
        Value("sink weight raw", f"{raw:.3f}", raw),
        Value("isolated", f"{iso:.3f}", iso),
        Value("raw / isolated", f"{raw / iso:.2f}x", raw / iso),
    ], iso < raw


@derived
def census_ratio(root: Path, file: str):
    """Sink-to-contextual weight ratio, raw and sink-isolated (Fig. 8)."""
    df = read_csv(root, file).set_index("class")
    if "sink" not in df.index or "contextual" not in df.index:
        raise Missing(f"{file}: no sink/contextual class")
    raw = float(df.loc["sink", "raw_weight"] / df.loc["contextual", "raw_weight"])
    iso = float(df.loc["sink", "isolated_weight"] / df.loc["contextual", "isolated_weight"])
    return [Value("raw", f"{raw:.2f}x", raw), Value("isolated", f"{iso:.2f}x", iso)], bool(raw > 1 >= iso)


@derived
def census_ceiling(root: Path, file: str):
    """Share of sink-isolated entropies below the uniform-residual ceiling ln(T - |S|) (Fig. 7)."""
    df = read_csv(root, file)
    n_sink = model_shape(root)["config"].get("presses", {}).get("page_entrokv", {}).get("n_sink", 4)
    import numpy as np

    ceiling = np.log(df["T"].astype(float) - n_sink)
    below = float((df.isolated_entropy <= ceiling + 1e-9).mean())
    gap = float((ceiling - df.isolated_entropy).min())
    return [
        Value("below ln(T - |S|)", f"{below:.3f} of {len(df):,}", below),
        Value("ceiling", f"ln(T - {n_sink}) = {ceiling.min():.2f}..{ceiling.max():.2f}"),
        Value("closest approach", f"{gap:.3f} nats", gap),
    ], below == 1.0


@derived
def effective_vs_target(root: Path, file: str, press: str, op: str = "==", tol: float = 0.002):
    """Measured effective compression against the requested ratio, per ratio."""
    df = filter_rows(read_csv(root, file), {"press": press}, file)
    vals, ok = [], True
    for _, row in df.sort_values("ratio").iterrows():
        eff, ratio = float(row.effective_compression), float(row.ratio)
        vals.append(Value(f"cr {ratio:g}", f"{eff:.3f}", eff))
        ok &= abs(eff - ratio) <= tol if op == "==" else eff >= ratio - 1e-9
    return vals, ok


@derived
def cert_counts(root: Path, file: str):
    """Cells certified UOR >= 2 by Bonferroni and by the sandwich bound, over the head-independent rows."""
    df = read_csv(root, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT)]
    if df.empty:
        raise Missing(f"{file}: no head-independent rows")
    run = read_json(root, UOR_RUN)
    b, s = int(df.cert_bonferroni.sum()), int(df.cert_sandwich.sum())
    th = run.get("thresholds", {})
    return [
        Value("Bonferroni certifies", f"{b:,} cells", b),
        Value("sandwich certifies", f"{s:,} cells", s),
        Value(
            f"thresholds (r = {run['r']})",
            f"J_bar <= {th.get('bonferroni', float('nan')):.4f} vs <= {th.get('sandwich', float('nan')):.4f}",
        ),
    ], s >= b


@derived
def sandwich_holds(root: Path, file: str):
    """Share of finite head-independent cells inside both certificates (Theorem 1, Corollary 1)."""
    df = read_csv(root, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT) & bools(df.finite)]
    if df.empty:
        raise Missing(f"{file}: no finite cells")
    tol = 1e-4  # the CSV stores 6 significant digits
    ok = (
        (df.uor >= df.bonferroni_lower - tol)
        & (df.uor >= df.sandwich_lower - tol)
        & (df.uor <= df.sandwich_upper + tol)
    ).mean()
    return [Value("cells inside both bounds", f"{ok:.3f} of {len(df):,}", float(ok))], bool(ok == 1.0)


@derived
def envelope_tail(root: Path, file: str, quantile: float = 0.1):
    """UOR over the sandwich lower envelope, in the most and the least disagreeing decile of cells (Fig. 4)."""
    df = read_csv(root, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT) & bools(df.finite)]
    if df.empty:
        raise Missing(f"{file}: no finite cells")
    ratio = df.uor / df.sandwich_lower
    lo, hi = df.j_bar.quantile(quantile), df.j_bar.quantile(1 - quantile)
    tail = float(ratio[df.j_bar <= lo].median())
    head = float(ratio[df.j_bar >= hi].median())
    return [
        Value("UOR / envelope, most disagreeing 10 %", f"{tail:.3f}", tail),
        Value("least disagreeing 10 %", f"{head:.3f}", head),
    ], tail < head


@derived
def alpha_peak(root: Path, file: str):
    """The Rényi order at which the mean max weight peaks (Fig. 5b)."""
    df = read_csv(root, file)
    row = df.loc[df.max_w.idxmax()]
    vals = [Value(f"alpha {a:g}", f"{w:.3f}", w) for a, w in zip(df.alpha, df.max_w)]
    return [Value("peak at alpha", f"{row.alpha:g}", float(row.alpha))] + vals, float(row.alpha) in (1.0, 2.0)


#: bytes per element of the cache dtypes the speed benchmark records
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _bytes_over_formula(root: Path, file: str, press: str, column: str, tokens: Callable, rows: str, missing: str):
    """The speed benchmark's ``column`` bytes of ``press`` over ``2 e L G d n`` with ``n = tokens(row)`` (rows where
    it is falsy are skipped): the range of the ratio over ``rows`` and whether it is 1 throughout."""
    df = filter_rows(read_csv(root, file), {"press": press}, file)
    shape = model_shape(root)
    ratios = []
    for _, row in df.iterrows():
        n = tokens(row)
        if not n:
            continue
        e = DTYPE_BYTES[str(row["dtype"])]
        ratios.append(float(row[column]) / (2 * e * shape["L"] * shape["G"] * shape["head_dim"] * n))
    if not ratios:
        raise Missing(f"{file}: {missing}")
    lo, hi = min(ratios), max(ratios)
    return [Value("measured / formula", f"{lo:.4f}..{hi:.4f} over {len(ratios)} {rows}", lo)], bool(
        abs(lo - 1) < 1e-9 and abs(hi - 1) < 1e-9
    )


@derived
def kv_footprint(root: Path, file: str):
    """Uncompressed cache bytes against paper 000 eq. 3, ``2 * e * L * H_KV * D_head * T`` (batch 1)."""
    return _bytes_over_formula(
        root, file, "no_press", "kv_full_bytes", lambda row: float(row.context_length), "rows", "no no_press row"
    )


def _t_prime(row) -> int | None:
    """EntroPrefill's retained length ``T'`` from a row's press statistics (None when it did not prune)."""
    stats = json.loads(row.press_stats) if isinstance(row.press_stats, str) else {}
    return stats.get("T_prime") or None


@derived
def transfer_payload(root: Path, file: str):
    """EntroPrefill's retained cache bytes against paper 001 section 8.2, ``2 e L G d T'``."""
    return _bytes_over_formula(
        root, file, "entroprefill", "kv_logical_bytes", _t_prime, "pruned rows", "no pruned EntroPrefill row"
    )


@derived
def union_bounds(root: Path, file: str):
    """Paper 001 eq. 30: ``K <= U_l <= min(G K, N_P)`` per (prompt, press, layer)."""
    df = read_csv(root, file)
    page = model_shape(root)["config"].get("presses", {}).get("page_entrokv", {}).get("page_size", 16)
    n_p = (df["T"] + page - 1) // page
    k, u, g = df.pages_per_group, df.union_pages, df.groups
    ok = float(((k <= u + 1e-9) & (u <= (g * k).clip(upper=n_p) + 1e-9)).mean())
    return [
        Value("layers inside the bounds", f"{ok:.3f} of {len(df):,}", ok),
        Value("mean U_l / K", f"{float((u / k).mean()):.3f}"),
    ], ok == 1.0


@derived
def dual_certificate(root: Path, file: str):
    """Theorem 4.3: the greedy saving D_l never exceeds the dual bound U_l; the mean gap U_l - D_l."""
    df = read_csv(root, file)
    df = df[(df.method == "entroprefill") & df.D_l.notna() & df.U_l.notna()]
    if df.empty:
        raise Missing(f"{file}: no EntroPrefill row with D_l and U_l")
    ok = float((df.D_l <= df.U_l + 1e-6).mean())
    gap = float((df.U_l - df.D_l).mean())
    return [
        Value("rows with D_l <= U_l", f"{ok:.3f} of {len(df)}", ok),
        Value("mean U_l - D_l", f"{gap:.0f} tokens", gap),
        Value("mean D_l / U_l", f"{float((df.D_l / df.U_l).mean()):.3f}"),
    ], ok == 1.0


@derived
def audit_radius(root: Path, file: str, config: str = "configs/press/entroprefill.yaml"):
    """Theorem 5.1: the recorded audit radius equals eq. 17 with the configured J, H_Q, delta, m_a; accepted
    layers satisfy eta_hat + b <= eps_audit."""
    from evaluation.harness import compose_config
    from evaluation.settings import run_settings
    from presses.entroprefill.equations import hoeffding_radius

    artifact_path(root, config)  # the config must exist; its press's settings are the class defaults it keeps
    cfg = run_settings(compose_config([f"press={Path(config).stem}"]))["press"]
    shape = model_shape(root)
    L = shape["L"]
    layers = cfg.get("monitored_layers")
    J = len(layers) if layers else len(range(min(L // 3, L - 2), max(min(L // 2, L - 1), min(L // 3, L - 2) + 1)))
    b = hoeffding_radius(J, shape["H_Q"], float(cfg["delta"]), int(cfg["audit_size"]))
    df = read_csv(root, file)
    df = df[(df.method == "entroprefill") & df.audit_bound.notna()]
    if df.empty:
        raise Missing(f"{file}: no audited row")
    recorded = df.audit_bound.astype(float)
    acc = df[df.accepted_layer.notna() & df.eta_hat_max.notna()]
    passed = (
        float(((acc.eta_hat_max + acc.audit_bound) <= float(cfg["epsilon_audit"]) + 1e-9).mean())
        if len(acc)
        else float("nan")
    )
    same = bool((recorded - b).abs().max() < 1e-9)
    return [
        Value(
            "b (eq. 17)",
            f"{b:.4f} (J = {J}, H_Q = {shape['H_Q']}, delta = {cfg['delta']}, m_a = {cfg['audit_size']})",
            b,
        ),
        Value("recorded b", f"{recorded.min():.4f}..{recorded.max():.4f}"),
        Value("accepted with eta_hat + b <= eps_audit", f"{passed:.3f} of {len(acc)}", passed),
    ], same and passed == 1.0


@derived
def bypass_is_full_prefill(root: Path, file: str):
    """Every bypassed EntroPrefill request ran the ordinary full prefill: its cache is as long as the full run's."""
    df = read_csv(root, file)
    if "method" not in df.columns:
        raise Unreadable(f"{file}: no method column")
    full = df[df.method == "full"].set_index("id").cache_len
    ep = df[df.method == "entroprefill"]
    bypassed = ep[ep.bypass_reason.notna() & (ep.bypass_reason.astype(str) != "")]
    pruned = ep[~ep.index.isin(bypassed.index)]
    if bypassed.empty:
        raise Missing(f"{file}: no bypassed request")
    same = float((bypassed.cache_len.to_numpy() == full.reindex(bypassed.id).to_numpy()).mean())
    shorter = float((pruned.cache_len.to_numpy() < full.reindex(pruned.id).to_numpy()).mean()) if len(pruned) else 1.0
    reasons = sorted(set(";".join(bypassed.bypass_reason.astype(str)).split(";")))
    return [
        Value("bypassed requests with the full cache", f"{same:.3f} of {len(bypassed)}", same),
        Value("pruned requests with a shorter cache", f"{shorter:.3f} of {len(pruned)}", shorter),
        Value("reasons", ", ".join(reasons)),
    ], same == 1.0 and shorter == 1.0


@derived
def eq6_on_census(root: Path, file: str):
    """Paper 001 eq. 6 with zeta = 0 on the embedded model's heads: the lowest-entropy head of each group gets at
    least ``1 / (1 + (s - 1) exp(-Delta / tau))``."""
    df = read_csv(root, file)
    tau = model_shape(root)["config"].get("presses", {}).get("page_entrokv", {}).get("tau", 0.5)
    n_ok = n = 0
    worst = float("inf")
    for _, grp in df.groupby(["prompt", "layer", "group"]):
        h = grp.isolated_entropy.to_numpy()
        w = grp.isolated_weight.to_numpy()
        i = int(h.argmin())
        others = [x for j, x in enumerate(h) if j != i]
        if not others:
            continue
        delta = min(others) - h[i]
        bound = 1.0 / (1.0 + len(others) * math.exp(-delta / tau))
        n += 1
        n_ok += w[i] >= bound - 1e-5  # weights stored with 6 significant digits
        worst = min(worst, w[i] - bound)
    if not n:
        raise Missing(f"{file}: no group")
    return [
        Value("groups meeting eq. 6", f"{n_ok} of {n}", n_ok / n),
        Value("smallest margin w - bound", f"{worst:.2e}", worst),
    ], n_ok == n


def _bv(root: Path, file: str):
    df = read_csv(root, file)
    df = df[df.layer.astype(str) == "all"]
    if df.empty:
        raise Missing(f"{file}: no layer-mean rows")
    return df


@derived
def bv_monotone(root: Path, file: str, estimators: list[str]):
    """Whether each estimator's mean error rises with the compression ratio (fewer samples)."""
    df = _bv(root, file)
    vals, ok = [], True
    for est in estimators:
        sub = df[df.estimator == est].sort_values("compression_ratio")
        if sub.empty:
            raise Missing(f"{file}: no estimator {est}")
        mae = sub.mae.astype(float).to_numpy()
        mono = bool((mae[1:] >= mae[:-1]).all())
        ok &= mono
        vals.append(
            Value(
                est,
                f"{mae[0]:.4f} (cr {sub.compression_ratio.iloc[0]:g}) -> {mae[-1]:.4f} "
                f"(cr {sub.compression_ratio.iloc[-1]:g}), {'monotone' if mono else 'not monotone'}",
                float(mae[-1] / mae[0]),
            )
        )
    return vals, ok


@derived
def bv_compare(root: Path, file: str, left: str | list, right: str, ratios: list[float], expect: str = "<"):
    """MAE of ``left`` against ``right`` at the given ratios; holds when ``left <expect> right`` at every one."""
    df = _bv(root, file)
    lefts = left if isinstance(left, list) else [left]
    vals, ok = [], True
    for cr in ratios:
        sub = df[(df.compression_ratio.astype(float) - cr).abs() < 1e-9].set_index("estimator")
        if right not in sub.index or any(x not in sub.index for x in lefts):
            raise Missing(f"{file}: cr {cr} lacks {lefts + [right]}")
        r = float(sub.loc[right, "mae"])
        parts = []
        for x in lefts:
            v = float(sub.loc[x, "mae"])
            ok &= v < r if expect == "<" else v > r
            parts.append(f"{x} {v:.4f}")
        vals.append(Value(f"cr {cr:g}", ", ".join(parts) + f" vs {right} {r:.4f}", float(sub.loc[lefts[0], "mae"]) / r))
    return vals, ok


def _snis(press: str) -> bool:
    return press.startswith("snis_")


def _wins(root: Path, file: str, among: list[str] | None = None):
    """The win-score table ``file`` (``results/tables/<dataset>__<model>__win.csv``) as a DataFrame.

    A win score ranks every press against the others in its table, so it depends on which presses the table
    holds. With ``among``, the scores are recomputed among those presses only (paper 003 ranks its 9 methods;
    our grid holds their uncorrected, tau-2 and page-unit twins too), from the complete runs under
    ``results/<dataset>/<model>/`` with the report's own ``win_table``.

    Raises:
        Missing: the table is absent or its sweep incomplete (:func:`read_csv`), or a press of ``among`` has no
            complete run at some ratio of the table.
    """
    import pandas as pd

    from evaluation.report import win_table
    from evaluation.runs import scan

    df = read_csv(root, file)
    if not among:
        return df
    dataset, model, _ = Path(file).name.split("__")
    runs = [r for r in scan(root / "results", dataset) if r.model == model and r.press in among and r.complete]
    out = pd.DataFrame(win_table(runs))
    for ratio in sorted(df.ratio.unique()):
        have = set(out[out.ratio == ratio].press) if not out.empty else set()
        if set(among) - have:
            raise Missing(f"{file}: no complete run of {sorted(set(among) - have)} at cr {ratio:g}")
    return out


@derived
def snis_vs_baselines(
    root: Path, file: str, baselines: list[str], column: str = "score", ours: list[str] | None = None
):
    """Per ratio, the best probabilistic-eviction press (every ``snis_*`` row, or only ``ours``) against the best
    kvpress baseline."""
    df = read_csv(root, file)
    vals, ok = [], True
    for ratio, sub in sorted(df.groupby("ratio")):
        if ratio == 0:
            continue
        ours_rows = sub[sub.press.isin(ours)] if ours else sub[sub.press.map(_snis)]
        base = sub[sub.press.isin(baselines)]
        if ours_rows.empty or base.empty:
            continue
        o, b = ours_rows.loc[ours_rows[column].idxmax()], base.loc[base[column].idxmax()]
        ok &= float(o[column]) >= float(b[column])
        vals.append(
            Value(
                f"cr {ratio:g}",
                f"{o.press} {float(o[column]):.3f} vs {b.press} {float(b[column]):.3f}",
                float(o[column]) - float(b[column]),
            )
        )
    if not vals:
        raise Missing(f"{file}: no ratio with both a snis_* press and a baseline")
    return vals, ok


def _ranks(df, file: str, press: str, what: str):
    """Rank of ``press`` by win score at every ratio of ``df`` (1 = best) as values ``"<rank> of <n><what> (best:
    <press>)"``, and whether it ranks first at every ratio."""
    vals, ok = [], True
    for ratio, sub in sorted(df.groupby("ratio")):
        if press not in set(sub.press):
            raise Missing(f"{file}: no {press} at cr {ratio:g}")
        ranked = sub.sort_values("win_score", ascending=False).press.tolist()
        rank = ranked.index(press) + 1
        ok &= rank == 1
        vals.append(Value(f"cr {ratio:g}", f"{rank} of {len(ranked)}{what} (best: {ranked[0]})", rank))
    return vals, ok


@derived
def win_rank(root: Path, file: str, press: str, among: list[str] | None = None):
    """Rank of ``press`` by win score at every ratio (1 = best); ``among``: scores among those presses only
    (:func:`_wins`)."""
    return _ranks(_wins(root, file, among), file, press, "")


@derived
def snis_best_rank(root: Path, file: str, press: str, among: list[str] | None = None):
    """Rank of ``press`` among the probabilistic-eviction presses by win score, at every ratio; ``among``: win
    scores among those presses only (:func:`_wins`), ranked among their ``snis_*`` members."""
    df = _wins(root, file, among)
    df = df[df.press.map(_snis)]
    vals, ok = _ranks(df, file, press, " SNIS presses")
    if len(set(df.press)) < 2:
        raise Missing(f"{file}: fewer than two SNIS presses")
    return vals, ok


@derived
def win_rising(root: Path, file: str, among: list[str] | None = None):
    """Share of presses whose win score at the highest ratio is at least that at the lowest ratio; ``among``:
    scores among those presses only (:func:`_wins`)."""
    df = _wins(root, file, among)
    ratios = sorted(df.ratio.unique())
    if len(ratios) < 2:
        raise Missing(f"{file}: one ratio only")
    lo = df[df.ratio == ratios[0]].set_index("press").win_score
    hi = df[df.ratio == ratios[-1]].set_index("press").win_score
    common = lo.index.intersection(hi.index)
    share = float((hi[common] >= lo[common]).mean())
    return [
        Value(
            f"presses with win(cr {ratios[-1]:g}) >= win(cr {ratios[0]:g})",
            f"{int((hi[common] >= lo[common]).sum())} of {len(common)}",
            share,
        ),
        Value("mean win", f"{float(lo[common].mean()):.3f} -> {float(hi[common].mean()):.3f}"),
    ], share > 0.5


@derived
def task_rank(root: Path, file: str, press: str, tasks: dict, ratio: float | None = None):
    """Rank of ``press`` on each named task (1 = best; ties share the best rank), and whether it matches the
    paper's ``first`` / ``last`` / ``top3``."""
    df = read_csv(root, file)
    df = df[df.ratio > 0]
    if ratio is not None:
        df = df[(df.ratio - ratio).abs() < 1e-9]
    vals, ok = [], True
    for task, expect in tasks.items():
        sub = df[df.group == task]
        if sub.empty or press not in set(sub.press):
            raise Missing(f"{file}: no {press} on {task}")
        ranks = []
        for _, s in sub.groupby("ratio"):
            mine = float(s[s.press == press].score.iloc[0])
            ranks.append((1 + int((s.score > mine + 1e-12).sum()), len(s)))
        n = ranks[0][1]
        mean_rank = sum(r for r, _ in ranks) / len(ranks)
        if expect == "first":
            hit = all(r == 1 for r, _ in ranks)
        elif expect == "last":
            hit = all(r == m for r, m in ranks)
        elif expect == "top3":
            hit = all(r <= 3 for r, _ in ranks)
        else:
            hit = True
        ok &= hit
        vals.append(Value(task, f"rank {', '.join(str(r) for r, _ in ranks)} of {n} (paper: {expect})", mean_rank))
    return vals, ok


def _snis_runs(root: Path, pattern: str, budget: str = "global"):
    rows = []
    for path, row in jsonl_rows(root, pattern):
        stats = row.get("press_stats") or {}
        if stats.get("budget") != budget or "logical_compression_per_layer" not in stats:
            continue
        m = re.search(r"/([^/]+)/cr([0-9.]+)/", "/" + path)
        rows.append((m.group(1) if m else "?", float(m.group(2)) if m else float("nan"), stats))
    if not rows:
        raise Missing(f"{pattern}: no {budget}-budget run with per-layer compression")
    return rows


@derived
def layer_budget(root: Path, files: str):
    """Global budget: mean logical compression of the first and last third of the layers (App. I.3, Fig. 9)."""
    import numpy as np

    per_layer = np.array(
        [[float(x) for x in s["logical_compression_per_layer"].split(",")] for _, _, s in _snis_runs(root, files)]
    )
    mean = per_layer.mean(0)
    third = max(1, len(mean) // 3)
    lo, hi = float(mean[:third].mean()), float(mean[-third:].mean())
    rho = float(np.corrcoef(np.arange(len(mean)), mean.argsort().argsort())[0, 1])
    return [
        Value("first third of layers", f"{lo:.3f}", lo),
        Value("last third", f"{hi:.3f}", hi),
        Value("Spearman(layer, compression)", f"{rho:+.2f}", rho),
        Value("requests", f"{len(per_layer)}"),
    ], lo < hi


@derived
def layer_budget_by_proposal(root: Path, files: str, conservative: str = "min_h", spiky: str = "h2o"):
    """Spread of per-layer compression across layers for two proposals (Fig. 9)."""
    import numpy as np

    by = {}
    for _, _, s in _snis_runs(root, files):
        by.setdefault(s.get("proposal"), []).append([float(x) for x in s["logical_compression_per_layer"].split(",")])
    if conservative not in by or spiky not in by:
        raise Missing(f"{files}: needs proposals {conservative} and {spiky}")
    out, stds = [], {}
    for name in (conservative, spiky):
        m = np.array(by[name]).mean(0)
        stds[name] = float(m.std())
        out.append(Value(name, f"layer std {m.std():.3f}, max - median {m.max() - np.median(m):.3f}", stds[name]))
    return out, stds[spiky] > stds[conservative]


@derived
def logical_vs_target(root: Path, files: str):
    """Global budget: requested ratio against the measured logical and physical (padded) compression."""
    runs = {}
    for press, ratio, stats in _snis_runs(root, files):
        runs.setdefault((press, ratio), []).append(stats)
    worst_l = worst_p = 0.0
    for (_press, ratio), stats in runs.items():
        logical = sum(s["logical_compression"] for s in stats) / len(stats)
        physical = sum(s["physical_compression"] for s in stats) / len(stats)
        worst_l = max(worst_l, abs(logical - ratio))
        worst_p = max(worst_p, abs(physical - ratio))
    return [
        Value("max |logical - target|", f"{worst_l:.4f}", worst_l),
        Value("max |physical - target|", f"{worst_p:.4f}", worst_p),
        Value("runs", f"{len(runs)} (press, ratio) cells"),
    ], worst_l <= 0.01


@derived
def correction_memory(root: Path, file: str):
    """SNIS memory beyond the kept entries: the bias (one float per kept entry and group, 1/(2 d) of the kept
    K/V bytes) and the padding of ragged groups (physical / logical - 1)."""
    df = read_csv(root, file)
    df = df[df.press.map(_snis)]
    if df.empty:
        raise Missing(f"{file}: no probabilistic-eviction row")
    d = model_shape(root)["head_dim"]
    pad = (df.physical_vs_full / df.logical_vs_full - 1).astype(float)
    return [
        Value("bias / kept K,V bytes", f"1/(2d) = {1 / (2 * d):.2%}", 1 / (2 * d)),
        Value("padding (physical / logical - 1)", f"{pad.min():.1%}..{pad.max():.1%}", float(pad.max())),
    ], True


@derived
def fig9b_masses(root: Path, file: str):
    """Best-head needle mass and entropy-pooled / mean-pooled mass per (layer, group) decision (Fig. 9b)."""
    df = read_csv(root, file)
    if df.empty:
        raise Missing(file)
    out, ok = [], True
    for protocol, sub in df.groupby("protocol"):
        ratio = (sub.pooled / sub["mean"].where(sub["mean"] > 0)).fillna(1.0)
        out.append(
            Value(
                str(protocol),
                f"best head median {sub.best_head.median():.3f}, pooled / mean median "
                f"{ratio.median():.3f} (90th pct {ratio.quantile(0.9):.3f})",
                float(ratio.median()),
            )
        )
        ok &= float(ratio.median()) <= 1.06
    return out, ok


@derived
def corrected_vs_uncorrected(root: Path, file: str):
    """Win score of every corrected probabilistic press against its ``_uncorrected`` twin, per ratio."""
    df = read_csv(root, file)
    better = worse = ties = 0
    for _ratio, sub in df.groupby("ratio"):
        s = sub.set_index("press").win_score
        for p in s.index:
            twin = f"{p}_uncorrected"
            if _snis(p) and twin in s.index:
                better += s[p] > s[twin] + 1e-12
                worse += s[p] < s[twin] - 1e-12
                ties += abs(s[p] - s[twin]) <= 1e-12
    total = better + worse + ties
    if not total:
        raise Missing(f"{file}: no corrected/uncorrected pair")
    return [
        Value(
            "corrected wins / ties / loses",
            f"{better} / {ties} / {worse} of {total} (press, ratio) cells",
            better / total,
        )
    ], better > worse


@derived
def tau2_task_level(root: Path, file: str):
    """Win score of each tau-2 probabilistic press against its tau-1 twin (App. I.2)."""
    df = read_csv(root, file)
    tau2 = sorted(p for p in set(df.press) if "tau2" in p)
    if not tau2:
        raise Missing(f"{file}: no tau-2 press")
    better = total = 0
    for p in tau2:
        twin = p.replace("_tau2", "")
        for _ratio, sub in df.groupby("ratio"):
            s = sub.set_index("press").win_score
            if p in s.index and twin in s.index:
                total += 1
                better += s[p] > s[twin]
    if not total:
        raise Missing(f"{file}: no tau-1 twin of {tau2}")
    return [
        Value("tau 2 beats tau 1", f"{better} of {total} (press, ratio) cells", better / total)
    ], better / total < 0.5
