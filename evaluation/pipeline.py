"""kvpress's text-generation pipeline for every tokenizer the harness runs: with or without a BOS token, with or
without a chat template, and with every token that ends a turn.

Without a chat template (a base model, or the LongBench tasks whose official prompt has none: trec, triviaqa,
samsum, lsht, lcc, repobench-p; :func:`evaluation.harness.chat_template`) kvpress 0.5.5's ``preprocess``
prepends ``tokenizer.bos_token`` to the context, which fails with a ``TypeError`` (None + str) for tokenizers that
have none (Qwen2.5, Qwen3). :class:`TextGenerationPipeline` prepends nothing there, as LongBench's ``pred.py``
(the tokenizer adds its special tokens, none for these), and is kvpress's pipeline in every other case.

Stop tokens (issue 32 item 6; KVCache-Factory #12, lighteval #1278): kvpress's ``generate_answer`` stops only on
``model.generation_config.eos_token_id``; with ``None`` it never stops, and a chat model whose end-of-turn token is
another (Llama 3's ``<|eot_id|>`` next to ``<|end_of_text|>``) runs to ``max_new_tokens`` with the next turn's text
in its prediction. The harness stops on :func:`stop_token_ids`, the union of the model config's, the generation
config's and the tokenizer's ``eos_token_id`` and the chat template's end-of-turn token
(:func:`end_of_turn_token`), and refuses a model for which that union is empty.

The thinking switch (issue 63 item 4): a chat template may read ``enable_thinking`` (Qwen3's writes an empty
``<think>\n\n</think>\n\n`` block after the assistant header when it is false, and lets the model think when it is
true or undefined). kvpress's pipeline passes ``enable_thinking=False`` unless told otherwise; the harness states
it: :class:`TextGenerationPipeline` takes ``enable_thinking`` (the run's ``model.enable_thinking``, off by default in
``configs/model/base/chat.yaml``) and passes it to every prompt it builds, through the pipeline call and through
``preprocess`` alike. A template without the switch (:func:`has_thinking_switch`) renders the same prompt either way;
the harness refuses ``model.enable_thinking=true`` for it (:func:`evaluation.guards.check_thinking`). The one prompt
the harness does not build is KVzip's reconstruction prompt: kvpress's KVzip press renders its chat-template
suffix itself, with ``enable_thinking=False`` whatever the run's setting (kvpress 0.5.5).
"""

from __future__ import annotations

from kvpress import KVPressTextGenerationPipeline

__all__ = ["TextGenerationPipeline", "end_of_turn_token", "has_thinking_switch", "stop_token_ids"]

_ANSWER = "kvpress-research answer marker"  # an assistant message whose end the chat template closes


def end_of_turn_token(tokenizer) -> int | None:
    """The special token the tokenizer's chat template writes right after an assistant message, or None (no
    template, a template that renders no such message, or plain text after it).

    Renders ``[user, assistant]`` with ``tokenize=False`` and tokenises what follows the assistant's text:
    ``<|im_end|>`` (ChatML: SmolLM2, Qwen), ``<|eot_id|>`` (Llama 3), ``<end_of_turn>`` (Gemma), ``<|end|>`` (Phi-3).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    turns = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template may refuse this conversation (jinja raises its own error types)
        return None
    if _ANSWER not in text:
        return None
    ids = tokenizer.encode(text[text.rindex(_ANSWER) + len(_ANSWER) :], add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


def has_thinking_switch(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads ``enable_thinking`` (a variable it does not set itself, found with
    ``jinja2.meta.find_undeclared_variables``; a template jinja cannot parse here is searched for the name). False
    without a template. A tokenizer with several named templates has the switch when one of them has it."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    templates = template.values() if isinstance(template, dict) else [template]
    found = False
    for text in templates:
        try:
            from jinja2 import ext, meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(extensions=[ext.loopcontrols])
            found |= "enable_thinking" in meta.find_undeclared_variables(env.parse(text))
        except Exception:  # transformers' own tags ({% generation %}) or a newer jinja syntax
            found |= "enable_thinking" in text
    return found


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end an answer: the union of ``model.config.eos_token_id``,
    ``model.generation_config.eos_token_id``, ``tokenizer.eos_token_id`` (each an id, a list or None) and the chat
    template's end-of-turn token (:func:`end_of_turn_token`).

    Returns:
        The ids, sorted.

    Raises:
        ValueError: naming the model when the union is empty (its answers would never stop before
            ``max_new_tokens``).
    """
    found: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for value in (
        getattr(getattr(model, "config", None), "eos_token_id", None),
        getattr(generation, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        end_of_turn_token(tokenizer),
    ):
        found.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    if not found:
        name = getattr(model, "name_or_path", None) or type(model).__name__
        raise ValueError(
            f"model {name!r} has no stop token: eos_token_id is None in its config, its generation config and its "
            "tokenizer, and its chat template writes no end-of-turn token, so answers would run to max_new_tokens; "
            "set model.generation_config.eos_token_id"
        )
    return sorted(int(i) for i in found)


class _EmptyBos:
    """A tokenizer seen with ``bos_token == ""`` (everything else is the tokenizer's own)."""

    bos_token = ""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class TextGenerationPipeline(KVPressTextGenerationPipeline):
    """kvpress's ``KVPressTextGenerationPipeline`` that also takes tokenizers without a BOS token, stops on every
    stop token and states the thinking switch (see the module docstring); construct it as kvpress's (``model=``,
    ``tokenizer=``, ``device=``) plus ``enable_thinking``: the value every prompt it builds passes to the chat
    template (default False, kvpress's own; a call's ``enable_thinking=`` still wins).

    Raises:
        ValueError: at construction, for a model without a stop token (:func:`stop_token_ids`).
    """

    def __init__(self, *args, enable_thinking: bool = False, **kwargs):
        self.enable_thinking = bool(enable_thinking)
        super().__init__(*args, **kwargs)
        self.stop_token_ids = stop_token_ids(self.model, self.tokenizer)  # with the chat template the model has

    def _sanitize_parameters(self, *args, enable_thinking: bool | None = None, **kwargs):
        """kvpress's, with ``enable_thinking`` defaulting to this pipeline's (kvpress's defaults to False)."""
        thinking = getattr(self, "enable_thinking", False) if enable_thinking is None else enable_thinking
        return super()._sanitize_parameters(*args, enable_thinking=thinking, **kwargs)

    def generate_answer(self, *args, **kwargs) -> str:
        """kvpress's greedy ``generate_answer``, stopping on :attr:`stop_token_ids` (the generation config's
        ``eos_token_id`` holds them for the call)."""
        config = self.model.generation_config
        saved = config.eos_token_id
        config.eos_token_id = list(self.stop_token_ids)
        try:
            return super().generate_answer(*args, **kwargs)
        finally:
            config.eos_token_id = saved

    def preprocess(self, context: str, *args, enable_thinking: bool | None = None, **kwargs):
        """kvpress's ``preprocess`` with ``enable_thinking`` (default: this pipeline's); without a chat template and
        without a BOS token nothing is prepended.

        Returns:
            ``{"context_ids": (1, T), "questions_ids": [(1, n_q), ...]}`` as kvpress's.
        """
        kwargs["enable_thinking"] = self.enable_thinking if enable_thinking is None else enable_thinking
        tokenizer = self.tokenizer
        if tokenizer.chat_template is not None or getattr(tokenizer, "bos_token", None) is not None:
            return super().preprocess(context, *args, **kwargs)
        self.tokenizer = _EmptyBos(tokenizer)
        try:
            return super().preprocess(context, *args, **kwargs)
        finally:
            self.tokenizer = tokenizer
