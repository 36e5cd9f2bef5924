"""KVzap's surrogates trained by the project (evaluation/train_scorers/) and attached to kvpress's KVzapPress
(evaluation/scorers.py): the ridge from moments is scikit-learn's, the command is deterministic, its scorers load
with kvpress's ``KVzapModel.from_pretrained`` and run offline through the harness and any wrapper, and a missing or
mismatched scorer is refused in one line. Tiny random Llama and a few tiny documents (mechanics only)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from conftest import make_tiny_llama
from kvpress import AdaKVPress, ComposedPress, DMSPress, KVzapPress, SnapKVPress
from kvpress.presses.kvzap_press import KVzapModel
from sklearn.linear_model import Ridge
from test_harness import composed
from transformers import DynamicCache

from evaluation import guards, harness, registry, scorers
from evaluation import run as entry
from evaluation.train_scorers import cli, corpus, ridge
from evaluation.train_scorers.corpus import Document
from evaluation.train_scorers.mlp import MLPSettings, train
from evaluation.train_scorers.moments import Moments

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the cache keeps keys and values of every token so attention reads them again when decoding".split()


def _tiny(checkpoint: Path, layers: int = 2, hidden: int = 64):
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=layers, hidden=hidden, attn_implementation="sdpa")
    tok = char_tokenizer()
    tok.save_pretrained(checkpoint)
    model.config.name_or_path = str(checkpoint)  # KVzip reloads the tokenizer from here
    return model, tok


def _docs(n: int, seed: int) -> list[Document]:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, 60)) for _ in range(n)]
    return [Document(f"tiny-{seed}-{i}", "tiny", f"f{i}.py", t, len(t)) for i, t in enumerate(texts)]


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """The tiny model as every loader returns it, five training and two held-out tiny documents, the scorers under
    ``tmp_path / "scorers"``."""
    model, tok = _tiny(tmp_path / "checkpoint")
    monkeypatch.setattr("evaluation.models.load_model", lambda *a, **k: (model, tok))
    monkeypatch.setattr(harness, "get_model", lambda *a, **k: (model, tok))
    monkeypatch.setattr(corpus, "split", lambda seed: (_docs(5, seed), _docs(2, seed + 100)))
    monkeypatch.setattr(scorers, "SCORERS", tmp_path / "scorers")
    return model, tok


def _train(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    argv = ["kvzap", "--model", "tiny", "--train-tokens", "700", "--growth", "300", "--mlp-hidden", "8", "4"]
    argv += ["--mlp-at", "300", "--mlp-epochs", "2", "--work-root", str(out / "work"), "--out", str(out), *extra]
    assert cli.main(argv) == 0
    return out / "checkpoint"


def test_the_defaults_are_the_committed_command():
    """``make scorers`` (the command with its defaults) rebuilds the committed scorers with the committed fit report's
    rows: the commands recorded in the committed READMEs and fit table parse to the defaults (--workers aside, which
    does not change the result)."""
    import re
    import shlex

    from evaluation.train_scorers import kvzap

    parser, root = cli.parser(), Path(__file__).parents[1] / "results" / "scorers" / "smollm2-135m"
    texts = [(root / "kvzap_linear" / "README.md").read_text(), (root / "kvzap_fit.md").read_text()]
    commands = {re.search(r"python -m evaluation.train_scorers (kvzap[^`]*)`", t).group(1) for t in texts}
    assert len(commands) == 1
    committed, default = parser.parse_args(shlex.split(commands.pop())), parser.parse_args(["kvzap"])
    assert kvzap.schedule(committed) == kvzap.schedule(default) and all(kvzap.schedule(default))  # the growth rows
    skip = {"workers", "growth", "mlp_at"}
    rest = [{k: v for k, v in vars(a).items() if k not in skip} for a in (committed, default)]
    assert rest[0] == rest[1]
    assert kvzap.schedule(parser.parse_args(["kvzap", "--train-tokens", "20000"])) == ([10_000], [])


def test_ridge_from_moments_is_sklearns_ridge():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 12)) * rng.uniform(0.1, 3, 12) + rng.normal(0, 50, 12)  # large means: outlier channels
    y = x @ rng.normal(size=(12, 3)) + rng.normal(size=(600, 3))
    a, b = Moments.zeros(1, 12, 3), Moments.zeros(1, 12, 3)
    for part in np.array_split(np.arange(400), 3):
        a.add(0, torch.from_numpy(x[part]), torch.from_numpy(y[part]))
    b.add(0, torch.from_numpy(x[400:]), torch.from_numpy(y[400:]))
    weights, intercepts = ridge.fit(a.merge(b))
    reference = Ridge(alpha=1.0).fit(x, y)
    assert a.count[0] == 600
    np.testing.assert_allclose(weights[0], reference.coef_, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(intercepts[0], reference.intercept_, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="layers \\[0\\] have no rows"):
        ridge.fit(Moments.zeros(1, 12, 3))


def test_mlp_is_seeded_and_reads_raw_features():
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(400, 2, 6)) * 5 + 20).astype(np.float16)
    y = np.tanh(x.astype(np.float32) @ rng.normal(size=(6, 2)).astype(np.float32) / 20)[..., :2] * 3 - 5
    settings = MLPSettings(hidden=16, epochs=30, lr=1e-2, batch_size=64)
    first, again = train(x, y, settings, seed=3), train(x, y, settings, seed=3)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(first, again) for k in a)
    assert any(not np.array_equal(a["w1"], b["w1"]) for a, b in zip(first, train(x, y, settings, seed=4)))
    for layer, p in enumerate(first):  # the folded standardisation: raw features in, raw log-scores out
        h = torch.nn.functional.gelu(torch.from_numpy(x[:, layer].astype(np.float32) @ p["w1"].T + p["b1"]))
        pred = h.numpy() @ p["w2"].T + p["b2"]
        assert np.mean((pred - y[:, layer]) ** 2) < 0.5 * np.var(y[:, layer])


class _InProcess:
    """multiprocessing's spawn context with processes that run their target at ``start`` in this process (where the
    tests' tiny model and documents are)."""

    def Process(self, target, args):
        class Process:
            exitcode = None

            def start(self):
                target(*args)
                self.exitcode = 0

            def join(self):
                pass

        return Process()


