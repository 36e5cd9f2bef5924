"""Where the probabilistic-eviction press spends its prefill time, on the embedded model (issue 18).

Usage::

    python scripts/profile_snis_press.py --lengths 2048 8192 [--proposal h2o_h] [--ratio 0.5] [--pyinstrument]

For each ``T`` (random token ids, seed 0): one warm-up prefill, then per press part the wall time and the CPU
time of the calling thread (``time.thread_time``; unlike wall time it barely moves when other processes share
the cores, but it misses the work of torch's other intra-op threads and of the column pass's worker threads):

- ``prefill``: the whole ``model.model(...)`` call inside ``with press(model)``;
- ``uncompressed prefill``: the same call without a press;
- ``attention with statistics``: the attention calls that also computed the proposal statistics
  (:func:`presses.kernels.attention_with_column_sums`: the fused flash kernel plus the column pass);
- ``proposal``: :func:`presses.proposals.compute_proposal` in the layers' hooks (reads the statistics);
- ``budget search``, ``sampling``: :func:`presses.budget.search_num_samples`, :func:`presses.budget.sample_counts`;
- ``eviction``: :meth:`ProbabilisticEvictionPress._evict` (sampling included: gather, padding, bias).

``--pyinstrument`` also prints a pyinstrument call tree of one prefill (wall time) when pyinstrument is installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@contextmanager
def timed_parts(targets: dict[str, tuple[object, str]], totals: dict[str, list[float]]):
    """Wrap ``getattr(owner, attr)`` for each ``name: (owner, attr)``; add ``[wall, cpu]`` seconds per call."""
    saved = {}
    for name, (owner, attr) in targets.items():
        fn = getattr(owner, attr)
        saved[name] = (owner, attr, fn)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_name][0] += time.perf_counter() - w
                totals[_name][1] += time.thread_time() - c

        setattr(owner, attr, wrapper)
    try:
        yield
    finally:
        for owner, attr, fn in saved.values():
            setattr(owner, attr, fn)


def profile(model, T: int, proposal: str, ratio: float, use_pyinstrument: bool) -> list[str]:
    """Markdown lines of one length's profile (see the module docstring)."""
    import torch
    from transformers import DynamicCache

    from presses import kernels, snis_press
    from presses.snis_attention import clear_snis_state

    ids = torch.randint(100, 40000, (1, T), generator=torch.Generator().manual_seed(0))

    def prefill(press):
        clear_snis_state(model)
        cache = DynamicCache()
        with torch.inference_mode(), (press(model) if press is not None else _null()):
            model.model(input_ids=ids, past_key_values=cache)

    def make():
        return snis_press.ProbabilisticEvictionPress(compression_ratio=ratio, proposal=proposal, seed=42)

    prefill(make())  # warm-up
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    w, c = time.perf_counter(), time.thread_time()
    prefill(None)
    totals["uncompressed prefill"] = [time.perf_counter() - w, time.thread_time() - c]
    targets = {
        "attention with statistics": (kernels, "attention_with_column_sums"),
        "proposal": (snis_press, "compute_proposal"),
        "budget search": (snis_press, "search_num_samples"),
        "sampling": (snis_press, "sample_counts"),
        "eviction": (snis_press.ProbabilisticEvictionPress, "_evict"),
    }
    with timed_parts(targets, totals):
        w, c = time.perf_counter(), time.thread_time()
        prefill(make())
        totals["prefill"] = [time.perf_counter() - w, time.thread_time() - c]
    lines = [f"### T = {T} ({proposal}, compression_ratio {ratio:g}, {torch.get_num_threads()} torch threads)", "",
             "| part | wall s | CPU s (calling thread) |", "|---|---|---|"]
    for name in ("uncompressed prefill", "prefill", *targets):
        wall, cpu = totals[name]
        lines.append(f"| {name} | {wall:.3f} | {cpu:.3f} |")
    lines.append("")
    if use_pyinstrument:
        try:
            from pyinstrument import Profiler
        except ImportError:
            lines += ["(pyinstrument is not installed)", ""]
        else:
            profiler = Profiler(interval=0.005)
            profiler.start()
            prefill(make())
            profiler.stop()
            lines += ["```", profiler.output_text(unicode=False, color=False), "```", ""]
    return lines


@contextmanager
def _null():
    yield


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--proposal", default="h2o_h")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pyinstrument", action="store_true")
    args = parser.parse_args(argv)
    from evaluation.models import load_model

    model, _ = load_model(args.model)
    lines = [f"Command: `python scripts/profile_snis_press.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
             ""]
    for T in args.lengths:
        lines += profile(model, T, args.proposal, args.ratio, args.pyinstrument)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
