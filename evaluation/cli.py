"""Bad input on the command line gets one line: ``error: <message>`` on stderr and exit status 1.

Hydra prints a traceback for any error a job raises. The harness's entry points (``evaluation.run``,
``evaluation.fused``) run their job inside :func:`one_line_errors`: an error that means bad input or missing
model or data (:data:`INPUT_ERRORS`, also when Hydra wrapped it while instantiating a config) is printed as one
line, the Hydra job directory the failed job made (``<output_dir>/.hydra/<time>/``) is removed with the
directories it leaves empty, and the process exits with status 1. With ``HYDRA_FULL_ERROR=1`` the error is
raised with its full traceback instead, as Hydra does; other errors (bugs) keep Hydra's traceback and directory.
An unknown config name on the command line (``press=nope``), which Hydra reports in some thirty lines before any
job starts, gets the same one line with the closest names (:func:`check_command_line`, called before Hydra).

Every command refuses what it does not read (issue 65 item 3), with one line and a "did you mean":

- the Hydra entry points (``evaluation.run``, ``evaluation.fused``, ``evaluation.uor``,
  ``evaluation.studies.bench_speed_memory``) check their command line before Hydra starts
  (:func:`check_command_line`): a key that their config does not hold (``+presss=<press>``, which Hydra's own advice
  for ``presss=<press>`` leads to and which it then accepts and ignores; ``model.enable_thinkin=true``), and a key
  the command holds but does not read (``evaluation.fused press=<press>``: it reads ``presses=``);
- the argparse entry points (``evaluation.report``, ``evaluation.migrate``, ``evaluation.merge_runs``, the studies)
  parse with :class:`ArgumentParser`: an unknown option gets its closest options, and every usage error is one line.

``--help`` of ``evaluation.run`` and ``evaluation.fused`` (``configs/hydra/help/harness.yaml``) lists the presses a
user runs, this project's and kvpress's, apart from the tuning and ablation variants (:func:`config_groups_help`):
a press config whose first line is ``# variant of <press>: <what it tries>`` (:data:`VARIANT_LINE`) is a variant of
that press; it keeps its name, so ``press=<variant>`` and its committed runs are as before (issue 65 item 6).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

__all__ = [
    "INPUT_ERRORS",
    "ArgumentParser",
    "VARIANT_LINE",
    "check_command_line",
    "config_groups_help",
    "input_error",
    "one_line_errors",
    "press_variants",
    "refuse",
]


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


def refuse(message: str) -> None:
    """Print ``error: <message>`` (one line) on stderr and exit with status 1."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _hydra_overrides(argv: list[str], command: str) -> tuple[list[str], str | None] | None:
    """The overrides and the ``--config-name`` of a Hydra command line (Hydra's own argument parser), or None when
    it asks for help or cannot be parsed (Hydra then answers itself); an option Hydra does not know is refused
    (:func:`refuse`), with the closest ones."""
    from hydra._internal.utils import get_args_parser

    from evaluation.harness import did_you_mean

    parser = get_args_parser()
    try:
        with contextlib.redirect_stderr(None):
            args, unknown = parser.parse_known_args(argv)
    except SystemExit:
        return None
    if args.help or args.hydra_help or args.shell_completion:
        return None
    options = [s for a in parser._actions for s in a.option_strings]
    for arg in unknown:
        if arg.startswith("-"):
            close = did_you_mean(arg.split("=")[0], options)
            hint = f"did you mean {' or '.join(close)}?" if close else "Hydra's options: --help"
            refuse(f"{command}: unrecognized option {arg} ({hint}); settings are key=value overrides")
    return [*args.overrides, *unknown], args.config_name


def _global_groups(config_dir: Path) -> set[str]:
    """Config groups whose every config is ``# @package _global_`` (``experiment``): ``+group=name`` merges it into
    the whole config (Hydra's sweeper settings), no key of its own."""
    found = set()
    for group in (p for p in config_dir.iterdir() if p.is_dir() and p.name != "hydra"):
        files = sorted(group.glob("*.yaml"))
        if files and all("@package _global_" in f.read_text(encoding="utf-8").split("\n", 1)[0] for f in files):
            found.add(group.name)
    return found


