"""The speed benchmark's README and plots (:mod:`evaluation.studies.bench_speed_memory`), rebuilt from the csv
rows after every sweep."""

from __future__ import annotations

import math
import platform
from pathlib import Path

from omegaconf import DictConfig

from evaluation.atomic import save_figure, write_atomic
from evaluation.plotting import legend_below, press_colors
from evaluation.studies.bench_speed_memory.rows import CSV_NAME, NO_PRESS, REFERENCE, row_key
from evaluation.tables import fmt, markdown_table, num, read_rows


def _threads_summary(rows: list[dict]) -> str:
    """torch intra-op threads of the rows, e.g. ``"1 torch thread(s): 24 rows; not recorded: 56 rows"`` (rows
    of sweeps made before the ``threads`` column existed). A row's ratios (``vs full``, ``overhead``) are taken
    within its own sweep, so rows measured with different threads compare only through their ratios."""
    counts: dict[str, int] = {}
    for r in rows:
        key = str(r.get("threads") or "")
        counts[key] = counts.get(key, 0) + 1
    parts = [f"{k} torch thread(s): {n} rows" for k, n in sorted(counts.items()) if k]
    if "" in counts:
        parts.append(f"threads not recorded: {counts['']} rows (earlier sweeps, torch's default)")
    return "; ".join(parts) or "no rows"


def comparison_tables(out: Path, rows: list[dict], cfg: DictConfig) -> list[str]:
    """README lines comparing the rows measured again with the same rows of earlier csv files (``compare_with``).

    Each file of ``cfg.compare_with`` (a path, relative to ``out`` unless absolute; typically a copy of the csv
    kept before a change) gives one table: every ``(model, press, ratio, T)`` present in both, not ``no_press``,
    whose measurement differs (another timestamp), with the prefill ratio vs full, the press time and the
    overhead vs SnapKV before and after. Each side's ratios were taken within its own run. A missing file gives
    a one-line note.
    """
    lines: list[str] = []
    order = [NO_PRESS, REFERENCE, *[str(p) for p in cfg.presses]]
    for name in cfg.get("compare_with") or []:
        path = Path(str(name)) if Path(str(name)).is_absolute() else out / str(name)
        if not path.exists():
            lines += [f"Comparison file `{name}` (compare_with) not found.", ""]
            continue
        before = {row_key(r): r for r in read_rows(path) if not r.get("error")}
        pairs = [
            (r, before[row_key(r)])
            for r in rows
            if row_key(r) in before
            and r["press"] != NO_PRESS
            and before[row_key(r)].get("timestamp") != r.get("timestamp")
        ]
        pairs.sort(
            key=lambda p: (
                p[0]["model"],
                order.index(p[0]["press"]) if p[0]["press"] in order else len(order),
                p[0]["press"],
                float(p[0]["compression_ratio"]),
                int(float(p[0]["T"])),
            )
        )
        stamps = sorted(str(old.get("timestamp", "")) for _, old in pairs)
        when = f" (measured {stamps[0]} to {stamps[-1]})" if stamps else ""
        lines += [
            f"## Before and after: rows measured again vs `{name}`{when}",
            "",
            "Each side's ratios are taken within its own run (its own uncompressed prefill and SnapKV "
            "reference at the same T).",
            "",
            "| model | press | ratio | T | vs full before | vs full after | press ms before | press ms after | "
            "overhead before | overhead after |",
            "|" + "---|" * 10,
        ]
        for new, old in pairs:
            lines.append(
                f"| {new['model']} | {new['press']} | {float(new['compression_ratio']):g} | {int(float(new['T']))} | "
                f"{fmt(old['prefill_ratio_vs_full'], '.2f')} | {fmt(new['prefill_ratio_vs_full'], '.2f')} | "
                f"{fmt(num(old['press_s']) * 1e3, '.1f')} | {fmt(num(new['press_s']) * 1e3, '.1f')} | "
                f"{fmt(old['overhead_ratio'], '.2f')} | {fmt(new['overhead_ratio'], '.2f')} |"
            )
        if not pairs:
            lines.append("| - | no row measured again | | | | | | | | |")
        lines.append("")
    return lines


