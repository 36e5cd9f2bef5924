"""What every run of the harness shares: run directories, resumable rows, configs, the model cache.

A run is one (model, dataset, press, compression ratio[, shard]); its directory is
``<output_dir>/<dataset>[-shared|-turns][-qa]/<model>/<press>/cr<ratio>[/shard_i_of_n]/`` (``-qa``: the question
inside the compressed context, ``query_aware=true``; ``-shared`` / ``-turns``: several questions per compressed
context, :mod:`evaluation.shared`; the protocols never share a directory, :func:`protocol_suffix`) and holds
``predictions.jsonl`` (one row per example, appended and fsynced as each finishes; once finished it may be stored
compressed, ``predictions.jsonl.gz``: :mod:`evaluation.predictions`), ``config.yaml`` (the resolved
config), ``commands.txt`` (the commands that wrote rows, :func:`note_command`) and ``metrics.json`` (written last,
atomically). A run whose ``metrics.json`` exists is skipped; an
interrupted run resumes after its last complete row, only with the settings saved in its ``config.yaml``.
``grow=true`` is the one exception: a run may take a larger ``n_samples`` on a dataset whose examples nest
(:func:`growth`), keeping its rows and running only the examples it lacks.

One process at a time writes a run directory: :func:`claim_runs` holds a file lock (``.run.lock``, the
``filelock`` library) on it from the settings check to ``metrics.json``. Another process with other settings is
refused, naming the changed keys; one with the same settings waits for the lock, then skips the rows already done
(or the whole run, once finished). :func:`run_in_progress` tells a reader (``evaluation.report``) that a run is
being written.
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

from evaluation.atomic import write_atomic
from evaluation.predictions import COMPRESSED, read_predictions, restore_run, rows_file

logger = logging.getLogger("evaluation.harness")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
_MODEL_CACHE: dict = {}

#: suffix of the dataset directory of runs with the question inside the compressed context (query_aware)
QA_SUFFIX = "-qa"
#: suffixes of the dataset directory of the shared-context protocol's runs (:mod:`evaluation.shared`), before ``-qa``:
#: several questions on copies of one compressed cache (multi-request), or in turn in one chat (multi-turn)
SHARED_SUFFIX = "-shared"
TURNS_SUFFIX = "-turns"


def config_choices(group: str) -> list[str]:
    """Names of the configs in one Hydra group (``press``, ``dataset``, ``model``)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


#: A group with at most this many configs is listed whole when a name is not among them; a longer one (the ~90
#: presses) gets its closest names only (:func:`unknown_config`).
SHORT_LIST = 20


def did_you_mean(name: str, valid, n: int = 3) -> list[str]:
    """The names of ``valid`` closest to ``name`` (at most ``n``, closest first; ``difflib.get_close_matches``)."""
    import difflib

    return difflib.get_close_matches(str(name), [str(v) for v in valid], n=n, cutoff=0.6)


def unknown_config(group: str, name: str) -> str:
    """The one-line message for a ``name`` that ``configs/<group>/`` lacks: every valid name when the group is
    short (:data:`SHORT_LIST`), else the closest ones (:func:`did_you_mean`) and where the whole list is."""
    valid = config_choices(group)
    if len(valid) <= SHORT_LIST:
        return f"unknown {group} '{name}'; valid: {', '.join(valid)}"
    close = did_you_mean(name, valid)
    hint = f"did you mean {', '.join(close)}?" if close else "no name is close to it"
    return f"unknown {group} '{name}'; {hint} (all {len(valid)} are the files of configs/{group}/: ls configs/{group})"


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
    """Return ``compression_ratio`` as a float, in its one spelling (:func:`evaluation.settings.normal_value`:
    ``0.50``, ``5e-1`` and ``'0.5'`` are 0.5).

    Raises:
        ValueError: if it is not a number in ``[0, 1)``.
    """
    from evaluation.settings import normal_value

    try:
        ratio = float(normal_value("compression_ratio", compression_ratio))
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
    from evaluation.settings import normal_value

    shard = normal_value("shard", shard)
    if shard is None:
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


