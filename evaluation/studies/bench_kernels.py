"""Benchmark the scoring kernels of :mod:`presses.kernels`: torch reference vs Triton (issue 7).

For each kernel and each context length T (default 4k, 16k, 64k) the reference and the Triton kernel
run in the same process on the same inputs; the script reports both times (CUDA events, median),
their ratio, the achieved memory bandwidth of the Triton kernel (ideal bytes moved / time) against
the device's peak and against a measured device-to-device copy, the kernel's arithmetic intensity
(estimated FLOPs / ideal bytes) and whether it is memory- or compute-bound at these shapes (``bound``),
the peak extra memory of each implementation, and the max difference between them.
It writes one CSV per kernel to ``--out`` (default ``results/kernels``). A wall-clock guard (default
420 s) skips a reference whose predicted time would not fit, so the whole run stays under 8 minutes.

Shapes (Llama-3-8B-like attention layer, bf16): B = 1, H_Q = 32, G = 8 (r = 4), d = 128, W = 64,
page_size = 16; ``E[J]`` scores 63 candidates (6 binary-search levels) for L x G = 32 x 8 rows; EntroPrefill's
row kernel reads the W_p = 8 proposal rows (chunk masses and their average) or 256 audit rows (chunk masses),
over chunks of 128 tokens covering 90% of the keys.

Usage (``python -m evaluation.studies.bench_kernels`` is the same):
    python scripts/bench_kernels.py                   # on a CUDA machine
    python scripts/bench_kernels.py --dry-run         # CPU plumbing check: TRITON_INTERPRET, tiny shapes
    python scripts/bench_kernels.py --out results/gpu/kernels --budget-s 150   # as scripts/gpu_check.sh runs it

``--dry-run`` writes to ``<out>/dry_run/`` and labels every row as a plumbing check: its times are those
of the Triton interpreter on toy shapes and mean nothing.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from evaluation.cli import ArgumentParser
from evaluation.studies import REPO
from evaluation.tables import write_rows

# device peak bandwidths (bytes/s) when the driver does not report memory clock and bus width
PEAK_BW_BY_NAME = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 8.64e11,
    "L4": 3.0e11,
    "4090": 1.008e12,
}


KERNELS = (
    "window_attention",
    "column_sums_h2o_h",
    "pooled_page_scores",
    "expected_unique_many",
    "biased_decode",
    "biased_decode_vs_sdpa_mask",
    "row_chunk_masses_proposal",
    "row_chunk_masses_audit",
)


@dataclass
class Case:
    kernel: str
    T: int
    shape: str
    dtype: str
    ideal_bytes: int
    flops: float  # estimated floating-point operations of the Triton kernel (for the intensity)
    bound: str  # "memory" or "compute" at the benchmark's shapes (see the comment where the case is built)
    reference: object  # () -> tensor
    triton: object  # () -> tensor
    ref_cost_exp: float  # how the reference's time grows with T (for the time guard)


def _parse(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET, tiny shapes: plumbing only")
    p.add_argument("--lengths", default=None, help="comma-separated T values (default 4096,16384,65536)")
    p.add_argument("--out", default=str(REPO / "results" / "kernels"))
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock guard for the whole run")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth override (GB/s)")
    p.add_argument("--kernels", default=None, help="comma-separated subset of: " + ", ".join(KERNELS))
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 20; 3 dry run)")
    return p.parse_args(argv)


def peak_bandwidth(torch, device, override_gbps):
    """Device peak memory bandwidth in bytes/s (override, driver clock x bus width, name table, or NaN)."""
    if override_gbps:
        return override_gbps * 1e9, "--peak-gbps"
    if device.type != "cuda":
        return float("nan"), "n/a (CPU)"
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8, "memory_clock_rate x memory_bus_width"
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        return 2.0 * clock_mhz * 1e6 * bus_bits / 8, "nvml"
    except Exception:  # any NVML failure falls back to the table
        pass
    for key, bw in PEAK_BW_BY_NAME.items():
        if key in props.name:
            return bw, f"table ({key})"
    return float("nan"), "unknown device"


def copy_bandwidth(torch, device, n_bytes: int = 1 << 30) -> float:
    """Achieved bytes/s (read + write) of a ``n_bytes`` device-to-device copy, median of 10 after a
    warm-up (the practical ceiling a memory-bound kernel can approach); NaN off CUDA."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (n_bytes // 2) * 2 / statistics.median(times)


