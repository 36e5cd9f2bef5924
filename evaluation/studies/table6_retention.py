"""Paper 000's Table 6 and Fig. 9b on the embedded model: needle-page retention, entropy against mean pooling.

Usage (``python -m evaluation.studies.table6_retention`` is the same)::

    python scripts/table6_retention.py                       # writes results/uor/smollm2-135m/table6_*.{csv,md,png}
    python scripts/table6_retention.py --lengths 959 --n-per-depth 1 --out /tmp/t6 --parts /tmp/t6/parts  # a look
    python scripts/table6_retention.py --protocols question_after &   # the two protocols in parallel; resumable
    python scripts/table6_retention.py --protocols question_inside

For every needle prompt (needle depths 0-100 %, prompt lengths about 959, 1474 and 1990 tokens, both protocols:
the question after compression and inside the compressed context) one uncompressed prefill is recorded and four
Page-EntroKV variants are replayed on it at retention 0.2 (compression ratio 0.8), each with ``record=True``:
our policy (``page_entrokv``) and paper 000's Algorithm 1 (``page_entrokv_paper000``), each with entropy pooling
and with arithmetic-mean pooling. Two criteria (docs/methods.md §1.13; paper 000 Table 6):

- **pooled selection**: the fraction of (layer, group) decisions that keep every page holding a token of the needle's
  value (no cross-layer requirement);
- **strict all-layer**: a prompt counts 1 when every layer and group keeps those pages, else 0.

Fig. 9b (paper 000 appendix): per (layer, group) decision, the needle-value mass of the group's best head, of the
entropy-pooled score and of the mean-pooled score, from the same observer attention the press pools.

Outputs (``--out``): ``table6_retention.csv`` (one row per prompt and variant), ``table6_fig9b.csv`` (one row per
prompt, layer and group), ``table6_reproduction.md`` (the tables, the paper's numbers beside ours, the command) and
``table6_fig9b.png``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from evaluation.cli import ArgumentParser

# read by transformers when it is first imported, so set before the imports below
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no weight-loading progress bars in the log

from hydra.utils import instantiate
from kvpress import KVPressTextGenerationPipeline
from transformers import DynamicCache

from evaluation import tables
from evaluation.atomic import save_figure, write_atomic
from evaluation.datasets.needle import NeedleDataset
from evaluation.harness import compose_config
from evaluation.memo import ReplayMemo
from evaluation.models import load_model
from evaluation.registry import sharing
from evaluation.replay import PrefillCapture, replay_prefill
from evaluation.studies import REPO
from evaluation.uor.study import retention_from_records
from presses import PageEntroKVPress

#: (variant name, press config, pooling override)
VARIANTS = [
    ("ours_entropy", "page_entrokv", None),
    ("ours_mean", "page_entrokv", "mean"),
    ("paper000_entropy", "page_entrokv_paper000", None),
    ("paper000_mean", "page_entrokv_paper000", "mean"),
]
#: the shortest target prompt length (tokens): the chat template and the question take about 90, a needle 64
MIN_LENGTH = 256
#: protocol name -> question inside the compressed context
PROTOCOLS = {"question_after": False, "question_inside": True}
#: Paper 000 Table 6 (Qwen2.5-1.5B-Instruct, r = 6, 20 % budget): pooled-selection retention by T.
PAPER_POOLED = {959: (0.0, 100.0), 1469: (0.0, 100.0), 1989: (0.0, 100.0), 2499: (0.0, 100.0)}


class _Observed(PageEntroKVPress):
    """A Page-EntroKV press that also keeps each layer's observer attention ``(H_Q, T)`` (batch row 0)."""

    def __post_init__(self):
        super().__post_init__()
        self.observed = {}

    def _observer_attention(self, module, hidden_states, keys, attentions, kwargs):
        out = super()._observer_attention(module, hidden_states, keys, attentions, kwargs)
        self.observed[module.layer_idx] = out[0].float().cpu()
        return out


def value_positions(tokenizer, ids: torch.Tensor, value: str) -> torch.Tensor:
    """Token positions ``(n,)`` of the needle's value in ``ids (1, T)``: the tokens whose decoded text overlaps the
    value's characters in the concatenation of the tokens' own decodings (robust where a decode/encode round trip
    of the whole prompt changes the ids).

    Raises:
        ValueError: if the value does not occur exactly once.
    """
    pieces = [tokenizer.decode([i]) for i in ids[0].tolist()]
    ends = torch.tensor([len(p) for p in pieces]).cumsum(0)
    text = "".join(pieces)
    start = text.find(value)
    if start < 0 or text.find(value, start + 1) >= 0:
        raise ValueError(f"needle value {value!r} must occur exactly once in the prompt")
    starts = ends - torch.tensor([len(p) for p in pieces])
    return ((starts < start + len(value)) & (ends > start)).nonzero().squeeze(-1)


