"""Q-Filters (arXiv 2503.02812) for a model from its own queries on the scorer corpus, saved where
``evaluation.scorers`` gives them to kvpress's ``QFilterPress``.

``python -m evaluation.train_scorers qfilter --model smollm2-135m [--train-tokens N] [--growth ...]``:

1. the query moments of the first training documents (:mod:`evaluation.train_scorers.queries`, shared with
   ``ea_stats``; resumable, in the model cache);
2. per layer and KV head, the filter (:func:`filters`): the principal direction of the group's queries **after
   RoPE** (the first right singular vector of the stacked queries, from their uncentred second moment), signed so
   that the queries project positively on it, then negated, because kvpress scores ``-(filter . key)`` (on the
   cache's rotated keys) and keeps the highest scores: the keys that the queries' dominant direction attends to;
3. the held-out fit (:mod:`evaluation.train_scorers.query_fit`) of the filters at ``--train-tokens`` and each
   ``--growth`` count, and of filters taken from the queries before RoPE (the RoPE check):
   ``<out>/<model>/qfilter_fit.csv`` and ``qfilter_fit.md``;
4. the filters at ``--train-tokens`` saved with ``QFilters.save_pretrained`` as ``<out>/<model>/qfilters/``
   (``config.json``, ``model.safetensors``) with ``training.json`` (the model they were made for, the command,
   seed, threads, documents, tokens, seconds, corpus) and a README.

Deterministic in ``--seed`` for a fixed ``--threads`` (recorded).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from evaluation.atomic import write_atomic

__all__ = ["add_arguments", "filters", "qfilter_scorer", "run"]


def add_arguments(p) -> None:
    """The ``qfilter`` command's arguments on the argparse parser ``p``."""
    from .query_cli import add_common

    add_common(p, "filters")
    p.set_defaults(run=run)


def filters(moments, kv_heads: int, which: str = "post") -> np.ndarray:
    """``(L, G, d)`` float64 Q-filters from query moments (:class:`evaluation.train_scorers.queries.QueryMoments`):
    per layer and KV head, minus the unit principal direction ``u`` of its group's queries ``which`` (``"post"``:
    after RoPE, what kvpress's score multiplies with keys; ``"pre"``: before, for the check), ``u`` being the top
    eigenvector of the uncentred ``sum q q^T`` over the group's heads, signed so that ``sum q . u > 0``.

    Raises:
        ValueError: the query heads are not a multiple of ``kv_heads``.
    """
    second = moments.second_moment(which)  # (L, H, d, d)
    L, H, d, _ = second.shape
    if H % kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of kv_heads={kv_heads}")
    grouped = second.reshape(L, kv_heads, H // kv_heads, d, d).sum(2)
    total = (moments.mean(which) * moments.tokens).reshape(L, kv_heads, H // kv_heads, d).sum(2)  # sum of q
    _, vectors = np.linalg.eigh(grouped)  # ascending eigenvalues
    u = vectors[..., -1]  # (L, G, d)
    sign = np.where(np.einsum("lgd,lgd->lg", u, total) < 0, -1.0, 1.0)
    return -(u * sign[..., None])


def qfilter_scorer(q_filters: torch.Tensor):
    """A :data:`evaluation.train_scorers.query_fit.Scorer`: kvpress's ``QFilterPress.score`` with ``q_filters``
    ``(L, G, d)``."""
    from kvpress import QFilterPress

    press = QFilterPress(compression_ratio=0.5)
    press.q_filters = q_filters

    def score(layer, module, kwargs, keys, values):
        return press.score(module, kwargs["hidden_states"], keys, values, None, kwargs)[0]

    return score


def run(args) -> None:
    """Run the command (module docstring)."""
    from kvpress.presses.qfilter_press import QFilters

    from evaluation.models import load_model
    from evaluation.scorers import QFILTER, model_key, scorer_dir
    from presses.core.model import text_config

    from . import query_cli

    counts, work, moments = query_cli.moments(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    config = text_config(model)
    G = config.num_key_value_heads
    made = {n: torch.from_numpy(filters(moments[n], G)).float() for n in counts}
    record = query_cli.record(args, work, moments[args.train_tokens], model_key(model))
    fit = None
    if not args.no_report:
        scorers = {f"qfilter at {moments[n].tokens} tokens": qfilter_scorer(made[n]) for n in counts}
        main = f"qfilter at {moments[args.train_tokens].tokens} tokens"
        before = torch.from_numpy(filters(moments[args.train_tokens], G, "pre")).float()
        scorers[f"{main}, directions from the queries before RoPE"] = qfilter_scorer(before)
        what = (
            "Spearman's rho and top-25 % overlap between kvpress's `QFilterPress.score` (`-(filter . key)`, keys "
            "after RoPE) and the attention each key receives from the held-out documents' later queries, and "
            "KVzip+'s scores. The filters are signed so that the queries project positively on their negation; the "
            "opposite sign negates every rho. The last row takes the directions from the queries before RoPE, scored "
            "on the same rotated keys (the RoPE check). Against"
        )
        fit = query_cli.report(
            args, model, tokenizer, scorers, main, "qfilter_fit", "Q-Filters: held-out fit", what, record
        )
    if not args.no_save:
        where = scorer_dir(model, QFILTER, Path(args.out))
        module = QFilters(config.num_hidden_layers, G, made[args.train_tokens].shape[-1])
        module.q_filters.data.copy_(made[args.train_tokens])
        where.mkdir(parents=True, exist_ok=True)
        module.save_pretrained(where)
        write_atomic(where / "training.json", json.dumps(record, indent=1) + "\n")
        body = (
            "kvpress's `QFilters` (`config.json`, `model.safetensors`: `(layers, KV heads, head dim)`), made from the "
            "model's own queries after RoPE on the scorer corpus (evaluation/train_scorers/qfilter.py); "
            "`evaluation.registry.attach_scorers` gives them to a `QFilterPress` on this model (the harness does so "
            "for every run)."
        )
        write_atomic(where / "README.md", query_cli.readme("Q-filters", body, record, fit))
        print(f"saved {where}", flush=True)
