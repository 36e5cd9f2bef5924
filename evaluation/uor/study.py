"""UOR and head-pooling analysis on a real model: paper 000 sections 6.2-6.3 rebuilt as one command.

Usage::

    python -m evaluation.uor                                  # configs/uor.yaml, embedded SmolLM2-135M
    python -m evaluation.uor model=qwen2.5-1.5b prompts.needle.lengths=[2048]

One eager prefill per prompt (needle and RULER contexts) feeds everything. A capture press, hooked on every
attention layer, reduces the ``(H_Q, T, T)`` attention on the fly to three per-head score rows (never
storing ``T x T`` for more than the current layer): ``h2o`` (column sums), ``last_row`` and ``snapkv``
(window-averaged observer attention, :func:`presses.observers.observer_attention`). In the same hook it runs
the ``compress`` of the configured Page-EntroKV presses (entropy and mean pooling, ``record=True``) on the
layer's full keys and stores their compressed caches, so one prefill gives the uncompressed cache, both
compressed caches and the presses' per-layer diagnostics. Needle prompts then decode an answer from each
cache.

Outputs, under ``output_dir`` (default ``results/uor/<model>``):

- ``table4.csv`` / ``table4.md`` and ``cells.csv``: head-independent replay per (prompt, layer, group) for
  the scorers at every ``k/T`` (UOR, ``J_bar``, ``J_max``, Bonferroni and sandwich certificates), the
  pooled Page-EntroKV rows (paper 000 Table 4; docs/methods.md §2);
- ``fig4_uor_vs_jbar.png``: UOR against ``J_bar`` with the lower envelopes and the ceiling ``r`` (Fig. 4);
- ``page_accounting.csv``: per layer, per-group allocation bytes against union-materialisation bytes
  (paper 001 section 7);
- ``table5_tau.csv``, ``table5_alpha.csv``, ``table5_cardinality.csv``: the ablations (Table 5);
- ``census.csv``, ``census_summary.csv``, ``fig7_entropy.png``, ``fig8_weights.png``: the sink census
  (Figs. 7-8);
- ``slot_mass.csv``: the pooled score mass by slot (offset within the page) in the pages the entropy press
  kept, all kept pages and the unprotected ones (paper 000 Fig. 6);
- ``retention.csv``, ``retention_layers.csv``, ``table6.md``, ``fig6_retention_layers.png``: needle
  retention under the pooled-selection and strict criteria beside answer accuracy (Table 6);
- ``report.md`` (every table, with the paper's pilot numbers beside ours) and ``run.json`` (config,
  timings, checks).
"""

from __future__ import annotations

import json
import logging
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from kvpress.presses.base_press import BasePress
from omegaconf import DictConfig, OmegaConf
from torch import nn

from evaluation.atomic import save_figure, write_atomic
from evaluation.cli import check_command_line
from evaluation.harness import CONFIG_DIR, command_line
from evaluation.uor.pages import allocation_bytes, page_union, union_bytes
from evaluation.uor.replay import (
    HEAD_CLASSES,
    SCORERS,
    accumulated_attention,
    alpha_sweep,
    bonferroni_bound,
    bonferroni_threshold,
    classify_heads,
    head_independent_replay,
    last_row_attention,
    pages_touched,
    pooled_replay,
    sandwich_bounds,
    sandwich_threshold,
    selection_masks,
    set_statistics,
    summarize_cells,
    tau_sweep,
)
from presses.core.pooling import pooled_group_scores
from presses.core.renyi import group_weights
from presses.observers import observer_attention

logger = logging.getLogger("evaluation.uor")

__all__ = [
    "CapturePress",
    "Capture",
    "capture",
    "needle_positions",
    "page_accounting",
    "slot_mass_rows",
    "run",
    "PAPER",
]

#: The pilot numbers of paper 000 (Qwen2.5-1.5B-Instruct, r = 6, L = 28, B = 16) quoted beside ours.
PAPER = {
    "table4": {
        ("h2o", 0.02): (2.849, 5.100, 1.000, 62, 290, 0.879),
        ("h2o", 0.05): (2.442, 4.471, 1.000, 22, 112, 0.820),
        ("h2o", 0.1): (2.292, 3.971, 1.000, 6, 65, 0.769),
        ("last_row", 0.02): (2.982, 4.600, 1.000, 21, 329, 0.960),
        ("last_row", 0.05): (2.703, 3.961, 1.000, 6, 196, 0.933),
    },
    "tau": {
        0.1: (0.9632, 0.3922),
        0.2: (0.9105, 0.3700),
        0.5: (0.7502, 0.2994),
        1.0: (0.5501, 0.2076),
        2.0: (0.3656, 0.1179),
    },
    "alpha": {
        0.5: (0.620, 3.530, 7.112),
        1.0: (0.762, 1.820, 6.638),
        2.0: (0.750, 1.091, 5.910),
        float("inf"): (0.641, 0.624, 4.260),
    },
    "census": {
        "sink": 152,
        "retrieval": 47,
        "contextual": 809,
        "w_sink": (0.303, 0.116),
        "w_ctx": (0.144, 0.176),
        "ratio": (2.10, 0.66),
    },
    "fig6": "slot 0 about 0.144, secondary peaks at slots 8 and 10",
    "table6": "pooled-selection criterion: mean pooling 0.0%, Page-EntroKV 100.0% at T = 959..2499; strict: "
    "uncompressed 1.00 at every depth",
}


# ------------------------------------------------------------------------------------------------------
# Capture
# ------------------------------------------------------------------------------------------------------


