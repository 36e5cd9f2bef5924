"""One row of the speed benchmark (:mod:`evaluation.studies.bench_speed_memory`): the prefill inside ``with
press(model)``, the time inside the press's hooks, the KV bytes held, the timed greedy decode and the peak memory.
Also the GPU check's timing (:mod:`evaluation.studies.gpu_end_to_end`)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import re
import resource
import statistics
import time
from pathlib import Path


def clock_fn(device: str):
    """The clock the benchmark times with: on a CPU with one torch thread, the calling thread's CPU seconds
    (``time.thread_time``: the whole computation runs on that thread, so other processes on the machine do not
    inflate it); elsewhere (CUDA, or several threads) wall seconds (``time.perf_counter``)."""
    import torch

    if not str(device).startswith("cuda") and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _sync_fn(device: str):
    """``torch.cuda.synchronize`` for a CUDA device, else a no-op."""
    import torch

    if str(device).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class HookTimer:
    """Sum the wall time a press spends inside its hooks: kvpress's attention ``forward_hook`` (every press) and,
    for this project's presses, every hook of the press contract's ``model_hooks`` (:mod:`presses.base`:
    the probabilistic press's deferred global eviction, EntroPrefill's chunk planning and layer hooks).

    Enter it BEFORE ``with press(model)``: the wrappers are set as instance attributes, which shadow the
    class methods when the press registers its hooks. Only the outermost timed call is counted (no double
    counting if one timed hook calls another). ``seconds`` and ``calls`` accumulate while entered.

    Args:
        press: a kvpress press, or None (nothing is timed).
        sync: called before and after each timed call (``torch.cuda.synchronize`` on GPU).
    """

    def __init__(self, press, sync=lambda: None, clock=time.perf_counter):
        self.press, self.sync, self.clock = press, sync, clock
        self.seconds, self.calls = 0.0, 0
        self._depth = 0
        self._patched: list[str] = []

    def _wrap(self, fn):
        @functools.wraps(fn)  # keeps __wrapped__: the press contract recognises its own (timed) hooks
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self.sync()
            start = self.clock()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.sync()
                self.seconds += self.clock() - start
                self.calls += 1

        return timed

    def __enter__(self) -> HookTimer:
        if self.press is not None:
            self.press.forward_hook = self._wrap(self.press.forward_hook)
            self._patched.append("forward_hook")
            model_hooks = getattr(self.press, "model_hooks", None)
            if model_hooks is not None:  # the press contract: hooks beyond the attention hooks
                self.press.model_hooks = lambda model: [(m, kind, self._wrap(fn)) for m, kind, fn in model_hooks(model)]
                self._patched.append("model_hooks")
        return self

    def __exit__(self, *exc) -> None:
        for name in self._patched:
            delattr(self.press, name)
        self._patched = []


def _proc_status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


class PeakMemory:
    """Peak memory over a block, in MiB: ``max_memory_allocated`` on CUDA, peak RSS (``VmHWM``) on CPU.

    On CPU ``start`` resets the kernel's high-water mark by writing ``5`` to ``/proc/self/clear_refs``
    (Linux >= 4.0); when that fails the monotone ``ru_maxrss`` of the whole process is reported instead
    and ``method`` says so. ``stop`` returns ``(peak_mb, delta_mb)``, the delta being the peak minus the
    RSS (or allocated bytes) at ``start``.
    """

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.device = device
        self.method = ""
        self.base_mb = 0.0

    def start(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_mb = torch.cuda.memory_allocated(self.device) / 2**20
            self.method = "torch.cuda.max_memory_allocated"
            return
        rss = _proc_status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM (peak RSS, reset via /proc/self/clear_refs)"
        except OSError:
            self.method = "ru_maxrss (peak RSS of the whole process, not reset)"
        self.base_mb = (rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024

    def stop(self) -> tuple[float, float]:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            hwm = _proc_status_kb("VmHWM") if self.method.startswith("VmHWM") else None
            peak = (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024
        return peak, peak - self.base_mb


def kv_bytes(cache, context_length: int) -> tuple[int, int]:
    """``(full, physical)`` bytes of a prefilled cache: ``full`` for all ``context_length`` tokens in every
    layer, ``physical`` the key and value tensors actually held (padded shapes)."""
    full = physical = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            physical += t.numel() * t.element_size()
            B, G, _, d = t.shape
            full += B * G * int(context_length) * d * t.element_size()
    return full, physical


def greedy_decode(model, cache, question_ids, context_length: int, n_tokens: int, sync, clock) -> float:
    """Feed ``question_ids`` at positions ``context_length..`` then time ``n_tokens`` greedy single-token
    steps (EOS ignored) on ``clock`` (:func:`clock_fn`). Returns the seconds of those steps (``nan`` for
    ``n_tokens == 0``)."""
    from evaluation.replay import greedy_step

    token = greedy_step(model, cache, question_ids.to(model.device), context_length).unsqueeze(1)
    next_pos = context_length + question_ids.shape[1]
    if n_tokens <= 0:
        return math.nan
    sync()
    start = clock()
    for i in range(n_tokens):
        token = greedy_step(model, cache, token, next_pos + i).unsqueeze(1)
    sync()
    return clock() - start


def measure_row(model, press, context_ids, question_ids, decode_tokens: int, device: str, repeats: int = 1) -> dict:
    """Prefill (``repeats`` times, each on a fresh cache), decode, and measure; see the module docstring.

    Args:
        model: a causal LM (kvpress-supported architecture) on ``device``.
        press: a kvpress press or None (full prefill).
        context_ids, question_ids: ``(1, T)`` and ``(1, q)`` token ids.
        decode_tokens: greedy steps to time (``>= 0``).
        repeats: measurements; times are medians, memory the max, bytes and stats from the last.

    Returns:
        a dict with the measured columns of :data:`COLUMNS`.
    """
    import torch
    from transformers import DynamicCache

    from evaluation.harness import cache_stats

    sync, clock = _sync_fn(device), clock_fn(device)
    ids = context_ids.to(device)
    T = ids.shape[1]
    if question_ids.shape[1] == 0:  # a query-aware context with no template after it: the decode (timed only)
        question_ids = context_ids[:, -1:]  # starts from a repeat of the context's last token
    prefill, press_s, decode, peaks, deltas = [], [], [], [], []
    for _ in range(max(1, int(repeats))):
        mem = PeakMemory(device)
        mem.start()
        cache = DynamicCache()
        timer = HookTimer(press, sync, clock)
        with torch.inference_mode():
            sync()
            start = clock()
            with timer, press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=ids, past_key_values=cache)
            sync()
            prefill.append(clock() - start)
            press_s.append(timer.seconds)
            full, physical = kv_bytes(cache, T)
            stats = press.summary() if press is not None and hasattr(press, "summary") else {}
            logical = full * (1 - cache_stats(cache, model, T, press)["effective_compression"])
            decode.append(greedy_decode(model, cache, question_ids, T, decode_tokens, sync, clock))
        peak, delta = mem.stop()
        peaks.append(peak)
        deltas.append(delta)
        del cache
    decode_s = statistics.median(decode)
    return {
        "context_length": T,
        "repeats": len(prefill),
        "prefill_s": statistics.median(prefill),
        "press_s": statistics.median(press_s),
        "decode_tokens": int(decode_tokens),
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s and math.isfinite(decode_s) else math.nan,
        "kv_full_bytes": int(full),
        "kv_physical_bytes": int(physical),
        "kv_logical_bytes": int(round(logical)),
        "physical_vs_full": physical / full,
        "logical_vs_full": logical / full,
        "peak_mem_mb": max(peaks),
        "peak_mem_delta_mb": max(deltas),
        "mem_method": mem.method,
        "press_stats": json.dumps(stats, default=str, sort_keys=True),
    }
