"""Build the benchmark report from run directories: tables, win scores, plots and ``results/README.md``.

Usage::

    python -m evaluation.report RESULTS_DIR [--out results/] [--confidence 0.95] [--no-plots]
        [--costs SPEED_CSV | --own-costs]

Reads every run below ``RESULTS_DIR`` laid out by ``evaluation.run``
(``<dataset>/<model>/<press>/cr<ratio>/predictions.jsonl``, or a finished run's ``predictions.jsonl.gz``; shards in
``cr<ratio>/shard_<i>_of_<n>/``, whose predictions are merged and de-duplicated by example id:
:func:`evaluation.runs.scan`) and writes under ``--out``:

* ``tables/<dataset>__<model>__summary.csv``: per press and ratio, the mean score over all examples with its
  interval (Wilson when every score is 0/1, Student t otherwise), the split-size-weighted average of paper 003
  section 7 (``sum_t n_t / N * mean_t``, equal to the mean over examples), the task-average and the mean
  effective compression;
* ``tables/<dataset>__<model>__per_task.csv``, and ``__by_length.csv`` / ``__by_depth.csv`` when the rows carry
  2 to 12 distinct target lengths (``metadata.context_length``) or needle depths (``depth``), each group with
  its mean score and its own win score (:func:`group_win_table`);
* ``tables/<dataset>__<model>__by_length_range.csv`` for LongBench-E rows (``metadata.longbench_e``): the official
  LongBench-E breakdown by each row's ``length`` into 0-4k, 4-8k and 8k+ (:func:`length_range_table`);
* ``tables/<dataset>__<model>__win.csv``: win score (paper 003 section 7) per press and ratio, over the
  presses run at that ratio (the uncompressed ``no_press`` baseline is left out), on the examples every one of
  them scored;
* ``plots/<dataset>__<model>__{score,win,tasks}.png``: score vs ratio, win score vs ratio, per-task panels, and
  ``__loss.png`` (NLL increase and KL vs ratio) for continuation rows; bars (one per press) when the presses were
  run at one ratio; at most ten presses in colour per panel (:data:`evaluation.plotting.MAX_LINES`);
* with ``--costs <speed sweep csv>``: ``tables/<dataset>__<model>__cost.csv`` and ``plots/...__cost.png``, each
  press's score against its prefill cost per ratio, and which presses lie on the quality-cost frontier
  (:mod:`evaluation.frontier`); with ``--own-costs`` the same from the runs' own timings (the shared prefill and
  each press's replay that ``python -m evaluation.fused`` rows record), as ``make eval`` does;
* for the shared-context protocol's rows (:mod:`evaluation.shared`, several questions per context):
  ``tables/<dataset>__<model>__by_question.csv``, the score per question position, and ``__cost_per_answer.csv``,
  the cost per answered question with the context's compression paid once over k = 1 and k = K answers, and each
  ratio's frontier, and ``__question_drop.csv``, the first question's score minus the later ones', context by
  context, with its interval (:mod:`evaluation.shared_report`);
* ``tables/<dataset>__<model>__continuation.csv`` for rows scored by the loss of the text after the context
  (:mod:`evaluation.continuation`): per press, ratio, task (``all`` too) and, when the rows carry 2 to 12 target
  lengths, per length (``all`` too), the mean NLL increase over the uncompressed context and the mean KL of the
  next-token distributions, each with its Student-t interval (:func:`continuation_table`);
* ``README.md`` linking all of it, with the commands that produced the runs (``metrics.json``'s ``command``, and
  for a run joined from pieces by :mod:`evaluation.merge_runs` its ``merged`` commands).

A run that another process is writing (it holds the run directory's lock, :func:`evaluation.harness.claim_runs`)
is listed as in progress, never as finished. Every file is written atomically (temporary file + ``os.replace``); files
of a previous report that this one
did not write are removed from ``tables/`` and ``plots/``. The output is regenerated, never hand-edited.
"""

from __future__ import annotations

import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from evaluation import shared_report
from evaluation.atomic import save_figure, write_atomic
from evaluation.cli import ArgumentParser
from evaluation.frontier import COST_COLUMN, cost_table, read_costs, run_costs
from evaluation.harness import (
    CONTINUATION_FIELDS,
    QA_SUFFIX,
    SHARED_SUFFIX,
    TURNS_SUFFIX,
)
from evaluation.metrics import score_interval, t_interval, win_scores
from evaluation.plotting import MAX_LINES, fit_title, legend_below, name_points, press_groups, press_styles
from evaluation.runs import Run, scan
from evaluation.tables import csv_text, markdown_table

BASELINE = "no_press"


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _label(press: str, ratio: float) -> str:
    return f"{press} @ {ratio:g}"


def _press_order(presses) -> list[str]:
    return sorted(set(presses), key=lambda p: (p != BASELINE, p))


def row_length(row: dict):
    """Target context length of a row, or None: ``metadata.target_length`` where the dataset writes one (needle,
    keyfacts, multidoc: their ``metadata.context_length`` counts the example's own tokens, which differ example by
    example), else ``metadata.context_length`` (RULER, stdlib_docs, continuation: the target itself)."""
    meta = row.get("metadata") or {}
    return meta.get("target_length", meta.get("context_length"))


def _row_depth(row: dict):
    """Needle depth of a row (percent), or None."""
    return row.get("depth")


#: The row groups a report breaks the scores down by, when the rows carry 2 to ``MAX_BREAKDOWN_COLUMNS`` of them:
#: ``(label, the row's group)``.
_BREAKDOWNS = (("length", row_length), ("depth", _row_depth))


MAX_BREAKDOWN_COLUMNS = 12
"""A per-length or per-depth table is written when it has 2 to this many distinct values."""


def _breaks_down(groups: set) -> bool:
    """Whether rows of these distinct ``groups`` (lengths, depths) get a breakdown: 2 to ``MAX_BREAKDOWN_COLUMNS``."""
    return 1 < len(groups) <= MAX_BREAKDOWN_COLUMNS


LENGTH_RANGES = (("0-4k", 4000), ("4-8k", 8000), ("8k+", math.inf))
"""LongBench-E's length ranges: a row of ``length`` L falls in the first range whose bound exceeds L (LongBench
``eval.py``, ``scorer_e``: ``length < 4000``, ``< 8000``, else ``8k+``; ``length`` is the row's word count)."""


def length_range(length) -> str:
    """The LongBench-E range (``0-4k``, ``4-8k``, ``8k+``) of a row's ``length``."""
    return next(name for name, bound in LENGTH_RANGES if float(length) < bound)


def length_range_table(runs: list[Run]) -> list[dict]:
    """LongBench-E scores by length range (LongBench ``eval.py``, ``scorer_e``), per run.

    Only rows with ``metadata.longbench_e`` and a ``metadata.length`` count. Per task and range: the mean score
    of its rows (the official per-task table); ``task="all"``: per range, the task average of those means
    (every task weighs the same, as LongBench-E's summary), over the tasks that have rows in the range.
    """
    out = []
    for run in runs:
        cells: dict[tuple[str, str], list[float]] = defaultdict(list)
        for r in run.rows:
            meta = r.get("metadata") or {}
            if meta.get("longbench_e") and meta.get("length") is not None:
                cells[(r.get("task") or run.dataset, length_range(meta["length"]))].append(float(r["score"]))
        if not cells:
            continue
        base = {"dataset": run.dataset, "model": run.model, "press": run.press, "ratio": run.ratio}
        for name, _ in LENGTH_RANGES:
            means = [sum(v) / len(v) for (task, rng), v in sorted(cells.items()) if rng == name]
            n = sum(len(v) for (task, rng), v in cells.items() if rng == name)
            if means:
                out.append({**base, "task": "all", "range": name, "n": n, "score": sum(means) / len(means)})
        for (task, name), vals in sorted(cells.items()):
            out.append({**base, "task": task, "range": name, "n": len(vals), "score": sum(vals) / len(vals)})
    return out


