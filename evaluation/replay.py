"""Replay one uncompressed prefill for many presses, and decode their caches as one batch.

Why this is exact. A kvpress press that compresses in its forward hooks (``BasePress.forward_hook``)
replaces the layer's cache entries *after* the attention output is computed; the hidden states of the
prefill are those of the uncompressed model, and layer ``i``'s hook reads only layer ``i``'s keys and
values. So one uncompressed prefill, with the inputs every hook saw recorded (:class:`PrefillCapture`: the
layer's ``hidden_states``, ``position_embeddings``, ``cache_position`` and attention output), lets each press's
hooks be called again afterwards, in the forward's order, on a fresh cache that receives the same keys and
values layer by layer (:func:`replay_prefill`: each attention module and then the language model is called
with its recorded inputs, its ``forward`` standing in for the computation, so that every hook runs as in the
prefill, through ``nn.Module.__call__`` itself). Which presses qualify is a capability
(``shares_prefill``, :mod:`evaluation.registry`); ``tests/test_fused.py`` checks bit-equal caches and equal
predictions against separate runs. (The probabilistic-eviction presses are equal to float32 round-off, with the
same kept entries: in a direct prefill their attention computes the proposal statistics
(:mod:`presses.probabilistic.prefill_attention`), while a replay has only the recorded prefill and recomputes them.)
The question may sit inside the compressed context (``query_aware``) or
come after it: the replay does not care. A press that reads attention weights (H2O-style; the
capability ``needs_eager``) shares a prefill run on eager attention: the recorded attention
output holds the weights its hook reads, so it too is rebuilt bit for bit, at a memory cost of the weights of
every layer (``4 L H T^2`` bytes in float32; the sweep refuses more than :data:`MAX_EAGER_CAPTURE_BYTES`).

Decoding: :func:`generate_answers` decodes caches of equal per-layer lengths as one batch (kvpress's greedy
decode, batched); :func:`pad_to_common_lengths` pads the caches of one compression ratio to common lengths,
the padding masked with a ``-inf`` logit bias (:mod:`presses.attention`), so a row computes what it would
alone up to the rounding of batched matrix products. Presses with decode-time state (the SNIS correction)
export it after their replay and the batch's states are stacked row by row (the press contract).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from evaluation.pipeline import stop_token_ids
from evaluation.registry import capabilities, sharing_problem
from presses import attention
from presses.attention_bias import AttentionBias
from presses.core.model import language_model, text_config

logger = logging.getLogger("evaluation.replay")

#: The most memory a captured eager prefill's attention weights may take (float32 bytes, all layers): SmolLM2's
#: 30 layers x 9 heads at 2k tokens take 4.5 GiB, at 4k 18 GiB.
MAX_EAGER_CAPTURE_BYTES = 8 * 2**30

__all__ = [
    "MAX_EAGER_CAPTURE_BYTES",
    "PrefillCapture",
    "check_capture_memory",
    "replay_prefill",
    "greedy_step",
    "generate_answers",
    "pad_to_common_lengths",
    "round_robin_by_task",
]


def check_capture_memory(model, T: int, name: str = "") -> None:
    """Raise if a shared eager prefill of ``T`` tokens would record more attention weights than
    :data:`MAX_EAGER_CAPTURE_BYTES` (``4 L H T^2`` bytes, float32, every layer held until the replays end).

    Raises:
        ValueError: naming the example, the size and the limit, and what to use instead.
    """
    c = text_config(model)
    need = 4 * c.num_hidden_layers * c.num_attention_heads * T * T
    if need > MAX_EAGER_CAPTURE_BYTES:
        raise ValueError(
            f"example {name!r}: a shared eager prefill of {T} tokens would hold {need / 2**30:.1f} GiB "
            f"of attention weights, above the limit of {MAX_EAGER_CAPTURE_BYTES / 2**30:.0f} GiB: run "
            "the presses that need eager attention with python -m evaluation.run"
        )


def check_shareable(press, name: str = "") -> None:
    """Raise unless ``press`` (None = no press) can be evaluated from a shared prefill (its capability
    ``shares_prefill``, :mod:`evaluation.registry`).

    Raises:
        ValueError: naming the press and what to use instead.
    """
    problem = sharing_problem(press)
    if problem:
        raise ValueError(
            f"press {name or type(press).__name__} ({type(press).__name__}) cannot share a prefill ({problem}): "
            "run it with python -m evaluation.run"
        )


class PrefillCapture:
    """Record what the forward hooks of a prefill see: per attention layer ``(args, kwargs, output)``
    (``kwargs`` without the cache), the layer's keys and values after the forward, and the language
    model's ``(args, kwargs, output)``.

    Use ``with PrefillCapture(model) as cap: model.model(input_ids=ids, past_key_values=cache)``; then
    ``cap.layers[i] = (args, kwargs, output, keys, values)`` with keys/values ``(B, H_kv, T, d)``.
    """

    def __init__(self, model):
        self.model = model
        self.layers: list = []
        self.lm_call: tuple | None = None
        self._handles: list = []

    def __enter__(self):
        lm = language_model(self.model)
        self.layers = [None] * len(lm.layers)

        def layer_hook(i, module, args, kwargs, output):
            cache = kwargs["past_key_values"]
            kw = {k: v for k, v in kwargs.items() if k != "past_key_values"}
            self.layers[i] = (args, kw, output, cache.layers[i].keys, cache.layers[i].values)

        def lm_hook(module, args, kwargs, output):
            self.lm_call = (args, {k: v for k, v in kwargs.items() if k != "past_key_values"}, output)

        for i, layer in enumerate(lm.layers):
            self._handles.append(
                layer.self_attn.register_forward_hook(functools.partial(layer_hook, i), with_kwargs=True)
            )
        self._handles.append(lm.register_forward_hook(lm_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False

    def uncompressed_cache(self) -> DynamicCache:
        """A new cache holding copies of the recorded prefill's keys and values, as the prefill left it."""
        cache = DynamicCache()
        for i, (_, _, _, keys, values) in enumerate(self.layers):
            cache.update(keys, values, i)  # copies
        return cache


