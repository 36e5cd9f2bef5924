"""EntroPrefill vs full prefill on the embedded model: prefill time, accuracy, bypasses, answer-passage survival.

For each query-aware example of a passage set (``--dataset keyfacts``: evaluation/datasets/keyfacts.py, the set
the uncompressed model answers; ``multidoc``: evaluation/datasets/multidoc.py) the script runs the kvpress
pipeline's own steps in one process: full prefill and EntroPrefill prefill, alternating which goes first,
timing only the prefill call ``model.model(input_ids, cache)`` (wall clock and process CPU time), then greedy
decoding with ``pipeline.generate_answer`` from position ``T``. ``--skip-full`` runs EntroPrefill alone (for
the position-bias study, which needs only its decisions). It writes to ``--out``:

* ``examples.csv``: one row per (example, method): time, score, the press summary, the answer passage, its
  rank among the candidate chunks by the priority ``S_i`` (eqs. 8-9) at the accepted layer (or the last
  scanned one), and the Spearman correlation of ``S_i`` with the chunk index (> 0: later chunks rank higher);
* ``summary.csv``: per context length: prefill times and their ratios, accuracies, bypass frequency, ``T'/T``,
  answer removal among pruned examples, survival of the answer passage in the first and second half, greedy
  saving ``D_l`` vs dual bound ``U_l``, analytic saving (paper 001 eq. 32);
* ``survival.csv``: answer-passage survival among pruned examples by position quarter, per length;
* ``README.md``: the tables, with the command that produced them.

Study options: ``--reverse-passages`` reverses the passage order of every prompt (markers renumbered, the
answer passage moves from position p to n + 1 - p); ``--scores rope_free`` computes the rows' attention with
RoPE removed from queries and keys (every key at relative distance 0 from its observer: content only), a
diagnostic, not the method; ``--press KEY=VALUE`` overrides EntroPrefillPress fields; ``--variant NAME KEY=VALUE``
(repeatable) runs several EntroPrefill configurations on every example after the same full prefill.

``--finch`` also runs kvpress's ``FinchPress`` (its nearest peer: query-aware prefill compression, the question as
SnapKV's window, arXiv 2408.11795 / TACL 2024) on every example at the first variant's kept fraction of that
example, ``compression_ratio = 1 - T'/T``, on a model copy with Finch's delimiter token (as the harness sets it
up, :func:`evaluation.registry.install_delimiter`), after the other methods; ``finch.csv`` and the README then
compare accuracy, prefill time against the full prefill, and the answer value's survival: the fraction of
(layer, KV head) pairs whose kept tokens hold every token of the answer value (Finch's selection recomputed from
its own scores, as its ``compress`` takes them).

Long runs: ``examples.csv`` is rewritten after every example and the tables after every length; ``--resume``
(same arguments) keeps the finished examples and runs the rest. ``--shard i/n`` runs every n-th example and
``--merge DIR ...`` writes the tables from the shards' ``examples.csv``.

Usage (``OMP_NUM_THREADS=1``; the committed runs list their commands in results/entroprefill/;
``python -m evaluation.studies.entroprefill_bench`` is the same)::

    python scripts/entroprefill_bench.py --dataset keyfacts --lengths 2048 4096 8000 --n 40 --threads 1
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from evaluation import tables
from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser


def parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if v.lower() in ("none", "null"):
        return None
    if v.startswith("[") and v.endswith("]"):
        return [parse_value(x.strip()) for x in v[1:-1].split(",") if x.strip()]
    return v


def reverse_passages(example):
    """The same prompt with its ``Passage N:`` passages in reverse order (markers renumbered); the metadata's
    ``answer_passage`` and ``depth`` follow the answer passage."""
    from presses.entroprefill.chunking import PASSAGE_PATTERN, passage_marker

    text = example.context
    marks = list(re.finditer(PASSAGE_PATTERN, text))
    q = text.rfind("\n\n" + "Answer the question") if "Question:" in text else len(text)
    head, tail = text[: marks[0].start()], text[q:]
    bodies = [text[m.end() : (marks[i + 1].start() if i + 1 < len(marks) else q)] for i, m in enumerate(marks)]
    bodies = [b.rstrip("\n") for b in bodies]
    n = len(bodies)
    context = head + "\n\n".join(passage_marker(i + 1) + b for i, b in enumerate(reversed(bodies))) + tail
    meta = dict(example.metadata)
    meta["answer_passage"] = n + 1 - example.metadata["answer_passage"]
    meta["depth"] = 100.0 * (meta["answer_passage"] - 1) / max(1, n - 1)
    return dataclasses.replace(example, id=example.id + "-rev", context=context, metadata=meta)


def rope_free_rows():
    """A replacement for the press's row statistics that removes RoPE from queries and keys (a diagnostic)."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    from presses.core.row_masses import row_chunk_masses_reference

    def rows(
        module, hidden_states, keys, positions, position_embeddings, ids, num_chunks, row_weights=None, attentions=None
    ):
        cos, sin = (x.unsqueeze(1) for x in position_embeddings)
        q = get_prerope_query_states(module, hidden_states[:, positions])
        k = keys * cos + rotate_half(keys) * -sin  # the inverse rotation: every key back at position 0
        return row_chunk_masses_reference(
            q, k, positions, ids, num_chunks, row_weights, getattr(module, "scaling", q.shape[-1] ** -0.5)
        )

    return rows


