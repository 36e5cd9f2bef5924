"""What identifies a run: its settings, with the press given by what was built, not by the yaml that built it.

A run directory's ``config.yaml`` holds the run's resolved config with its ``press`` section replaced by
:func:`press_settings` of the instantiated press: the press's class (its public path: the package that exports
it and its name, ``kvpress.<Name>`` or ``presses.<Name>``) and every dataclass field it was built with, defaults
included, nested presses alike. Two configs are the same run when these settings agree (:func:`run_settings`), so
a yaml that moves, renames or stops restating a default changes nothing, while a changed class default or field
value is a changed setting.
Building the press imports kvpress and torch, which happens only when a run directory already holds settings.

Every run setting is written one way (:func:`normalise`, issue 63 item 3) before it names a directory, is saved or
is compared: a value can reach the harness in several spellings (``compression_ratio=0.50``, ``5e-1``, ``'0.5'``,
a float of a Hydra ``range(...)`` sweep such as ``0.30000000000000004``, ``seed=42.0``, ``shard=00/4``,
``query_aware='true'``), and each spelling of one value is one run: one directory, one ``config.yaml``, and a
finished run is found whichever spelling the next command uses. A run setting added after runs were saved
(:data:`SETTINGS_SAVED_BEFORE`) is read, where a config lacks it, as the value every earlier run ran with; a press
field added or removed since, as its class declares (:func:`saved_press`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import logging
import math

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = [
    "RATIO_DIGITS",
    "SETTING_KINDS",
    "SETTINGS_SAVED_BEFORE",
    "PROTOCOLS",
    "SHARED_DEFAULTS",
    "SHARED_MODES",
    "normal_value",
    "normalise",
    "press_settings",
    "public_path",
    "run_settings",
    "saved_press",
    "saved_run_settings",
]

#: Significant digits a compression ratio keeps (:func:`normal_value`): enough for any ratio typed by hand, few
#: enough to drop the float error of a Hydra ``range(0.1, 0.5, 0.1)`` sweep (``0.30000000000000004`` is ``0.3``).
RATIO_DIGITS = 12

#: The run settings a config may spell in several ways, by dotted key, and the kind of value each one is
#: (:func:`normal_value` says what each kind accepts and gives).
SETTING_KINDS = {
    "compression_ratio": "ratio",
    "seed": "integer",
    "n_samples": "integer",
    "max_new_tokens": "integer",
    "shard": "shard",
    "query_aware": "switch",
    "overwrite": "switch",
    "grow": "switch",
    "model.enable_thinking": "switch",
    "protocol": "word",
    "questions": "integer",
    "shared_mode": "word",
}

#: The protocols (``protocol``): ``single``, one question per compressed context (kvpress's; the question after
#: compression, or inside it with ``query_aware``); ``shared``, one compressed context asked ``questions`` questions
#: in turn (:mod:`evaluation.shared`), each on a copy of the compressed cache (``shared_mode=request``) or each with its
#: answer left in the cache for the next (``shared_mode=turn``).
PROTOCOLS = ("single", "shared")
SHARED_MODES = ("request", "turn")
#: What ``protocol=shared`` reads where ``questions`` or ``shared_mode`` is null (the one source of both defaults);
#: ``protocol=single`` reads neither, and they stay null.
SHARED_DEFAULTS = {"questions": 4, "shared_mode": "request"}

#: Run settings added to the configs after runs were saved without them, by dotted key, with the value those runs
#: ran with: a config that lacks one (a ``config.yaml`` saved before it existed) is read with this value.
#: ``model.enable_thinking``: before the harness stated it, kvpress's pipeline passed ``enable_thinking=False`` to
#: every chat template. ``protocol``, ``questions``, ``shared_mode``: every run before the shared-context protocol
#: asked one question per context.
SETTINGS_SAVED_BEFORE = {"model.enable_thinking": False, "protocol": "single", "questions": None, "shared_mode": None}

_SWITCH_WORDS = {"true": True, "false": False}


def normal_value(key: str, value):
    """The one spelling of the run setting ``key`` (a key of :data:`SETTING_KINDS`) with value ``value``.

    - ``ratio``: a number (an int, a float, a string holding one) becomes a float rounded to
      :data:`RATIO_DIGITS` significant digits (``0.50``, ``5e-1``, ``'0.5'`` and ``0.5000000000000001`` are 0.5;
      ``0`` is 0.0);
    - ``integer``: an integral float or a string holding an integer becomes an int (``seed=42.0`` is 42); None
      stays None;
    - ``shard``: ``"i/n"`` with integers becomes ``f"{i}/{n}"`` (``00/4`` and ``' 0 / 4'`` are ``0/4``); ``""`` and
      ``"null"`` are None;
    - ``switch``: a bool, ``"true"`` / ``"false"`` in any case, or the ints 0 and 1 becomes a bool;
    - ``word``: a string becomes its stripped lower-case form (``Shared`` is ``shared``).

    Anything else (``compression_ratio='abc'``, ``seed=42.5``, ``shard=x/2``) is returned unchanged, for the check
    of that setting to refuse with its own message (:func:`evaluation.harness.check_ratio`,
    :func:`evaluation.harness.parse_shard`, :func:`evaluation.guards.check_setting_values`).

    Raises:
        KeyError: for a key that :data:`SETTING_KINDS` does not list.
    """
    kind = SETTING_KINDS[key]
    if kind == "word":
        return value.strip().lower() if isinstance(value, str) else value
    if kind == "switch":
        if isinstance(value, str) and value.strip().lower() in _SWITCH_WORDS:
            return _SWITCH_WORDS[value.strip().lower()]
        if isinstance(value, int) and value in (0, 1):  # bools are ints too
            return bool(value)
        return value
    if value is None or isinstance(value, bool):
        return value
    if kind == "shard":
        text = str(value).strip()
        if text in ("", "null"):
            return None
        parts = text.split("/")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return f"{int(parts[0])}/{int(parts[1])}"
        return value
    try:
        number = float(value) if isinstance(value, (int, float, str)) else None
    except ValueError:
        return value
    if number is None or not math.isfinite(number):
        return value
    if kind == "ratio":
        return float(f"{number:.{RATIO_DIGITS}g}")
    if number.is_integer() and abs(number) < 2**53:  # beyond 2**53 a float no longer holds every integer
        return int(number)
    return value


def _runs_uncompressed(node) -> bool:
    """Whether a run config's press section builds no press (the uncompressed baseline: ``_target_: null``)."""
    press = node.get("press") if hasattr(node, "get") else None
    return hasattr(press, "get") and press.get("_target_", "missing") is None


