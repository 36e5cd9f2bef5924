"""The one per-example loop of the harness, shared by ``python -m evaluation.run`` and ``python -m evaluation.fused``.

:func:`evaluate` takes one or more runs of one model and dataset (each a ``(cfg, names)`` pair as Hydra composes
it) and, before any run directory is created:

1. resolves the inputs (:func:`evaluation.inputs.prepare`: names, ratios, settings, the model's and the data's
   sources; finished runs are skipped), instantiates each press, checks the fields kvpress leaves unchecked
   (:func:`evaluation.registry.press_field_problem`) and reads its capabilities from the registry;
2. loads the model (:func:`evaluation.guards.check_model`), builds the examples, and checks every example against
   the model's positions and every press's limits (:mod:`evaluation.guards`);

then holds the run directories (:func:`evaluation.harness.claim_runs`: one process per directory, settings
checked and written before any row) and for every example some run still lacks:

3. tokenises it (kvpress's ``preprocess`` through :class:`evaluation.pipeline.TextGenerationPipeline`; the chat
   template is dropped where the dataset says so; a template's thinking switch gets ``model.enable_thinking``, on
   this path and on the pipeline's alike);
4. produces each pending run's prediction:

   - ``shared_prefill=False`` (``evaluation.run``): each run through kvpress's pipeline, as a user would;
   - ``shared_prefill=True`` (``evaluation.fused``): one uncompressed prefill, each press's hooks replayed on it
     (:func:`evaluation.replay.replay_prefill`), then the runs decoded in batches
     (:func:`evaluation.replay.generate_answers`), presses with decode-time state exporting it after their
     replay (the press contract, :mod:`presses.base`); presses with ``scores_once`` scored by
     :mod:`evaluation.kvzip_path` and decoded one by one. Runs are replayed batch by batch, just before their decode,
     and their caches freed after it: with ``pad_decode`` (the default) one ratio's runs hold caches at a time, for a
     continuation example one run (what the runs share, the prefill's recording and the memo, stays for the example);
   - an example with a ``continuation`` (:class:`evaluation.datasets.base.Example`) generates nothing: the
     continuation is teacher-forced on each run's cache and scored by its loss against the uncompressed context's
     (:func:`evaluation.continuation.run_row`, :func:`evaluation.continuation.shared_rows`);

5. appends one row per run (:func:`evaluation.harness.prediction_row`), then writes ``metrics.json``.

What a press can do is read from the registry (:mod:`evaluation.registry`), never from its class or name.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from tqdm import tqdm
from transformers import DynamicCache

from evaluation import continuation, guards, harness, inputs, kvzip_path, prompt_delimiter, shared
from evaluation.memo import ReplayMemo
from evaluation.pipeline import TextGenerationPipeline
from evaluation.registry import (
    capabilities,
    export_decode_state,
    held_press_problem,
    press_field_problem,
    run_ratio_problem,
    sharing,
)
from evaluation.replay import (
    PrefillCapture,
    check_capture_memory,
    check_shareable,
    generate_answers,
    pad_to_common_lengths,
    replay_prefill,
    round_robin_by_task,
)
from evaluation.shared import Protocol
from presses import attention
from presses.base import Capabilities
from presses.kernels.process_cache import use_process_cache

logger = logging.getLogger("evaluation.loop")

__all__ = ["SHARED_KEYS", "Run", "evaluate", "tokenise"]

#: Settings every run of one :func:`evaluate` call must share (one model, one dataset, one example list).
SHARED_KEYS = inputs.SHARED_KEYS


@dataclass
class Run:
    """One run of an :func:`evaluate` call: its index in the call, config, names, directory and press."""

    index: int
    cfg: DictConfig
    names: dict
    out: object
    press: object
    caps: Capabilities


def _held_config_problem(press_cfg: DictConfig) -> str | None:
    """:func:`evaluation.registry.held_press_problem` from a wrapper's config, for a wrapper whose construction
    asserted (one of kvpress's asserts the held press's class without a message): the held press built alone."""
    held = press_cfg.get("press")
    if not isinstance(held, DictConfig) or not held.get("_target_"):
        return None
    return held_press_problem(get_class(press_cfg._target_), "press", instantiate(held))  # hydra built it already


def _runs(cfgs: list, pending: list[int], shared_prefill: bool) -> list[Run]:
    """The pending runs with their presses instantiated and their capabilities checked (nothing written)."""
    runs = []
    for k in pending:
        cfg, names = cfgs[k]
        try:
            press = instantiate(cfg.press) if cfg.press.get("_target_") else None
        except InstantiationException as err:  # kvpress checks its parameters with assert
            if not isinstance(err.__cause__, AssertionError):
                raise
            why = _held_config_problem(cfg.press) or str(err.__cause__) or "kvpress's assertion failed (no message)"
            raise ValueError(f"press {names['press']} ({cfg.press._target_}): {why}") from err
        caps = capabilities(press)
        problem = press_field_problem(press) or run_ratio_problem(press, cfg.compression_ratio)  # no model needed
        if problem:
            raise ValueError(f"press {names['press']}: {problem}")
        if shared_prefill and not caps.scores_once:  # scored once per example instead (evaluation.kvzip_path)
            check_shareable(press, names["press"])
        if caps.needs_question and not cfg.query_aware:
            raise ValueError(
                f"press {names['press']} needs the question inside the compressed context: set query_aware=true"
            )
        runs.append(Run(k, cfg, names, None, press, caps))
    return runs


def tokenise(pipe, tokenizer, ex, protocol: Protocol | None = None) -> dict:
    """kvpress's preprocessing of one example (context ids ``(1, T)``, question ids: one, or with the shared-context
    ``protocol`` one per question, :func:`evaluation.shared.tokenise`), with the chat template dropped where the
    dataset says so."""
    with harness.chat_template(tokenizer, ex.metadata.get("chat_template", True)):
        if protocol is not None:
            return shared.tokenise(pipe, ex, protocol)
        return pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))


def _check_inputs(
    examples: list,
    runs: list[Run],
    pipe,
    model,
    tokenizer,
    max_new_tokens,
    eager_capture: bool = False,
    protocol: Protocol | None = None,
) -> dict[str, dict]:
    """Every example against the model's positions and vocabulary and every press's limits, before any directory
    is made (with the shared-context ``protocol``, every question of it:
    :func:`evaluation.guards.check_shared_positions`). Returns each example's :func:`tokenise` output by example id
    (the loop reuses it).

    Raises:
        ValueError: an example id that repeats; with ``eager_capture`` (a shared prefill on eager attention), an
            example whose attention weights would exceed :func:`evaluation.replay.check_capture_memory`'s limit; or
            what :mod:`evaluation.guards` raises.
    """
    tokens = {}
    for ex in examples:
        if ex.id in tokens:  # rows, resume and these tokens are keyed by id
            raise ValueError(f"example id {ex.id!r} appears twice in the dataset; every example needs its own id")
        ids = tokens[ex.id] = tokenise(pipe, tokenizer, ex, protocol)
        T, n_question = int(ids["context_ids"].shape[1]), int(ids["questions_ids"][0].shape[1])
        top = max(int(t.max()) for t in (ids["context_ids"], *ids["questions_ids"]) if t.numel())
        max_new = max_new_tokens or ex.max_new_tokens or 32
        if protocol is not None:
            lengths = [int(q.shape[1]) for q in ids["questions_ids"]]
            guards.check_shared_positions(model, T, lengths, max_new, protocol.turns, ex.id)
        guards.check_model_input(model, T, n_question, max_new, ex.id, top)
        for run in runs:
            guards.check_press_input(run.press, model, T, multi_token_forward=True)  # the question forward follows
        if eager_capture:  # a shared eager prefill records every layer's attention weights
            check_capture_memory(model, T, ex.id)
    return tokens


def seed_example(seed: int, example_id: str) -> None:
    """Seed torch's generator for one run's prefill of one example, in both loops alike.

    A press that draws from torch's generator (kvpress's Compactor and leverage-score sketches, its random scores
    without a seed) then gives the same cache alone, resumed, or replayed from a shared prefill after other presses.
    """
    torch.manual_seed(zlib.crc32(f"{seed}:{example_id}".encode()))


def _pipeline_row(run: Run, ex, pipe, dataset, model, tokenizer, T: int, max_new: int) -> dict:
    """Prefill, compress and decode one example through kvpress's pipeline (what a user runs)."""
    cache = DynamicCache()
    seed_example(run.cfg.seed, ex.id)
    start = time.perf_counter()
    with harness.chat_template(tokenizer, ex.metadata.get("chat_template", True)), torch.inference_mode():
        prediction = pipe(
            ex.context,
            question=ex.question,
            answer_prefix=ex.answer_prefix,
            press=run.press,
            max_new_tokens=max_new,
            cache=cache,
        )["answer"]
    elapsed = time.perf_counter() - start
    return harness.prediction_row(ex, run.names, dataset, prediction, cache, model, T, elapsed, run.press)


