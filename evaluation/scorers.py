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
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SCORERS", "kvzap_dir", "kvzap_problem", "load_kvzap", "model_key", "train_command"]

#: Where trained scorers live: ``<SCORERS>/<model key>/kvzap_<model_type>/``.
SCORERS = Path(__file__).resolve().parents[1] / "results" / "scorers"


def model_key(model) -> str:
    """The model's name as kvpress names its scorers: the last part of ``model.config.name_or_path``."""
    return str(model.config.name_or_path).rstrip("/").split("/")[-1]


def train_command(model, model_type: str) -> str:
    """The command that makes the scorer ``model_type`` for ``model`` (the MLP's: ``make scorers`` for the embedded
    model, whose linear scorer is committed)."""
    from evaluation.models import EMBEDDED, HUB_IDS

    name = str(model.config.name_or_path)
    key = model_key(model)
    short = next((k for k, hub in HUB_IDS.items() if hub == name), key if key in EMBEDDED else name)
    command = f"python -m evaluation.train_scorers kvzap --model {short}"
    return f"make scorers ({command})" if key in EMBEDDED and model_type == "mlp" else command


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
    """The project's KVzap scorer ``model_type`` for ``model`` (kvpress's ``KVzapModel``, in eval mode).

    Raises:
        FileNotFoundError: :func:`kvzap_problem`'s line, when there is none or it was made for another model.
    """
    from kvpress.presses.kvzap_press import KVzapModel

    problem = kvzap_problem(model, model_type, root)
    if problem:
        raise FileNotFoundError(problem)
    return KVzapModel.from_pretrained(kvzap_dir(model, model_type, root)).eval()
