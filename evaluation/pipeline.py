"""kvpress's text-generation pipeline for every tokenizer the harness runs: with or without a BOS token, with or
without a chat template.

Without a chat template (a base model, or the LongBench tasks whose official prompt has none: trec, triviaqa,
samsum, lsht, lcc, repobench-p; :func:`evaluation.harness.chat_template`) kvpress 0.5.5's ``preprocess``
prepends ``tokenizer.bos_token`` to the context, which fails with a ``TypeError`` (None + str) for tokenizers that
have none (Qwen2.5, Qwen3). :class:`TextGenerationPipeline` prepends nothing there, as LongBench's ``pred.py``
(the tokenizer adds its special tokens, none for these), and is kvpress's pipeline in every other case.
"""

from __future__ import annotations

from kvpress import KVPressTextGenerationPipeline

__all__ = ["TextGenerationPipeline"]


class _EmptyBos:
    """A tokenizer seen with ``bos_token == ""`` (everything else is the tokenizer's own)."""

    bos_token = ""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class TextGenerationPipeline(KVPressTextGenerationPipeline):
    """kvpress's ``KVPressTextGenerationPipeline`` that also takes tokenizers without a BOS token (see the module
    docstring); construct it as kvpress's (``model=``, ``tokenizer=``, ``device=``)."""

    def preprocess(self, context: str, *args, **kwargs):
        """kvpress's ``preprocess``; without a chat template and without a BOS token nothing is prepended.

        Returns:
            ``{"context_ids": (1, T), "questions_ids": [(1, n_q), ...]}`` as kvpress's.
        """
        tokenizer = self.tokenizer
        if tokenizer.chat_template is not None or getattr(tokenizer, "bos_token", None) is not None:
            return super().preprocess(context, *args, **kwargs)
        self.tokenizer = _EmptyBos(tokenizer)
        try:
            return super().preprocess(context, *args, **kwargs)
        finally:
            self.tokenizer = tokenizer
