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

import contextlib
import time

import torch
from kvpress import KVPressTextGenerationPipeline
from transformers import DynamicCache

__all__ = ["TextGenerationPipeline", "end_of_turn_token", "has_thinking_switch", "next_turn_text", "stop_token_ids"]

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


#: What follows an answer before the next question of a chat when the tokenizer has no chat template: kvpress's
#: pipeline writes ``question + "\n" + answer_prefix`` after the context, so a new paragraph starts the next turn.
PLAIN_TURN_SEPARATOR = "\n\n"


def next_turn_text(tokenizer, question: str, answer_prefix: str = "", enable_thinking: bool = False) -> str:
    """The text that continues a chat after the model's answer with a new question: the end of the assistant's turn,
    a user turn holding ``question``, the assistant's header (the chat template's generation prompt, rendered with
    ``enable_thinking``) and ``answer_prefix``. Without a chat template: :data:`PLAIN_TURN_SEPARATOR`, the question,
    ``"\n"`` and the prefix (kvpress's layout of a question without a template).

    Rendered from ``[user, assistant, user]`` with ``tokenize=False``: what follows the assistant's text.

    Raises:
        ValueError: naming the tokenizer when its template does not render an assistant message's text.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return PLAIN_TURN_SEPARATOR + question + "\n" + answer_prefix
    turns = [
        {"role": "user", "content": "context"},
        {"role": "assistant", "content": _ANSWER},
        {"role": "user", "content": question},
    ]
    text = tokenizer.apply_chat_template(
        turns, add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )
    if _ANSWER not in text:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"the chat template of {name!r} does not render an assistant message: no turns on it")
    return text[text.rindex(_ANSWER) + len(_ANSWER) :] + answer_prefix


class _Conversation:
    """The state of a chat on one cache (:meth:`TextGenerationPipeline.answer_questions` with ``turns``): the next
    token's position, the last generated token when it is not in the cache yet, and the compressed context's
    per-layer lengths (the cache is cut back to them when the chat ends)."""

    def __init__(self):
        self.position: int | None = None
        self.pending: list[int] = []
        self.lengths: list[int] | None = None


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
        #: seconds of each answer of the last call (each ``generate_answer``: question forward and greedy decode)
        self.answer_seconds: list[float] = []
        self._chat: _Conversation | None = None
        super().__init__(*args, **kwargs)
        self.stop_token_ids = stop_token_ids(self.model, self.tokenizer)  # with the chat template the model has

    def _sanitize_parameters(
        self,
        *args,
        enable_thinking: bool | None = None,
        answer_prefixes: list[str] | None = None,
        turns: bool = False,
        **kwargs,
    ):
        """kvpress's, with ``enable_thinking`` defaulting to this pipeline's (kvpress's defaults to False), and two
        parameters of the shared-context protocol (:mod:`evaluation.shared`): ``answer_prefixes``, one per question
        of ``questions`` (instead of kvpress's one ``answer_prefix`` for all), and ``turns``, the questions asked in
        turn in one chat (each answer stays in the cache for the next question) instead of each on the compressed
        context alone (kvpress's multi-request).

        Raises:
            ValueError: ``answer_prefixes`` of another length than ``questions``.
        """
        thinking = getattr(self, "enable_thinking", False) if enable_thinking is None else enable_thinking
        pre, forward, post = super()._sanitize_parameters(*args, enable_thinking=thinking, **kwargs)
        if answer_prefixes is not None:
            if len(answer_prefixes) != len(pre["questions"]):
                raise ValueError(
                    f"answer_prefixes has {len(answer_prefixes)} prefixes for {len(pre['questions'])} questions"
                )
            pre["answer_prefixes"] = list(answer_prefixes)
        if turns:
            pre["turns"] = forward["turns"] = True
        return pre, forward, post

    def generate_answer(self, question_ids, cache, context_length: int, max_new_tokens: int) -> str:
        """kvpress's greedy ``generate_answer``, stopping on :attr:`stop_token_ids` (the generation config's
        ``eos_token_id`` holds them for the call); inside a chat (``turns``) the next turn of it
        (:meth:`_chat_answer`). Its seconds are appended to :attr:`answer_seconds`."""
        start = time.perf_counter()
        try:
            if self._chat is not None:
                return self._chat_answer(question_ids, cache, context_length, max_new_tokens)
            config = self.model.generation_config
            saved = config.eos_token_id
            config.eos_token_id = list(self.stop_token_ids)
            try:
                return super().generate_answer(question_ids, cache, context_length, max_new_tokens)
            finally:
                config.eos_token_id = saved
        finally:
            self.answer_seconds.append(time.perf_counter() - start)

    def _chat_answer(self, question_ids, cache, context_length: int, max_new_tokens: int) -> str:
        """One turn of a chat on ``cache``: kvpress's greedy decode (question forward at the chat's position, then one
        token at a time until a stop token after the first, or ``max_new_tokens``), its tokens left in the cache.

        The first turn starts at ``context_length`` (as kvpress's pipeline asks a question); each later one where the
        last ended, after the last turn's final token when that was not a stop token (a stop token is not fed: the
        chat template's end of turn, in the next question's text, closes the answer).
        """
        chat = self._chat
        if chat.position is None:
            chat.position = context_length
            chat.lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        device = self.model.device
        pending = torch.tensor([chat.pending], dtype=question_ids.dtype, device=device)
        ids = torch.cat([pending, question_ids.to(device)], dim=1)
        position_ids = torch.arange(chat.position, chat.position + ids.shape[1], device=device).unsqueeze(0)
        outputs = self.model(input_ids=ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
        generated = [outputs.logits[0, -1].argmax()]
        for i in range(max_new_tokens - 1):
            outputs = self.model(
                input_ids=generated[-1].view(1, 1), past_key_values=cache, position_ids=position_ids[:, -1:] + 1 + i
            )
            generated.append(outputs.logits[0, -1].argmax())
            if generated[-1].item() in self.stop_token_ids:
                break
        last = int(generated[-1])
        chat.position += ids.shape[1] + len(generated) - 1  # the last token is not in the cache
        chat.pending = [] if last in self.stop_token_ids else [last]
        return str(self.tokenizer.decode(torch.stack(generated), skip_special_tokens=True))

    def _remove_answer_from_cache(self, cache, cache_seq_lengths: list[int]):
        """kvpress's (the cache cut back to the compressed context after each question), except inside a chat, whose
        answers stay in the cache until it ends."""
        if self._chat is None:
            super()._remove_answer_from_cache(cache, cache_seq_lengths)

    @contextlib.contextmanager
    def _chat_on(self, cache, turns: bool):
        """Inside the block, with ``turns``, the questions form one chat on ``cache``, which is cut back to the
        compressed context when the block ends; :attr:`answer_seconds` starts empty."""
        self.answer_seconds = []
        if not turns:
            yield
            return
        self._chat = _Conversation()
        try:
            yield
        finally:
            chat, self._chat = self._chat, None
            if chat.lengths is not None:
                self._remove_answer_from_cache(cache, chat.lengths)

    def _forward(self, input_tensors, max_new_tokens: int = 50, press=None, cache=None, turns: bool = False):
        """kvpress's ``_forward`` (prefill under ``press``, then each question on the compressed cache, the answer
        cut off after it); with ``turns`` the questions form one chat (:meth:`_chat_answer`)."""
        cache = DynamicCache() if cache is None else cache
        with self._chat_on(cache, turns):
            return super()._forward(input_tensors, max_new_tokens=max_new_tokens, press=press, cache=cache)

    def answer_questions(
        self, cache, questions_ids: list, context_length: int, max_new_tokens: int, turns: bool = False
    ) -> list[str]:
        """kvpress's decoding loop (the part of its ``_forward`` after the prefill) on an already compressed
        ``cache``: each question answered greedily, the answer cut off after it (kvpress's multi-request), or with
        ``turns`` one chat (:meth:`_chat_answer`); the cache holds the compressed context again on return.

        Args:
            cache: the compressed cache (its decode-time state on its layers).
            questions_ids: ``(1, n_k)`` per question, as :meth:`preprocess` gives them (with ``turns`` for a chat).
            context_length: ``T``, the uncompressed context's length (the first question's position).
            max_new_tokens: the most tokens of each answer.
            turns: the questions in turn in one chat.

        Returns:
            The answers, in order; :attr:`answer_seconds` holds each one's seconds.
        """
        answers = []
        with self._chat_on(cache, turns):
            for question_ids in questions_ids:
                lengths = [cache.get_seq_length(i) for i in range(len(cache))]
                answers.append(self.generate_answer(question_ids, cache, context_length, max_new_tokens))
                self._remove_answer_from_cache(cache, lengths)
        return answers

    def preprocess(
        self,
        context: str,
        questions: list[str],
        answer_prefix: str,
        max_context_length: int,
        enable_thinking: bool | None = None,
        answer_prefixes: list[str] | None = None,
        turns: bool = False,
    ):
        """kvpress's ``preprocess`` with ``enable_thinking`` (default: this pipeline's); without a chat template and
        without a BOS token nothing is prepended. With ``answer_prefixes`` each question gets its own prefix (each
        question's ids are kvpress's for that question alone); with ``turns`` the questions after the first are the
        next turns of a chat (:func:`next_turn_text`).

        Returns:
            ``{"context_ids": (1, T), "questions_ids": [(1, n_q), ...]}`` as kvpress's.
        """
        thinking = self.enable_thinking if enable_thinking is None else enable_thinking
        if answer_prefixes is None and not turns:
            return self._preprocess(context, questions, answer_prefix, max_context_length, thinking)
        prefixes = list(answer_prefixes) if answer_prefixes is not None else [answer_prefix] * len(questions)
        first = self._preprocess(context, questions[:1], prefixes[0], max_context_length, thinking)
        ids = first["questions_ids"]
        for question, prefix in zip(questions[1:], prefixes[1:]):
            if turns:
                text = next_turn_text(self.tokenizer, question, prefix, thinking)
                ids.append(self.tokenizer.encode(text, return_tensors="pt", add_special_tokens=False))
            else:
                ids += self._preprocess(context, [question], prefix, max_context_length, thinking)["questions_ids"]
        return {"context_ids": first["context_ids"], "questions_ids": ids}

    def _preprocess(self, context: str, questions: list[str], answer_prefix: str, max_context_length: int, thinking):
        """kvpress's ``preprocess``; a tokenizer without chat template and BOS token gets nothing prepended."""
        tokenizer = self.tokenizer
        args = (context, questions, answer_prefix, max_context_length, thinking)
        if tokenizer.chat_template is not None or getattr(tokenizer, "bos_token", None) is not None:
            return super().preprocess(*args)
        self.tokenizer = _EmptyBos(tokenizer)
        try:
            return super().preprocess(*args)
        finally:
            self.tokenizer = tokenizer
