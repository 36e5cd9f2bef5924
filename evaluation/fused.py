"""Shared-prefill sweep: one uncompressed prefill per example feeds every press of a sweep.

Usage::

    python -m evaluation.fused dataset=needle presses=[no_press,snapkv,page_entrokv] ratios=[0.5,0.75]

Why this is exact. A kvpress press that compresses in its forward hooks (``BasePress.forward_hook``)
replaces the layer's cache entries *after* the attention output is computed; the hidden states of the
prefill are those of the uncompressed model, and layer ``i``'s hook reads only layer ``i``'s keys and
values. So one uncompressed prefill, with the inputs every hook saw recorded (the layer's ``hidden_states``,
``position_embeddings``, ``cache_position`` and attention output), lets each press's hooks be called again
afterwards, in the forward's order, on a fresh cache that receives the same keys and values layer by layer.
Each press then decodes from its own cache exactly as ``KVPressTextGenerationPipeline`` does (question
forward, greedy decode). ``tests/test_fused.py`` checks that predictions and caches equal those of
``python -m evaluation.run`` press by press. (The probabilistic-eviction presses are equal to float32 round-off,
with the same kept entries: under ``evaluation.run`` their prefill's attention computes the proposal
(:mod:`presses.prefill_attention`), while a replay has only the uncompressed prefill and recomputes it.)

Only presses that act through forward hooks on the language model and its attention modules, and leave
the attention output unchanged, can share a prefill: kvpress's scorer presses (not ObservedAttention,
which needs eager attention weights), ``PageEntroKVPress`` and ``ProbabilisticEvictionPress``.
EntroPrefill changes the prefill itself and PyramidKV is rejected by the harness's guard; they raise here.

Decoding: runs of one example whose caches have equal per-layer lengths (kvpress's scorer presses at one
ratio keep ``int(T (1 - r))`` entries per layer) are decoded as one batch (``batch_decode=true``, the
default); rows see no padding, so a row computes what it would alone up to the rounding of batched matrix
products. With ``pad_decode=true`` (the default) all runs of one compression ratio decode as one batch:
each layer's caches are padded at their end to the layer's longest one, and the padded slots get a
``-inf`` logit bias through the SNIS attention wrapper (:func:`pad_to_common_lengths`), so they get
exactly zero attention and a row again computes what it would alone up to rounding. On the embedded model, batched predictions equal the single-run predictions committed under
``results/needle`` (checked on 10 rows, 5 presses x 2 examples). The SNIS correction lives on the
attention modules: it is taken off after each replay (:func:`take_snis_states`) and
the batch's corrections are stacked row by row for its decode (:func:`install_snis_states`), so SNIS runs of
equal per-layer lengths (e.g. corrected and uncorrected at one ratio, which keep the same entries) decode as
one batch too. ``batch_decode=false`` decodes every run alone.

Each (press, ratio) writes the same run directory, ``config.yaml``, ``predictions.jsonl`` and
``metrics.json`` as ``python -m evaluation.run`` (so ``make report`` reads both), and resumes the same
way: an example is prefilled only if some run still lacks its row. A row's ``seconds`` is the shared
prefill plus that press's hook replay plus its share of the (batched) decode; ``prefill_seconds`` gives
the shared part and ``decode_batch`` the batch size. Within one example the probabilistic-eviction presses
share their proposals (:func:`presses.proposals.shared_proposals`): a proposal is computed by the first run
that needs it, so that run's ``seconds`` carries it and the later runs' do not.
"""

from __future__ import annotations

import functools
import logging
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from evaluation import run as harness
from evaluation.guards import check_press_input

logger = logging.getLogger("evaluation.fused")

__all__ = ["PrefillCapture", "replay_prefill", "shared_prefill_presses", "run_fused", "take_snis_states",
           "install_snis_states"]


def shared_prefill_presses():
    """The press classes whose prefill can be shared (see the module docstring)."""
    from kvpress import ObservedAttentionPress, ScorerPress

    from presses.page_entrokv import PageEntroKVPress
    from presses.snis_press import ProbabilisticEvictionPress

    return (ScorerPress, PageEntroKVPress, ProbabilisticEvictionPress), (ObservedAttentionPress,)


def check_shareable(press, name: str = "") -> None:
    """Raise unless ``press`` (None = no press) can be evaluated from a shared prefill.

    Raises:
        ValueError: naming the press and what to use instead.
    """
    if press is None:
        return
    allowed, excluded = shared_prefill_presses()
    if not isinstance(press, allowed) or isinstance(press, excluded):
        raise ValueError(f"press {name or type(press).__name__} ({type(press).__name__}) cannot share a prefill: "
                         f"only {', '.join(c.__name__ for c in allowed)} (not ObservedAttentionPress) compress "
                         "in forward hooks without changing the prefill; run it with python -m evaluation.run")