def normalise(cfg):
    """Every run setting of ``cfg`` in its one spelling (:func:`normal_value`); a config that builds no press (the
    uncompressed baseline) has ``compression_ratio`` 0.0, the ratio its directory is named by, whatever was typed;
    a setting of :data:`SETTINGS_SAVED_BEFORE` that ``cfg`` lacks (where its parent section exists) is added with
    the value runs had before it existed; ``protocol=shared`` gets :data:`SHARED_DEFAULTS` where its ``questions`` or
    ``shared_mode`` is null. Idempotent.

    Args:
        cfg: a run config, a ``DictConfig`` (changed in place, so that an interpolation that reads a setting, e.g.
            ``press.compression_ratio: ${compression_ratio}``, reads its one spelling) or a plain dict (a saved
            ``config.yaml``; a normalised copy is returned, the dict itself is left as it is).

    Returns:
        ``cfg`` itself (a ``DictConfig``) or the normalised copy (a dict).
    """
    if not isinstance(cfg, DictConfig):
        return _normalise_dict(cfg)
    with open_dict(cfg):
        for key, value in SETTINGS_SAVED_BEFORE.items():
            parent, _, leaf = key.rpartition(".")
            section = OmegaConf.select(cfg, parent) if parent else cfg
            if isinstance(section, DictConfig) and leaf not in section.keys():
                section[leaf] = value
        for key in SETTING_KINDS:
            parent, _, leaf = key.rpartition(".")
            section = OmegaConf.select(cfg, parent) if parent else cfg
            if isinstance(section, DictConfig) and leaf in section and not OmegaConf.is_missing(section, leaf):
                value = section[leaf]
                new = normal_value(key, value)
                if type(new) is not type(value) or new != value:
                    section[leaf] = new
        if "compression_ratio" in cfg and _runs_uncompressed(cfg):
            cfg.compression_ratio = 0.0
        if cfg.get("protocol") == "shared":
            for key, value in SHARED_DEFAULTS.items():
                if cfg.get(key) is None:
                    cfg[key] = value
    return cfg


