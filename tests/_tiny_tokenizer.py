"""Offline tokenizers for dataset tests (no hub, no model): built from the ``tokenizers`` library."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one token per word or punctuation run (every id is [UNK]).

    Token counts follow ``tokenizers``' ``Whitespace`` pre-tokenizer (``\\w+|[^\\w\\s]+``); decoding is lossy.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@lru_cache(maxsize=1)
def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one token per UTF-8 byte (byte-level BPE without merges).

    ``len(ids) == len(text.encode())`` and ``decode(encode(text)) == text``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