def bench_shapes(torch, dry: bool) -> tuple:
    """``(B, H_Q, G, d, W, page_size, dtype, L, M, query_block)`` of the benchmark (module docstring), or toy
    shapes for the dry run."""
    if dry:
        return 1, 4, 2, 16, 16, 16, torch.float32, 2, 7, 32
    return 1, 32, 8, 128, 64, 16, torch.bfloat16, 32, 63, 128


ROW_MASS_CASES = {"row_chunk_masses_proposal": (8, True), "row_chunk_masses_audit": (256, False)}
"""EntroPrefill's row-kernel cases: name -> (rows, with the weighted average)."""


def row_mass_inputs(torch, keys, n_heads: int, randn, gen, n_rows: int, average: bool, dry: bool) -> tuple:
    """Inputs of one EntroPrefill row-kernel case (paper 001 eqs. 2, 14, 17) over ``keys`` ``(B, G, T, d)`` for
    ``n_heads`` query heads: chunks of 128 keys (16 in the dry run) after 5% instructions, before a 5% question;
    ``n_rows`` proposal rows (the last ones, with uniform average weights) or audit rows (distinct question
    positions, at most the question's length). ``randn(*shape)`` draws the queries, ``gen`` the audit positions.

    Returns:
        ``(queries (B, H_Q, n, d), rows (n,), ids (T,), num_chunks, row_weights (n,) or None)``.
    """
    from presses.core.row_masses import chunk_ids

    B, _, T, d = keys.shape
    device = keys.device
    cs = 16 if dry else 128
    lo, hi = T // 20, T - T // 20
    ids = chunk_ids(T, [(s0, min(s0 + cs, hi)) for s0 in range(lo, hi, cs)], device)
    n_rows = n_rows if average else min(n_rows, T - hi)
    qr = randn(B, n_heads, n_rows, d)
    rows = (
        torch.arange(T - n_rows, T, device=device)
        if average
        else torch.randperm(T - hi, generator=gen, device=device)[:n_rows] + hi
    )
    w = torch.full((n_rows,), 1.0 / n_rows, device=device) if average else None
    return qr, rows, ids, int(ids.max()) + 1, w


