"""Hydra entry point: run one press on one dataset with one model, resumably, through kvpress's pipeline.

Usage (``configs/config.yaml``; the README lists the groups)::

    python -m evaluation.run press=<press> dataset=<dataset> compression_ratio=0.75 n_samples=4
    python -m evaluation.run -m press=<press>,<press> compression_ratio=0.5,0.75   # a sweep

Each run writes ``<output_dir>/<dataset>[-qa]/<model>/<press>/cr<ratio>[/shard_i_of_n]/`` (see
:mod:`evaluation.harness`); the per-example loop is :func:`evaluation.loop.evaluate`.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from evaluation import inputs
from evaluation.cli import check_command_line, one_line_errors
from evaluation.harness import CONFIG_DIR, command_line

__all__ = ["run", "main"]


def run(cfg: DictConfig, names: dict[str, str] | None = None) -> dict:
    """Run one (model, dataset, press, ratio[, shard]) and return its metrics.

    The inputs are resolved first (:func:`evaluation.inputs.prepare`, without importing torch or kvpress), so
    bad input fails in seconds and before anything is written.

    Args:
        cfg: the composed config (``configs/config.yaml``).
        names: the chosen ``press``, ``dataset`` and ``model`` config names (default: Hydra's choices).

    Raises:
        ValueError: as :func:`evaluation.loop.evaluate`.
    """
    names = names or {g: HydraConfig.get().runtime.choices[g] for g in ("press", "dataset", "model")}
    prepared = inputs.prepare([(cfg, names)])
    from evaluation.loop import evaluate  # torch and kvpress only once the inputs are resolved

    return evaluate([(cfg, names)], command_line(), prepared=prepared)[0]


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float:
    """Hydra's task: one run; returns the score so sweepers can optimise it. Bad input: one ``error:`` line and exit
    status 1 (:mod:`evaluation.cli`)."""
    with one_line_errors():
        return run(cfg)["score"]


def main() -> None:
    """The command line (``sys.argv``): refused in one line, before Hydra starts, when it names a config or a key
    this command does not have (:func:`evaluation.cli.check_command_line`); else Hydra runs the job(s)."""
    check_command_line(sys.argv[1:], "config", "evaluation.run")
    _hydra_main()


if __name__ == "__main__":
    main()