def summary_table(runs: list[Run], confidence: float) -> list[dict]:
    """One record per run: n, mean score and interval, weighted and task averages, effective compression."""
    out = []
    for run in runs:
        scores = [float(r["score"]) for r in run.rows]
        if not scores:
            continue
        mean, lo, hi, method = score_interval(scores, confidence)
        by_task: dict[str, list[float]] = defaultdict(list)
        for r in run.rows:
            by_task[r.get("task") or run.dataset].append(float(r["score"]))
        n = len(scores)
        weighted = sum(len(v) / n * (sum(v) / len(v)) for v in by_task.values())
        task_avg = sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
        eff = [r["effective_compression"] for r in run.rows if r.get("effective_compression") is not None]
        out.append(
            {
                "dataset": run.dataset,
                "model": run.model,
                "press": run.press,
                "ratio": run.ratio,
                "n": n,
                "score": mean,
                "low": lo,
                "high": hi,
                "interval": method,
                "weighted_average": weighted,
                "task_average": task_avg,
                "n_tasks": len(by_task),
                "effective_compression": sum(eff) / len(eff) if eff else math.nan,
                "complete": run.complete,
            }
        )
    return out


def per_task_table(runs: list[Run], key=lambda r: r.get("task")) -> list[dict]:
    """Mean score and count per run and group (task by default)."""
    out = []
    for run in runs:
        groups: dict = defaultdict(list)
        for r in run.rows:
            groups[key(r)].append(float(r["score"]))
        for group, vals in sorted(groups.items(), key=lambda kv: str(kv[0])):
            out.append(
                {
                    "dataset": run.dataset,
                    "model": run.model,
                    "press": run.press,
                    "ratio": run.ratio,
                    "group": group,
                    "n": len(vals),
                    "score": sum(vals) / len(vals),
                }
            )
    return out


def continuation_table(runs: list[Run], confidence: float) -> list[dict]:
    """Per run, context length and task: the mean NLL increase and mean KL of rows scored by their continuation's
    loss (:mod:`evaluation.continuation`, nats per token), each with its Student-t interval (not clipped: an
    increase can be negative), and the mean NLL with and without compression. Runs without such rows give none.

    ``task="all"`` pools the tasks and ``context_length="all"`` the lengths; when the runs' rows carry 2 to
    ``MAX_BREAKDOWN_COLUMNS`` distinct target lengths (:func:`row_length`), each length also gets its own records
    (a merged run of 2k and 4k documents reports each length as a run of that length alone would).
    """
    lengths = sorted({row_length(r) for run in runs for r in run.rows} - {None})
    lengths = lengths if _breaks_down(set(lengths)) else []
    out = []
    for run in runs:
        out += _continuation_records(run, "all", confidence)
        for length in lengths:
            out += _continuation_records(run.keep(lambda r, n=length: row_length(r) == n), length, confidence)
    return out


def _continuation_records(run: Run, length, confidence: float) -> list[dict]:
    """:func:`continuation_table`'s records of one run (already cut to one ``length``, or ``"all"``): per task and
    ``task="all"``."""
    rows = [r for r in run.rows if all(k in r for k in CONTINUATION_FIELDS)]
    tasks = sorted({r.get("task") or run.dataset for r in rows})
    out = []
    for task in ["all", *tasks] if rows else []:
        sel = [r for r in rows if task == "all" or (r.get("task") or run.dataset) == task]
        rec = {"dataset": run.dataset, "model": run.model, "press": run.press, "ratio": run.ratio}
        rec.update({"context_length": length, "task": task, "n": len(sel)})
        for key in ("nll_increase", "kl"):
            vals = [float(r[key]) for r in sel]
            lo, hi = t_interval(vals, confidence)
            rec.update({key: sum(vals) / len(vals), f"{key}_low": lo, f"{key}_high": hi})
        for key in ("nll", "nll_uncompressed"):
            rec[key] = sum(float(r[key]) for r in sel) / len(sel)
        out.append(rec)
    return out


def win_table(runs: list[Run], provisional: bool = False) -> list[dict]:
    """Win score of each press per ratio (paper 003 section 7), on examples all presses at that ratio scored.

    Runs of the ``no_press`` baseline are left out; a ratio with fewer than two presses is skipped.

    Args:
        runs: the runs of one dataset and model.
        provisional: ``False``: complete runs only (the table the report, the plots and the claims ledger
            read). ``True``: only the ratios where some run is incomplete, every run with rows counted, on
            the examples all of them hold so far (a sweep in progress; ``n_examples`` says how many).
    """
    by_ratio = _scored_by_ratio(runs, incomplete=provisional)
    if provisional:
        by_ratio = {ratio: group for ratio, group in by_ratio.items() if not all(run.complete for run in group)}
    return _wins_by_ratio(by_ratio)


def group_win_table(runs: list[Run], key) -> dict[tuple[str, float, object], float]:
    """Win score per (press, ratio, group), each group's rows ranked on their own: :func:`win_table` on the runs
    cut to the rows whose ``key`` (e.g. :func:`row_length`) is that group. A merged run of two context lengths
    thus still reports each length's win score, as a run of that length alone would have.

    Returns:
        ``{(press, ratio, group): win_score}``; a group where fewer than two complete presses share a ratio is
        absent.
    """
    groups = {key(r) for run in runs for r in run.rows} - {None}
    out = {}
    for group in groups:
        cut = [run.keep(lambda r, g=group: key(r) == g) for run in runs]
        for rec in win_table(cut):
            out[(rec["press"], rec["ratio"], group)] = rec["win_score"]
    return out


def _scored_by_ratio(runs: list[Run], incomplete: bool) -> dict[float, list[Run]]:
    """The runs a win score compares, by ratio: every run with rows but the ``no_press`` baseline; with
    ``incomplete=False`` only complete runs."""
    by_ratio: dict[float, list[Run]] = defaultdict(list)
    for run in runs:
        if run.press != BASELINE and run.rows and (run.complete or incomplete):
            by_ratio[run.ratio].append(run)
    return by_ratio


def _wins_by_ratio(by_ratio: dict[float, list[Run]]) -> list[dict]:
    """The rows of :func:`win_table` for runs already chosen and grouped by ratio; a ratio with fewer than two
    runs is skipped, and each ratio is scored on the examples all its runs hold."""
    out = []
    for ratio, group in sorted(by_ratio.items()):
        if len(group) < 2:
            continue
        scored = {
            run.press: {r["id"]: (r.get("task") or run.dataset, float(r["score"])) for r in run.rows} for run in group
        }
        common = set.intersection(*(set(s) for s in scored.values()))
        per_task: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for ex_id in sorted(common):
            for press, table in scored.items():
                task, score = table[ex_id]
                per_task[task][press].append(score)
        if not per_task:
            continue
        for press, value in win_scores(per_task).items():
            out.append(
                {
                    "dataset": group[0].dataset,
                    "model": group[0].model,
                    "press": press,
                    "ratio": ratio,
                    "win_score": value,
                    "n_examples": len(common),
                    "n_tasks": len(per_task),
                    "n_methods": len(group),
                }
            )
    return out