def _pipeline_shared_rows(run: Run, ex, pipe, dataset, model, tokenizer, T: int, max_new: int, protocol: Protocol):
    """Prefill and compress one example through kvpress's pipeline, then ask its questions on the compressed cache
    (kvpress's ``questions=[...]``, each answer cut off after it; or, in turn, one chat): one row per question
    (:func:`evaluation.shared.rows`)."""
    questions, prefixes = shared.asked(ex, protocol)
    cache = DynamicCache()
    seed_example(run.cfg.seed, ex.id)
    start = time.perf_counter()
    with harness.chat_template(tokenizer, ex.metadata.get("chat_template", True)), torch.inference_mode():
        answers = pipe(
            ex.context,
            questions=questions,
            answer_prefixes=prefixes,
            turns=protocol.turns,
            press=run.press,
            max_new_tokens=max_new,
            cache=cache,
        )["answers"]
    elapsed = time.perf_counter() - start
    decode = list(pipe.answer_seconds)
    prefill = elapsed - sum(decode)  # the prefill with the press, and the pipeline's pre- and postprocessing
    return [
        (run, row)
        for row in shared.rows(ex, run.names, dataset, answers, decode, cache, model, T, run.press, protocol, prefill)
    ]


def _shared_rows(
    pending: list[Run],
    ex,
    pipe,
    dataset,
    model,
    context_ids,
    question_ids,
    T: int,
    max_new: int,
    batch_decode: bool,
    pad_decode: bool,
    protocol: Protocol | None = None,
) -> list[tuple[Run, dict]]:
    """One uncompressed prefill, every pending press replayed on it, the runs decoded in batches (``question_ids``:
    the question's ids, or with the shared-context ``protocol`` a list of each question's; in a chat, each run
    alone)."""
    start = time.perf_counter()
    with torch.inference_mode(), PrefillCapture(model) as capture:
        model.model(input_ids=context_ids, past_key_values=DynamicCache())
    prefill_seconds = time.perf_counter() - start
    # presses differing only in ratio / correction / seed (SNIS) or ratio / protection (Page-EntroKV) compute their
    # proposals and observer attention once per layer
    memo = ReplayMemo()

    def replayed(runs: list[Run]):
        """``(run, cache, replay seconds, decode state per layer)`` per run, each replayed when it is asked for."""
        for run in runs:
            start = time.perf_counter()
            seed_example(run.cfg.seed, ex.id)
            with torch.inference_mode(), sharing(run.press, memo):
                cache = replay_prefill(model, run.press, capture)
            # decode-time state belongs to the run's cache: keep it with the run until its decode
            state = export_decode_state(run.press, cache)
            yield run, cache, time.perf_counter() - start, state

    def decoded(runs: list[Run]) -> list[tuple[Run, dict]]:
        """Replay ``runs`` and decode them in batches; their caches are freed on return."""
        items = list(replayed(runs))
        if pad_decode or not batch_decode:  # one batch already (one ratio, or one run)
            return _decode_group(items, pipe, question_ids, T, max_new, ex, dataset, model, prefill_seconds, protocol)
        groups: dict = {}  # equal per-layer cache lengths (and bias layers): one batch
        for item in items:
            lengths = tuple(item[1].get_seq_length(i) for i in range(len(item[1])))
            groups.setdefault((lengths, tuple(state is not None for state in item[3])), []).append(item)
        rows = []
        for group in groups.values():
            rows += _decode_group(group, pipe, question_ids, T, max_new, ex, dataset, model, prefill_seconds, protocol)
        return rows

    scored = [run for run in pending if run.caps.scores_once]  # one scoring pass, then each run on its own
    replayable = [run for run in pending if not run.caps.scores_once]
    if ex.continuation:  # nothing to generate: the loss of the text after the context (evaluation.continuation)
        masked = kvzip_path.selected_runs(scored, model, capture, context_ids)
        return continuation.shared_rows(
            replayed(replayable), capture, ex, dataset, model, pipe.tokenizer, T, max_new, prefill_seconds, masked
        )
    rows = []
    # only the runs of one decode batch hold a cache at a time: each run alone, the runs of one ratio (padded), or
    # (batched by equal per-layer lengths, known only after the replays) every run; a chat's runs each alone
    alone = protocol is not None and protocol.turns
    for runs in _decode_batches(replayable, batch_decode and not alone, pad_decode):
        rows += decoded(runs)
    for run, cache, seconds, masks, state in kvzip_path.selected_runs(scored, model, capture, context_ids):
        with kvzip_path.masked_keys(model, masks):
            item = (run, cache, seconds, state)
            rows += _decode_group([item], pipe, question_ids, T, max_new, ex, dataset, model, prefill_seconds, protocol)
    return rows


