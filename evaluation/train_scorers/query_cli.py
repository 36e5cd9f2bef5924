"""What the ``qfilter`` and ``ea_stats`` commands share: their arguments, the query pass, the record stored beside
the saved scorer (``training.json``), its README and the held-out fit report."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

__all__ = ["add_common", "moments", "readme", "record", "report"]


def add_common(p, what: str) -> None:
    """The arguments both commands take, on the argparse parser ``p`` (``what``: the scorer's name in the help)."""
    from evaluation.scorers import SCORERS
    from evaluation.train_scorers.queries import DEFAULT_TRAIN_TOKENS, GROWTH_TOKENS, Settings
    from evaluation.train_scorers.query_fit import HELDOUT_DOCS

    d = Settings()
    p.add_argument("--model", default=d.model, help="model name for evaluation.models.load_model")
    p.add_argument("--seed", type=int, default=d.seed, help="corpus split seed")
    p.add_argument("--train-tokens", type=int, default=DEFAULT_TRAIN_TOKENS, help=f"training tokens of the {what}")
    p.add_argument("--growth", type=int, nargs="*", default=list(GROWTH_TOKENS), help="more token counts reported")
    p.add_argument("--heldout-docs", type=int, default=HELDOUT_DOCS, help="held-out documents scored")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (recorded)")
    p.add_argument("--out", default=str(SCORERS), help="where <model>/<scorer>/ and the fit tables go")
    p.add_argument("--work-root", default=None, help="where query moments are stored (default: the model cache)")
    p.add_argument("--kvzip-root", default=None, help="where the kvzap command's targets are (default: model cache)")
    p.add_argument("--no-save", action="store_true", help=f"fit and report without saving the {what}")
    p.add_argument("--no-report", action="store_true", help="skip the held-out fit report")


def command(args) -> str:
    """The command line as run (recorded)."""
    return "python -m evaluation.train_scorers " + shlex.join(getattr(args, "argv", sys.argv[1:]))


def moments(args) -> tuple[list[int], Path, dict]:
    """``(token counts, work directory, {count: QueryMoments})`` of the command's query pass
    (:func:`evaluation.train_scorers.queries.compute`)."""
    from evaluation.train_scorers import queries

    if args.heldout_docs < 0:
        raise ValueError(f"--heldout-docs={args.heldout_docs} must be >= 0")
    counts = sorted({args.train_tokens, *args.growth})
    settings = queries.Settings(args.model, args.seed, args.threads)
    start = time.perf_counter()
    work, found = queries.compute(settings, counts, Path(args.work_root) if args.work_root else None)
    print(f"query moments in {work} ({time.perf_counter() - start:.0f} s)", flush=True)
    return counts, work, found


def record(args, work: Path, moments, key: str) -> dict:
    """What ``training.json`` holds: the model the scorer was made for (``base_model``: ``key``), the command, seed,
    threads, skipped leading positions, documents, queries per head, seconds and the corpus."""
    from evaluation.train_scorers import corpus, queries

    return {
        "base_model": key,
        "command": command(args),
        "seed": args.seed,
        "threads": args.threads,
        "n_sink": queries.N_SINK,
        "train_docs": moments.docs,
        "train_queries_per_head": moments.tokens,
        "seconds": round(queries.seconds(work, moments.docs), 1),
        "corpus_sha256": corpus.corpus_sha256(),
    }


def readme(title: str, body: str, record: dict, fit: dict | None) -> str:
    """The saved scorer's README: ``title`` for the model, ``body``, the record and the held-out fit's means."""
    lines = [
        f"# {title} for {record['base_model']}",
        "",
        body,
        "",
        f"- command: `{record['command']}`",
        f"- corpus: evaluation/train_scorers/data/scorer_corpus_manifest.csv (SHA-256 {record['corpus_sha256']})",
        f"- seed {record['seed']}, {record['threads']} torch thread(s); the first {record['train_docs']} training "
        f"documents, {record['train_queries_per_head']} queries per head (the first {record['n_sink']} positions of "
        f"each left out); {record['seconds']:.0f} s of prefills and moments",
    ]
    for key, label in (("attention", "attention from later queries"), ("kvzip", "KVzip+")):
        if fit and key in fit:
            lines.append(
                f"- held-out fit against {label} ({fit[key]['docs']} documents): mean Spearman's rho "
                f"{fit[key]['rho']:.3f}, top-25 % overlap {fit[key]['top25']:.3f} over layers"
            )
    return "\n".join(lines) + "\n"


def _shown(path: Path | None) -> str:
    """``path`` as a README shows it: under the model cache as ``<model cache>/...``; ``none stored`` for None."""
    from evaluation.models import cache_dir

    if path is None:
        return "none stored"
    try:
        return f"<model cache>/{Path(path).relative_to(cache_dir())}"
    except ValueError:
        return str(path)


def report(args, model, tokenizer, scorers: dict, main: str, stem: str, title: str, what: str, rec: dict) -> dict:
    """The held-out fit of ``scorers`` (:func:`evaluation.train_scorers.query_fit.evaluate`) written as
    ``<out>/<model>/<stem>.csv`` and ``.md`` (``what``: the paragraph saying what is compared; the per-layer table
    shows ``main``). Returns ``main``'s means over layers per reference: ``{"rho", "top25", "docs"}``."""
    from evaluation.pipeline import TextGenerationPipeline
    from evaluation.scorers import model_key
    from evaluation.train_scorers import corpus, queries, query_fit

    pipe = TextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)
    _, heldout = corpus.split(args.seed)
    root = Path(args.kvzip_root) if args.kvzip_root else None
    kvzip, kvzip_work = query_fit.kvzip_heldout(args.model, args.seed, root)
    t0 = time.perf_counter()
    fit = query_fit.evaluate(model, pipe, heldout[: args.heldout_docs], scorers, kvzip, queries.N_SINK)
    means = query_fit.summary(fit)
    notes = [
        f"Command: `{rec['command']}` ({time.perf_counter() - t0:.0f} s for the held-out fit, "
        f"{rec['seconds']:.0f} s for the {rec['train_docs']} training documents' queries, {args.threads} thread(s))",
        "",
        f"{what} KVzip+'s scores: {_shown(kvzip_work)} (per document and KV head, then averaged: "
        "evaluation/train_scorers/query_fit.py).",
    ]
    query_fit.write_report(Path(args.out) / model_key(model), stem, title, means, notes, [main])
    return {
        k: {"rho": float(v["rho"].mean()), "top25": float(v["top25"].mean()), "docs": v["docs"]}
        for k, v in means[main].items()
    }