# --------------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------------


def protocol_table(after: list[Run], inside: list[Run], confidence: float) -> list[dict]:
    """The two protocols of one dataset and model side by side: one record per (press, ratio) run in both.

    ``after``: runs with the question asked after compression (``<dataset>/``); ``inside``: the question inside
    the compressed context (``<dataset>-qa/``). The win scores are recomputed among the presses present in both
    protocols at that ratio (so that the two columns compare the same set of presses), and every cell uses only
    the examples that every such run at that ratio holds in both protocols (so that a protocol still running,
    or a run with fewer examples, compares the same examples' contexts). A run still running (some shards
    missing) counts in the win scores too, on those examples, as it does in the scores.

    Returns:
        Records with ``press, ratio, n_after, score_after, low_after, high_after, n_inside, score_inside, ...,
        win_after, win_inside`` (``nan`` where a win score is undefined, e.g. ``no_press``).
    """
    both = {(r.press, r.ratio) for r in after} & {(r.press, r.ratio) for r in inside}
    common: dict[float, set] = {}  # per ratio: the examples every run at that ratio holds in both protocols
    for r in after + inside:
        if (r.press, r.ratio) in both:
            ids = {row["id"] for row in r.rows}
            common[r.ratio] = common[r.ratio] & ids if r.ratio in common else ids
    both = {(press, ratio) for press, ratio in both if common[ratio]}
    if not both:
        return []

    def keep(runs):
        return [r.keep(lambda row, ids=common[r.ratio]: row["id"] in ids) for r in runs if (r.press, r.ratio) in both]

    stats = {
        name: {(s["press"], s["ratio"]): s for s in summary_table(keep(runs), confidence)}
        for name, runs in (("after", after), ("inside", inside))
    }
    wins = {  # every kept run, complete or not: the examples are already the common ones
        name: {
            (w["press"], w["ratio"]): w["win_score"]
            for w in _wins_by_ratio(_scored_by_ratio(keep(runs), incomplete=True))
        }
        for name, runs in (("after", after), ("inside", inside))
    }
    out = []
    for press, ratio in sorted(both, key=lambda k: (k[1], k[0])):
        rec = {"dataset": after[0].dataset, "model": after[0].model, "press": press, "ratio": ratio}
        for name in ("after", "inside"):
            s = stats[name].get((press, ratio))
            if s is None:
                continue
            rec.update(
                {f"n_{name}": s["n"], f"score_{name}": s["score"], f"low_{name}": s["low"], f"high_{name}": s["high"]}
            )
        for name in ("after", "inside"):
            rec[f"win_{name}"] = wins[name].get((press, ratio), math.nan)
        out.append(rec)
    return out


def _csv(records: list[dict]) -> str:
    """CSV text of flat records, floats with 6 significant digits (:func:`evaluation.tables.csv_text`)."""
    return csv_text(records, float_spec=".6g")


def _markdown(header: list[str], rows: list[list]) -> str:
    """A Markdown table as one string (:func:`evaluation.tables.markdown_table`)."""
    return "\n".join(markdown_table(header, rows))


def _pivot(records: list[dict], row_key, col_key, cell, row_order=None, col_order=None):
    """(header columns, rows) of a press x something table from flat records."""
    cells = {(row_key(r), col_key(r)): cell(r) for r in records}
    rows_ = row_order or sorted({row_key(r) for r in records})
    cols = col_order or sorted({col_key(r) for r in records}, key=str)
    return cols, [[rk] + [cells.get((rk, c), "–") for c in cols] for rk in rows_]


def _press_by_ratio(records: list[dict], cell, row_order: list, col_order=None) -> str:
    """``records`` (rows with ``press`` and ``ratio``) as a Markdown press x ratio table, ``cell(record)`` per cell."""
    hdr, rows = _pivot(records, lambda r: r["press"], lambda r: r["ratio"], cell, row_order, col_order)
    return _markdown(["press"] + [f"cr {c:g}" for c in hdr], rows)


def _win_table_markdown(wins: list[dict], presses: list[str]) -> str:
    """The win scores (:func:`win_table`'s rows) as a press x ratio Markdown table, the baseline left out."""
    order = [p for p in presses if p != BASELINE]
    return _press_by_ratio(wins, lambda r: f"{r['win_score']:.3f}", order, sorted({r["ratio"] for r in wins}))


class _Writer:
    """Writes report files atomically and remembers them (to prune stale ones)."""

    def __init__(self, out: Path):
        self.out = out
        self.written: set[Path] = set()

    def text(self, rel: str, content: str) -> str:
        path = self.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, content)
        self.written.add(path.resolve())
        return rel

    def figure(self, rel: str, fig) -> str:
        path = self.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=100)
        self.written.add(path.resolve())
        return rel

    def prune(self) -> None:
        for sub in ("tables", "plots"):
            for path in (self.out / sub).glob("*"):
                if path.is_file() and path.resolve() not in self.written and path.suffix in (".csv", ".png"):
                    path.unlink()


def _one_ratio(records: list[dict]) -> float | None:
    """The compression ratio of ``records`` when the presses but the baseline were all run at one, else None."""
    ratios = {r["ratio"] for r in records if r["press"] != BASELINE}
    return next(iter(ratios)) if len(ratios) == 1 else None


