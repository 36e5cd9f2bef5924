"""Token counting and middle truncation shared by the datasets (lengths are in the model's tokens)."""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (no BOS/EOS, no chat template)."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def count_tokens(tokenizer, text: str) -> int:
    """Number of model tokens of ``text`` without special tokens."""
    return len(encode(tokenizer, text))


def truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    """Cut the middle of ``text`` so that it keeps at most ``max_tokens`` tokens: its head and its tail.

    LongBench's ``pred.py`` rule ("truncate in the middle, since the left and right side may contain
    crucial instructions"): when the text is longer, keep the first ``max_tokens // 2`` tokens and the
    last ``max_tokens - max_tokens // 2`` tokens, decoded and concatenated. A text that fits is returned
    unchanged. Decoding may merge or split tokens at the cut, so a re-encoding can differ by a token or
    two from ``max_tokens``.

    Raises:
        ValueError: ``max_tokens < 0``.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens} must be >= 0")
    ids = encode(tokenizer, text)
    if len(ids) <= max_tokens:
        return text
    head = max_tokens // 2
    tail = max_tokens - head
    kept_tail = ids[len(ids) - tail :] if tail else []
    return tokenizer.decode(ids[:head], skip_special_tokens=True) + tokenizer.decode(
        kept_tail, skip_special_tokens=True
    )