@contextlib.contextmanager
def _standing_in(module, forward) -> Iterator[None]:
    """Inside the block, calling ``module`` runs ``forward`` instead of its computation (its hooks still run)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward  # the class's forward again


def _replayed_output(module, recorded, output, name: str):
    """Raise unless ``module``'s hooks left the recorded output (the prefill would no longer be the shared one)."""
    if output is not recorded:
        raise ValueError(
            f"a forward hook on {name} changed its output: the press changes the prefill, so it cannot share one "
            "(run it with python -m evaluation.run)"
        )
    return output


def replay_prefill(model, press, capture: PrefillCapture):
    """Build ``press``'s compressed cache from a captured uncompressed prefill.

    Inside ``with press(model)`` the language model is called with its recorded inputs and a fresh
    ``DynamicCache``, its ``forward`` standing in for the computation: per layer ``i`` the attention module is
    called with its recorded inputs, its ``forward`` writing the layer's recorded keys and values to the cache
    (``cache.update``, as the attention forward does) and returning the recorded output. So every hook of the
    language model and the attention modules runs as in the prefill (``nn.Module.__call__``); decoder layers
    and whatever a press hooks there are not called (such a press changes the prefill and cannot share one, a
    capability). Decode-time state a press leaves belongs to the new cache.

    Args:
        model: the causal LM the capture was taken on.
        press: a press accepted by :func:`check_shareable`, or None (the uncompressed cache).
        capture: a filled :class:`PrefillCapture`.

    Returns:
        The press's cache, as the pipeline's prefill would have left it.

    Raises:
        ValueError: for a press that cannot share a prefill, a press that reads attention weights (H2O) on a
            capture without them (not eager), or a hook that changes an attention module's input or output.
    """
    check_shareable(press)
    if capabilities(press).needs_eager and any(layer[2][1] is None for layer in capture.layers):
        raise ValueError(
            f"press {type(press).__name__} reads attention weights, and the captured prefill has none: "
            "run the shared prefill on eager attention (attn_implementation='eager')"
        )
    lm = language_model(model)
    cache = DynamicCache()
    lm_args, lm_kwargs, lm_output = capture.lm_call

    def layer_forward(i, args, kwargs, recorded):
        def forward(*call_args, **call_kwargs):
            moved = len(call_args) != len(args) or any(a is not b for a, b in zip(call_args, args))
            if moved or call_kwargs.get("hidden_states") is not kwargs.get("hidden_states"):
                raise ValueError(
                    f"press {type(press).__name__} changes the input of layer {i}'s attention: it changes the "
                    "prefill and cannot share one (run it with python -m evaluation.run)"
                )
            keys, values = capture.layers[i][3], capture.layers[i][4]
            cache.update(keys, values, i)  # what the attention forward does with the layer's new keys and values
            return recorded

        return forward

    def lm_forward(*args, **kwargs):
        for i, layer in enumerate(lm.layers):
            args_i, kwargs_i, recorded = capture.layers[i][:3]
            with _standing_in(layer.self_attn, layer_forward(i, args_i, kwargs_i, recorded)):
                out = layer.self_attn(*args_i, **{**kwargs_i, "past_key_values": cache})
            _replayed_output(layer.self_attn, recorded, out, f"layer {i} attention")
        return lm_output

    with press(model) if press is not None else contextlib.nullcontext(), _standing_in(lm, lm_forward):
        out = lm(*lm_args, **{**lm_kwargs, "past_key_values": cache})
    _replayed_output(lm, lm_output, out, "the language model")
    return cache