def _plot_lines(
    ax, records: list[dict], value: str, presses: list[str], err: bool = False, shown: list[str] | None = None
) -> None:
    """``value`` of ``records`` (rows with ``press``, ``ratio``; ``low``/``high`` with ``err``) against the ratio,
    one line per press, the baseline a dashed line; at one ratio, one bar per press instead (a line at one x hid
    all but the top press).

    ``presses``: every press of the report, in order (each keeps one style, :func:`evaluation.plotting.press_styles`,
    in every plot drawn with the same list). ``shown``: the presses drawn in colour, in the styles of their own order
    (at most :data:`evaluation.plotting.MAX_LINES`); the others are thin grey lines under them with one legend entry.
    """
    if _one_ratio(records) is not None:
        _plot_bars(ax, records, value, presses, err)
        return
    styles = press_styles(presses if shown is None else shown, BASELINE)
    grey = [p for p in presses if p != BASELINE and p not in styles]
    for press in [*(p for p in presses if p not in grey), *grey]:  # the grey ones last in the legend, under in z
        pts = sorted((r["ratio"], r[value], r.get("low"), r.get("high")) for r in records if r["press"] == press)
        if not pts:
            continue
        if press == BASELINE:
            ax.axhline(pts[0][1], color="black", linestyle="--", linewidth=1, label=BASELINE)
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if press in grey:  # an errorbar without bars where the others have them: its legend entry comes after theirs
            label = f"{len(grey)} other presses" if press == grey[0] else None
            (ax.errorbar if err else ax.plot)(xs, ys, color="0.75", linewidth=0.8, zorder=1, label=label)
        elif err:
            # clipped at 0: an interval end can sit a rounding error inside the mean (matplotlib refuses < 0)
            yerr = [[max(0.0, y - p[2]) for y, p in zip(ys, pts)], [max(0.0, p[3] - y) for y, p in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=yerr, capsize=3, label=press, markersize=5, **styles[press])
        else:
            ax.plot(xs, ys, label=press, markersize=5, **styles[press])
    ax.set_xlabel("compression ratio")
    ax.grid(alpha=0.3)


def _plot_bars(ax, records: list[dict], value: str, presses: list[str], err: bool = False) -> None:
    """:func:`_plot_lines` at one ratio: one bar per press, named below it, with its interval (``err``); the baseline
    a dashed line across."""
    styles = press_styles(presses, BASELINE)
    names, heights, errors = [], [], []
    for press in presses:
        found = [r for r in records if r["press"] == press]
        if not found:
            continue
        r = found[0]
        if press == BASELINE:
            ax.axhline(r[value], color="black", linestyle="--", linewidth=1, label=BASELINE)
            continue
        names.append(press)
        heights.append(r[value])
        # clipped at 0: an interval end can sit a rounding error inside the mean (matplotlib refuses < 0)
        errors.append((max(0.0, r[value] - r["low"]), max(0.0, r["high"] - r[value])) if err else (0.0, 0.0))
    xs = list(range(len(names)))
    bars = ax.bar(
        xs,
        heights,
        yerr=list(zip(*errors)) if err and names else None,
        capsize=3,
        color=[styles[p]["color"] for p in names],
    )
    for x, bar in zip(xs, bars):  # each value written in its bar, right of the interval's line (a zero bar too)
        ax.annotate(
            f"{bar.get_height():.2f}",
            (x + 0.08, bar.get_height() / 2),
            xytext=(0, 0 if bar.get_height() else 3),
            textcoords="offset points",
            ha="left",
            va="center" if bar.get_height() else "bottom",
            fontsize=7,
        )
    ax.set_xticks(xs, names, rotation=45 if len(names) <= 12 else 90, ha="right", fontsize=7)
    ax.set_xlabel(f"press (compression ratio {_one_ratio(records):g})")
    ax.grid(alpha=0.3, axis="y")


def _leading(records: list[dict], value: str, presses: list[str], lower: bool = False) -> list[str] | None:
    """The :data:`evaluation.plotting.MAX_LINES` presses (the baseline apart) of best mean ``value`` over their
    ratios, in the order of ``presses`` (``lower``: the lowest are best); None when every press fits."""
    others = [p for p in presses if p != BASELINE]
    if len(others) <= MAX_LINES:
        return None
    means = {}
    for p in others:
        vals = [r[value] for r in records if r["press"] == p]
        if vals:
            means[p] = sum(vals) / len(vals)
    best = sorted(means, key=lambda p: means[p] if lower else -means[p])[:MAX_LINES]
    return [p for p in others if p in best]


def _loss_lengths(losses: list[dict]) -> list:
    """The context lengths :func:`continuation_table` broke ``losses`` down by, then ``"all"`` (alone when none)."""
    return sorted({r["context_length"] for r in losses} - {"all"}) + ["all"]


def _length_caption(length, lengths: list) -> str:
    """`` at 4096 tokens`` / `` over all lengths`` beside a loss table or panel; empty with one length."""
    if len(lengths) == 1:
        return ""
    return " over all lengths" if length == "all" else f" at {length} tokens"


def _loss_figure(w: _Writer, stem: str, title: str, losses: list[dict], presses: list[str]) -> str:
    """``plots/<stem>__loss.png``: the NLL increase and the KL against the ratio, per press, with intervals; a row of
    panels per context length when the losses are broken down by length, the pooled row last; one legend below.
    Past :data:`evaluation.plotting.MAX_LINES` presses, those of the lowest mean KL are drawn in colour, the rest
    grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = _loss_lengths(losses)
    shown = _leading([r for r in losses if r["context_length"] == "all" and r["task"] == "all"], "kl", presses, True)
    fig, axes = plt.subplots(len(lengths), 2, figsize=(10, 4 * len(lengths)), layout="constrained", squeeze=False)
    for row, length in zip(axes, lengths):
        for ax, key, label in zip(row, ("nll_increase", "kl"), ("NLL increase (nats/token)", "KL (nats/token)")):
            recs = [
                {
                    "press": r["press"],
                    "ratio": r["ratio"],
                    key: r[key],
                    "low": r[f"{key}_low"],
                    "high": r[f"{key}_high"],
                }
                for r in losses
                if r["task"] == "all" and r["context_length"] == length
            ]
            _plot_lines(ax, recs, key, presses, err=True, shown=shown)
            ax.set_ylabel(label)
            ax.set_title(f"{label.split(' (')[0]}{_length_caption(length, lengths)}")
    fig.suptitle(fit_title(title, fig.get_figwidth()))
    legend_below(fig, axes[0][0])
    return w.figure(f"plots/{stem}__loss.png", fig)


def _figures(
    w: _Writer, stem: str, title: str, summary: list[dict], wins: list[dict], tasks: list[dict], presses: list[str]
) -> dict[str, str]:
    """The score, win-score and per-task plots (``plots/<stem>__{score,win,tasks}.png``); returns their paths by kind.

    At one ratio each draws bars (:func:`_plot_lines`). Past :data:`evaluation.plotting.MAX_LINES` presses the score
    and win plots split the presses into panels of at most that many, one above the other, each with its legend
    (:func:`evaluation.plotting.press_groups`), and the per-task plot draws the presses of the best mean score in
    colour, the rest grey.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = {}
    for kind, records, value, label in (
        ("score", summary, "score", "score (95% interval)"),
        ("win", wins, "win_score", "win score"),
    ):
        if not records:
            continue
        groups = [None] if _one_ratio(records) is not None else press_groups(presses, BASELINE)
        fig, axes = plt.subplots(
            len(groups),
            1,
            figsize=(7, 4 if len(groups) == 1 else 3.2 * len(groups)),
            squeeze=False,
            sharex=True,
            sharey=True,
            layout="constrained",
        )
        for ax, group in zip(axes.flat, groups):
            split = len(groups) > 1  # each panel its presses (and the baseline), in the styles of their own order
            cut = [r for r in records if r["press"] in (BASELINE, *group)] if split else records
            _plot_lines(ax, cut, value, presses, err=kind == "score", shown=group if split else None)
            ax.set_ylabel(label)
            if kind == "win":
                ax.set_ylim(-0.02, 1.02)
            if split:
                ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
        for ax in axes.flat[:-1]:  # the panels share their x axis: named once, below the last
            ax.set_xlabel("")
        head = title if kind == "score" else f"{title}: win score"
        if len(groups) > 1:
            count = sum(len(g) for g in groups)
            fig.suptitle(fit_title(f"{head} ({count} presses in {len(groups)} panels)", 7))
        else:
            axes[0][0].set_title(fit_title(head, 7))
            legend_below(fig, axes[0][0])
        links[kind] = w.figure(f"plots/{stem}__{kind}.png", fig)
    names = sorted({r["group"] for r in tasks}, key=str)
    if names:
        shown = _leading(summary, "score", presses)
        ncols = min(4, len(names))
        nrows = math.ceil(len(names) / ncols)
        fig, axes = plt.subplots(
            nrows,
            ncols,
            figsize=(max(3.2 * ncols, 7), 2.6 * nrows + 0.6),  # 7 inches at least: the legend's columns
            squeeze=False,
            sharey=True,
            layout="constrained",
        )
        for ax, name in zip(axes.flat, names):
            _plot_lines(ax, [r for r in tasks if r["group"] == name], "score", presses, shown=shown)
            ax.set_title(str(name), fontsize=9)
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        legend_below(fig, axes.flat[0])
        fig.suptitle(fit_title(f"{title}: per task", fig.get_figwidth()))
        links["tasks"] = w.figure(f"plots/{stem}__tasks.png", fig)
    return links


def _plain_number(value: float, _position) -> str:
    """A tick label without an exponent: ``2``, ``0.5``, ``10``."""
    return f"{value:g}"


def _cost_figure(w: _Writer, stem: str, title: str, costed: list[dict], presses: list[str]) -> str:
    """Score against prefill cost, one panel per ratio, the frontier joined and its presses named on the panel, every
    press in the legend below (:func:`evaluation.frontier.cost_table`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    styles = press_styles(presses, BASELINE)
    ratios = sorted({r["ratio"] for r in costed})
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios), 4), squeeze=False, layout="constrained")
    for ax, ratio in zip(axes.flat, ratios):
        rows = [r for r in costed if r["ratio"] == ratio]
        for r in rows:
            if r["press"] == BASELINE:
                ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label=BASELINE)
            elif r["prefill_cost"] is not None:
                size = 40 if r["on_frontier"] else 18
                style = styles.get(r["press"], {})
                ax.scatter(
                    r["prefill_cost"],
                    r["score"],
                    color=style.get("color"),
                    marker=style.get("marker"),
                    s=size,
                    label=r["press"],
                )
        front = sorted((r["prefill_cost"], r["score"], r["press"]) for r in rows if r["on_frontier"])
        if front:
            costs, scores, _ = zip(*front)
            ax.plot(costs, scores, color="black", linewidth=1, alpha=0.6, label="frontier")
        ax.set_xscale("log")
        # plain labels at 1, 2, 5, 10, ... (matplotlib's own labels of the minor ticks, 2x10^0, ran into each other)
        ax.xaxis.set_minor_locator(ticker.LogLocator(subs=(2, 5)))
        ax.xaxis.set_tick_params(which="both", labelsize=8)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(_plain_number))
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(_plain_number))
        ax.set_xlabel("prefill time / uncompressed prefill (log)")
        ax.set_title(f"cr {ratio:g}", fontsize=9)
        ax.grid(alpha=0.3)
        # the frontier's presses named on the panel, apart (every press is in the legend: 20 names ran into each other)
        name_points(ax, [f[:2] for f in front], [f[2] for f in front])
    axes.flat[0].set_ylabel("score")
    legend_below(fig, *axes.flat)
    fig.suptitle(fit_title(f"{title}: quality against prefill cost", fig.get_figwidth()))
    return w.figure(f"plots/{stem}__cost.png", fig)


def _protocol(dataset: str) -> str:
    """Which protocol the runs of ``dataset`` follow (``<dataset>-qa``: the question inside the compressed context,
    ``query_aware=true``; else after compression, kvpress's default; ``-shared`` / ``-turns`` before it: several
    questions per context, :mod:`evaluation.shared`, the first one inside or after)."""
    inside = dataset.endswith(QA_SUFFIX)
    stem = dataset[: -len(QA_SUFFIX)] if inside else dataset
    for suffix, how in ((SHARED_SUFFIX, "questions on copies of one compressed context"), (TURNS_SUFFIX, "a chat")):
        if stem.endswith(suffix):
            return f"{how}, the first question {'inside the context' if inside else 'after compression'}"
    return "question inside the context" if inside else "question after compression"


def _counts(values, noun: str) -> str:
    """``1 example``, ``5 examples`` or ``3-5 examples`` (``noun``: the singular) for the distinct counts of
    ``values``; empty for none."""
    found = sorted({v for v in values if v is not None})
    if not found:
        return ""
    return f"{found[0]} {noun}" if found == [1] else f"{found[0]}{'' if len(found) == 1 else f'-{found[-1]}'} {noun}s"


def _cost_section(
    costed: list[dict],
    table: str,
    plot: str | None,
    costs: Path | None,
    length: float | None,
    protocol: str | None = None,
    floor: float | None = None,
) -> list[str]:
    """The README lines of the quality-cost frontier (:mod:`evaluation.frontier`); ``length``: the runs' mean context
    length (tokens), stated beside the lengths the costs were measured at. ``costs``: the speed sweep's csv the costs
    come from, None for the runs' own timings (:func:`evaluation.frontier.run_costs`). Each ratio's line names the
    ``protocol`` (None: none, e.g. continuation rows) and where its costs come from, with their repeats. ``floor``:
    the uncompressed run's own measured cost (its replay rebuilds the cache as every press's does), when known."""
    measured = sorted({r["cost_length"] for r in costed if r.get("cost_length") is not None})
    counted = [r.get("cost_repeats") for r in costed if r["prefill_cost"] is not None and r["press"] != BASELINE]
    repeats = _counts(counted, "example" if costs is None else "repeat")
    at = f"at {' and '.join(str(t) for t in measured)} tokens" + (
        f" (the runs' mean context length: {length:.0f})" if length is not None and costs is not None else ""
    )
    if costs is None:
        how = (
            "measured by these runs themselves: the example's uncompressed prefill plus the press's replay on it "
            "(`replay_seconds`: its scoring and compression; KVzip's whole scoring pass), over that prefill, "
            f"averaged over {repeats} per press {at}, on the machine and threads the runs had (other work "
            "beside them shows as noise; what a press reuses from an earlier press's replay of the example is "
            "charged to the earlier one"
            + (
                ""
                if floor is None
                else f"; the replay of `{BASELINE}`, which rebuilds the cache as every replay does but compresses "
                f"nothing, costs {floor:.2f} x: the floor of these costs"
            )
            + ")"
        )
        source = f"costs of these runs, {repeats}"
    else:
        how = f"measured in one speed sweep (`{costs}`" + (f", {repeats} per press" if repeats else "") + f") {at}"
        source = f"costs of the speed sweep {Path(costs).name}" + (f", {repeats}" if repeats else "")
    md = [
        "### Quality against prefill cost",
        "",
        f"Each press's score beside its prefill time over the uncompressed prefill (compression included), {how}; "
        f"on the frontier: no other press at that ratio scores as much at no more cost (`{BASELINE}` holds the whole "
        "cache and is a reference, never on it).",
        "",
    ]
    label = f"{protocol}; {source}" if protocol else source
    for ratio in sorted({r["ratio"] for r in costed}):
        rows = [r for r in costed if r["ratio"] == ratio]
        front = [f"`{r['press']}` ({r['score']:.3f}, {r['prefill_cost']:.2f} x)" for r in rows if r["on_frontier"]]
        unmeasured = sorted(r["press"] for r in rows if r["prefill_cost"] is None and r["press"] != BASELINE)
        md.append(
            f"- cr {ratio:g} ({label}): on the frontier, by cost: {', '.join(front)}"
            + (f"; no cost measured: {', '.join(f'`{p}`' for p in unmeasured)}" if unmeasured else "")
        )
    md += ["", f"Table: [{table}]({table})" + (f" · plot:\n\n![quality against cost]({plot})" if plot else ""), ""]
    return md


# --------------------------------------------------------------------------------------------------
# Report: build_report's steps, in order
# --------------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """One dataset and model of the report: its runs (step 1), then what each step adds: the records of its tables,
    the files written (``links``: a table's kind -> its path under the report directory; ``plots``: a plot's kind ->
    its path) and the numbers the README states beside them."""

    dataset: str
    model: str
    runs: list[Run]
    presses: list[str] = field(default_factory=list)  # every press, the baseline first (one style each in the plots)
    summary: list[dict] = field(default_factory=list)
    tasks: list[dict] = field(default_factory=list)
    breakdowns: dict[str, list[dict]] = field(default_factory=dict)  # "length" / "depth" -> per-group records
    ranges: list[dict] = field(default_factory=list)  # LongBench-E length ranges
    losses: list[dict] = field(default_factory=list)  # continuation loss
    positions: list[dict] = field(default_factory=list)  # shared-context protocol: score per question position
    per_answer: list[dict] = field(default_factory=list)  # shared-context protocol: cost per answered question
    shared_links: dict[str, str] = field(default_factory=dict)
    drops: list[dict] = field(default_factory=list)  # shared-context protocol: the later questions against q1
    wins: list[dict] = field(default_factory=list)
    provisional: list[dict] = field(default_factory=list)
    costed: list[dict] = field(default_factory=list)  # the quality-cost frontier's records
    mean_length: float | None = None  # the runs' mean context length (tokens), beside the costs' lengths
    floor: float | None = None  # the uncompressed run's own replay cost (--own-costs)
    links: dict[str, str] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)

    @property
    def stem(self) -> str:
        """The file name stem of its tables and plots: ``<dataset>__<model>``."""
        return f"{self.dataset}__{self.model}"

    @property
    def title(self) -> str:
        return f"{self.dataset} / {self.model}"

    @property
    def ratios(self) -> list[float]:
        return sorted({r["ratio"] for r in self.summary})


def collect_runs(results_dir: Path) -> dict[tuple[str, str], list[Run]]:
    """Step 1, collect runs: every run below ``results_dir`` (:func:`evaluation.runs.scan`: shards merged, why a run
    is incomplete), grouped by ``(dataset, model)``, in sorted order.

    Raises:
        FileNotFoundError: ``results_dir`` does not exist.
    """
    groups: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in scan(Path(results_dir)):
        groups[(run.dataset, run.model)].append(run)
    return dict(sorted(groups.items()))


def _write_tables(w: _Writer, g: _Group, confidence: float) -> None:
    """Step 2, tables: the summary, per task, per length and per depth (their win scores come in step 3), LongBench-E
    length ranges, continuation loss and the shared-context protocol's tables of one dataset and model; writes each
    table's CSV (but the per-length and per-depth ones, which wait for their win scores)."""
    g.presses = _press_order(r.press for r in g.runs)
    g.summary = summary_table(g.runs, confidence)
    g.tasks = per_task_table(g.runs)
    for label, key in _BREAKDOWNS:
        table = [r for r in per_task_table(g.runs, key=key) if r["group"] is not None]
        if _breaks_down({r["group"] for r in table}):
            g.breakdowns[label] = table
    g.links["summary"] = w.text(f"tables/{g.stem}__summary.csv", _csv(g.summary))
    g.links["per_task"] = w.text(f"tables/{g.stem}__per_task.csv", _csv(g.tasks))
    g.ranges = length_range_table(g.runs)
    if g.ranges:
        g.links["by_length_range"] = w.text(f"tables/{g.stem}__by_length_range.csv", _csv(g.ranges))
    g.losses = continuation_table(g.runs, confidence)
    if g.losses:
        g.links["continuation"] = w.text(f"tables/{g.stem}__continuation.csv", _csv(g.losses))
    g.positions = shared_report.position_table(g.runs, confidence)  # several questions per context
    if g.positions:
        g.per_answer = shared_report.answer_cost_table(g.runs)
        g.drops = shared_report.drop_table(g.runs, confidence)
        g.shared_links = {
            "drops": w.text(f"tables/{g.stem}__question_drop.csv", _csv(g.drops)) if g.drops else "",
            "positions": w.text(f"tables/{g.stem}__by_question.csv", _csv(g.positions)),
            "costs": w.text(f"tables/{g.stem}__cost_per_answer.csv", _csv(g.per_answer)) if g.per_answer else "",
        }


