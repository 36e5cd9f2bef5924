"""Expected attention's query statistics for a model from its own queries on the scorer corpus, saved where
``evaluation.scorers`` gives them to kvpress's ``ExpectedAttentionStatsPress``.

``python -m evaluation.train_scorers ea_stats --model smollm2-135m [--train-tokens N] [--growth ...]``:

1. the query moments of the first training documents (:mod:`evaluation.train_scorers.queries`, shared with
   ``qfilter``; resumable, in the model cache);
2. per layer and query head, the mean and covariance of the queries **before RoPE** (the press rotates them by the
   average RoPE of the next positions itself), the covariance with ``n - 1`` as kvpress's ``collect_queries``;
3. the held-out fit (:mod:`evaluation.train_scorers.query_fit`) of kvpress's ``ExpectedAttentionStatsPress`` with
   the statistics at ``--train-tokens`` and each ``--growth`` count, beside kvpress's ``ExpectedAttentionPress``
   (statistics of the document's own queries): ``<out>/<model>/ea_stats_fit.csv`` and ``ea_stats_fit.md``;
4. the statistics at ``--train-tokens`` saved with ``ExpectedAttentionStats.save_pretrained`` as
   ``<out>/<model>/ea_stats/`` (:func:`evaluation.scorers.scorer_dir`; ``config.json`` naming the model,
   ``model.safetensors``), with ``training.json`` and a README.

Deterministic in ``--seed`` for a fixed ``--threads`` (recorded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evaluation.atomic import write_atomic

__all__ = ["add_arguments", "run", "statistics"]

#: ``ExpectedAttentionStats.dataset_name`` of the statistics made here.
DATASET_NAME = "kvpress-research scorer corpus"


def add_arguments(p) -> None:
    """The ``ea_stats`` command's arguments on the argparse parser ``p``."""
    from .query_cli import add_common

    add_common(p, "statistics")
    p.set_defaults(run=run)


def statistics(moments, model_name: str, n_sink: int, max_tokens: int):
    """kvpress's ``ExpectedAttentionStats`` holding the mean ``(L, H, d)`` and covariance ``(L, H, d, d)`` (float32)
    of the queries before RoPE in ``moments`` (:class:`evaluation.train_scorers.queries.QueryMoments`).

    Args:
        model_name: the model's key (``evaluation.scorers.model_key``), stored as ``model_name``.
        n_sink: the leading positions left out of each document.
        max_tokens: the longest document's prefill, stored as ``sample_seq_len``.
    """
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats

    mean, cov = moments.mean("pre"), moments.covariance("pre")
    L, H, d = mean.shape
    stats = ExpectedAttentionStats(L, H, d, DATASET_NAME, model_name, moments.docs, max_tokens, n_sink)
    stats.query_mean.data.copy_(torch.from_numpy(mean))
    stats.query_cov.data.copy_(torch.from_numpy(cov))
    return stats


def stats_scorer(stats=None):
    """A :data:`evaluation.train_scorers.query_fit.Scorer`: kvpress's ``ExpectedAttentionStatsPress.score`` with
    ``stats`` (an ``ExpectedAttentionStats``), or with None kvpress's ``ExpectedAttentionPress.score`` (statistics
    of the document's own queries)."""
    from kvpress import ExpectedAttentionPress, ExpectedAttentionStatsPress

    if stats is None:
        press = ExpectedAttentionPress(compression_ratio=0.5)
    else:
        press = ExpectedAttentionStatsPress(compression_ratio=0.5)
        press.mu, press.cov = stats.query_mean.data.float(), stats.query_cov.data.float()

    def score(layer, module, kwargs, keys, values):
        return press.score(module, kwargs["hidden_states"], keys, values, None, kwargs)[0]

    return score


def run(args) -> None:
    """Run the command (module docstring)."""
    from evaluation.models import load_model
    from evaluation.scorers import EA_STATS, model_key, scorer_dir

    from . import queries, query_cli

    counts, work, moments = query_cli.moments(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    key = model_key(model)
    longest = _longest(work, moments[args.train_tokens].docs)
    made = {n: statistics(moments[n], key, queries.N_SINK, longest) for n in counts}
    record = query_cli.record(args, work, moments[args.train_tokens], key)
    fit = None
    if not args.no_report:
        scorers = {f"expected_attention_stats at {moments[n].tokens} tokens": stats_scorer(made[n]) for n in counts}
        main = f"expected_attention_stats at {moments[args.train_tokens].tokens} tokens"
        scorers["expected_attention (the document's own queries)"] = stats_scorer(None)
        what = (
            "Spearman's rho and top-25 % overlap between kvpress's `ExpectedAttentionStatsPress.score` (its defaults: "
            "512 future positions, covariance and value norms on) and the attention each key receives from the "
            "held-out documents' later queries, and KVzip+'s scores. The last row is kvpress's "
            "`ExpectedAttentionPress`, whose statistics are the document's own queries (the later ones included), "
            "for reference. Against"
        )
        title = "Expected-attention statistics: held-out fit"
        fit = query_cli.report(args, model, tokenizer, scorers, main, "ea_stats_fit", title, what, record)
    if not args.no_save:
        where = scorer_dir(model, EA_STATS, Path(args.out))
        where.mkdir(parents=True, exist_ok=True)
        made[args.train_tokens].save_pretrained(where)
        write_atomic(where / "training.json", json.dumps(record, indent=1) + "\n")
        body = (
            "kvpress's `ExpectedAttentionStats` (`config.json`, `model.safetensors`: the mean `(layers, heads, head "
            "dim)` and covariance `(layers, heads, head dim, head dim)` of the queries before RoPE), made from the "
            "model's own queries on the scorer corpus (evaluation/train_scorers/ea_stats.py); "
            "`evaluation.registry.attach_scorers` gives them to an `ExpectedAttentionStatsPress` on this model whose "
            "`stats_folder` is unset (the harness does so for every run)."
        )
        write_atomic(where / "README.md", query_cli.readme("Expected-attention query statistics", body, record, fit))
        print(f"saved {where}", flush=True)


def _longest(work: Path, docs: int) -> int:
    """The longest prefill among the first ``docs`` documents (their timing records)."""
    rows = [json.loads(line) for line in (work / "timings.jsonl").read_text().splitlines()]
    return max((r["tokens"] for r in rows if r["position"] < docs), default=0)
