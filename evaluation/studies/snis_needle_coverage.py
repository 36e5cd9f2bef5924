"""Why probabilistic eviction loses the needle: how often the needle's answer tokens survive eviction.

For needle examples of the committed table (question asked after compression, as kvpress's pipeline does),
run the prefill with each press and record, per layer and KV group, which context positions it keeps:

- probabilistic eviction (``snis_*`` configs): the draw counts ``c_i`` of
:func:`presses.probabilistic.budget.sample_counts`
  (kept = ``c_i > 0``) and the proposal ``pi`` they were drawn from; for the page unit (``snis_*_page``) the
  page counts give every token of a drawn page (:func:`presses.probabilistic.page_sampling.expand_pages`) and a token's
  proposal mass is its page's mass shared equally by the page's tokens;
- kvpress scorer presses (``snapkv``, ...): the top ``int(T (1 - r))`` of the press's ``score``, as
  ``ScorerPress.compress`` keeps them.

The answer tokens are the context tokens that overlap the needle's number. Per example and press:
``kept_all``, the fraction of (layer, group) pairs that keep every answer token; ``kept_every_layer``, whether
some group of every layer keeps them all; ``pi_ratio``, the mean proposal mass of an answer token relative to
uniform ``1 / T`` (SNIS only).

Usage (``python -m evaluation.studies.snis_needle_coverage`` is the same)::

    python scripts/snis_needle_coverage.py [--presses snis_min snis_min_page snapkv] [--ratio 0.5] [--per-depth 2]
        [--query-aware] [--out results/snis] [--name needle_coverage]

``--query-aware`` puts the question inside the compressed context (the harness's ``query_aware=true``).
Writes ``<out>/<name>.csv`` (one row per example and press) and ``<out>/<name>.md`` (the mean per press and
depth, and the command).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from kvpress import KVPressTextGenerationPipeline, ScorerPress
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

import presses.probabilistic.press as snis_module
from evaluation import harness, tables
from evaluation.cli import ArgumentParser
from evaluation.guards import check_press_downloads
from presses.core.paging import num_pages
from presses.probabilistic.page_sampling import expand_pages


def answer_positions(tokenizer, context_ids: torch.Tensor, answer: str) -> list[int]:
    """Positions of the context tokens that overlap the first occurrence of ``answer`` in the decoded context.

    Raises:
        ValueError: if the answer is not in the decoded context.
    """
    pieces = [tokenizer.decode([int(t)]) for t in context_ids[0]]
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    text = "".join(pieces)
    start = text.find(answer)
    if start < 0:
        raise ValueError(f"answer {answer!r} not found in the decoded context")
    stop, begin = start + len(answer), 0
    positions = []
    for i, end in enumerate(ends):
        if end > start and begin < stop:
            positions.append(i)
        begin = end
    return positions


def kept_masks(model, press, context_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the prefill with ``press``; return per layer the ``(G, T)`` kept mask and (SNIS) the ``(G, T)`` proposal."""
    kept, proposals = [], []
    if isinstance(press, ScorerPress):
        original = press.score
        T = context_ids.shape[1]

        def score(*args, **kwargs):
            scores = original(*args, **kwargs)
            idx = scores.topk(compute_n_kept(T, press.compression_ratio), dim=-1).indices
            kept.append(torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)[0])
            return scores

        press.score = score
    original_counts = snis_module.sample_counts

    def counts(pi, m, generator):
        c = original_counts(pi, m, generator)
        if getattr(press, "unit", "token") == "page":  # (B, G, P) pages -> (G, T) tokens
            T, B = context_ids.shape[1], press.page_size
            lengths = torch.full((num_pages(T, B),), float(B), device=pi.device)
            lengths[-1] = T - (lengths.numel() - 1) * B
            kept.append(expand_pages(c > 0, B, T)[0])
            proposals.append(expand_pages(pi / lengths, B, T)[0])
        else:
            kept.append((c > 0)[0])
            proposals.append(pi[0])
        return c

    snis_module.sample_counts = counts
    try:
        with torch.inference_mode(), press(model):
            model.model(input_ids=context_ids, past_key_values=DynamicCache())
    finally:
        snis_module.sample_counts = original_counts
        if isinstance(press, ScorerPress):
            del press.score
    return kept, proposals


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--presses", nargs="+", default=["snis_min", "snis_min_h", "snis_h2o", "snis_h2o_h", "snapkv"])
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--per-depth", type=int, default=2, help="examples per needle depth")
    parser.add_argument("--query-aware", action="store_true", help="the question inside the compressed context")
    parser.add_argument("--out", default="results/snis")
    parser.add_argument("--name", default="needle_coverage", help="stem of the .csv and .md outputs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with initialize_config_dir(str(harness.CONFIG_DIR), version_base="1.3"):
        cfgs = {
            p: compose(
                "config",
                [
                    f"model={args.model}",
                    "dataset=needle",
                    f"press={p}",
                    f"compression_ratio={args.ratio}",
                    f"dataset.n_per_depth={args.per_depth}",
                    f"query_aware={str(args.query_aware).lower()}",
                ],
            )
            for p in args.presses
        }
    first = next(iter(cfgs.values()))
    dataset = instantiate(first.dataset)
    model, tokenizer = harness.get_model(first.model, "cpu", first.model.get("attn_implementation", "sdpa"))
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    rows = []
    for ex in harness.run_examples(first, dataset, tokenizer):
        with harness.chat_template(tokenizer, ex.metadata.get("chat_template", True)):
            inputs = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
        context_ids = inputs["context_ids"]
        T = context_ids.shape[1]
        positions = answer_positions(tokenizer, context_ids, ex.answers[0])
        for name, cfg in cfgs.items():
            press = instantiate(cfg.press)
            check_press_downloads(press, model)  # the project's trained scorers, as every run gets them
            kept, proposals = kept_masks(model, press, context_ids)
            per_layer = torch.stack([k[:, positions].all(-1) for k in kept])  # (L, G)
            row = {
                "id": ex.id,
                "depth": ex.metadata["depth"],
                "press": name,
                "ratio": args.ratio,
                "T": T,
                "answer_tokens": len(positions),
                "kept_all": float(per_layer.float().mean()),
                "kept_every_layer": bool(per_layer.any(-1).all()),
                "pi_ratio": (
                    float(torch.stack([p[:, positions].mean() for p in proposals]).mean() * T) if proposals else ""
                ),
            }
            rows.append(row)
            print(row, flush=True)
    import pandas as pd

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    harness.write_atomic(out / f"{args.name}.csv", table.to_csv(index=False))
    table["pi_ratio"] = pd.to_numeric(table["pi_ratio"], errors="coerce")
    summary = table.groupby(["press", "depth"])[["kept_all", "kept_every_layer", "pi_ratio"]].mean().unstack("depth")
    command = tables.command("snis_needle_coverage", argv or sys.argv[1:])
    text = [
        "# Needle coverage: do the needle's answer tokens survive eviction?",
        "",
        f"Produced by `{command}` in {time.perf_counter() - start:.0f} s ({args.model}, compression_ratio "
        f"{args.ratio}, {args.per_depth} needle examples per depth, question "
        f"{'inside the compressed context' if args.query_aware else 'asked after compression'}).",
        "",
        "`kept_all`: fraction of (layer, KV group) pairs that keep every answer token; `kept_every_layer`: "
        "fraction of examples where every layer keeps them in some group; `pi_ratio`: mean proposal mass of an "
        "answer token relative to uniform (SNIS only; page unit: the page's mass shared by its tokens). "
        f"Per-example rows: `{args.name}.csv`.",
        "",
    ]
    for metric in ("kept_all", "kept_every_layer", "pi_ratio"):
        block = summary[metric]
        text += [
            f"### {metric} by needle depth (%)",
            "",
            "| press | " + " | ".join(f"{d:g}" for d in block.columns) + " |",
            "| --- | " + " | ".join("---:" for _ in block.columns) + " |",
        ]
        text += [
            "| " + press + " | " + " | ".join("–" if pd.isna(v) else f"{v:.3f}" for v in vals) + " |"
            for press, vals in block.iterrows()
        ]
        text.append("")
    harness.write_atomic(out / f"{args.name}.md", "\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
