"""Sweep grids, launcher configs and the Makefile's launcher option compose with the harness config (no job is
launched; tests/test_launchers.py launches them)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# left out of the grids: the baseline, presses that cannot answer through the pipeline or need the question in the
# context, and presses that need weights trained for the model (README, kvpress's presses)
#: Presses the grids leave out besides those that need the question inside: the baseline, and those that need
#: weights trained for the model (README).
NOT_IN_GRID = {"no_press", "qfilter", "kvzap", "dms", "fastkvzip", "duo_attention", "lukv", "expected_attention_stats"}
NOT_IN_GRID |= {"kvzap_linear", "kvzap_mlp", "dms_linear"}  # trained per model (results/scorers/)
NOT_IN_GRID |= {"per_layer_compression"}  # its ratios are a list per layer of the model, not the grid's ratio


@pytest.fixture
def hydra_compose():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield lambda overrides: compose("config", overrides=overrides, return_hydra_config=True)


def _jobs(cfg, extra=()) -> list[dict[str, str]]:
    """The job list Hydra's basic sweeper would launch for ``cfg.hydra.sweeper.params`` (+ extra overrides)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + list(extra)
    (batch,) = BasicSweeper.split_arguments(parser.parse_overrides(params), None)
    return [dict(o.split("=", 1) for o in job) for job in batch]


def _grid_presses(hydra_compose) -> set[str]:
    """Every press config but :data:`NOT_IN_GRID` and the presses that need the question inside the context (the
    registry's ``needs_question``: the grid runs kvpress's protocol, the question after)."""
    from hydra.utils import instantiate

    from evaluation.registry import capabilities

    names = {p.stem for p in (CONFIG_DIR / "press").glob("*.yaml")} - NOT_IN_GRID
    return {n for n in names if not capabilities(instantiate(hydra_compose([f"press={n}"]).press)).needs_question}


def test_standard_grid_is_every_press_by_three_ratios(hydra_compose):
    presses = _grid_presses(hydra_compose)
    assert "entroprefill_page" not in presses and "page_entrokv" in presses
    jobs = _jobs(hydra_compose(["+experiment=grid", "dataset=ruler"]))
    assert {j["press"] for j in jobs} == presses
    assert {j["compression_ratio"] for j in jobs} == {"0.25", "0.5", "0.75"}
    assert len(jobs) == 3 * len(presses) == len({tuple(sorted(j.items())) for j in jobs})


def test_sharded_grid_and_paper003_grid(hydra_compose):
    presses = _grid_presses(hydra_compose)
    jobs = _jobs(hydra_compose(["+experiment=grid"]), extra=["shard=0/2,1/2"])
    assert len(jobs) == 6 * len(presses) and {j["shard"] for j in jobs} == {"0/2", "1/2"}
    jobs = _jobs(hydra_compose(["+experiment=grid_paper003"]))
    assert {j["dataset"] for j in jobs} == {"ruler_paper003", "longbench_paper003"}
    assert len(jobs) == 2 * 3 * len(presses)
    assert _jobs(hydra_compose(["+experiment=baseline"])) == [{"press": "no_press", "compression_ratio": "0.0"}]


def test_submitit_slurm_launcher_composes(hydra_compose):
    # The SLURM launcher is the `slurm` extra for users; the `dev` extra (make install) has it too, so this runs in CI.
    target = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert hydra_compose(["hydra/launcher=submitit_slurm"]).hydra.launcher._target_ == target
    cfg = hydra_compose(["+experiment=grid", "hydra/launcher=slurm"])
    assert cfg.hydra.launcher._target_ == target and cfg.device == "cpu"
    assert cfg.hydra.launcher.gpus_per_node is None  # a CPU run asks for no GPU; GPU runs ask for theirs:
    setup = OmegaConf.to_container(cfg.hydra.launcher.setup, resolve=True)  # shell lines (YAML could make dicts)
    assert len(setup) == 1 and isinstance(setup[0], str) and setup[0].startswith("export OMP_NUM_THREADS=")
    gpu = ["hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=1", "device=cuda:0"]
    cfg = hydra_compose(["+experiment=grid", "hydra/launcher=slurm", *gpu])
    assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.hydra.launcher.partition == "gpu"


def test_make_launcher_runs_each_shared_prefill_sweep_as_an_array_of_shards():
    """``make paper003-grid LAUNCHER=slurm SHARDS=3``: both of its sweeps become ``evaluation.fused -m`` over three
    shards on the SLURM launcher, with ``LAUNCH_ARGS`` passed on; the command lines parse as Hydra sweeps."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    venv = Path(sys.executable).parent.parent  # `make -n` prints the commands, with this interpreter's venv
    launch = ["LAUNCHER=slurm", "SHARDS=3", "LAUNCH_ARGS=hydra.launcher.gpus_per_node=1 device=cuda:0"]
    make = ["make", "-n", "paper003-grid", f"VENV={venv}", *launch]
    printed = subprocess.run(make, cwd=CONFIG_DIR.parent, capture_output=True, text=True, check=True).stdout
    sweeps = [shlex.split(line) for line in printed.splitlines() if " -m evaluation.fused " in line]
    assert len(sweeps) == 2
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        for argv in sweeps:
            args = argv[argv.index("evaluation.fused") + 1 :]
            assert args[0] == "-m"
            (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(args[1:]), None)
            assert sorted(dict(o.split("=", 1) for o in job)["shard"] for job in jobs) == ["0/3", "1/3", "2/3"]
            cfg = compose("fused", overrides=jobs[0], return_hydra_config=True)
            assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.device == "cuda:0" and cfg.shard == "0/3"
    plain = subprocess.run(
        ["make", "-n", "sweep", f"VENV={venv}"], cwd=CONFIG_DIR.parent, capture_output=True, text=True, check=True
    )
    (line,) = [line for line in plain.stdout.splitlines() if " -m evaluation.fused " in line]
    assert "hydra/launcher" not in line and "shard=" not in line  # without LAUNCHER: one process, as before


def test_joblib_launcher_composes(hydra_compose):
    cfg = hydra_compose(["hydra/launcher=joblib_local", "hydra.launcher.n_jobs=3"])
    assert cfg.hydra.launcher._target_ == "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    assert cfg.hydra.launcher.n_jobs == 3


@pytest.mark.parametrize(
    "name", ["ruler", "ruler_paper003", "ruler_smoke", "longbench", "longbench_paper003", "longbench_e"]
)
def test_dataset_configs_instantiate(hydra_compose, name):
    from hydra.utils import instantiate

    cfg = hydra_compose([f"dataset={name}"])
    ds = instantiate(cfg.dataset)
    assert ds.name == name.split("_")[0] and len(ds.tasks) > 0
    if name == "ruler_paper003":
        assert len(ds.tasks) * ds.num_samples == 130  # paper 003 section 7: 130 RULER examples
    if name == "longbench_paper003":
        assert sorted(ds.tasks) == ["hotpotqa", "qasper", "triviaqa"] and ds.skip_longer_than == 3000