def test_the_command_is_deterministic_and_its_scorers_load(tiny, tmp_path, monkeypatch):
    import multiprocessing

    first = _train(tmp_path, "a")
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: _InProcess())
    second = _train(tmp_path, "b", "--workers", "2")  # each worker its shard: the same moments, merged in order
    for kind in ("kvzap_linear", "kvzap_mlp"):
        assert (first / kind / "model.safetensors").read_bytes() == (second / kind / "model.safetensors").read_bytes()
        loaded = KVzapModel.from_pretrained(first / kind)
        assert loaded.config.base_model == "checkpoint" and loaded.config.n_modules == 2
        assert (loaded.config.hidden_dim is None) == (kind == "kvzap_linear")
        assert "--train-tokens 700" in (first / kind / "README.md").read_text()
    assert loaded.config.hidden_dim == 8  # the first width is saved
    rows = (first.parent / "checkpoint" / "kvzap_fit.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3 * 2  # (linear, mlp, mlp4) x (300, 700 tokens) x 2 layers
    assert {json.loads((first / k / "config.json").read_text())["training"]["train_docs"] for k in ("kvzap_linear",)}
    from filelock import FileLock

    work = next((tmp_path / "a" / "work" / "tiny").iterdir())
    with FileLock(work / "shard0.lock"), FileLock(work / "shard1.lock"):  # as while another run computes further
        again = _train(tmp_path, "a", "--surrogates", "linear", "--no-report")  # computed: fits without a worker
    assert (again / "kvzap_linear" / "model.safetensors").read_bytes() == (
        second / "kvzap_linear" / "model.safetensors"
    ).read_bytes()
    other = _train(tmp_path, "c", "--seed", "1", "--surrogates", "linear", "--no-report")
    assert (other / "kvzap_linear" / "model.safetensors").read_bytes() != (
        first / "kvzap_linear" / "model.safetensors"
    ).read_bytes()


def test_scorers_run_offline_through_the_harness_and_any_wrapper(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    _train(tmp_path, "scorers", "--surrogates", "linear", "--no-report")
    loads = []
    real = KVzapModel.from_pretrained.__func__
    monkeypatch.setattr(KVzapModel, "from_pretrained", classmethod(lambda cls, p, **k: loads.append(p) or real(cls, p)))
    cfg = composed("press=kvzap_linear", "compression_ratio=0.5", f"output_dir={tmp_path / 'runs'}", "n_samples=2")
    cfg.dataset.context_length, cfg.dataset.max_new_tokens = 256, 4
    metrics = entry.run(cfg, {"press": "kvzap_linear", "dataset": "needle", "model": "smollm2-135m"})
    assert metrics["n"] == 2 and loads and all(Path(p).parent.parent == tmp_path / "scorers" for p in loads)
    # the rows say which scorer file they ran with (a file is not a setting: a retrained one would join silently)
    weights = tmp_path / "scorers" / "checkpoint" / "kvzap_linear" / "model.safetensors"
    run_dir = tmp_path / "runs" / "needle" / "smollm2-135m" / "kvzap_linear" / "cr0.5"
    rows = harness.read_predictions(harness.rows_file(run_dir))
    assert [r["scorer_files"] for r in rows] == [{"kvzap_linear": hashlib.sha256(weights.read_bytes()).hexdigest()}] * 2
    # a scorer retrained under a run stopped halfway (its second row lost) is refused when the run resumes
    _train(tmp_path, "scorers", "--seed", "1", "--surrogates", "linear", "--no-report")
    (run_dir / "metrics.json").unlink()
    harness.rows_file(run_dir).write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"holds rows made with kvzap_linear [0-9a-f]{12}, but the scorer file now"):
        entry.run(cfg, {"press": "kvzap_linear", "dataset": "needle", "model": "smollm2-135m"})
    assert len(harness.read_predictions(harness.rows_file(run_dir))) == 1
    saved = KVzapModel.from_pretrained(tmp_path / "scorers" / "checkpoint" / "kvzap_linear")
    ids = torch.tensor([[ord(c) for c in "keys and values of every token " * 6]])
    for press in (
        DMSPress(KVzapPress(model_type="linear"), threshold=-4.0, sliding_window_size=8),
        AdaKVPress(KVzapPress(model_type="linear", compression_ratio=0.5)),
        ComposedPress([KVzapPress(model_type="linear", compression_ratio=0.3), SnapKVPress(0.2)]),
    ):
        (kvzap,) = registry.attach_kvzap(press, model)
        assert kvzap.kvzap_model_name == "nvidia/KVzap-linear-checkpoint"  # kvpress then loads nothing
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        assert all(
            torch.equal(a, b) for a, b in zip(kvzap.kvzap_model.state_dict().values(), saved.state_dict().values())
        )


def test_missing_or_mismatched_scorers_are_refused_in_one_line(tiny, tmp_path):
    model, _ = tiny
    mlp = KVzapPress(model_type="mlp")
    with pytest.raises(OSError) as err:
        guards.check_press_downloads(DMSPress(mlp, threshold=-4.0), model)  # offline (the tests' hub)
    line = str(err.value)
    assert "\n" not in line and "kvzap_mlp/config.json is missing" in line and "checkpoint" in line
    assert f"python -m evaluation.train_scorers kvzap --model {tmp_path / 'checkpoint'}" in line
    _train(tmp_path, "scorers", "--surrogates", "linear", "--no-report")
    bigger, _ = _tiny(tmp_path / "other" / "checkpoint", layers=3, hidden=32)  # same name, another shape
    problem = scorers.kvzap_problem(bigger, "linear")
    assert "3 layers, hidden 32" in problem and "2 layers, hidden 64" in problem and "\n" not in problem
    with pytest.raises(OSError, match="make it again with python -m evaluation.train_scorers kvzap"):
        guards.check_press_downloads(KVzapPress(model_type="linear", compression_ratio=0.5), bigger)
    guards.check_press_downloads(KVzapPress(model_type="linear", compression_ratio=0.5), model)  # the right one
    embedded, _ = _tiny(tmp_path / "smollm2-135m")
    assert "make scorers (python -m evaluation.train_scorers kvzap --model smollm2-135m)" in scorers.kvzap_problem(
        embedded, "mlp"
    )