@dataclass
class CapturePress(BasePress):
    """Prefill hook: per-head score rows of every layer, plus the compressed caches of other presses.

    Reduces the layer's eager attention ``(1, H_Q, T, T)`` at once to ``(H_Q, T)`` rows for each of
    :data:`evaluation.uor.replay.SCORERS` and discards it. Each press in ``presses`` compresses the layer's full
    keys/values with its own ``compress``; its output goes to ``caches[name]``. The model's own cache is
    returned unchanged (the uncompressed baseline).

    Parameters:
        window_size: observer window ``W`` of the ``snapkv`` scorer (``1 <= W <= T``).
        presses: ``{name: press}`` presses whose caches and records to build in the same prefill.

    Raises (from :meth:`compress`):
        ValueError: without eager attention weights (load the model with ``attn_implementation="eager"``)
            or for a batch of more than one prompt.
    """

    window_size: int = 64
    presses: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict, init=False, repr=False)
    caches: dict = field(default_factory=dict, init=False, repr=False)

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the layer's score rows and the other presses' compressed keys/values (see the class)."""
        from transformers import DynamicCache

        if attentions is None:
            raise ValueError(
                "the UOR capture needs the layer's attention weights: load the model with attn_implementation='eager'"
            )
        if keys.shape[0] != 1:
            raise ValueError(f"the UOR capture takes one prompt at a time, got a batch of {keys.shape[0]}")
        layer = module.layer_idx
        if layer == 0:
            self.scores = {name: [] for name in SCORERS}
            self.caches = {name: DynamicCache() for name in self.presses}
        self.scores["h2o"].append(accumulated_attention(attentions)[0].cpu())
        self.scores["last_row"].append(last_row_attention(attentions)[0].cpu())
        obs = observer_attention(
            module, hidden_states, keys, self.window_size, kwargs.get("position_embeddings"), attentions
        )
        self.scores["snapkv"].append(obs[0].cpu())
        for name, press in self.presses.items():
            k, v = press.compress(module, hidden_states, keys, values, attentions, kwargs)
            self.caches[name].update(k, v, layer)
        return keys, values


@dataclass
class Capture:
    """What one prefill yields: ``scores[scorer]`` ``(L, H_Q, T)`` float32 on the CPU, the uncompressed
    ``full_cache``, ``caches[name]``, ``records[name]`` (the presses' ``records`` of this prefill) and
    ``cache_lengths[name]`` (per-layer length of each compressed cache right after the prefill)."""

    scores: dict
    full_cache: object
    caches: dict
    records: dict
    cache_lengths: dict


def capture(model, input_ids: torch.Tensor, presses: dict, window_size: int) -> Capture:
    """Run one eager prefill with :class:`CapturePress` (see the module docstring).

    Args:
        model: a kvpress-supported causal LM loaded with ``attn_implementation="eager"``.
        input_ids: ``(1, T)`` prompt ids.
        presses: ``{name: press}`` (e.g. Page-EntroKV with ``record=True``); may be empty.
        window_size: ``W`` of the ``snapkv`` scorer.

    Raises:
        ValueError: if the model does not return attention weights (not eager) or ``W > T``.
    """
    from transformers import DynamicCache

    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise ValueError(f"the UOR capture needs attn_implementation='eager', the model uses {impl!r}")
    press = CapturePress(window_size=window_size, presses=presses)
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=input_ids.to(model.device), past_key_values=cache)
    scores = {name: torch.stack(rows) for name, rows in press.scores.items()}
    records = {name: list(getattr(p, "records", [])) for name, p in presses.items()}
    lengths = {name: [c.get_seq_length(i) for i in range(len(c))] for name, c in press.caches.items()}
    return Capture(scores, cache, press.caches, records, lengths)


def needle_positions(tokenizer, input_ids: torch.Tensor, needle: str, value: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions of the needle sentence and of its value inside a tokenized prompt.

    Decodes ``input_ids`` and re-encodes the text with character offsets (the round trip must give the
    same ids), then maps the character spans of ``needle`` and of ``value`` inside it to tokens.

    Args:
        tokenizer: a fast tokenizer (offsets).
        input_ids: ``(1, T)`` prompt ids (chat template included).
        needle: the needle sentence as inserted in the context.
        value: the answer string inside ``needle``.

    Returns:
        ``(needle_tokens, value_tokens)``: ascending long positions.

    Raises:
        ValueError: if the round trip changes the ids, or the needle / value is not found exactly once.
    """
    ids = input_ids[0].tolist()
    text = tokenizer.decode(ids)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != ids:
        raise ValueError("decode/encode round trip changed the prompt ids; cannot map the needle to tokens")
    start = text.find(needle)
    if start < 0 or text.find(needle, start + 1) >= 0:
        raise ValueError(f"needle {needle!r} must occur exactly once in the prompt")
    v_start = start + needle.index(value)

    def span(a: int, b: int) -> torch.Tensor:
        return torch.tensor([i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < b and e > a and e > s])

    return span(start, start + len(needle)), span(v_start, v_start + len(value))


def page_accounting(records: list[dict], head_dim: int, page_size: int, bytes_per_element: int) -> list[dict]:
    """Per-layer physical page accounting of a page press (paper 001 section 7; docs/methods.md §2).

    Per layer ``l``: ``K_{l,g}`` kept pages of each group, ``U_l = |union_g K_{l,g}|``; per-group allocation
    ``2 e d B sum_g K_{l,g}`` bytes against union materialisation ``2 e d B G U_l`` bytes
    (:func:`evaluation.uor.pages.allocation_bytes`, :func:`evaluation.uor.pages.union_bytes`).

    Args:
        records: a page press's ``records`` with ``layer_idx`` and ``kept_pages`` ``(G, n)`` (one prompt).
        head_dim: ``d``. page_size: ``B``. bytes_per_element: ``e``.

    Returns:
        one dict per scored layer: ``layer``, ``groups``, ``pages_per_group`` (mean ``K_{l,g}``),
        ``union_pages`` ``U_l``, ``allocation_bytes``, ``union_bytes``, ``union_ratio``
        (``G U_l / sum_g K_{l,g}``, in ``[1, G]``).
    """
    rows = []
    for rec in records:
        pages = rec.get("kept_pages")
        if pages is None:
            continue
        G = pages.shape[0]
        counts = [int(pages[g].numel()) for g in range(G)]
        U = page_union(pages)
        alloc = allocation_bytes(counts, head_dim, page_size, bytes_per_element)
        union = union_bytes([U], G, head_dim, page_size, bytes_per_element)
        rows.append(
            {
                "layer": int(rec["layer_idx"]),
                "groups": G,
                "pages_per_group": sum(counts) / G,
                "union_pages": U,
                "allocation_bytes": alloc,
                "union_bytes": union,
                "union_ratio": union / alloc if alloc else float("nan"),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One analysed prompt: ``kind`` (needle / ruler), ids, the example, and needle token positions."""

    id: str
    kind: str
    task: str
    length: int
    depth: float | None
    example: object
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    needle_tokens: torch.Tensor | None = None
    value_tokens: torch.Tensor | None = None


def build_prompts(cfg: DictConfig, pipe, tokenizer) -> tuple[list[Prompt], object]:
    """Needle prompts (every length x depth x sample) and RULER prompts, tokenized the pipeline's way."""
    from evaluation.datasets.needle import NeedleDataset
    from evaluation.datasets.ruler import RulerDataset

    out = []
    nd = cfg.prompts.needle
    needle_ds = None
    for length in nd.lengths:
        needle_ds = NeedleDataset(
            context_length=int(length),
            depths=list(nd.depths),
            n_per_depth=int(nd.n_per_depth),
            max_new_tokens=int(nd.max_new_tokens),
        )
        for ex in needle_ds.examples(tokenizer, None, cfg.seed, False):
            ids = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
            value = ex.answers[0]
            ntok, vtok = needle_positions(tokenizer, ids["context_ids"], ex.metadata["needle"], value)
            out.append(
                Prompt(
                    ex.id,
                    "needle",
                    "needle",
                    int(length),
                    float(ex.metadata["depth"]),
                    ex,
                    ids["context_ids"],
                    ids["questions_ids"][0],
                    ntok,
                    vtok,
                )
            )
    rc = cfg.prompts.ruler
    if rc.tasks:
        ruler = RulerDataset(tasks=list(rc.tasks), context_lengths=list(rc.lengths), num_samples=int(rc.n_per_task))
        for ex in ruler.examples(tokenizer, None, cfg.seed, False):
            ids = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
            out.append(
                Prompt(
                    ex.id,
                    "ruler",
                    ex.task,
                    int(ex.metadata["context_length"]),
                    None,
                    ex,
                    ids["context_ids"],
                    ids["questions_ids"][0],
                )
            )
    return out, needle_ds


# ------------------------------------------------------------------------------------------------------
# Analyses (pure functions of the captured data)
# ------------------------------------------------------------------------------------------------------


def pooled_rows(caps: list[Capture], G: int, n_sink: int, alpha: float, tau: float) -> list[torch.Tensor]:
    """The pooled group rows ``p_g`` of every prompt, computed once for Table 4 and Fig. 6.

    Args:
        caps: the prefills' captures; each holds ``scores["snapkv"]``, ``(L, H_Q, T)``.
        G: KV groups; n_sink, alpha, tau: the press's pooling settings (paper 000 section 3; docs/methods.md §1).

    Returns:
        One ``(L, G, T)`` tensor per capture: sink-isolated Rényi-entropy pooling of its ``snapkv`` rows
        (:func:`presses.core.pooling.pooled_group_scores`).
    """
    return [pooled_group_scores(cap.scores["snapkv"], G, n_sink, alpha, tau, "entropy")[0] for cap in caps]


def replay_tables(
    prompts: list[Prompt], caps: list[Capture], cfg: DictConfig, G: int, r: int, pooled: list[torch.Tensor]
):
    """Table 4: per-cell rows and summary rows for every scorer and ``k/T``, plus the pooled rows (``pooled``:
    :func:`pooled_rows` of ``caps``)."""
    cells, summary = [], []
    for scorer in [*cfg.replay.scorers, "page_entrokv_pooled"]:
        for k in cfg.replay.k_over_t:
            outs = []
            for p, cap, rows in zip(prompts, caps, pooled):
                if scorer == "page_entrokv_pooled":
                    out = pooled_replay(rows, r, float(k))
                else:
                    out = head_independent_replay(cap.scores[scorer], G, float(k))
                outs.append(out)
                L = out["uor"].shape[0]
                for layer in range(L):
                    for g in range(G):
                        cells.append(
                            {
                                "prompt": p.id,
                                "kind": p.kind,
                                "T": int(p.context_ids.shape[1]),
                                "scorer": scorer,
                                "k_over_t": float(k),
                                "layer": layer,
                                "group": g,
                                "s": int(out["s"][layer, g]),
                                "union": int(out["union"][layer, g]),
                                "uor": float(out["uor"][layer, g]),
                                "j_bar": float(out["j_bar"][layer, g]),
                                "j_max": float(out["j_max"][layer, g]),
                                "bonferroni_lower": float(out["bonferroni_lower"][layer, g]),
                                "sandwich_lower": float(out["sandwich_lower"][layer, g]),
                                "sandwich_upper": float(out["sandwich_upper"][layer, g]),
                                "cert_bonferroni": bool(out["cert_bonferroni"][layer, g]),
                                "cert_sandwich": bool(out["cert_sandwich"][layer, g]),
                                "finite": bool(out["finite"][layer, g]),
                            }
                        )
            summary.append({"scorer": scorer, "k_over_t": float(k), **summarize_cells(outs)})
    # the press's own page decisions (records): every head of a group holds the group's pages
    outs = []
    for cap in caps:
        for rec in cap.records.get("page_entrokv", []):
            if rec.get("kept_pages") is None:
                continue
            pages = rec["kept_pages"]  # (G, n)
            n_pages = int(pages.max()) + 1
            masks = selection_masks(pages, n_pages).unsqueeze(1).expand(G, r, n_pages)
            st = set_statistics(masks)
            lo_b = bonferroni_bound(r, st["j_bar"])
            lo_s, _ = sandwich_bounds(r, st["j_bar"], st["j_max"])
            outs.append(
                {
                    **st,
                    "cert_bonferroni": lo_b >= 2,
                    "cert_sandwich": lo_s >= 2,
                    "finite": torch.ones(G, dtype=torch.bool),
                }
            )
    if outs:
        summary.append(
            {
                "scorer": "page_entrokv_press_pages",
                "k_over_t": 1.0 - float(cfg.compression_ratio),
                **summarize_cells(outs),
            }
        )
    return cells, summary


def slot_mass_rows(caps: list[Capture], pooled: list[torch.Tensor]) -> list[dict]:
    """Paper 000 Fig. 6: where the pooled score mass sits inside the pages the press kept.

    For every prompt, layer and group, the pooled row ``p_g`` (sink-isolated entropy pooling of the ``snapkv``
    rows, the row of Table 4's ``page_entrokv_pooled``) is summed by slot ``s = j mod B`` over the full pages
    the press kept (its ``records``: ``kept_pages``, ``protected_pages``, ``page_size``, ``T``); the sums of
    all cells are added and normalised to shares.

    Args:
        caps: the prefills' captures, with ``records["page_entrokv"]`` (``record=True``).
        pooled: :func:`pooled_rows` of ``caps`` with the press's own pooling settings, ``(L, G, T)`` each.

    Returns:
        One row per slot: ``slot``, ``share_kept`` (all kept full pages), ``share_unprotected`` (kept pages
        other than the protected sink and window pages), ``uniform`` (``1/B``) and the numbers of pages behind
        each share (``pages_kept``, ``pages_unprotected``). Empty without records.
    """
    sums, pages_used, B = {}, {"kept": 0, "unprotected": 0}, None
    for cap, rows in zip(caps, pooled):
        G = rows.shape[1]
        for rec in (x for x in cap.records.get("page_entrokv", []) if x.get("kept_pages") is not None):
            B, n_full = int(rec["page_size"]), int(rec["T"]) // int(rec["page_size"])
            protected = set() if rec["protected_pages"] is None else set(rec["protected_pages"].tolist())
            frames = rows[rec["layer_idx"], :, : n_full * B].double().view(G, n_full, B)
            for g in range(G):
                kept = [p for p in rec["kept_pages"][g].tolist() if p < n_full]
                for key, chosen in (("kept", kept), ("unprotected", [p for p in kept if p not in protected])):
                    if chosen:
                        sums[key] = sums.get(key, 0) + frames[g, chosen].sum(0)
                        pages_used[key] += len(chosen)
    if B is None:
        return []
    share = {k: v / v.sum() for k, v in sums.items()}
    return [
        {
            "slot": s,
            "share_kept": float(share["kept"][s]) if "kept" in share else float("nan"),
            "share_unprotected": float(share["unprotected"][s]) if "unprotected" in share else float("nan"),
            "uniform": 1.0 / B,
            "pages_kept": pages_used["kept"],
            "pages_unprotected": pages_used["unprotected"],
        }
        for s in range(B)
    ]


def accounting_table(prompts, caps, cfg, head_dim: int, G: int, r: int):
    """Per-layer page accounting of both presses, with the head-independent snapkv counterpart.

    ``hi_snapkv_pages_per_group``: pages touched by the union of the group's heads' own top-``b`` snapkv
    positions (``b`` = the press's kept tokens), what a page engine must allocate per group for
    head-independent selection at the same token budget.
    """
    rows = []
    B, e = int(cfg.presses.page_entrokv.page_size), int(cfg.bytes_per_element)
    for p, cap in zip(prompts, caps):
        for name in cap.records:
            for rec, acc in zip(
                [x for x in cap.records[name] if x.get("kept_pages") is not None],
                page_accounting(cap.records[name], head_dim, B, e),
            ):
                layer = acc["layer"]
                T = int(p.context_ids.shape[1])
                kept = int(rec["kept_tokens"])
                hi = head_independent_replay(cap.scores["snapkv"][layer], G, kept / T)
                idx = hi["indices"].reshape(G, -1)  # (G, r * s): the union of the heads' sets
                hi_pages = pages_touched(idx, B)
                rows.append(
                    {
                        "prompt": p.id,
                        "T": T,
                        "press": name,
                        **acc,
                        "kept_tokens": kept,
                        "hi_snapkv_uor": float(hi["uor"].mean()),
                        "hi_snapkv_pages_per_group": float(hi_pages.double().mean()),
                        "hi_snapkv_allocation_bytes": allocation_bytes(hi_pages.tolist(), head_dim, B, e),
                    }
                )
    return rows


def ablation_tables(prompts, caps, cfg, G: int):
    """Table 5: tau sweep, alpha sweep and cardinality exactness."""
    pc = cfg.presses.page_entrokv
    ents = []
    for cap in caps:
        recs = [x for x in cap.records.get("page_entrokv", []) if x.get("entropy") is not None]
        ents.append(torch.stack([x["entropy"] for x in recs]))  # (L, H_Q): the press's sink-isolated H_2
    ent = torch.cat(ents)
    ts = tau_sweep(ent, G, list(cfg.ablations.taus))
    tau_rows = [
        {
            "tau": t,
            "max_w": float(m.mean()),
            "max_w_max": float(m.max()),
            "w_std": float(s.mean()),
            "cells": int(m.numel()),
        }
        for t, m, s in zip(ts["taus"], ts["max_w"], ts["std_w"])
    ]
    means = [row["max_w"] for row in tau_rows]
    tau_check = {
        "per_cell_violations": ts["violations"],
        "monotone_per_cell": ts["monotone"],
        "monotone_mean": all(b <= a + 1e-9 for a, b in zip(means, means[1:])),
    }
    alpha_rows = []
    by_alpha: dict = {}
    for p, cap in zip(prompts, caps):
        res = alpha_sweep(cap.scores["snapkv"], G, int(pc.n_sink), list(cfg.ablations.alphas), float(pc.tau))
        T = int(p.context_ids.shape[1])
        for a, v in res.items():
            d = by_alpha.setdefault(
                a,
                {
                    "max_w": [],
                    "h_min": math.inf,
                    "h_max": -math.inf,
                    "violations": 0,
                    "at_clamp": 0,
                    "n": 0,
                    "ln_t": [],
                },
            )
            d["max_w"].append(v["max_w"].reshape(-1))
            d["h_min"], d["h_max"] = min(d["h_min"], v["h_min"]), max(d["h_max"], v["h_max"])
            d["violations"] += v["violations"]
            d["at_clamp"] += v["at_clamp"]
            d["n"] += int(v["entropy"].numel())
            d["ln_t"].append(math.log(T))
    for a, d in by_alpha.items():
        alpha_rows.append(
            {
                "alpha": a,
                "max_w": float(torch.cat(d["max_w"]).mean()),
                "h_min": d["h_min"],
                "h_max": d["h_max"],
                "ln_T_min": min(d["ln_t"]),
                "violations": d["violations"],
                "at_clamp": d["at_clamp"],
                "entropies": d["n"],
            }
        )
    card = []
    for p, cap in zip(prompts, caps):
        for name, recs in cap.records.items():
            for rec in recs:
                if rec.get("kept_pages") is None:
                    continue
                T, B = int(rec["T"]), int(rec["page_size"])
                pages = rec["kept_pages"]
                last = (T - 1) // B
                n_tok = (pages.numel() // pages.shape[0] - 1) * B + (T - last * B)
                cache_len = cap.cache_lengths[name][int(rec["layer_idx"])]
                card.append(
                    {
                        "prompt": p.id,
                        "press": name,
                        "layer": int(rec["layer_idx"]),
                        "T": T,
                        "budget": int(rec["budget"]),
                        "kept_tokens": int(rec["kept_tokens"]),
                        "tokens_from_pages": n_tok,
                        "cache_length": cache_len,
                        "exact": n_tok == int(rec["kept_tokens"]) == cache_len <= int(rec["budget"]),
                    }
                )
    return tau_rows, tau_check, alpha_rows, card


def census_rows(prompts, caps, cfg, G: int, r: int):
    """Sink census (Figs. 7-8): one row per (needle prompt, layer, query head)."""
    pc, cc = cfg.presses.page_entrokv, cfg.census
    rows = []
    for p, cap in zip(prompts, caps):
        if p.kind != "needle":
            continue
        T = int(p.context_ids.shape[1])
        if cc.exclude_window_needles and int(p.needle_tokens.max()) >= T - int(pc.window_size):
            continue  # the needle sits inside the observer window: locality, not retrieval
        attn = cap.scores["snapkv"]  # (L, H_Q, T)
        labels = classify_heads(attn, int(pc.n_sink), float(cc.sink_threshold), p.needle_tokens)
        recs = [x for x in cap.records["page_entrokv"] if x.get("entropy") is not None]
        iso = torch.stack([x["entropy"] for x in recs])
        raw = torch.stack([x["raw_entropy"] for x in recs])
        z = torch.stack([x["z"] for x in recs])
        w_iso = torch.stack([x["weights"] for x in recs]).reshape(len(recs), -1)
        w_raw = group_weights(raw, G, float(pc.tau)).reshape(len(recs), -1)
        L, HQ = labels.shape
        for layer in range(L):
            for h in range(HQ):
                rows.append(
                    {
                        "prompt": p.id,
                        "T": T,
                        "depth": p.depth,
                        "layer": layer,
                        "head": h,
                        "group": h // r,
                        "class": HEAD_CLASSES[int(labels[layer, h])],
                        "sink_mass": float(1 - z[layer, h]),
                        "raw_entropy": float(raw[layer, h]),
                        "isolated_entropy": float(iso[layer, h]),
                        "raw_weight": float(w_raw[layer, h]),
                        "isolated_weight": float(w_iso[layer, h]),
                    }
                )
    return rows


def retention_from_records(records: list[dict], value_tokens: torch.Tensor) -> torch.Tensor:
    """``(L, G)`` bool: did each (layer, group) decision keep every page holding a needle-value token."""
    out = []
    for rec in records:
        pages = rec.get("kept_pages")
        if pages is None:  # nothing scored: the whole cache was kept
            out.append(None)
            continue
        B = int(rec["page_size"])
        need = torch.unique(value_tokens // B)
        out.append(torch.stack([torch.isin(need, pages[g]).all() for g in range(pages.shape[0])]))
    G = next((x.numel() for x in out if x is not None), 1)
    return torch.stack([x if x is not None else torch.ones(G, dtype=torch.bool) for x in out])


# ------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------


def _fmt(x, nd=3):
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf"
        return f"{x:.{nd}f}"
    return str(x)


def md_table(rows: list[dict], cols: list[str], nd: int = 3, headers: list[str] | None = None) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``cols``."""
    head = headers or cols
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c), nd) for c in cols) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as a CSV at ``path``, atomically (:func:`evaluation.atomic.write_atomic`)."""
    import pandas as pd

    write_atomic(path, pd.DataFrame(rows).to_csv(index=False, float_format="%.6g"))


def plot_fig4(cells: list[dict], r: int, path: Path, k_values: list[float]) -> None:
    """UOR against J_bar per cell, per k/T panel, with the two lower envelopes and the ceiling r."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"h2o": "tab:blue", "last_row": "tab:orange", "snapkv": "tab:purple", "page_entrokv_pooled": "tab:green"}
    n = len(k_values)
    cols = min(2, n)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(6 * cols, 4.2 * rows_), squeeze=False)
    j = torch.linspace(0, 1, 201, dtype=torch.float64)
    lo_s, _ = sandwich_bounds(r, j, j)
    lo_b = bonferroni_bound(r, j)
    for ax, k in zip(axes.flat, k_values):
        for scorer, color in colors.items():
            pts = [
                (c["j_bar"], c["uor"]) for c in cells if c["scorer"] == scorer and c["k_over_t"] == k and c["finite"]
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.scatter(
                    xs,
                    ys,
                    s=6,
                    alpha=0.35 if scorer != "page_entrokv_pooled" else 0.9,
                    color=color,
                    label=f"{scorer} (n={len(pts)})",
                )
        ax.plot(j, lo_s, "r--", lw=1.5, label="sandwich lower envelope (Thm. 1)")
        ax.plot(j, lo_b, color="grey", ls="-.", lw=1, label="Bonferroni (Cor. 1)")
        ax.axhline(r, color="k", ls=":", lw=1.2, label=f"ceiling r = {r}")
        ax.axhline(2, color="grey", lw=0.5)
        ax.set_title(f"k/T = {k:g}")
        ax.set_xlabel(r"$\bar J$ (mean pairwise Jaccard similarity)")
        ax.set_ylabel("UOR")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(0.9, r + 0.2)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle("Union overhead of head-independent selection vs intra-group agreement (paper 000 Fig. 4)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_census(rows: list[dict], ln_ceiling: float, fig7: Path, fig8: Path) -> None:
    """Fig. 7 (raw vs sink-isolated entropy per class) and Fig. 8 (mean weight per class)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sink": "tab:red", "retrieval": "tab:green", "contextual": "tab:blue"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    allv = [x[k] for x in rows for k in ("raw_entropy", "isolated_entropy")]
    bins = torch.linspace(0, max(allv + [ln_ceiling]) + 0.1, 41).tolist()
    for ax, key, title in zip(
        axes, ("raw_entropy", "isolated_entropy"), ("(a) raw collision entropy", "(b) sink-isolated collision entropy")
    ):
        for cls in HEAD_CLASSES:
            v = [x[key] for x in rows if x["class"] == cls]
            if v:
                ax.hist(v, bins=bins, alpha=0.5, color=colors[cls], density=True, label=f"{cls} (n={len(v)})")
        ax.axvline(ln_ceiling, color="k", ls="--", lw=1, label=f"ln(T-|S|) = {ln_ceiling:.2f}")
        ax.set_title(title)
        ax.set_xlabel(r"$H_2$ (nats)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("density")
    fig.tight_layout()
    save_figure(fig, fig7, dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(HEAD_CLASSES))
    for off, key, label in ((-0.2, "raw_weight", "raw entropy"), (0.2, "isolated_weight", "sink-isolated")):
        means = []
        for cls in HEAD_CLASSES:
            v = [x[key] for x in rows if x["class"] == cls]
            means.append(sum(v) / len(v) if v else float("nan"))
        ax.bar([x + off for x in xs], means, width=0.4, label=label)
        for x, m in zip(xs, means):
            if not math.isnan(m):
                ax.text(x + off, m, f"{m:.3f}", ha="center", va="bottom", fontsize=8)
    r = max(x["head"] for x in rows) // (max(x["group"] for x in rows) + 1) + 1
    ax.axhline(1 / r, color="grey", ls=":", lw=1, label=f"mean pooling 1/r = {1 / r:.3f}")
    ax.set_xticks(list(xs), HEAD_CLASSES)
    ax.set_ylabel(r"mean pooling weight $w_h$ ($\tau_g$ = 0.5)")
    ax.set_title("Pooling weight per head class (paper 000 Fig. 8)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, fig8, dpi=110)


def plot_retention_layers(layer_rows: list[dict], path: Path) -> None:
    """Per-layer needle keep rate of each press (the pooled-selection criterion, layer by layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for press in sorted({x["press"] for x in layer_rows}):
        pts = sorted((x["layer"], x["keep_rate"]) for x in layer_rows if x["press"] == press)
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", ms=3, label=press)
    ax.set_xlabel("layer")
    ax.set_ylabel("needle page kept (fraction of group decisions)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    ax.set_title("Needle retention per layer at a 20% budget")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------------


def run(cfg: DictConfig) -> dict:
    """Capture, analyse and write every output (see the module docstring); returns ``run.json``'s dict."""
    from hydra.utils import instantiate

    from evaluation.guards import check_thinking
    from evaluation.models import load_model
    from evaluation.pipeline import TextGenerationPipeline

    t0 = time.perf_counter()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(
        cfg.model.name,
        device=cfg.device,
        dtype=cfg.model.get("dtype"),
        attn_implementation="eager",
        path=cfg.model.get("path"),
    )
    mc = model.config
    HQ, G = mc.num_attention_heads, mc.num_key_value_heads
    r = HQ // G
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // HQ
    check_thinking(tokenizer, cfg.model.enable_thinking, f"model {cfg.model.name}")
    pipe = TextGenerationPipeline(
        model=model, tokenizer=tokenizer, device=torch.device(cfg.device), enable_thinking=cfg.model.enable_thinking
    )
    prompts, needle_ds = build_prompts(cfg, pipe, tokenizer)
    t_load = time.perf_counter() - t0
    logger.info(
        "model %s (H_Q=%d, G=%d, r=%d, L=%d), %d prompts, load %.0fs",
        cfg.model.name,
        HQ,
        G,
        r,
        mc.num_hidden_layers,
        len(prompts),
        t_load,
    )

    press_names = list(cfg.retention.presses)
    caps, retention, timings = [], [], []
    for i, p in enumerate(prompts):
        t1 = time.perf_counter()
        presses = {name: instantiate(cfg.presses[name], record=True) for name in press_names}
        cap = capture(model, p.context_ids, presses, int(cfg.presses.page_entrokv.window_size))
        t_prefill = time.perf_counter() - t1
        if p.kind == "needle":
            T = int(p.context_ids.shape[1])
            caches = {"no_press": cap.full_cache, **cap.caches}
            for name, cache in caches.items():
                with torch.inference_mode():
                    answer = pipe.generate_answer(p.question_ids, cache, T, int(p.example.max_new_tokens or 16))
                kept = (
                    retention_from_records(cap.records[name], p.value_tokens)
                    if name != "no_press"
                    else torch.ones(mc.num_hidden_layers, G, dtype=torch.bool)
                )
                retention.append(
                    {
                        "prompt": p.id,
                        "length": p.length,
                        "T": T,
                        "depth": p.depth,
                        "press": name,
                        "frac_decisions_kept": float(kept.double().mean()),
                        "strict_kept": bool(kept.all()),
                        "per_layer": kept.all(-1).tolist(),
                        "per_layer_group_rate": kept.double().mean(-1).tolist(),
                        "value_tokens": p.value_tokens.tolist(),
                        "answer": answer,
                        "score": float(needle_ds.score(answer, p.example)),
                        "cache_length": cache.get_seq_length(0),
                    }
                )
        cap.full_cache, cap.caches = None, {}  # keep the score rows, records and cache lengths only
        caps.append(cap)
        timings.append(
            {
                "prompt": p.id,
                "T": int(p.context_ids.shape[1]),
                "prefill_s": t_prefill,
                "total_s": time.perf_counter() - t1,
            }
        )
        logger.info(
            "[%d/%d] %s T=%d prefill %.0fs total %.0fs",
            i + 1,
            len(prompts),
            p.id,
            int(p.context_ids.shape[1]),
            t_prefill,
            time.perf_counter() - t1,
        )

    # --- Table 4, Fig. 4 ---
    pc = cfg.presses.page_entrokv
    pooled = pooled_rows(caps, G, int(pc.n_sink), float(pc.alpha), float(pc.tau))
    cells, t4 = replay_tables(prompts, caps, cfg, G, r, pooled)
    write_csv(out / "cells.csv", cells)
    write_csv(out / "table4.csv", t4)
    plot_fig4(cells, r, out / "fig4_uor_vs_jbar.png", [float(k) for k in cfg.replay.k_over_t])
    acc = accounting_table(prompts, caps, cfg, head_dim, G, r)
    write_csv(out / "page_accounting.csv", acc)
    slots = slot_mass_rows(caps, pooled)
    write_csv(out / "slot_mass.csv", slots)
    # --- Table 5 ---
    tau_rows, tau_check, alpha_rows, card = ablation_tables(prompts, caps, cfg, G)
    write_csv(out / "table5_tau.csv", tau_rows)
    write_csv(out / "table5_alpha.csv", alpha_rows)
    write_csv(out / "table5_cardinality.csv", card)
    # --- census ---
    census = census_rows(prompts, caps, cfg, G, r)
    write_csv(out / "census.csv", census)
    census_sum = []
    for cls in HEAD_CLASSES:
        v = [x for x in census if x["class"] == cls]
        census_sum.append(
            {
                "class": cls,
                "n": len(v),
                "sink_mass": _mean(x["sink_mass"] for x in v),
                "raw_entropy": _mean(x["raw_entropy"] for x in v),
                "isolated_entropy": _mean(x["isolated_entropy"] for x in v),
                "raw_weight": _mean(x["raw_weight"] for x in v),
                "isolated_weight": _mean(x["isolated_weight"] for x in v),
            }
        )
    write_csv(out / "census_summary.csv", census_sum)
    if census:
        T_max = max(x["T"] for x in census)
        plot_census(
            census,
            math.log(T_max - int(cfg.presses.page_entrokv.n_sink)),
            out / "fig7_entropy.png",
            out / "fig8_weights.png",
        )
    # --- Table 6 ---
    ret_rows = [{k: v for k, v in x.items() if k not in ("per_layer", "per_layer_group_rate")} for x in retention]
    write_csv(out / "retention.csv", ret_rows)
    layer_rows = []
    for name in press_names:
        rs = [x for x in retention if x["press"] == name]
        if rs:
            for layer in range(len(rs[0]["per_layer_group_rate"])):
                layer_rows.append(
                    {
                        "press": name,
                        "layer": layer,
                        "keep_rate": _mean(x["per_layer_group_rate"][layer] for x in rs),
                        "all_groups_rate": _mean(float(x["per_layer"][layer]) for x in rs),
                    }
                )
    write_csv(out / "retention_layers.csv", layer_rows)
    if layer_rows:
        plot_retention_layers(layer_rows, out / "fig6_retention_layers.png")

    info = {
        "command": command_line("python -m evaluation.uor"),
        "model": cfg.model.name,
        "H_Q": HQ,
        "G": G,
        "r": r,
        "L": mc.num_hidden_layers,
        "head_dim": head_dim,
        "prompts": [
            {"id": p.id, "kind": p.kind, "task": p.task, "T": int(p.context_ids.shape[1]), "depth": p.depth}
            for p in prompts
        ],
        "timings": timings,
        "load_s": t_load,
        "tau_check": tau_check,
        "thresholds": {
            "bonferroni": bonferroni_threshold(r) if r >= 2 else None,
            "sandwich": sandwich_threshold(r) if r >= 2 else None,
        },
        "cardinality_exact": all(x["exact"] for x in card),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    info["total_s"] = time.perf_counter() - t0
    write_report(
        out, cfg, info, t4, acc, tau_rows, tau_check, alpha_rows, card, census_sum, retention, layer_rows, slots
    )
    info["total_s"] = time.perf_counter() - t0
    write_atomic(out / "run.json", json.dumps(info, indent=2, default=str))
    logger.info("wrote %s in %.0fs", out, info["total_s"])
    return info


def write_report(
    out: Path,
    cfg,
    info,
    t4,
    acc,
    tau_rows,
    tau_check,
    alpha_rows,
    card,
    census_sum,
    retention,
    layer_rows,
    slots: list | None = None,
) -> None:
    """``table4.md``, ``table6.md`` and ``report.md`` (every table, the paper's numbers beside ours)."""
    r, G = info["r"], info["G"]
    lines = [
        f"# UOR and head-pooling analysis: {info['model']}",
        "",
        f"Generated by `{info['command']}` in {info['total_s'] / 60:.1f} min "
        f"({len(info['prompts'])} prompts; H_Q={info['H_Q']}, G={G}, r={r}, L={info['L']}, d={info['head_dim']}). "
        "Paper numbers: paper 000's Qwen2.5-1.5B-Instruct pilot (r = 6, L = 28).",
        "",
    ]
    # Table 4
    t4_rows = []
    for row in t4:
        paper = PAPER["table4"].get((row["scorer"], row["k_over_t"]))
        t4_rows.append(
            {
                **row,
                "paper": ""
                if paper is None
                else f"{paper[0]:.3f} / {paper[1]:.3f} / {paper[2]:.3f} / {paper[3]} / {paper[4]} / {paper[5]:.3f}",
            }
        )
    cols = [
        "scorer",
        "k_over_t",
        "uor_mean",
        "uor_max",
        "frac_uor_gt1",
        "cert_bonferroni",
        "cert_sandwich",
        "frac_uor_ge2",
        "j_bar_mean",
        "j_max_mean",
        "cells",
        "skipped",
        "paper",
    ]
    heads = [
        "Scorer",
        "k/T",
        "mean UOR",
        "UOR max",
        "frac(UOR>1)",
        "cert_1 (Bonf.)",
        "cert_T (sandw.)",
        ">=2-frac",
        "mean J_bar",
        "mean J_max",
        "cells",
        "skipped",
        "paper: mean/max/frac>1/cert_1/cert_T/>=2",
    ]
    t4md = md_table(t4_rows, cols, 3, heads)
    thr = info["thresholds"]
    t4_note = (
        f"Cells = (prompt, layer, group). Certificates count cells whose lower bound certifies UOR >= 2: "
        f"Bonferroni at J_bar <= {thr['bonferroni']:.4f}, sandwich at J_bar <= {thr['sandwich']:.4f} for r = {r}. "
        "`page_entrokv_pooled`: the pooled score (sink-isolated H_2, tau_g = 0.5) top-s per group shared by the "
        "group's heads; `page_entrokv_press_pages`: the press's own page decisions at compression_ratio = "
        f"{cfg.compression_ratio} from its records (k/T column = kept fraction)."
    )
    write_atomic(
        out / "table4.md", "# Table 4: head-independent replay vs pooled selection\n\n" + t4md + "\n\n" + t4_note + "\n"
    )
    lines += [
        "## Table 4: head-independent replay vs pooled selection",
        "",
        t4md,
        "",
        t4_note,
        "",
        "![Fig. 4](fig4_uor_vs_jbar.png)",
        "",
    ]
    # accounting
    acc_sum = []
    for press in sorted({x["press"] for x in acc}):
        for layer in sorted({x["layer"] for x in acc}):
            v = [x for x in acc if x["press"] == press and x["layer"] == layer]
            acc_sum.append(
                {
                    "press": press,
                    "layer": layer,
                    "pages_per_group": _mean(x["pages_per_group"] for x in v),
                    "union_pages": _mean(x["union_pages"] for x in v),
                    "allocation_bytes": _mean(x["allocation_bytes"] for x in v),
                    "union_bytes": _mean(x["union_bytes"] for x in v),
                    "union_ratio": _mean(x["union_ratio"] for x in v),
                    "hi_snapkv_uor": _mean(x["hi_snapkv_uor"] for x in v),
                    "hi_snapkv_allocation_bytes": _mean(x["hi_snapkv_allocation_bytes"] for x in v),
                }
            )
    tot = []
    for press in sorted({x["press"] for x in acc}):
        v = [x for x in acc if x["press"] == press]
        n_prompts = len({x["prompt"] for x in v})
        a, u, h = (
            sum(x[k] for x in v) / n_prompts for k in ("allocation_bytes", "union_bytes", "hi_snapkv_allocation_bytes")
        )
        tot.append(
            {
                "press": press,
                "allocation_MiB": a / 2**20,
                "union_MiB": u / 2**20,
                "union/allocation": u / a,
                "hi_snapkv_allocation_MiB": h / 2**20,
                "hi/allocation": h / a,
            }
        )
    lines += [
        "## Physical page accounting (paper 001 section 7)",
        "",
        f"Per prompt, all layers (e = {cfg.bytes_per_element} bytes per element, "
        f"B = {cfg.presses.page_entrokv.page_size}): "
        "per-group allocation `2 e d B sum K_lg` vs union materialisation `2 e d B G sum U_l`; "
        "`hi_snapkv`: per-group allocation of the pages touched by the union of the heads' own top-b snapkv "
        "positions at the same token budget b.",
        "",
        md_table(tot, list(tot[0]) if tot else [], 3),
        "",
        "Per layer (means over prompts; `page_accounting.csv` has every prompt):",
        "",
        md_table(acc_sum, list(acc_sum[0]) if acc_sum else [], 3),
        "",
    ]
    if slots:
        top = sorted(slots, key=lambda x: -x["share_unprotected"])[:3]
        lines += [
            "## Pooled mass by slot within the kept pages (paper 000 Fig. 6)",
            "",
            f"Share of the pooled score mass at each offset of the kept pages (B = {len(slots)}; uniform "
            f"{slots[0]['uniform']:.4f}), over {slots[0]['pages_kept']} kept page frames (all) and "
            f"{slots[0]['pages_unprotected']} unprotected ones (not the sink or window pages). Largest "
            "unprotected shares: "
            + ", ".join(f"slot {x['slot']} {x['share_unprotected']:.4f}" for x in top)
            + f". Paper (Qwen2.5-1.5B pilot, r = 6): {PAPER['fig6']}.",
            "",
            md_table(slots, ["slot", "share_kept", "share_unprotected", "uniform"], 4),
            "",
        ]
    # Table 5
    tau_md = [
        {
            **x,
            "paper max_w / std": ""
            if x["tau"] not in PAPER["tau"]
            else "{:.4f} / {:.4f}".format(*PAPER["tau"][x["tau"]]),
        }
        for x in tau_rows
    ]
    alpha_md = [
        {
            **x,
            "paper max_w; [H_min, H_max]": ""
            if x["alpha"] not in PAPER["alpha"]
            else "{:.3f}; [{:.3f}, {:.3f}]".format(*PAPER["alpha"][x["alpha"]]),
        }
        for x in alpha_rows
    ]
    n_exact = sum(x["exact"] for x in card)
    union = [x for x in acc if x["press"] == "page_entrokv"]
    lines += [
        "## Table 5: mechanism ablations",
        "",
        f"(a) tau_g sweep on the press's sink-isolated H_2 (per (prompt, layer, group) cell; mean of max_h w_h, "
        f"max of max_h w_h, mean within-group population std). Monotone per cell: {tau_check['monotone_per_cell']} "
        f"({tau_check['per_cell_violations']} violations); monotone in the mean: {tau_check['monotone_mean']}; "
        f"limit 1/r = {1 / r:.4f}.",
        "",
        md_table(tau_md, list(tau_md[0]), 4),
        "",
        "(b) alpha sweep at tau_g = 0.5 (sink-isolated entropies of every head; violations of [0, ln T]; "
        "`at_clamp` counts values on the clamp edges 0 or ln(T-|S|) of `renyi_entropy`, which would hide "
        "round-off).",
        "",
        md_table(alpha_md, list(alpha_md[0]), 3),
        "",
        f"(c) Cardinality exactness: {n_exact}/{len(card)} (prompt, press, layer) decisions keep exactly the "
        "planned tokens, the cache holds that many, and it is within the budget.",
        "",
        f"(d) Page-union ratio G U_l / sum_g K_lg of Page-EntroKV: mean {_mean(x['union_ratio'] for x in union):.3f}, "
        f"max {max((x['union_ratio'] for x in union), default=float('nan')):.3f} (1 = all groups keep the same "
        f"pages, G = {G} = disjoint).",
        "",
    ]
    # census
    c = {x["class"]: x for x in census_sum}
    ratio_raw = c["sink"]["raw_weight"] / c["contextual"]["raw_weight"] if c["contextual"]["n"] else float("nan")
    ratio_iso = (
        c["sink"]["isolated_weight"] / c["contextual"]["isolated_weight"] if c["contextual"]["n"] else float("nan")
    )
    cc = cfg.census
    lines += [
        "## Sink census (Figs. 7-8)",
        "",
        f"Rule (operational, on the window-averaged observer attention of every (layer, query head) of the needle "
        f"probes{' whose needle lies before the observer window' if cc.exclude_window_needles else ''}): "
        f"**sink** when at least {cc.sink_threshold} of the mass is on the first "
        f"n_sink = {cfg.presses.page_entrokv.n_sink} "
        "positions; else **retrieval** when the top-1 non-sink position is a token of the needle sentence; else "
        "**contextual**. Weights are the group softmax at tau_g = 0.5 of raw vs sink-isolated H_2.",
        "",
        md_table(census_sum, list(census_sum[0]), 3),
        "",
        f"Sink-to-contextual weight ratio: raw {ratio_raw:.2f}x, isolated {ratio_iso:.2f}x "
        f"(paper: {PAPER['census']['ratio'][0]:.2f}x -> {PAPER['census']['ratio'][1]:.2f}x; paper weights sink "
        f"{PAPER['census']['w_sink'][0]} -> {PAPER['census']['w_sink'][1]}, "
        f"contextual {PAPER['census']['w_ctx'][0]} -> "
        f"{PAPER['census']['w_ctx'][1]} at r = 6; paper n = {PAPER['census']['sink']} sink / "
        f"{PAPER['census']['retrieval']} retrieval / {PAPER['census']['contextual']} contextual).",
        "",
        "![Fig. 7](fig7_entropy.png) ![Fig. 8](fig8_weights.png)",
        "",
    ]
    # Table 6
    t6 = table6(retention, list(cfg.retention.presses), int(cfg.presses.page_entrokv.page_size))
    write_atomic(out / "table6.md", "# Table 6: needle retention at a 20% budget\n\n" + t6 + "\n")
    lines += [
        "## Table 6: needle retention",
        "",
        t6,
        "",
        f"Paper: {PAPER['table6']}.",
        "",
        "![retention per layer](fig6_retention_layers.png)",
        "",
    ]
    lines += [
        "## Timing",
        "",
        md_table(info["timings"], ["prompt", "T", "prefill_s", "total_s"], 1),
        "",
        f"Model load and prompt generation: {info['load_s']:.0f} s; threads: {info['threads']}.",
        "",
    ]
    write_atomic(out / "report.md", "\n".join(lines))


def table6(retention: list[dict], presses: list[str], page_size: int) -> str:
    """Markdown for Table 6: (a) pooled-selection criterion by length, (b) strict criterion by depth,
    (c) end-to-end answer accuracy by depth and length (``page_size``: the presses' page size, stated)."""
    names = ["no_press", *presses]
    lengths = sorted({x["length"] for x in retention})
    depths = sorted({x["depth"] for x in retention})
    T_of = {L: round(_mean(x["T"] for x in retention if x["length"] == L)) for L in lengths}

    def cell(name, key, **where):
        v = [x[key] for x in retention if x["press"] == name and all(x[k] == w for k, w in where.items())]
        return _mean(float(a) for a in v), len(v)

    def block(title, key, by, labels, pct):
        rows = [
            f"**{title}**",
            "",
            "| Method | " + " | ".join(labels) + " | all |",
            "|---|" + "---|" * (len(labels) + 1),
        ]
        for name in names:
            vals = [cell(name, key, **{by: b})[0] for b in (lengths if by == "length" else depths)]
            allv = cell(name, key)[0]
            f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.2f}")
            rows.append(f"| {name} | " + " | ".join(f(v) for v in vals) + f" | {f(allv)} |")
        return rows

    n = len([x for x in retention if x["press"] == names[0]])
    out = [
        f"{n} needle prompts per method; budget 20% (compression_ratio 0.8), page_size {page_size}, "
        "needle page = every page holding a token of the needle's value.",
        "",
    ]
    out += block(
        "(a) Pooled-selection criterion: fraction of (layer, group) decisions that keep the needle page, "
        "by context (T = prompt tokens)",
        "frac_decisions_kept",
        "length",
        [f"T={T_of[L]}" for L in lengths],
        True,
    )
    out += [""] + block(
        "(b) Strict all-layer criterion: recall (needle page kept in every layer and group), by depth",
        "strict_kept",
        "depth",
        [f"{d:g}%" for d in depths],
        False,
    )
    out += [""] + block(
        "(c) End-to-end answer accuracy (greedy, 7-digit value in the answer), by depth",
        "score",
        "depth",
        [f"{d:g}%" for d in depths],
        False,
    )
    out += [""] + block(
        "(d) End-to-end answer accuracy by context", "score", "length", [f"T={T_of[L]}" for L in lengths], False
    )
    return "\n".join(out)


@hydra.main(config_path=str(CONFIG_DIR), config_name="uor", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    """Hydra's task (``configs/uor.yaml``)."""
    run(cfg)


def main() -> None:
    """The command line (``sys.argv``): refused in one line, before Hydra starts, when it names a config or a key
    ``configs/uor.yaml`` does not have (:func:`evaluation.cli.check_command_line`); else Hydra runs the study."""
    check_command_line(sys.argv[1:], "uor", "evaluation.uor")
    _hydra_main()


if __name__ == "__main__":
    main()