def _language_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


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
        lm = _language_model(self.model)
        self.layers = [None] * len(lm.layers)

        def layer_hook(i, module, args, kwargs, output):
            cache = kwargs["past_key_values"]
            kw = {k: v for k, v in kwargs.items() if k != "past_key_values"}
            self.layers[i] = (args, kw, output, cache.layers[i].keys, cache.layers[i].values)

        def lm_hook(module, args, kwargs, output):
            self.lm_call = (args, {k: v for k, v in kwargs.items() if k != "past_key_values"}, output)

        for i, layer in enumerate(lm.layers):
            self._handles.append(layer.self_attn.register_forward_hook(functools.partial(layer_hook, i),
                                                                       with_kwargs=True))
        self._handles.append(lm.register_forward_hook(lm_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


def _pre_hooks(module, args, kwargs):
    """Call ``module``'s forward pre-hooks as ``nn.Module.__call__`` does; return ``(args, kwargs)``."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _post_hooks(module, args, kwargs, output, name: str):
    """Call ``module``'s forward hooks as ``nn.Module.__call__`` does.

    Raises:
        ValueError: if a hook replaces the output (the prefill would no longer be the shared one).
    """
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None and result is not output:
            raise ValueError(f"a forward hook on {name} changed its output: the press changes the prefill, "
                             "so it cannot share one (run it with python -m evaluation.run)")
    return output


def replay_prefill(model, press, capture: PrefillCapture):
    """Build ``press``'s compressed cache from a captured uncompressed prefill.

    Inside ``with press(model)``: the language model's pre-hooks, then per layer ``i`` the layer's keys
    and values are written to a fresh ``DynamicCache`` (``cache.update``, as the attention forward does)
    and the attention module's forward hooks are called with the recorded inputs and output; then the
    language model's forward hooks. Attention wrappers keep per-module state (the SNIS correction), which
    a real prefill resets; it is reset here too.

    Args:
        model: the causal LM the capture was taken on.
        press: a press accepted by :func:`check_shareable`, or None (the uncompressed cache).
        capture: a filled :class:`PrefillCapture`.

    Returns:
        The press's cache, as the pipeline's prefill would have left it.

    Raises:
        ValueError: for a press that cannot share a prefill, or hooks outside the attention modules and
            the language model.
    """
    import contextlib

    from transformers import DynamicCache

    from presses.snis_attention import clear_snis_state

    check_shareable(press)
    lm = _language_model(model)
    cache = DynamicCache()
    clear_snis_state(model)  # what the SNIS attention wrapper does at every new prefill
    with press(model) if press is not None else contextlib.nullcontext():
        for i, layer in enumerate(lm.layers):
            if layer._forward_pre_hooks or layer._forward_hooks or layer.self_attn._forward_pre_hooks:
                raise ValueError(f"press {type(press).__name__} hooks decoder layer {i} or its attention's input: "
                                 "it changes the prefill and cannot share one (run it with python -m evaluation.run)")
        lm_args, lm_kwargs, lm_output = capture.lm_call
        _, lm_kwargs = _pre_hooks(lm, lm_args, {**lm_kwargs, "past_key_values": cache})
        for i, layer in enumerate(lm.layers):
            args, kwargs, output, keys, values = capture.layers[i]
            cache.update(keys, values, i)
            _post_hooks(layer.self_attn, args, {**kwargs, "past_key_values": cache}, output, f"layer {i} attention")
        _post_hooks(lm, lm_args, {**lm_kwargs, "past_key_values": cache}, lm_output, "the language model")
    return cache


def generate_answers(pipe, question_ids, caches: list, context_length: int, max_new_tokens: int) -> list[str]:
    """Greedy answers for several caches of equal per-layer lengths in one batch.

    The batched form of ``KVPressTextGenerationPipeline.generate_answer`` (question forward at positions
    ``context_length ...``, then greedy decoding until EOS or ``max_new_tokens``), one row per cache; a
    row's answer stops at its first EOS after the first token (the pipeline never tests the first one).
    One cache is decoded by the pipeline's own method. Rows of a batch see no padding (or padding that
    :func:`pad_to_common_lengths` masked to zero attention), so each row computes what it would alone, up
    to floating-point rounding of batched matrix products.

    Raises:
        ValueError: if the caches' per-layer lengths differ.
    """
    import torch
    from transformers import DynamicCache

    if len(caches) == 1:
        lengths = [caches[0].get_seq_length(i) for i in range(len(caches[0]))]
        answer = pipe.generate_answer(question_ids=question_ids, cache=caches[0], context_length=context_length,
                                      max_new_tokens=max_new_tokens)
        pipe._remove_answer_from_cache(caches[0], lengths)  # as the pipeline does: the cache holds the context
        return [answer]
    lengths = {tuple(c.get_seq_length(i) for i in range(len(c))) for c in caches}
    if len(lengths) != 1:
        raise ValueError(f"batched decoding needs equal per-layer cache lengths, got {sorted(lengths)}")
    model, n = pipe.model, len(caches)
    cache = DynamicCache()
    for i in range(len(caches[0])):
        cache.update(torch.cat([c.layers[i].keys for c in caches]), torch.cat([c.layers[i].values for c in caches]), i)
    position_ids = torch.arange(context_length, context_length + question_ids.shape[1],
                                device=model.device).unsqueeze(0).expand(n, -1)
    outputs = model(input_ids=question_ids.expand(n, -1), past_key_values=cache, position_ids=position_ids,
                    logits_to_keep=1)
    position_ids = position_ids[:, -1:] + 1
    generated = [outputs.logits[:, -1].argmax(-1)]
    stop = model.generation_config.eos_token_id
    stop = torch.tensor(stop if isinstance(stop, list) else [stop], device=model.device)
    done = torch.zeros_like(generated[0], dtype=torch.bool)  # as generate_answer: the first token is never a stop
    for i in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        outputs = model(input_ids=generated[-1].unsqueeze(1), past_key_values=cache, position_ids=position_ids + i)
        generated.append(outputs.logits[:, -1].argmax(-1))
        done = done | torch.isin(generated[-1], stop)
    tokens = torch.stack(generated, dim=1)  # (n, steps)
    answers = []
    for row in tokens:
        hits = torch.isin(row[1:], stop).nonzero()
        end = int(hits[0]) + 2 if len(hits) else len(row)
        answers.append(str(pipe.tokenizer.decode(row[:end], skip_special_tokens=True)))
    return answers


def take_snis_states(model) -> tuple:
    """Detach the SNIS correction a replay left on ``model``'s attention modules.

    Returns:
        One entry per decoder layer: its :class:`presses.snis_attention.SNISLayerState` (bias ``(B, G, P)``)
        or ``None``. The modules are cleared, so the next replay starts clean.
    """
    from presses.snis_attention import clear_snis_state

    states = tuple(getattr(layer.self_attn, "_snis_state", None) for layer in _language_model(model).layers)
    clear_snis_state(model)
    return states


def install_snis_states(model, states_per_run: list) -> None:
    """Put the SNIS corrections of the runs of one decode batch back on ``model``'s attention modules.

    Layer ``i`` gets the batch-wise concatenation of the runs' biases (row ``k`` of the batch is run ``k``),
    which :func:`presses.snis_attention.snis_mask` applies per row; a layer without a state in every run
    gets none.

    Raises:
        ValueError: if some but not all runs have a state at a layer, or their padded lengths ``P`` differ.
    """
    import torch

    from presses.snis_attention import SNISLayerState, install_snis_attention

    if any(state is not None for states in states_per_run for state in states):
        install_snis_attention()  # the states act through the wrapper (padding masks need it without SNIS presses)
    for i, layer in enumerate(_language_model(model).layers):
        layer_states = [states[i] for states in states_per_run]
        present = [s is not None for s in layer_states]
        if not any(present):
            layer.self_attn._snis_state = None
            continue
        if not all(present) or len({s.prefix_len for s in layer_states}) != 1:
            raise ValueError(f"layer {i}: runs decoded in one batch need SNIS states of equal padded length "
                             f"(present={present})")
        layer.self_attn._snis_state = SNISLayerState(torch.cat([s.bias for s in layer_states], dim=0))


def pad_to_common_lengths(caches: list, states_per_run: list) -> tuple[list, list]:
    """Pad the caches of several runs to common per-layer lengths so that they decode as one batch.

    Layer ``i`` of every cache is padded at its end with zero keys and values to ``P_i``, the longest
    length of that layer among the runs. The padded slots are masked with a ``-inf`` logit bias carried by a
    :class:`presses.snis_attention.SNISLayerState` (the SNIS attention wrapper turns it into the attention
    mask), so they get exactly zero attention weight; a run's own SNIS bias is kept on its real slots and a
    run without one gets ``0`` there. Layers where no run is padded and no run has an SNIS state get none.
    Keys carry their RoPE positions already, so where the padding sits does not matter to the real slots.

    Args:
        caches: one ``DynamicCache`` per run (keys/values ``(1, G, L_i, d)`` per layer), not modified.
        states_per_run: per run, one SNIS state or ``None`` per layer (:func:`take_snis_states`).

    Returns:
        ``(caches, states_per_run)``: the inputs themselves when every layer already has equal lengths,
        else new padded caches (``(1, G, P_i, d)``) and states (bias ``(1, G, P_i)`` float32).

    Raises:
        ValueError: if a run's SNIS state does not cover exactly its cache at some layer.
    """
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    from presses.snis_attention import SNISLayerState

    n_layers = len(caches[0])
    lengths = [[c.get_seq_length(i) for i in range(n_layers)] for c in caches]
    for k, states in enumerate(states_per_run):
        for i, state in enumerate(states):
            if state is not None and state.prefix_len != lengths[k][i]:
                raise ValueError(f"run {k}, layer {i}: SNIS state covers {state.prefix_len} slots but the cache "
                                 f"holds {lengths[k][i]}")
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
                padded_states[k][i] = SNISLayerState(F.pad(bias.float(), (0, extra), value=float("-inf")))
    return padded, [tuple(states) for states in padded_states]


def _decode_and_write(group: list, pipe, question_ids, T: int, max_new: int, ex, dataset, model,
                      prefill_seconds: float) -> None:
    """Decode a group of replayed runs (one batch, padded to common per-layer lengths where they differ,
    their SNIS corrections stacked) and append each run's prediction row (with its own, unpadded cache)."""
    import torch

    from presses.snis_attention import clear_snis_state

    start = time.perf_counter()
    caches, states = pad_to_common_lengths([item[1] for item in group], [item[3] for item in group])
    install_snis_states(model, states)
    try:
        with torch.inference_mode():
            predictions = generate_answers(pipe, question_ids.to(model.device), caches, T, max_new)
    finally:
        clear_snis_state(model)
    decode_s = (time.perf_counter() - start) / len(group)
    for ((_, _, names, out, press), cache, replay_s, _), prediction in zip(group, predictions):
        seconds = prefill_seconds + replay_s + decode_s
        row = harness.prediction_row(ex, names, dataset, prediction, cache, model, T, seconds, press,
                                     prefill_seconds=prefill_seconds, shared_prefill=True, decode_batch=len(group))
        harness.append_row(out / "predictions.jsonl", row)


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


def run_fused(cfgs: list[tuple[DictConfig, dict[str, str]]], command: str, batch_decode: bool = True,
              pad_decode: bool = True) -> list[dict]:
    """Run several (press, ratio) configs of ONE model and dataset from shared prefills.

    Args:
        cfgs: ``(cfg, names)`` per run, each as ``python -m evaluation.run`` would compose it; all must
            agree on model, dataset, seed, n_samples, shard, query_aware, device and max_new_tokens.
        command: the command recorded in each ``metrics.json``.
        batch_decode: decode the runs of an example whose caches have equal per-layer lengths in one batch
            (:func:`generate_answers`); SNIS runs batch with SNIS runs of the same padded lengths, their
            corrections stacked per row (:func:`install_snis_states`).
        pad_decode: with ``batch_decode``, decode all runs of one compression ratio as one batch, their
            caches padded to common per-layer lengths with the padding masked (:func:`pad_to_common_lengths`);
            default True, as in ``configs/fused.yaml``.

    Returns:
        The metrics of every run, in ``cfgs`` order.

    Raises:
        ValueError: for runs that disagree on the shared settings, query-aware runs (the question is part
            of the compressed context there, which the pipeline's prefill flow does not cover), or a press
            that cannot share a prefill.
    """
    import torch
    from hydra.utils import instantiate
    from kvpress import KVPressTextGenerationPipeline
    from tqdm import tqdm
    from transformers import DynamicCache

    from presses.proposals import shared_proposals

    shared_keys = ("model", "dataset", "seed", "n_samples", "shard", "query_aware", "device", "max_new_tokens")
    first = cfgs[0][0]
    for cfg, names in cfgs[1:]:
        for key in shared_keys:
            if cfg.get(key) != first.get(key):
                raise ValueError(f"fused runs must share {key}: {names['press']} has {cfg.get(key)!r}, "
                                 f"{cfgs[0][1]['press']} has {first.get(key)!r}")
    if first.query_aware:
        raise ValueError("query_aware=true is not supported by the shared-prefill sweep; use python -m evaluation.run")

    runs = []  # (index in cfgs, cfg, names, out, press)
    metrics: dict[int, dict] = {}
    for k, (cfg, names) in enumerate(cfgs):
        out, done = harness.start_run(cfg, names)
        if done is not None:
            metrics[k] = done
            continue
        press = instantiate(cfg.press) if cfg.press.get("_target_") else None
        check_shareable(press, names["press"])
        runs.append((k, cfg, names, out, press))
    if not runs:
        return [metrics[k] for k in range(len(cfgs))]

    dataset = instantiate(first.dataset)
    model, tokenizer = harness.get_model(first.model, first.device, first.model.get("attn_implementation", "sdpa"))
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device(first.device))
    examples = harness.run_examples(first, dataset, tokenizer)
    done_ids = {k: {r["id"] for r in harness.read_predictions(out / "predictions.jsonl")}
                for k, _, _, out, _ in runs}
    todo = round_robin_by_task([e for e in examples if any(e.id not in done_ids[k] for k, *_ in runs)])
    logger.info("%d runs x %d examples; %d examples still needed by some run", len(runs), len(examples), len(todo))
    torch.manual_seed(first.seed)
    for ex in tqdm(todo, desc="shared prefill", dynamic_ncols=True):
        max_new = first.max_new_tokens or ex.max_new_tokens or 32
        with harness.chat_template(tokenizer, ex.metadata.get("chat_template", True)):
            inputs = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
        context_ids, question_ids = inputs["context_ids"].to(model.device), inputs["questions_ids"][0]
        T = int(context_ids.shape[1])
        pending = [run for run in runs if ex.id not in done_ids[run[0]]]
        for _, _, _, _, press in pending:
            check_press_input(press, model, T, multi_token_forward=True)
        start = time.perf_counter()
        with torch.inference_mode(), PrefillCapture(model) as capture:
            model.model(input_ids=context_ids, past_key_values=DynamicCache())
        prefill_seconds = time.perf_counter() - start
        replayed = []  # (run, cache, replay seconds, SNIS states per layer)
        with shared_proposals():  # presses differing only in ratio / correction / seed compute a proposal once
            for run in pending:
                start = time.perf_counter()
                with torch.inference_mode():
                    cache = replay_prefill(model, run[4], capture)
                # the SNIS correction lives on the attention modules: keep it with the run until its decode
                replayed.append((run, cache, time.perf_counter() - start, take_snis_states(model)))
                if not batch_decode:
                    _decode_and_write([replayed.pop()], pipe, question_ids, T, max_new, ex, dataset, model,
                                      prefill_seconds)
        groups: dict = {}
        for item in replayed:  # one ratio (padded) or equal per-layer cache lengths (and SNIS layers): one batch
            key = (item[0][1].compression_ratio if pad_decode else
                   (tuple(item[1].get_seq_length(i) for i in range(len(item[1]))),
                    tuple(state is not None for state in item[3])))
            groups.setdefault(key, []).append(item)
        for group in groups.values():
            _decode_and_write(group, pipe, question_ids, T, max_new, ex, dataset, model, prefill_seconds)
        del capture
    for k, cfg, names, out, _ in runs:
        metrics[k] = harness.finish_run(out, examples, names, cfg, command)
    return [metrics[k] for k in range(len(cfgs))]


