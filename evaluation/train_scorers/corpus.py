"""The scorer training corpus, as committed: documents of third-party package docstrings
(:mod:`evaluation.train_scorers.corpus_extract`), split into train and held-out documents by a seed.

Every trained scorer of this project (KVzap's surrogates here; Q-Filters, expected-attention statistics and Fast
KVzip gates can reuse it) reads its documents through :func:`documents`, so they all train on one fixed text that
shares nothing with the evaluation sets (``tests/test_scorer_corpus.py``).

The split is by source file, so two documents cut from one file never straddle it: a file is held out when the
SHA-256 of ``"<seed>:<file>"`` falls in the lowest :data:`HELDOUT_PERCENT` percent. Held-out documents come in the
order of their ids; training documents in a seeded random order (``numpy.random.default_rng(seed)``), so the first
``k`` training documents of a seed are the same whatever else is asked.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CORPUS", "DATA_DIR", "HELDOUT_PERCENT", "MANIFEST", "Document", "corpus_sha256", "documents", "split"]

#: Where the committed corpus lives, and its two files.
DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS = DATA_DIR / "scorer_corpus.jsonl.xz"
MANIFEST = DATA_DIR / "scorer_corpus_manifest.csv"
#: Percent of source files (by hash) whose documents are held out.
HELDOUT_PERCENT = 5


@dataclass(frozen=True)
class Document:
    """One corpus document.

    Attributes:
        id: ``<package>-<k>``, stable (the manifest's).
        package: the distribution it was extracted from.
        file: its source file, relative to the package's parent directory.
        text: the document (docstrings, see :mod:`evaluation.train_scorers.corpus_extract`).
        tokens: its length in the embedded model's tokens (the manifest's count).
    """

    id: str
    package: str
    file: str
    text: str
    tokens: int


@functools.lru_cache(maxsize=1)
def _all() -> tuple[Document, ...]:
    manifest = {row["id"]: row for row in csv.DictReader(MANIFEST.open())}
    docs = []
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            row = manifest[item["id"]]
            docs.append(Document(item["id"], item["package"], row["file"], item["text"], int(row["tokens"])))
    return tuple(docs)


def corpus_sha256() -> str:
    """SHA-256 of the committed corpus file (what a training run records and keys its work on)."""
    return hashlib.sha256(CORPUS.read_bytes()).hexdigest()


def _heldout_file(file: str, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{file}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def split(seed: int) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)``: the training documents in their seeded order and the held-out ones by id.

    Raises:
        ValueError: ``seed`` is negative (numpy's generator takes none).
    """
    if seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    docs = _all()
    heldout = sorted((d for d in docs if _heldout_file(f"{d.package}/{d.file}", seed)), key=lambda d: d.id)
    train = [d for d in docs if not _heldout_file(f"{d.package}/{d.file}", seed)]
    order = np.random.default_rng(seed).permutation(len(train))
    return [train[i] for i in order], heldout


def documents(tokenizer, which: str = "train", seed: int = 0) -> Iterator[tuple[Document, list[int]]]:
    """The documents of one split with their token ids under ``tokenizer`` (no special tokens, no chat template).

    Args:
        tokenizer: a Hugging Face tokenizer (any model's: the ids are computed here, the manifest's counts are the
            embedded model's).
        which: ``"train"`` (seeded order) or ``"heldout"`` (by id).
        seed: the split's seed.

    Raises:
        ValueError: ``which`` is neither split, or ``seed`` is negative.
    """
    if which not in ("train", "heldout"):
        raise ValueError(f"which={which!r} is not 'train' or 'heldout'")
    train, heldout = split(seed)
    for doc in train if which == "train" else heldout:
        yield doc, list(tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"])