def _write_win_scores(w: _Writer, g: _Group) -> None:
    """Step 3, win scores: per press and ratio over the complete runs (:func:`win_table`), the provisional ones where
    some run is incomplete, and each length's and depth's own (:func:`group_win_table`) beside its scores; writes
    ``__win.csv``, ``__win_provisional.csv`` and ``__by_length.csv`` / ``__by_depth.csv``."""
    g.wins = win_table(g.runs)
    for label, table in g.breakdowns.items():
        group_wins = group_win_table(g.runs, dict(_BREAKDOWNS)[label])
        for r in table:
            r["win_score"] = group_wins.get((r["press"], r["ratio"], r["group"]))
    if g.wins:
        g.links["win"] = w.text(f"tables/{g.stem}__win.csv", _csv(g.wins))
    g.provisional = win_table(g.runs, provisional=True)
    if g.provisional:
        g.links["win_provisional"] = w.text(f"tables/{g.stem}__win_provisional.csv", _csv(g.provisional))
    for label, table in g.breakdowns.items():
        g.links[f"by_{label}"] = w.text(f"tables/{g.stem}__by_{label}.csv", _csv(table))


def _write_protocols(w: _Writer, groups: dict[tuple[str, str], list[Run]], confidence: float) -> list[str]:
    """Step 4, the two protocols side by side: per dataset and model run with the question after compression
    (``<dataset>/``) and inside the context (``<dataset>-qa/``), :func:`protocol_table` written to
    ``__protocols.csv``; returns the README's section (none without such a pair)."""
    pairs = [(d, m) for d, m in groups if (d + QA_SUFFIX, m) in groups]
    if not pairs:
        return []
    md = [
        '<a id="protocols"></a>',
        "## The two protocols side by side",
        "",
        "Question after compression (kvpress's default protocol, `<dataset>/`) against the question inside "
        "the compressed context (`<dataset>-qa/`, `query_aware=true`), on the same examples' contexts: those that "
        "every run at that ratio holds in both protocols (n). "
        f"Score: mean [{_percent(confidence)} interval]. Win score: among the presses run in both protocols at "
        "that ratio (so the two columns compare the same presses; it can differ from the per-protocol sections "
        "below).",
        "",
    ]
    for dataset, model in pairs:
        table = protocol_table(groups[(dataset, model)], groups[(dataset + QA_SUFFIX, model)], confidence)
        if not table:  # no press at a ratio in both protocols, or no example in all of them
            continue
        link = w.text(f"tables/{dataset}__{model}__protocols.csv", _csv(table))

        def fmt(r, k):
            return f"{r[f'score_{k}']:.3f} [{r[f'low_{k}']:.3f}, {r[f'high_{k}']:.3f}]" if f"score_{k}" in r else "–"

        def win(v):
            return "–" if math.isnan(v) else f"{v:.3f}"

        md += [
            f"### {dataset} / {model}",
            "",
            _markdown(
                ["ratio", "press", "n", "score, question after", "score, question inside", "win, after", "win, inside"],
                [
                    [
                        f"{r['ratio']:g}",
                        r["press"],
                        r.get("n_inside", "–"),
                        fmt(r, "after"),
                        fmt(r, "inside"),
                        win(r["win_after"]),
                        win(r["win_inside"]),
                    ]
                    for r in table
                ],
            ),
            "",
            f"Table: [{link}]({link})",
            "",
        ]
    return md


