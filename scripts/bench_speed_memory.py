"""Speed and memory of every press (issue 8): prefill time, press overhead vs SnapKV, decode tokens/s,
KV-cache bytes (physical and logical) against the full cache, and peak memory.

Usage (``configs/bench_speed_memory.yaml``; one command from a fresh clone)::

    python scripts/bench_speed_memory.py
    python scripts/bench_speed_memory.py lengths=[256] presses=[snapkv,page_entrokv] compression_ratios=[0.5] \\
        decode_tokens=8 output_dir=/tmp/sm_smoke

For each context length ``T`` (ascending), compression ratio and press, one row of
``<output_dir>/speed_memory.csv`` holds (times in seconds, bytes in bytes, memory in MiB):

* ``prefill_s``: wall time of the prefill call ``model.model(input_ids, cache)`` inside ``with press(model)``
  (kvpress pipeline's own prefill), press hooks included; ``prefill_ratio_vs_full`` divides it by the
  uncompressed prefill on the same context measured in the same run (``full_prefill_s``).
* ``press_s``: wall time spent inside the press's compression hooks during the prefill, summed over layers:
  ``forward_hook`` (kvpress's hook that calls ``compress``; EntroPrefill's monitoring hook), plus the press
  contract's ``model_hooks`` (the SNIS press's deferred global eviction, EntroPrefill's chunk
  planning and layer hooks). On CUDA each hook is bracketed by
  ``torch.cuda.synchronize``. ``overhead_ratio = press_s / snapkv_press_s``, SnapKV measured at the same
  ``T`` and ratio in the same run (always, even when not listed); ``no_press`` has ``press_s = 0``.
* ``decode_tok_s``: after the prefill, the question (plus answer prefix) is fed at positions ``T..``
  (as kvpress's pipeline does), then ``decode_tokens`` greedy single-token steps are timed, EOS ignored,
  outside the press context (the SNIS press's decode-time bias stays on the attention modules).
* ``kv_full_bytes``: ``2 L B G T d e`` (keys and values of every context token, the cache's dtype);
  ``kv_physical_bytes``: the key and value tensors actually held after the prefill (padded shapes);
  ``kv_logical_bytes``: the kept (unmasked, unpadded) entries (:func:`evaluation.harness.cache_stats`: the press's
  own count, or the cache minus AdaKV-style masked keys).
* ``peak_mem_mb`` / ``peak_mem_delta_mb``: on CPU the process's peak RSS (``VmHWM``) over the row, reset
  before the row by writing ``5`` to ``/proc/self/clear_refs``, and its excess over the RSS at the row's
  start; on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` and its excess
  over ``memory_allocated`` at the start. ``mem_method`` names the method (``ru_maxrss``, monotone over
  the process, when ``clear_refs`` is not writable).

Rows are written atomically as they finish; a rerun skips rows already in the csv (failed rows, with an
``error``, are retried) and re-measures the SnapKV / full-prefill references it needs, so every ratio is
taken within one run (``snapkv_press_s`` and ``full_prefill_s`` are stored beside it). ``time_limit_s``
stops the sweep cleanly. ``README.md`` (tables and the command) and the plots are rebuilt from the csv.
``compare_with`` names earlier csv files (relative to ``output_dir``), e.g. a copy kept before a change: the README
then has a before / after table of the rows measured again (remove rows from the csv to have them re-measured).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import gc
import io
import json
import logging
import math
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from evaluation.harness import (  # noqa: E402
    CONFIG_DIR,
    cache_stats,
    check_ratio,
    command_line,
    compose_config,
    config_choices,
    write_atomic,
)
from evaluation.registry import capabilities  # noqa: E402

logger = logging.getLogger("bench_speed_memory")


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


#: Columns of speed_memory.csv, in order.
COLUMNS = [
    "model",
    "device",
    "dtype",
    "press",
    "compression_ratio",
    "T",
    "context_length",
    "context",
    "repeats",
    "prefill_s",
    "full_prefill_s",
    "prefill_ratio_vs_full",
    "press_s",
    "snapkv_press_s",
    "overhead_ratio",
    "decode_tokens",
    "decode_s",
    "decode_tok_s",
    "kv_full_bytes",
    "kv_physical_bytes",
    "kv_logical_bytes",
    "physical_vs_full",
    "logical_vs_full",
    "peak_mem_mb",
    "peak_mem_delta_mb",
    "mem_method",
    "press_stats",
    "error",
    "timestamp",
    "threads",
]
REFERENCE = "snapkv"
NO_PRESS = "no_press"
GPU_TIME_LIMIT_S = 480.0
CSV_NAME = "speed_memory.csv"


# ---------------------------------------------------------------------------------------------- timing, memory
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

    def __init__(self, press, sync=lambda: None):
        self.press, self.sync = press, sync
        self.seconds, self.calls = 0.0, 0
        self._depth = 0
        self._patched: list[str] = []

    def _wrap(self, fn):
        @functools.wraps(fn)  # keeps __wrapped__: the press contract recognises its own (timed) hooks
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.sync()
                self.seconds += time.perf_counter() - start
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


# ---------------------------------------------------------------------------------------------- presses
def press_config(name: str, overrides: dict | None = None) -> DictConfig:
    """The ``configs/press/<name>.yaml`` node, with ``overrides`` merged in.

    Raises:
        ValueError: for a name with no config (lists the valid ones).
    """
    if name not in config_choices("press"):
        raise ValueError(f"unknown press '{name}'; valid: {', '.join(config_choices('press'))}")
    # composed by Hydra, so a config's defaults list (e.g. configs/press/base/snis.yaml) is merged in
    node = OmegaConf.create(OmegaConf.to_container(compose_config([f"press={name}"]).press, resolve=False))
    if overrides:
        node = OmegaConf.merge(node, OmegaConf.create(dict(overrides)))
    return node


def make_press(name: str, compression_ratio: float, seed: int, tokenizer=None, overrides: dict | None = None):
    """Instantiate the press config ``name`` (as ``evaluation.run`` does with ``cfg.press``) at a ratio.

    The config's ``${compression_ratio}`` and ``${seed}`` resolve to the arguments; a press class with a
    ``tokenizer`` field (EntroPrefill) receives ``tokenizer``. Returns None for ``no_press``.

    Raises:
        ValueError: unknown press name, or ``compression_ratio`` outside ``[0, 1)``.
    """
    from hydra.utils import get_class, instantiate

    ratio = check_ratio(compression_ratio)
    node = press_config(name, overrides)
    if not node.get("_target_"):
        return None
    root = OmegaConf.create({"compression_ratio": ratio, "seed": int(seed), "press": node})
    extra = {}
    cls = get_class(root.press._target_)
    if (
        tokenizer is not None
        and dataclasses.is_dataclass(cls)
        and "tokenizer" in {f.name for f in dataclasses.fields(cls)}
    ):
        extra["tokenizer"] = tokenizer
    return instantiate(root.press, **extra)


# ---------------------------------------------------------------------------------------------- contexts
MIN_CONTEXT_FRACTION = 0.8
"""A context must reach this fraction of its target length ``T`` to be measured as length ``T``."""


def build_context(ds_cfg: DictConfig, pipe, tokenizer, T: int, seed: int, query_aware: bool):
    """Token ids of one prose context of about ``T`` tokens (chat template included) and its question.

    ``ds_cfg`` is a dataset config (``_target_`` + parameters); its length argument (``context_length``
    or ``context_lengths``) is set to ``T`` minus the chat template's own tokens.

    Returns:
        ``(context_ids (1, T'), question_ids (1, q))`` on the CPU; ``question_ids`` holds the question
        (empty when ``query_aware``), the template suffix and the answer prefix, as kvpress's pipeline.

    Raises:
        ValueError: when the dataset cannot build a context that short, or builds one shorter than
            ``MIN_CONTEXT_FRACTION`` of ``T`` (e.g. a multi-document context that runs out of passages).
    """
    from hydra.utils import get_class, instantiate

    overhead = pipe.preprocess("", [""], "", int(1e10))["context_ids"].shape[1]
    n = int(T) - overhead
    fields = {f.name for f in dataclasses.fields(get_class(ds_cfg._target_))}
    length = {"context_length": n} if "context_length" in fields else {"context_lengths": [n]}
    dataset = instantiate(ds_cfg, **length)
    example = dataset.examples(tokenizer, 1, seed, query_aware)[0]
    inputs = pipe.preprocess(example.context, [example.question], example.answer_prefix, int(1e10))
    if inputs["context_ids"].shape[1] < MIN_CONTEXT_FRACTION * T:
        raise ValueError(
            f"{ds_cfg._target_} built a context of {inputs['context_ids'].shape[1]} tokens for T={T}, "
            f"below {MIN_CONTEXT_FRACTION:.0%} of T: the dataset stops short of T (multi-document contexts "
            "add whole passages, at most 40 with fact_kinds=[city] and 200 with [code])"
        )
    return inputs["context_ids"], inputs["questions_ids"][0]


# ---------------------------------------------------------------------------------------------- one measurement
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


def greedy_decode(model, cache, question_ids, context_length: int, n_tokens: int, sync) -> float:
    """Feed ``question_ids`` at positions ``context_length..`` then time ``n_tokens`` greedy single-token
    steps (EOS ignored). Returns the seconds of those steps (``nan`` for ``n_tokens == 0``)."""
    import torch

    device = model.device
    q = question_ids.to(device)
    pos = torch.arange(context_length, context_length + q.shape[1], device=device).unsqueeze(0)
    out = model(input_ids=q, past_key_values=cache, position_ids=pos, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    next_pos = int(pos[0, -1]) + 1
    if n_tokens <= 0:
        return math.nan
    sync()
    start = time.perf_counter()
    for i in range(n_tokens):
        out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[next_pos + i]], device=device))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    return time.perf_counter() - start


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

    sync = _sync_fn(device)
    ids = context_ids.to(device)
    T = ids.shape[1]
    prefill, press_s, decode, peaks, deltas = [], [], [], [], []
    for _ in range(max(1, int(repeats))):
        mem = PeakMemory(device)
        mem.start()
        cache = DynamicCache()
        timer = HookTimer(press, sync)
        with torch.inference_mode():
            sync()
            start = time.perf_counter()
            with timer, press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=ids, past_key_values=cache)
            sync()
            prefill.append(time.perf_counter() - start)
            press_s.append(timer.seconds)
            full, physical = kv_bytes(cache, T)
            stats = press.summary() if press is not None and hasattr(press, "summary") else {}
            logical = full * (1 - cache_stats(cache, model, T, press)["effective_compression"])
            decode.append(greedy_decode(model, cache, question_ids, T, decode_tokens, sync))
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


# ---------------------------------------------------------------------------------------------- csv
def row_key(row: dict) -> tuple[str, str, str, int]:
    """Resume key of a row: ``(model, press, ratio, T)``."""
    return str(row["model"]), str(row["press"]), f"{float(row['compression_ratio']):g}", int(float(row["T"]))


def read_rows(path: Path) -> list[dict]:
    """Rows of ``speed_memory.csv`` (strings), or ``[]``."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: Path, rows: list[dict]) -> None:
    """Rewrite the csv atomically, rows sorted by model, T, ratio, press."""
    rows = sorted(
        rows, key=lambda r: (str(r["model"]), int(float(r["T"])), float(r["compression_ratio"]), str(r["press"]))
    )
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------- the sweep
def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda:0`` when torch sees a GPU, else ``cpu``."""
    import torch

    if str(device) == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return str(device)


def resolve_time_limit(time_limit_s, device: str) -> float:
    """Seconds allowed for the sweep: ``auto`` is 480 on CUDA and unlimited on CPU; null is unlimited.

    Raises:
        ValueError: for a non-positive number.
    """
    if time_limit_s in (None, "null"):
        return math.inf
    if str(time_limit_s) == "auto":
        return GPU_TIME_LIMIT_S if device.startswith("cuda") else math.inf
    limit = float(time_limit_s)
    if not limit > 0:
        raise ValueError(f"time_limit_s={time_limit_s} must be > 0 seconds (or null / auto)")
    return limit


def validate(cfg: DictConfig) -> tuple[list[str], list[float], list[int]]:
    """Check the sweep's lists; returns ``(presses, ratios, lengths)`` (lengths ascending).

    Raises:
        ValueError: unknown press, ratio outside ``[0, 1)``, a length ``< 64``, ``decode_tokens < 0``,
            ``repeats < 1``, or an empty list.
    """
    presses = [str(p) for p in cfg.presses]
    for p in [*presses, *cfg.get("query_aware_presses", [])]:
        press_config(p)
    ratios = [check_ratio(r) for r in cfg.compression_ratios]
    lengths = sorted({int(t) for t in cfg.lengths})
    if not presses or not ratios or not lengths:
        raise ValueError(f"presses={presses}, compression_ratios={ratios} and lengths={lengths} must be non-empty")
    bad = [t for t in lengths if t < 64]
    if bad:
        raise ValueError(f"lengths {bad} must be >= 64 tokens")
    if int(cfg.decode_tokens) < 0:
        raise ValueError(f"decode_tokens={cfg.decode_tokens} must be >= 0")
    if int(cfg.repeats) < 1:
        raise ValueError(f"repeats={cfg.repeats} must be >= 1")
    return presses, ratios, lengths


def run_bench(
    cfg: DictConfig,
    model,
    tokenizer,
    model_name: str,
    device: str,
    command: str = "",
    time_limit_s: float = math.inf,
    notes: list[str] | None = None,
) -> list[dict]:
    """Run the sweep of ``cfg`` on an already loaded model and write the csv, README and plots.

    Args:
        cfg: the bench config (``configs/bench_speed_memory.yaml``).
        model, tokenizer: the model on ``device`` and its tokenizer (a tiny model can be injected).
        model_name: the ``model`` column (resume key).
        command: the command line recorded in the README.
        time_limit_s: stop starting new measurements after this many seconds (from this call).
        notes: extra README lines (e.g. a model fallback).

    Returns:
        every row of the csv after the sweep (this run's and earlier ones).

    Raises:
        ValueError: see :func:`validate`.
    """
    import torch
    from kvpress import KVPressTextGenerationPipeline

    from presses import attention

    t_start = time.perf_counter()
    presses, ratios, lengths = validate(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / CSV_NAME
    rows = read_rows(csv_path)
    done = {row_key(r) for r in rows if not r.get("error")}
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    query_aware = set(cfg.get("query_aware_presses", []))
    overrides = OmegaConf.to_container(cfg.press_overrides, resolve=True) if cfg.get("press_overrides") else {}
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device(device))
    attention.install()  # every press runs through the same (wrapped) attention function
    warmed: set[str] = set()
    stopped = False

    def over_time() -> bool:
        return time.perf_counter() - t_start > time_limit_s

    for T in lengths:
        # what this T needs: press rows not yet done, per ratio (no_press only at ratio 0)
        todo = {r: [p for p in presses if p != NO_PRESS and (model_name, p, f"{r:g}", T) not in done] for r in ratios}
        need_full = (model_name, NO_PRESS, "0", T) not in done  # the full-prefill row is always saved
        if not need_full and not any(todo.values()):
            continue
        contexts: dict[str, tuple] = {}
        full_ref: dict[str, float] = {}

        def context(kind: str):
            if kind not in contexts:
                contexts[kind] = build_context(
                    cfg.contexts[kind], pipe, tokenizer, T, int(cfg.seed), kind == "query_aware"
                )
            return contexts[kind]

        def measure(name: str, ratio: float, kind: str) -> dict:
            press = make_press(name, ratio, int(cfg.seed), tokenizer, overrides.get(name))
            ids, q_ids = context(kind)
            if cfg.warmup and name not in warmed:
                measure_row(model, press, ids, q_ids, min(2, int(cfg.decode_tokens)), device)
                warmed.add(name)
            logger.info("T=%d ratio=%g %s (%s context, %d tokens)", T, ratio, name, kind, ids.shape[1])
            return measure_row(model, press, ids, q_ids, int(cfg.decode_tokens), device, int(cfg.repeats))

        def full_prefill(kind: str) -> float:
            """The uncompressed prefill time on this T's ``kind`` context (measured once per run)."""
            if kind not in full_ref:
                res = measure(NO_PRESS, 0.0, kind)
                full_ref[kind] = res["prefill_s"]
                if kind == "default" and need_full:
                    save(NO_PRESS, 0.0, kind, res, res["prefill_s"], math.nan)
            return full_ref[kind]

        def save(name, ratio, kind, res, full_s, snap_s, error=""):
            row = {
                "model": model_name,
                "device": device,
                "dtype": dtype,
                "press": name,
                "compression_ratio": ratio,
                "T": T,
                "context": kind,
                **res,
                "full_prefill_s": full_s,
                "snapkv_press_s": snap_s,
                "error": error,
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "threads": torch.get_num_threads(),
            }
            if not error:
                row["prefill_ratio_vs_full"] = res["prefill_s"] / full_s if full_s else math.nan
                row["overhead_ratio"] = (
                    0.0 if name == NO_PRESS else res["press_s"] / snap_s if snap_s and snap_s > 0 else math.nan
                )
            rows[:] = [r for r in rows if row_key(r) != row_key(row)] + [row]
            write_rows(csv_path, rows)
            if not error:
                done.add(row_key(row))
            logger.info(
                "  -> %s",
                {
                    k: row.get(k)
                    for k in (
                        "prefill_s",
                        "press_s",
                        "overhead_ratio",
                        "decode_tok_s",
                        "physical_vs_full",
                        "peak_mem_mb",
                    )
                },
            )

        try:
            if over_time():
                stopped = True
                break
            full_s = full_prefill("default")
            for ratio in ratios:
                if not todo[ratio]:
                    continue
                if over_time():
                    stopped = True
                    break
                snap = measure(REFERENCE, ratio, "default")  # the run's own reference, always measured
                if (model_name, REFERENCE, f"{ratio:g}", T) not in done:  # saved even when not listed
                    save(REFERENCE, ratio, "default", snap, full_s, snap["press_s"])
                for name in todo[ratio]:
                    if name == REFERENCE:
                        continue
                    if over_time():
                        stopped = True
                        break
                    kind = "query_aware" if name in query_aware else "default"
                    try:
                        res = measure(name, ratio, kind)
                        save(name, ratio, kind, res, full_prefill(kind), snap["press_s"])
                    except Exception as err:  # a press that fails here must not lose the other rows
                        logger.exception("%s at T=%d ratio=%g failed", name, T, ratio)
                        save(name, ratio, kind, {}, math.nan, snap["press_s"], error=f"{type(err).__name__}: {err}")
                if stopped:
                    break
        finally:
            contexts.clear()
        if stopped:
            break
    if stopped:
        logger.warning(
            "time_limit_s=%g reached after %.0f s: wrote the rows done so far; rerun to resume",
            time_limit_s,
            time.perf_counter() - t_start,
        )
    rows = read_rows(csv_path)
    lines = list(notes or [])
    if stopped:
        lines.append(
            f"**Incomplete**: the time limit ({time_limit_s:g} s) stopped the sweep; rerun the command to resume."
        )
    write_report(out, rows, cfg, command, device, lines, time.perf_counter() - t_start)
    return rows


# ---------------------------------------------------------------------------------------------- report
def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _fmt(x, spec: str) -> str:
    v = _num(x)
    return "-" if not math.isfinite(v) else format(v, spec)


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
                f"{_fmt(old['prefill_ratio_vs_full'], '.2f')} | {_fmt(new['prefill_ratio_vs_full'], '.2f')} | "
                f"{_fmt(_num(old['press_s']) * 1e3, '.1f')} | {_fmt(_num(new['press_s']) * 1e3, '.1f')} | "
                f"{_fmt(old['overhead_ratio'], '.2f')} | {_fmt(new['overhead_ratio'], '.2f')} |"
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
        "How to read: `prefill s` is the prefill call (press included); `vs full` divides it by the uncompressed "
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
                    + " | ".join(_fmt(cell[t]["overhead_ratio"], ".2f") if t in cell else "-" for t in Ts)
                    + " | "
                    + " | ".join(_fmt(cell[t]["physical_vs_full"], ".3f") if t in cell else "-" for t in Ts)
                    + " |"
                )
        lines.append("")
        for t in Ts:
            trows = sorted(
                [r for r in mrows if int(float(r["T"])) == t],
                key=lambda r: (float(r["compression_ratio"]), presses.index(r["press"])),
            )
            n_ctx = sorted({r["context_length"] for r in trows})
            lines += [
                f"## {model}, T = {t} (context tokens: {', '.join(n_ctx)})",
                "",
                "| press | ratio | prefill s | vs full | press ms | overhead vs SnapKV | decode tok/s | "
                "KV full MiB | physical | logical | peak MiB | +MiB |",
                "|" + "---|" * 12,
            ]
            for r in trows:
                lines.append(
                    f"| {r['press']} | {float(r['compression_ratio']):g} | {_fmt(r['prefill_s'], '.3f')} | "
                    f"{_fmt(r['prefill_ratio_vs_full'], '.2f')} | {_fmt(_num(r['press_s']) * 1e3, '.1f')} | "
                    f"{_fmt(r['overhead_ratio'], '.2f')} | {_fmt(r['decode_tok_s'], '.1f')} | "
                    f"{_fmt(_num(r['kv_full_bytes']) / 2**20, '.2f')} | {_fmt(r['physical_vs_full'], '.3f')} | "
                    f"{_fmt(r['logical_vs_full'], '.3f')} | {_fmt(r['peak_mem_mb'], '.0f')} | "
                    f"{_fmt(r['peak_mem_delta_mb'], '.0f')} |"
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
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(presses)}

    def series(press, ratio, col):
        pts = sorted(
            (int(float(r["T"])), _num(r[col]))
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
        fig, axes = plt.subplots(1, len(ratios), figsize=(5.5 * len(ratios), 4), squeeze=False)
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
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        tmp = out / f".{fname}.tmp{os.getpid()}"
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, out / fname)


# ---------------------------------------------------------------------------------------------- entry point
def load_bench_model(cfg: DictConfig, device: str, attn_implementation: str | None = None):
    """Load the model of ``cfg.model`` (``auto``: ``gpu_model`` on CUDA with ``fallback_model`` when it does
    not load, ``fallback_model`` on CPU) using its ``configs/model/<name>.yaml`` (dtype, path, attention).

    Returns:
        ``(model, tokenizer, name, notes)``; ``notes`` says why a fallback happened.

    Raises:
        ValueError: for an unknown model name.
    """
    from evaluation.models import load_model

    notes = []
    if str(cfg.model) == "auto":
        names = (
            [str(cfg.gpu_model), str(cfg.fallback_model)] if device.startswith("cuda") else [str(cfg.fallback_model)]
        )
    else:
        names = [str(cfg.model)]
    for i, name in enumerate(names):
        if name not in config_choices("model"):
            raise ValueError(f"unknown model '{name}'; valid: {', '.join(config_choices('model'))}")
        mcfg = OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml")
        try:
            model, tok = load_model(
                mcfg.name,
                device=device,
                dtype=mcfg.get("dtype"),
                attn_implementation=attn_implementation or mcfg.get("attn_implementation", "sdpa"),
                path=mcfg.get("path"),
            )
            return model, tok, name, notes
        except (OSError, ValueError, ImportError) as err:
            if i == len(names) - 1:
                raise
            notes.append(
                f"Model `{name}` could not be loaded ({type(err).__name__}: {str(err)[:200]}); "
                f"fell back to `{names[i + 1]}`."
            )
            logger.warning(notes[-1])
    raise AssertionError("unreachable")


@hydra.main(config_path="../configs", config_name="bench_speed_memory", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point (``configs/bench_speed_memory.yaml``)."""
    import torch

    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = resolve_device(cfg.device)
    limit = resolve_time_limit(cfg.time_limit_s, device)
    presses, ratios, _ = validate(cfg)
    probes = [make_press(p, ratios[0], int(cfg.seed)) for p in presses]
    attn = "eager" if any(capabilities(p).needs_eager for p in probes) else None
    model, tok, name, notes = load_bench_model(cfg, device, attn)
    if attn:
        notes.append("A listed press reads attention weights: every press ran with eager attention.")
    logger.info("loaded %s on %s in %.1f s", name, device, time.perf_counter() - t0)
    command = command_line("python scripts/bench_speed_memory.py")
    run_bench(cfg, model, tok, name, device, command, limit - (time.perf_counter() - t0), notes)


if __name__ == "__main__":
    main()