def protocol_suffix(cfg) -> str:
    """What a run's protocol adds to its dataset's directory name: ``-shared`` (``protocol=shared``, multi-request) or
    ``-turns`` (``protocol=shared shared_mode=turn``), then ``-qa`` (``query_aware=true``); empty for kvpress's
    protocol (one question, after compression). Read in their one spelling (:func:`evaluation.settings.normalise`)."""
    from evaluation.settings import SHARED_DEFAULTS, normal_value

    shared = normal_value("protocol", cfg.get("protocol") or "single") == "shared"
    mode = normal_value("shared_mode", cfg.get("shared_mode") or SHARED_DEFAULTS["shared_mode"])
    suffix = (TURNS_SUFFIX if mode == "turn" else SHARED_SUFFIX) if shared else ""
    query_aware = normal_value("query_aware", cfg.get("query_aware", False)) is True
    return suffix + (QA_SUFFIX if query_aware else "")


def run_dir(cfg: DictConfig, names: dict[str, str]) -> Path:
    """The directory of one run (see the module docstring); its ratio, protocol and shard are read in their one
    spelling (:func:`evaluation.settings.normal_value`), so every spelling of one run names one directory."""
    ratio = 0.0 if names["press"] == "no_press" else check_ratio(cfg.compression_ratio)
    dataset = names["dataset"] + protocol_suffix(cfg)  # the protocols never mix
    out = Path(cfg.output_dir) / dataset / names["model"] / run_label(names) / f"cr{ratio:g}"
    shard = parse_shard(cfg.get("shard"))
    return out / f"shard_{shard[0]}_of_{shard[1]}" if shard else out


#: A run directory's log of the commands that wrote its rows, for the report while the run is unfinished (a
#: finished run's ``metrics.json`` holds its command).
COMMANDS_NAME = "commands.txt"


def note_command(out: Path, command: str) -> None:
    """Add ``command`` (one line) to ``out``'s :data:`COMMANDS_NAME` unless it is there already; atomic."""
    path = out / COMMANDS_NAME
    seen = path.read_text().splitlines() if path.exists() else []
    if command not in seen:
        write_atomic(path, "".join(line + "\n" for line in [*seen, command]))


