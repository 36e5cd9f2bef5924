"""Where the probabilistic-eviction press spends its prefill time, on the embedded model (issue 18).

Usage (``python -m evaluation.studies.profile_snis_press`` is the same)::

    python scripts/profile_snis_press.py --lengths 2048 8192 [--threads 1] [--repeats 2] [--proposal h2o_h]
        [--ratio 0.5] [--pyinstrument]

For each ``T`` (random token ids, seed 0): one warm-up prefill per press, then ``--repeats`` measurements (the
fastest kept) of the wall time and of the CPU time of the calling thread (``time.thread_time``). With
``--threads 1`` every op, the column pass included, runs on the calling thread, so its CPU time is the work
itself and barely moves when other processes share the cores (wall time does); with more threads it misses the
other threads' work. Rows:

- ``uncompressed prefill``; ``SnapKV prefill`` and ``SnapKV press`` (its kvpress hooks, as the speed benchmark
  times them); ``SNIS prefill`` and ``SNIS press`` (its hooks: ``forward_hook`` -> ``compress`` and the deferred
  ``finalize``), then the SNIS parts:
- ``attention with statistics``: the attention calls that also computed the proposal statistics
  (:func:`presses.kernels.attention_with_column_sums`: the fused flash kernel plus the column pass; inside the
  prefill, outside the press's hooks);
- ``proposal``: :func:`presses.probabilistic.proposals.compute_proposal` in the layers' hooks (reads the statistics);
- ``budget search``, ``sampling``: :func:`presses.probabilistic.budget.search_num_samples`,
:func:`presses.probabilistic.budget.sample_counts`;
- ``eviction``: :meth:`ProbabilisticEvictionPress._evict` (sampling included: gather, padding, bias).

``--pyinstrument`` also prints a pyinstrument call tree of one SNIS prefill (wall time) when it is installed.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager

from evaluation import tables
from evaluation.cli import ArgumentParser


def _timed(fn, totals: dict[str, list[float]], name: str):
    """``fn`` wrapped to add the ``[wall, cpu]`` seconds of every call to ``totals[name]``."""

    def wrapper(*args, **kwargs):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name][0] += time.perf_counter() - w
            totals[name][1] += time.thread_time() - c

    return wrapper


@contextmanager
def timed_parts(targets: dict[str, tuple[object, str]], totals: dict[str, list[float]]):
    """Wrap ``getattr(owner, attr)`` for each ``name: (owner, attr)``; add ``[wall, cpu]`` seconds per call."""
    saved = {}
    for name, (owner, attr) in targets.items():
        fn = getattr(owner, attr)
        saved[name] = (owner, attr, fn)
        setattr(owner, attr, _timed(fn, totals, name))
    try:
        yield
    finally:
        for owner, attr, fn in saved.values():
            setattr(owner, attr, fn)


def _hooked(press, totals: dict[str, list[float]], name: str):
    """Time ``press``'s compression hooks (as the speed benchmark's HookTimer: instance attributes shadowing the
    methods before ``press(model)`` registers them), adding ``[wall, cpu]`` seconds under ``name``."""
    for attr in ("forward_hook", "finalize"):
        fn = getattr(press, attr, None)
        if fn is None:
            continue
        setattr(press, attr, _timed(fn, totals, name))
    return press


def profile(model, T: int, proposal: str, ratio: float, repeats: int, use_pyinstrument: bool) -> list[str]:
    """Markdown lines of one length's profile (see the module docstring)."""
    import torch
    from kvpress import SnapKVPress
    from transformers import DynamicCache

    import presses.probabilistic.press as snis_press
    from presses import kernels

    ids = torch.randint(100, 40000, (1, T), generator=torch.Generator().manual_seed(0))

    def prefill(press):
        cache = DynamicCache()
        w, c = time.perf_counter(), time.thread_time()
        with torch.inference_mode(), press(model) if press is not None else _null():
            model.model(input_ids=ids, past_key_values=cache)
        return [time.perf_counter() - w, time.thread_time() - c]

    def snis():
        return snis_press.ProbabilisticEvictionPress(compression_ratio=ratio, proposal=proposal, seed=42)

    targets = {
        "attention with statistics": (kernels, "attention_with_column_sums"),
        "proposal": (snis_press, "compute_proposal"),
        "budget search": (snis_press, "search_num_samples"),
        "sampling": (snis_press, "sample_counts"),
        "eviction": (snis_press.ProbabilisticEvictionPress, "_evict"),
    }
    prefill(snis())  # warm-up
    prefill(SnapKVPress(compression_ratio=ratio))
    best: dict[str, list[float]] | None = None
    for _ in range(max(1, repeats)):
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        totals["uncompressed prefill"] = prefill(None)
        totals["SnapKV prefill"] = prefill(_hooked(SnapKVPress(compression_ratio=ratio), totals, "SnapKV press"))
        with timed_parts(targets, totals):
            totals["SNIS prefill"] = prefill(_hooked(snis(), totals, "SNIS press"))
        if (
            best is None
            or totals["SNIS prefill"][1] + totals["uncompressed prefill"][1]
            < best["SNIS prefill"][1] + best["uncompressed prefill"][1]
        ):
            best = dict(totals)
    names = ["uncompressed prefill", "SnapKV prefill", "SnapKV press", "SNIS prefill", "SNIS press", *targets]
    lines = [
        f"### T = {T} ({proposal}, compression_ratio {ratio:g}, {torch.get_num_threads()} torch threads, "
        f"fastest of {max(1, repeats)})",
        "",
        "| part | wall s | CPU s (calling thread) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {best[name][0]:.3f} | {best[name][1]:.3f} |" for name in names]

    def ratio_of(a, b, i):
        return best[a][i] / best[b][i] if best[b][i] > 0 else float("nan")

    lines += [
        "",
        "| ratio | wall | CPU |",
        "|---|---|---|",
        f"| SNIS prefill / uncompressed prefill | {ratio_of('SNIS prefill', 'uncompressed prefill', 0):.3f} | "
        f"{ratio_of('SNIS prefill', 'uncompressed prefill', 1):.3f} |",
        f"| SNIS press / SnapKV press | {ratio_of('SNIS press', 'SnapKV press', 0):.2f} | "
        f"{ratio_of('SNIS press', 'SnapKV press', 1):.2f} |",
        "",
    ]
    if use_pyinstrument:
        try:
            from pyinstrument import Profiler
        except ImportError:
            lines += ["(pyinstrument is not installed)", ""]
        else:
            profiler = Profiler(interval=0.005)
            profiler.start()
            prefill(snis())
            profiler.stop()
            lines += ["```", profiler.output_text(unicode=False, color=False), "```", ""]
    return lines


@contextmanager
def _null():
    yield


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--proposal", default="h2o_h")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pyinstrument", action="store_true")
    args = parser.parse_args(argv)
    import torch

    from evaluation.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)

    model, _ = load_model(args.model)
    lines = [f"Command: `{tables.command('profile_snis_press', sys.argv[1:] if argv is None else argv)}`", ""]
    for T in args.lengths:
        lines += profile(model, T, args.proposal, args.ratio, args.repeats, args.pyinstrument)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
