"""KVzip's exact scores at a lower cost (``presses.KVzipFastPress``, docs/methods.md §1.18) against kvpress's KVzip
and KVzip+ on the embedded model, one thread: the cost of the prefill and its reconstruction pass against the
prefill alone, and the Jaccard of the kept (layer, KV head, position) sets against kvpress's.

Usage::

    python -m evaluation.studies.kvzip_fast [n_examples=4] [context_length=2048] [output=results/kvzip_cost/fast]
    python scripts/kvzip_fast.py ...            # the same

Per needle example (question after the context; only the context is scored), each measured in this process with
one torch thread as CPU seconds of the calling thread (``time.thread_time``: what the work costs, whatever else
the shared machine runs): the uncompressed prefill (``model.model``), then for every variant the prefill inside
``with press(model)`` and the reconstruction pass it runs on leaving (the selection left out: a top-k). Each
variant's raw scores then go through its own selection at every ratio of :data:`RATIOS`
(``evaluation.kvzip_path.select``); the kept sets are compared with kvpress's KVzip's (KVzip+'s for the KVzip+
variants). Writes ``<output>/README.md`` and ``<output>/kvzip_fast.csv`` (one row per example and variant).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

RATIOS = (0.5, 0.75, 0.9)

#: variant -> (press class name, its fields besides the ratio, the kvpress variant its kept sets are compared with)
VARIANTS = {
    "kvzip (kvpress)": ("KVzipPress", {}, "kvzip (kvpress)"),
    "kvzip_plus (kvpress)": ("KVzipPress", {"kvzip_plus_normalization": True}, "kvzip_plus (kvpress)"),
    "kvzip_fast (fused)": ("KVzipFastPress", {}, "kvzip (kvpress)"),
    "kvzip_fast fused=False": ("KVzipFastPress", {"fused": False}, "kvzip (kvpress)"),
    "kvzip_plus_fast (fused)": ("KVzipFastPress", {"kvzip_plus_normalization": True}, "kvzip_plus (kvpress)"),
    "kvzip_fast chunk_size=1024": ("KVzipFastPress", {"chunk_size": 1024}, "kvzip (kvpress)"),
    "kvzip_fast chunk_size=512": ("KVzipFastPress", {"chunk_size": 512}, "kvzip (kvpress)"),
}


def kept_mask(masks: tuple, shape: tuple):
    """``(L, G, T)`` bool: the entries kvpress's head-wise masks (one ``(batch, head, position)`` triple or None per
    layer, batch 1) leave."""
    import torch

    kept = torch.ones(shape, dtype=torch.bool)
    for layer, mask in enumerate(masks):
        if mask is not None:
            kept[layer, mask[1].cpu(), mask[2].cpu()] = False
    return kept


def jaccard(a, b) -> float:
    """``|a & b| / |a | b|`` of two bool tensors (1 for two empty sets)."""
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else 1.0


def _timed(fn):
    cpu, wall = time.thread_time(), time.perf_counter()
    out = fn()
    return out, time.thread_time() - cpu, time.perf_counter() - wall


def main(n_examples: int = 4, context_length: int = 2048, output: str = "results/kvzip_cost/fast") -> None:
    import kvpress
    import torch
    from hydra.utils import instantiate
    from transformers import DynamicCache

    import presses
    from evaluation import harness, kvzip_path, tables
    from evaluation.atomic import write_atomic
    from evaluation.loop import tokenise
    from evaluation.models import load_model
    from evaluation.pipeline import TextGenerationPipeline

    def build(name: str, ratio: float):
        cls_name, fields, _ = VARIANTS[name]
        cls = getattr(kvpress, cls_name, None) or getattr(presses, cls_name)
        return cls(compression_ratio=ratio, **fields)

    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    cfg = harness.compose_config(["dataset=needle", f"dataset.context_length={context_length}"])
    examples = instantiate(cfg.dataset).examples(tok, n_examples, 42, False)
    L, G = model.config.num_hidden_layers, model.config.num_key_value_heads
    rows = []
    for ex in examples:
        context_ids = tokenise(pipe, tok, ex)["context_ids"]
        T = context_ids.shape[1]
        with torch.inference_mode():
            _, prefill_cpu, prefill_wall = _timed(
                lambda: model.model(input_ids=context_ids, past_key_values=DynamicCache())
            )
            kept = {}
            for name in VARIANTS:
                press, scores = build(name, RATIOS[0]), {}
                press.compress_post = lambda model, press=press: scores.setdefault("raw", press.score_val.clone())

                def scored(press=press):
                    with press(model):
                        model.model(input_ids=context_ids, past_key_values=DynamicCache())

                _, cpu, wall = _timed(scored)
                kept[name] = {
                    r: kept_mask(kvzip_path.select(build(name, r), scores["raw"], model, None), (L, G, T))
                    for r in RATIOS
                }
                reference = VARIANTS[name][2]
                row = {"example": ex.id, "tokens": T, "variant": name, "reference": reference}
                row |= {"prefill_cpu_s": prefill_cpu, "cpu_s": cpu, "x_prefill": cpu / prefill_cpu}
                row |= {"prefill_wall_s": prefill_wall, "wall_s": wall}
                row |= {f"jaccard_{r:g}": jaccard(kept[name][r], kept[reference][r]) for r in RATIOS}
                rows.append(row)
        print(ex.id, {r["variant"]: round(r["x_prefill"], 2) for r in rows if r["example"] == ex.id}, flush=True)

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tables.write_rows(out / "kvzip_fast.csv", rows, float_spec=".6g")
    text = readme(rows, [str(n_examples), str(context_length), str(output)], torch.__version__)
    write_atomic(out / "README.md", text)
    print(text)


def readme(rows: list[dict], argv: list[str], torch_version: str) -> str:
    """``README.md`` of the study from its CSV rows (:func:`main`'s, or read back with numbers as strings): per
    variant the mean CPU seconds, their ratio to the uncompressed prefill and to the reference variant, and the
    Jaccard of the kept sets at each ratio, min / mean over examples."""
    from evaluation import tables

    def mean(name: str, column: str) -> float:
        return statistics.mean(float(r[column]) for r in rows if r["variant"] == name)

    prefill = mean(next(iter(VARIANTS)), "prefill_cpu_s")
    table = []
    for name in VARIANTS:
        cpu, reference = mean(name, "cpu_s"), VARIANTS[name][2]
        jac = [[float(r[f"jaccard_{x:g}"]) for r in rows if r["variant"] == name] for x in RATIOS]
        jac = [f"{min(j):.6f} / {statistics.mean(j):.6f}" for j in jac]
        ratio = cpu / mean(reference, "cpu_s")
        table.append([name, f"{cpu:.1f}", f"{cpu / prefill:.2f}", reference, f"{ratio:.2f}", *jac])
    n_examples = len({r["example"] for r in rows})
    tokens = " / ".join(sorted({str(r["tokens"]) for r in rows}))
    lines = [
        "# KVzip's exact scores at a lower cost: presses.KVzipFastPress against kvpress's KVzip (one thread)",
        "",
        f"Command: `{tables.command('kvzip_fast', argv)}` (torch {torch_version}, 1 thread). Needle examples of "
        f"{argv[1]} tokens ({tokens} with the chat template; question after the context, the context scored), mean "
        f"over {n_examples} examples. CPU: seconds of the calling thread (`time.thread_time`) for the prefill inside "
        "`with press(model)` and the reconstruction pass it runs on leaving (the selection, a top-k, left out); "
        f"x prefill: over the uncompressed prefill's mean ({prefill:.2f} s); x reference: over the reference "
        "variant's CPU seconds. Jaccard: of the kept (layer, KV head, position) sets against the reference "
        "variant's at each ratio, min / mean over examples. Rows: `kvzip_fast.csv`. What each variant does: "
        "docs/methods.md §1.18.",
        "",
        *tables.markdown_table(
            ["variant", "CPU s / example", "x prefill", "reference", "x reference"]
            + [f"Jaccard @{r:g}" for r in RATIOS],
            table,
        ),
        "",
    ]
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> None:
    """This study's command line (:func:`evaluation.studies.kvzip_cost.example_cli`)."""
    from evaluation.studies.kvzip_cost import example_cli

    example_cli("python -m evaluation.studies.kvzip_fast", __doc__.split("\n")[0], main, argv)


if __name__ == "__main__":
    cli()
