"""Chunks and protected spans of a prompt, as token index ranges (paper 001 section 2.1).

EntroPrefill removes whole candidate chunks (documents, paragraphs or fixed token blocks) that
precede the user question; instructions, the complete question, delimiters and the initial sink
tokens are protected, and a chunk that overlaps a protected span becomes protected itself
("If protection intersects a chunk, the entire chunk is protected before indexing the remaining
candidates", paper 001 section 2.1; docs/methods.md §4). The datasets use the same passage markers.

Everything works on token ids plus character offsets, so a chunk is a half-open token range
``[start, end)`` of the tokenized prompt. Token ``k`` with character span ``offsets[k] = (s, e)``
belongs to the text segment that contains its first character ``s`` (segments partition the text),
so a token that straddles a chunk boundary belongs to exactly one side. Explicitly protected
character spans (``protect_pattern`` matches) instead protect EVERY token that overlaps them.

Chunking modes:

* ``"passage"``: LongBench multi-document markers ``Passage N:`` (:data:`PASSAGE_PATTERN`);
* ``"paragraph"``: blank lines (:data:`PARAGRAPH_PATTERN`);
* ``"regex"``: any delimiter regex given by the caller;
* ``"block"``: fixed blocks of ``block_size`` tokens.

In the three delimiter modes the text before the first delimiter is the instruction (protected),
every delimiter match is protected, and each chunk runs from the end of a delimiter to the start of
the next one (or to the question); a whitespace-only gap is protected like a delimiter. In
``"block"`` mode the documents start after the sinks, or after the first match of
``doc_start_pattern`` when one is given (the text before it is the instruction).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "CHUNK_MODES",
    "PASSAGE_PATTERN",
    "PARAGRAPH_PATTERN",
    "passage_marker",
    "ChunkPlan",
    "token_offsets",
    "find_question",
    "plan_chunks",
]

CHUNK_MODES = ("passage", "paragraph", "regex", "block")
#: LongBench multi-doc QA passage marker (``Passage 1:`` ... ``Passage N:``).
PASSAGE_PATTERN = r"Passage \d+:"
#: One or more blank lines.
PARAGRAPH_PATTERN = r"\n[ \t]*\n\s*"


def passage_marker(n: int) -> str:
    """The marker of passage ``n`` (1-based), matched by :data:`PASSAGE_PATTERN`."""
    if n < 1:
        raise ValueError(f"passage number n={n} must be >= 1")
    return f"Passage {n}:"


@dataclass
class ChunkPlan:
    """Chunks and protected spans of one tokenized prompt of ``n_tokens`` tokens.

    Attributes:
        n_tokens: ``T``.
        chunks: every chunk in text order, as token ranges ``[start, end)``; disjoint, non-empty.
            Chunk indices used elsewhere (``removed_chunks``) index this list, so in ``"passage"``
            mode chunk ``i`` is ``Passage i+1``.
        protected_chunk: ``protected_chunk[i]`` is True when chunk ``i`` overlaps a protected span
            and is therefore not a candidate.
        protected: merged protected token ranges (sinks, instruction, delimiters, question,
            ``protect_pattern`` matches).
        question: token range ``[q_start, T)`` of the question (``(T, T)`` when there is none).
        n_sink: number of leading sink tokens.
    """

    n_tokens: int
    chunks: list[tuple[int, int]]
    protected_chunk: list[bool]
    protected: list[tuple[int, int]]
    question: tuple[int, int]
    n_sink: int = 0
    mode: str = field(default="passage")

    @property
    def candidates(self) -> list[int]:
        """Indices (into :attr:`chunks`) of the removable candidate chunks ``c_1 .. c_k``."""
        return [i for i, p in enumerate(self.protected_chunk) if not p]

    @property
    def sizes(self) -> list[int]:
        """``n_i`` of every chunk (tokens)."""
        return [e - s for s, e in self.chunks]

    def retained_indices(self, removed: Sequence[int]) -> torch.Tensor:
        """Retained support ``R = [T] \\ E`` for the union ``E`` of the ``removed`` chunks.

        Args:
            removed: chunk indices (into :attr:`chunks`), each a candidate.

        Returns:
            ``(T',)`` int64 token indices in ascending (original) order.

        Raises:
            ValueError: if an index is out of range or names a protected chunk.
        """
        keep = torch.ones(self.n_tokens, dtype=torch.bool)
        for i in removed:
            if not 0 <= i < len(self.chunks):
                raise ValueError(f"chunk index {i} is outside [0, {len(self.chunks)})")
            if self.protected_chunk[i]:
                raise ValueError(f"chunk {i} {self.chunks[i]} is protected and cannot be removed")
            s, e = self.chunks[i]
            keep[s:e] = False
        return keep.nonzero().flatten()


def token_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """Text of ``ids`` and the character span of every token in it.

    Exact path: decode, re-encode with a fast tokenizer's offset mapping, and use it when the
    re-encoding reproduces ``ids``. Otherwise each token is decoded on its own and the pieces are
    concatenated (``text`` is then that concatenation, which can differ from the true decoding only
    inside multi-byte characters split across tokens; ASCII markers are unaffected).

    Args:
        tokenizer: a Hugging Face tokenizer, or any object with ``decode(list[int]) -> str``.
        ids: the ``T`` token ids.

    Returns:
        ``(text, offsets)`` with ``offsets[k] = (start, end)`` character positions in ``text``,
        non-decreasing, ``len(offsets) == T``.
    """
    ids = [int(i) for i in ids]
    if getattr(tokenizer, "is_fast", False):
        text = tokenizer.decode(ids)
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            if list(enc["input_ids"]) == ids:
                return text, [(int(s), int(e)) for s, e in enc["offset_mapping"]]
        except (TypeError, ValueError, NotImplementedError):  # pragma: no cover - tokenizer quirks
            pass
    if hasattr(tokenizer, "batch_decode"):
        pieces = tokenizer.batch_decode([[i] for i in ids])
    else:
        pieces = [tokenizer.decode([i]) for i in ids]
    offsets, pos = [], 0
    for p in pieces:
        offsets.append((pos, pos + len(p)))
        pos += len(p)
    return "".join(pieces), offsets


def find_question(text: str, question_pattern: str) -> int | None:
    """Character position where the question starts: the LAST match of ``question_pattern``.

    Returns:
        the start of the last match, or ``None`` when the pattern does not occur.
    """
    last = None
    for m in re.finditer(question_pattern, text):
        last = m.start()
    return last


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(x for x in spans if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def plan_chunks(
    text: str,
    offsets: Sequence[tuple[int, int]],
    *,
    mode: str = "passage",
    question_start: int | None = None,
    n_sink: int = 4,
    delimiter: str | None = None,
    block_size: int = 128,
    protect_pattern: str | None = None,
    doc_start_pattern: str | None = None,
) -> ChunkPlan:
    """Split a tokenized prompt into candidate chunks and protected spans (paper 001 section 2.1).

    Args:
        text: the prompt text that ``offsets`` index (see :func:`token_offsets`).
        offsets: ``T`` character spans, one per token.
        mode: one of :data:`CHUNK_MODES`.
        question_start: character position of the question (it and everything after it is
            protected and no chunk extends into it); ``None`` means the prompt has no question
            and chunks run to the end.
        n_sink: leading sink tokens, protected (``S`` of paper 001 section 3.1).
        delimiter: the delimiter regex for ``mode="regex"`` (ignored otherwise).
        block_size: tokens per chunk for ``mode="block"``.
        protect_pattern: optional regex; every token overlapping one of its matches is protected.
        doc_start_pattern: ``"block"`` mode only: documents start after its first match.

    Returns:
        the :class:`ChunkPlan`.

    Raises:
        ValueError: for an unknown ``mode``, a missing ``delimiter`` in ``"regex"`` mode, a
            ``block_size < 1``, ``n_sink < 0`` or a ``question_start`` outside the text.
    """
    if mode not in CHUNK_MODES:
        raise ValueError(f"chunking mode={mode!r} must be one of {CHUNK_MODES}")
    if n_sink < 0:
        raise ValueError(f"n_sink={n_sink} must be >= 0")
    T = len(offsets)
    q_char = len(text) if question_start is None else question_start
    if not 0 <= q_char <= len(text):
        raise ValueError(f"question_start={question_start} must lie in [0, {len(text)}]")
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]

    def tok(c: int) -> int:  # first token whose first character is at or after character c
        return bisect.bisect_left(starts, c)

    q_tok = tok(q_char) if question_start is not None else T
    protected: list[tuple[int, int]] = [(0, min(n_sink, T)), (q_tok, T)]
    chunks: list[tuple[int, int]] = []

    if mode == "block":
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        doc_tok = 0
        if doc_start_pattern is not None:
            m = re.search(doc_start_pattern, text[:q_char])
            if m is not None:
                doc_tok = tok(m.end())
                protected.append((0, doc_tok))
        start = max(doc_tok, min(n_sink, T))
        for s in range(start, q_tok, block_size):
            chunks.append((s, min(s + block_size, q_tok)))
    else:
        if mode == "regex":
            if not delimiter:
                raise ValueError("chunking mode='regex' needs a delimiter regex (delimiter=None)")
            pattern = delimiter
        else:
            pattern = PASSAGE_PATTERN if mode == "passage" else PARAGRAPH_PATTERN
        matches = [m for m in re.finditer(pattern, text[:q_char]) if m.end() > m.start()]
        if matches:
            protected.append((0, tok(matches[0].start())))  # instruction
        for i, m in enumerate(matches):
            d0, d1 = tok(m.start()), tok(m.end())
            protected.append((d0, d1))  # the delimiter itself
            nxt_char = matches[i + 1].start() if i + 1 < len(matches) else q_char
            nxt = tok(nxt_char)
            if nxt > d1 and not text[m.end() : nxt_char].strip():
                protected.append((d1, nxt))  # whitespace between delimiters: delimiter material
            elif nxt > d1:
                chunks.append((d1, nxt))

    if protect_pattern:
        for m in re.finditer(protect_pattern, text):
            a, b = m.start(), m.end()
            first = bisect.bisect_right(ends, a)  # first token ending after a
            last = bisect.bisect_left(starts, b)  # tokens starting before b
            if b == a:
                continue
            protected.append((first, last))
    protected = _merge(protected)
    protected_chunk = [any(s < pe and ps < e for ps, pe in protected) for s, e in chunks]
    return ChunkPlan(
        n_tokens=T,
        chunks=chunks,
        protected_chunk=protected_chunk,
        protected=protected,
        question=(q_tok, T),
        n_sink=min(n_sink, T),
        mode=mode,
    )