#: paper 000's pilot page size (Table 4), for every variant: the benchmark config's tuned 32
#: (results/tuning/page_entrokv) would make "ours" and "paper000" differ in page size too
PAGE_SIZE = 16


def build_press(config: str, ratio: float, pooling: str | None, observed: bool = False) -> PageEntroKVPress:
    """The press of ``configs/press/<config>.yaml`` at ``ratio`` and page size :data:`PAGE_SIZE`, with
    ``record=True`` (and a pooling override)."""
    overrides = [
        f"press={config}",
        f"compression_ratio={ratio}",
        "++press.record=true",
        f"++press.page_size={PAGE_SIZE}",
    ]
    if pooling:
        overrides.append(f"++press.pooling={pooling}")
    node = compose_config(overrides).press
    if observed:
        node._target_ = f"{__name__}._Observed"
    return instantiate(node)


def fig9b_rows(press: _Observed, value_tokens: torch.Tensor, G: int) -> list[dict]:
    """Best-head, entropy-pooled and mean-pooled needle-value mass per (layer, group) (paper 000 Fig. 9b)."""
    rows = []
    for rec in press.records:
        attn = press.observed.get(rec["layer_idx"])
        if attn is None or rec["weights"] is None:
            continue
        mass = attn[:, value_tokens].sum(-1).view(G, -1)  # (G, r) needle mass per head
        w = rec["weights"].view(G, -1)
        for g in range(G):
            rows.append(
                {
                    "layer": rec["layer_idx"],
                    "group": g,
                    "best_head": float(mass[g].max()),
                    "pooled": float((w[g] * mass[g]).sum()),
                    "mean": float(mass[g].mean()),
                }
            )
    return rows


