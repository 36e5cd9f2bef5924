"""The command line of :mod:`evaluation.train_scorers`: ``corpus`` (extract the committed corpus again), ``kvzap``
(targets, fits, saved scorers, held-out fit report), ``qfilter`` and ``ea_stats`` (Q-filters and expected attention's
query statistics from the model's queries). Bad input is one ``error:`` line, exit status 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _corpus(args) -> None:
    from transformers import AutoTokenizer

    from evaluation.models import embedded_model_dir
    from evaluation.train_scorers import corpus_extract

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(args.model))
    rows = corpus_extract.extract(Path(args.out), tokenizer, args.model)
    print(f"{len(rows)} documents, {sum(r['tokens'] for r in rows)} tokens -> {args.out}")


def parser() -> argparse.ArgumentParser:
    """The argument parser (``corpus``, ``kvzap``, ``qfilter``, ``ea_stats``)."""
    from evaluation.train_scorers.corpus import DATA_DIR

    top = argparse.ArgumentParser(prog="python -m evaluation.train_scorers", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    c = commands.add_parser("corpus", help="extract the scorer corpus from the installed packages' docstrings")
    c.add_argument("--model", default="smollm2-135m", help="the embedded model whose tokenizer counts the tokens")
    c.add_argument("--out", default=str(DATA_DIR), help="where the corpus and its manifest are written")
    c.set_defaults(run=_corpus)
    from evaluation.train_scorers import ea_stats, kvzap, qfilter

    kvzap.add_arguments(commands.add_parser("kvzap", help=kvzap.__doc__.splitlines()[0]))
    qfilter.add_arguments(commands.add_parser("qfilter", help=qfilter.__doc__.splitlines()[0]))
    ea_stats.add_arguments(commands.add_parser("ea_stats", help=ea_stats.__doc__.splitlines()[0]))
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad value is one ``error:`` line on stderr and exit status 1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv  # what the command records
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
