"""The claims ledger: every claim of the three source papers beside this project's counterpart.

Usage::

    python scripts/claims_ledger.py                      # reads results/claims/claims.yaml, writes results/claims.md
    python scripts/claims_ledger.py --out /tmp/claims.md  # somewhere else

``results/claims/claims.yaml`` is the hand-curated source: for every claim its paper, section or table, the claim,
the paper's number and setting, and one or more pointers to our counterpart. This script never types a number of
ours: it reads every measured number from the committed artifact the pointer names (a CSV row filter and column,
a JSON key, a JSONL field, or a function below that reads the artifact) and computes the analytic ones with the
project's own code (:data:`ANALYTIC`). A pointer whose artifact does not exist (yet) is reported as "not measured
yet" with the command that would produce it, never as an error; the next pointer of the claim is tried first.

Pointer kinds (``ours:`` is a list; the first one whose artifact exists is used):

- ``csv``: ``file``, ``filter`` ({column: value or [values]}), ``column``, ``agg`` (first, mean, median, max, min,
  sum, count, frac_true, all_true), ``scale``, ``fmt``; or ``values``: a list of such parts, each with a ``label``
  and its own ``filter`` (merged over the pointer's) / ``column`` / ``agg`` / ``fmt``.
- ``json``: ``file``, ``key`` (dotted path) or ``values``.
- ``jsonl``: ``files`` (a glob), ``field`` (dotted path), ``agg``.
- ``derived``: ``fn`` (a name in :data:`DERIVED`), ``args``; reads committed artifacts, may say whether the claim
  holds.
- ``analytic``: ``fn`` (a name in :data:`ANALYTIC`), ``args``; exact computation with the project's code.
- ``test``: ``file``, ``name``: a property test that checks the claim on synthetic inputs (not run here; its
  existence is checked).
- ``none``: ``reason`` and optionally ``needs`` (a larger model, a GPU, data): no counterpart here.

Every pointer carries ``setting`` and ``command`` (how the artifact was or would be produced); ``check``
(``{op: <=|>=|==|approx|between, value, tol, lo, hi, part}``) turns the number into a yes/no "agrees" column.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

COMMAND = "python scripts/claims_ledger.py"
DEFAULT_CLAIMS = "results/claims/claims.yaml"
DEFAULT_OUT = "results/claims.md"

PAPERS = {
    "000": "Page-EntroKV: Hardware-Aligned, Entropy-Weighted KV-Cache Eviction under Grouped-Query Attention "
    "(Inbasekaran S, 2026)",
    "001": "EntroPrefill: Rényi-Guided Context Pruning with Conditional Stability Guarantees for "
    "Retrieval-Augmented Generation (arXiv 2610.09757, 2026)",
    "003": "A Probabilistic Interpretation of KV Cache Eviction (Geh, Chen, Israel, Grover, Van den Broeck)",
}
SHORT = {"000": "Page-EntroKV", "001": "EntroPrefill", "003": "Probabilistic eviction (SNIS)"}

REQUIRED_FIELDS = ("id", "paper", "where", "claim", "paper_value", "paper_setting", "ours", "explanation")
KINDS = ("csv", "json", "jsonl", "derived", "analytic", "test", "none")
MEASURED_KINDS = ("csv", "json", "jsonl", "derived")

MEASURED, COMPUTED, TESTED, PENDING, OUT_OF_REACH = (
    "measured",
    "computed",
    "tested",
    "not measured yet",
    "out of reach here",
)
STATUSES = (MEASURED, COMPUTED, TESTED, PENDING, OUT_OF_REACH)


class Missing(Exception):
    """The artifact a pointer names does not exist, or holds no matching row."""


class Unreadable(Missing):
    """The artifact exists but its layout is not what the pointer expects (a column or key renamed)."""


@dataclass
class Value:
    """One formatted part of a counterpart, e.g. ``("cr 0.5", "0.125", 0.125)``."""

    label: str | None
    text: str
    number: float | None = None


@dataclass
class Outcome:
    """What a claim's counterpart resolved to."""

    status: str
    values: list[Value] = field(default_factory=list)
    agrees: bool | None = None
    setting: str = ""
    command: str = ""
    note: str = ""
    needs: str = ""
    pending: list[tuple[str, str]] = field(default_factory=list)  # (artifact, command) of pointers not available

    @property
    def number(self) -> float | None:
        return next((v.number for v in self.values if v.number is not None), None)


