"""The project's trained scorers: where they live, which model they were made for, and loading them.

kvpress's KVzap press loads ``nvidia/KVzap-<model_type>-<model>`` from the Hugging Face hub when its prefill
starts (``<model>``: the last part of ``model.config.name_or_path``); kvpress publishes none for the embedded
model. :func:`evaluation.registry.attach_kvzap` gives every KVzap press inside any wrapper the project's scorer
from here instead (the harness does it for every run; Python users call it once before ``with press(model)`` or
the pipeline).

The scorers are ``results/scorers/<model>/kvzap_<model_type>/`` (``KVzapModel.save_pretrained``: ``config.json``
and ``model.safetensors``, ``config.json`` also naming the model they were trained for), made by
``python -m evaluation.train_scorers kvzap --model <name>`` (:mod:`evaluation.train_scorers`). A scorer made for
another model (another name, layer count, hidden size or KV-head count) is refused, as is a missing one when the
press needs it: one line naming the model, the file and the command that makes it.

The same holds for the statistics kvpress downloads per model for its Q-Filters press (``nthngdy/<model>_qfilt``)
and its expected-attention press with statistics (``alessiodevoto/exp_att_stats_...``): the project makes them from
the model's own queries (``python -m evaluation.train_scorers qfilter`` and ``... ea_stats``) as
``results/scorers/<model>/qfilters/`` (``QFilters.save_pretrained``, with ``training.json`` naming the model) and
``results/scorers/<model>/ea_stats/`` (``ExpectedAttentionStats.save_pretrained``, whose ``config.json`` names the
model); :func:`qfilter_problem`, :func:`ea_stats_problem` and their loaders refuse a missing or mismatched one in one
line the same way.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = [
    "EA_STATS",
    "QFILTER",
    "SCORERS",
    "ea_stats_problem",
    "kvzap_dir",
    "kvzap_problem",
    "load_ea_stats",
    "load_kvzap",
    "load_qfilter",
    "model_key",
    "qfilter_problem",
    "scorer_dir",
    "train_command",
]

#: Where trained scorers live: ``<SCORERS>/<model key>/kvzap_<model_type>/``.
SCORERS = Path(__file__).resolve().parents[1] / "results" / "scorers"
#: The directories of the query statistics under ``<SCORERS>/<model key>/``.
QFILTER, EA_STATS = "qfilters", "ea_stats"


def model_key(model) -> str:
    """The model's name as kvpress names its scorers: the last part of ``model.config.name_or_path``."""
    return str(model.config.name_or_path).rstrip("/").split("/")[-1]


def train_command(model, model_type: str) -> str:
    """The command that makes the scorer ``model_type`` for ``model`` (the MLP's: ``make scorers`` for the embedded
    model, whose linear scorer is committed)."""
    from evaluation.models import EMBEDDED

    command = f"python -m evaluation.train_scorers kvzap --model {_model_arg(model)}"
    return f"make scorers ({command})" if model_key(model) in EMBEDDED and model_type == "mlp" else command


def _model_arg(model) -> str:
    """The model's name for ``--model`` (``evaluation.models.load_model``): its short name for a hub model or the
    embedded one, else its ``name_or_path``."""
    from evaluation.models import EMBEDDED, HUB_IDS

    full, key = str(model.config.name_or_path), model_key(model)
    return next((k for k, hub in HUB_IDS.items() if hub == full), key if key in EMBEDDED else full)


def kvzap_dir(model, model_type: str, root: Path | None = None) -> Path:
    """``<root>/<model key>/kvzap_<model_type>`` (root: :data:`SCORERS`)."""
    return Path(root or SCORERS) / model_key(model) / f"kvzap_{model_type}"


def _shape(config) -> tuple[int, int, int]:
    text = config.get_text_config()
    return text.num_hidden_layers, text.hidden_size, text.num_key_value_heads


def kvzap_problem(model, model_type: str, root: Path | None = None) -> str | None:
    """Why the project has no usable KVzap scorer ``model_type`` for ``model``, or None.

    Returns:
        One line naming the model, the scorer's file and the command that makes it: the file is missing, or its
        ``config.json`` was trained for another model (name, layers, hidden size, KV heads) or is not a KVzap
        model of this type.
    """
    import json

    where = kvzap_dir(model, model_type, root)
    key, command = model_key(model), train_command(model, model_type)
    weights, config = where / "model.safetensors", where / "config.json"
    if not (weights.is_file() and config.is_file()):
        missing = weights if config.is_file() else config
        return f"the KVzap {model_type} scorer for {key}: {missing} is missing; make it with {command}"
    saved = json.loads(config.read_text())
    layers, hidden, heads = _shape(model.config)
    got = (saved.get("base_model"), saved.get("n_modules"), saved.get("input_dim"), saved.get("output_dim"))
    kind = "linear" if saved.get("hidden_dim") is None else "mlp"
    if got != (key, layers, hidden, heads) or kind != model_type:
        return (
            f"the KVzap {model_type} scorer for {key} ({layers} layers, hidden {hidden}, {heads} KV heads): "
            f"{config} holds a {kind} scorer for {got[0]} ({got[1]} layers, hidden {got[2]}, {got[3]} KV heads); "
            f"make it again with {command}"
        )
    return None