def needle_examples(pipe, tokenizer, args, target: int, query_aware: bool) -> list:
    """The needle prompts of about ``target`` model tokens (chat template and, inside the context, the question
    included): the haystack is sized by the overhead measured on a probe prompt."""
    probe = NeedleDataset(context_length=target, depths=[50], n_per_depth=1).examples(
        tokenizer, 1, args.seed, query_aware
    )[0]
    overhead = (
        pipe.preprocess(probe.context, [probe.question], probe.answer_prefix, int(1e10))["context_ids"].shape[1]
        - probe.metadata["context_length"]
    )
    ds = NeedleDataset(context_length=target - overhead, depths=args.depths, n_per_depth=args.n_per_depth)
    return list(ds.examples(tokenizer, None, args.seed, query_aware))


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    G = model.config.num_key_value_heads
    parts = Path(args.parts)
    parts.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    examples = {
        (protocol, target): needle_examples(pipe, tokenizer, args, target, query_aware)
        for protocol, query_aware in PROTOCOLS.items()
        for target in args.lengths
    }
    for protocol in PROTOCOLS:
        if protocol not in args.protocols:
            continue
        for target in args.lengths:
            for ex in examples[(protocol, target)]:
                part = parts / f"{protocol}_{target}_{ex.id}_r{args.ratio:g}_s{args.seed}.json"
                if part.exists():  # resume: this prompt was measured by an earlier (or parallel) process
                    continue
                retention, fig9b = [], []
                ids = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))["context_ids"]
                value_tokens = value_positions(tokenizer, ids, ex.answers[0])
                with torch.inference_mode(), PrefillCapture(model) as capture:
                    model.model(input_ids=ids, past_key_values=DynamicCache())
                memo = ReplayMemo()  # the entropy and mean variants of a policy share the observers
                for name, config, pooling in VARIANTS:
                    press = build_press(config, args.ratio, pooling, observed=name == "ours_entropy")
                    with torch.inference_mode(), sharing(press, memo):
                        replay_prefill(model, press, capture)
                    kept = retention_from_records(press.records, value_tokens)  # (L, G) bool
                    s = press.summary()
                    retention.append(
                        {
                            "protocol": protocol,
                            "target_T": target,
                            "T": ids.shape[1],
                            "depth": ex.metadata["depth"],
                            "id": ex.id,
                            "variant": name,
                            "pooled_selection": float(kept.float().mean()),
                            "strict": int(bool(kept.all())),
                            "effective_compression": s["effective_compression"],
                        }
                    )
                    if name == "ours_entropy":
                        fig9b += [
                            {"protocol": protocol, "target_T": target, "T": ids.shape[1], "id": ex.id, **r}
                            for r in fig9b_rows(press, value_tokens, G)
                        ]
                print(
                    f"{protocol} T={ids.shape[1]} depth={ex.metadata['depth']:g}: "
                    + ", ".join(
                        f"{r['variant']}={r['pooled_selection']:.2f}/{r['strict']}" for r in retention[-len(VARIANTS) :]
                    ),
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
                write_atomic(part, json.dumps({"retention": retention, "fig9b": fig9b}))
    retention, fig9b, missing = collect(parts, args, examples)
    if missing:
        print(f"{missing} prompt(s) not measured yet (another --protocols process?): no report written", flush=True)
        return
    tables.write_rows(out / "table6_retention.csv", retention)
    tables.write_rows(out / "table6_fig9b.csv", fig9b)
    plot_fig9b(fig9b, out / "table6_fig9b.png")
    write_atomic(out / "table6_reproduction.md", report(retention, fig9b, args))


def collect(parts: Path, args, examples: dict) -> tuple[list[dict], list[dict], int]:
    """The retention and Fig. 9b rows of every prompt of ``examples`` (``{(protocol, target length): needle
    examples}``, both protocols, as :func:`run` builds them) from the part files in ``parts``, in the order of
    the sweep, and the number of prompts without a part file."""
    retention, fig9b, missing = [], [], 0
    for protocol in PROTOCOLS:
        for target in args.lengths:
            for ex in examples[(protocol, target)]:
                part = parts / f"{protocol}_{target}_{ex.id}_r{args.ratio:g}_s{args.seed}.json"
                if not part.exists():
                    missing += 1
                    continue
                data = json.loads(part.read_text())
                retention += data["retention"]
                fig9b += data["fig9b"]
    return retention, fig9b, missing


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def report(retention: list[dict], fig9b: list[dict], args) -> str:
    """``table6_reproduction.md``: (a) pooled selection by length, (b) strict by depth, per protocol; Fig. 9b
    summary."""
    argv, skip = [], False
    for a in sys.argv[1:]:  # the recorded command is the whole sweep: drop a per-process --protocols
        if a == "--protocols" or a.startswith("--protocols="):
            skip = a == "--protocols"
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        argv.append(a)
    command = tables.command("table6_retention", argv)
    lines = [
        "# Paper 000 Table 6 and Fig. 9b on the embedded model",
        "",
        f"Command: `{command}` (written by the script; never edited by hand).",
        "",
        f"Model {args.model}; needle prompts at target lengths {args.lengths} (measured T in the rows), depths "
        f"{args.depths}, {args.n_per_depth} per depth, seed {args.seed}; compression ratio {args.ratio} "
        "(retention 0.2). Variants: `ours` = `configs/press/page_entrokv.yaml`, `paper000` = "
        "`configs/press/page_entrokv_paper000.yaml` (observers = every prompt query, no protection, per-layer "
        f"union, max fallback), each with entropy pooling and with arithmetic-mean pooling, all at page size "
        f"{PAGE_SIZE} (paper 000's). Criteria: "
        "docs/methods.md §1.13.",
        "",
    ]
    variants = [v for v, _, _ in VARIANTS]
    for protocol in ("question_after", "question_inside"):
        rows = [r for r in retention if r["protocol"] == protocol]
        lengths = sorted({r["target_T"] for r in rows})
        lines += [
            f"## {protocol.replace('_', ' ')}",
            "",
            "(a) Pooled-selection criterion: % of (layer, group) "
            "decisions that keep the needle-value pages, by prompt length",
            "",
            "| variant | "
            + " | ".join(f"T ~ {t} (mean {_mean([r['T'] for r in rows if r['target_T'] == t]):.0f})" for t in lengths)
            + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for v in variants:
            pooled = {
                t: _mean([r["pooled_selection"] for r in rows if (r["variant"], r["target_T"]) == (v, t)])
                for t in lengths
            }
            lines.append(f"| {v} | " + " | ".join(f"{100 * pooled[t]:.1f}%" for t in lengths) + " |")
        depths = sorted({r["depth"] for r in rows})
        lines += [
            "",
            "(b) Strict all-layer criterion: fraction of prompts whose needle-value pages survive in every "
            "layer and group, by depth (all lengths)",
            "",
            "| variant | " + " | ".join(f"{d:g}%" for d in depths) + " | all | effective compression |",
            "|---|" + "---|" * (len(depths) + 2),
        ]
        for v in variants:
            vr = [r for r in rows if r["variant"] == v]
            lines.append(
                f"| {v} | "
                + " | ".join(f"{_mean([r['strict'] for r in vr if r['depth'] == d]):.2f}" for d in depths)
                + f" | {_mean([r['strict'] for r in vr]):.2f} | "
                f"{_mean([r['effective_compression'] for r in vr]):.3f} |"
            )
        lines.append("")
    lines += [
        "Paper 000 (Qwen2.5-1.5B-Instruct, r = 6, 20 % budget), pooled-selection criterion: arithmetic mean "
        "0.0 % and Page-EntroKV 100.0 % at T = 959, 1469, 1989 and 2499; strict: uncompressed 1.00 at every "
        "depth. The paper does not state its protocol for this table.",
        "",
        "## Fig. 9b: entropy pooling against mean pooling on real text",
        "",
        "Per (layer, group) decision of `ours_entropy`: the needle-value mass (summed over the value's tokens) "
        "in the observer attention of the group's best head, of the entropy-pooled score and of the mean-pooled "
        "score.",
        "",
        "| protocol | decisions | best head (median) | best head (90th pct) | pooled / mean "
        "(median) | pooled / mean (90th pct) |",
        "|---|---|---|---|---|---|",
    ]
    for protocol in ("question_after", "question_inside"):
        rows = [r for r in fig9b if r["protocol"] == protocol]
        if not rows:
            continue
        best = torch.tensor([r["best_head"] for r in rows])
        ratio = torch.tensor([r["pooled"] / r["mean"] if r["mean"] > 0 else 1.0 for r in rows])
        lines.append(
            f"| {protocol.replace('_', ' ')} | {len(rows)} | {float(best.median()):.4f} | "
            f"{float(best.quantile(0.9)):.4f} | {float(ratio.median()):.3f} | {float(ratio.quantile(0.9)):.3f} |"
        )
    lines += [
        "",
        "Paper 000 Fig. 9b (Qwen2.5-1.5B, T <= 2048): the best head's needle mass is about 0.16, so entropy "
        "pooling degenerates toward mean pooling; pooled and mean masses agree within a factor 1.06.",
        "",
    ]
    return "\n".join(lines)


def plot_fig9b(rows: list[dict], path: Path) -> None:
    """Scatter of entropy-pooled against mean-pooled needle mass, coloured by the best head's mass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, protocol in zip(axes, ("question_after", "question_inside")):
        sub = [r for r in rows if r["protocol"] == protocol]
        if not sub:
            continue
        sc = ax.scatter(
            [r["mean"] for r in sub],
            [r["pooled"] for r in sub],
            c=[r["best_head"] for r in sub],
            s=6,
            cmap="viridis",
            vmin=0,
            vmax=1,
        )
        top = max(max(r["pooled"] for r in sub), max(r["mean"] for r in sub), 1e-3)
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set_title(protocol.replace("_", " "))
        ax.set_xlabel("mean-pooled needle mass")
    axes[0].set_ylabel("entropy-pooled needle mass")
    fig.colorbar(sc, ax=axes, label="best head's needle mass")
    save_figure(fig, path, dpi=120)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[959, 1474, 1990])
    p.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100])
    p.add_argument("--n-per-depth", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "results" / "uor" / "smollm2-135m"))
    p.add_argument(
        "--protocols",
        nargs="+",
        choices=list(PROTOCOLS),
        default=list(PROTOCOLS),
        help="measure only these (run one process per protocol in parallel; the last to finish writes "
        "the report from every prompt's part file)",
    )
    p.add_argument(
        "--parts",
        default=str(REPO / "runs" / "table6"),
        help="one json per measured prompt (resume: a prompt with a part file is skipped)",
    )
    args = p.parse_args(argv)
    if args.n_per_depth < 1:
        p.error(f"--n-per-depth {args.n_per_depth} must be >= 1")
    if not 0 <= args.ratio < 1:
        p.error(f"--ratio {args.ratio} must be in [0, 1)")
    if min(args.lengths) < MIN_LENGTH:
        p.error(
            f"--lengths {min(args.lengths)} is below {MIN_LENGTH} tokens (the chat template, question and a "
            "needle must fit)"
        )
    if not all(0 <= d <= 100 for d in args.depths):
        p.error(f"--depths {args.depths} must lie in [0, 100]")
    run(args)


if __name__ == "__main__":
    main()
