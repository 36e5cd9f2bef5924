"""Tile and precision sweep of EntroPrefill's row kernel (:mod:`presses.kernels.row_masses`) on one CUDA GPU.

The kernel benchmark (:mod:`evaluation.studies.bench_kernels`) found the chunk-mass kernel slower than its torch
reference at 64k (x0.56 for 256 audit rows, x0.74 for 8 proposal rows with their average, on an H200). Two costs
are suspected: the one-hot chunk product runs on the float32 cores (``input_precision="ieee"``), and with more
chunks than the largest chunk tile every chunk tile recomputes its rows' scores. This sweep times the kernel on the
benchmark's own inputs (:func:`evaluation.studies.bench_kernels.row_mass_inputs`, bfloat16, d = 128) over

* ``mass_precision`` in :data:`presses.kernels.row_masses.MASS_PRECISIONS`,
* ``max_block_k`` (the largest chunk tile), ``block_m``, ``block_n``, ``num_warps``,

against the torch reference (timed once per case), with each configuration's largest absolute difference from the
reference. A configuration that fails to compile or run is a row with its error. One CSV,
``<out>/tune_row_masses.csv``, rewritten (atomically) after every configuration, so a timeout keeps what ran; a
wall-clock guard (``--budget-s``) stops the sweep and the rows say how far it got.

Usage (on a CUDA machine; ``--dry-run`` checks the plumbing on CPU under ``TRITON_INTERPRET=1``, toy shapes):
    python scripts/tune_row_masses.py --out results/kernels/tune_row_masses
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from evaluation.cli import ArgumentParser
from evaluation.studies import REPO
from evaluation.tables import write_rows

GRID = {
    "mass_precision": ("ieee", "tf32x3"),
    "max_block_k": (128, 256, 512),
    "block_m": (32, 64),
    "block_n": (32, 64),
    "num_warps": (4, 8),
}
"""The configurations tried (every combination), in this order."""

DRY_GRID = {"mass_precision": ("ieee",), "max_block_k": (16, 32), "block_m": (16,), "block_n": (16,), "num_warps": (4,)}


def parse_config(text: str) -> dict:
    """``'mass_precision=tf32x3 num_warps=4'`` -> ``{'mass_precision': 'tf32x3', 'num_warps': 4}``.

    Raises:
        ValueError: for a name outside :data:`GRID`, an item without ``=``, or a non-integer tile or warp count.
    """
    cfg = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or name not in GRID:
            raise ValueError(f"configuration item {item!r}: expected name=value with a name among {list(GRID)}")
        if name != "mass_precision" and not value.isdigit():
            raise ValueError(f"configuration item {item!r}: {name} takes a positive integer")
        cfg[name] = value if name == "mass_precision" else int(value)
    return cfg


def _parse(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET, toy shapes: plumbing only")
    p.add_argument("--lengths", default=None, help="comma-separated T values (default 65536,16384)")
    p.add_argument("--out", default=str(REPO / "results" / "kernels" / "tune_row_masses"))
    p.add_argument("--budget-s", type=float, default=200.0, help="wall-clock guard for the whole sweep")
    p.add_argument("--reps", type=int, default=None, help="timed calls per configuration (default 10; 2 dry run)")
    p.add_argument(
        "--configs",
        default=None,
        help="';'-separated configurations instead of the grid, each 'name=value ...' (names of GRID; the others at "
        "the kernel's defaults; an empty one is the defaults), e.g. 'mass_precision=tf32x3 num_warps=4;'",
    )
    p.add_argument("--cases", default=None, help="comma-separated subset of " + ", ".join(("proposal", "audit")))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    from evaluation.studies.bench_kernels import ROW_MASS_CASES, bench_shapes, row_mass_inputs, study_device, timed

    found = study_device(args.dry_run)
    if found is None:
        return 2
    torch, device = found
    from presses.core.row_masses import row_chunk_masses_reference
    from presses.kernels.row_masses import row_chunk_masses_triton

    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else ([96] if args.dry_run else [65536, 16384])
    configs = (
        [parse_config(c) for c in args.configs.split(";")]
        if args.configs is not None
        else [dict(zip(g, v)) for g in [DRY_GRID if args.dry_run else GRID] for v in itertools.product(*g.values())]
    )
    wanted = args.cases.split(",") if args.cases else None
    known = [name.rsplit("_", 1)[-1] for name in ROW_MASS_CASES]
    if wanted and not set(wanted) <= set(known):
        raise ValueError(f"--cases {args.cases!r}: each case must be one of {known}")
    cases = {name: spec for name, spec in ROW_MASS_CASES.items() if not wanted or name.rsplit("_", 1)[-1] in wanted}
    reps = args.reps or (2 if args.dry_run else 10)
    B, HQ, G, d, _, _, dtype, *_ = bench_shapes(torch, args.dry_run)
    out = Path(args.out) / ("dry_run" if args.dry_run else "")
    out.mkdir(parents=True, exist_ok=True)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"device: {dev_name}; torch {torch.__version__}", flush=True)

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    t0 = time.perf_counter()
    rows: list[dict] = []
    for T in lengths:
        keys = randn(B, G, T, d)
        for case, (n_rows, average) in cases.items():
            q, positions, ids, k, w = row_mass_inputs(torch, keys, HQ, randn, gen, n_rows, average, args.dry_run)

            def reference(q=q, positions=positions, ids=ids, k=k, w=w):
                return row_chunk_masses_reference(q, keys, positions, ids, k, w)

            def kernel(cfg, q=q, positions=positions, ids=ids, k=k, w=w):
                return row_chunk_masses_triton(q, keys, positions, ids, k, w, **cfg)

            ref_ms, ref, _ = timed(torch, device, reference, 3, 10)
            base = dict(case=case, T=T, rows=len(positions), chunks=k, dtype=str(dtype).replace("torch.", ""))
            rows.append({**base, "config": "reference", "ms": f"{ref_ms:.4f}", "speedup": "1.000"})
            for cfg in configs:
                left = args.budget_s - (time.perf_counter() - t0)
                row = {**base, "config": " ".join(f"{a}={b}" for a, b in cfg.items()) or "defaults", **cfg}
                if left < 5:
                    rows.append({**row, "error": f"skipped: budget of {args.budget_s:.0f} s spent"})
                    continue
                try:
                    ms, got, _ = timed(torch, device, lambda cfg=cfg: kernel(cfg), reps, 5)
                    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref) if g is not None)
                    row.update(ms=f"{ms:.4f}", speedup=f"{ref_ms / ms:.3f}", max_abs_diff=f"{diff:.2e}")
                except Exception as exc:  # a tile that does not compile or fit is a result, not a crash
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                rows.append(row)
                print({k_: v for k_, v in row.items() if k_ not in base}, flush=True)
                write_rows(out / "tune_row_masses.csv", rows)
            del ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_rows(out / "tune_row_masses.csv", rows)
    print(f"wrote {out / 'tune_row_masses.csv'} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
