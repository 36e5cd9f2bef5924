"""The claims ledger's Markdown (:mod:`evaluation.studies.claims_ledger`): the YAML rows checked, every claim's
counterpart resolved, and ``results/claims.md`` written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.studies import REPO
from evaluation.studies.claims_ledger.analytic import ANALYTIC
from evaluation.studies.claims_ledger.derived import DERIVED
from evaluation.studies.claims_ledger.pointers import (
    COMPUTED,
    KINDS,
    MEASURED,
    MEASURED_KINDS,
    OUT_OF_REACH,
    PENDING,
    STATUSES,
    TESTED,
    Outcome,
    evaluate_claim,
)

#: the command recorded in the ledger (``python -m evaluation.studies.claims_ledger`` is the same)
COMMAND = "python scripts/claims_ledger.py"
DESCRIPTION = "The claims ledger: every claim of the three source papers beside this project's counterpart."
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
    ap = ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--claims", default=DEFAULT_CLAIMS, help="the hand-curated YAML (relative to --root)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="the ledger to write (relative to --root)")
    ap.add_argument("--root", default=str(REPO), help="the repository whose artifacts are read")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    claims, outcomes = build(root / args.claims, root)
    out = root / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, render(claims, outcomes, args.claims) + "\n")
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    print(f"{len(claims)} claims -> {out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return out
