"""Is the scorer corpus disjoint from the evaluation sets? No window of :data:`WINDOW` consecutive model tokens may
occur in both.

The evaluation side is every offline dataset config of ``configs/dataset/`` (LongBench's and RULER's ``qa_1`` and
``qa_2`` need the hub and are left out; their text is not in any installed package either) built as a run builds
it, at 2k tokens, for the harness's default seed (``configs/config.yaml``, 42, the seed of every committed run) and
the config's default sample count, question after compression: each example's context, question, answer prefix and
continuation, tokenised apart with the model's tokenizer. The corpus side is every committed document
(:mod:`evaluation.train_scorers.corpus`). Windows are compared by a 64-bit polynomial hash of their token ids (a
collision would only report a false overlap).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from evaluation.train_scorers import corpus

__all__ = ["WINDOW", "CONTEXT_LENGTH", "evaluation_texts", "overlaps", "window_hashes"]

#: Window length in tokens, and the evaluation sets' context length.
WINDOW = 64
CONTEXT_LENGTH = 2048
_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_ONLINE = ("longbench",)  # dataset configs whose data comes from the hub


def window_hashes(ids: list[int] | np.ndarray, window: int = WINDOW) -> np.ndarray:
    """``(max(0, n - window + 1),)`` uint64 hashes of every ``window``-token window of ``ids``."""
    ids = np.asarray(ids, dtype=np.uint64)
    if len(ids) < window:
        return np.zeros(0, np.uint64)
    powers = np.ones(window, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(window - 2, -1, -1):
            powers[i] = powers[i + 1] * np.uint64(1_000_003)  # wraps modulo 2**64, as intended
        views = np.lib.stride_tricks.sliding_window_view(ids, window)
        return (views * powers).sum(axis=1, dtype=np.uint64)


def _dataset_configs() -> list[Path]:
    return sorted(p for p in (_CONFIGS / "dataset").glob("*.yaml") if not p.stem.startswith(_ONLINE))


def evaluation_texts(tokenizer) -> Iterator[tuple[str, str]]:
    """``(dataset config name, text)`` of every part of every example of the offline evaluation sets at 2k tokens
    (the module docstring)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    seed = int(OmegaConf.load(_CONFIGS / "config.yaml").seed)
    with initialize_config_dir(config_dir=str(_CONFIGS), version_base=None):
        for path in _dataset_configs():
            cfg = compose("config", overrides=[f"dataset={path.stem}"]).dataset
            if "context_lengths" in cfg:
                cfg.context_lengths = [CONTEXT_LENGTH]
            if "context_length" in cfg:
                cfg.context_length = CONTEXT_LENGTH
            if "tasks" in cfg and str(cfg._target_).endswith("RulerDataset"):
                from evaluation.datasets.ruler import SYNTHETIC_TASKS

                cfg.tasks = [t for t in cfg.tasks if t in SYNTHETIC_TASKS]  # qa_1, qa_2: SQuAD, HotpotQA (hub)
            dataset = instantiate(cfg)
            for ex in dataset.examples(tokenizer, None, seed, False):
                for text in (ex.context, ex.question, ex.answer_prefix, ex.continuation):
                    if text:
                        yield path.stem, text


def overlaps(tokenizer, texts=None, seed: int = 0) -> list[tuple[str, str]]:
    """``(corpus document id, dataset config name)`` of every pair sharing a :data:`WINDOW`-token window; empty
    when the corpus is disjoint from the evaluation sets.

    Args:
        tokenizer: the model's tokenizer.
        texts: ``(name, text)`` pairs of the evaluation side (default: :func:`evaluation_texts`).
        seed: only orders the corpus documents (the check covers both splits).
    """
    where: dict[int, str] = {}
    for name, text in evaluation_texts(tokenizer) if texts is None else texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        for h in window_hashes(ids).tolist():
            where.setdefault(h, name)
    found = []
    for split in ("train", "heldout"):
        for doc, ids in corpus.documents(tokenizer, split, seed):
            shared = {where[h] for h in window_hashes(ids).tolist() if h in where}
            found += [(doc.id, name) for name in sorted(shared)]
    return found