def _decode_batches(runs: list[Run], batch_decode: bool, pad_decode: bool) -> list[list[Run]]:
    """The runs replayed together, in order: each alone (no ``batch_decode``), the runs of one compression ratio
    (``pad_decode``: one padded batch each), else all of them (batched by their cache lengths after the replays).
    A run's replay depends on nothing but its own press, seed and example (the memo keys what it shares by what
    that depends on), so the order changes no result."""
    if not batch_decode:
        return [[run] for run in runs]
    if not pad_decode:
        return [runs] if runs else []
    by_ratio: dict = {}
    for run in runs:
        by_ratio.setdefault(run.cfg.compression_ratio, []).append(run)
    return list(by_ratio.values())


def _decode_group(
    group: list,
    pipe,
    question_ids,
    T: int,
    max_new: int,
    ex,
    dataset,
    model,
    prefill_seconds: float,
    protocol: Protocol | None = None,
) -> list[tuple[Run, dict]]:
    """Decode replayed runs as one batch (padded to common per-layer lengths where they differ, their decode-time
    biases stacked) and build each run's prediction row (with its own, unpadded cache); with the shared-context
    ``protocol``, :func:`_decode_shared`."""
    if protocol is not None:
        return _decode_shared(group, pipe, question_ids, T, max_new, ex, dataset, model, prefill_seconds, protocol)
    start = time.perf_counter()
    caches, states = pad_to_common_lengths([item[1] for item in group], [item[3] for item in group])
    with torch.inference_mode():
        predictions = generate_answers(pipe, question_ids.to(model.device), caches, T, max_new, states)
    decode_s = (time.perf_counter() - start) / len(group)
    rows = []
    for (run, cache, replay_s, _), prediction in zip(group, predictions):
        seconds = prefill_seconds + replay_s + decode_s
        rows.append(
            (
                run,
                harness.prediction_row(
                    ex,
                    run.names,
                    dataset,
                    prediction,
                    cache,
                    model,
                    T,
                    seconds,
                    run.press,
                    prefill_seconds=prefill_seconds,
                    replay_seconds=replay_s,  # the press's own prefill work (evaluation.frontier.run_costs)
                    shared_prefill=True,
                    decode_batch=len(group),
                ),
            )
        )
    return rows