def append_row(path: Path, row: dict) -> None:
    """Append one JSON row with a single write and fsync."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def get_model(model_cfg: DictConfig, device: str, attn_implementation: str, variant: str = ""):
    """Load (and memoise across a multirun) the model and tokenizer of ``model_cfg``.

    ``variant`` names a copy that a press changes in place (Finch's delimiter token resizes the embeddings and
    grows the tokenizer): it is loaded and memoised apart from the plain model, and one model is memoised at a time,
    so the change never reaches a run of another press.
    """
    from evaluation.models import load_model

    key = (model_cfg.name, model_cfg.get("path"), device, str(model_cfg.get("dtype")), attn_implementation, variant)
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        _MODEL_CACHE[key] = load_model(
            model_cfg.name,
            device=device,
            dtype=model_cfg.get("dtype"),
            attn_implementation=attn_implementation,
            path=model_cfg.get("path"),
        )
    return _MODEL_CACHE[key]


def cache_stats(cache, model, context_length: int, press=None) -> dict:
    """The compression of the context cache after a prefill under ``press``, fractions in ``[0, 1]``.

    ``effective_compression = 1 - mean(kept) / T`` over layers, with ``kept`` the entries the press kept per KV
    head (:func:`evaluation.registry.kept_entries`); ``physical_compression`` the same with the cache's lengths
    (padding and masked keys count as held).
    """
    from evaluation.registry import kept_entries

    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    kept = kept_entries(press, model, cache)
    return {
        "effective_compression": 1 - sum(kept) / (len(kept) * context_length),
        "physical_compression": 1 - sum(lengths) / (len(lengths) * context_length),
    }


# Keys a run may change between a start and its resume: they do not change its examples or predictions.
RESUME_FREE_KEYS = ("overwrite", "grow", "output_dir", "device")


def config_changes(saved, cfg, both_saved: bool = False) -> list[str]:
    """The settings in which ``cfg`` differs from a run directory's ``saved`` config, as ``key: old -> new``.

    Both are compared as run settings (:func:`evaluation.settings.run_settings`: the press as the class and fields
    it builds; for ``saved``, a field it predates takes its value from before the field existed,
    :func:`evaluation.settings.saved_run_settings`), leaf by leaf with dotted names; the keys in
    ``RESUME_FREE_KEYS`` are ignored. ``both_saved``: ``cfg`` is a saved config too (two shards of one run).
    """

    def flat(node, prefix=""):
        if isinstance(node, dict):
            return {k: v for key, val in node.items() for k, v in flat(val, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    from evaluation.settings import run_settings, saved_run_settings

    old = flat(saved_run_settings(OmegaConf.create(saved)))
    new = flat((saved_run_settings if both_saved else run_settings)(OmegaConf.create(cfg)))
    return [
        f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}"
        for k in sorted(set(old) | set(new))
        if k.split(".")[0] not in RESUME_FREE_KEYS and old.get(k, "<unset>") != new.get(k, "<unset>")
    ]


def check_names(names: dict[str, str]) -> None:
    """Raise unless the ``press``, ``dataset`` and ``model`` of ``names`` are configs of their groups.

    Raises:
        ValueError: naming the unknown name and the valid or the closest ones (:func:`unknown_config`).
    """
    for group in ("press", "dataset", "model"):  # "run_name" labels a variant: not a config (run_label)
        name = names[group]
        if name not in config_choices(group):
            raise ValueError(unknown_config(group, name))


#: The uncompressed model's press config: its runs keep the whole cache (ratio 0) and are every report's baseline.
BASELINE = "no_press"

#: The lock file of a run directory (:func:`claim_runs`).
LOCK_NAME = ".run.lock"
#: Seconds between two looks at a busy run directory's settings while waiting for its lock.
LOCK_POLL_S = 1.0


def nests_samples(cfg: DictConfig) -> bool:
    """Whether the dataset of ``cfg`` declares that its examples nest: for ``n_samples`` m < n, the m examples
    (per the dataset's unit: task, length, depth) are, id for id and word for word, among the n, and the examples
    of one length are the same whichever other lengths are asked (the class attribute ``nested_samples``; each such
    dataset seeds example ``i`` by its own coordinates, never by the count or the other lengths)."""
    from hydra.utils import get_class

    target = OmegaConf.select(cfg, "dataset._target_")
    try:
        return bool(target) and bool(getattr(get_class(target), "nested_samples", False))
    except Exception:  # an unknown target is refused elsewhere, with its own message
        return False


#: the settings grow=true may change, and how: n_samples upwards, dataset.context_lengths to a superset
GROWABLE = ("n_samples", "dataset.context_lengths")


def growth(out: Path, cfg: DictConfig) -> list[str] | None:
    """The changes (``key: old -> new``) by which ``cfg`` grows the run in ``out`` (``grow=true``): its saved settings
    differ from ``cfg``'s only in a larger ``n_samples`` and / or more ``dataset.context_lengths`` (every saved
    length kept), on a dataset whose examples nest (:func:`nests_samples`), outside a shard. The rows already
    written are kept and only the missing examples run (rows, resume and ``metrics.json`` are keyed by example
    id). None when ``grow`` is unset or nothing differs.

    Raises:
        ValueError: ``grow=true`` with other changes, a smaller or unset ``n_samples``, a saved length left out, a
            shard, or a dataset whose examples do not nest; the message names the value and the rule.
    """
    if not cfg.get("grow", False) or not (out / "config.yaml").exists():
        return None
    saved = OmegaConf.load(out / "config.yaml")
    changed = config_changes(saved, cfg)
    if not changed:
        return None
    rule = "grow=true takes a run to a larger n_samples and / or more dataset.context_lengths and changes nothing else"
    keys = [c.split(":")[0] for c in changed]
    if not set(keys) <= set(GROWABLE):
        raise ValueError(f"{out}: {rule}; other settings differ ({'; '.join(changed)})")
    if "n_samples" in keys:
        old, new = saved.get("n_samples"), cfg.get("n_samples")
        if not isinstance(old, int) or not isinstance(new, int) or new <= old:
            raise ValueError(f"{out}: {rule}; n_samples={new!r} is not an integer above the saved n_samples={old!r}")
    if "dataset.context_lengths" in keys:
        old, new = (OmegaConf.select(c, "dataset.context_lengths") or [] for c in (saved, cfg))
        left_out = sorted({int(x) for x in old} - {int(x) for x in new})
        if left_out:
            raise ValueError(
                f"{out}: {rule}; dataset.context_lengths={list(new)} leaves out the saved length(s) {left_out}"
            )
    if parse_shard(cfg.get("shard")):
        raise ValueError(
            f"{out}: grow=true cannot grow a shard (shard={cfg.get('shard')!r}): growing moves examples "
            "between shards; grow the unsharded run"
        )
    if not nests_samples(cfg):
        raise ValueError(
            f"{out}: grow=true needs a dataset whose examples nest (nested_samples); {cfg.dataset._target_} does not "
            "say so: run the larger n_samples in another output_dir"
        )
    return changed


def _settings_problem(out: Path, cfg: DictConfig, why: str) -> str | None:
    """Why ``cfg`` may not write ``out`` (its ``config.yaml`` holds other settings), or None; a permitted
    :func:`growth` is no problem."""
    if not (out / "config.yaml").exists():
        return None
    changed = config_changes(OmegaConf.load(out / "config.yaml"), cfg)
    if not changed or growth(out, cfg):
        return None
    more = " (or grow=true to add the missing examples)" if {c.split(":")[0] for c in changed} <= set(GROWABLE) else ""
    return (
        f"{out} {why} other settings ({'; '.join(changed)}); writing it would mix them: choose another "
        "output_dir for these settings (the run directory names only dataset, model, press and ratio), or "
        f"pass overwrite=true to redo the run{more}"
    )


def _has_rows(out: Path) -> bool:
    path = rows_file(out)  # either form (evaluation.predictions)
    return path is not None and path.stat().st_size > 0


def check_existing_run(cfg: DictConfig, names: dict[str, str]) -> dict | None:
    """Read-only look at a run's directory before anything is loaded or written.

    Returns:
        The run's ``metrics.json`` when it is finished with the same settings (nothing to do), else None.

    Raises:
        ValueError: for a bad name, ratio or shard, or a directory that holds rows or metrics made with other
            settings (the check is repeated under the lock by :func:`claim_runs`).
    """
    check_names(names)
    check_ratio(cfg.compression_ratio)
    out = run_dir(cfg, names)
    if cfg.get("overwrite", False):
        return None
    finished = (out / "metrics.json").exists()
    if finished or _has_rows(out):
        problem = _settings_problem(out, cfg, "holds a run made with")
        if problem:
            raise ValueError(problem)
        finished = finished and not growth(out, cfg)
    if finished and not run_in_progress(out):
        logger.info("finished run found, skipping: %s", out)
        return json.loads((out / "metrics.json").read_text())
    return None


def run_in_progress(out: Path) -> bool:
    """Whether another process holds ``out``'s lock (writes that run now). A directory without a lock file, or
    one this process cannot lock (read-only), is not in progress."""
    from filelock import FileLock, Timeout

    path = Path(out) / LOCK_NAME
    if not path.exists():
        return False
    try:
        with FileLock(path, timeout=0, thread_local=False, is_singleton=False):
            return False
    except Timeout:
        return True
    except OSError:
        return False


def _claim(cfg: DictConfig, names: dict[str, str], made: list[Path]):
    """Lock one run directory (waiting for another process with the same settings), check and write its
    settings. Returns ``(out, lock, metrics)``: ``metrics`` of a finished run (the lock is then released and
    None), else None with the lock held. Directories this call creates are appended to ``made``."""
    from filelock import FileLock, Timeout

    from evaluation.settings import run_settings

    check_names(names)
    check_ratio(cfg.compression_ratio)
    out = run_dir(cfg, names)
    missing = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    made.extend(reversed(missing))  # deepest last
    overwrite = cfg.get("overwrite", False)
    lock = FileLock(out / LOCK_NAME, thread_local=False, is_singleton=False)
    waiting = False
    while True:
        try:
            lock.acquire(timeout=LOCK_POLL_S)
            if (out / LOCK_NAME).exists():
                break
            lock.release()  # the holder removed the directory it had made (it failed before any row): retry
            out.mkdir(parents=True, exist_ok=True)
            continue
        except Timeout:  # another process writes this run: its settings are in config.yaml
            problem = _settings_problem(out, cfg, "is being written by another process with")
            if problem:
                raise ValueError(problem) from None
            if not waiting:
                logger.warning(
                    "%s is being written by another process with the same settings: waiting for it "
                    "(its finished rows will be skipped)",
                    out,
                )
                waiting = True
    try:
        finished = (out / "metrics.json").exists()
        if (finished or _has_rows(out)) and not overwrite:
            problem = _settings_problem(out, cfg, "holds a run made with")
            if problem:
                raise ValueError(problem)
            grown = growth(out, cfg)
            if grown:  # the smaller run's metrics go before its config: a crash between leaves a plain resumable run
                logger.info("growing %s (%s): its rows are kept", out, "; ".join(grown))
                (out / "metrics.json").unlink(missing_ok=True)
                finished = False
        if finished and not overwrite:
            logger.info("finished run found, skipping: %s", out)
            metrics = json.loads((out / "metrics.json").read_text())
            lock.release()
            return out, None, metrics
        if overwrite:
            for name in ("predictions.jsonl", COMPRESSED, "metrics.json", COMMANDS_NAME):
                (out / name).unlink(missing_ok=True)
        restore_run(out)  # a compressed run reopened (grow=true, or no metrics.json): its rows back in the plain file
        write_atomic(out / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(run_settings(cfg))))  # before any row
        return out, lock, None
    except BaseException:
        lock.release()
        raise


@contextlib.contextmanager
def claim_runs(runs: list[tuple[DictConfig, dict[str, str]]]):
    """Hold the run directories of ``runs`` (``(cfg, names)`` each) for the duration of the block.

    Each directory is locked (``.run.lock``), in path order so two processes never wait on each other; while
    another process holds it, its ``config.yaml`` is compared with ``cfg``: other settings are refused at once,
    the same settings wait. Under the lock a directory that holds rows or metrics of other settings is refused,
    a finished one is skipped, and ``config.yaml`` is written before any row, so two settings never mix in one
    run (whoever comes second). On an error before any row was written, the directories this call created are
    removed again.

    Yields:
        Per run, in ``runs`` order: ``(run directory, metrics)``, ``metrics`` being the finished run's
        ``metrics.json`` (nothing to do) or None (the run is held and still has work).

    Raises:
        ValueError: for a bad name, ratio or shard, or a run directory of other settings (pass
            ``overwrite=true`` or another ``output_dir``).
    """
    order = sorted(range(len(runs)), key=lambda k: str(run_dir(*runs[k])))
    held, made, claimed = [], [], {}
    try:
        for k in order:
            out, lock, metrics = _claim(*runs[k], made)
            claimed[k] = (out, metrics)
            if lock is not None:
                held.append(lock)
        yield [claimed[k] for k in range(len(runs))]
    except BaseException:
        for path in reversed(made):  # nothing left behind by a run that never wrote a row
            if path.is_dir() and not _has_rows(path) and not (path / "metrics.json").exists():
                for name in (LOCK_NAME, "config.yaml", COMMANDS_NAME):
                    (path / name).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.rmdir()  # only when empty
        raise
    finally:
        for lock in held:
            lock.release()


def start_run(cfg: DictConfig, names: dict[str, str]) -> tuple[Path, dict | None]:
    """Validate the names and ratio of one run, create its directory and write its ``config.yaml``, as
    :func:`claim_runs` does for one run, releasing the lock again (for scripts that run alone).

    Returns:
        ``(run directory, metrics)``; ``metrics`` is the finished run's ``metrics.json`` (then nothing
        was written) or None when the run still has work.

    Raises:
        ValueError: as :func:`claim_runs`.
    """
    with claim_runs([(cfg, names)]) as claimed:
        return claimed[0]


def run_examples(cfg: DictConfig, dataset, tokenizer) -> list:
    """The run's examples: the dataset's ``n_samples`` examples for ``seed``, then this run's shard.

    Raises:
        ValueError: when no example is left (:func:`evaluation.guards.check_examples`).
    """
    from evaluation.guards import check_examples

    if cfg.get("protocol") == "shared":  # several questions per context (evaluation.shared)
        examples = dataset.examples(tokenizer, cfg.n_samples, cfg.seed, cfg.query_aware, questions=cfg.questions)
    else:
        examples = dataset.examples(tokenizer, cfg.n_samples, cfg.seed, cfg.query_aware)
    shard = parse_shard(cfg.get("shard"))
    mine = examples[shard[0] :: shard[1]] if shard else examples
    check_examples(mine, cfg, len(examples))
    return mine


#: The fields of a row scored by the loss of the text after the context (:mod:`evaluation.continuation`), in nats
#: per token; :func:`summarize` averages them and the report tables them.
CONTINUATION_FIELDS = ("nll", "nll_uncompressed", "nll_increase", "kl")


def prediction_row(
    ex,
    names: dict[str, str],
    dataset,
    prediction: str,
    cache,
    model,
    context_length: int,
    seconds: float,
    press,
    score: float | None = None,
    **extra,
) -> dict:
    """One ``predictions.jsonl`` row: the example, the prediction and its score (``dataset.score``, or ``score`` when
    given: a continuation row's, :mod:`evaluation.continuation`), the effective and the
    physical compression (:func:`cache_stats`), seconds, and
    ``press.summary()`` when the press has one, and the project's trained scorers it ran with
    (:func:`evaluation.registry.scorer_files`: their files' SHA-256, only when it holds one)."""
    row = {
        "id": ex.id,
        "task": ex.task or names["dataset"],
        "context_length": context_length,
        "depth": ex.metadata.get("depth"),
        "answers": ex.answers,
        "prediction": prediction,
        "score": float(dataset.score(prediction, ex) if score is None else score),
        **cache_stats(cache, model, context_length, press),
        "seconds": seconds,
        "press_stats": press.summary() if press is not None and hasattr(press, "summary") else None,
        **extra,
        "metadata": ex.metadata,
    }
    from evaluation.registry import scorer_files  # torch and kvpress only once a model runs

    files = scorer_files(press)
    if files:  # the trained scorers it ran with (their files are not settings): only rows of such presses hold it
        row["scorer_files"] = files
    return row


def row_ids(ex) -> list[str]:
    """The ids of the rows one example gives: its own id, or with several questions per context
    (``Example.questions``, :mod:`evaluation.shared`) one per question, ``<id>#q<k>`` for k = 1..K."""
    questions = getattr(ex, "questions", ())
    return [f"{ex.id}#q{k}" for k in range(1, len(questions) + 1)] if questions else [ex.id]


def finish_run(out: Path, examples: list, names: dict[str, str], cfg: DictConfig, command: str) -> dict:
    """Summarise the run's rows (those of ``examples``: :func:`row_ids`) into ``metrics.json``, written atomically."""
    ids = {i for e in examples for i in row_ids(e)}
    rows = [r for r in read_predictions(out / "predictions.jsonl", repair=True) if r["id"] in ids]
    metrics = summarize(rows)
    metrics.update(
        {
            "press": run_label(names),
            "dataset": names["dataset"],
            "model": names["model"],
            "compression_ratio": 0.0 if names["press"] == "no_press" else check_ratio(cfg.compression_ratio),
            "shard": cfg.get("shard"),
            "command": command,
        }
    )
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2))
    logger.info("wrote %s: score %.3f over %d examples", out / "metrics.json", metrics["score"], metrics["n"])
    return metrics


