"""Train KVzap's surrogates (arXiv 2601.07891) for a model: KVzip+ targets from the project's KVzip path, the ridge
and MLP fits, the saved scorers and the held-out fit report.

``python -m evaluation.train_scorers kvzap --model smollm2-135m [--train-tokens N] [--workers 2] [--growth ...]``:

1. targets (:mod:`evaluation.train_scorers.targets`): held-out documents, then training documents in the seeded
   order until ``--train-tokens`` (and the largest ``--growth``) manifest tokens; resumable, in the model cache;
2. fits: the ridge surrogate from the moments of the first documents (:mod:`evaluation.train_scorers.ridge`), the
   MLP from their row subsample (:mod:`evaluation.train_scorers.mlp`), at ``--train-tokens`` and at each
   ``--growth`` count;
3. the scorers at ``--train-tokens`` saved as ``<out>/<model>/kvzap_linear/`` and ``kvzap_mlp/`` with a README
   (:mod:`evaluation.train_scorers.save`), where ``evaluation.scorers`` finds them;
4. the held-out fit of every fit (:mod:`evaluation.train_scorers.heldout_fit`): ``<out>/<model>/kvzap_fit.csv``
   and ``kvzap_fit.md``.

Everything is deterministic in ``--seed`` for a fixed ``--threads`` (recorded), whatever ``--workers``.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["add_arguments", "run", "schedule"]

#: The committed scorers' training tokens (60 documents) and held-out documents (the first 20 by id): the linear fit
#: gained 0.008 rho from 50k to 100k tokens (results/scorers/README.md), and targets, fits and report take about 25
#: minutes on two free cores.
DEFAULT_TRAIN_TOKENS = 100_000
DEFAULT_HELDOUT_DOCS = 20
#: The committed fit report's other training-token counts, its other MLP width (beside MLPSettings.hidden, the saved
#: one) and the counts the MLP is also fitted at (those below --train-tokens when not given): the defaults are the
#: committed command, so ``make scorers`` rebuilds every committed file (weights, READMEs, fit tables, growth rows).
DEFAULT_GROWTH = (10_000, 20_000, 50_000)
DEFAULT_MLP_ALSO = (64,)
DEFAULT_MLP_AT = (50_000,)


def add_arguments(p) -> None:
    """The ``kvzap`` command's arguments on the argparse parser ``p``."""
    from evaluation.scorers import SCORERS
    from evaluation.train_scorers.mlp import MLPSettings
    from evaluation.train_scorers.targets import Settings

    d, m = Settings(), MLPSettings()
    p.add_argument("--model", default=d.model, help="model name for evaluation.models.load_model")
    p.add_argument("--seed", type=int, default=d.seed, help="corpus split, row sample and MLP seed")
    p.add_argument("--train-tokens", type=int, default=DEFAULT_TRAIN_TOKENS, help="training tokens of the scorers")
    p.add_argument("--growth", type=int, nargs="*", help="more training-token counts (default: DEFAULT_GROWTH's below)")
    p.add_argument("--heldout-docs", type=int, default=DEFAULT_HELDOUT_DOCS, help="held-out documents scored")
    p.add_argument("--workers", type=int, default=1, help="target processes (1 or 2), each --threads threads")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per process (recorded)")
    p.add_argument("--surrogates", default="linear,mlp", help="comma-separated: linear, mlp")
    p.add_argument("--mlp-rows-per-doc", type=int, default=d.mlp_rows_per_doc, help="MLP rows kept per document")
    p.add_argument("--mlp-hidden", type=int, nargs="+", default=[m.hidden, *DEFAULT_MLP_ALSO], help="MLP widths")
    p.add_argument("--mlp-at", type=int, nargs="*", help="MLP fits besides --train-tokens (default: DEFAULT_MLP_AT's)")
    p.add_argument("--mlp-epochs", type=int, default=m.epochs)
    p.add_argument("--mlp-lr", type=float, default=m.lr)
    p.add_argument("--out", default=str(SCORERS), help="where <model>/kvzap_<type>/ and the fit tables go")
    p.add_argument("--work-root", default=None, help="where targets are stored (default: the model cache)")
    p.add_argument("--no-save", action="store_true", help="fit and report without saving the scorers")
    p.add_argument("--no-report", action="store_true", help="skip the held-out fit report")
    p.set_defaults(run=run)


def schedule(args) -> tuple[list[int], list[int]]:
    """The ``--growth`` and ``--mlp-at`` training-token counts of parsed ``args``, a default (None) resolved to the
    DEFAULT_GROWTH / DEFAULT_MLP_AT counts below ``--train-tokens``."""
    below = [t for t in DEFAULT_GROWTH if t < args.train_tokens], [t for t in DEFAULT_MLP_AT if t < args.train_tokens]
    return (below[0] if args.growth is None else args.growth), (below[1] if args.mlp_at is None else args.mlp_at)


