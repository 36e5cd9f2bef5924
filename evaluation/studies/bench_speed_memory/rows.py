"""The speed benchmark's csv (:mod:`evaluation.studies.bench_speed_memory`): its columns, a row's resume key, and
its atomic rewrite (:mod:`evaluation.tables` reads and writes the rows)."""

from __future__ import annotations

from pathlib import Path

from evaluation import tables

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
#: the press every overhead ratio divides by, measured at the same T and ratio in the same run
REFERENCE = "snapkv"
#: the uncompressed prefill's press name
NO_PRESS = "no_press"
CSV_NAME = "speed_memory.csv"


def row_key(row: dict) -> tuple[str, str, str, int]:
    """Resume key of a row: ``(model, press, ratio, T)``."""
    return str(row["model"]), str(row["press"]), f"{float(row['compression_ratio']):g}", int(float(row["T"]))


def write_rows(path: Path, rows: list[dict]) -> None:
    """Rewrite the csv atomically, rows sorted by model, T, ratio, press."""
    rows = sorted(
        rows, key=lambda r: (str(r["model"]), int(float(r["T"])), float(r["compression_ratio"]), str(r["press"]))
    )
    tables.write_rows(path, rows, COLUMNS)
