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


@lru_cache(maxsize=1)
def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one token per printable ASCII character (ids < 128).

    ``<pad>``=0, ``<s>``=1 (BOS), ``</s>``=2 (EOS), ``<unk>``=3: fits the tiny random Llama models of
    ``tests/conftest.py`` (vocab 128) for runs through kvpress's pipeline.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({chr(c): 4 + i for i, c in enumerate(range(32, 127))})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=4096)