def _target_seconds(work: Path, n_train: int) -> float:
    """Seconds the targets of the held-out documents and the first ``n_train`` training documents took (their
    recorded prefill, KVzip pass and storage; the last record of each)."""
    seen = {}
    for path in sorted(work.glob("timings.w*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["kind"] == "heldout" or row["position"] < n_train:
                seen[row["kind"], row["position"]] = row["prefill"] + row["kvzip"] + row["store"]
    return sum(seen.values())


def _readme(kind: str, key: str, record: dict, fit: dict | None) -> str:
    lines = [
        f"# KVzap {kind} surrogate for {key}",
        "",
        "kvpress's `KVzapModel` (`config.json`, `model.safetensors`), trained on KVzip+ scores of the project's KVzip "
        "path (configs/press/kvzip_plus.yaml); `evaluation.registry.attach_kvzap` gives it to a `KVzapPress("
        f'model_type="{kind}")` on {key} (the harness does so for every run).',
        "",
        f"- command: `{record['command']}`",
        "- corpus: evaluation/train_scorers/data/scorer_corpus_manifest.csv (corpus SHA-256 "
        f"{record['corpus_sha256']})",
        f"- seed {record['seed']}, {record['threads']} torch thread(s) per process, {record['workers']} worker(s)",
        f"- training: the first {record['train_docs']} training documents, {record['train_tokens']} manifest tokens, "
        f"{record['rows']} rows per layer" + (f" ({record['mlp_rows']} sampled for the MLP)" if kind == "mlp" else ""),
        f"- time: targets {record['target_seconds']:.0f} s (the recorded seconds of the documents used, held-out ones "
        "included, one thread each, on cores shared with other jobs), fit "
        f"{record['fit_seconds']:.0f} s",
    ]
    if kind == "mlp":
        lines.append(f"- MLP: {record['mlp']}")
    if fit:
        lines.append(
            f"- held-out fit ({fit['docs']} documents): mean Spearman's rho {fit['rho']:.3f}, mean top-25 % overlap "
            f"{fit['overlap']:.3f} over layers (per layer: ../kvzap_fit.md)"
        )
    return "\n".join(lines) + "\n"


def run(args) -> None:
    """Run the command (module docstring)."""
    import torch

    from evaluation.models import load_model
    from evaluation.scorers import model_key
    from evaluation.train_scorers import corpus, mlp, ridge, save, targets

    surrogates = [s.strip() for s in args.surrogates.split(",") if s.strip()]
    unknown = sorted(set(surrogates) - {"linear", "mlp"})
    if unknown or not surrogates:
        raise ValueError(f"--surrogates={args.surrogates!r}: each must be linear or mlp")
    growth, mlp_at = schedule(args)
    counts = sorted({args.train_tokens, *growth})
    if counts[0] < 1:
        raise ValueError(f"training tokens {counts[0]} must be >= 1")
    settings = targets.Settings(args.model, args.seed, args.mlp_rows_per_doc, args.threads)
    mlp_settings = [mlp.MLPSettings(hidden=h, epochs=args.mlp_epochs, lr=args.mlp_lr) for h in args.mlp_hidden]
    command = "python -m evaluation.train_scorers " + shlex.join(getattr(args, "argv", sys.argv[1:]))
    work_root = Path(args.work_root) if args.work_root else None

    start = time.perf_counter()
    work = targets.compute(settings, counts[-1], args.heldout_docs, args.workers, work_root, tuple(counts))
    print(f"targets in {work} ({time.perf_counter() - start:.0f} s)", flush=True)

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    key = model_key(model)
    train, _ = corpus.split(args.seed)
    docs = targets.milestone_docs(train, counts)
    heldout = targets.heldout_scores(work, args.seed)
    if args.heldout_docs is not None:
        heldout = heldout[: args.heldout_docs]
    base = {
        "command": command,
        "seed": args.seed,
        "threads": args.threads,
        "workers": args.workers,
        "corpus_sha256": corpus.corpus_sha256(),
        "heldout_docs": len(heldout),
    }
    fits, records = {}, {}
    for tokens in counts:
        k = docs[tokens]
        record = dict(base, train_docs=k, train_tokens=sum(d.tokens for d in train[:k]))
        record["target_seconds"] = round(_target_seconds(work, k), 1)
        if "linear" in surrogates:
            t0 = time.perf_counter()
            moments = targets.shard_moments(work, k)
            params = ridge.fit(moments)
            rec = dict(record, rows=int(moments.count[0]), fit_seconds=round(time.perf_counter() - t0, 1))
            fits["linear", tokens] = save.kvzap_model(params, key, rec)
            records["linear", tokens] = rec
            print(f"linear at {tokens} tokens: {k} documents, {rec['rows']} rows, {rec['fit_seconds']} s", flush=True)
        if "mlp" in surrogates and tokens in {args.train_tokens, *mlp_at}:
            x, y = targets.train_rows(work, k)
            rows = int(targets.shard_moments(work, k).count[0]) if "linear" in surrogates else None
            for ms in mlp_settings:
                t0 = time.perf_counter()
                layers = mlp.train(x, y, ms, args.seed)
                name = "mlp" if ms is mlp_settings[0] else f"mlp{ms.hidden}"
                rec = dict(record, rows=rows, mlp_rows=int(x.shape[0]), mlp=ms.__dict__.copy())
                rec["fit_seconds"] = round(time.perf_counter() - t0, 1)
                fits[name, tokens] = save.kvzap_model(layers, key, rec)
                records[name, tokens] = rec
                print(f"{name} at {tokens} tokens: {x.shape[0]} rows, {rec['fit_seconds']} s", flush=True)

    summary = {}
    if not args.no_report and heldout:
        summary = _report(fits, records, heldout, model, tokenizer, Path(args.out) / key, command)
    if not args.no_save:
        for kind in surrogates:
            where = Path(args.out) / key / f"kvzap_{kind}"
            fit = summary.get((kind, args.train_tokens))
            save.save(fits[kind, args.train_tokens], where, _readme(kind, key, records[kind, args.train_tokens], fit))
            print(f"saved {where}", flush=True)


def _report(fits: dict, records: dict, heldout: list, model, tokenizer, out: Path, command: str) -> dict:
    """Held-out fit of every fit: ``kvzap_fit.csv`` (per surrogate, tokens, layer) and ``kvzap_fit.md``; returns the
    means over layers per fit."""
    from evaluation.atomic import write_atomic
    from evaluation.pipeline import TextGenerationPipeline
    from evaluation.train_scorers import heldout_fit

    pipe = TextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)
    rho = {name: [] for name in fits}
    overlap = {name: [] for name in fits}
    for doc, scores, start, end in heldout:
        features = heldout_fit.document_features(model, pipe, doc.text, start, end)
        for name, scorer in fits.items():
            r, o = heldout_fit.metrics(heldout_fit.predict(scorer, features), scores)
            rho[name].append(r)
            overlap[name].append(o)
    rows, summary = [], {}
    for (kind, tokens), record in records.items():
        r = np.mean(rho[kind, tokens], axis=(0, 2))  # over documents and heads: (L,)
        o = np.mean(overlap[kind, tokens], axis=(0, 2))
        summary[kind, tokens] = {"rho": float(r.mean()), "overlap": float(o.mean()), "docs": len(heldout)}
        for layer in range(len(r)):
            rows.append(
                {
                    "surrogate": kind,
                    "train_tokens": record["train_tokens"],
                    "train_docs": record["train_docs"],
                    "layer": layer,
                    "spearman_rho": round(float(r[layer]), 4),
                    "top25_overlap": round(float(o[layer]), 4),
                }
            )
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "kvzap_fit.csv", buffer.getvalue())
    write_atomic(out / "kvzap_fit.md", _markdown(rows, summary, records, command, len(heldout)))
    return summary