@contextlib.contextmanager
def chat_template(tokenizer, enabled: bool):
    """Temporarily drop the tokenizer's chat template for examples whose official prompt has none
    (LongBench's trec, triviaqa, samsum, lsht, lcc, repobench-p: ``metadata["chat_template"] = False``).
    Without a template kvpress's pipeline prepends the BOS token; :class:`evaluation.pipeline.TextGenerationPipeline`
    prepends nothing for a tokenizer that has none."""
    saved = tokenizer.chat_template
    if not enabled:
        tokenizer.chat_template = None
    try:
        yield
    finally:
        tokenizer.chat_template = saved


def summarize(rows: list[dict]) -> dict:
    """Mean score, per-task means, mean effective compression and timing of prediction rows, and the mean of each
    :data:`CONTINUATION_FIELDS` field that every row holds; rows of the shared-context protocol (with
    ``question_index``, one per question) add the mean score per question position (``per_question``, 1-based) and
    the number of contexts (``n_contexts``; ``n`` counts answers)."""
    n = len(rows)

    def mean(xs):
        return sum(xs) / len(xs) if xs else math.nan

    tasks = sorted({r["task"] for r in rows})
    losses = {k: mean([r[k] for r in rows]) for k in CONTINUATION_FIELDS if rows and all(k in r for r in rows)}
    return {
        "n": n,
        **losses,
        "score": mean([r["score"] for r in rows]),
        "per_task": {t: mean([r["score"] for r in rows if r["task"] == t]) for t in tasks},
        "effective_compression": mean([r["effective_compression"] for r in rows]),
        "physical_compression": mean([r["physical_compression"] for r in rows]),
        "seconds_per_example": mean([r["seconds"] for r in rows]),
        **_per_question(rows, mean),
    }


def _per_question(rows: list[dict], mean) -> dict:
    """``per_question`` (mean score per 1-based question position) and ``n_contexts`` of shared-protocol rows, or
    nothing for rows of one question per context."""
    if not rows or not all("question_index" in r for r in rows):
        return {}
    positions = sorted({int(r["question_index"]) for r in rows})
    return {
        "n_contexts": len({r["example_id"] for r in rows}),
        "per_question": {str(k): mean([r["score"] for r in rows if r["question_index"] == k]) for k in positions},
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