def spearman(x: list[float]) -> float:
    """Spearman correlation of ``x`` with its index (ties averaged); NaN below 3 values."""
    n = len(x)
    if n < 3:
        return math.nan
    order = sorted(range(n), key=lambda i: x[i])
    ranks = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    mean = (n - 1) / 2
    cov = sum((ranks[i] - mean) * (i - mean) for i in range(n))
    var = sum((i - mean) ** 2 for i in range(n))
    var_r = sum((r - mean) ** 2 for r in ranks)
    return cov / math.sqrt(var * var_r) if var_r > 0 else math.nan


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dataset", choices=["keyfacts", "multidoc"], default="keyfacts")
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[2048, 4096, 8000],
        help="context lengths (keyfacts: 8000 leaves room for the template and answer in 8192 positions)",
    )
    ap.add_argument(
        "--n",
        "--n-per-kind",
        dest="n",
        type=int,
        default=10,
        help="examples per length (keyfacts) or per fact kind and length (multidoc)",
    )
    ap.add_argument("--distractor-facts", default="none", help="keyfacts: none | other | number")
    ap.add_argument("--compression-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--skip-full", action="store_true", help="EntroPrefill only (its decisions; no accuracy ratio)")
    ap.add_argument("--reverse-passages", action="store_true")
    ap.add_argument("--scores", choices=["model", "rope_free"], default="model")
    ap.add_argument(
        "--press",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="EntroPrefillPress overrides, e.g. epsilon=0.3 monitored_layers=[3,4,5]",
    )
    ap.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=None,
        metavar="NAME [KEY=VALUE ...]",
        help="a named EntroPrefill variant (repeatable; each runs on every example after the same "
        "full prefill); --press overrides apply to every variant. Default: one variant "
        "'entroprefill'",
    )
    ap.add_argument(
        "--finch",
        action="store_true",
        help="also kvpress's FinchPress at the first variant's kept fraction of each example (module docstring)",
    )
    ap.add_argument("--shard", default=None, help="i/n: run examples i, i+n, ... only (merge with --merge)")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="DIR",
        help="write the tables from the examples.csv of these shard directories (no model run)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows of an earlier run's <out>/examples.csv (same arguments) and run only the "
        "examples it lacks; rows are written after every example and the tables after every length",
    )
    ap.add_argument("--out", default="results/entroprefill/keyfacts")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.merge:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = read_examples(args.merge)
        write_examples(rows, out)
        names = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "full"))
        write_tables(rows, args, names, out, 0.0, argv)
        return 0

    from kvpress import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    import presses.entroprefill.press as ep
    from evaluation.models import load_model
    from presses.entroprefill import EntroPrefillPress

    t0 = time.perf_counter()
    model, tok = load_model(args.model, device=args.device)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device(args.device))
    common = dict(kv.split("=", 1) for kv in args.press)
    variants = {}
    for spec in args.variant or [["entroprefill"]]:
        kw = {"compression_ratio": str(args.compression_ratio), **common, **dict(kv.split("=", 1) for kv in spec[1:])}
        variants[spec[0]] = EntroPrefillPress(tokenizer=tok, **{k: parse_value(v) for k, v in kw.items()})
    if args.dataset == "keyfacts":
        from evaluation.datasets.keyfacts import KeyFactsDataset

        ds = KeyFactsDataset(
            context_lengths=args.lengths, distractor_facts=args.distractor_facts, max_new_tokens=args.max_new_tokens
        )
    else:
        from evaluation.datasets.multidoc import MultiDocQADataset

        ds = MultiDocQADataset(context_lengths=args.lengths, max_new_tokens=args.max_new_tokens)
    examples = ds.examples(tok, args.n, args.seed, query_aware=True)
    if args.shard:
        i, k = (int(x) for x in args.shard.split("/"))
        examples = examples[i::k]
    if args.reverse_passages:
        examples = [reverse_passages(e) for e in examples]
    if args.scores == "rope_free":
        ep.row_chunk_statistics = rope_free_rows()
    priorities: list = []  # (layer, S) of every layer that reached the chunk priorities, in order
    real_priorities, layer = ep.chunk_priorities, [-1]

    def recording_priorities(*a, **k):
        out = real_priorities(*a, **k)
        priorities.append((layer[0], out["S"].tolist()))
        return out

    def recording_monitor(real):
        def monitor(module, kwargs, cache, attentions, idx):
            layer[0] = idx
            return real(module, kwargs, cache, attentions, idx)

        return monitor

    ep.chunk_priorities = recording_priorities
    for press in variants.values():
        press._monitor = recording_monitor(press._monitor)
    print(f"loaded model and built {len(examples)} examples in {time.perf_counter() - t0:.1f}s", flush=True)

    def prefill(ids, press):
        cache = DynamicCache()
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        with torch.inference_mode():
            sync()
            start, cpu = time.perf_counter(), time.process_time()
            if press is not None:
                with press(model):
                    model.model(input_ids=ids, past_key_values=cache)
            else:
                model.model(input_ids=ids, past_key_values=cache)
            sync()
        return cache, time.perf_counter() - start, time.process_time() - cpu

    warm = pipe.preprocess(examples[0].context, [examples[0].question], "", int(1e10))["context_ids"][:, -512:]
    prefill(warm.to(args.device), None)  # warm-up (allocator, kernels); EntroPrefill needs the question
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_examples([out]) if args.resume and (out / "examples.csv").exists() else []
    finch = FinchRunner(args) if args.finch else None
    methods = ([] if args.skip_full else ["full"]) + list(variants) + (["finch"] if finch else [])
    done = {(r["id"], r["method"]) for r in rows}
    rows = [r for r in rows if all((r["id"], m) in done for m in methods)]  # drop half-finished examples
    if rows:
        print(f"resuming: {len({r['id'] for r in rows})} examples already in {out / 'examples.csv'}", flush=True)
    for n, ex in enumerate(examples):
        if all((ex.id, m) in done for m in methods):
            continue
        inputs = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
        ids = inputs["context_ids"].to(args.device)
        q_ids = inputs["questions_ids"][0].to(args.device)
        T = ids.shape[1]
        order = [m for m in methods if m != "finch"]
        if n % 2:  # alternate which method runs first
            order.reverse()
        for method in order + (["finch"] if finch else []):  # Finch last: it needs the first variant's T'
            priorities.clear()
            press = variants.get(method)
            if method == "finch":
                first = next(r for r in rows[::-1] if r["id"] == ex.id and r["method"] == list(variants)[0])
                answer, seconds, cpu_seconds, cache, extra = finch.run(ex, 1 - first["T_prime"] / T)
            else:
                cache, seconds, cpu_seconds = prefill(ids, press)
                with torch.inference_mode():
                    answer = pipe.generate_answer(q_ids, cache, T, ex.max_new_tokens or args.max_new_tokens)
            answer_chunk = ex.metadata["answer_passage"] - 1
            row = {
                "id": ex.id,
                "method": method,
                "target_length": ex.metadata["target_length"],
                "T": T,
                "answer_passage": ex.metadata["answer_passage"],
                "n_passages": ex.metadata["n_passages"],
                "depth": ex.metadata["depth"],
                "answer": ex.answers[0],
                "prediction": answer.strip().replace("\n", " "),
                "score": ds.score(answer, ex),
                "prefill_s": seconds,
                "prefill_cpu_s": cpu_seconds,
                "cache_len": cache.get_seq_length(),
            }
            if method == "finch":
                row.update(extra)
            elif press is not None:
                st = press.summary()
                removed = [int(i) for i in st["removed_chunks"].split(",") if i]
                row.update(
                    {
                        k: st[k]
                        for k in (
                            "accepted_layer",
                            "removed_chunks",
                            "n_chunks",
                            "D_l",
                            "U_l",
                            "target_saving",
                            "audit_bound",
                            "eta_hat_max",
                            "bypass_reason",
                            "layer_reasons",
                            "T_prime",
                            "analytic_saving",
                            "prefill_time_s",
                        )
                    }
                )
                row["answer_removed"] = int(answer_chunk in removed)
                # the candidates are every passage in these sets (chunk i = Passage i+1)
                S = priorities[-1][1] if priorities else []
                if S and answer_chunk < len(S):
                    row["answer_rank"] = sum(s > S[answer_chunk] for s in S) / max(1, len(S) - 1)  # 0 = top
                    row["priority_index_spearman"] = spearman(S)
                    row["answer_rank_by_layer"] = ";".join(
                        f"{li}:{sum(s > Sl[answer_chunk] for s in Sl) / max(1, len(Sl) - 1):.2f}"
                        for li, Sl in priorities
                    )
            rows.append(row)
            info = (
                ""
                if method == "full"
                else f"ratio={row['finch_ratio']:.3f} value_kept={row['answer_value_kept']:.2f}"
                if method == "finch"
                else (
                    f"T_prime={row['T_prime']} layer={row['accepted_layer']} "
                    f"bypass={row['bypass_reason'] or '-'} "
                    f"ans@{row['answer_passage']}/{row['n_passages']} "
                    f"removed={row['answer_removed']}"
                )
            )
            print(
                f"[{n + 1}/{len(examples)}] {method:12s} T={T} {seconds:6.2f}s (cpu {cpu_seconds:6.2f}s) "
                f"score={row['score']:.0f} {info} -> {row['prediction'][:30]!r} (ref {ex.answers[0]})",
                flush=True,
            )
        write_examples(rows, out)
        if n + 1 == len(examples) or examples[n + 1].metadata["target_length"] != ex.metadata["target_length"]:
            write_tables(rows, args, list(variants), out, time.perf_counter() - t0, argv, echo=False)
            print(f"length {ex.metadata['target_length']} done: tables in {out}", flush=True)
    write_examples(rows, out)
    write_tables(rows, args, list(variants), out, time.perf_counter() - t0, argv)
    return 0