def _markdown(rows: list[dict], summary: dict, records: dict, command: str, n_heldout: int) -> str:
    fits = sorted(summary, key=lambda f: (f[1], f[0]))
    lines = [
        "# KVzap surrogates: held-out fit",
        "",
        f"Command: `{command}`",
        "",
        f"Spearman's rho and top-25 % overlap between predicted and true KVzip+ scores on {n_heldout} held-out "
        "documents, per document and KV head, averaged (evaluation/train_scorers/heldout_fit.py).",
        "",
        "## Growth with the training tokens and the surrogate (mean over layers)",
        "",
        "| surrogate | training tokens | documents | rho | top-25 % overlap | fit s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fit in fits:
        rec, s = records[fit], summary[fit]
        lines.append(
            f"| {fit[0]} | {rec['train_tokens']} | {rec['train_docs']} | {s['rho']:.3f} | {s['overlap']:.3f} | "
            f"{rec['fit_seconds']:.0f} |"
        )
    kinds = sorted({f[0] for f in fits})
    largest = {kind: max(t for k, t in fits if k == kind) for kind in kinds}
    lines += ["", "## Per layer (each surrogate at its largest training-token count)", ""]
    lines.append("| layer | " + " | ".join(f"{k} rho | {k} top-25 %" for k in kinds) + " |")
    lines.append("| ---: |" + " ---: | ---: |" * len(kinds))
    by = {(r["surrogate"], r["train_tokens"], r["layer"]): r for r in rows}
    for layer in sorted({r["layer"] for r in rows}):
        cells = []
        for kind in kinds:
            r = by[kind, records[kind, largest[kind]]["train_tokens"], layer]
            cells.append(f"{r['spearman_rho']:.3f} | {r['top25_overlap']:.3f}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