def _normalise_dict(node: dict) -> dict:
    """:func:`normalise` of a plain dict, on a copy (the sections it changes are copied, the others shared).
    The settings are top-level keys (``protocol``) or keys of a top-level section (``model.enable_thinking``)."""
    node = dict(node)
    for key, value in SETTINGS_SAVED_BEFORE.items():
        parent, _, leaf = key.rpartition(".")
        if not parent:
            node.setdefault(leaf, value)
        elif isinstance(node.get(parent), dict) and leaf not in node[parent]:
            node[parent] = {**node[parent], leaf: value}
    for key in SETTING_KINDS:
        parent, _, leaf = key.rpartition(".")
        section = node.get(parent) if parent else node
        if isinstance(section, dict) and leaf in section:
            if parent:
                node[parent] = section = dict(section)
            section[leaf] = normal_value(key, section[leaf])
    if "compression_ratio" in node and _runs_uncompressed(node):
        node["compression_ratio"] = 0.0
    if node.get("protocol") == "shared":
        node.update({k: v for k, v in SHARED_DEFAULTS.items() if node.get(k) is None})
    return node


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
    config with every run setting in its one spelling (:func:`normalise`; ``cfg`` itself is left as it is), its
    ``press`` section replaced by :func:`press_settings` of the press it builds.

    Raises:
        ValueError: if the press section cannot be built (naming its ``_target_`` and why).
    """
    if isinstance(cfg, DictConfig):  # normalised before it is resolved: the press reads the one spelling too
        node = OmegaConf.to_container(normalise(copy.deepcopy(cfg)), resolve=True)
    else:
        node = normalise(dict(cfg))
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


def saved_press(node):
    """A press section saved in a run directory as today's classes read it: every press section (a dict with
    ``_target_``, nested ones too) completed by the :data:`presses.base.SAVED_BEFORE` values of the fields its class
    has and it lacks, and without the fields its class no longer has (the class's ``removed_fields``,
    :class:`presses.base.RemovedField`) where it holds the value each had in effect. ``node`` is left as it is.

    Raises:
        ValueError: for a removed field saved at another value (the run used a press the class no longer builds),
            naming the class, the field, its value and where such values live now.
    """
    if isinstance(node, list):
        return [saved_press(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: saved_press(v) for k, v in node.items()}
    target = node.get("_target_")
    if isinstance(target, str):
        try:
            from hydra.utils import get_class

            from presses.base import SAVED_BEFORE

            cls = get_class(target)
        except Exception:  # an unknown class: run_settings names it with its own error
            return node
        if dataclasses.is_dataclass(cls):
            fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
            for f in fields.values():
                if SAVED_BEFORE in f.metadata and f.name not in node:
                    node[f.name] = f.metadata[SAVED_BEFORE]
            for name, removed in getattr(cls, "removed_fields", {}).items():
                if name in fields or name not in node:
                    continue
                if node[name] != press_settings(removed.value):
                    raise ValueError(
                        f"{target}: this run was saved with {name}={node[name]!r}, a field the class no longer has "
                        f"(only {name}={removed.value!r}, which every press it builds ran with, reads as today's "
                        f"press); its other values are {removed.moved_to}'s"
                    )
                del node[name]
    return node


def saved_run_settings(saved) -> dict:
    """:func:`run_settings` of a config saved in a run directory: a press field the saved section lacks takes the
    value it had before it existed (its :data:`presses.base.SAVED_BEFORE` metadata) where it has one, else today's
    default; a field its class no longer has is read as absent at the value it had in effect (:func:`saved_press`);
    a run setting it lacks, the value of :data:`SETTINGS_SAVED_BEFORE` (as for any config, :func:`normalise`).

    Raises:
        ValueError: as :func:`run_settings` and :func:`saved_press`.
    """
    node = OmegaConf.to_container(saved, resolve=True) if isinstance(saved, DictConfig) else dict(saved)
    if isinstance(node.get("press"), dict):
        node["press"] = saved_press(node["press"])
    return run_settings(node)
