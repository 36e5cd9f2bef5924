"""Shared-prefill sweep: one uncompressed prefill per example feeds every press of a sweep.

Usage (``configs/fused.yaml``)::

    python -m evaluation.fused dataset=<dataset> presses=[<press>,<press>] ratios=[0.5,0.75] [query_aware=true]
    python -m evaluation.fused -m hydra/launcher=slurm shard=0/4,1/4,2/4,3/4 ...   # one job per shard (README)

Writes the same run directories, rows and metrics as ``python -m evaluation.run`` (so ``make report`` reads
both), and resumes the same way: an example is prefilled only if some run still lacks its row. The replay is
exact for presses whose capability ``shares_prefill`` holds (:mod:`evaluation.registry`; why:
:mod:`evaluation.replay`); presses that score once per example (``scores_once``: KVzip) get one scoring pass for all
their runs (:mod:`evaluation.kvzip_path`); others raise (run them with ``evaluation.run``). A row's ``seconds``
is the shared prefill plus that press's hook replay (for KVzip: the whole scoring pass) plus its share of the
(batched) decode; ``prefill_seconds`` gives the shared part and ``decode_batch`` the batch size. Within one
example the presses share what does not depend on their options (one :class:`evaluation.memo.ReplayMemo` per
example: the probabilistic presses' proposals, Page-EntroKV's observer attention): it is computed by the first run
that needs it, so that run's ``seconds`` carries it and the later runs' do not.
"""

from __future__ import annotations

import sys

import hydra
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from evaluation import harness, inputs
from evaluation.cli import check_command_line, one_line_errors

__all__ = ["NOT_READ", "run_fused", "compose_runs", "not_read_problem", "main"]


def run_fused(
    cfgs: list[tuple[DictConfig, dict[str, str]]], command: str, batch_decode: bool = True, pad_decode: bool = True
) -> list[dict]:
    """Run several (press, ratio) configs of ONE model and dataset from shared prefills
    (:func:`evaluation.loop.evaluate` with ``shared_prefill=True``).

    Args:
        cfgs: ``(cfg, names)`` per run, each as ``python -m evaluation.run`` would compose it.
        command: the command recorded in each ``metrics.json``.
        batch_decode: decode the runs of an example whose caches have equal per-layer lengths in one batch.
        pad_decode: with ``batch_decode``, decode all runs of one compression ratio as one batch (padding masked);
            default True, as in ``configs/fused.yaml``.

    Returns:
        The metrics of every run, in ``cfgs`` order.

    Raises:
        ValueError: as :func:`evaluation.loop.evaluate`, and for a press that cannot share a prefill.
        FileNotFoundError, OSError, ImportError, DataUnavailableError: a model or data that cannot be found.
    """
    prepared = inputs.prepare(cfgs)  # bad input fails before torch and kvpress are imported
    from evaluation.loop import evaluate

    return evaluate(
        cfgs, command, shared_prefill=True, batch_decode=batch_decode, pad_decode=pad_decode, prepared=prepared
    )


#: Keys of ``configs/config.yaml`` that this command does not read, with the key it reads instead: the command
#: line refuses them (:func:`evaluation.cli.check_command_line`), as :func:`compose_runs` does.
NOT_READ = {"press": "presses", "compression_ratio": "ratios"}


def not_read_problem(override: str) -> str | None:
    """Why the command-line ``override`` (``key=value``) would be ignored by this command (a key of
    :data:`NOT_READ`), with the override it means; None for any other."""
    key, sep, value = override.partition("=")
    key = key.lstrip("+~")
    if not sep or key not in NOT_READ:
        return None
    value = value.strip()
    listed = value if value.startswith("[") else f"[{value}]"
    return (
        f"evaluation.fused reads {NOT_READ[key]}=, not {key}= (it would run the default {NOT_READ[key]} of "
        f"configs/fused.yaml): did you mean {NOT_READ[key]}={listed}?"
    )


def compose_runs(cfg: DictConfig, overrides: list[str]) -> list[tuple[DictConfig, dict[str, str]]]:
    """Compose one harness config per (press, ratio) of ``cfg.presses`` x ``cfg.ratios`` (the uncompressed
    baseline ``no_press`` once), with the user's other ``overrides``, as ``python -m evaluation.run`` would.

    Each ratio is written in its one spelling (:func:`evaluation.harness.check_ratio`: ``[0.5,0.50]`` is one ratio)
    and a press or ratio given twice is one run.

    Raises:
        ValueError: for an unknown press name, a ratio outside ``[0, 1)``, or an override of a key this command does
            not read (``press=``, ``compression_ratio=``: :data:`NOT_READ`).
    """
    for override in overrides:
        problem = not_read_problem(override)
        if problem:
            raise ValueError(problem)
    choices = harness.config_choices("press")
    base = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("presses", "ratios")]
    ratios = list(dict.fromkeys(harness.check_ratio(r) for r in cfg.ratios))  # one spelling, each once
    runs = []
    for press in dict.fromkeys(cfg.presses):
        if press not in choices:
            raise ValueError(harness.unknown_config("press", press))
        for ratio in [0.0] if press == "no_press" else ratios:
            run_cfg = compose(config_name="config", overrides=[*base, f"press={press}", f"compression_ratio={ratio!r}"])
            names = {
                "press": press,
                "dataset": HydraConfig.get().runtime.choices["dataset"],
                "model": HydraConfig.get().runtime.choices["model"],
            }
            runs.append((run_cfg, names))
    return runs


@hydra.main(config_path=str(harness.CONFIG_DIR), config_name="fused", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    """Hydra's task: the shared-prefill sweep (``configs/fused.yaml``). Bad input: one ``error:`` line and exit
    status 1 (:mod:`evaluation.cli`)."""
    with one_line_errors():
        overrides = list(HydraConfig.get().overrides.task)
        run_fused(
            compose_runs(cfg, overrides),
            harness.command_line("python -m evaluation.fused"),
            cfg.batch_decode,
            cfg.get("pad_decode", True),
        )


def main() -> None:
    """The command line (``sys.argv``): refused in one line, before Hydra starts, when it names a config or a key
    this command does not have or does not read (``press=``, ``compression_ratio=``: :data:`NOT_READ`;
    :func:`evaluation.cli.check_command_line`); else Hydra runs the sweep."""
    check_command_line(sys.argv[1:], "fused", "evaluation.fused", not_read_problem)
    _hydra_main()


if __name__ == "__main__":
    main()
