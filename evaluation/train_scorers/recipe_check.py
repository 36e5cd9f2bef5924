"""How the project's KVzip+ targets (:mod:`evaluation.train_scorers.targets`: kvpress's KVzipPress reconstruction
pass) relate to those of kvpress's own KVzap recipe (``kvzap/data.py`` of kvpress's repository, reimplemented here
from its description, not copied): per held-out document, Spearman's rho between the two per layer and KV head.

The recipe's targets come from ONE eager forward over the chat ``user: <document>\\n\\nRepeat the previous context
exactly. / assistant: <document>``: per document key, the maximum over the repeated document's query rows of the
attention weight (softmax over the whole causal prefix), divided by the row's hidden-state norm, times
``||W_o v||`` of the key's value for the row's head, maximum over the KV group's heads, log. Documents whose two
tokenisations of the document differ in length are skipped.

``python -m evaluation.train_scorers.recipe_check [--docs 3] [--seed 0]`` prints a Markdown table per layer and
writes it to ``results/scorers/<model>/kvzap_targets_vs_recipe.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from evaluation.atomic import write_atomic

__all__ = ["recipe_scores"]


def _span(offsets: torch.Tensor, text_len: int, start: int, end: int) -> tuple[int, int]:
    m = torch.cat([offsets[:, 0], torch.tensor([text_len])])
    return int(torch.where(m >= start)[0][0]), int(torch.where(m >= end)[0][0])


def recipe_scores(model, tokenizer, text: str) -> np.ndarray:
    """``(L, G, n)`` raw scores of ``text``'s ``n`` tokens by the recipe (module docstring); ``model`` on eager
    attention."""
    prompt = text.strip()
    chat = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": prompt + "\n\nRepeat the previous context exactly."},
            {"role": "assistant", "content": prompt},
        ],
        tokenize=False,
    )
    enc = tokenizer(chat, return_tensors="pt", return_offsets_mapping=True)
    prefix, repeat, _ = chat.split(prompt)
    offsets = enc.offset_mapping[0]
    s, e = _span(offsets, len(chat), len(prefix), len(prefix) + len(prompt))
    rs, re_ = _span(
        offsets, len(chat), len(prefix) + len(prompt) + len(repeat), len(prefix) + 2 * len(prompt) + len(repeat)
    )
    out = []

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"][0]  # (T, hidden)
        values = kwargs["past_key_values"].layers[module.layer_idx].values[0]  # (G, T, d)
        G, H = values.shape[0], module.config.num_attention_heads
        wo = module.o_proj.weight.T.reshape(H, values.shape[-1], -1)  # (H, d, hidden)
        wov = torch.einsum("hdj,htd->htj", wo, values.repeat_interleave(H // G, 0)).norm(dim=-1)  # (H, T)
        w = output[1][0] / h.norm(dim=-1)[None, :, None] * wov[:, None, :]  # (H, T, T)
        w = w[:, rs:re_, s:e].amax(1).reshape(G, H // G, -1).amax(1)  # (G, n)
        out.append(w.float().cpu().numpy())

    from presses.core.model import decoder_layers

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in decoder_layers(model)]
    try:
        with torch.inference_mode():
            model.model(input_ids=enc.input_ids.to(model.device))
    finally:
        for handle in handles:
            handle.remove()
    return np.stack(out)


def main(argv: list[str] | None = None) -> int:
    """Compare the two targets on the first ``--docs`` held-out documents whose targets are stored."""
    from evaluation.models import load_model
    from evaluation.scorers import SCORERS, model_key
    from evaluation.train_scorers import targets

    p = argparse.ArgumentParser(prog="python -m evaluation.train_scorers.recipe_check", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(SCORERS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = targets.Settings(model=args.model, seed=args.seed, threads=args.threads)
    stored = targets.heldout_scores(targets.work_dir(settings), args.seed)
    model, tokenizer = load_model(args.model, attn_implementation="eager")
    rhos, used = [], []
    for doc, scores, _, _ in stored:
        if len(used) == args.docs:
            break
        recipe = recipe_scores(model, tokenizer, doc.text)
        if recipe.shape != scores.shape:
            print(f"{doc.id}: {recipe.shape[-1]} recipe tokens against {scores.shape[-1]}: skipped", flush=True)
            continue
        rhos.append([[spearmanr(a, b).statistic for a, b in zip(x, y)] for x, y in zip(recipe, scores)])
        used.append(doc.id)
        print(f"{doc.id}: mean rho {np.mean(rhos[-1]):.3f}", flush=True)
    rho = np.mean(rhos, axis=(0, 2))
    lines = [
        "# KVzip+ targets: the project's KVzip path against kvpress's KVzap recipe",
        "",
        f"Command: `python -m evaluation.train_scorers.recipe_check {' '.join(argv or sys.argv[1:])}`",
        "",
        f"Spearman's rho between the two targets per layer, averaged over KV heads and the held-out documents "
        f"{', '.join(used)} (evaluation/train_scorers/recipe_check.py); mean over layers {rho.mean():.3f}.",
        "",
        "| layer | rho |",
        "| ---: | ---: |",
        *[f"| {layer} | {r:.3f} |" for layer, r in enumerate(rho)],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    key = model_key(model)
    Path(args.out, key).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(args.out, key, "kvzap_targets_vs_recipe.md"), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