def build_cases(torch, device, lengths, dry, only):
    from presses.core.columns import column_sums as column_sums_reference
    from presses.core.observer import observer_attention_reference
    from presses.core.row_masses import row_chunk_masses_reference
    from presses.kernels.attention_columns import column_sums_triton, window_attention_triton
    from presses.kernels.biased_decode import biased_decode_triton
    from presses.kernels.expected_unique import expected_unique_many_triton
    from presses.kernels.references import (
        biased_decode_reference,
        expected_unique_many_reference,
        pooled_page_scores_reference,
    )
    from presses.kernels.renyi_pages import pooled_page_scores_triton
    from presses.kernels.row_masses import row_chunk_masses_triton
    from presses.probabilistic.proposals import harmonic_prior

    B, HQ, G, d, W, page, dtype, L, M, qblock = bench_shapes(torch, dry)
    r = HQ // G
    e = torch.finfo(dtype).bits // 8
    dname = str(dtype).replace("torch.", "")
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    def want(name):
        return not only or name in only

    for T in lengths:
        keys = randn(B, G, T, d)
        if want("window_attention"):
            q = randn(B, HQ, W, d)
            yield Case(
                "window_attention",
                T,
                f"B={B} H_Q={HQ} G={G} W={W} d={d}",
                dname,
                keys.numel() * e + q.numel() * e + B * HQ * T * 4,
                4.0 * B * HQ * W * T * d,  # two passes over K, one W x T x d product each
                "compute",  # ~480 FLOP/byte at W=64, r=4, d=128: above any GPU's bf16 ridge point
                lambda q=q, k=keys: observer_attention_reference(q, k),
                lambda q=q, k=keys: window_attention_triton(q, k),
                1.0,
            )
        if want("column_sums_h2o_h"):
            qa = randn(B, HQ, T, d)
            prior = harmonic_prior(T, device)

            def ref_cs(qa=qa, k=keys, prior=prior, T=T):  # the press's query-block loop, all T rows
                out = None
                for s in range(0, T, qblock):
                    rows = torch.arange(s, min(s + qblock, T), device=device)
                    part = column_sums_reference(qa[:, :, s : s + qblock], k, prior[s : s + qblock], rows)
                    out = part if out is None else out + part
                return out

            yield Case(
                "column_sums_h2o_h",
                T,
                f"B={B} H_Q={HQ} G={G} rows=T d={d} (query blocks of {qblock})",
                dname,
                keys.numel() * e + qa.numel() * e + B * HQ * T * 4,
                2.0 * B * HQ * T * T * d,  # two passes, each ~T^2/2 causal q.k products of 2d FLOPs
                "compute",  # O(T^2 d) work on O(T d) bytes
                ref_cs,
                lambda qa=qa, k=keys, prior=prior, T=T: column_sums_triton(
                    qa, k, prior, torch.arange(T, device=device)
                ),
                2.0,
            )
        if want("pooled_page_scores"):
            attn = torch.softmax(randn(B, HQ, T, dt=torch.float32) * 4, -1)
            P = -(-T // page)
            yield Case(
                "pooled_page_scores",
                T,
                f"B={B} H_Q={HQ} G={G} page_size={page} alpha=2 entropy",
                "float32",
                3 * attn.numel() * 4 + B * G * (T + P) * 4,
                20.0 * attn.numel(),  # a few elementwise passes (powers, logs, pooling, page max)
                "memory",  # ~1.5 FLOP/byte
                lambda a=attn: pooled_page_scores_reference(a, G, 4, 2.0, 0.5, "entropy", page, "block_max")[1],
                lambda a=attn: pooled_page_scores_triton(a, G, 4, 2.0, 0.5, "entropy", page, "block_max")[1],
                1.0,
            )
        if want("expected_unique_many"):
            pi = torch.softmax(randn(L * G, T, dt=torch.float64) * 3, -1)
            m = torch.logspace(0, 12, M, device=device, dtype=torch.float64).round()
            yield Case(
                "expected_unique_many",
                T,
                f"rows=L*G={L * G} M={M} candidates",
                "float64",
                pi.numel() * 8 + L * G * M * 8,
                4.0 * pi.numel() * M,  # one float64 log1p + exp + multiply-add per (row, key, m)
                "compute",  # ~30 float64 FLOP/byte (transcendentals), above the float64 ridge (~14 on H100/H200)
                lambda pi=pi, m=m: expected_unique_many_reference(pi, m),
                lambda pi=pi, m=m: expected_unique_many_triton(pi, m),
                1.0,
            )
        for name, (n_rows, average) in ROW_MASS_CASES.items():
            if not want(name):
                continue
            qr, rows, ids, k, w = row_mass_inputs(torch, keys, HQ, randn, gen, n_rows, average, dry)
            n_rows = len(rows)

            def flat(out):
                return out[0].flatten() if out[1] is None else torch.cat([out[0].flatten(), out[1].flatten()])

            yield Case(
                name,
                T,
                f"B={B} H_Q={HQ} G={G} rows={n_rows} chunks={k} d={d}" + (" +average" if average else ""),
                dname,
                keys.numel() * e
                + qr.numel() * e
                + T * 4
                + B * HQ * n_rows * k * 4
                + (B * HQ * T * 4 if average else 0),
                # q.k and the one-hot chunk product (float32 masses, on the tensor cores as three TF32 products:
                # presses.kernels.row_masses) in one pass; the average: a second q.k pass
                2.0 * B * HQ * n_rows * T * (d + min(128, k)) + (4.0 * B * HQ * n_rows * T * d if average else 0),
                "compute",  # ~250 FLOP/byte (audit rows) and ~20 (proposal rows): T x rows x (d + chunk tile)
                lambda q=qr, k_=keys, rows=rows, ids=ids, k=k, w=w: flat(
                    row_chunk_masses_reference(q, k_, rows, ids, k, w)
                ),
                lambda q=qr, k_=keys, rows=rows, ids=ids, k=k, w=w: flat(
                    row_chunk_masses_triton(q, k_, rows, ids, k, w)
                ),
                1.0,
            )
        if want("biased_decode") or want("biased_decode_vs_sdpa_mask"):
            qd, vals = randn(B, HQ, 1, d), randn(B, G, T, d)
            bias = randn(B, G, T, dt=torch.float32)
            bias[..., T - T // 10 :] = float("-inf")  # padded tail
            decode = dict(  # what the two decode cases share: the Triton kernel and its traffic
                T=T,
                dtype=dname,
                ideal_bytes=2 * keys.numel() * e + bias.numel() * 4 + 2 * qd.numel() * e,
                flops=4.0 * B * HQ * T * d,  # q.k and p.v
                bound="memory",  # ~4 FLOP/byte
                triton=lambda q=qd, k=keys, v=vals, b=bias: biased_decode_triton(q, k, v, b),
                ref_cost_exp=1.0,
            )
        if want("biased_decode"):
            yield Case(
                "biased_decode",
                shape=f"B={B} H_Q={HQ} G={G} K=T d={d} (10% padding)",
                reference=lambda q=qd, k=keys, v=vals, b=bias: biased_decode_reference(q, k, v, b),
                **decode,
            )
        if want("biased_decode_vs_sdpa_mask"):
            # the path the SNIS press takes today: sdpa with a (B, H_Q, 1, K) float mask (bias_mask)
            yield Case(
                "biased_decode_vs_sdpa_mask",
                shape=f"B={B} H_Q={HQ} G={G} K=T d={d}",
                reference=lambda q=qd, k=keys, v=vals, b=bias: torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k.repeat_interleave(r, 1),
                    v.repeat_interleave(r, 1),
                    attn_mask=b.to(dtype).repeat_interleave(r, 1).unsqueeze(2),
                ),
                **decode,
            )


def timed(torch, device, fn, max_reps, max_s):
    """Median time (ms) of ``fn`` after one warm-up call, the result, and the peak extra memory (MB)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    out = fn()  # warm-up (and compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        peak_mb = float("nan")
    times = []
    start_all = time.perf_counter()
    while len(times) < max_reps and (not times or time.perf_counter() - start_all < max_s):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out, peak_mb


def study_device(dry_run: bool):
    """``(torch, device)`` of a kernel study: CUDA, or the CPU with ``TRITON_INTERPRET=1`` for a dry run (set before
    triton is imported); ``None``, with a message on stderr, when no CUDA device is there for a real run."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU plumbing check", file=sys.stderr)
        return None
    return torch, torch.device("cpu" if dry_run else "cuda")