def compose_runs(cfg: DictConfig, overrides: list[str]) -> list[tuple[DictConfig, dict[str, str]]]:
    """Compose one harness config per (press, ratio) of ``cfg.presses`` x ``cfg.ratios`` (``no_press``
    once), with the user's other ``overrides``, as ``python -m evaluation.run`` would.

    Raises:
        ValueError: for an unknown press name or a ratio outside ``[0, 1)``.
    """
    from hydra import compose

    choices = harness.config_choices("press")
    base = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~") in ("presses", "ratios")]
    runs = []
    for press in cfg.presses:
        if press not in choices:
            raise ValueError(f"unknown press '{press}'; valid: {', '.join(choices)}")
        for ratio in ([0.0] if press == "no_press" else cfg.ratios):
            harness.check_ratio(ratio)
            run_cfg = compose(config_name="config", overrides=[*base, f"press={press}", f"compression_ratio={ratio}"])
            names = {"press": press, "dataset": HydraConfig.get().runtime.choices["dataset"],
                     "model": HydraConfig.get().runtime.choices["model"]}
            runs.append((run_cfg, names))
    return runs


@hydra.main(config_path=str(harness.CONFIG_DIR), config_name="fused", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of the shared-prefill sweep (``configs/fused.yaml``)."""
    overrides = list(HydraConfig.get().overrides.task)
    run_fused(compose_runs(cfg, overrides), harness.command_line("python -m evaluation.fused"), cfg.batch_decode,
              cfg.get("pad_decode", True))


if __name__ == "__main__":
    main()