def write_report(
    out: Path, rows: list[dict], cfg: DictConfig, command: str, device: str, notes: list[str], seconds: float
) -> None:
    """Write ``README.md`` (tables per T, summary tables, the command) and the plots from the csv rows."""
    import torch

    ok = [r for r in rows if not r.get("error")]
    failed = [r for r in rows if r.get("error")]
    models = sorted({r["model"] for r in rows})
    lines = [
        "# Speed and memory of the presses",
        "",
        f"Command: `{command}`",
        "",
        f"Device `{device}` ({platform.processor() or platform.machine()}, "
        f"{_threads_summary(rows)}{', ' + torch.cuda.get_device_name(device) if device.startswith('cuda') else ''}), "
        f"torch {torch.__version__}, python {platform.python_version()}, model(s) {', '.join(models) or '-'}; "
        f"decode over {cfg.decode_tokens} tokens; {cfg.repeats} repeat(s) per row (median); "
        f"last sweep {seconds:.0f} s.",
        "",
        *[n + "\n" for n in notes],
        "How to read: times are the calling thread's CPU seconds on a CPU with one torch thread (the whole "
        "computation runs on it, so other processes on the machine do not inflate them: "
        "`measure.clock_fn`), wall seconds on a GPU or with several threads. "
        "`prefill s` is the prefill call (press included); `vs full` divides it by the uncompressed "
        "prefill on the same context in the same run. `press ms` is the time inside the press's compression "
        "hooks (kvpress `forward_hook` -> `compress`, plus the SNIS press's deferred `finalize` and EntroPrefill's "
        "`_model_pre_hook` chunk planning), summed over layers; `overhead` = press ms / SnapKV press ms at the same "
        "T and ratio, measured in the same run. EntroPrefill is not a ScorerPress: its press ms is its own "
        "monitoring work (proposal rows, scan, certificate, audit, cache gather) plus chunk planning, while the "
        "layers it skips make its `vs full` below 1 when it prunes (its context is the query-aware multi-document "
        "prompt, whose full prefill is measured separately). `physical` / `logical` are the KV bytes held after "
        "the prefill (padded tensors / kept entries) over the full cache's bytes. `peak MiB` is the row's peak "
        "memory (CPU: peak RSS of the process, `VmHWM` reset per row; GPU: `torch.cuda.max_memory_allocated`), "
        "`+MiB` its excess over the level at the row's start. The SNIS press takes its proposal's statistics from "
        "the prefill's own attention (`presses/prefill_attention.py`): that work is in `prefill s` and `vs full`, "
        "not in `press ms`.",
        "",
    ]
    lines += comparison_tables(out, ok, cfg)
    if not ok:
        lines.append("No rows yet.")
    for model in models:
        mrows = [r for r in ok if r["model"] == model]
        Ts = sorted({int(float(r["T"])) for r in mrows})
        order = [NO_PRESS, REFERENCE, *[str(p) for p in cfg.presses]]
        presses = sorted({r["press"] for r in mrows}, key=lambda p: (order.index(p) if p in order else len(order), p))
        ratios = sorted({float(r["compression_ratio"]) for r in mrows if r["press"] != NO_PRESS})
        lines += [
            f"## {model}: summary",
            "",
            "Overhead ratio vs SnapKV (press time / SnapKV press time, same T and ratio, same run) and "
            "physical KV bytes vs full, per press:",
            "",
        ]
        header = (
            "| press | ratio | "
            + " | ".join(f"overhead T={t}" for t in Ts)
            + " | "
            + " | ".join(f"physical T={t}" for t in Ts)
            + " |"
        )
        lines += [header, "|" + "---|" * (2 + 2 * len(Ts))]
        for p in presses:
            for ratio in [0.0] if p == NO_PRESS else ratios:
                cell = {
                    int(float(r["T"])): r
                    for r in mrows
                    if r["press"] == p and abs(float(r["compression_ratio"]) - ratio) < 1e-9
                }
                if not cell:
                    continue
                lines.append(
                    f"| {p} | {ratio:g} | "
                    + " | ".join(fmt(cell[t]["overhead_ratio"], ".2f") if t in cell else "-" for t in Ts)
                    + " | "
                    + " | ".join(fmt(cell[t]["physical_vs_full"], ".3f") if t in cell else "-" for t in Ts)
                    + " |"
                )
        lines.append("")
        for t in Ts:
            trows = sorted(
                [r for r in mrows if int(float(r["T"])) == t],
                key=lambda r: (float(r["compression_ratio"]), presses.index(r["press"])),
            )
            n_ctx = sorted({r["context_length"] for r in trows})
            lines += [f"## {model}, T = {t} (context tokens: {', '.join(n_ctx)})", ""]
            lines += markdown_table(
                ["press", "ratio", "prefill s", "vs full", "press ms", "overhead vs SnapKV", "decode tok/s"]
                + ["KV full MiB", "physical", "logical", "peak MiB", "+MiB"],
                [
                    [r["press"], f"{float(r['compression_ratio']):g}", fmt(r["prefill_s"], ".3f")]
                    + [fmt(r["prefill_ratio_vs_full"], ".2f"), fmt(num(r["press_s"]) * 1e3, ".1f")]
                    + [fmt(r["overhead_ratio"], ".2f"), fmt(r["decode_tok_s"], ".1f")]
                    + [fmt(num(r["kv_full_bytes"]) / 2**20, ".2f"), fmt(r["physical_vs_full"], ".3f")]
                    + [
                        fmt(r["logical_vs_full"], ".3f"),
                        fmt(r["peak_mem_mb"], ".0f"),
                        fmt(r["peak_mem_delta_mb"], ".0f"),
                    ]
                    for r in trows
                ],
            )
            lines.append("")
    if failed:
        lines += ["## Failed rows", "", "| model | press | ratio | T | error |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['model']} | {r['press']} | {r['compression_ratio']} | {r['T']} | {r['error']} |" for r in failed
        ]
        lines.append("")
    methods = sorted({r["mem_method"] for r in ok if r.get("mem_method")})
    lines += [
        f"Memory method: {'; '.join(methods) or '-'}. Rows: `{CSV_NAME}`. Plots: `overhead_ratio.png`, "
        "`kv_bytes.png`, `prefill.png`.",
        "",
    ]
    write_atomic(out / "README.md", "\n".join(lines))
    if ok:
        write_plots(out, ok)


