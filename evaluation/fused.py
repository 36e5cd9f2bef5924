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
from evaluation.cli import check_group_choices, one_line_errors

__all__ = ["run_fused", "compose_runs", "main"]


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


def compose_runs(cfg: DictConfig, overrides: list[str]) -> list[tuple[DictConfig, dict[str, str]]]:
    """Compose one harness config per (press, ratio) of ``cfg.presses`` x ``cfg.ratios`` (the uncompressed
    baseline ``no_press`` once), with the user's other ``overrides``, as ``python -m evaluation.run`` would.

    Raises:
        ValueError: for an unknown press name or a ratio outside ``[0, 1)``.
    """
    choices = harness.config_choices("press")
    base = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("presses", "ratios")]
    runs = []
    for press in cfg.presses:
        if press not in choices:
            raise ValueError(f"unknown press '{press}'; valid: {', '.join(choices)}")
        for ratio in [0.0] if press == "no_press" else cfg.ratios:
            harness.check_ratio(ratio)
            run_cfg = compose(config_name="config", overrides=[*base, f"press={press}", f"compression_ratio={ratio}"])
            names = {
                "press": press,
                "dataset": HydraConfig.get().runtime.choices["dataset"],
                "model": HydraConfig.get().runtime.choices["model"],
            }
            runs.append((run_cfg, names))
    return runs


@hydra.main(config_path=str(harness.CONFIG_DIR), config_name="fused", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of the shared-prefill sweep (``configs/fused.yaml``). Bad input: one ``error:`` line and
    exit status 1 (:mod:`evaluation.cli`)."""
    with one_line_errors():
        overrides = list(HydraConfig.get().overrides.task)
        run_fused(
            compose_runs(cfg, overrides),
            harness.command_line("python -m evaluation.fused"),
            cfg.batch_decode,
            cfg.get("pad_decode", True),
        )


if __name__ == "__main__":
    check_group_choices(sys.argv[1:])
    main()