def _unknown_key(key: str, known, command: str) -> str:
    from evaluation.harness import did_you_mean

    close = did_you_mean(key.rpartition(".")[2], known)
    prefix = key.rpartition(".")[0]
    close = [f"{prefix}.{c}" if prefix else c for c in close]
    hint = f"did you mean {' or '.join(close)}?" if close else f"it reads: {', '.join(sorted(map(str, known)))}"
    return f"{command} has no key {key!r} (a '+' would add it, and nothing would read it): {hint}"


def check_command_line(
    argv: list[str], config_name: str, command: str, not_read=None, config_dir: Path | None = None
) -> None:
    """Exit with one ``error:`` line (:func:`refuse`) for a Hydra command-line override the command does not read,
    before Hydra starts (so before any model loads):

    - a config name that its group lacks, alone or in a sweep (``press=<typo>``, ``-m press=<press>,<typo>``:
      :func:`evaluation.harness.unknown_config`, the closest names);
    - a key its config does not hold, added with ``+``/``++`` or not (``+presss=<press>``), at the top level or in a
      section of settings (``model.enable_thinkin=true``); a section that builds an object (``press``, ``dataset``:
      a ``_target_``) is left to its constructor, which refuses an unknown argument itself, and an empty mapping
      (``press_overrides: {}``) takes any key; ``hydra`` keys, ``hydra/...`` groups and ``+experiment=...`` (a
      group of ``@package _global_`` configs) are Hydra's;
    - a key the config holds but the command ignores: ``not_read(override)`` returns why (e.g.
      :func:`evaluation.fused.not_read_problem`), or None.

    Args:
        argv: the command line after the program (``sys.argv[1:]``).
        config_name: the primary config (``configs/<config_name>.yaml``), unless the command line names another.
        command: the command as the message names it (``evaluation.run``).
        not_read: see above (default: every key of the config is read).
        config_dir: the config directory (default :data:`evaluation.harness.CONFIG_DIR`).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, OverrideType
    from omegaconf import DictConfig

    from evaluation import harness

    config_dir = Path(config_dir or harness.CONFIG_DIR)
    parsed = _hydra_overrides(argv, command)
    if parsed is None:
        return
    texts, named = parsed
    try:
        overrides = OverridesParser.create().parse_overrides(texts)
    except Exception:  # a syntax error: Hydra's own message says where
        return
    groups = {p.name for p in config_dir.iterdir() if p.is_dir() and p.name != "hydra"}
    global_groups = _global_groups(config_dir)
    for o in overrides:
        if o.key_or_group in groups and o.package is None and o.type != OverrideType.DEL:
            value = o.value()
            names = [value] if isinstance(value, str) else list(value.list) if isinstance(value, ChoiceSweep) else []
            valid = harness.config_choices(o.key_or_group)
            for name in names:
                if str(name) not in valid:
                    refuse(harness.unknown_config(o.key_or_group, str(name)))
        problem = not_read(o.input_line) if not_read else None
        if problem:
            refuse(problem)
    choices = [  # the plain group choices, so that each section is the one the command will compose
        o.input_line
        for o in overrides
        if o.key_or_group in groups
        and o.package is None
        and o.type == OverrideType.CHANGE
        and not o.is_sweep_override()
    ]
    try:
        cfg = harness.compose_config(choices, named or config_name)
    except Exception:  # a config that does not compose: Hydra's own message says why
        return
    for o in overrides:
        key = o.key_or_group
        top = key.split("/")[0].split(".")[0]
        if o.package is not None or o.type == OverrideType.DEL or top == "hydra" or "/" in key:
            continue
        if top not in cfg.keys():
            if top in global_groups and "." not in key and o.type != OverrideType.CHANGE:
                continue
            refuse(_unknown_key(top, [k for k in cfg.keys() if k != "hydra"], command))
        node, path = cfg, []
        for part in key.split("."):
            if not isinstance(node, DictConfig) or "_target_" in node or (len(node) == 0 and path):
                break  # a constructor's arguments, a list or value, or a free mapping
            if part not in node.keys():  # keys() also holds a '???' value, which ``in`` does not see
                refuse(_unknown_key(".".join([*path, part]), list(node.keys()), command))
            node, path = node._get_node(part), [*path, part]  # the node itself: a '???' value is not read


#: The first line of a press config that is a tuning or ablation variant of another press (``<press>``, a press
#: config that is no variant): ``# variant of <press>: <what it tries>``.
VARIANT_LINE = re.compile(r"# variant of (\w+):")


def press_variants(config_dir: Path | None = None) -> dict[str, str]:
    """Each tuning or ablation variant among the press configs (first line :data:`VARIANT_LINE`), with the press
    it varies: ``{<variant config>: <the press config it varies>, ...}``.

    Args:
        config_dir: the config directory (default :data:`evaluation.harness.CONFIG_DIR`).
    """
    from evaluation import harness

    found = {}
    for path in sorted((Path(config_dir or harness.CONFIG_DIR) / "press").glob("*.yaml")):
        with path.open(encoding="utf-8") as f:
            match = VARIANT_LINE.match(f.readline())
        if match:
            found[path.stem] = match.group(1)
    return found


def _press_target(path: Path) -> str | None:
    """The ``_target_`` a press config builds: its own, else that of the config its defaults put ``@_here_``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    if "_target_" in cfg:
        return cfg._target_
    for entry in cfg.get("defaults", []):
        if isinstance(entry, str) and entry.endswith("@_here_"):
            return _press_target(path.parent / f"{entry.removesuffix('@_here_')}.yaml")
    return None


