"""Bad input on the command line gets one line: ``error: <message>`` on stderr and exit status 1.

Hydra prints a traceback for any error a job raises. The harness's entry points (``evaluation.run``,
``evaluation.fused``) run their job inside :func:`one_line_errors`: an error that means bad input or missing
model or data (:data:`INPUT_ERRORS`, also when Hydra wrapped it while instantiating a config) is printed as one
line, the Hydra job directory the failed job made (``<output_dir>/.hydra/<time>/``) is removed with the
directories it leaves empty, and the process exits with status 1. With ``HYDRA_FULL_ERROR=1`` the error is
raised with its full traceback instead, as Hydra does; other errors (bugs) keep Hydra's traceback and directory.
An unknown config name on the command line (``press=nope``), which Hydra reports in some thirty lines before any
job starts, gets the same one line (:func:`check_group_choices`, called before Hydra).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

__all__ = ["INPUT_ERRORS", "one_line_errors", "input_error", "check_group_choices"]


def _input_errors() -> tuple[type, ...]:
    from evaluation.datasets.base import DataUnavailableError

    return (ValueError, OSError, ImportError, DataUnavailableError)


#: Errors that mean bad input or a model or data that cannot be found (their messages say what to do).
INPUT_ERRORS = _input_errors()


def input_error(err: BaseException) -> BaseException | None:
    """The input error behind ``err`` (itself, or the cause Hydra wrapped while instantiating a config), or
    None for any other error."""
    from hydra.errors import InstantiationException

    outer = err
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    if isinstance(err, INPUT_ERRORS):
        return err
    if isinstance(outer, InstantiationException) and isinstance(err, TypeError):
        return outer  # a config's arguments do not fit its _target_: Hydra's message names the target and the key
    return None


def _remove_job_dir() -> None:
    """Remove this Hydra job's output directory (a single run's ``<output_dir>/.hydra/<time>/``), then the
    directories above it that it leaves empty, up to the run's ``output_dir``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not under Hydra
        return
    if hydra_cfg.mode != RunMode.RUN:  # a sweep's directory is shared by its jobs
        return
    job_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    if job_dir.parent.name != ".hydra":  # a user-chosen hydra.run.dir: leave it
        return
    shutil.rmtree(job_dir, ignore_errors=True)
    for parent in (job_dir.parent, job_dir.parent.parent):
        with contextlib.suppress(OSError):
            parent.rmdir()  # only when empty


@contextlib.contextmanager
def one_line_errors():
    """Run a Hydra job; turn an input error into ``error: <message>`` on stderr and exit status 1 (see the
    module docstring)."""
    try:
        yield
    except Exception as err:  # filtered just below
        cause = input_error(err)
        if cause is None:
            raise
        _remove_job_dir()
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        message = " ".join(str(cause).split()) or type(cause).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def check_group_choices(argv: list[str], groups: tuple[str, ...] = ("press", "dataset", "model")) -> None:
    """Exit with one ``error:`` line when a command-line override names a config that ``configs/<group>/`` lacks.

    Plain choices and comma-separated sweeps (``press=a,b``) are checked; anything else (Hydra's sweep
    functions, interpolations, ``+group=...``) is left to Hydra.
    """
    from evaluation.harness import config_choices

    for arg in argv:
        group, sep, value = arg.partition("=")
        if not sep or group not in groups or any(c in value for c in "()[]{}$*"):
            continue
        valid = config_choices(group)
        for name in (v.strip() for v in value.split(",")):
            if name not in valid:
                print(f"error: unknown {group} '{name}'; valid: {', '.join(valid)}", file=sys.stderr, flush=True)
                raise SystemExit(1)
