"""Offline English prose for haystacks: the reference documentation that ships with CPython.

Source: ``pydoc_data.topics`` (the Python Language Reference and Library topics, Python Software
Foundation License v2). Only prose paragraphs are kept: grammar blocks, indented code and heading
underlines are dropped, and line wraps are joined, so the text reads as running English.
"""

from __future__ import annotations

import functools
import re

__all__ = ["prose_paragraphs", "prose_sentences", "SOURCE"]

SOURCE = "CPython pydoc_data.topics (Python documentation, PSF License v2)"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@functools.lru_cache(maxsize=1)
def prose_paragraphs() -> tuple[str, ...]:
    """All prose paragraphs, in a fixed order (topic names sorted), each one line of text.

    A paragraph is kept when it is not indented (code), has no grammar ``::=`` or heading rule, and
    is mostly letters and spaces.
    """
    from pydoc_data import topics

    out = []
    for name in sorted(topics.topics):
        for block in re.split(r"\n\s*\n", topics.topics[name]):
            lines = block.split("\n")
            if any(line.startswith((" ", "\t", ">>>")) for line in lines):
                continue
            if any(set(line.strip()) <= set("*=-~^") for line in lines if line.strip()):
                continue
            text = " ".join(line.strip() for line in lines).strip()
            if len(text) < 80 or "::=" in text:
                continue
            letters = sum(c.isalpha() or c == " " for c in text)
            if letters / len(text) < 0.85:
                continue
            out.append(text)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """The prose paragraphs split into sentences (on ``.``, ``!`` or ``?`` before a capital)."""
    return tuple(s.strip() for p in prose_paragraphs() for s in _SENTENCE_END.split(p) if s.strip())


def check_passage_lengths(passage_tokens: int, context_lengths) -> None:
    """Refuse passages under 32 tokens and context lengths without room for two passages (the multi-passage
    sets ``multidoc`` and ``keyfacts``).

    Raises:
        ValueError: naming the value and the limit.
    """
    if passage_tokens < 32:
        raise ValueError(f"passage_tokens={passage_tokens} must be >= 32")
    short = [n for n in context_lengths if int(n) < 2 * passage_tokens + 128]
    if short:
        raise ValueError(
            f"context_lengths {short} must be >= 2 * passage_tokens + 128 = "
            f"{2 * passage_tokens + 128} tokens (room for two passages)"
        )


def fill_body(sentences, sent_len, start: int, budget: int) -> tuple[list[str], int]:
    """Consecutive prose sentences from index ``start`` (cyclic) while their tokens fit ``budget``; at least one.

    Args:
        sentences: the prose sentences; sent_len: their token counts (same order).
        start: index of the first sentence; budget: tokens the body may use.

    Returns:
        The body's sentences and the (uncycled) index after the last one taken.
    """
    body, used, k = [], 0, start
    while used + sent_len[k % len(sentences)] <= budget or not body:
        body.append(sentences[k % len(sentences)])
        used += sent_len[k % len(sentences)]
        k += 1
    return body, k


def check_passage_count(length: int, n_pass: int, passage_tokens: int) -> None:
    """Refuse a context length that holds fewer than two passages.

    Raises:
        ValueError: naming the length, the passage count and the passage size.
    """
    if n_pass < 2:
        raise ValueError(
            f"context_length={length} holds {n_pass} passage(s) of ~{passage_tokens} tokens; at least two are needed"
        )
