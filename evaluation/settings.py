"""What identifies a run: its settings, with the press given by what was built, not by the yaml that built it.

A run directory's ``config.yaml`` holds the run's resolved config with its ``press`` section replaced by
:func:`press_settings` of the instantiated press: the press's class (its public path: the package that exports
it and its name, ``kvpress.<Name>`` or ``presses.<Name>``) and every dataclass field it was built with, defaults
included, nested presses alike. Two configs are the same run when these settings agree (:func:`run_settings`), so
a yaml that moves, renames or stops restating a default changes nothing, while a changed class default or field
value is a changed setting.
Building the press imports kvpress and torch, which happens only when a run directory already holds settings.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import math

from omegaconf import DictConfig, OmegaConf

__all__ = ["press_settings", "public_path", "run_settings", "saved_run_settings"]


def public_path(cls: type) -> str:
    """``package.Name`` when the top-level package exports the class, else ``module.Name``."""
    top = cls.__module__.split(".")[0]
    try:
        if getattr(importlib.import_module(top), cls.__qualname__, None) is cls:
            return f"{top}.{cls.__qualname__}"
    except ImportError:
        pass
    return f"{cls.__module__}.{cls.__qualname__}"


def press_settings(value):
    """The settings of a press (or of any value of one of its fields), as plain data.

    A dataclass becomes ``{"_target_": public_path, field: settings, ...}`` over its ``init`` fields (what the
    constructor takes, so the result builds the same press again with Hydra's ``instantiate``); lists, tuples and
    dicts are mapped element by element; numbers, strings, booleans and None are themselves; anything else (an
    object passed in Python, e.g. a tokenizer) is named by its type, ``"<PreTrainedTokenizerFast>"``.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: press_settings(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"_target_": public_path(type(value)), **fields}
    if isinstance(value, (list, tuple)):
        return [press_settings(v) for v in value]
    if isinstance(value, dict):
        return {str(k): press_settings(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # inf and nan compare equal as strings
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=512)
def _built_settings(press_json: str) -> str:
    from hydra.utils import instantiate

    # The press is built only to read its fields: kvpress's construction warnings (KVzip's "multiple forward
    # passes", ...) concern running it, so they are held back here.
    kvpress_log = logging.getLogger("kvpress")
    level = kvpress_log.level
    kvpress_log.setLevel(logging.ERROR)
    try:
        return json.dumps(press_settings(instantiate(json.loads(press_json))))  # the fields in their class order
    finally:
        kvpress_log.setLevel(level)


def run_settings(cfg) -> dict:
    """The settings of a run config (a ``DictConfig`` or a plain dict, e.g. a saved ``config.yaml``): the resolved
    config, its ``press`` section replaced by :func:`press_settings` of the press it builds.

    Raises:
        ValueError: if the press section cannot be built (naming its ``_target_`` and why).
    """
    node = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    press = node.get("press")
    if isinstance(press, DictConfig):
        press = OmegaConf.to_container(press, resolve=True)
    if isinstance(press, dict) and press.get("_target_"):
        try:
            node["press"] = json.loads(_built_settings(json.dumps(press, sort_keys=True)))
        except Exception as err:  # any failure to build becomes one message naming the target
            raise ValueError(
                f"cannot build the press {press['_target_']} of these settings ({err}); a run directory written by "
                "an earlier version is brought up to date by python -m evaluation.migrate <directory>"
            ) from err
    return node


def _fill_saved_before(node):
    """``node`` with every press section (a dict with ``_target_``, nested ones too) completed by the
    :data:`presses.base.SAVED_BEFORE` values of the fields its class has and it lacks."""
    if isinstance(node, list):
        return [_fill_saved_before(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _fill_saved_before(v) for k, v in node.items()}
    target = node.get("_target_")
    if isinstance(target, str):
        try:
            from hydra.utils import get_class

            from presses.base import SAVED_BEFORE

            cls = get_class(target)
        except Exception:  # an unknown class: run_settings names it with its own error
            return node
        if dataclasses.is_dataclass(cls):
            for f in dataclasses.fields(cls):
                if f.init and SAVED_BEFORE in f.metadata and f.name not in node:
                    node[f.name] = f.metadata[SAVED_BEFORE]
    return node


def saved_run_settings(saved) -> dict:
    """:func:`run_settings` of a config saved in a run directory: a press field the saved section lacks takes the
    value it had before it existed (its :data:`presses.base.SAVED_BEFORE` metadata) where it has one, else today's
    default.

    Raises:
        ValueError: as :func:`run_settings`.
    """
    node = OmegaConf.to_container(saved, resolve=True) if isinstance(saved, DictConfig) else dict(saved)
    if isinstance(node.get("press"), dict):
        node["press"] = _fill_saved_before(node["press"])
    return run_settings(node)