def write_examples(rows: list[dict], out: Path) -> None:
    """``examples.csv`` (rewritten whole, through a temporary file, so an interrupted run leaves a readable one);
    NaN is written as an empty cell, as :func:`read_examples` reads it back."""
    cells = [{k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]
    tables.write_rows(out / "examples.csv", cells)


#: ``examples.csv`` columns kept as text when read back (every other cell is parsed: numbers, booleans, lists)
TEXT_COLUMNS = ("id", "method", "answer", "prediction", "removed_chunks", "bypass_reason", "layer_reasons")
TEXT_COLUMNS += ("answer_rank_by_layer",)


def read_examples(dirs) -> list[dict]:
    """The rows of the ``examples.csv`` of shard directories, numbers parsed back (an empty cell is NaN)."""
    rows = []
    for d in dirs:
        for r in tables.read_rows(Path(d) / "examples.csv"):
            rows.append({k: v if k in TEXT_COLUMNS else parse_value(v) if v != "" else math.nan for k, v in r.items()})
            for k in ("bypass_reason", "removed_chunks"):
                if k in rows[-1] and rows[-1][k] is None:
                    rows[-1][k] = ""
    return rows


def finch_table(rows: list[dict], lengths: list[int], variant: str) -> list[dict]:
    """Per length: Finch against the full prefill and ``variant`` on the examples all three ran (``finch.csv``)."""

    def mean(xs):
        return statistics.fmean(xs) if xs else math.nan

    out = []
    for length in lengths:
        by = {
            m: {r["id"]: r for r in rows if r["target_length"] == length and r["method"] == m}
            for m in ("full", variant, "finch")
        }
        ids = sorted(set(by["full"]) & set(by[variant]) & set(by["finch"]))
        if not ids:
            continue
        full, ep, fi = ([by[m][i] for i in ids] for m in ("full", variant, "finch"))
        out.append(
            {
                "target_length": length,
                "n": len(ids),
                "mean_finch_ratio": mean([r["finch_ratio"] for r in fi]),
                "time_ratio_finch": mean([r["prefill_s"] for r in fi]) / mean([r["prefill_s"] for r in full]),
                f"time_ratio_{variant}": mean([r["prefill_s"] for r in ep]) / mean([r["prefill_s"] for r in full]),
                "cpu_time_ratio_finch": mean([r["prefill_cpu_s"] for r in fi])
                / mean([r["prefill_cpu_s"] for r in full]),
                f"cpu_time_ratio_{variant}": mean([r["prefill_cpu_s"] for r in ep])
                / mean([r["prefill_cpu_s"] for r in full]),
                "acc_full": mean([r["score"] for r in full]),
                f"acc_{variant}": mean([r["score"] for r in ep]),
                "acc_finch": mean([r["score"] for r in fi]),
                "answer_value_kept": mean(
                    [r["answer_value_kept"] for r in fi if not math.isnan(r["answer_value_kept"])]
                ),
                f"answer_passage_kept_{variant}": 1 - mean([r["answer_removed"] for r in ep]),
            }
        )
    return out


class FinchRunner:
    """kvpress's ``FinchPress`` on a model copy of its own with its delimiter token (the ``--finch`` method)."""

    def __init__(self, args):
        from kvpress import FinchPress, KVPressTextGenerationPipeline

        from evaluation.models import load_model
        from evaluation.registry import install_delimiter

        self.args = args
        self.model, self.tok = load_model(args.model, device=args.device)
        self.setup = FinchPress()
        self.token = install_delimiter(self.setup, self.model, self.tok, args.seed)
        self.pipe = KVPressTextGenerationPipeline(
            model=self.model, tokenizer=self.tok, device=torch.device(args.device)
        )

    def run(self, ex, ratio: float):
        """Prefill ``ex`` (question inside, the delimiter before its question part) under ``FinchPress(ratio)``,
        ``ratio`` clamped to ``[0, 0.99]``, then decode as kvpress's pipeline does (from the cache's length: Finch
        re-rotates the kept keys). Returns ``(answer, seconds, cpu_seconds, cache, row fields)``."""
        from kvpress import FinchPress
        from kvpress.utils import compute_n_kept
        from transformers import DynamicCache

        from evaluation.prompt_delimiter import delimited

        ratio = min(max(ratio, 0.0), 0.99)
        context = delimited(ex, self.token, "finch").context
        inputs = self.pipe.preprocess(context, [ex.question], ex.answer_prefix, int(1e10))
        ids = inputs["context_ids"].to(self.args.device)
        plain = ids[0][ids[0] != self.setup.delimiter_token_id]  # the positions Finch scores
        press = FinchPress(compression_ratio=ratio)
        press.delimiter_token, press.delimiter_token_id = self.setup.delimiter_token, self.setup.delimiter_token_id
        scores: dict[int, torch.Tensor] = {}
        score = press.score

        def recording(module, *a, **k):
            scores[module.layer_idx] = out = score(module, *a, **k)
            return out

        press.score = recording  # compress calls self.score: its selection is the top-k of these
        cache = DynamicCache()
        with torch.inference_mode():
            start, cpu = time.perf_counter(), time.process_time()
            with press(self.model):
                self.model.model(input_ids=ids, past_key_values=cache)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            q_ids = inputs["questions_ids"][0].to(self.args.device)
            answer = self.pipe.generate_answer(
                q_ids, cache, cache.get_seq_length(), ex.max_new_tokens or self.args.max_new_tokens
            )
        value = answer_positions(plain, self.tok.encode(ex.answers[0], add_special_tokens=False))
        value = value or answer_positions(plain, self.tok.encode(" " + ex.answers[0], add_special_tokens=False))
        kept = []
        for s in scores.values():  # (1, G, T) per layer
            top = s.topk(compute_n_kept(s.shape[-1], ratio), dim=-1).indices
            mask = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
            kept.append(mask[..., value].all(-1).float().mean().item() if value else math.nan)
        if ratio == 0:  # Finch neither scores nor evicts at ratio 0: every token kept
            value_kept = 1.0
        else:
            value_kept = statistics.fmean(kept) if kept else math.nan
        return answer, seconds, cpu_seconds, cache, {"finch_ratio": ratio, "answer_value_kept": value_kept}


def answer_positions(ids: torch.Tensor, answer_ids: list[int]) -> list[int]:
    """The positions of the last occurrence of ``answer_ids`` in ``ids`` (``(T,)``), or ``[]`` when absent."""
    n, seq = len(answer_ids), ids.tolist()
    for i in range(len(seq) - n, -1, -1):
        if n and seq[i : i + n] == answer_ids:
            return list(range(i, i + n))
    return []


def write_tables(
    rows: list[dict], args, variants: list[str], out: Path, seconds: float, argv, echo: bool = True
) -> None:
    """``summary.csv``, ``survival.csv`` and ``README.md`` from the per-example rows (see the module docstring)."""

    def mean(xs):
        return statistics.fmean(xs) if xs else math.nan

    summary, survival = [], []
    for length, variant in ((ln, v) for ln in args.lengths for v in variants):
        full = [r for r in rows if r["target_length"] == length and r["method"] == "full"]
        ep_rows = [r for r in rows if r["target_length"] == length and r["method"] == variant]
        if not ep_rows:
            continue
        pruned = [r for r in ep_rows if not r["bypass_reason"]]
        scanned = [r for r in ep_rows if isinstance(r["U_l"], float) and math.isfinite(r["U_l"])]
        first = [r for r in pruned if r["answer_passage"] <= r["n_passages"] / 2]
        second = [r for r in pruned if r["answer_passage"] > r["n_passages"] / 2]
        full_s, ep_s = mean([r["prefill_s"] for r in full]), mean([r["prefill_s"] for r in ep_rows])
        full_c, ep_c = mean([r["prefill_cpu_s"] for r in full]), mean([r["prefill_cpu_s"] for r in ep_rows])
        ranks = [
            r["answer_rank"]
            for r in ep_rows
            if isinstance(r.get("answer_rank"), float) and not math.isnan(r["answer_rank"])
        ]
        corr = [
            r["priority_index_spearman"]
            for r in ep_rows
            if isinstance(r.get("priority_index_spearman"), float) and not math.isnan(r["priority_index_spearman"])
        ]
        summary.append(
            {
                "target_length": length,
                "variant": variant,
                "n": len(ep_rows),
                "mean_T": mean([r["T"] for r in ep_rows]),
                "full_prefill_s": full_s,
                "entroprefill_prefill_s": ep_s,
                "time_ratio": ep_s / full_s if full else math.nan,
                "full_prefill_cpu_s": full_c,
                "entroprefill_prefill_cpu_s": ep_c,
                "cpu_time_ratio": ep_c / full_c if full else math.nan,
                "acc_full": mean([r["score"] for r in full]),
                "acc_entroprefill": mean([r["score"] for r in ep_rows]),
                "bypass_freq": 1 - len(pruned) / len(ep_rows),
                "mean_T_prime_over_T": mean([r["T_prime"] / r["T"] for r in ep_rows]),
                "answer_removed_freq": mean([r["answer_removed"] for r in pruned]),
                "survival_first_half": 1 - mean([r["answer_removed"] for r in first]),
                "n_first_half": len(first),
                "survival_second_half": 1 - mean([r["answer_removed"] for r in second]),
                "n_second_half": len(second),
                "mean_answer_rank": mean(ranks),
                "mean_priority_index_spearman": mean(corr),
                "mean_accepted_layer": mean([r["accepted_layer"] for r in pruned]),
                "mean_D_l": mean([r["D_l"] for r in scanned]),
                "mean_U_l": mean([r["U_l"] for r in scanned]),
                "mean_target": mean([r["target_saving"] for r in ep_rows]),
                "mean_analytic_saving": mean([r["analytic_saving"] for r in ep_rows]),
                "bypass_reasons": ";".join(sorted({r["bypass_reason"] for r in ep_rows if r["bypass_reason"]})),
            }
        )
        for lo in (0, 25, 50, 75):
            part = [r for r in pruned if lo <= r["depth"] < lo + 25 or (lo == 75 and r["depth"] == 100)]
            survival.append(
                {
                    "target_length": length,
                    "variant": variant,
                    "depth": f"[{lo}, {lo + 25}{']' if lo == 75 else ')'}",
                    "n_pruned": len(part),
                    "answer_survival": 1 - mean([r["answer_removed"] for r in part]),
                    "acc_entroprefill": mean([r["score"] for r in part]),
                }
            )
    finch = finch_table(rows, args.lengths, variants[0]) if any(r["method"] == "finch" for r in rows) else []
    for name, table in (("summary.csv", summary), ("survival.csv", survival), ("finch.csv", finch)):
        if table:
            tables.write_rows(out / name, table, list(table[0]))
    cmd = tables.command("entroprefill_bench", argv if argv is not None else sys.argv[1:])

    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    def md(table):
        return tables.markdown_table(list(table[0]), [[fmt(s[c]) for c in table[0]] for s in table])

    specs = "; ".join(f"`{' '.join(v)}`" for v in (args.variant or [["entroprefill"]]))
    lines = [
        f"# EntroPrefill vs full prefill ({args.dataset}, query-aware)",
        "",
        f"Model `{args.model}` on `{args.device}` ({args.threads or torch.get_num_threads()} torch threads), seed "
        f"{args.seed}, compression_ratio (token-saving target as a fraction of document tokens) = "
        f"{args.compression_ratio}, press overrides for every variant: `{' '.join(args.press) or 'none'}`, "
        f"variants: {specs}"
        + (f", distractor_facts={args.distractor_facts}" if args.dataset == "keyfacts" else "")
        + (", passages REVERSED" if args.reverse_passages else "")
        + (", scores RoPE-free (diagnostic)" if args.scores == "rope_free" else "")
        + (", EntroPrefill only (no full prefill)" if args.skip_full else "")
        + ".",
        "",
        "Times: the prefill call only, every method on the same example in the same process (order alternating). "
        "`time_ratio`: mean EntroPrefill wall time / mean full wall time (bypassed examples included); "
        "`cpu_time_ratio`: the same with process CPU time, the figure to read on a shared machine (wall time "
        "includes waiting for the cores). `answer_removed_freq` and `survival_*`: among pruned (not bypassed) "
        "examples; `mean_answer_rank`: the answer passage's rank among the chunks by priority S_i (0 = kept "
        "first, 1 = removed first) at the accepted or last scanned layer; `mean_priority_index_spearman`: "
        "Spearman correlation of S_i with the chunk index (> 0: later passages rank higher). `mean_D_l` / "
        "`mean_U_l`: greedy saving and dual bound; `mean_analytic_saving`: paper 001 eq. 32 (0 when bypassed).",
        "",
        *md(summary),
        "",
        "Answer-passage survival among pruned examples, by the answer passage's depth (percent of the passage list):",
        "",
        *md(survival),
        "",
        *(
            [
                f"kvpress's FinchPress at {variants[0]}'s kept fraction of each example (`finch_ratio` = 1 - T'/T; "
                "Finch ran after the other methods on a model copy with its delimiter token). `time_ratio`: mean "
                "Finch prefill wall time / mean full; `answer_value_kept`: the fraction of (layer, KV head) pairs "
                f"keeping every token of the answer value; `answer_passage_kept_{variants[0]}`: 1 - its "
                "answer-passage removal, every example counted (a bypass keeps it).",
                "",
                *md(finch),
                "",
            ]
            if finch
            else []
        ),
        f"Command: `{cmd}`",
        "",
        f"Wall time: {seconds:.0f} s. Per-example rows: `examples.csv`.",
        "",
    ]
    write_atomic(out / "README.md", "\n".join(lines))
    if echo:
        print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
