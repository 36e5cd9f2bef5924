"""Extract the scorer training corpus: the docstrings of installed third-party packages with permissive licences,
packed into documents of a bounded number of model tokens (``python -m evaluation.train_scorers corpus``).

Why these sources: the corpus must ship offline and share no text with any evaluation set, which are built from
CPython's standard library, its documentation (``pydoc_data``) and generated prose (``evaluation/datasets/``). The
docstrings of scientific packages (:data:`PACKAGES`: BSD-licensed sympy, networkx, scipy, pandas, numpy, mpmath) are
English technical prose with examples, written by other authors than CPython's; ``tests/test_scorer_corpus.py``
checks that no 64-token window is shared with the evaluation sets at 2k tokens.

How: every ``.py`` file of a package, sorted, outside test directories, is parsed with ``ast`` (nothing is imported)
and its docstrings (module, classes, functions, in source order) are taken as blocks ``<qualified name>\\n<docstring>``
(``inspect.cleandoc``); a block seen before anywhere in the corpus (inherited or templated docs) is skipped. The
blocks of one file are packed, in order, into documents of :data:`MIN_TOKENS` to :data:`MAX_TOKENS` model tokens
(a block longer than the maximum is split at blank lines, then at lines); a file's remainder shorter than the
minimum is dropped. At most :data:`MAX_DOCUMENTS_PER_PACKAGE` documents per package are kept (the first ones in
file order), so the committed corpus stays a few MB compressed.

The result is written as ``<out>/scorer_corpus.jsonl.xz`` (one document a line: ``id``, ``package``, ``text``) and
``<out>/scorer_corpus_manifest.csv`` (per document: package, version, licence, file, the file's SHA-256, the
text's SHA-256, its token count under the tokenizer named there). Extraction depends on the installed package
versions, which the manifest records; :mod:`evaluation.train_scorers.corpus` reads the committed files and never
re-extracts.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import lzma
from collections.abc import Callable, Iterator
from pathlib import Path

from evaluation.atomic import write_atomic

__all__ = ["MAX_DOCUMENTS_PER_PACKAGE", "MAX_TOKENS", "MIN_TOKENS", "PACKAGES", "extract", "package_documents"]

#: Distribution name -> import name and licence (SPDX), as the distribution's metadata states it.
PACKAGES: dict[str, tuple[str, str]] = {
    "sympy": ("sympy", "BSD-3-Clause"),
    "networkx": ("networkx", "BSD-3-Clause"),
    "scipy": ("scipy", "BSD-3-Clause"),
    "pandas": ("pandas", "BSD-3-Clause"),
    "numpy": ("numpy", "BSD-3-Clause"),
    "mpmath": ("mpmath", "BSD-3-Clause"),
}
#: Bounds of a document's length in model tokens (the evaluation sets run at 2k tokens with the chat template).
MIN_TOKENS = 1024
MAX_TOKENS = 2000
#: Documents kept per package (the first in file order).
MAX_DOCUMENTS_PER_PACKAGE = 220
_SKIPPED_DIRS = {"tests", "test", "testing", "benchmarks", "_vendor", "vendor", "externals", "_lib"}


def _blocks(source: str) -> Iterator[str]:
    """``<qualified name>\\n<docstring>`` for the module, classes and functions of ``source``, in source order."""
    tree = ast.parse(source)

    def visit(node, prefix: str) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=False)
                if doc and doc.strip():
                    yield f"{name}\n{inspect.cleandoc(doc)}"
                yield from visit(child, f"{name}.")

    doc = ast.get_docstring(tree, clean=False)
    if doc and doc.strip():
        yield inspect.cleandoc(doc)
    yield from visit(tree, "")


def _pieces(block: str, count: Callable[[str], int]) -> Iterator[str]:
    """``block`` whole, or cut at blank lines and then at lines into pieces of at most :data:`MAX_TOKENS` tokens."""
    if count(block) <= MAX_TOKENS:
        yield block
        return
    for sep in ("\n\n", "\n"):
        parts = block.split(sep)
        if len(parts) > 1:
            piece = ""
            for part in parts:
                joined = f"{piece}{sep}{part}" if piece else part
                if count(joined) <= MAX_TOKENS:
                    piece = joined
                    continue
                if piece:
                    yield from _pieces(piece, count)
                piece = part
            if piece:
                yield from _pieces(piece, count)
            return
    # one line longer than the maximum (a table, a data literal): not prose, dropped


def package_documents(package: str, count: Callable[[str], int], seen: set[str]) -> Iterator[tuple[str, str]]:
    """``(file relative to the package's parent, text)`` of the documents of ``package`` (an import name), in file
    order; ``seen`` holds the SHA-256 of blocks already used (updated)."""
    spec = importlib.util.find_spec(package)
    root = Path(next(iter(spec.submodule_search_locations)))
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if _SKIPPED_DIRS & set(rel.parts[:-1]) or path.name.startswith("test_") or path.name == "conftest.py":
            continue
        try:
            source = path.read_text(encoding="utf-8")
            blocks = list(_blocks(source))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc, doc_tokens = "", 0
        for block in blocks:
            digest = hashlib.sha256(block.encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            for piece in _pieces(block, count):
                joined = f"{doc}\n\n{piece}" if doc else piece
                n = count(joined)
                if n <= MAX_TOKENS:
                    doc, doc_tokens = joined, n
                    continue
                if doc_tokens >= MIN_TOKENS:
                    yield str(rel), doc
                doc, doc_tokens = piece, count(piece)
        if doc_tokens >= MIN_TOKENS:
            yield str(rel), doc


def _file_sha256(package: str, rel: str) -> str:
    root = Path(next(iter(importlib.util.find_spec(package).submodule_search_locations))).parent
    return hashlib.sha256((root / rel).read_bytes()).hexdigest()


def extract(out_dir: Path, tokenizer, tokenizer_name: str) -> list[dict]:
    """Extract the corpus into ``out_dir`` (the two files of the module docstring); returns the manifest rows.

    Args:
        out_dir: where ``scorer_corpus.jsonl.xz`` and ``scorer_corpus_manifest.csv`` are written (created).
        tokenizer: the model's tokenizer that counts the tokens (the embedded model's for the committed corpus).
        tokenizer_name: the name the manifest gives it.
    """

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    seen: set[str] = set()
    rows, lines = [], []
    for dist, (package, licence) in PACKAGES.items():
        version = importlib.metadata.version(dist)
        for k, (rel, text) in enumerate(package_documents(package, count, seen)):
            if k == MAX_DOCUMENTS_PER_PACKAGE:
                break
            doc_id = f"{package}-{k:04d}"
            lines.append(json.dumps({"id": doc_id, "package": dist, "text": text}, ensure_ascii=False))
            rows.append(
                {
                    "id": doc_id,
                    "package": dist,
                    "version": version,
                    "licence": licence,
                    "file": rel,
                    "file_sha256": _file_sha256(package, rel),
                    "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                    "tokens": count(text),
                    "tokenizer": tokenizer_name,
                }
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    data = lzma.compress(("\n".join(lines) + "\n").encode(), preset=9 | lzma.PRESET_EXTREME)
    write_atomic(out_dir / "scorer_corpus.jsonl.xz", data)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(out_dir / "scorer_corpus_manifest.csv", buffer.getvalue())
    return rows
