"""How well the presses scored with query statistics (Q-Filters, expected attention) rank the keys of held-out
documents: per layer, Spearman's rho and the top-25 % overlap (:func:`evaluation.train_scorers.heldout_fit.metrics`)
between a press's own scores (kvpress's ``score`` on the recorded prefill) and two references, per document and KV
head, then averaged.

Per held-out document (the preprocessing and prefill of :mod:`evaluation.train_scorers.queries`), on the scored span
``[start, end)``: KVzip+'s span where its scores are stored, else ``[n_sink, T)``:

- **attention**: the attention a key in the first half of the span, ``[start, mid)``, receives from the later
  queries (every position from ``mid`` to the end): ``softmax(q k^T * scaling)`` over the keys at or before each
  query (the Llama family's attention, no logit soft-cap), summed over those queries and the query heads of the
  key's group. It is what Q-Filters and expected attention estimate: attention that future queries pay a key.
- **KVzip+**: KVzip+'s scores of the project's KVzip path over the whole span, where the ``kvzap`` command stored
  them for this model, seed and corpus (:func:`kvzip_heldout`; ``results/scorers/README.md``).

A scorer whose ranking anti-correlates with attention (negative rho) has the wrong sign: this is how the Q-filters'
sign is checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = ["HELDOUT_DOCS", "evaluate", "kvzip_heldout", "received_attention", "summary", "write_report"]

#: Held-out documents scored by default: the first 20 by id, those whose KVzip+ targets the ``kvzap`` command
#: computes by default.
HELDOUT_DOCS = 20

#: A scorer: ``(layer, attention module, its recorded forward kwargs, keys, values) -> (G, T)`` scores, keys and
#: values ``(1, G, T, d)``.
Scorer = Callable[[int, torch.nn.Module, dict, torch.Tensor, torch.Tensor], torch.Tensor]


def kvzip_heldout(model_name: str, seed: int, root: Path | None = None) -> tuple[dict, Path | None]:
    """KVzip+'s held-out scores that the ``kvzap`` command stored for ``model_name`` and ``seed`` on the committed
    corpus with today's KVzip+ config (:mod:`evaluation.train_scorers.targets`): ``({doc id: (scores (L, G, n),
    start, end)}, its work directory)``, or ``({}, None)`` when there are none.

    Args:
        root: where target work directories live (default: ``<model cache>/scorers``).
    """
    from evaluation.models import cache_dir
    from evaluation.train_scorers import corpus, targets

    sha, config = corpus.corpus_sha256(), targets.KVZIP_PLUS_CONFIG.read_text()
    for work in sorted(((root or cache_dir() / "scorers") / model_name).glob("kvzap-*")):
        path = work / "settings.json"
        settings = json.loads(path.read_text()) if path.is_file() else {}
        if (settings.get("seed"), settings.get("corpus_sha256"), settings.get("kvzip_plus_config")) != (
            seed,
            sha,
            config,
        ):
            continue
        found = {doc.id: (scores, start, end) for doc, scores, start, end in targets.heldout_scores(work, seed)}
        if found:
            return found, work
    return {}, None


def received_attention(model, capture, start: int, mid: int) -> np.ndarray:
    """``(L, G, mid - start)``: the attention each key at ``[start, mid)`` receives from the queries at ``mid`` and
    after in the recorded prefill ``capture`` (module docstring), summed over queries and the group's query heads.

    Raises:
        ValueError: ``0 <= start < mid < T`` does not hold.
    """
    from evaluation.train_scorers.queries import layer_queries
    from presses.core.model import language_model

    out = []
    for layer, (_, kwargs, _, keys, _) in zip(language_model(model).layers, capture.layers):
        module = layer.self_attn
        T = keys.shape[2]
        if not 0 <= start < mid < T:
            raise ValueError(f"start={start}, mid={mid}: need 0 <= start < mid < T={T}")
        _, q = layer_queries(module, kwargs, mid)  # (H, T - mid, d), after RoPE
        k = keys[0].float().cpu()  # (G, T, d)
        H, G = q.shape[0], k.shape[0]
        scaling = getattr(module, "scaling", q.shape[-1] ** -0.5)
        logits = torch.einsum("grid,gjd->grij", q.view(G, H // G, -1, q.shape[-1]), k) * scaling
        causal = torch.arange(T)[None, :] > torch.arange(mid, T)[:, None]  # key after the query
        weights = logits.masked_fill(causal, float("-inf")).softmax(-1)
        out.append(weights.sum((1, 2))[:, start:mid].numpy())
    return np.stack(out)


def evaluate(model, pipe, docs: list, scorers: dict[str, Scorer], kvzip: dict, n_sink: int) -> dict:
    """The fit of every scorer on ``docs`` (corpus documents).

    Returns:
        ``{name: {"attention": (rho, top25), "kvzip": (rho, top25)}}``, each ``(documents, L, G)`` (``kvzip`` over
        the documents that have KVzip+ scores; absent when none has).

    Raises:
        ValueError: a document's KVzip+ span does not fit its prefill (the scores were made for other token ids).
    """
    from evaluation.train_scorers import heldout_fit
    from evaluation.train_scorers.queries import context_ids, prefill
    from presses.core.model import language_model

    layers = language_model(model).layers
    for layer in layers:  # as kvpress's BasePress.__call__ does: ExpectedAttention reads the rotary embedding here
        layer.self_attn.rotary_emb = language_model(model).rotary_emb
    results = {name: {"attention": ([], []), "kvzip": ([], [])} for name in scorers}
    for doc in docs:
        ids = context_ids(pipe, doc.text)
        capture = prefill(model, ids)
        T = ids.shape[1]
        reference = kvzip.get(doc.id)
        start, end = (reference[1], reference[2]) if reference else (n_sink, T)
        if reference and (end > T or reference[0].shape[-1] != end - start):
            raise ValueError(f"{doc.id}: KVzip+'s span [{start}, {end}) does not fit its prefill of {T} tokens")
        mid = (start + end) // 2
        attention = received_attention(model, capture, start, mid)
        for name, scorer in scorers.items():
            with torch.inference_mode():
                scores = [
                    scorer(i, layer.self_attn, kwargs, keys, values)
                    for i, (layer, (_, kwargs, _, keys, values)) in enumerate(zip(layers, capture.layers))
                ]
            predicted = torch.stack(scores).float().cpu().numpy()  # (L, G, T)
            for key, target, lo, hi in (("attention", attention, start, mid), ("kvzip", reference, start, end)):
                if target is None:
                    continue
                rho, top = heldout_fit.metrics(predicted[..., lo:hi], target if key == "attention" else target[0])
                results[name][key][0].append(rho)
                results[name][key][1].append(top)
    return {
        name: {key: (np.stack(r), np.stack(t)) for key, (r, t) in fit.items() if r} for name, fit in results.items()
    }


def summary(fit: dict) -> dict:
    """Per scorer and reference: ``{"rho": (L,), "top25": (L,), "docs": n}``, averaged over documents and heads."""
    return {
        name: {
            key: {"rho": r.mean((0, 2)), "top25": t.mean((0, 2)), "docs": r.shape[0]} for key, (r, t) in refs.items()
        }
        for name, refs in fit.items()
    }


def write_report(out: Path, stem: str, title: str, means: dict, notes: list[str], per_layer: list[str]) -> None:
    """``<out>/<stem>.csv`` (scorer, reference, layer, rho, top-25 %) and ``<out>/<stem>.md``: ``title``, ``notes``
    (lines), the means over layers of every scorer, and per layer the scorers ``per_layer``."""
    import csv
    import io

    from evaluation.atomic import write_atomic

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["scorer", "reference", "docs", "layer", "spearman_rho", "top25_overlap"])
    for name, refs in means.items():
        for key, m in refs.items():
            for layer, (r, t) in enumerate(zip(m["rho"], m["top25"])):
                writer.writerow([name, key, m["docs"], layer, round(float(r), 4), round(float(t), 4)])
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{stem}.csv", buffer.getvalue())
    keys = [k for k in ("attention", "kvzip") if any(k in refs for refs in means.values())]
    label = {"attention": "attention from later queries", "kvzip": "KVzip+"}
    lines = [f"# {title}", "", *notes, "", "## Mean over layers", ""]
    lines.append("| scorer | " + " | ".join(f"{label[k]}: rho | top-25 %" for k in keys) + " | documents |")
    lines.append("| --- |" + " ---: | ---: |" * len(keys) + " --- |")
    for name, refs in means.items():
        cells = [f"{refs[k]['rho'].mean():.3f} | {refs[k]['top25'].mean():.3f}" if k in refs else "- | -" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + ", ".join(f"{refs[k]['docs']}" for k in refs) + " |")
    lines += ["", "## Per layer (rho)", ""]
    columns = [(name, k) for name in per_layer for k in keys if k in means[name]]
    lines.append("| layer | " + " | ".join(f"{name}: {label[k]}" for name, k in columns) + " |")
    lines.append("| ---: |" + " ---: |" * len(columns))
    for layer in range(len(next(iter(means[per_layer[0]].values()))["rho"])):
        lines.append(f"| {layer} | " + " | ".join(f"{means[n][k]['rho'][layer]:.3f}" for n, k in columns) + " |")
    write_atomic(out / f"{stem}.md", "\n".join(lines) + "\n")