def _write_plots(w: _Writer, g: _Group) -> None:
    """Step 5, plots: score, win score and per task against the ratio (:func:`_figures`), and the continuation loss
    (:func:`_loss_figure`) when the runs have it."""
    g.plots = _figures(w, g.stem, g.title, g.summary, g.wins, g.tasks, g.presses)
    if g.losses:
        g.plots["loss"] = _loss_figure(w, g.stem, g.title, g.losses, g.presses)


def _write_frontier(w: _Writer, g: _Group, cost_rows: list[dict], own_costs: bool, plots: bool) -> None:
    """Step 6, the quality-cost frontier: each press's score beside its prefill cost (:func:`evaluation.frontier.
    cost_table`), from a speed sweep's ``cost_rows`` or, with ``own_costs``, from the runs' own timings
    (:func:`evaluation.frontier.run_costs`); writes ``__cost.csv`` and, with ``plots``, ``__cost.png``."""
    lengths = [row["context_length"] for r in g.runs for row in r.rows if row.get("context_length")]
    g.mean_length = sum(lengths) / len(lengths) if lengths else None
    if own_costs:
        cost_rows = run_costs((r.model, r.press, r.ratio, r.rows) for r in g.runs)
        g.floor = next((c[COST_COLUMN] for c in cost_rows if c["press"] == BASELINE), None)
    g.costed = cost_table(g.summary, cost_rows, g.model, g.mean_length, BASELINE)
    if g.costed:
        g.links["cost"] = w.text(f"tables/{g.stem}__cost.csv", _csv(g.costed))
        if plots:
            g.plots["cost"] = _cost_figure(w, g.stem, g.title, g.costed, g.presses)