# ------------------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------------------


def _fmt(x: Any, fmt: str | None = None) -> str:
    if fmt:
        return fmt.format(x)
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) < 1e-3:
            return f"{x:.3g}"
        return f"{x:.3f}"
    return str(x)


def _num(x: Any) -> float | None:
    try:
        if isinstance(x, bool):
            return float(x)
        v = float(x)
        return v if math.isfinite(v) else None
    except (TypeError, ValueError):
        return None


def _path(root: Path, rel: str) -> Path:
    p = root / rel
    if not p.exists():
        raise Missing(rel)
    return p


def _read_csv(root: Path, rel: str):
    """A committed CSV as a DataFrame.

    Raises:
        Missing: the file is absent, or it is a report table (``results/tables/<dataset>__<model>__<kind>.csv``)
            of a sweep still running: its ``__summary.csv`` marks a run incomplete, and numbers over part of the
            examples are not the claim's (a fallback stands in until the sweep is complete).
    """
    import pandas as pd

    df = pd.read_csv(_path(root, rel))
    if rel.startswith("results/tables/") and rel.count("__") == 2:
        summary = rel.rsplit("__", 1)[0] + "__summary.csv"
        runs = df if summary == rel else pd.read_csv(root / summary) if (root / summary).exists() else df
        if "complete" in runs and not runs.complete.astype(str).eq("True").all():
            raise Missing(f"{rel}: the sweep is incomplete ({summary} marks unfinished runs)")
    return df


def _read_json(root: Path, rel: str):
    return json.loads(_path(root, rel).read_text())


def _dig(obj: Any, key: str) -> Any:
    for part in key.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            raise KeyError(key)
    return obj


def _filter(df, flt: dict | None, rel: str):
    import numpy as np

    for col, want in (flt or {}).items():
        if col not in df.columns:
            raise Missing(f"{rel}: no column {col!r}")
        wants = want if isinstance(want, list) else [want]
        series = df[col]
        mask = np.zeros(len(df), dtype=bool)
        for w in wants:
            wn = _num(w)
            if wn is not None and not isinstance(w, bool) and series.dtype.kind in "fiu":
                mask |= np.isclose(series.astype(float), wn, rtol=0, atol=1e-9)
            else:
                mask |= series.astype(str).str.lower() == str(w).lower()
        df = df[mask]
    if df.empty:
        raise Missing(f"{rel}: no row matches {flt}")
    return df


def _bools(series):
    if series.dtype == bool:
        return series
    return series.astype(str).str.lower().isin(["true", "1", "1.0"])


def _aggregate(series, agg: str):
    if agg == "first":
        return series.iloc[0].item() if hasattr(series.iloc[0], "item") else series.iloc[0]
    if agg == "count":
        return len(series)
    if agg == "frac_true":
        return float(_bools(series).mean())
    if agg == "all_true":
        return bool(_bools(series).all())
    if agg == "n_true":
        return int(_bools(series).sum())
    vals = series.astype(float)
    if agg == "mean":
        return float(vals.mean())
    if agg == "median":
        return float(vals.median())
    if agg == "max":
        return float(vals.max())
    if agg == "min":
        return float(vals.min())
    if agg == "sum":
        s = float(vals.sum())
        return int(s) if s.is_integer() else s
    raise ValueError(f"unknown agg {agg!r}")


def _scaled(x, scale):
    if scale is None or isinstance(x, (bool, str)):
        return x
    return x * scale


# ------------------------------------------------------------------------------------------------------------
# pointer kinds
# ------------------------------------------------------------------------------------------------------------


def _csv_values(src: dict, root: Path) -> list[Value]:
    df = _read_csv(root, src["file"])
    parts = src.get("values") or [{"column": src["column"]}]
    out = []
    for part in parts:
        flt = {**(src.get("filter") or {}), **(part.get("filter") or {})}
        sub = _filter(df, flt, src["file"])
        col = part.get("column", src.get("column"))
        if col not in sub.columns:
            raise Missing(f"{src['file']}: no column {col!r}")
        x = _aggregate(sub[col], part.get("agg", src.get("agg", "first")))
        x = _scaled(x, part.get("scale", src.get("scale")))
        out.append(Value(part.get("label"), _fmt(x, part.get("fmt", src.get("fmt"))), _num(x)))
    return out


