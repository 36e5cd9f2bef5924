"""Bias vs variance of KV eviction estimators (paper 003 section 6, Fig. 2; docs/methods.md §3 item 7).

On one prompt (paper 003 appendix E: the Roman Empire text; first answer token = first token of
"Who was the first Roman emperor?"), compute the uncompressed KV cache, then for every layer and
head compare the attention output of the first answer token against estimators that see an evicted
prompt cache (eq. 11, mean absolute error over the head dimension, averaged over heads):

- ``uncorrected``: probabilistic eviction with the H2O proposal, plain attention over kept entries;
- ``corrected_tau{1,2,5}``: the same draws with the SNIS correction at temperature ``tau`` (eq. 10);
- ``topk_h2o``: deterministic top-k of the same H2O scores (H2O eviction).

With ``--page-sizes B [B ...]`` the same estimators with pages of ``B`` positions as the sampling unit
(:mod:`presses.probabilistic.page_sampling`) run beside them: ``page{B}_uncorrected`` and ``page{B}_corrected_tau*``
draw
pages from the page proposal (the H2O proposal summed over each page) with ``m`` per group from the page
budget (target ``(1 - r) t / B`` distinct pages), keep every token of a drawn page and give it its page's
weight; ``topk_h2o_page{B}`` keeps the ``round(k / B)`` (at least 1) pages of highest H2O mass, the
deterministic page counterpart. Each row's ``kept_fraction`` is the estimator's own.

Every layer is evaluated in isolation with its true (uncompressed-model) query, keys and values, so
the error is the estimator's own, not propagated. As in the paper's Fig. 2 setting, the compression
ratio is constrained per KV group (``budget="head"``): ``m`` per group from Algorithm 2, and
``k = (1 - r) t`` entries per group for top-k. The answer token's own key/value is the one entry
written after eviction (bias 0).

Usage (``python -m evaluation.studies.snis_bias_variance`` is the same):
    python scripts/snis_bias_variance.py [--seeds 16] [--model smollm2-135m] [--out results/snis] [--page-sizes 16]
Writes ``<out>/bias_variance.csv`` (estimator, compression_ratio, layer, mae, kept_fraction; layer
``all`` = mean over layers), ``<out>/bias_variance.png`` and ``<out>/README.md`` (the layer-mean table
and the command that produced it). A run stopped by ``--time-limit`` says which ratios it covers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from kvpress import BasePress
from kvpress.utils import compute_n_kept
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from evaluation import tables
from evaluation.atomic import save_figure, write_atomic
from evaluation.cli import ArgumentParser
from presses.probabilistic.budget import sample_counts, search_num_samples
from presses.probabilistic.correction import snis_bias
from presses.probabilistic.page_sampling import expand_pages, page_proposal, page_target, page_tolerance
from presses.probabilistic.proposals import group_mixture, head_proposals

PROMPT = (
    "The Roman Empire was one of the largest and most enduring political entities in ancient history, reaching "
    "its greatest extent under Emperor Trajan in 117 CE when it spanned from Britain to Mesopotamia. Rome evolved "
    "from a monarchy to a republic before Julius Caesar's assassination in 44 BCE precipitated civil wars. "
    "Augustus emerged victorious and became the first emperor in 27 BCE, initiating a period of relative peace "
    "known as the Pax Romana.\n\n"
    "Roman law, architecture, and administrative practices shaped European civilization for centuries. Latin, "
    "the language of the Romans, evolved into the Romance languages including French, Spanish, Italian, "
    "Portuguese, and Romanian. The western empire collapsed in 476 CE, while the eastern half survived as the "
    "Byzantine Empire for nearly a thousand more years."
)
QUESTION = "Who was the first Roman emperor?"
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
TAUS = (1.0, 2.0, 5.0)


class _Capture(BasePress):
    """Records the prefill inputs of every layer's compress call without compressing."""

    def __init__(self):
        self.layers = {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        self.layers[module.layer_idx] = (module, hidden_states, keys.clone(), values.clone(), kwargs)
        return keys, values


def capture(model, tokenizer):
    """Prefill the prompt, then forward the first answer token; return per-layer tensors.

    Returns:
        dict layer -> (pi (G, t), keys (G, t, d), values (G, t, d), query (H, d), k_y (G, d), v_y (G, d),
        scaling) and the prompt length ``t``.
    """
    prompt_ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    y = tokenizer(QUESTION, return_tensors="pt", add_special_tokens=False).input_ids[:, :1]
    t = prompt_ids.shape[1]
    cap = _Capture()
    cache = DynamicCache()
    with torch.no_grad(), cap(model):
        model.model(input_ids=prompt_ids, past_key_values=cache)
    seen = {}
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen[module.layer_idx] = (query[0, :, -1].float(), key[0, :, -1].float(), value[0, :, -1].float())
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        with torch.no_grad():
            model(input_ids=y, past_key_values=cache, position_ids=torch.tensor([[t]]))
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    out = {}
    with torch.no_grad():
        for layer, (module, hs, keys, values, kwargs) in sorted(cap.layers.items()):
            head_pi = head_proposals("h2o", module, hs, keys, values, kwargs["position_embeddings"])
            pi = group_mixture(head_pi, keys.shape[1])[0]
            q, k_y, v_y = seen[layer]
            out[layer] = (pi, keys[0].float(), values[0].float(), q, k_y, v_y, module.scaling)
    return out, t


def attend(query, keys, values, k_y, v_y, bias, scaling):
    """Attention of one query per head over the prompt entries (+ additive bias) and the answer token.

    query (H, d); keys/values (G, t, d); k_y/v_y (G, d); bias (G, t) or None. Returns (H, d).
    """
    H, G = query.shape[0], keys.shape[0]
    r = H // G
    k = torch.cat([keys, k_y.unsqueeze(1)], 1).repeat_interleave(r, 0)  # (H, t + 1, d)
    v = torch.cat([values, v_y.unsqueeze(1)], 1).repeat_interleave(r, 0)
    logits = torch.einsum("hd,htd->ht", query, k) * scaling
    if bias is not None:
        logits[:, :-1] += bias.repeat_interleave(r, 0)
    return torch.einsum("ht,htd->hd", torch.softmax(logits, -1), v)


def run(layers, t, seeds, ratios=RATIOS, taus=TAUS, time_limit=480.0, page_sizes=()):
    """MAE rows: (estimator, ratio, layer, mae, kept_fraction), averaged over heads and seeds; with
    ``page_sizes`` also the page-unit estimators of each page size (module docstring)."""
    rows = []
    start = time.time()
    for ratio in ratios:
        for layer, (pi, keys, values, q, k_y, v_y, scaling) in layers.items():
            full = attend(q, keys, values, k_y, v_y, None, scaling)

            def mae(out, full=full):
                return (out - full).abs().mean().item()

            # top-k of the same H2O scores, k entries per group
            k = compute_n_kept(t, ratio)
            top = torch.zeros_like(pi, dtype=torch.bool).scatter(-1, pi.topk(k, -1).indices, True)
            top_bias = torch.where(top, 0.0, float("-inf"))
            rows.append(("topk_h2o", ratio, layer, mae(attend(q, keys, values, k_y, v_y, top_bias, scaling)), k / t))
            m = search_num_samples(pi, ratio)  # (G,) per-group budget
            acc = {"uncorrected": 0.0, **{f"corrected_tau{tau:g}": 0.0 for tau in taus}}
            kept = 0.0
            for seed in range(seeds):
                counts = sample_counts(pi, m, torch.Generator().manual_seed(seed))
                kept += (counts > 0).double().mean().item() / seeds
                acc["uncorrected"] += (
                    mae(attend(q, keys, values, k_y, v_y, snis_bias(counts, m, pi, correction=False), scaling)) / seeds
                )
                for tau in taus:
                    bias = snis_bias(counts, m, pi, tau=tau)
                    acc[f"corrected_tau{tau:g}"] += mae(attend(q, keys, values, k_y, v_y, bias, scaling)) / seeds
            rows += [(name, ratio, layer, value, kept) for name, value in acc.items()]
            for B in page_sizes:
                rows += page_rows(B, ratio, layer, pi, keys, values, q, k_y, v_y, scaling, t, k, seeds, taus, mae)
        if time.time() - start > time_limit:
            print(f"time limit reached after compression_ratio={ratio}; stopping early")
            break
    return rows


def page_rows(B, ratio, layer, pi, keys, values, q, k_y, v_y, scaling, t, k, seeds, taus, mae):
    """The page-unit rows of one (ratio, layer) for page size ``B`` (module docstring)."""
    pages = page_proposal(pi, B)  # (G, P)
    rows = []
    n_top = max(1, round(k / B))
    top = expand_pages(torch.zeros_like(pages, dtype=torch.bool).scatter(-1, pages.topk(n_top, -1).indices, True), B, t)
    rows.append(
        (
            f"topk_h2o_page{B}",
            ratio,
            layer,
            mae(attend(q, keys, values, k_y, v_y, torch.where(top, 0.0, float("-inf")), scaling)),
            top.double().mean().item(),
        )
    )
    m = search_num_samples(pages, ratio, target=page_target(t, ratio, B), tol=page_tolerance(B))  # (G,)
    token_pi = expand_pages(pages, B, t)
    acc = {f"page{B}_uncorrected": 0.0, **{f"page{B}_corrected_tau{tau:g}": 0.0 for tau in taus}}
    kept = 0.0
    for seed in range(seeds):
        counts = expand_pages(sample_counts(pages, m, torch.Generator().manual_seed(seed)), B, t)
        kept += (counts > 0).double().mean().item() / seeds
        acc[f"page{B}_uncorrected"] += (
            mae(attend(q, keys, values, k_y, v_y, snis_bias(counts, m, token_pi, correction=False), scaling)) / seeds
        )
        for tau in taus:
            bias = snis_bias(counts, m, token_pi, tau=tau)
            acc[f"page{B}_corrected_tau{tau:g}"] += mae(attend(q, keys, values, k_y, v_y, bias, scaling)) / seeds
    return rows + [(name, ratio, layer, value, kept) for name, value in acc.items()]


def summarise(rows):
    """Append the layer-mean rows (layer = 'all')."""
    groups = {}
    for name, ratio, _layer, mae, kept in rows:
        groups.setdefault((name, ratio), []).append((mae, kept))
    return rows + [
        (name, ratio, "all", sum(v[0] for v in vals) / len(vals), sum(v[1] for v in vals) / len(vals))
        for (name, ratio), vals in groups.items()
    ]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5) if any("page" in r[0] for r in rows) else (6, 4))
    names = sorted({r[0] for r in rows}, key=lambda n: (n != "topk_h2o", n != "uncorrected", n))
    colors = {
        "topk_h2o": "black",
        "uncorrected": "tab:orange",
        "corrected_tau1": "tab:green",
        "corrected_tau2": "tab:red",
        "corrected_tau5": "tab:purple",
    }
    units = sorted(
        {n.split("_")[0] for n in names if n.startswith("page")}
        | {n.rsplit("_", 1)[1] for n in names if n.startswith("topk_h2o_page")},
        key=lambda u: int(u[4:]),
    )
    styles = dict(zip(["token", *units], ["-", ":", "-.", (0, (1, 3))]))  # one line style per sampling unit
    for name in names:
        pts = sorted((r[1], r[3]) for r in rows if r[0] == name and r[2] == "all")
        if name.startswith("page"):
            unit, base = name.split("_", 1)
        elif name.startswith("topk_h2o_page"):
            base, unit = name.rsplit("_", 1)
        else:
            unit, base = "token", name
        style = "--" if name == "topk_h2o" else styles[unit]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            linestyle=style,
            marker="o",
            ms=3,
            color=colors.get(base),
            label=name,
        )
    ax.set_xlabel("compression ratio r")
    ax.set_ylabel("MAE of attention outputs (mean over layers, heads)")
    ax.set_yscale("log")
    ax.set_title("Bias vs variance of eviction estimators (paper 003 Fig. 2)")
    ax.legend(fontsize=7, ncol=2 if len(names) > 8 else 1)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seeds", type=int, default=16, help="draws per (layer, ratio)")
    parser.add_argument("--out", default="results/snis")
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds before stopping early")
    parser.add_argument(
        "--page-sizes", type=int, nargs="*", default=[], help="also run the page-unit estimators with these page sizes"
    )
    args = parser.parse_args(argv)
    started = time.time()
    torch.set_num_threads(2)
    from evaluation.models import load_model

    model, tokenizer = load_model(args.model, attn_implementation="sdpa", dtype="float32")
    layers, t = capture(model, tokenizer)
    print(f"prompt length t={t}, layers={len(layers)}")
    rows = summarise(run(layers, t, args.seeds, time_limit=args.time_limit, page_sizes=args.page_sizes))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = ["estimator", "compression_ratio", "layer", "mae", "kept_fraction"]
    cells = [(n, r, layer, f"{m:.6g}", f"{k:.4f}") for n, r, layer, m, k in rows]
    tables.write_rows(out / "bias_variance.csv", [dict(zip(columns, c)) for c in cells], columns)
    plot(rows, out / "bias_variance.png")
    for name in sorted({r[0] for r in rows}):
        pts = sorted((r[1], r[3]) for r in rows if r[0] == name and r[2] == "all")
        print(f"{name:>20}: " + " ".join(f"{m:.4f}" for _, m in pts))
    command = tables.command("snis_bias_variance", sys.argv[1:] if argv is None else argv)
    write_readme(rows, out / "README.md", args, t, len(layers), time.time() - started, command)