def config_groups_help(config_dir: Path | None = None) -> str:
    """The config groups of ``--help`` (Hydra's ``$APP_CONFIG_GROUPS``, with the presses split), one line a group:
    the presses of this project (a ``_target_`` outside kvpress), kvpress's (the uncompressed config, ``_target_:
    null``, among them), then the tuning and ablation variants (:func:`press_variants`), one line per press they
    vary. A group's ``base/`` configs, which other configs include, are left out.

    Args:
        config_dir: the config directory (default :data:`evaluation.harness.CONFIG_DIR`).
    """
    from evaluation import harness

    config_dir = Path(config_dir or harness.CONFIG_DIR)
    lines = []
    for group in sorted(p.name for p in config_dir.iterdir() if p.is_dir() and p.name != "hydra"):
        names = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        if group != "press":
            lines.append(f"{group}: {', '.join(names)}")
            continue
        variants = press_variants(config_dir)
        users = [n for n in names if n not in variants]
        targets = {n: _press_target(config_dir / group / f"{n}.yaml") for n in users}
        ours = [n for n in users if targets[n] is not None and not targets[n].startswith("kvpress.")]
        lines.append(f"press, this project's: {', '.join(ours)}")
        lines.append(f"press, kvpress's: {', '.join(n for n in users if n not in ours)}")
        lines.append("press, tuning and ablation variants (each runs as any press), by the press each varies:")
        for base in sorted(set(variants.values())):
            lines.append(f"  {base}: {', '.join(n for n in names if variants.get(n) == base)}")
    return "\n".join(lines)


def _register_help_resolver() -> None:
    """``${config_groups:}``, which ``configs/hydra/help/harness.yaml`` reads (:func:`config_groups_help`)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("config_groups", lambda: config_groups_help(), replace=True)


_register_help_resolver()


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line, ``error: <prog>: <message>`` on stderr and exit
    status 1 (:func:`refuse`), and whose unknown options get the closest known ones (``--outt``: did you mean
    ``--out``?), before any other usage error (a missing positional argument). Construct and use it as argparse's."""

    def _named(self, extras: list[str]) -> list[str]:
        """``extras``, each unknown option with its closest known ones."""
        from evaluation.harness import did_you_mean

        options = [s for a in self._actions for s in a.option_strings]
        named = []
        for extra in extras:
            close = did_you_mean(extra.split("=")[0], options) if extra.startswith("-") else []
            named.append(f"{extra} (did you mean {' or '.join(close)}?)" if close else extra)
        return named

    def _unknown_options(self, args: list[str]) -> list[str]:
        """The ``--options`` of ``args`` (before a ``--``) that name no option, not even by a unique prefix."""
        options = [s for a in self._actions for s in a.option_strings]
        unknown = []
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=")[0]
            if not arg.startswith("--") or name in options:
                continue
            if not (self.allow_abbrev and len([o for o in options if o.startswith(name)]) == 1):
                unknown.append(arg)
        return unknown

    def parse_args(self, args=None, namespace=None):
        """argparse's; an argument it does not know is refused, an option with the closest known ones."""
        args = sys.argv[1:] if args is None else list(args)
        unknown = self._unknown_options(args)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(self._named(unknown))}")
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(self._named(extras))}")
        return parsed

    def error(self, message: str):
        """One line and exit status 1, where argparse prints its usage and exits with 2 (``--help`` shows it)."""
        refuse(f"{self.prog}: {message} (--help shows the usage)")