def _json_values(src: dict, root: Path) -> list[Value]:
    data = _read_json(root, src["file"])
    parts = src.get("values") or [{"key": src["key"]}]
    out = []
    for part in parts:
        try:
            x = _dig(data, part.get("key", src.get("key")))
        except KeyError as err:
            raise Missing(f"{src['file']}: no key {err}") from err
        x = _scaled(x, part.get("scale", src.get("scale")))
        out.append(Value(part.get("label"), _fmt(x, part.get("fmt", src.get("fmt"))), _num(x)))
    return out


def _jsonl_rows(root: Path, pattern: str) -> list[tuple[str, dict]]:
    files = sorted(glob.glob(str(root / pattern)))
    if not files:
        raise Missing(pattern)
    rows = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                rows.append((str(Path(f).relative_to(root)), json.loads(line)))
    if not rows:
        raise Missing(f"{pattern}: empty")
    return rows


def _jsonl_values(src: dict, root: Path) -> list[Value]:
    import pandas as pd

    rows = _jsonl_rows(root, src["files"])
    vals = []
    for _, row in rows:
        try:
            vals.append(_dig(row, src["field"]))
        except KeyError:
            continue
    if not vals:
        raise Missing(f"{src['files']}: no field {src['field']!r}")
    x = _scaled(_aggregate(pd.Series(vals), src.get("agg", "mean")), src.get("scale"))
    return [Value(src.get("label"), _fmt(x, src.get("fmt")), _num(x))]


def _check(values: list[Value], spec: dict | None) -> bool | None:
    if not spec:
        return None
    part = spec.get("part")
    if part is None:
        v = next((v.number for v in values if v.number is not None), None)
    elif isinstance(part, int):
        v = values[part].number
    else:
        v = next((x.number for x in values if x.label == part), None)
    if v is None:
        return None
    op = spec["op"]
    if op == "<=":
        return v <= spec["value"] + spec.get("tol", 0.0)
    if op == ">=":
        return v >= spec["value"] - spec.get("tol", 0.0)
    if op == "==":
        return v == spec["value"]
    if op == "approx":
        return abs(v - spec["value"]) <= spec.get("tol", 1e-9)
    if op == "between":
        return spec["lo"] <= v <= spec["hi"]
    raise ValueError(f"unknown check op {op!r}")


def resolve_pointer(src: dict, root: Path) -> Outcome:
    """Resolve one pointer; raises :class:`Missing` when its artifact is absent."""
    kind = src["kind"]
    base = {
        "setting": src.get("setting", ""),
        "command": src.get("command", ""),
        "note": src.get("note", ""),
        "needs": src.get("needs", ""),
    }
    if kind == "none":
        status = OUT_OF_REACH if src.get("needs") else PENDING
        return Outcome(
            status,
            [Value(None, "–")],
            None,
            note=src.get("reason", ""),
            **{k: v for k, v in base.items() if k != "note"},
        )
    if kind == "test":
        path = _path(root, src["file"])
        if not re.search(rf"^def {re.escape(src['name'])}\(", path.read_text(), re.MULTILINE):
            raise Missing(f"{src['file']}::{src['name']}")
        return Outcome(TESTED, [Value(None, f"`{src['file']}::{src['name']}`")], None, **base)
    if kind in ("derived", "analytic"):
        registry = DERIVED if kind == "derived" else ANALYTIC
        fn = registry[src["fn"]]
        values, agrees = fn(root, **(src.get("args") or {}))
        if src.get("check"):
            agrees = _check(values, src["check"])
        return Outcome(MEASURED if kind == "derived" else COMPUTED, values, agrees, **base)
    reader = {"csv": _csv_values, "json": _json_values, "jsonl": _jsonl_values}[kind]
    values = reader(src, root)
    return Outcome(MEASURED, values, _check(values, src.get("check")), **base)


