"""Input guards of the harness: every input that the model, the dataset or a press cannot take gets one clear
``ValueError`` naming the value and the limit, before anything is written (the README's Limits lists them all,
each with its test).

- the run's settings (:func:`check_setting_values`, :func:`check_settings`): ``n_samples >= 1``,
  ``max_new_tokens >= 1``, an integer ``seed``, switches that are true or false, a CUDA device that exists;
- the dataset (:func:`check_dataset`): ``n_samples`` within what it can give (``Dataset.sample_limit``);
  its own parameters (unknown LongBench or RULER task, a RULER length below a task's smallest prompt, a needle
  context too short for the needle, ...) are checked by the dataset itself when it is built;
- the run's examples (:func:`check_examples`): at least one (a shard past the last example, or filters that
  drop every example, give none);
- the model (:func:`check_model`): the decoder layout every press hooks into (:func:`check_model_layout`) and a
  stop token (:func:`evaluation.pipeline.stop_token_ids`); ``model.enable_thinking=true`` only for a chat template
  with a thinking switch (:func:`check_thinking`);
- each example on the model (:func:`check_model_input`): prompt plus answer within the model's positions, and
  token ids within its vocabulary; with several questions per context, all of them and their answers
  (:func:`check_shared_positions`);
- each press on the model (:func:`check_press_downloads`): the project's trained scorers attached
  (:mod:`evaluation.scorers`), and the weights, statistics or data a kvpress press downloads when its prefill starts
  cached or reachable (:func:`evaluation.registry.press_download_problem`);
- each example under a press (:func:`check_press_input`): the press's limits, from the registry
  (:func:`evaluation.registry.press_input_problem`; kvpress's baselines check their inputs with ``assert``,
  skipped under ``python -O``, or not at all). This project's presses validate their own input.

``tests/test_guards.py`` and ``tests/test_robustness.py``.
"""

from __future__ import annotations

__all__ = [
    "check_setting_values",
    "check_settings",
    "check_dataset",
    "check_examples",
    "check_model",
    "check_model_layout",
    "check_model_input",
    "check_shared_positions",
    "check_thinking",
    "check_press_input",
    "check_press_downloads",
    "max_positions",
]