def write_readme(rows, path: Path, args, t: int, n_layers: int, seconds: float, command: str) -> None:
    """The layer-mean MAE table (estimator x compression ratio) as markdown, with the producing command."""
    names = sorted({r[0] for r in rows})
    ratios = sorted({r[1] for r in rows})
    mean = {(r[0], r[1]): r[3] for r in rows if r[2] == "all"}
    kept = {(r[0], r[1]): r[4] for r in rows if r[2] == "all"}
    missing = [r for r in RATIOS if r not in ratios]
    lines = [
        "# Bias vs variance of KV eviction estimators (paper 003 section 6, Fig. 2)",
        "",
        f"Produced by `{command}` in {seconds / 60:.0f} min "
        f"({args.model}, {n_layers} layers, prompt of t={t} tokens, {args.seeds} draws per layer and ratio, "
        "per-group budget). Regenerate with `make snis-study`"
        + (" plus `--page-sizes " + " ".join(map(str, args.page_sizes)) + "`" if args.page_sizes else "")
        + ".",
        "",
        "Mean absolute error of each layer's attention output for the first answer token against the "
        "uncompressed one (eq. 11), averaged over heads, draws and layers. Per-layer values: "
        "`bias_variance.csv`; plot: `bias_variance.png`.",
        "",
        *(
            [
                "`pageB_*`: pages of B positions as the sampling unit (`presses/probabilistic/page_sampling.py`), "
                "same H2O proposal summed over each page, m per group for (1 - r) t / B expected distinct pages; "
                "`topk_h2o_pageB`: the round(k / B) pages of highest H2O mass.",
                "",
            ]
            if args.page_sizes
            else []
        ),
        "| estimator | " + " | ".join(f"cr {r:g}" for r in ratios) + " |",
        "| --- | " + " | ".join("---:" for _ in ratios) + " |",
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{mean[(name, r)]:.4f}" for r in ratios) + " |")
    kept_rows = [("kept fraction (probabilistic)", "uncorrected")]
    kept_rows += [(f"kept fraction (page {B})", f"page{B}_uncorrected") for B in args.page_sizes]
    kept_rows += [(f"kept fraction (topk_h2o_page{B})", f"topk_h2o_page{B}") for B in args.page_sizes]
    for label, name in kept_rows:
        lines.append(f"| {label} | " + " | ".join(f"{kept.get((name, r), float('nan')):.3f}" for r in ratios) + " |")
    if missing:
        lines += ["", f"Stopped by the time limit: ratios {', '.join(f'{r:g}' for r in missing)} not run."]
    write_atomic(path, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