def _artifact(src: dict) -> str:
    args = src.get("args") or {}
    return (
        src.get("artifact")
        or src.get("file")
        or src.get("files")
        or args.get("file")
        or args.get("files")
        or f"({src.get('kind')} pointer)"
    )


def evaluate_claim(claim: dict, root: Path) -> Outcome:
    """The first pointer of ``claim['ours']`` whose artifact exists; "not measured yet" when none does."""
    pending: list[tuple[str, str]] = []
    missing_notes = []
    for src in claim["ours"]:
        try:
            try:
                out = resolve_pointer(src, root)
            except (KeyError, AttributeError, IndexError, TypeError, ValueError) as err:
                if src["kind"] not in MEASURED_KINDS:
                    raise
                raise Unreadable(f"unreadable {_artifact(src)}: {type(err).__name__}: {err}") from err
        except Missing as err:
            pending.append((src.get("artifact") or _artifact(src), src.get("command", "")))
            missing_notes.append(str(err))
            continue
        out.pending = pending
        return out
    first = claim["ours"][0]
    return Outcome(
        PENDING,
        [Value(None, "not measured yet")],
        None,
        setting=first.get("setting", ""),
        command=first.get("command", ""),
        note="missing: " + "; ".join(missing_notes),
        needs=first.get("needs", ""),
        pending=pending,
    )


# ------------------------------------------------------------------------------------------------------------
# derived: numbers read from committed artifacts
# ------------------------------------------------------------------------------------------------------------

DERIVED: dict[str, Callable] = {}
ANALYTIC: dict[str, Callable] = {}

UOR_RUN = "results/uor/smollm2-135m/run.json"
HEAD_INDEPENDENT = ("h2o", "last_row", "snapkv")


def derived(fn):
    DERIVED[fn.__name__] = fn
    return fn


def analytic(fn):
    ANALYTIC[fn.__name__] = fn
    return fn


def _model_shape(root: Path) -> dict:
    run = _read_json(root, UOR_RUN)
    return {k: run[k] for k in ("H_Q", "G", "r", "L", "head_dim")} | {"config": run.get("config", {})}


@derived
def uor_ceiling(root: Path, file: str):
    """Max head-independent UOR against the ceiling r, and the share of cells inside ``[1, min(r, T/s)]``."""
    df = _read_csv(root, file)
    r = _model_shape(root)["r"]
    hi = df[df.scorer.isin(HEAD_INDEPENDENT) & _bools(df.finite)]
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
    df = _filter(_read_csv(root, file), {"k_over_t": k_over_t}, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT)]
    if df.empty:
        raise Missing(f"{file}: no head-independent row at k/T = {k_over_t}")
    r = _model_shape(root)["r"]
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
    df = _read_csv(root, file).set_index("class")
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
    df = _read_csv(root, file).set_index("class")
    if "sink" not in df.index or "contextual" not in df.index:
        raise Missing(f"{file}: no sink/contextual class")
    raw = float(df.loc["sink", "raw_weight"] / df.loc["contextual", "raw_weight"])
    iso = float(df.loc["sink", "isolated_weight"] / df.loc["contextual", "isolated_weight"])
    return [Value("raw", f"{raw:.2f}x", raw), Value("isolated", f"{iso:.2f}x", iso)], bool(raw > 1 >= iso)


@derived
def census_ceiling(root: Path, file: str):
    """Share of sink-isolated entropies below the uniform-residual ceiling ln(T - |S|) (Fig. 7)."""
    df = _read_csv(root, file)
    n_sink = _model_shape(root)["config"].get("presses", {}).get("page_entrokv", {}).get("n_sink", 4)
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
    df = _filter(_read_csv(root, file), {"press": press}, file)
    vals, ok = [], True
    for _, row in df.sort_values("ratio").iterrows():
        eff, ratio = float(row.effective_compression), float(row.ratio)
        vals.append(Value(f"cr {ratio:g}", f"{eff:.3f}", eff))
        ok &= abs(eff - ratio) <= tol if op == "==" else eff >= ratio - 1e-9
    return vals, ok


