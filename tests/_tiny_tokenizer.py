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
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=4096,
    )


#: A ChatML chat template (the layout of Qwen2.5's and SmolLM2's), for tokenizers made in the tests.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer_flavour(bos: bool, chat_template: bool):
    """A fresh copy of :func:`char_tokenizer` with or without its BOS token (``<s>``; Qwen2.5 and Qwen3 have
    none) and with or without a chat template (:data:`CHATML_TEMPLATE`)."""
    import copy

    tok = copy.deepcopy(char_tokenizer())
    if not bos:
        tok.bos_token = None
    tok.chat_template = CHATML_TEMPLATE if chat_template else None
    return tok
