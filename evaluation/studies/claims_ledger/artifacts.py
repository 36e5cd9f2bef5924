"""Reading the committed artifacts a claim's pointer names (:mod:`evaluation.studies.claims_ledger`): a CSV's rows
filtered and aggregated, a JSON key, JSONL rows, the embedded model's shape, and a number formatted for the ledger.
Every reader raises :class:`Missing` when the artifact (or the row it needs) is not there."""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluation.predictions import read_text

#: the UOR study's run record: the embedded model's shape and the study's press config
UOR_RUN = "results/uor/smollm2-135m/run.json"


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


def format_value(x: Any, fmt: str | None = None) -> str:
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


def as_number(x: Any) -> float | None:
    try:
        if isinstance(x, bool):
            return float(x)
        v = float(x)
        return v if math.isfinite(v) else None
    except (TypeError, ValueError):
        return None


def artifact_path(root: Path, rel: str) -> Path:
    p = root / rel
    if not p.exists():
        raise Missing(rel)
    return p


def read_csv(root: Path, rel: str):
    """A committed CSV as a DataFrame.

    Raises:
        Missing: the file is absent, or it is a report table (``results/tables/<dataset>__<model>__<kind>.csv``)
            of a sweep still running: its ``__summary.csv`` marks a run incomplete, and numbers over part of the
            examples are not the claim's (a fallback stands in until the sweep is complete).
    """
    import pandas as pd

    df = pd.read_csv(artifact_path(root, rel))
    if rel.startswith("results/tables/") and rel.count("__") == 2:
        summary = rel.rsplit("__", 1)[0] + "__summary.csv"
        runs = df if summary == rel else pd.read_csv(root / summary) if (root / summary).exists() else df
        if "complete" in runs and not runs.complete.astype(str).eq("True").all():
            raise Missing(f"{rel}: the sweep is incomplete ({summary} marks unfinished runs)")
    return df


def read_json(root: Path, rel: str):
    return json.loads(artifact_path(root, rel).read_text())


def dig(obj: Any, key: str) -> Any:
    for part in key.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            raise KeyError(key)
    return obj


def filter_rows(df, flt: dict | None, rel: str):
    import numpy as np

    for col, want in (flt or {}).items():
        if col not in df.columns:
            raise Missing(f"{rel}: no column {col!r}")
        wants = want if isinstance(want, list) else [want]
        series = df[col]
        mask = np.zeros(len(df), dtype=bool)
        for w in wants:
            wn = as_number(w)
            if wn is not None and not isinstance(w, bool) and series.dtype.kind in "fiu":
                mask |= np.isclose(series.astype(float), wn, rtol=0, atol=1e-9)
            else:
                mask |= series.astype(str).str.lower() == str(w).lower()
        df = df[mask]
    if df.empty:
        raise Missing(f"{rel}: no row matches {flt}")
    return df


def bools(series):
    if series.dtype == bool:
        return series
    return series.astype(str).str.lower().isin(["true", "1", "1.0"])


def aggregate(series, agg: str):
    if agg == "first":
        return series.iloc[0].item() if hasattr(series.iloc[0], "item") else series.iloc[0]
    if agg == "count":
        return len(series)
    if agg == "frac_true":
        return float(bools(series).mean())
    if agg == "all_true":
        return bool(bools(series).all())
    if agg == "n_true":
        return int(bools(series).sum())
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


def scaled(x, scale):
    if scale is None or isinstance(x, (bool, str)):
        return x
    return x * scale


def jsonl_rows(root: Path, pattern: str) -> list[tuple[str, dict]]:
    """``(path under root, row)`` of every JSON line of the files ``pattern`` (a glob under ``root``) names; a
    ``*.jsonl`` pattern also reads a file stored compressed (``<name>.jsonl.gz``, as a finished run's rows are:
    :mod:`evaluation.predictions`) where the plain file is absent."""
    files = glob.glob(str(root / pattern))
    if pattern.endswith(".jsonl"):
        plain = set(files)
        files += [f for f in glob.glob(str(root / pattern) + ".gz") if f.removesuffix(".gz") not in plain]
    files = sorted(files)
    if not files:
        raise Missing(pattern)
    rows = []
    for f in files:
        for line in read_text(Path(f)).splitlines():
            if line.strip():
                rows.append((str(Path(f).relative_to(root)), json.loads(line)))
    if not rows:
        raise Missing(f"{pattern}: empty")
    return rows


def model_shape(root: Path) -> dict:
    run = read_json(root, UOR_RUN)
    return {k: run[k] for k in ("H_Q", "G", "r", "L", "head_dim")} | {"config": run.get("config", {})}
