"""The speed benchmark's sweep and Hydra entry point (:mod:`evaluation.studies.bench_speed_memory`): presses
from their configs, prose contexts of ``T`` tokens, every (T, ratio, press) row measured once and resumed."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from evaluation.cli import check_command_line
from evaluation.guards import check_press_downloads
from evaluation.harness import (
    CONFIG_DIR,
    check_ratio,
    command_line,
    compose_config,
    config_choices,
    unknown_config,
)
from evaluation.prompt_delimiter import delimited
from evaluation.registry import capabilities, install_delimiter
from evaluation.studies.bench_speed_memory.measure import measure_row
from evaluation.studies.bench_speed_memory.report import write_report
from evaluation.studies.bench_speed_memory.rows import CSV_NAME, NO_PRESS, REFERENCE, row_key, write_rows
from evaluation.tables import read_rows

logger = logging.getLogger("bench_speed_memory")

#: seconds a sweep may run on CUDA when time_limit_s is auto (a device lent for minutes)
GPU_TIME_LIMIT_S = 480.0


def press_config(name: str, overrides: dict | None = None) -> DictConfig:
    """The ``configs/press/<name>.yaml`` node, with ``overrides`` merged in.

    Raises:
        ValueError: for a name with no config (names the closest ones, :func:`evaluation.harness.unknown_config`).
    """
    if name not in config_choices("press"):
        raise ValueError(unknown_config("press", name))
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


def build_context(
    ds_cfg: DictConfig, pipe, tokenizer, T: int, seed: int, query_aware: bool, delimiter: tuple[str, str] | None = None
):
    """Token ids of one prose context of about ``T`` tokens (chat template included) and its question.

    ``ds_cfg`` is a dataset config (``_target_`` + parameters); its length argument (``context_length``
    or ``context_lengths``) is set to ``T`` minus the chat template's own tokens. With ``delimiter``, ``(token,
    press)`` for a press that needs one (Finch: :func:`evaluation.prompt_delimiter.delimited`), the same example with
    the token where its question starts, through ``pipe`` (whose tokenizer knows the token).

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
    if delimiter is not None:
        example = delimited(example, *delimiter)
    inputs = pipe.preprocess(example.context, [example.question], example.answer_prefix, int(1e10))
    if inputs["context_ids"].shape[1] < MIN_CONTEXT_FRACTION * T:
        raise ValueError(
            f"{ds_cfg._target_} built a context of {inputs['context_ids'].shape[1]} tokens for T={T}, "
            f"below {MIN_CONTEXT_FRACTION:.0%} of T: the dataset stops short of T (multi-document contexts "
            "add whole passages, at most 40 with fact_kinds=[city] and 200 with [code])"
        )
    return inputs["context_ids"], inputs["questions_ids"][0]


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

        def with_delimiter(name: str, press, kind: str) -> tuple:
            """A press that needs a delimiter token (Finch) runs on a model and tokenizer copy of its own with the
            token installed (:func:`evaluation.registry.install_delimiter`: the first press adds it, the others only
            learn its id), on this T's ``kind`` example with the token where its question starts."""
            if "delimiter copy" not in contexts:
                contexts["delimiter copy"] = (copy.deepcopy(model), copy.deepcopy(tokenizer))
            own_model, own_tokenizer = contexts["delimiter copy"]
            token = install_delimiter(press, own_model, own_tokenizer, int(cfg.seed))
            if "delimited" not in contexts:
                own_pipe = KVPressTextGenerationPipeline(
                    model=own_model, tokenizer=own_tokenizer, device=torch.device(device)
                )
                contexts["delimited"] = build_context(
                    cfg.contexts[kind], own_pipe, own_tokenizer, T, int(cfg.seed), True, (token, name)
                )
            return own_model, contexts["delimited"]

        def measure(name: str, ratio: float, kind: str) -> dict:
            press = make_press(name, ratio, int(cfg.seed), tokenizer, overrides.get(name))
            if press is not None and capabilities(press).needs_delimiter:
                run_model, (ids, q_ids) = with_delimiter(name, press, kind)
            else:
                run_model, (ids, q_ids) = model, context(kind)
            check_press_downloads(press, run_model)  # the project's trained scorers, as the harness attaches them
            if cfg.warmup and name not in warmed:
                measure_row(run_model, press, ids, q_ids, min(2, int(cfg.decode_tokens)), device)
                warmed.add(name)
            logger.info("T=%d ratio=%g %s (%s context, %d tokens)", T, ratio, name, kind, ids.shape[1])
            return measure_row(run_model, press, ids, q_ids, int(cfg.decode_tokens), device, int(cfg.repeats))

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
            raise ValueError(unknown_config("model", name))
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


def main() -> None:
    """The command line (``sys.argv``): refused in one line, before Hydra starts, when it names a key
    ``configs/bench_speed_memory.yaml`` does not have (:func:`evaluation.cli.check_command_line`); else Hydra runs
    the sweep."""
    check_command_line(sys.argv[1:], "bench_speed_memory", "evaluation.studies.bench_speed_memory")
    _hydra_main()


@hydra.main(config_path=str(CONFIG_DIR), config_name="bench_speed_memory", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    """Hydra's task (``configs/bench_speed_memory.yaml``)."""
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