def _decode_shared(
    group: list,
    pipe,
    questions_ids: list,
    T: int,
    max_new: int,
    ex,
    dataset,
    model,
    prefill_seconds: float,
    protocol: Protocol,
) -> list[tuple[Run, dict]]:
    """The shared-context protocol's decode of replayed runs: multi-request, each question decoded as one batch of the
    runs (padded as :func:`_decode_group`; each batch on new copies of the caches, or one run's cache cut back after
    its answer, as kvpress's pipeline does); a chat, each run alone (``group`` of one) through the pipeline's own
    loop (:meth:`evaluation.pipeline.TextGenerationPipeline.answer_questions`). One row per run and question
    (:func:`evaluation.shared.rows`)."""
    caches, states = pad_to_common_lengths([item[1] for item in group], [item[3] for item in group])
    answers = [[] for _ in group]
    decode = [[] for _ in group]
    if protocol.turns:
        for k, (cache, state) in enumerate(zip(caches, states)):
            attention.put_decode_state(cache, [state])
            with torch.inference_mode():
                answers[k] = pipe.answer_questions(cache, questions_ids, T, max_new, turns=True)
            decode[k] = list(pipe.answer_seconds)
    else:
        for question_ids in questions_ids:
            start = time.perf_counter()
            with torch.inference_mode():
                predictions = generate_answers(pipe, question_ids.to(model.device), caches, T, max_new, states)
            seconds = (time.perf_counter() - start) / len(group)
            for k, prediction in enumerate(predictions):
                answers[k].append(prediction)
                decode[k].append(seconds)
    rows = []
    for (run, cache, replay_s, _), run_answers, run_decode in zip(group, answers, decode):
        for row in shared.rows(
            ex,
            run.names,
            dataset,
            run_answers,
            run_decode,
            cache,
            model,
            T,
            run.press,
            protocol,
            prefill_seconds,
            replay_s,
            shared_prefill=True,
            decode_batch=len(group),
        ):
            rows.append((run, row))
    return rows