def greedy_step(model, cache, input_ids: torch.Tensor, position: int) -> torch.Tensor:
    """One greedy decoding step, the harness's only one (the batched decode here, the speed benchmark's timed decode).

    Args:
        model: the causal LM.
        cache: the cache the step reads and extends (its batch rows are ``input_ids``' rows).
        input_ids: ``(B, n)`` tokens fed at positions ``position .. position + n - 1`` (RoPE positions continue the
            uncompressed context, as kvpress's pipeline does).
        position: the first token's position.

    Returns:
        ``(B,)`` the argmax of each row's last logits.
    """
    B, n = input_ids.shape
    position_ids = torch.arange(position, position + n, device=model.device).unsqueeze(0).expand(B, -1)
    outputs = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    return outputs.logits[:, -1].argmax(-1)


def generate_answers(
    pipe, question_ids, caches: list, context_length: int, max_new_tokens: int, states: list | None = None
) -> list[str]:
    """Greedy answers for several caches of equal per-layer lengths in one batch.

    The batched form of ``KVPressTextGenerationPipeline.generate_answer`` (question forward at positions
    ``context_length ...``, then greedy decoding until EOS or ``max_new_tokens``), one row per cache; a
    row's answer stops at its first EOS after the first token (the pipeline never tests the first one), and a
    row that stops leaves the batch (its cache rows and decode-time bias rows are dropped), so a batch costs
    the tokens its rows generate, not ``max_new_tokens`` per row. One cache is decoded by the pipeline's own
    method. Rows of a batch see no padding (or padding that :func:`pad_to_common_lengths` masked to zero
    attention), so each row computes what it would alone, up to floating-point rounding of batched matrix
    products.

    Args:
        pipe: the harness's pipeline (model and tokenizer).
        question_ids: ``(1, q)`` the question's token ids.
        caches: one cache per run, equal per-layer lengths.
        context_length: ``T``, the uncompressed context length (RoPE positions continue there).
        max_new_tokens: the most tokens generated per row.
        states: per cache, its decode-time state (one :class:`presses.attention_bias.AttentionBias` or None per
            layer, a press's exported state, padded by :func:`pad_to_common_lengths`), or None for none.

    Raises:
        ValueError: if the caches' per-layer lengths differ.
    """
    if len(caches) == 1:
        if states is not None:
            attention.put_decode_state(caches[0], states)
        lengths = [caches[0].get_seq_length(i) for i in range(len(caches[0]))]
        answer = pipe.generate_answer(
            question_ids=question_ids, cache=caches[0], context_length=context_length, max_new_tokens=max_new_tokens
        )
        pipe._remove_answer_from_cache(caches[0], lengths)  # as the pipeline does: the cache holds the context
        return [answer]
    lengths = {tuple(c.get_seq_length(i) for i in range(len(c))) for c in caches}
    if len(lengths) != 1:
        raise ValueError(f"batched decoding needs equal per-layer cache lengths, got {sorted(lengths)}")
    model, n = pipe.model, len(caches)
    cache = DynamicCache()
    for i in range(len(caches[0])):
        cache.update(torch.cat([c.layers[i].keys for c in caches]), torch.cat([c.layers[i].values for c in caches]), i)
    if states is not None:
        attention.put_decode_state(cache, states)  # row k of the batch is run k
    last = greedy_step(model, cache, question_ids.expand(n, -1), context_length)
    position = context_length + question_ids.shape[1]
    stop = getattr(pipe, "stop_token_ids", None) or stop_token_ids(model, pipe.tokenizer)  # every token ending a turn
    stop = torch.tensor(stop, device=model.device)
    tokens = [[token] for token in last.tolist()]  # the first token is never a stop
    active = torch.arange(n, device=model.device)  # rows still decoding; finished rows leave the batch
    for i in range(max_new_tokens - 1):
        last = greedy_step(model, cache, last.unsqueeze(1), position + i)
        for row, token in zip(active.tolist(), last.tolist()):
            tokens[row].append(token)
        going = ~torch.isin(last, stop)
        if not bool(going.all()):
            if not bool(going.any()):
                break
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)  # the rows of the keys, values and decode-time biases (presses.attention)
            active, last = active[keep], last[keep]
    return [str(pipe.tokenizer.decode(row, skip_special_tokens=True)) for row in tokens]