def _decoder_layers(model):
    """The decoder layers of a causal LM (``model.model.layers`` or ``model.model.language_model.layers``)."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    return getattr(inner, "layers", None)


def _text_config(model):
    return getattr(model.config, "text_config", None) or model.config


def check_setting_values(cfg) -> None:
    """Raise for a run setting whose value is of no use, read in its one spelling
    (:func:`evaluation.settings.normal_value`; call on a normalised config): ``n_samples`` and
    ``max_new_tokens`` integers >= 1 or null, ``seed`` an integer, the switches (``query_aware``, ``overwrite``,
    ``grow``, ``model.enable_thinking``) true or false, the protocol's settings (:func:`_check_protocol`). Reads no
    file and imports nothing heavy.

    Raises:
        ValueError: naming the key, the value and what it must be.
    """
    from omegaconf import OmegaConf

    from evaluation.settings import SETTING_KINDS, normal_value

    for key in ("n_samples", "max_new_tokens"):
        value = normal_value(key, cfg.get(key))
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key}={value!r} must be an integer >= 1 (or null for the dataset's default)")
    seed = normal_value("seed", cfg.get("seed", 0))
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r} must be an integer")
    for key, kind in SETTING_KINDS.items():
        value = OmegaConf.select(OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg, key, default=None)
        if kind == "switch" and value is not None and not isinstance(normal_value(key, value), bool):
            raise ValueError(f"{key}={value!r} must be true or false")
    _check_protocol(cfg)


def _check_protocol(cfg) -> None:
    """The shared-context protocol's settings (:mod:`evaluation.shared`): ``protocol`` one of
    :data:`evaluation.settings.PROTOCOLS`; with ``shared``, ``questions`` an integer >= 1 and ``shared_mode`` one of
    :data:`evaluation.settings.SHARED_MODES`; with ``single``, neither set (it reads them not)."""
    from evaluation.settings import PROTOCOLS, SHARED_MODES, normal_value

    protocol = normal_value("protocol", cfg.get("protocol") or "single")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} must be one of {', '.join(PROTOCOLS)}")
    questions = normal_value("questions", cfg.get("questions"))
    mode = normal_value("shared_mode", cfg.get("shared_mode"))
    if protocol == "single":
        for key, value in (("questions", questions), ("shared_mode", mode)):
            if value is not None:
                raise ValueError(f"{key}={value!r} is read only with protocol=shared (one context, several questions)")
        return
    if not isinstance(questions, int) or isinstance(questions, bool) or questions < 1:
        raise ValueError(f"questions={questions!r} must be an integer >= 1 (the questions asked per context)")
    if mode not in SHARED_MODES:
        raise ValueError(f"shared_mode={mode!r} must be one of {', '.join(SHARED_MODES)}")


def check_settings(cfg) -> None:
    """Raise for run settings no dataset or model can take (called before anything is loaded).

    Raises:
        ValueError: a value :func:`check_setting_values` refuses, or a ``cuda`` device that torch does not see.
    """
    check_setting_values(cfg)
    device = str(cfg.get("device", "cpu"))
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device} but torch sees {torch.cuda.device_count()} CUDA device(s): use "
                "device=cpu or an existing GPU"
            )


def check_dataset(dataset, n_samples: int | None, questions: int | None = None) -> None:
    """Raise when ``n_samples`` asks for more examples than the dataset can give (``dataset.sample_limit()``:
    LongBench's rows per task file, RULER's qa questions; the generated datasets have no limit), or, with
    ``questions`` (``protocol=shared``), when the dataset cannot put that many questions on one context (its
    ``shared_problem(questions)``; a dataset without that method has one question per context).

    Raises:
        ValueError: naming ``n_samples``, the limit and what sets it; or the dataset, ``questions`` and why.
    """
    if questions is not None:
        check = getattr(dataset, "shared_problem", None)
        name = getattr(dataset, "name", type(dataset).__name__)
        problem = check(int(questions)) if callable(check) else "it has one question per context"
        if problem:
            raise ValueError(
                f"protocol=shared questions={questions} on dataset {name}: {problem} (the sets with several "
                "questions per context: needle, needle_docs, ruler_shared, stdlib_docs)"
            )
    limit = getattr(dataset, "sample_limit", None)
    limit = limit() if callable(limit) and n_samples is not None else None
    if limit is not None and n_samples > limit[0]:
        raise ValueError(
            f"n_samples={n_samples} is more than the dataset can give: {limit[1]} number "
            f"{limit[0]}; use n_samples<={limit[0]} (or n_samples=null for the dataset's default)"
        )


def check_examples(examples: list, cfg, n_total: int) -> None:
    """Raise when a run has no example to run.

    Args:
        examples: the run's examples (after its shard).
        cfg: the run's config (``shard``, ``dataset``).
        n_total: the dataset's examples before sharding.

    Raises:
        ValueError: naming the shard and the number of examples, or the dataset's filters.
    """
    if examples:
        return
    shard = cfg.get("shard")
    if shard and n_total:
        raise ValueError(
            f"shard={shard} is empty: the dataset gives {n_total} example(s), so shard i/n needs i < {n_total}"
        )
    raise ValueError(
        "the dataset gives no example for these settings (its filters, e.g. skip_longer_than, drop every prompt)"
    )


def check_model_layout(model) -> None:
    """Raise unless ``model`` has the decoder layout every press hooks into.

    Presses hook ``model.model.layers[i].self_attn`` (kvpress's ``BasePress.__call__``) and project window
    queries with its ``q_proj`` (or Phi-3's ``qkv_proj``) using ``config.num_attention_heads`` and
    ``num_key_value_heads``. A model that soft-caps its attention logits (Gemma2) runs on eager attention only:
    transformers' sdpa ignores the soft-cap, so sdpa would compute another model.

    Raises:
        ValueError: naming the model class and what is missing, or the soft-cap and the implementation.
    """
    name = type(model).__name__
    layers = _decoder_layers(model)
    if layers is None or len(layers) == 0:
        raise ValueError(
            f"model class {name} is not supported by the presses: they need a decoder-only causal "
            "LM with its layers at model.model.layers (Llama, Mistral, Qwen2/3, Phi-3, Gemma2/3)"
        )
    attn = getattr(layers[0], "self_attn", None)
    if attn is None or not (hasattr(attn, "q_proj") or hasattr(attn, "qkv_proj")) or not hasattr(attn, "layer_idx"):
        raise ValueError(
            f"model class {name} is not supported by the presses: its decoder layers need a "
            "Llama-style self_attn with q_proj (or qkv_proj) and layer_idx, got "
            f"{type(attn).__name__ if attn is not None else 'no self_attn'}"
        )
    if not hasattr(_text_config(model), "num_attention_heads"):
        raise ValueError(f"model class {name} is not supported by the presses: config.num_attention_heads is missing")
    softcap = getattr(_text_config(model), "attn_logit_softcapping", None)
    impl = getattr(model.config, "_attn_implementation", None)
    if softcap and impl != "eager":
        raise ValueError(
            f"model class {name} soft-caps its attention logits (attn_logit_softcapping={softcap}), which "
            f"transformers' {impl} attention ignores: load it with attn_implementation='eager' "
            "(model.attn_implementation=eager)"
        )


def check_model(model, tokenizer) -> None:
    """Raise for a model the harness cannot run (:func:`check_model_layout`) or whose answers would never stop (no
    stop token: :func:`evaluation.pipeline.stop_token_ids`). Whether the tokenizer fits the model is checked on the
    ids it produces (:func:`check_model_input`): a tokenizer may hold a few added tokens beyond the embedding that no
    text produces (the embedded SmolLM2's has 5).

    Raises:
        ValueError: an unsupported layout, or no stop token (naming the model).
    """
    from evaluation.pipeline import stop_token_ids  # kvpress only once a model is loaded

    check_model_layout(model)
    stop_token_ids(model, tokenizer)


def check_thinking(tokenizer, enable_thinking: bool, model_name: str = "the model") -> None:
    """Raise for ``model.enable_thinking=true`` on a tokenizer whose chat template has no thinking switch
    (:func:`evaluation.pipeline.has_thinking_switch`): the prompt would be the one of ``false``, under another
    run setting. ``false`` (the default) is every template's prompt of today.

    Raises:
        ValueError: naming the model and the setting.
    """
    from evaluation.pipeline import has_thinking_switch  # kvpress only once a model is loaded

    if enable_thinking and not has_thinking_switch(tokenizer):
        raise ValueError(
            f"model.enable_thinking=true, but the chat template of {model_name} has no thinking switch (it never "
            "reads enable_thinking), so the prompt would not change: leave model.enable_thinking=false"
        )


def max_positions(model) -> int | None:
    """The most positions ``model`` takes: ``max_position_embeddings``, or ``factor x
    original_max_position_embeddings`` when a YaRN / dynamic / LongRoPE scaling extends it further; None when
    the config does not say (:func:`presses.core.model.max_positions`, the one source: every press of the project
    refuses a longer prefill with it)."""
    from presses.core.model import max_positions as positions  # presses import torch: only once a model is loaded

    return positions(model)


def check_model_input(
    model,
    context_length: int,
    question_length: int,
    max_new_tokens: int,
    example_id: str = "",
    max_token_id: int | None = None,
) -> None:
    """Raise when an example does not fit the model: its positions (:func:`max_positions`) or its vocabulary.

    The context (with its chat template), the question and the generated answer all take positions
    (decoding continues after ``T``, whatever the press kept); every token id must index a row of the model's
    input embedding (``vocab_size``).

    Raises:
        ValueError: naming the example, the token counts and ``max_position_embeddings``, or the token id and
            ``vocab_size``.
    """
    rows = model.get_input_embeddings().num_embeddings
    if max_token_id is not None and max_token_id >= rows:
        raise ValueError(
            f"example {example_id}: token id {max_token_id} is not below the model's vocab_size={rows} "
            "(its embedding rows): the tokenizer does not fit the model; use the model's own tokenizer"
        )
    limit = max_positions(model)
    total = int(context_length) + int(question_length) + int(max_new_tokens)
    if limit is not None and total > limit:
        raise ValueError(
            f"example {example_id}: context {context_length} + question {question_length} + "
            f"max_new_tokens {max_new_tokens} = {total} positions, more than the model's "
            f"max_position_embeddings={limit}: use a shorter context (e.g. dataset.context_length, "
            "dataset.max_context_length)"
        )


def check_shared_positions(
    model, context_length: int, question_lengths: list[int], max_new_tokens: int, turns: bool, example_id: str = ""
) -> None:
    """Raise when a context's questions (:mod:`evaluation.shared`) do not fit the model's positions after its prefill
    (:func:`max_positions`): each question and its answer take positions after the context's ``T``, one at a time
    on a copy of the compressed cache (``turns=False``: the longest counts), or all of them in turn (``turns``:
    every question, with its chat turn's text, and every answer stay in the cache). Checked before any model work.

    Raises:
        ValueError: naming the example, the lengths, the total and ``max_position_embeddings``.
    """
    limit = max_positions(model)
    per = [int(q) + int(max_new_tokens) for q in question_lengths]
    total = int(context_length) + (sum(per) if turns else max(per))
    if limit is not None and total > limit:
        how = "all in turn" if turns else "the longest"
        raise ValueError(
            f"example {example_id}: context {context_length} + questions {list(question_lengths)} + max_new_tokens "
            f"{max_new_tokens} each ({how}) = {total} positions, more than the model's max_position_embeddings={limit}"
            ": use fewer questions, a shorter context or a smaller max_new_tokens"
        )


def check_press_input(press, model, context_length: int, multi_token_forward: bool = False) -> None:
    """Raise a clear error for a (press, model, context) the press cannot compress.

    Call once per example, after tokenising the context and before the prefill. ``press=None`` (no
    compression) is not checked. The press-specific limits come from the registry
    (:func:`evaluation.registry.press_input_problem`).

    Args:
        press: the instantiated press (kvpress or ours), or None.
        model: the causal LM.
        context_length: ``T``, prefill tokens of the example.
        multi_token_forward: True when a forward of more than one token follows the prefill on the
            compressed cache (kvpress's pipeline runs the question and answer prefix as one forward).

    Raises:
        ValueError: for an unsupported model layout, or a limit of the press (see the registry).
    """
    if press is None:
        return
    from evaluation.registry import press_input_problem  # kvpress only when a press is checked

    check_model_layout(model)
    problem = press_input_problem(press, model, context_length, multi_token_forward)
    if problem:
        raise ValueError(problem)


def check_press_downloads(press, model) -> None:
    """Attach the project's trained scorers and statistics to ``press`` (None: nothing to do) for ``model``
    (:func:`evaluation.registry.attach_scorers`, so kvpress downloads nothing), then
    raise when it needs weights, statistics or data for ``model`` that it cannot download here (kvpress fetches them
    when the prefill starts; :func:`evaluation.registry.press_download_problem`). Call once per run, after the model
    is loaded and before any run directory is created.

    Raises:
        OSError: naming the press, what it needs (the hub repository or URL, or the project's scorer file and the
            command that makes it) and how to get it.
    """
    if press is None:
        return
    from evaluation.registry import attach_scorers, press_download_problem  # kvpress only when a press is checked

    try:
        attach_scorers(press, model, required=False)
    except FileNotFoundError as err:  # a scorer made for another model
        raise OSError(str(err)) from None
    problem = press_download_problem(press, model)
    if problem:
        raise OSError(problem)