def evaluate(
    cfgs: list[tuple[DictConfig, dict[str, str]]],
    command: str,
    shared_prefill: bool = False,
    batch_decode: bool = True,
    pad_decode: bool = True,
    prepared: inputs.Prepared | None = None,
) -> list[dict]:
    """Run (or resume) several runs of ONE model and dataset, example by example (see the module docstring).

    Args:
        cfgs: ``(cfg, names)`` per run, as ``python -m evaluation.run`` composes it; all must agree on
            :data:`SHARED_KEYS`.
        command: the command recorded in each ``metrics.json``.
        shared_prefill: one uncompressed prefill per example, replayed for every press (``evaluation.fused``);
            otherwise every run goes through kvpress's pipeline (``evaluation.run``).
        batch_decode: with ``shared_prefill``, decode the runs of an example whose caches have equal per-layer
            lengths (and decode-time state layers) as one batch.
        pad_decode: with ``batch_decode``, decode all runs of one compression ratio as one batch, their caches
            padded to common per-layer lengths with the padding masked.
        prepared: the inputs :func:`evaluation.inputs.prepare` resolved for ``cfgs`` (default: resolved here).

    Returns:
        The metrics of every run, in ``cfgs`` order.

    Raises:
        ValueError: as :func:`evaluation.inputs.prepare`; a press that cannot share a prefill (with
            ``shared_prefill``) or that needs the question inside the context without ``query_aware``; a model,
            example or press input the guards reject (:mod:`evaluation.guards`); a run directory that another
            process writes with other settings (:func:`evaluation.harness.claim_runs`). All of them before any
            run directory is created.
        FileNotFoundError, OSError, ImportError, DataUnavailableError: a model or data that cannot be found.
    """
    prepared = prepared or inputs.prepare(cfgs)
    use_process_cache()  # parallel jobs (joblib, shards, SLURM) never share Triton's kernel cache
    metrics = dict(prepared.finished)
    pending = prepared.pending(len(cfgs))
    if not pending:
        return [metrics[k] for k in range(len(cfgs))]
    runs = _runs(cfgs, pending, shared_prefill)
    first = cfgs[pending[0]][0]
    dataset = prepared.dataset
    eager = any(run.caps.needs_eager for run in runs)
    attn = "eager" if eager else first.model.get("attn_implementation", "sdpa")
    model, tokenizer = harness.get_model(first.model, first.device, attn, prompt_delimiter.model_variant(runs))
    guards.check_model(model, tokenizer)
    thinking = first.model.enable_thinking  # every prompt below states it (evaluation.pipeline)
    guards.check_thinking(tokenizer, thinking, f"model {runs[0].names['model']}")
    if any(run.caps.uneven_layers for run in runs):
        attention.install()  # one attention mask per layer, from its own cache length (presses.attention)
    for run in runs:
        guards.check_press_downloads(run.press, model)
    pipe = TextGenerationPipeline(
        model=model, tokenizer=tokenizer, device=torch.device(first.device), enable_thinking=thinking
    )
    examples = harness.run_examples(first, dataset, tokenizer)
    examples, delimiter = prompt_delimiter.setup(runs, model, tokenizer, examples, first.seed)  # Finch
    protocol = Protocol.of(first)  # None: one question per context
    tokens = _check_inputs(
        examples, runs, pipe, model, tokenizer, first.max_new_tokens, shared_prefill and eager, protocol
    )
    tokens = prompt_delimiter.strip(tokens, delimiter)  # rows count the context the press compresses
    with harness.claim_runs([cfgs[run.index] for run in runs]) as claimed:  # held until metrics.json
        for run, (out, done) in zip(runs, claimed):
            run.out = out
            if done is not None:  # finished by another process meanwhile
                metrics[run.index] = done
        runs = [run for run in runs if run.index not in metrics]
        for run in runs:
            harness.note_command(run.out, command)
        if runs:
            _run_examples(
                runs, examples, tokens, pipe, dataset, model, tokenizer, first, shared_prefill, batch_decode, pad_decode
            )
        for run in runs:
            metrics[run.index] = harness.finish_run(run.out, examples, run.names, run.cfg, command)
    return [metrics[k] for k in range(len(cfgs))]


