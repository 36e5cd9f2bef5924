"""Where does the embedded model's attention find the answer passage? A probe for EntroPrefill's position bias.

For query-aware examples of the key-value set (evaluation/datasets/keyfacts.py) the script runs ONE
uncompressed forward over the prompt as the model sees it when it answers: the prefill (passages, question,
``Answer:``) followed by the chat template's assistant turn and the answer prefix ("The special magic number
for <key> is"). At every layer it reads, for several sets of observer rows, each row's mass on each passage
(:func:`presses.core.row_masses.row_chunk_masses_reference`, the quantity of paper 001 eq. 14), and reports the
answer passage's LIFT: its share of the row's mass on the passages divided by its share of the passage tokens
(1 = no preference, > 1 = the row looks at the answer passage). Observer sets:

* ``suffix``: the last 8 prefill positions (EntroPrefill's default proposal observers);
* ``query``: every position of the query span (from ``Question:`` to the end of the prefill);
* ``key``: the question's tokens of the key (the word that identifies the answer passage);
* ``answer``: the last token of the answer prefix, AFTER the prefill (what the model attends from when it
  produces the value; EntroPrefill cannot observe it, it is not in the prompt it prunes).

Per layer and observer set it reports the mean over examples of the head-averaged lift (what pooling sees),
the max-over-heads lift, and the fraction of examples where the answer passage has the largest mass of all
passages in the head-averaged rows; plus the Spearman correlation of the head-averaged passage masses with
the passage index (> 0: later passages get more). Writes ``<out>/probe.csv`` and ``<out>/README.md``.

Usage (``python -m evaluation.studies.entroprefill_attention_probe`` is the same)::

    python scripts/entroprefill_attention_probe.py --lengths 2048 --n 10 --seed 1000 --threads 1 \\
        --out results/entroprefill/position_bias/probe
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch

from evaluation import tables
from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.studies.entroprefill_bench import reverse_passages, spearman


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reverse-passages", action="store_true")
    ap.add_argument("--out", default="results/entroprefill/position_bias/probe")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvpress import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    from evaluation.datasets.keyfacts import KeyFactsDataset
    from evaluation.models import load_model
    from presses.core.row_masses import chunk_ids, row_chunk_masses_reference
    from presses.entroprefill.chunking import find_question, plan_chunks, token_offsets
    from presses.entroprefill.equations import row_queries

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    ds = KeyFactsDataset(context_lengths=args.lengths)
    examples = ds.examples(tok, args.n, args.seed, query_aware=True)
    if args.reverse_passages:
        examples = [reverse_passages(e) for e in examples]
    L = model.config.num_hidden_layers
    stats: dict[tuple[int, str], dict[str, list[float]]] = {}
    for n, ex in enumerate(examples):
        inputs = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
        ctx, tail = inputs["context_ids"], inputs["questions_ids"][0]
        ids = torch.cat([ctx, tail], dim=1)
        T = ctx.shape[1]
        text, offsets = token_offsets(tok, ctx[0].tolist())
        plan = plan_chunks(text, offsets, mode="passage", question_start=find_question(text, "Question:"), n_sink=4)
        chunks = [plan.chunks[i] for i in plan.candidates]
        k, answer = len(chunks), ex.metadata["answer_passage"] - 1
        ids_k = chunk_ids(ids.shape[1], chunks)
        sizes = torch.tensor([e - s for s, e in chunks], dtype=torch.float64)
        q0 = plan.question[0]
        key_ids = tok(" " + ex.metadata["key"], add_special_tokens=False)["input_ids"]
        qtoks = ctx[0, q0:].tolist()
        key_pos = [
            q0 + i + j
            for i in range(len(qtoks) - len(key_ids) + 1)
            if qtoks[i : i + len(key_ids)] == key_ids
            for j in range(len(key_ids))
        ]
        sets = {
            "suffix": torch.arange(T - 8, T),
            "query": torch.arange(q0, T),
            "key": torch.tensor(key_pos),
            "answer": torch.tensor([ids.shape[1] - 1]),
        }

        def hook(module, a, kwargs, output, sets=sets, ids_k=ids_k, k=k, answer=answer, sizes=sizes):
            keys = kwargs["past_key_values"].layers[module.layer_idx].keys
            for name, pos in sets.items():
                if not len(pos):
                    continue
                q = row_queries(module, kwargs["hidden_states"], pos, kwargs["position_embeddings"])
                m = row_chunk_masses_reference(q, keys, pos, ids_k, k)[0][0].double()  # (H, P, k)
                share = m / m.sum(-1, keepdim=True).clamp_min(1e-30)
                lift = share[..., answer] / (sizes[answer] / sizes.sum())  # (H, P)
                avg = share.mean((0, 1))  # head- and row-averaged passage shares
                st = stats.setdefault(
                    (module.layer_idx, name), {"lift_mean": [], "lift_max_head": [], "top": [], "spearman": []}
                )
                st["lift_mean"].append(float(lift.mean()))
                st["lift_max_head"].append(float(lift.mean(1).max()))
                st["top"].append(float(int(avg.argmax()) == answer))
                st["spearman"].append(spearman((avg / sizes).tolist()))
            return output

        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
        with torch.inference_mode():
            model.model(input_ids=ids, past_key_values=DynamicCache())
        for h in handles:
            h.remove()
        print(
            f"[{n + 1}/{len(examples)}] T={T} passages={k} answer={answer + 1} key_tokens={len(key_pos)} "
            f"{time.perf_counter() - t0:.0f}s",
            flush=True,
        )

    def mean(xs):
        return statistics.fmean([x for x in xs if not math.isnan(x)]) if xs else math.nan

    rows = [
        {"layer": li, "observers": name, **{s: mean(v) for s, v in st.items()}}
        for (li, name), st in sorted(stats.items())
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables.write_rows(out / "probe.csv", rows, list(rows[0]))
    names = ["suffix", "query", "key", "answer"]
    by = {(r["layer"], r["observers"]): r for r in rows}
    head = "| layer | " + " | ".join(f"{n}: lift / max-head lift / top / spearman" for n in names) + " |"
    lines = [
        f"# Attention probe: does the model's attention find the answer passage? (keyfacts, seed {args.seed}"
        + (", passages reversed" if args.reverse_passages else "")
        + ")",
        "",
        f"{len(examples)} examples at {args.lengths} tokens, model `{args.model}`. Per layer (0-based) and "
        "observer set: mean over examples of the answer passage's lift (its share of the passage mass / its "
        "share of the passage tokens, head- and row-averaged; 1 = no preference), the largest head's lift, "
        "the fraction of examples where the answer passage gets the most mass, and the Spearman correlation "
        "of the passages' mass density with their index (> 0: later passages get more). Observers: `suffix` "
        "= the last 8 prefill tokens (EntroPrefill's default), `query` = the whole query span, `key` = the "
        "key's tokens in the question, `answer` = the last answer-prefix token, after the prefill.",
        "",
        head,
        "|---|" + "---|" * len(names),
    ]
    for li in range(L):
        cells = []
        for name in names:
            r = by.get((li, name))
            cells.append(
                "-"
                if r is None
                else f"{r['lift_mean']:.2f} / {r['lift_max_head']:.2f} / {r['top']:.2f} / {r['spearman']:.2f}"
            )
        lines.append(f"| {li} | " + " | ".join(cells) + " |")
    cmd = tables.command("entroprefill_attention_probe", argv if argv is not None else sys.argv[1:])
    lines += ["", f"Command: `{cmd}`", "", f"Total wall time: {time.perf_counter() - t0:.0f} s.", ""]
    write_atomic(out / "README.md", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