def pad_to_common_lengths(caches: list, states_per_run: list) -> tuple[list, list]:
    """Pad the caches of several runs to common per-layer lengths so that they decode as one batch.

    Layer ``i`` of every cache is padded at its end with zero keys and values to ``P_i``, the longest
    length of that layer among the runs. The padded slots are masked with a ``-inf`` logit bias carried by a
    :class:`presses.attention_bias.AttentionBias` (the bias attention wrapper turns it into the attention
    mask), so they get exactly zero attention weight; a run's own decode-time bias is kept on its real slots and a
    run without one gets ``0`` there. Layers where no run is padded and no run has a bias get none.
    Keys carry their RoPE positions already, so where the padding sits does not matter to the real slots.

    Args:
        caches: one ``DynamicCache`` per run (keys/values ``(1, G, L_i, d)`` per layer), not modified.
        states_per_run: per run, one bias state or ``None`` per layer (a press's exported decode state).

    Returns:
        ``(caches, states_per_run)``: the inputs themselves when every layer already has equal lengths,
        else new padded caches (``(1, G, P_i, d)``) and states (bias ``(1, G, P_i)`` float32).

    Raises:
        ValueError: if a run's bias state does not cover exactly its cache at some layer.
    """
    n_layers = len(caches[0])
    lengths = [[c.get_seq_length(i) for i in range(n_layers)] for c in caches]
    for k, states in enumerate(states_per_run):
        for i, state in enumerate(states):
            if state is not None and state.prefix_len != lengths[k][i]:
                raise ValueError(
                    f"run {k}, layer {i}: bias state covers {state.prefix_len} slots but the cache "
                    f"holds {lengths[k][i]}"
                )
    if all(row == lengths[0] for row in lengths):
        return caches, states_per_run
    padded = [DynamicCache() for _ in caches]
    padded_states = [[None] * n_layers for _ in caches]
    for i in range(n_layers):
        longest = max(row[i] for row in lengths)
        masked = any(row[i] < longest for row in lengths) or any(states[i] is not None for states in states_per_run)
        for k, cache in enumerate(caches):
            keys, values, extra = cache.layers[i].keys, cache.layers[i].values, longest - lengths[k][i]
            padded[k].update(F.pad(keys, (0, 0, 0, extra)), F.pad(values, (0, 0, 0, extra)), i)
            if masked:
                state = states_per_run[k][i]
                bias = state.bias if state is not None else torch.zeros(keys.shape[:3], device=keys.device)
                padded_states[k][i] = AttentionBias(F.pad(bias.float(), (0, extra), value=float("-inf")))
    return padded, [tuple(states) for states in padded_states]


def round_robin_by_task(examples: list) -> list:
    """Reorder examples so that tasks take turns: the first example of every task, then the second, ...

    A sweep stopped part-way then holds a few examples of every task rather than all examples of the
    first tasks. Only the order changes: which examples run, and their rows, are the same.

    Args:
        examples: harness examples with a ``task`` attribute (``None`` counts as one task).

    Returns:
        The same examples, each task's in their original order.
    """
    by_task: dict = {}
    for ex in examples:
        by_task.setdefault(ex.task, []).append(ex)
    queues = list(by_task.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