@derived
def cert_counts(root: Path, file: str):
    """Cells certified UOR >= 2 by Bonferroni and by the sandwich bound, over the head-independent rows."""
    df = _read_csv(root, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT)]
    if df.empty:
        raise Missing(f"{file}: no head-independent rows")
    run = _read_json(root, UOR_RUN)
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
    df = _read_csv(root, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT) & _bools(df.finite)]
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
    df = _read_csv(root, file)
    df = df[df.scorer.isin(HEAD_INDEPENDENT) & _bools(df.finite)]
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
    df = _read_csv(root, file)
    row = df.loc[df.max_w.idxmax()]
    vals = [Value(f"alpha {a:g}", f"{w:.3f}", w) for a, w in zip(df.alpha, df.max_w)]
    return [Value("peak at alpha", f"{row.alpha:g}", float(row.alpha))] + vals, float(row.alpha) in (1.0, 2.0)


#: bytes per element of the cache dtypes the speed benchmark records
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@derived
def kv_footprint(root: Path, file: str):
    """Uncompressed cache bytes against paper 000 eq. 3, ``2 * e * L * H_KV * D_head * T`` (batch 1)."""
    df = _filter(_read_csv(root, file), {"press": "no_press"}, file)
    shape = _model_shape(root)
    ratios = []
    for _, row in df.iterrows():
        e = DTYPE_BYTES[str(row["dtype"])]
        ratios.append(
            float(row.kv_full_bytes) / (2 * e * shape["L"] * shape["G"] * shape["head_dim"] * float(row.context_length))
        )
    lo, hi = min(ratios), max(ratios)
    return [Value("measured / formula", f"{lo:.4f}..{hi:.4f} over {len(ratios)} rows", lo)], bool(
        abs(lo - 1) < 1e-9 and abs(hi - 1) < 1e-9
    )


@derived
def transfer_payload(root: Path, file: str):
    """EntroPrefill's retained cache bytes against paper 001 section 8.2, ``2 e L G d T'``."""
    df = _filter(_read_csv(root, file), {"press": "entroprefill"}, file)
    shape = _model_shape(root)
    ratios = []
    for _, row in df.iterrows():
        stats = json.loads(row.press_stats) if isinstance(row.press_stats, str) else {}
        t_prime = stats.get("T_prime") or None
        if not t_prime:
            continue
        e = DTYPE_BYTES[str(row["dtype"])]
        ratios.append(float(row.kv_logical_bytes) / (2 * e * shape["L"] * shape["G"] * shape["head_dim"] * t_prime))
    if not ratios:
        raise Missing(f"{file}: no pruned EntroPrefill row")
    lo, hi = min(ratios), max(ratios)
    return [Value("measured / formula", f"{lo:.4f}..{hi:.4f} over {len(ratios)} pruned rows", lo)], bool(
        abs(lo - 1) < 1e-9 and abs(hi - 1) < 1e-9
    )


