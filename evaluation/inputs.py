"""A sweep's inputs resolved before anything is loaded or written: names, ratios and settings, then the model and
the data.

:func:`prepare` imports neither torch nor kvpress, so bad input fails in seconds: ``python -m evaluation.run`` and
``python -m evaluation.fused`` call it before they import the per-example loop, and
:func:`evaluation.loop.evaluate` calls it when given no prepared inputs. Its checks, in order:

0. every run setting is written in its one spelling, in place (:func:`evaluation.settings.normalise`), before it
   names a directory, is compared or saved, and values of no use are refused
   (:func:`evaluation.guards.check_setting_values`);
1. the runs agree on :data:`SHARED_KEYS`; each run's names, ratio and shard are valid, and a run directory that
   holds rows or metrics of other settings is refused (read-only: :func:`evaluation.harness.check_existing_run`);
   finished runs are set aside, and when none is left nothing else happens;
2. the run settings (:func:`evaluation.guards.check_settings`);
3. the model is found (a local directory, the embedded package, the hub or the local hub cache;
   :func:`evaluation.models.check_available`, which answers offline in seconds);
4. the dataset is built (its own parameter checks) and its files are read (``Dataset.prepare``), and
   ``n_samples`` (with ``protocol=shared``, ``questions`` too) is checked against what it can give
   (:func:`evaluation.guards.check_dataset`).

The model is loaded, the examples built and every example checked against the model and the presses only after
this, still before any run directory is created (:func:`evaluation.loop.evaluate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.utils import instantiate
from omegaconf import DictConfig

from evaluation import guards, harness, models, settings

__all__ = ["SHARED_KEYS", "Prepared", "prepare"]

#: Settings every run of one :func:`evaluation.loop.evaluate` call must share (one model, one dataset, one
#: example list).
SHARED_KEYS = (
    "model",
    "dataset",
    "seed",
    "n_samples",
    "shard",
    "query_aware",
    "protocol",
    "questions",
    "shared_mode",
    "device",
    "max_new_tokens",
)


@dataclass
class Prepared:
    """What :func:`prepare` resolved: per run, the finished run's metrics (or None when it has work), and the
    dataset (None when every run is finished)."""

    finished: dict[int, dict] = field(default_factory=dict)
    dataset: object = None

    def pending(self, n_runs: int) -> list[int]:
        """Indices of the runs that still have work."""
        return [k for k in range(n_runs) if k not in self.finished]


def prepare(cfgs: list[tuple[DictConfig, dict[str, str]]]) -> Prepared:
    """Resolve the inputs of the runs ``cfgs`` (``(cfg, names)`` each) in the order of the module docstring; each
    ``cfg`` (a ``DictConfig``) is normalised in place.

    Raises:
        ValueError: runs that disagree on a shared setting, a bad name, ratio, shard or setting, a run directory
            of other settings, a dataset parameter or ``n_samples`` the dataset cannot take.
        FileNotFoundError, ImportError, OSError: a model that cannot be found (the message says how to fix it).
        FileNotFoundError, evaluation.datasets.base.DataUnavailableError: data that cannot be found.
    """
    for cfg, _ in cfgs:
        settings.normalise(cfg)  # in place: the loop, the run directories and config.yaml read the one spelling
        guards.check_setting_values(cfg)
    first, first_names = cfgs[0]
    for cfg, names in cfgs[1:]:
        for key in SHARED_KEYS:
            if cfg.get(key) != first.get(key):
                raise ValueError(
                    f"runs of one sweep must share {key}: {names['press']} has {cfg.get(key)!r}, "
                    f"{first_names['press']} has {first.get(key)!r}"
                )
    prepared = Prepared()
    for k, (cfg, names) in enumerate(cfgs):
        metrics = harness.check_existing_run(cfg, names)
        if metrics is not None:
            prepared.finished[k] = metrics
    if not prepared.pending(len(cfgs)):
        return prepared
    guards.check_settings(first)
    models.check_available(first.model.name, first.model.get("path"))
    dataset = instantiate(first.dataset)
    if callable(getattr(dataset, "prepare", None)):
        dataset.prepare()
    shared = first.get("protocol") == "shared"  # several questions per context (evaluation.shared)
    guards.check_dataset(dataset, first.n_samples, first.get("questions") if shared else None)
    prepared.dataset = dataset
    return prepared
