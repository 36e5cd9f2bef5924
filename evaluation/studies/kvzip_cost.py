"""Seconds per example of KVzip on the embedded model, one thread: what ``evaluation.run`` pays per ratio against
what ``evaluation.fused`` pays for several ratios and both variants (one reconstruction pass,
``evaluation.kvzip_path``), and the same for Page-EntroKV with reconstruction observers
(``page_entrokv_reconstruction``, docs/methods.md §1.16), alone and sharing KVzip's pass.

Usage::

    python -m evaluation.studies.kvzip_cost [n_examples=2] [context_length=2048] [output=results/kvzip_cost]
    python scripts/kvzip_cost.py ...            # the same

Per needle example (question after the context), each measured in this process with one torch thread, as CPU
seconds of the calling thread (``time.thread_time``: what the work costs, whatever else the machine runs) and wall
seconds:

- ``prefill``: the uncompressed prefill alone (``model.model``);
- ``run kvzip@r``: kvpress's pipeline with ``KVzipPress(r)``, prefill, reconstruction, selection and decode, as
  ``evaluation.run`` runs it, once per ratio;
- ``run page_entrokv_reconstruction@r``: the same with ``PageEntroKVReconstructionPress(r)`` (its own pass);
- ``fused ...``: one recorded prefill, :func:`evaluation.kvzip_path.selected_runs` (one pass, a selection per run)
  and each run's decode with its masks, as ``evaluation.fused`` runs them.

The fused predictions of KVzip and of the reconstruction press are checked against the pipeline's (they must be
equal). Writes ``<output>/README.md``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

RATIOS = (0.25, 0.5, 0.75)


class _Run:
    def __init__(self, press, name: str):
        self.press, self.name = press, name


def _timed(fn):
    cpu, wall = time.thread_time(), time.perf_counter()
    out = fn()
    return out, time.thread_time() - cpu, time.perf_counter() - wall


def main(n_examples: int = 2, context_length: int = 2048, output: str = "results/kvzip_cost") -> None:
    import torch
    from hydra.utils import instantiate
    from kvpress import KVzipPress
    from transformers import DynamicCache

    from evaluation import harness, kvzip_path
    from evaluation.loop import tokenise
    from evaluation.models import load_model
    from evaluation.pipeline import TextGenerationPipeline
    from evaluation.replay import PrefillCapture, generate_answers
    from presses import PageEntroKVReconstructionPress

    build = {
        "kvzip": lambda r: KVzipPress(compression_ratio=r),
        "kvzip_plus": lambda r: KVzipPress(compression_ratio=r, kvzip_plus_normalization=True),
        "page_entrokv_reconstruction": lambda r: PageEntroKVReconstructionPress(compression_ratio=r),
    }
    alone_too = ("kvzip", "page_entrokv_reconstruction")  # also run through the pipeline, the fused runs' reference

    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    cfg = harness.compose_config(["dataset=needle", f"dataset.context_length={context_length}"])
    examples = instantiate(cfg.dataset).examples(tok, n_examples, 42, False)
    rows: dict[str, list] = {}
    mismatches = []

    def add(name, cpu, wall):
        rows.setdefault(name, []).append((cpu, wall))

    for ex in examples:
        ids = tokenise(pipe, tok, ex)
        context_ids, question_ids = ids["context_ids"], ids["questions_ids"][0]
        T, max_new = context_ids.shape[1], ex.max_new_tokens or 32
        with torch.inference_mode():
            _, cpu, wall = _timed(lambda: model.model(input_ids=context_ids, past_key_values=DynamicCache()))
            add("prefill (no_press)", cpu, wall)
            alone = {}
            for name in alone_too:
                for ratio in RATIOS:
                    press = build[name](ratio)
                    answer, cpu, wall = _timed(
                        lambda p=press: pipe(
                            ex.context,
                            question=ex.question,
                            answer_prefix=ex.answer_prefix,
                            press=p,
                            max_new_tokens=max_new,
                        )["answer"]
                    )
                    alone[(name, ratio)] = answer
                    add(f"run {name}@{ratio:g} (prefill + pass + decode)", cpu, wall)
            for names in (
                ("kvzip",),
                ("kvzip", "kvzip_plus"),
                ("page_entrokv_reconstruction",),
                ("kvzip", "page_entrokv_reconstruction"),
            ):
                label, runs = " + ".join(names), [_Run(build[n](r), n) for n in names for r in RATIOS]

                def fused(runs=runs):
                    answers = []
                    with PrefillCapture(model) as capture:
                        model.model(input_ids=context_ids, past_key_values=DynamicCache())
                    for _, cache, _, masks, _ in kvzip_path.selected_runs(runs, model, capture, context_ids):
                        with kvzip_path.masked_keys(model, masks):
                            answers += generate_answers(pipe, question_ids, [cache], T, max_new)
                    return answers

                answers, cpu, wall = _timed(fused)
                add(f"fused {label}, {len(RATIOS)} ratios ({len(runs)} runs)", cpu, wall)
                for run, answer in zip(runs, answers):
                    expected = alone.get((run.name, run.press.compression_ratio))
                    if run.name in alone_too and answer != expected:
                        mismatches.append((ex.id, run.name, run.press.compression_ratio, answer, expected))
        print(ex.id, {k: round(v[-1][0], 1) for k, v in rows.items()}, flush=True)

    prefill_cpu = statistics.mean(c for c, _ in rows["prefill (no_press)"])
    lines = [
        "# KVzip's cost on the embedded model, and Page-EntroKV's with reconstruction observers (one thread)",
        "",
        f"Command: `python scripts/kvzip_cost.py {n_examples} {context_length} {output}` (torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread). Needle examples of {context_length} tokens, "
        f"question after the context; mean over {len(examples)} examples. CPU: seconds of the calling thread "
        "(`time.thread_time`), wall: elapsed (the machine is shared, so wall time varies with its load).",
        "",
        "| what | CPU s / example | x prefill | wall s / example |",
        "| --- | --- | --- | --- |",
    ]
    for name, values in rows.items():
        cpu, wall = statistics.mean(c for c, _ in values), statistics.mean(w for _, w in values)
        lines.append(f"| {name} | {cpu:.1f} | {cpu / prefill_cpu:.1f} | {wall:.1f} |")
    lines += [
        "",
        "Fused predictions equal the pipeline's for every kvzip and page_entrokv_reconstruction run: "
        + ("yes" if not mismatches else f"NO, {len(mismatches)} differ: {mismatches}"),
        "",
    ]
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    harness.write_atomic(out / "README.md", "\n".join(lines))
    print("\n".join(lines))


def example_cli(prog: str, description: str, main, argv: list[str] | None = None) -> None:
    """``[n_examples] [context_length] [output]`` from the command line into ``main`` (its defaults where left out;
    a fourth argument is refused, :class:`evaluation.cli.ArgumentParser`): the cost studies' command line."""
    from evaluation.cli import ArgumentParser

    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("n_examples", type=int, nargs="?", help="examples (default: main's)")
    parser.add_argument("context_length", type=int, nargs="?", help="needle context tokens (default: main's)")
    parser.add_argument("output", nargs="?", help="output directory (default: main's)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    main(**{k: v for k, v in vars(args).items() if v is not None})


def cli(argv: list[str] | None = None) -> None:
    """This study's command line (:func:`example_cli`)."""
    example_cli("python -m evaluation.studies.kvzip_cost", __doc__.split("\n")[0], main, argv)


if __name__ == "__main__":
    cli()