def main(argv=None) -> int:
    args = _parse(argv)
    found = study_device(args.dry_run)
    if found is None:
        return 2
    torch, device = found
    import triton

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    lengths = (
        [int(x) for x in args.lengths.split(",")]
        if args.lengths
        else ([96, 200] if args.dry_run else [4096, 16384, 65536])
    )
    only = set(args.kernels.split(",")) if args.kernels else None
    if only and not only <= set(KERNELS):
        print(f"--kernels {sorted(only - set(KERNELS))} not among {KERNELS}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) / ("dry_run" if args.dry_run else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    peak_bw, peak_src = peak_bandwidth(torch, device, args.peak_gbps)
    copy_bw = copy_bandwidth(torch, device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    label = "PLUMBING CHECK (dry run, Triton interpreter on CPU): times are meaningless" if args.dry_run else "measured"
    print(
        f"device: {dev_name}; peak bandwidth {peak_bw / 1e9:.0f} GB/s ({peak_src}), measured device copy "
        f"{copy_bw / 1e9:.0f} GB/s; torch {torch.__version__}, "
        f"triton {triton.__version__}; {label}",
        flush=True,
    )

    t_start = time.perf_counter()
    rows: dict[str, list[dict]] = {}
    last_ref: dict[str, tuple[int, float]] = {}
    for case in build_cases(torch, device, lengths, args.dry_run, only):
        elapsed = time.perf_counter() - t_start
        left = args.budget_s - elapsed
        reps = args.reps or (3 if args.dry_run else 20)
        tri_ms, tri_out, tri_mb = timed(torch, device, case.triton, reps, min(5.0, max(0.5, left / 20)))
        ref_ms = ref_mb = err = float("nan")
        note = ""
        prev = last_ref.get(case.kernel)
        predicted = prev[1] * (case.T / prev[0]) ** case.ref_cost_exp / 1e3 if prev else 0.0
        if predicted * 3 > left * 0.5:  # warm-up + 2 reps must fit in half of what is left
            note = f"reference skipped: predicted {predicted:.1f} s per call, {left:.0f} s left"
        else:
            ref_ms, ref_out, ref_mb = timed(
                torch, device, case.reference, 2 if predicted > 1 else reps, min(10.0, max(0.5, left / 10))
            )
            last_ref[case.kernel] = (case.T, ref_ms)
            err = float((tri_out.float() - ref_out.float()).abs().nan_to_num(0.0).max())
        achieved = case.ideal_bytes / (tri_ms / 1e3)
        intensity = case.flops / case.ideal_bytes
        row = {
            "kernel": case.kernel,
            "T": case.T,
            "shape": case.shape,
            "dtype": case.dtype,
            "reference_ms": f"{ref_ms:.4f}",
            "triton_ms": f"{tri_ms:.4f}",
            "speedup_ref_over_triton": f"{ref_ms / tri_ms:.3f}" if not math.isnan(ref_ms) else "nan",
            "ideal_bytes": case.ideal_bytes,
            "triton_GBps": f"{achieved / 1e9:.1f}",
            "peak_GBps": f"{peak_bw / 1e9:.0f}",
            "bandwidth_fraction": f"{achieved / peak_bw:.3f}",
            "peak_source": peak_src,
            "copy_GBps": f"{copy_bw / 1e9:.0f}",
            "fraction_of_copy": f"{achieved / copy_bw:.3f}",
            "flop_per_byte": f"{intensity:.1f}",
            "bound": case.bound,
            "reference_peak_extra_MB": f"{ref_mb:.1f}",
            "triton_peak_extra_MB": f"{tri_mb:.1f}",
            "max_abs_diff": f"{err:.3g}",
            "device": dev_name,
            "status": label,
            "note": note,
        }
        rows.setdefault(case.kernel, []).append(row)
        print(
            f"{case.kernel:28s} T={case.T:6d}  ref {ref_ms:10.3f} ms  triton {tri_ms:9.3f} ms  "
            f"x{row['speedup_ref_over_triton']:>8s}  {row['triton_GBps']:>8s} GB/s "
            f"({row['bandwidth_fraction']} of peak)  mem ref/tri {ref_mb:.0f}/{tri_mb:.0f} MB  "
            f"diff {err:.2g} {note}",
            flush=True,
        )
        del tri_out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for kernel, krows in rows.items():
        path = out_dir / f"{kernel}.csv"
        write_rows(path, krows, list(krows[0]))
        print(f"wrote {path}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
