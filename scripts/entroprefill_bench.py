"""EntroPrefill vs full prefill on the embedded model: prefill wall time, accuracy, bypasses, certificates.

For each multi-document QA example (evaluation/datasets/multidoc.py, query-aware) the script runs the
kvpress pipeline's own steps twice in the same process -- full prefill and EntroPrefill prefill,
alternating which goes first -- timing only the prefill call ``model.model(input_ids, cache)``, then
decodes greedily with ``pipeline.generate_answer`` from position ``T``. It writes

* ``<out>/examples.csv``: one row per (example, method) with time, score and the press summary;
* ``<out>/summary.csv``: per context length: mean prefill times and their ratio, accuracies,
  bypass frequency, mean ``T'/T``, mean greedy saving ``D_l`` vs dual bound ``U_l``, mean analytic
  saving (paper 001 eq. 32);
* ``<out>/README.md``: the summary as a markdown table, with the command that produced it.

Usage (about 10 min on 2 CPU cores)::

    python scripts/entroprefill_bench.py --lengths 2048 4096 --n-per-kind 5 --compression-ratio 0.5
"""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if v.lower() in ("none", "null"):
        return None
    if v.startswith("[") and v.endswith("]"):
        return [parse_value(x.strip()) for x in v[1:-1].split(",") if x.strip()]
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--n-per-kind", type=int, default=5, help="examples per fact kind (city, code) and length")
    ap.add_argument("--compression-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--press", nargs="*", default=[], metavar="KEY=VALUE",
                    help="EntroPrefillPress overrides, e.g. epsilon=0.3 monitored_layers=[3,4,5]")
    ap.add_argument("--out", default="results/entroprefill")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvpress import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    from evaluation.datasets.multidoc import MultiDocQADataset
    from evaluation.models import load_model
    from presses.entroprefill import EntroPrefillPress

    t0 = time.perf_counter()
    model, tok = load_model(args.model, device=args.device)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device(args.device))
    overrides = dict(kv.split("=", 1) for kv in args.press)
    press = EntroPrefillPress(compression_ratio=args.compression_ratio, tokenizer=tok,
                              **{k: parse_value(v) for k, v in overrides.items()})
    ds = MultiDocQADataset(context_lengths=args.lengths, num_samples=args.n_per_kind,
                           max_new_tokens=args.max_new_tokens)
    examples = ds.examples(tok, None, args.seed, query_aware=True)
    print(f"loaded model and built {len(examples)} examples in {time.perf_counter() - t0:.1f}s", flush=True)

    def prefill(ids, use_press: bool):
        cache = DynamicCache()
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        with torch.inference_mode():
            sync()
            start, cpu = time.perf_counter(), time.process_time()
            if use_press:
                with press(model):
                    model.model(input_ids=ids, past_key_values=cache)
            else:
                model.model(input_ids=ids, past_key_values=cache)
            sync()
        return cache, time.perf_counter() - start, time.process_time() - cpu

    warm = pipe.preprocess(examples[0].context, [examples[0].question], "", int(1e10))["context_ids"][:, -512:]
    prefill(warm.to(args.device), False)  # warm-up (allocator, kernels); EntroPrefill needs the question,
    rows = []
    for n, ex in enumerate(examples):
        inputs = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
        ids = inputs["context_ids"].to(args.device)
        q_ids = inputs["questions_ids"][0].to(args.device)
        T = ids.shape[1]
        order = ["full", "entroprefill"] if n % 2 == 0 else ["entroprefill", "full"]
        for method in order:
            cache, seconds, cpu_seconds = prefill(ids, method == "entroprefill")
            with torch.inference_mode():
                answer = pipe.generate_answer(q_ids, cache, T, ex.max_new_tokens or args.max_new_tokens)
            row = {"id": ex.id, "method": method, "target_length": ex.metadata["target_length"], "T": T,
                   "answer_passage": ex.metadata["answer_passage"], "n_passages": ex.metadata["n_passages"],
                   "answer": ex.answers[0], "prediction": answer.strip().replace("\n", " "),
                   "score": ds.score(answer, ex), "prefill_s": seconds, "prefill_cpu_s": cpu_seconds,
                   "cache_len": cache.get_seq_length()}
            if method == "entroprefill":
                st = press.summary()
                removed = [int(i) for i in st["removed_chunks"].split(",") if i]
                row.update({k: st[k] for k in ("accepted_layer", "removed_chunks", "n_chunks", "D_l", "U_l",
                                               "target_saving", "audit_bound", "eta_hat_max", "bypass_reason",
                                               "layer_reasons", "T_prime", "analytic_saving", "prefill_time_s")})
                row["answer_removed"] = int(ex.metadata["answer_passage"] - 1 in removed)
            rows.append(row)
            info = "" if method == "full" else (f"T_prime={row['T_prime']} layer={row['accepted_layer']} "
                                                 f"bypass={row['bypass_reason'] or '-'}")
            print(f"[{n + 1}/{len(examples)}] {method:12s} T={T} {seconds:6.2f}s (cpu {cpu_seconds:6.2f}s) score={row['score']:.0f} {info}"
                  f" -> {row['prediction'][:40]!r} (ref {ex.answers[0]})", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k) if k in rows[-1] else 99)
    with open(out / "examples.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)

    summary = []
    mean = lambda xs: statistics.fmean(xs) if xs else math.nan  # noqa: E731
    for length in args.lengths:
        full = [r for r in rows if r["target_length"] == length and r["method"] == "full"]
        ep = [r for r in rows if r["target_length"] == length and r["method"] == "entroprefill"]
        pruned = [r for r in ep if not r["bypass_reason"]]
        scanned = [r for r in ep if isinstance(r["U_l"], float) and math.isfinite(r["U_l"])]
        summary.append({
            "target_length": length, "n": len(ep), "mean_T": mean([r["T"] for r in ep]),
            "full_prefill_s": mean([r["prefill_s"] for r in full]),
            "entroprefill_prefill_s": mean([r["prefill_s"] for r in ep]),
            "time_ratio": mean([r["prefill_s"] for r in ep]) / mean([r["prefill_s"] for r in full]),
            "cpu_time_ratio": mean([r["prefill_cpu_s"] for r in ep]) / mean([r["prefill_cpu_s"] for r in full]),
            "time_ratio_pruned": (mean([r["prefill_s"] for r in pruned])
                                  / mean([f["prefill_s"] for f in full for r in pruned if f["id"] == r["id"]])
                                  if pruned else math.nan),
            "acc_full": mean([r["score"] for r in full]), "acc_entroprefill": mean([r["score"] for r in ep]),
            "bypass_freq": 1 - len(pruned) / len(ep) if ep else math.nan,
            "mean_T_prime_over_T": mean([r["T_prime"] / r["T"] for r in ep]),
            "answer_removed_freq": mean([r["answer_removed"] for r in pruned]),
            "mean_accepted_layer": mean([r["accepted_layer"] for r in pruned]),
            "mean_D_l": mean([r["D_l"] for r in scanned]), "mean_U_l": mean([r["U_l"] for r in scanned]),
            "mean_target": mean([r["target_saving"] for r in ep]),
            "mean_analytic_saving": mean([r["analytic_saving"] for r in ep]),
            "bypass_reasons": ";".join(sorted({r["bypass_reason"] for r in ep if r["bypass_reason"]})),
        })
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)

    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    cols = list(summary[0])
    lines = [
        "# EntroPrefill vs full prefill (multi-document QA, query-aware)", "",
        f"Model `{args.model}` on `{args.device}` ({torch.get_num_threads()} torch threads), "
        f"compression_ratio (token-saving target as a fraction of document tokens) = {args.compression_ratio}, "
        f"press overrides: `{' '.join(args.press) or 'none'}`.", "",
        "Times are wall-clock seconds of the prefill call only, both methods in the same run (alternating order); "
        "`time_ratio` = mean EntroPrefill time / mean full time over all examples (bypassed ones included), "
        "`cpu_time_ratio` the same with process CPU time (robust to other jobs sharing the cores), "
        "`time_ratio_pruned` over the pruned examples only. `mean_D_l` / `mean_U_l`: greedy token saving and "
        "dual bound at the accepted layer (or at the last layer that reached the scan). `mean_analytic_saving`: "
        "paper 001 eq. 32 (0 when bypassed).", "",
        "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
        *("| " + " | ".join(fmt(s[c]) for c in cols) + " |" for s in summary), "",
        f"Command: `{cmd}`", "",
        f"Total wall time: {time.perf_counter() - t0:.0f} s. Per-example rows: `examples.csv`.", "",
    ]
    (out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