def load_kvzap(model, model_type: str, root: Path | None = None):
    """The project's KVzap scorer ``model_type`` for ``model`` (kvpress's ``KVzapModel``, in eval mode), loaded once per
    file version and process (a sweep's presses share it: kvpress only reads it) and without transformers' weight-
    loading bar.

    Raises:
        FileNotFoundError: :func:`kvzap_problem`'s line, when there is none or it was made for another model.
    """
    problem = kvzap_problem(model, model_type, root)
    if problem:
        raise FileNotFoundError(problem)
    path = kvzap_dir(model, model_type, root)
    return _load_kvzap(str(path), (path / "model.safetensors").stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_kvzap(path: str, version: int):
    from kvpress.presses.kvzap_press import KVzapModel

    from evaluation.models import quiet_weight_loading

    with quiet_weight_loading(), _quiet():
        return KVzapModel.from_pretrained(path).eval()


def _quiet():
    """huggingface_hub's ``from_pretrained`` prints "Loading weights from local directory" on every load: kept off."""
    import contextlib
    import io

    return contextlib.redirect_stdout(io.StringIO())


def scorer_dir(model, name: str, root: Path | None = None) -> Path:
    """``<root>/<model key>/<name>`` (root: :data:`SCORERS`; name: :data:`QFILTER` or :data:`EA_STATS`)."""
    return Path(root or SCORERS) / model_key(model) / name


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _saved(model, name: str, what: str, command: str, root: Path | None, files: tuple[str, ...]):
    """``(config.json of the saved statistics or None, the line naming the first missing file and ``command``)``."""
    import json

    where = scorer_dir(model, name, root)
    missing = next((where / f for f in files if not (where / f).is_file()), None)
    if missing is not None:
        return None, f"the {what} for {model_key(model)}: {missing} is missing; make them with {command}"
    return json.loads((where / "config.json").read_text()), ""


def qfilter_problem(model, root: Path | None = None) -> str | None:
    """Why the project has no usable Q-filters for ``model``, or None.

    Returns:
        One line naming the model, the file and the command that makes them: ``config.json``, ``model.safetensors``
        or ``training.json`` of :func:`scorer_dir` is missing, or they were made for another model (the name in
        ``training.json``, or the layers, KV heads or head dimension in ``config.json``).
    """
    import json

    command = f"python -m evaluation.train_scorers qfilter --model {_model_arg(model)}"
    files = ("config.json", "model.safetensors", "training.json")
    config, line = _saved(model, QFILTER, "Q-filters", command, root, files)
    if config is None:
        return line
    where = scorer_dir(model, QFILTER, root)
    made_for = json.loads((where / "training.json").read_text()).get("base_model")
    text = model.config.get_text_config()
    want = (model_key(model), text.num_hidden_layers, text.num_key_value_heads, _head_dim(text))
    got = (made_for, config.get("num_layers"), config.get("num_kv_heads"), config.get("kv_head_dim"))
    if got == want:
        return None
    return (
        f"the Q-filters for {want[0]} ({want[1]} layers, {want[2]} KV heads of {want[3]}): {where} holds filters "
        f"for {got[0]} ({got[1]} layers, {got[2]} KV heads of {got[3]}); make them again with {command}"
    )


def load_qfilter(model, root: Path | None = None):
    """The project's Q-filters for ``model``: ``(L, G, d)`` float32 (kvpress's ``QFilters.q_filters``).

    Raises:
        FileNotFoundError: :func:`qfilter_problem`'s line.
    """
    from kvpress.presses.qfilter_press import QFilters

    problem = qfilter_problem(model, root)
    if problem:
        raise FileNotFoundError(problem)
    with _quiet():
        return QFilters.from_pretrained(scorer_dir(model, QFILTER, root)).q_filters.data


def ea_stats_problem(model, root: Path | None = None) -> str | None:
    """Why the project has no usable expected-attention query statistics for ``model``, or None.

    Returns:
        One line naming the model, the file and the command that makes them: ``config.json`` or
        ``model.safetensors`` of :func:`scorer_dir` is missing, or its ``config.json`` names another model
        (``model_name``), layer count, query-head count or head dimension.
    """
    command = f"python -m evaluation.train_scorers ea_stats --model {_model_arg(model)}"
    files = ("config.json", "model.safetensors")
    config, line = _saved(model, EA_STATS, "expected-attention statistics", command, root, files)
    if config is None:
        return line
    text = model.config.get_text_config()
    want = (model_key(model), text.num_hidden_layers, text.num_attention_heads, _head_dim(text))
    got = (config.get("model_name"), config.get("num_layers"), config.get("num_heads"), config.get("head_dim"))
    if got == want:
        return None
    return (
        f"the expected-attention statistics for {want[0]} ({want[1]} layers, {want[2]} heads of {want[3]}): "
        f"{scorer_dir(model, EA_STATS, root)} holds statistics for {got[0]} ({got[1]} layers, {got[2]} heads of "
        f"{got[3]}); make them again with {command}"
    )


def load_ea_stats(model, root: Path | None = None):
    """The project's expected-attention statistics for ``model`` (kvpress's ``ExpectedAttentionStats``: query mean
    ``(L, H, d)`` and covariance ``(L, H, d, d)`` before RoPE).

    Raises:
        FileNotFoundError: :func:`ea_stats_problem`'s line.
    """
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats

    problem = ea_stats_problem(model, root)
    if problem:
        raise FileNotFoundError(problem)
    with _quiet():
        return ExpectedAttentionStats.from_pretrained(scorer_dir(model, EA_STATS, root))


@functools.lru_cache(maxsize=32)
def _file_sha256(path: str, version: int) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(directory: Path) -> str:
    """The SHA-256 of a scorer's ``model.safetensors`` in ``directory`` (once per file version and process): what a
    run's rows record of the scorer it ran with (:func:`evaluation.registry.scorer_files`)."""
    path = Path(directory) / "model.safetensors"
    return _file_sha256(str(path), path.stat().st_mtime_ns)
