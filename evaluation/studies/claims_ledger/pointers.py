"""The claims ledger's pointer language (:mod:`evaluation.studies.claims_ledger`): a claim's ``ours:`` list of
pointers, each resolved to an :class:`Outcome` (status, formatted values, whether the claim agrees); the first
pointer whose artifact exists wins."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from evaluation.studies.claims_ledger.analytic import ANALYTIC
from evaluation.studies.claims_ledger.artifacts import (
    Missing,
    Unreadable,
    Value,
    aggregate,
    artifact_path,
    as_number,
    dig,
    filter_rows,
    format_value,
    jsonl_rows,
    read_csv,
    read_json,
    scaled,
)
from evaluation.studies.claims_ledger.derived import DERIVED

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


def _csv_values(src: dict, root: Path) -> list[Value]:
    df = read_csv(root, src["file"])
    parts = src.get("values") or [{"column": src["column"]}]
    out = []
    for part in parts:
        flt = {**(src.get("filter") or {}), **(part.get("filter") or {})}
        sub = filter_rows(df, flt, src["file"])
        col = part.get("column", src.get("column"))
        if col not in sub.columns:
            raise Missing(f"{src['file']}: no column {col!r}")
        x = aggregate(sub[col], part.get("agg", src.get("agg", "first")))
        x = scaled(x, part.get("scale", src.get("scale")))
        out.append(Value(part.get("label"), format_value(x, part.get("fmt", src.get("fmt"))), as_number(x)))
    return out


def _json_values(src: dict, root: Path) -> list[Value]:
    data = read_json(root, src["file"])
    parts = src.get("values") or [{"key": src["key"]}]
    out = []
    for part in parts:
        try:
            x = dig(data, part.get("key", src.get("key")))
        except KeyError as err:
            raise Missing(f"{src['file']}: no key {err}") from err
        x = scaled(x, part.get("scale", src.get("scale")))
        out.append(Value(part.get("label"), format_value(x, part.get("fmt", src.get("fmt"))), as_number(x)))
    return out


def _jsonl_values(src: dict, root: Path) -> list[Value]:
    import pandas as pd

    rows = jsonl_rows(root, src["files"])
    vals = []
    for _, row in rows:
        try:
            vals.append(dig(row, src["field"]))
        except KeyError:
            continue
    if not vals:
        raise Missing(f"{src['files']}: no field {src['field']!r}")
    x = scaled(aggregate(pd.Series(vals), src.get("agg", "mean")), src.get("scale"))
    return [Value(src.get("label"), format_value(x, src.get("fmt")), as_number(x))]


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
        path = artifact_path(root, src["file"])
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