@derived
def union_bounds(root: Path, file: str):
    """Paper 001 eq. 30: ``K <= U_l <= min(G K, N_P)`` per (prompt, press, layer)."""
    df = _read_csv(root, file)
    page = _model_shape(root)["config"].get("presses", {}).get("page_entrokv", {}).get("page_size", 16)
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
    df = _read_csv(root, file)
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

    _path(root, config)  # the config must exist; its press's settings are the class defaults it does not restate
    cfg = run_settings(compose_config([f"press={Path(config).stem}"]))["press"]
    shape = _model_shape(root)
    L = shape["L"]
    layers = cfg.get("monitored_layers")
    J = len(layers) if layers else len(range(min(L // 3, L - 2), max(min(L // 2, L - 1), min(L // 3, L - 2) + 1)))
    b = hoeffding_radius(J, shape["H_Q"], float(cfg["delta"]), int(cfg["audit_size"]))
    df = _read_csv(root, file)
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
    df = _read_csv(root, file)
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
    df = _read_csv(root, file)
    tau = _model_shape(root)["config"].get("presses", {}).get("page_entrokv", {}).get("tau", 0.5)
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
    df = _read_csv(root, file)
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
        Missing: the table is absent or its sweep incomplete (:func:`_read_csv`), or a press of ``among`` has no
            complete run at some ratio of the table.
    """
    import pandas as pd

    from evaluation.report import scan, win_table

    df = _read_csv(root, file)
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
    df = _read_csv(root, file)
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


@derived
def win_rank(root: Path, file: str, press: str, among: list[str] | None = None):
    """Rank of ``press`` by win score at every ratio (1 = best); ``among``: scores among those presses only
    (:func:`_wins`)."""
    df = _wins(root, file, among)
    vals, ok = [], True
    for ratio, sub in sorted(df.groupby("ratio")):
        if press not in set(sub.press):
            raise Missing(f"{file}: no {press} at cr {ratio:g}")
        ranked = sub.sort_values("win_score", ascending=False).press.tolist()
        rank = ranked.index(press) + 1
        ok &= rank == 1
        best = ranked[0]
        vals.append(Value(f"cr {ratio:g}", f"{rank} of {len(ranked)} (best: {best})", rank))
    return vals, ok


@derived
def snis_best_rank(root: Path, file: str, press: str, among: list[str] | None = None):
    """Rank of ``press`` among the probabilistic-eviction presses by win score, at every ratio; ``among``: win
    scores among those presses only (:func:`_wins`), ranked among their ``snis_*`` members."""
    df = _wins(root, file, among)
    df = df[df.press.map(_snis)]
    vals, ok = [], True
    for ratio, sub in sorted(df.groupby("ratio")):
        if press not in set(sub.press):
            raise Missing(f"{file}: no {press} at cr {ratio:g}")
        ranked = sub.sort_values("win_score", ascending=False).press.tolist()
        rank = ranked.index(press) + 1
        ok &= rank == 1
        vals.append(Value(f"cr {ratio:g}", f"{rank} of {len(ranked)} SNIS presses (best: {ranked[0]})", rank))
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
    df = _read_csv(root, file)
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
    for path, row in _jsonl_rows(root, pattern):
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
    df = _read_csv(root, file)
    df = df[df.press.map(_snis)]
    if df.empty:
        raise Missing(f"{file}: no probabilistic-eviction row")
    d = _model_shape(root)["head_dim"]
    pad = (df.physical_vs_full / df.logical_vs_full - 1).astype(float)
    return [
        Value("bias / kept K,V bytes", f"1/(2d) = {1 / (2 * d):.2%}", 1 / (2 * d)),
        Value("padding (physical / logical - 1)", f"{pad.min():.1%}..{pad.max():.1%}", float(pad.max())),
    ], True


@derived
def fig9b_masses(root: Path, file: str):
    """Best-head needle mass and entropy-pooled / mean-pooled mass per (layer, group) decision (Fig. 9b)."""
    df = _read_csv(root, file)
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
    df = _read_csv(root, file)
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
    df = _read_csv(root, file)
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


# ------------------------------------------------------------------------------------------------------------
# analytic: exact computations with the project's code
# ------------------------------------------------------------------------------------------------------------


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
    from presses.core.needle_group import needle_group_attention
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


# ------------------------------------------------------------------------------------------------------------
# validation, rendering
# ------------------------------------------------------------------------------------------------------------


def validate(claims: list[dict]) -> list[str]:
    """Problems with the YAML rows (missing fields, unknown kinds or functions, duplicate ids)."""
    problems, seen = [], set()
    for i, c in enumerate(claims):
        cid = c.get("id", f"#{i}")
        for f in REQUIRED_FIELDS:
            if c.get(f) in (None, "", []):
                problems.append(f"{cid}: missing {f}")
        if cid in seen:
            problems.append(f"{cid}: duplicate id")
        seen.add(cid)
        if str(c.get("paper")) not in PAPERS:
            problems.append(f"{cid}: unknown paper {c.get('paper')!r}")
        for src in c.get("ours") or []:
            kind = src.get("kind")
            if kind not in KINDS:
                problems.append(f"{cid}: unknown kind {kind!r}")
                continue
            if kind in MEASURED_KINDS and not src.get("command"):
                problems.append(f"{cid}: a {kind} pointer needs the command that produced its artifact")
            if kind in MEASURED_KINDS and not src.get("setting"):
                problems.append(f"{cid}: a {kind} pointer needs its setting")
            if kind == "csv" and not (src.get("file") and (src.get("column") or src.get("values"))):
                problems.append(f"{cid}: csv pointer needs file and column or values")
            if kind == "json" and not (src.get("file") and (src.get("key") or src.get("values"))):
                problems.append(f"{cid}: json pointer needs file and key or values")
            if kind == "jsonl" and not (src.get("files") and src.get("field")):
                problems.append(f"{cid}: jsonl pointer needs files and field")
            if kind == "derived" and src.get("fn") not in DERIVED:
                problems.append(f"{cid}: unknown derived fn {src.get('fn')!r}")
            if kind == "analytic" and src.get("fn") not in ANALYTIC:
                problems.append(f"{cid}: unknown analytic fn {src.get('fn')!r}")
            if kind == "test" and not (src.get("file") and src.get("name")):
                problems.append(f"{cid}: test pointer needs file and name")
            if kind == "none" and not src.get("reason"):
                problems.append(f"{cid}: none pointer needs a reason")
    return problems


def load_claims(path: Path) -> list[dict]:
    data = yaml.safe_load(path.read_text())
    claims = data["claims"] if isinstance(data, dict) else data
    for c in claims:
        c["paper"] = str(c.get("paper", "")).zfill(3)
    return claims


def _cell(text: Any) -> str:
    s = " ".join(str(text).split())
    return s.replace("|", "\\|")


def _values_text(out: Outcome) -> str:
    return "; ".join(f"{v.label}: {v.text}" if v.label else v.text for v in out.values)


def _compared(claim: dict, out: Outcome) -> float | None:
    """The number of ours that ``paper_number`` is compared with: the part named by ``compare_part`` (a label or an
    index), else the first numeric part."""
    part = claim.get("compare_part")
    if part is None:
        return out.number
    if isinstance(part, int):
        return out.values[part].number if part < len(out.values) else None
    return next((v.number for v in out.values if v.label == str(part)), None)


def _difference(claim: dict, out: Outcome) -> str:
    p = claim.get("paper_number")
    ours = _compared(claim, out)
    if p is None or ours is None or out.status not in (MEASURED, COMPUTED):
        return ""
    d = ours - float(p)
    return "Δ 0" if d == 0 else f"Δ {d:+.3g}"


def _agrees(out: Outcome) -> str:
    return {True: "yes", False: "no", None: "–"}[out.agrees]


def render(claims: list[dict], outcomes: list[Outcome], claims_path: str) -> str:
    by_paper: dict[str, list[tuple[dict, Outcome]]] = {}
    for c, o in zip(claims, outcomes):
        by_paper.setdefault(c["paper"], []).append((c, o))
    n = len(claims)
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    md = [
        "# Claims ledger: the papers' claims beside this project's counterparts",
        "",
        (
            f"_Generated by `{COMMAND}` from `{claims_path}` and the committed artifacts it points to. "
            "Regenerate it; never edit by hand._"
        ),
        "",
        (
            "One row per numeric or qualitative claim of the three source papers: where the paper makes it, its "
            "number and setting; our counterpart on the embedded model (SmolLM2-135M-Instruct: 30 layers, 9 query "
            "heads, 3 KV heads, r = 3, CPU) with its number, setting and the command that produced it; whether it "
            "agrees, and why the two differ. Papers:"
        ),
        "",
    ]
    md += [f"- **{k}** ({SHORT[k]}): {v}" for k, v in PAPERS.items()]
    md += [
        "",
        "## Summary",
        "",
        "| paper | claims | " + " | ".join(STATUSES) + " | agrees yes / no |",
        "|---|---:|" + "---:|" * len(STATUSES) + "---|",
    ]
    for paper, rows in sorted(by_paper.items()):
        outs = [o for _, o in rows]
        md.append(
            f"| {paper} {SHORT[paper]} | {len(rows)} | "
            + " | ".join(str(sum(o.status == s for o in outs)) for s in STATUSES)
            + f" | {sum(o.agrees is True for o in outs)} / {sum(o.agrees is False for o in outs)} |"
        )
    md.append(
        f"| **all** | **{n}** | "
        + " | ".join(f"**{counts[s]}**" for s in STATUSES)
        + f" | {sum(o.agrees is True for o in outcomes)} / {sum(o.agrees is False for o in outcomes)} |"
    )
    measured, computed = counts[MEASURED], counts[COMPUTED]
    md += [
        "",
        (
            f"Measured on the embedded model from a committed artifact: **{measured} of {n} "
            f"({100 * measured / n:.0f} %)**; measured or computed exactly by this project's code: "
            f"**{measured + computed} of {n} ({100 * (measured + computed) / n:.0f} %)**."
        ),
        "",
        (
            "Statuses: *measured*: read from a committed artifact of a run on the embedded model; *computed*: "
            "an analytic claim (worked example, constant, bound) evaluated exactly with the project's code; "
            "*tested*: a property the paper proves, checked by a named test on synthetic inputs but with no "
            "number on the model; *not measured yet*: the artifact does not exist yet (the row gives the command "
            "that would produce it); *out of reach here*: needs what this project does not have (a larger model, a "
            "GPU, data that must be downloaded) or has no measurable content. *agrees* is computed from the "
            "numbers (the row's check, or the function that reads the artifact); `–` where the paper's and our "
            "settings make a yes/no meaningless."
        ),
        "",
    ]
    pend: dict[tuple[str, str], list[str]] = {}
    for c, o in zip(claims, outcomes):
        for art, cmd in o.pending:
            pend.setdefault((art, cmd), []).append(c["id"])
    if pend:
        md += [
            "### Artifacts not there yet, and the commands that would make them",
            "",
            "| artifact | command | claims waiting (a fallback may stand in meanwhile) |",
            "|---|---|---|",
        ]
        for (art, cmd), ids in sorted(pend.items()):
            md.append(f"| `{_cell(art)}` | `{_cell(cmd)}` | {', '.join(ids)} |")
        md.append("")
    reach = [(c, o) for c, o in zip(claims, outcomes) if o.status in (OUT_OF_REACH, PENDING) and not o.pending]
    if reach:
        md += ["### No counterpart, and why", "", "| claim | status | why |", "|---|---|---|"]
        for c, o in reach:
            md.append(f"| {c['id']} | {o.status}{' (needs ' + o.needs + ')' if o.needs else ''} | {_cell(o.note)} |")
        md.append("")
    for paper, rows in sorted(by_paper.items()):
        md += [
            f"## Paper {paper}: {SHORT[paper]}",
            "",
            f"{PAPERS[paper]}.",
            "",
            (
                "| id | where | claim | paper: number (setting) | ours: number (setting) | status | agrees | "
                "difference and why | command |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c, o in rows:
            ours = _values_text(o)
            if o.setting:
                ours += f" ({o.setting})"
            if o.note and o.status in (MEASURED, COMPUTED, TESTED):
                ours += f". {o.note}"
            if o.pending and o.status != PENDING:
                ours += ". Pending: " + "; ".join(f"`{a}`" for a, _ in o.pending)
            status = o.status + (f"; needs {o.needs}" if o.needs else "")
            why = " ".join(x for x in (_difference(c, o), str(c["explanation"])) if x)
            cmd = f"`{o.command}`" if o.command else "–"
            md.append(
                "| "
                + " | ".join(
                    _cell(x)
                    for x in (
                        c["id"],
                        c["where"],
                        c["claim"],
                        f"**{c['paper_value']}** ({c['paper_setting']})",
                        ours,
                        status,
                        _agrees(o),
                        why,
                        cmd,
                    )
                )
                + " |"
            )
        md.append("")
    return "\n".join(md)


def build(claims_path: Path, root: Path) -> tuple[list[dict], list[Outcome]]:
    claims = load_claims(claims_path)
    problems = validate(claims)
    if problems:
        raise ValueError("claims.yaml problems:\n" + "\n".join(problems))
    return claims, [evaluate_claim(c, root) for c in claims]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--claims", default=DEFAULT_CLAIMS, help="the hand-curated YAML (relative to --root)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="the ledger to write (relative to --root)")
    ap.add_argument("--root", default=str(REPO), help="the repository whose artifacts are read")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    claims, outcomes = build(root / args.claims, root)
    out = root / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(claims, outcomes, args.claims) + "\n")
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    print(f"{len(claims)} claims -> {out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return out


if __name__ == "__main__":
    main()
