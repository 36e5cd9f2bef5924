"""What every run of the harness shares: run directories, resumable rows, configs, the model cache.

A run is one (model, dataset, press, compression ratio[, shard]); its directory is
``<output_dir>/<dataset>[-qa]/<model>/<press>/cr<ratio>[/shard_i_of_n]/`` (``-qa``: the question inside the
compressed context, ``query_aware=true``; the two protocols never share a directory) and holds
``predictions.jsonl`` (one row per example, appended and fsynced as each finishes), ``config.yaml`` (the resolved
config) and ``metrics.json`` (written last, atomically). A run whose ``metrics.json`` exists is skipped; an
interrupted run resumes after its last complete row, only with the settings saved in its ``config.yaml``.
The per-example loop is :mod:`evaluation.loop`; the entry points are :mod:`evaluation.run` and
:mod:`evaluation.fused`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from evaluation.registry import MOVED_TARGETS

logger = logging.getLogger("evaluation.harness")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
_MODEL_CACHE: dict = {}


def config_choices(group: str) -> list[str]:
    """Names of the configs in one Hydra group (``press``, ``dataset``, ``model``)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with ``overrides`` as Hydra would (defaults lists included), from
    inside a Hydra app or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=overrides)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def check_ratio(compression_ratio) -> float:
    """Return ``compression_ratio`` as a float.

    Raises:
        ValueError: if it is not a number in ``[0, 1)``.
    """
    try:
        ratio = float(compression_ratio)
    except (TypeError, ValueError):
        raise ValueError(f"compression_ratio={compression_ratio!r} must be a number in [0, 1)") from None
    if not 0 <= ratio < 1:
        raise ValueError(f"compression_ratio={ratio} must be in [0, 1)")
    return ratio


def parse_shard(shard) -> tuple[int, int] | None:
    """Parse ``"i/n"`` into ``(i, n)``; None for no sharding.

    Raises:
        ValueError: unless ``0 <= i < n``.
    """
    if shard in (None, "", "null"):
        return None
    try:
        i, n = (int(x) for x in str(shard).split("/"))
    except ValueError:
        raise ValueError(f"shard={shard!r} must look like 'i/n' with integers, e.g. shard=0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"shard={shard!r} needs 0 <= i < n")
    return i, n


def run_label(names: dict[str, str]) -> str:
    """The press part of a run's directory: ``names["run_name"]`` when a caller labels a variant of a press
    config (e.g. a tuning candidate with overrides), else the press config's name."""
    return names.get("run_name") or names["press"]


def run_dir(cfg: DictConfig, names: dict[str, str]) -> Path:
    """The directory of one run (see the module docstring)."""
    ratio = 0.0 if names["press"] == "no_press" else check_ratio(cfg.compression_ratio)
    dataset = names["dataset"] + ("-qa" if cfg.get("query_aware") else "")  # the two protocols never mix
    out = Path(cfg.output_dir) / dataset / names["model"] / run_label(names) / f"cr{ratio:g}"
    shard = parse_shard(cfg.get("shard"))
    return out / f"shard_{shard[0]}_of_{shard[1]}" if shard else out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_predictions(path: Path) -> list[dict]:
    """Complete rows of a ``predictions.jsonl``; a torn last line (a killed run) is dropped and the
    file rewritten without it, so appending resumes cleanly."""
    if not path.exists():
        return []
    rows, torn = [], False
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            torn = True
    if torn:
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def append_row(path: Path, row: dict) -> None:
    """Append one JSON row with a single write and fsync."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def get_model(model_cfg: DictConfig, device: str, attn_implementation: str):
    """Load (and memoise across a multirun) the model and tokenizer of ``model_cfg``."""
    from evaluation.models import load_model

    key = (model_cfg.name, model_cfg.get("path"), device, str(model_cfg.get("dtype")), attn_implementation)
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        _MODEL_CACHE[key] = load_model(model_cfg.name, device=device, dtype=model_cfg.get("dtype"),
                                       attn_implementation=attn_implementation, path=model_cfg.get("path"))
    return _MODEL_CACHE[key]


def cache_stats(cache, model, context_length: int) -> dict:
    """Effective compression of the context cache after the pipeline ran.

    ``effective_compression = 1 - kept / T`` averaged over layers, where ``kept`` is the cache length
    (physical). kvpress's head-wise presses (AdaKV) keep a dense cache and mask keys instead; their
    masked entries are subtracted to give the logical count.
    """
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    physical = 1 - sum(lengths) / (len(lengths) * context_length)
    logical = physical
    masked = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    if any(m is not None for m in masked):
        n_kv = model.config.num_key_value_heads
        kept = [n - (len(m[0]) / n_kv if m is not None else 0) for n, m in zip(lengths, masked)]
        logical = 1 - sum(kept) / (len(kept) * context_length)
    return {"effective_compression": logical, "physical_compression": physical}


# Keys a run may change between a start and its resume: they do not change its examples or predictions.
RESUME_FREE_KEYS = ("overwrite", "output_dir", "device")


def config_changes(saved, cfg) -> list[str]:
    """The settings in which ``cfg`` differs from a run directory's ``saved`` config, as ``key: old -> new``.

    Both are (resolved) configs; nested keys are compared leaf by leaf with dotted names, the keys in
    ``RESUME_FREE_KEYS`` are ignored, and a saved ``_target_`` that merely moved (:data:`MOVED_TARGETS`) counts
    as its new path.
    """
    def flat(node, prefix=""):
        if isinstance(node, dict):
            return {k: v for key, val in node.items() for k, v in flat(val, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    old = flat(OmegaConf.to_container(OmegaConf.create(saved), resolve=True))
    new = flat(OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))
    old = {k: MOVED_TARGETS.get(v, v) if k.endswith("_target_") else v for k, v in old.items()}
    return [f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in sorted(set(old) | set(new))
            if k.split(".")[0] not in RESUME_FREE_KEYS and old.get(k, "<unset>") != new.get(k, "<unset>")]


def start_run(cfg: DictConfig, names: dict[str, str]) -> tuple[Path, dict | None]:
    """Validate the names and ratio of one run, create its directory and write its ``config.yaml``.

    A directory that already holds rows or ``metrics.json`` is resumed (or reused) only when its saved
    ``config.yaml`` has the same settings (:func:`config_changes`), so two settings never mix in one run.

    Returns:
        ``(run directory, metrics)``; ``metrics`` is the finished run's ``metrics.json`` (then nothing
        was written) or None when the run still has work.

    Raises:
        ValueError: for a ratio outside ``[0, 1)``, a bad shard, an unknown config name, or a run
            directory whose saved settings differ (pass ``overwrite=true`` or another ``output_dir``).
    """
    for group in ("press", "dataset", "model"):
        name = names[group]
        if name not in config_choices(group):
            raise ValueError(f"unknown {group} '{name}'; valid: {', '.join(config_choices(group))}")
    check_ratio(cfg.compression_ratio)
    out = run_dir(cfg, names)
    overwrite, finished = cfg.get("overwrite", False), (out / "metrics.json").exists()
    started = finished or (out / "predictions.jsonl").exists()
    if started and not overwrite and (out / "config.yaml").exists():
        changed = config_changes(OmegaConf.load(out / "config.yaml"), cfg)
        if changed:
            raise ValueError(f"{out} holds a run made with other settings ({'; '.join(changed)}); resuming "
                             "would mix them: pass overwrite=true to redo it, or choose another output_dir")
    if finished and not overwrite:
        logger.info("finished run found, skipping: %s", out)
        return out, json.loads((out / "metrics.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    if overwrite and (out / "predictions.jsonl").exists():
        (out / "predictions.jsonl").unlink()
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    return out, None


def run_examples(cfg: DictConfig, dataset, tokenizer) -> list:
    """The run's examples: the dataset's ``n_samples`` examples for ``seed``, then this run's shard."""
    examples = dataset.examples(tokenizer, cfg.n_samples, cfg.seed, cfg.query_aware)
    shard = parse_shard(cfg.get("shard"))
    return examples[shard[0]::shard[1]] if shard else examples