def _percent(confidence: float) -> str:
    """``95 %`` for a confidence of 0.95: how the README names an interval."""
    return f"{100 * confidence:g} %"


def _link(table: str, plot: str | None = None, caption: str = "") -> str:
    """``Table: [path](path)``, and `` · plot:`` with the image below it when there is a ``plot``."""
    return f"Table: [{table}]({table})" + (f" · plot:\n\n![{caption}]({plot})" if plot else "")


def _readme(
    command: str, results_dir: Path, groups: dict[tuple[str, str], list[Run]], protocols: list[str], sections: list
) -> str:
    """Step 7, the README text: its title and the command that made it, the contents, the protocols side by side
    (``protocols``: step 4's section) and each dataset and model's section (``sections``: their lines, in order)."""
    md = [
        "# Benchmark results",
        "",
        f"_Generated by `{command}` from the runs in `{results_dir}`. Regenerate it; never edit by hand._",
        "",
    ]
    if not groups:
        md += ["No runs found."]
    else:
        pairs = any((d + QA_SUFFIX, m) in groups for d, m in groups)
        md += (
            ["## Contents", ""]
            + (["- [The two protocols side by side](#protocols)"] if pairs else [])
            + [f"- [{d} / {m}](#{_anchor(d, m)})" for d, m in groups]
            + [""]
        )
    md += protocols
    for lines in sections:
        md += lines
    return "\n".join(md).rstrip() + "\n"


def _group_text(g: _Group, results_dir: Path, confidence: float, costs: Path | None) -> list[str]:
    """Step 7 for one dataset and model: its README section, in this order: the runs, score, the shared-context
    protocol's positions and costs, continuation loss, win score, the quality-cost frontier, provisional win scores,
    per task, per length / depth, LongBench-E ranges, incomplete runs and the commands that made the runs."""
    md = [f'<a id="{_anchor(g.dataset, g.model)}"></a>', f"## {g.title}", ""]
    if g.dataset.endswith(QA_SUFFIX):
        md += [
            f"Protocol: the question inside the compressed context (`query_aware=true`); the runs of "
            f"`{g.dataset[: -len(QA_SUFFIX)]}` ask it after compression (kvpress's default).",
            "",
        ]
    md += [
        f"Runs: {len(g.runs)} ({len(g.presses)} press(es), ratios {', '.join(f'{x:g}' for x in g.ratios)}); "
        f"examples per run: {', '.join(sorted({str(r['n']) for r in g.summary}, key=int))}.",
        "",
    ]
    md += _score_text(g, confidence)
    if g.positions:
        md += shared_report.section(g.positions, g.per_answer, g.shared_links, _percent(confidence), g.drops)
    if g.losses:
        md += _continuation_text(g, confidence)
    if g.wins:
        md += [
            "### Win score (paper 003 section 7)",
            "",
            "Per example each press gets the number of other presses it beats or ties, averaged per task, "
            "divided by (presses - 1) and averaged over tasks; compared at each ratio on the examples "
            f"every press scored (`{BASELINE}` and incomplete runs left out).",
            "",
            _win_table_markdown(g.wins, g.presses),
            "",
            _link(g.links["win"], g.plots.get("win"), "win score vs ratio"),
            "",
        ]
    if g.costed:
        protocol = None if g.losses else _protocol(g.dataset)  # continuation rows ask no question
        md += _cost_section(g.costed, g.links["cost"], g.plots.get("cost"), costs, g.mean_length, protocol, g.floor)
    if g.provisional:
        n = {r["ratio"]: r["n_examples"] for r in g.provisional}
        md += [
            "### Win score on the examples every run holds (some runs incomplete)",
            "",
            "As above, at the ratios where some run is incomplete (unfinished, or run on a subset of its shards: "
            "see Incomplete runs), on the examples every run at the ratio holds ("
            + ", ".join(f"cr {x:g}: n = {n[x]}" for x in sorted(n))
            + "). These change as those runs grow; no other table or the claims ledger reads them.",
            "",
            _win_table_markdown(g.provisional, g.presses),
            "",
            _link(g.links["win_provisional"]),
            "",
        ]
    md += _breakdown_text(g)
    bad = [r for r in g.runs if not r.complete]
    if bad:
        md += (
            ["### Incomplete runs", ""]
            + [f"- `{r.path.relative_to(results_dir)}`: {'; '.join(r.problems)}" for r in bad]
            + [""]
        )
    commands = sorted({c for r in g.runs for c in r.commands})
    md += ["### Commands", "", "The runs above were produced by:", "", "```"]
    md += commands or ["(no run recorded a command)"]
    md += ["```", ""]
    return md


def _score_text(g: _Group, confidence: float) -> list[str]:
    """The README's score tables of one dataset and model: mean and interval (``*``: an incomplete run), task
    average and measured effective compression, press x ratio."""

    def scored(r):
        return f"{r['score']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" + ("" if r["complete"] else " *")

    compression = _press_by_ratio(g.summary, lambda r: f"{r['effective_compression']:.3f}", g.presses, g.ratios)
    return [
        f"### Score (mean over examples, {_percent(confidence)} interval)",
        "",
        "Mean over all examples, which is paper 003's average of the per-split scores weighted by split "
        "size; interval: Wilson when every score is 0 or 1, Student t otherwise. `*`: incomplete run.",
        "",
        _press_by_ratio(g.summary, scored, g.presses, g.ratios),
        "",
        "Task average (every task weighs the same):",
        "",
        _press_by_ratio(g.summary, lambda r: f"{r['task_average']:.3f}", g.presses, g.ratios),
        "",
        "Measured effective compression:",
        "",
        compression,
        "",
        _link(g.links["summary"], g.plots.get("score"), "score vs ratio"),
        "",
    ]