def write_plots(out: Path, rows: list[dict]) -> None:
    """``overhead_ratio.png`` (overhead vs SnapKV against T), ``kv_bytes.png`` (physical solid, logical
    dashed, vs full against T) and ``prefill.png`` (prefill seconds against T), one panel per ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({float(r["compression_ratio"]) for r in rows if r["press"] != NO_PRESS})
    if not ratios:
        return
    presses = sorted({r["press"] for r in rows})
    colors = press_colors(presses)

    def series(press, ratio, col):
        pts = sorted(
            (int(float(r["T"])), num(r[col]))
            for r in rows
            if r["press"] == press and (press == NO_PRESS or abs(float(r["compression_ratio"]) - ratio) < 1e-9)
        )
        return [p[0] for p in pts], [p[1] for p in pts]

    for fname, cols, ylabel, logy in (
        ("overhead_ratio.png", [("overhead_ratio", "-")], "press time / SnapKV", True),
        (
            "kv_bytes.png",
            [("physical_vs_full", "-"), ("logical_vs_full", "--")],
            "KV bytes / full (solid physical, dashed logical)",
            False,
        ),
        ("prefill.png", [("prefill_s", "-")], "prefill seconds", True),
    ):
        fig, axes = plt.subplots(1, len(ratios), figsize=(5.5 * len(ratios), 4), squeeze=False, layout="constrained")
        for ax, ratio in zip(axes[0], ratios):
            for p in presses:
                if p == NO_PRESS and fname == "overhead_ratio.png":
                    continue
                for col, style in cols:
                    x, y = series(p, ratio, col)
                    if any(math.isfinite(v) and (v > 0 or not logy) for v in y):
                        ax.plot(x, y, style, marker="o", color=colors[p], label=p if style == "-" else None)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_xlabel("context length T (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"compression_ratio = {ratio:g}")
            ax.grid(alpha=0.3)
        legend_below(fig, *axes[0])
        save_figure(fig, out / fname, dpi=110)