def prediction_row(ex, names: dict[str, str], dataset, prediction: str, cache, model, context_length: int,
                   seconds: float, press, **extra) -> dict:
    """One ``predictions.jsonl`` row: the example, the prediction and its score, the cache's effective
    compression (:func:`cache_stats`), seconds, and ``press.summary()`` when the press has one."""
    return {"id": ex.id, "task": ex.task or names["dataset"], "context_length": context_length,
            "depth": ex.metadata.get("depth"), "answers": ex.answers, "prediction": prediction,
            "score": float(dataset.score(prediction, ex)), **cache_stats(cache, model, context_length),
            "seconds": seconds,
            "press_stats": press.summary() if press is not None and hasattr(press, "summary") else None,
            **extra, "metadata": ex.metadata}


def finish_run(out: Path, examples: list, names: dict[str, str], cfg: DictConfig, command: str) -> dict:
    """Summarise the run's rows (those of ``examples``) into ``metrics.json``, written atomically."""
    ids = {e.id for e in examples}
    rows = [r for r in read_predictions(out / "predictions.jsonl") if r["id"] in ids]
    metrics = summarize(rows)
    metrics.update({"press": run_label(names), "dataset": names["dataset"], "model": names["model"],
                    "compression_ratio": 0.0 if names["press"] == "no_press" else check_ratio(cfg.compression_ratio),
                    "shard": cfg.get("shard"), "command": command})
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2))
    logger.info("wrote %s: score %.3f over %d examples", out / "metrics.json", metrics["score"], metrics["n"])
    return metrics


@contextlib.contextmanager
def chat_template(tokenizer, enabled: bool):
    """Temporarily drop the tokenizer's chat template for examples whose official prompt has none
    (LongBench's trec, triviaqa, samsum, lsht, lcc, repobench-p: ``metadata["chat_template"] = False``)."""
    saved = tokenizer.chat_template
    if not enabled:
        tokenizer.chat_template = None
    try:
        yield
    finally:
        tokenizer.chat_template = saved


def summarize(rows: list[dict]) -> dict:
    """Mean score, per-task means, mean effective compression and timing of prediction rows."""
    n = len(rows)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    tasks = sorted({r["task"] for r in rows})
    return {
        "n": n,
        "score": mean([r["score"] for r in rows]),
        "per_task": {t: mean([r["score"] for r in rows if r["task"] == t]) for t in tasks},
        "effective_compression": mean([r["effective_compression"] for r in rows]),
        "physical_compression": mean([r["physical_compression"] for r in rows]),
        "seconds_per_example": mean([r["seconds"] for r in rows]),
    }


def command_line(entry: str = "python -m evaluation.run") -> str:
    """The command that launched this Hydra job, as a user would retype it: ``entry`` followed by the
    job's overrides (``" ".join(sys.argv)`` when not under Hydra). Shared by every Hydra entry point
    (harness, ``evaluation.uor``, ``scripts/bench_speed_memory.py``)."""
    try:
        overrides = " ".join(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra
        return " ".join(sys.argv)
    return f"{entry} {overrides}".strip()
