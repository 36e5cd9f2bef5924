"""Does a press keep an answer that straddles a page boundary? Committed runs, read against the page grid.

A page press keeps whole pages ``[kB, (k+1)B)`` of the prefilled cache (``B = page_size``, docs/methods.md §1); an
answer whose tokens fall on two pages is kept whole only if both pages are. For every example of the committed runs
of a dataset at one ratio, this study rebuilds the example exactly as the runs did (the run's saved settings: seed,
``n_samples``, shard, protocol), tokenises it as kvpress's pipeline does (chat template included), finds the answer's
context tokens (:func:`evaluation.studies.snis_needle_coverage.answer_positions`) and says whether they straddle a
page boundary; then it reads each press's score on that example from its ``predictions.jsonl``. Nothing is run
through the model: the scores are the committed ones. Only an example's first answer is placed, so a task with one
answer per example (needle, RULER's ``niah_single_*``) is what it reads; ``--tasks`` picks them.

Usage (``python -m evaluation.studies.page_straddle`` is the same)::

    python scripts/page_straddle.py results/ruler-qa/smollm2-135m --ratio 0.9 \\
        --presses kvzip page_entrokv_mean [--tasks niah_single_1 niah_single_2 niah_single_3] [--page-size 32] \\
        [--out results/page_straddle] [--name ruler-qa_0.9]

Writes ``<out>/<name>.csv`` (one row per example: task, answer tokens, straddle, each press's score) and
``<out>/<name>.md`` (per task and straddle: examples and each press's mean score; the command), atomically.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from evaluation import tables
from evaluation.studies import committed

__all__ = ["straddles", "main"]


def straddles(positions: list[int], page_size: int) -> bool:
    """Whether the token positions ``positions`` (ascending, non-empty) fall on more than one page of
    ``page_size`` positions (page ``k`` holds ``[k * page_size, (k + 1) * page_size)``).

    Raises:
        ValueError: for no positions or ``page_size < 1``.
    """
    if not positions:
        raise ValueError("positions is empty: the answer has no token in the context")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    return positions[0] // page_size != positions[-1] // page_size


def main(argv: list[str] | None = None) -> int:
    parser = committed.parser(__doc__.split("\n")[0], "results/page_straddle")
    parser.add_argument("--page-size", type=int, default=None, help="default: PageEntroKVPress's page_size")
    args = parser.parse_args(argv)

    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from evaluation import harness
    from evaluation.loop import tokenise
    from evaluation.models import load_model
    from evaluation.pipeline import TextGenerationPipeline
    from evaluation.studies.snis_needle_coverage import answer_positions
    from presses import PageEntroKVPress

    page_size = args.page_size or PageEntroKVPress().page_size
    scores: dict[str, dict[str, float]] = {}
    configs = {}  # one per distinct example set (dataset, n_samples, seed, shard, protocol)
    for press in args.presses:
        scores[press] = {}
        for run in committed.run_dirs(args.runs, press, args.ratio):
            cfg = OmegaConf.load(run / "config.yaml")
            key = (OmegaConf.to_yaml(cfg.dataset), cfg.n_samples, cfg.seed, cfg.get("shard"), cfg.query_aware)
            configs.setdefault(key, cfg)
            scores[press].update(
                {row["id"]: row["score"] for row in harness.read_predictions(run / "predictions.jsonl")}
            )
    first = next(iter(configs.values()))
    model, tok = load_model(first.model.name, path=first.model.path)
    pipe = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))

    rows, seen = [], set()
    for cfg in configs.values():  # every shard's examples, as the runs built them
        for ex in harness.run_examples(cfg, instantiate(cfg.dataset), tok):
            if ex.id in seen or (args.tasks and ex.task not in args.tasks):
                continue
            seen.add(ex.id)
            positions = answer_positions(tok, tokenise(pipe, tok, ex)["context_ids"], ex.answers[0])
            row = {"id": ex.id, "task": ex.task, "answer_tokens": len(positions)}
            row["straddles"] = straddles(positions, page_size)
            row.update({press: scores[press].get(ex.id) for press in args.presses})
            rows.append(row)
    rows.sort(key=lambda r: (r["task"], r["id"]))

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["straddles"])].append(row)
    header = ["task", "answer tokens", "straddles a page", "n", *args.presses]
    body = []
    for (task, straddle), members in sorted(groups.items()):
        lengths = sorted({r["answer_tokens"] for r in members})
        cells = []
        for press in args.presses:
            got = [r[press] for r in members if r[press] is not None]
            cells.append(f"{sum(got) / len(got):.3f}" if got else "–")
        span = f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"
        body.append([task, span, "yes" if straddle else "no", str(len(members)), *cells])
    tables.write_study(
        args.out,
        committed.name(args),
        rows,
        f"Answers on the page grid: {args.runs} at ratio {args.ratio:g}, pages of {page_size}",
        "page_straddle",
        sys.argv[1:] if argv is None else argv,
        "Mean committed score per press, by task and by whether the answer's context tokens fall on two pages.",
        header,
        body,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