def _continuation_text(g: _Group, confidence: float) -> list[str]:
    """The README's continuation-loss tables of one dataset and model: NLL increase and KL with their intervals,
    press x ratio, per context length when the losses are broken down by length, then over all."""
    every = [r for r in g.losses if r["task"] == "all"]
    md = [
        f"### Continuation loss (mean over examples, {_percent(confidence)} Student-t interval)",
        "",
        "The context compressed, the text that follows teacher-forced on the compressed cache "
        "(`evaluation/continuation.py`): the increase of the mean negative log-likelihood per token over "
        "the uncompressed context, and the mean KL(uncompressed || compressed) of the next-token "
        "distributions, in nats per token (the rows' `score` is exp(-KL)).",
        "",
    ]
    lengths = _loss_lengths(g.losses)
    for key, label in (("nll_increase", "NLL increase"), ("kl", "KL")):

        def loss(r, k=key):
            return f"{r[k]:.4f} [{r[f'{k}_low']:.4f}, {r[f'{k}_high']:.4f}]"

        for length in lengths:
            cut = [r for r in every if r["context_length"] == length]
            md += [
                f"{label}{_length_caption(length, lengths)}:",
                "",
                _press_by_ratio(cut, loss, g.presses, g.ratios),
                "",
            ]
    table = g.links["continuation"]
    md += [
        f"Table (per task{' and length' if len(lengths) > 1 else ''} too): [{table}]({table})"
        + (f" · plot:\n\n![loss vs ratio]({g.plots['loss']})" if "loss" in g.plots else ""),
        "",
    ]
    return md


def _breakdown_text(g: _Group) -> list[str]:
    """The README's per-task table of one dataset and model, then per length and per depth (each score with its own
    win score) and the LongBench-E length ranges, rows ``press @ ratio``."""
    labels = [
        _label(p, x) for p in g.presses for x in g.ratios if any(r["press"] == p and r["ratio"] == x for r in g.summary)
    ]
    hdr, rows = _pivot(
        g.tasks,
        lambda r: _label(r["press"], r["ratio"]),
        lambda r: r["group"],
        lambda r: f"{r['score']:.3f}",
        row_order=labels,
    )
    md = [
        "### Per task",
        "",
        _markdown(["press @ ratio"] + [str(c) for c in hdr], rows),
        "",
        _link(g.links["per_task"], g.plots.get("tasks"), "per task"),
        "",
    ]
    for label, table in g.breakdowns.items():
        hdr, rows = _pivot(
            table,
            lambda r: _label(r["press"], r["ratio"]),
            lambda r: r["group"],
            lambda r: f"{r['score']:.3f}" + ("" if r["win_score"] is None else f" ({r['win_score']:.3f})"),
            row_order=labels,
            col_order=sorted({r["group"] for r in table}),
        )
        title = "context length (tokens)" if label == "length" else "needle depth (%)"
        md += [
            f"### Per {title}",
            "",
            "Mean score and, in parentheses, the win score among the presses of the ratio on that "
            f"{label}'s examples alone.",
            "",
            _markdown(["press @ ratio"] + [f"{c:g}" for c in hdr], rows),
            "",
            _link(g.links[f"by_{label}"]),
            "",
        ]
    if g.ranges:
        everything = [r for r in g.ranges if r["task"] == "all"]
        hdr, rows = _pivot(
            everything,
            lambda r: _label(r["press"], r["ratio"]),
            lambda r: r["range"],
            lambda r: f"{r['score']:.3f}",
            row_order=labels,
            col_order=[name for name, _ in LENGTH_RANGES if any(r["range"] == name for r in everything)],
        )
        md += [
            "### LongBench-E by length range",
            "",
            "The official LongBench-E breakdown (LongBench `eval.py`): each row falls in 0-4k, 4-8k or 8k+ "
            "by its `length` (words); per range, the mean score of each task, averaged over tasks. "
            "Per-task values are in the table file.",
            "",
            _markdown(["press @ ratio"] + hdr, rows),
            "",
            _link(g.links["by_length_range"]),
            "",
        ]
    return md


def build_report(
    results_dir: Path,
    out: Path,
    confidence: float = 0.95,
    command: str | None = None,
    plots: bool = True,
    costs: Path | None = None,
    own_costs: bool = False,
) -> Path:
    """Write the report of every run below ``results_dir`` into ``out``; returns ``out / "README.md"``.

    The steps, each a function: collect the runs (:func:`collect_runs`), then per dataset and model its tables
    (:func:`_write_tables`), win scores (:func:`_write_win_scores`), plots (:func:`_write_plots`) and quality-cost
    frontier (:func:`_write_frontier`); the two protocols side by side (:func:`_write_protocols`); the README text
    (:func:`_readme`, each dataset's section :func:`_group_text`); last, files of an earlier report that this one did
    not write are removed.

    ``plots=False`` skips the PNGs (tables and README only; stale PNGs are then removed too). ``costs``: a speed
    sweep's csv, for the quality-cost sections (:mod:`evaluation.frontier`); none when None or missing.
    ``own_costs``: those sections from the runs' own timings instead (:func:`evaluation.frontier.run_costs`: rows
    of ``python -m evaluation.fused``), each dataset's from its own runs.

    Raises:
        FileNotFoundError: ``results_dir`` does not exist. ValueError: ``confidence`` outside (0, 1), or both
        ``costs`` and ``own_costs``.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    if costs is not None and own_costs:
        raise ValueError(f"costs={costs} and own_costs=True: the frontier reads one source of costs, not both")
    cost_rows = read_costs(costs) if costs is not None else []
    groups = collect_runs(results_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    w = _Writer(out)
    protocols = _write_protocols(w, groups, confidence)
    sections = []
    for (dataset, model), runs in groups.items():
        g = _Group(dataset, model, runs)
        _write_tables(w, g, confidence)
        _write_win_scores(w, g)
        if plots:
            _write_plots(w, g)
        _write_frontier(w, g, cost_rows, own_costs, plots)
        sections.append(_group_text(g, results_dir, confidence, costs))
    command = command or f"python -m evaluation.report {results_dir} --out {out}"
    readme = Path(w.text("README.md", _readme(command, results_dir, groups, protocols, sections)))
    w.prune()
    return out / readme


def _anchor(dataset: str, model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{dataset}-{model}".lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (see the module docstring)."""
    parser = ArgumentParser(prog="python -m evaluation.report", description=__doc__.split("\n")[0])
    parser.add_argument("results_dir", type=Path, help="directory holding <dataset>/<model>/<press>/cr<ratio>/ runs")
    parser.add_argument("--out", type=Path, default=Path("results"), help="report directory (default: results/)")
    parser.add_argument("--confidence", type=float, default=0.95, help="interval confidence (default 0.95)")
    parser.add_argument("--no-plots", action="store_true", help="write tables and README only")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--costs", type=Path, default=None, help="a speed sweep's csv: quality-cost frontier sections")
    source.add_argument(
        "--own-costs",
        action="store_true",
        help="quality-cost frontier sections from the runs' own timings (rows of python -m evaluation.fused)",
    )
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    readme = build_report(
        args.results_dir,
        args.out,
        args.confidence,
        command="python -m evaluation.report " + " ".join(argv),
        plots=not args.no_plots,
        costs=args.costs,
        own_costs=args.own_costs,
    )
    print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