def check_scorer_files(name: str, out, press, rows: list[dict]) -> None:
    """Refuse to add rows to a run whose rows were made with other trained scorer files than ``press`` holds now.

    A scorer's weights are not a press setting (:func:`evaluation.harness.config_changes` cannot see them), so a
    surrogate retrained after a run started would otherwise mix two scorers' rows in one run. Rows record the
    SHA-256 of the files they ran with (``scorer_files``, :func:`evaluation.registry.scorer_files`).

    Args:
        name: the press's config name (for the message); out: the run directory; press: the run's press, its
            scorers attached; rows: the run's rows so far.

    Raises:
        ValueError: naming the run directory, the scorer and both hashes' first characters.
    """
    from evaluation.registry import scorer_files  # kvpress only once a model runs

    if not rows:
        return
    now, before = scorer_files(press), rows[0].get("scorer_files") or {}  # a run's rows share one scorer
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            made = f"{key} {before[key][:12]}" if key in before else f"no record of {key}"
            held = f"{now[key][:12]}" if key in now else "not attached"
            raise ValueError(
                f"press {name}: {out} holds rows made with {made}, but the scorer file now is {held}: move that "
                "run away to rerun it with this scorer"
            )


def _run_examples(
    runs: list[Run],
    examples: list,
    tokens: dict[str, dict],
    pipe,
    dataset,
    model,
    tokenizer,
    first,
    shared_prefill: bool,
    batch_decode: bool,
    pad_decode: bool,
) -> None:
    """Append one row per held run and example it still lacks (``tokens``: :func:`_check_inputs`'s)."""
    held = {run.index: harness.read_predictions(run.out / "predictions.jsonl", repair=True) for run in runs}
    for run in runs:
        check_scorer_files(run.names["press"], run.out, run.press, held[run.index])
    done_ids = {index: {r["id"] for r in rows} for index, rows in held.items()}

    def needs(run: Run, ex) -> bool:  # a row of the example is missing (one per question: harness.row_ids)
        return any(i not in done_ids[run.index] for i in harness.row_ids(ex))

    protocol = Protocol.of(first)
    todo = round_robin_by_task([e for e in examples if any(needs(r, e) for r in runs)])
    logger.info("%d runs x %d examples; %d examples still needed by some run", len(runs), len(examples), len(todo))
    torch.manual_seed(first.seed)
    desc = "shared prefill" if shared_prefill else f"{runs[0].names['press']} cr={runs[0].cfg.compression_ratio:g}"
    for ex in tqdm(todo, desc=desc, dynamic_ncols=True):
        max_new = first.max_new_tokens or ex.max_new_tokens or 32
        ids = tokens[ex.id]
        context_ids, question_ids = ids["context_ids"].to(model.device), ids["questions_ids"][0]
        if protocol is not None:  # every question's ids (evaluation.shared)
            question_ids = ids["questions_ids"]
        T = int(context_ids.shape[1])
        pending = [run for run in runs if needs(run, ex)]
        if shared_prefill:
            rows = _shared_rows(
                pending,
                ex,
                pipe,
                dataset,
                model,
                context_ids,
                question_ids,
                T,
                max_new,
                batch_decode,
                pad_decode,
                protocol,
            )
        elif protocol is not None:
            rows = [
                pair
                for run in pending
                for pair in _pipeline_shared_rows(run, ex, pipe, dataset, model, tokenizer, T, max_new, protocol)
            ]
        elif ex.continuation:  # nothing to generate: the loss of the text after the context (evaluation.continuation)
            rows = [
                (run, continuation.run_row(run, ex, dataset, model, tokenizer, context_ids, max_new)) for run in pending
            ]
        else:
            rows = [(run, _pipeline_row(run, ex, pipe, dataset, model, tokenizer, T, max_new)) for run in pending]
        for run, row in rows:
            if row["id"] not in done_ids[run.index]:  # a resumed example's rows already written are kept
                harness.append_row(run.out / "predictions.jsonl", row)
