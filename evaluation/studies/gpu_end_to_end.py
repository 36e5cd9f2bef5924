"""End-to-end GPU check of the presses on a random-weight model with SmolLM2-135M's shapes (issue 19).

Two measurements, both on one model whose weights are drawn in this script (seeded), so no checkpoint
has to travel (timing first: it needs only the GPU, while the agreement's CPU runs take most of the time):

1. **Timing** (``--lengths``, default 8192 and 32768 tokens, bfloat16, on the GPU): the full prefill
   (no press) and each press, with the speed benchmark's
   :func:`evaluation.studies.bench_speed_memory.measure.measure_row`: prefill time, time inside the press's
   hooks, greedy decode tokens/s, KV bytes kept and peak memory (one untimed warm-up per press first, for
   Triton's JIT and the allocator).
2. **Agreement** (``--agree-lengths``, default 4096 tokens, float32): each press runs once on the CPU
   with the torch reference kernels (``KVPRESS_RESEARCH_KERNELS=reference``) and once on the GPU with
   the Triton kernels forced (``KVPRESS_RESEARCH_KERNELS=triton``), on the same weights and the same
   prompt. For every (layer, KV group) the kept prompt positions of the two runs are compared by their
   Jaccard index ``|A & B| / |A | B|``. Kept positions are read off the cache itself: each key row the
   press left in the cache is matched, bit for bit, to the key rows the press received
   (:func:`key_fingerprints`), so the check needs nothing press-specific except EntroPrefill, whose
   retained support ``R`` (one set for the whole model, paper 001 Algorithm 1) is read from the press; a
   press that masks keys instead of pruning them (kvpress's KVzip and the reconstruction press built on it)
   leaves ``masked_key_indices`` on the attention modules, read by :func:`masked_positions`.
   The probabilistic-eviction press draws its samples on the CPU generator in both runs
   (:func:`cpu_draws`): CUDA and CPU generators give different streams by design, and the check is
   about the proposal, the budget search and the eviction computed on each device, not about two
   random streams. A third run, on the device with the torch references, separates the two causes of a
   difference: ``kernels_mean_jaccard`` compares the device's Triton run with it (kernels vs references
   on the same device), ``mean_jaccard`` the device's Triton run with the CPU (what a user sees). For the
   probabilistic-eviction presses ``proposal_max_abs_diff`` compares the proposals themselves (GPU Triton run
   against the CPU reference): a kept set is a random draw, and a last-bit difference in a proposal can change
   a layer's draws (:func:`cpu_draws`).

Presses (the harness configs ``configs/press/<name>.yaml`` at ``--ratio``), timed (:data:`PRESSES`):
``snapkv`` (kvpress), ``page_entrokv`` (paper 000), ``snis_min_h`` (paper 003: proposal ``min_h``, global
budget, corrected) and its page variant ``snis_min_h_page``, ``entroprefill`` (paper 001) with relaxed acceptance
(:data:`ENTROPREFILL_OVERRIDES`) so that random weights still reach the pruning path, which is what this check must
exercise, ``page_entrokv_reconstruction`` (Page-EntroKV's scoring on KVzip's reconstruction pass), and kvpress's
frontier ``chunkkv`` and ``kvzip`` (their cost on the GPU). KVzip's presses load the tokenizer by the model's name:
the word-level tokenizer is saved to a temporary folder that the model's config names. Compared across devices
(:data:`AGREE_PRESSES`): the presses that run this project's kernels, SnapKV and KVzip.

Model: ``LlamaForCausalLM`` with SmolLM2-135M's configuration (:data:`SMOLLM2_135M`: hidden 576, 9 query
heads, 3 KV heads, head dim 64, 30 layers, intermediate 1536, vocabulary 49152, RoPE theta 1e5), weights
from transformers' initialiser (std 0.02) with the query and key projections multiplied by
:data:`QK_GAIN`, so that attention logits have a standard deviation of about 2 (about 0.2 without:
near-uniform attention, unlike a trained model's). The prompt is built by :func:`build_prompt` from a
small word-level tokenizer made here (:func:`build_tokenizer`): ``Passage N:`` documents of random
words and a final ``Question: ...`` line, which is what EntroPrefill needs to find its chunks and query.

Usage (``python -m evaluation.studies.gpu_end_to_end`` is the same)::

    python scripts/gpu_end_to_end.py --out results/gpu/end_to_end          # on a CUDA GPU
    python scripts/gpu_end_to_end.py --dry-run --out /tmp/e2e               # CPU plumbing check

``--dry-run``: a 2-layer model with the same head counts (head dim 8), 128 tokens, observer windows of 16
(:data:`DRY_RUN_OVERRIDES`), no warm-up, and the
"device" run on the CPU with the Triton kernels interpreted (``TRITON_INTERPRET=1``): the agreement then
compares the Triton kernels with the torch references, and the timings mean nothing.

Outputs in ``--out``: ``agreement.csv`` (one row per press, length, layer and group), ``agreement_summary.csv``
(one row per press and length), ``timing.csv`` (one row per press and length), ``meta.json`` (device,
versions, configuration, command, elapsed time, notes). :mod:`evaluation.studies.gpu_report` turns them into
tables.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.studies import REPO
from evaluation.studies.bench_speed_memory.rows import COLUMNS
from evaluation.tables import write_rows

#: SmolLM2-135M-Instruct's configuration (the embedded model's ``config.json``), minus its weights.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
#: The dry run's model: same head counts, 2 layers, head dim 8.
DRY_RUN_MODEL = {
    **SMOLLM2_135M,
    **dict(vocab_size=4096, hidden_size=72, intermediate_size=192, num_hidden_layers=2, head_dim=8),
}
#: Factor applied to the randomly initialised query and key projections (attention logits x QK_GAIN^2).
QK_GAIN = 3.0
#: Press configs (``configs/press/``) timed end to end: ours, and kvpress's SnapKV, ChunkKV and KVzip (the
#: frontier's cost on the GPU). KVzip and the reconstruction press run KVzip's reconstruction passes.
PRESSES = (
    "snapkv",
    "page_entrokv",
    "snis_min_h",
    "entroprefill",
    "snis_min_h_page",
    "page_entrokv_reconstruction",
    "chunkkv",
    "kvzip",
)
#: The presses whose kept sets are compared across devices: those that run this project's kernels, SnapKV as the
#: baseline of the same observer path and KVzip as the baseline of the reconstruction press's pass (KVzip's presses
#: mask keys after the prefill: :func:`masked_positions`). ChunkKV scores with kvpress's SnapKV code.
AGREE_PRESSES = tuple(p for p in PRESSES if p != "chunkkv")
#: EntroPrefill with relaxed acceptance (as tests/test_entroprefill.py's accepted-run test): random weights
#: rarely pass the default audit, and the check must run the pruning path. The rest are the config's values.
ENTROPREFILL_OVERRIDES = {"epsilon": 0.9, "epsilon_audit": 0.95, "stability_streak": 0}
#: Dry run only: 128-token prompts cannot hold Page-EntroKV's 64-token window pages under a 64-token budget.
DRY_RUN_OVERRIDES = {"page_entrokv": {"window_size": 16}, "snapkv": {"window_size": 16}}
#: Sentinel press name of the full (uncompressed) prefill in the timing table.
NO_PRESS = "no_press"

AGREEMENT_COLUMNS = [
    "press",
    "T",
    "layer",
    "group",
    "kept_reference",
    "kept_device",
    "intersection",
    "union",
    "jaccard",
]
SUMMARY_COLUMNS = [
    "press",
    "T",
    "dtype",
    "layer_groups",
    "mean_jaccard",
    "min_jaccard",
    "identical_fraction",
    "kept_reference_mean",
    "kept_device_mean",
    "kernels_mean_jaccard",
    "kernels_min_jaccard",
    "proposal_max_abs_diff",
    "reference_s",
    "device_s",
    "reference_detail",
    "device_detail",
    "error",
]
#: Columns of one speed-benchmark row (:mod:`evaluation.studies.bench_speed_memory.rows`) left out of timing.csv:
#: the ratios to references measured within a sweep, the byte counts (their ratios to the full cache stay) and
#: the bookkeeping.
NOT_TIMED = {"full_prefill_s", "prefill_ratio_vs_full", "snapkv_press_s", "overhead_ratio", "timestamp", "threads"}
NOT_TIMED |= {"kv_full_bytes", "kv_physical_bytes", "kv_logical_bytes"}
#: timing.csv: the press and the shape, then the speed benchmark's measured columns
TIMING_COLUMNS = ["press", "T", "dtype", "compression_ratio"]
TIMING_COLUMNS += [c for c in COLUMNS[COLUMNS.index("prefill_s") :] if c not in NOT_TIMED]


# ---------------------------------------------------------------------------------------------- tokenizer, prompt
def build_tokenizer(n_words: int = 1500, seed: int = 0):
    """A word-level ``PreTrainedTokenizerFast``: ``n_words`` pseudo-words, digits, punctuation, space and
    newline each one token (``[A-Za-z]+|\\d|.`` pre-tokenizer, decoding by plain concatenation, so
    ``decode`` is exact and re-encoding its text gives the same ids).

    Returns:
        ``(tokenizer, words)``: the tokenizer and its pseudo-words (ids ``< n_words + 64``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    fixed = [
        "Read",
        "the",
        "passages",
        "and",
        "answer",
        "question",
        "Passage",
        "passage",
        "Question",
        "Answer",
        "which",
        "mentions",
        "word",
    ]
    words: list[str] = []
    seen = set(fixed)
    while len(words) < n_words:
        w = "".join(rng.choice("bcdfghjklmnprstvwz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for piece in [" ", "\n", ".", ",", ":", "?", *"0123456789", *fixed, *words]:
        vocab[piece] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z]+|\d|[^A-Za-z\d]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    return tok, words


def build_prompt(tokenizer, words: list[str], T: int, seed: int = 0):
    """Token ids ``(1, T)`` of ``Read the passages ...`` + ``Passage N:`` documents of random words (40 to
    400 words each; fewer for ``T < 3200``, so that short prompts still hold several passages) +
    ``Question: which passage mentions the word w?\\nAnswer:``.

    Raises:
        ValueError: if ``T`` is too short for the header, one passage and the question (< 64 tokens), or
            the tokenizer does not re-encode the prompt to the same ids without unknown tokens.
    """
    import torch

    rng = random.Random(seed)
    header = [
        "Read",
        " ",
        "the",
        " ",
        "passages",
        " ",
        "and",
        " ",
        "answer",
        " ",
        "the",
        " ",
        "question",
        ".",
        "\n",
        "\n",
    ]
    target = rng.choice(words)
    question = [
        "Question",
        ":",
        " ",
        "which",
        " ",
        "passage",
        " ",
        "mentions",
        " ",
        "the",
        " ",
        "word",
        " ",
        target,
        "?",
        "\n",
        "Answer",
        ":",
    ]
    if T < 64:
        raise ValueError(f"T={T} must be >= 64 tokens (header, one passage, question)")
    pieces = list(header)
    budget = T - len(question)
    n = 0
    while True:
        n += 1
        marker = ["Passage", " ", *str(n), ":", "\n"]
        if len(pieces) + len(marker) + 4 > budget:  # no room for another passage: extend the last one
            break
        pieces += marker
        for i in range(rng.randint(min(40, max(6, T // 32)), min(400, max(12, T // 8)))):
            if len(pieces) + 2 + 3 > budget:
                break
            pieces += ([" "] if i else []) + [rng.choice(words)]
        pieces += [".", "\n", "\n"]
    body, tail = pieces[:-3], pieces[-3:]  # extend the last passage (before its ".\n\n") to exactly T tokens
    while len(body) + len(tail) + 2 <= budget:
        body += [" ", rng.choice(words)]
    if len(body) + len(tail) < budget:
        body.append(",")
    pieces = body + tail + question
    ids = [tokenizer.convert_tokens_to_ids(p) for p in pieces]
    text = "".join(pieces)
    if tokenizer(text, add_special_tokens=False)["input_ids"] != ids or tokenizer.unk_token_id in ids:
        raise ValueError("the tokenizer does not re-encode the prompt to the same ids without unknown tokens")
    return torch.tensor([ids])


# ---------------------------------------------------------------------------------------------- model
def build_model(config: dict, seed: int, qk_gain: float = QK_GAIN):
    """A float32 ``LlamaForCausalLM`` (sdpa attention) with ``config`` and seeded random weights, query and
    key projections multiplied by ``qk_gain``; on the CPU, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**config, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_gain)
            layer.self_attn.k_proj.weight.mul_(qk_gain)
    return model


# ---------------------------------------------------------------------------------------------- kept positions
def key_fingerprints(keys):
    """An exact fingerprint of each key row: ``(B, G, T, d)`` float keys -> ``(B, G, T)`` int64.

    The raw bits of each element (as int16 / int32 / int64) times fixed odd weights below 2^24, summed in
    int64: integer arithmetic, no rounding, no overflow for ``d <= 256`` with 32-bit elements, so a row
    copied by ``gather`` has exactly the fingerprint of its source row on any device.
    """
    import torch

    itype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[keys.element_size()]
    ints = keys.detach().contiguous().view(itype).to(torch.int64)
    gen = torch.Generator().manual_seed(1234)
    weights = (torch.randint(0, 1 << 23, (keys.shape[-1],), generator=gen) * 2 + 1).to(keys.device)
    return (ints * weights).sum(-1)


def kept_positions(inputs_fp, cache_keys) -> list[list[set[int]]]:
    """Kept prompt positions per batch row and group: cache rows matched to the press's input rows.

    Args:
        inputs_fp: ``(B, G, T)`` fingerprints of the keys the press received.
        cache_keys: ``(B, G, P, d)`` keys the cache holds after the prefill (padding rows, which match no
            input row, are dropped).

    Returns:
        ``[b][g]`` sets of positions in ``[0, T)``.
    """
    import torch

    kept_fp = key_fingerprints(cache_keys).cpu()
    full = inputs_fp.cpu()
    out = []
    for b in range(full.shape[0]):
        row = []
        for g in range(full.shape[1]):
            sorted_fp, order = torch.sort(full[b, g])
            idx = torch.searchsorted(sorted_fp, kept_fp[b, g]).clamp_max(len(sorted_fp) - 1)
            hit = sorted_fp[idx] == kept_fp[b, g]
            row.append(set(order[idx[hit]].tolist()))
        out.append(row)
    return out


def masked_positions(masks: tuple, T: int, num_groups: int) -> dict:
    """Kept prompt positions of a press that masks keys instead of pruning them (kvpress's head-wise presses: KVzip
    and its subclasses, whose ``compress_post`` leaves the cache whole and sets ``masked_key_indices``).

    Args:
        masks: per layer, ``(batch, head, position)`` index tensors or None
            (:func:`evaluation.kvzip_path.take_masked_keys`); batch row 0 is read.
        T: the prompt length.
        num_groups: KV heads per layer.

    Returns:
        ``{(layer, group): set}`` of the positions in ``[0, T)`` not masked.
    """
    out = {}
    for layer, mask in enumerate(masks):
        b, h, pos = (t.cpu() for t in mask) if mask is not None else (None, None, None)
        for g in range(num_groups):
            gone = set() if mask is None else set(pos[(b == 0) & (h == g)].tolist())
            out[(layer, g)] = set(range(T)) - gone
    return out


@contextlib.contextmanager
def capture_inputs(press):
    """Record ``fingerprints[layer_idx]`` of the keys each ``press.compress`` call receives (the layer's full
    prefill keys), by an instance attribute that shadows the method while the block runs."""
    fingerprints: dict[int, object] = {}
    real = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        fingerprints[int(getattr(module, "layer_idx", len(fingerprints)))] = key_fingerprints(keys)
        return real(module, hidden_states, keys, values, attentions, kwargs)

    press.compress = compress
    try:
        yield fingerprints
    finally:
        del press.compress


@contextlib.contextmanager
def cpu_draws(seed: int, record: list | None = None):
    """While the block runs, the probabilistic-eviction press draws its multinomial samples on a CPU generator
    (its proposal and budget stay on the model's device), a fresh one per call (per layer) seeded with
    ``seed`` and the call's index, as the press's own per-layer generators: the binomial splitting's rejection
    steps consume a number of uniforms that depends on the proposal, so a last-bit difference in one layer's
    proposal can change that layer's draws, and a generator shared across layers would carry the change into
    every later layer (the first GPU check saw layers 0-2 identical and every later one different).
    With ``record``, each call's ``(proposal as float64 on the CPU, m)`` is appended to it."""
    import torch

    import presses.probabilistic.press as snis_press

    real = snis_press.sample_counts
    calls = [0]

    def draw(pi, num_samples, generator=None):
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + calls[0])
        calls[0] += 1
        m = torch.as_tensor(num_samples).cpu()
        pi_cpu = pi.detach().cpu()  # one copy off the device, for the draw and the record
        if record is not None:
            record.append((pi_cpu.double(), m.clone()))
        return real(pi_cpu, m, gen).to(pi.device)

    snis_press.sample_counts = draw
    try:
        yield
    finally:
        snis_press.sample_counts = real


def proposal_max_abs_diff(a: list, b: list) -> float:
    """Largest ``|pi_a - pi_b|`` over the proposals two runs recorded (:func:`cpu_draws`), ``inf`` when their
    calls, shapes or budgets ``m`` differ."""
    if len(a) != len(b) or not a:
        return math.inf
    worst = 0.0
    for (pa, ma), (pb, mb) in zip(a, b):
        if pa.shape != pb.shape or not bool((ma == mb).all()):
            return math.inf
        worst = max(worst, float((pa - pb).abs().max()))
    return worst


@contextlib.contextmanager
def kernel_mode(mode: str):
    """Set ``KVPRESS_RESEARCH_KERNELS`` (read at every dispatch call) for the block."""
    old = os.environ.get("KVPRESS_RESEARCH_KERNELS")
    os.environ["KVPRESS_RESEARCH_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVPRESS_RESEARCH_KERNELS", None)
        else:
            os.environ["KVPRESS_RESEARCH_KERNELS"] = old


def kept_sets(model, press_name: str, press, ids, seed: int, record: list | None = None) -> tuple[dict, str]:
    """Prefill ``ids`` on ``model`` under ``press``; the kept positions per (layer, group) and a detail
    string (EntroPrefill's accepted layer, SNIS's mean draws). Batch size 1. ``record``: as :func:`cpu_draws`.

    Returns:
        ``({(layer, group): set}, detail)``; EntroPrefill gives one entry ``(-1, -1)``: its retained support.

    Raises:
        ValueError: when the press both pruned the cache and masked keys (the check reads one or the other).
    """
    import torch
    from transformers import DynamicCache

    from evaluation.kvzip_path import take_masked_keys  # here: Triton must not load before main() sets the interpreter

    cache = DynamicCache()
    ids = ids.to(model.device)
    T = ids.shape[1]
    with torch.inference_mode():
        if press_name == "entroprefill":
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
            st = press.summary()
            R = press._retained
            kept = set(range(T)) if R is None else set(R.tolist())
            detail = (
                f"accepted_layer={st.get('accepted_layer')} removed_chunks={st.get('removed_chunks')} "
                f"T'={st.get('T_prime')} bypass={st.get('bypass_reason') or '-'}"
            )
            return {(-1, -1): kept}, detail
        draws = cpu_draws(seed, record) if press_name.startswith("snis") else contextlib.nullcontext()
        take_masked_keys(model)  # no mask of an earlier run may stay on the model
        with draws, capture_inputs(press) as fps, press(model):
            model.model(input_ids=ids, past_key_values=cache)
        masks = take_masked_keys(model)
    out = {}
    for layer, fp in sorted(fps.items()):
        for g, positions in enumerate(kept_positions(fp, cache.layers[layer].keys)[0]):
            out[(layer, g)] = positions
    if any(m is not None for m in masks):
        if out:
            raise ValueError(f"{press_name} both pruned the cache and masked keys: the check reads one or the other")
        out = masked_positions(masks, T, model.config.num_key_value_heads)
    detail = ""
    if hasattr(press, "summary"):
        st = press.summary()
        if "num_samples_mean" in st:
            detail = f"m={st['num_samples_mean']:.6g} logical_compression={st.get('logical_compression', 0):.4f}"
        elif "effective_compression" in st:
            detail = f"effective_compression={st['effective_compression']:.4f}"
    return out, detail


def compare(ref: dict, dev: dict) -> list[dict]:
    """Per (layer, group) row: kept counts, intersection, union and Jaccard index (1 when both are empty).

    Raises:
        ValueError: when the two runs did not compress the same (layer, group) set.
    """
    if set(ref) != set(dev):
        raise ValueError(f"the runs compressed different layers/groups: {sorted(set(ref) ^ set(dev))[:6]}")
    rows = []
    for key in sorted(ref):
        a, b = ref[key], dev[key]
        inter, union = len(a & b), len(a | b)
        rows.append(
            {
                "layer": key[0],
                "group": key[1],
                "kept_reference": len(a),
                "kept_device": len(b),
                "intersection": inter,
                "union": union,
                "jaccard": inter / union if union else 1.0,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------- outputs
def versions() -> dict:
    """Versions of python and the packages the check runs on (``-`` when missing)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in (
        "torch",
        "triton",
        "transformers",
        "tokenizers",
        "kvpress",
        "hydra-core",
        "omegaconf",
        "datasets",
        "numpy",
        "scipy",
    ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "-"
    return out


def _parse(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "results" / "gpu" / "end_to_end"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, Triton interpreted: plumbing only")
    p.add_argument("--lengths", default=None, help="timing lengths T (default 8192,32768; dry run 128)")
    p.add_argument("--agree-lengths", default=None, help="agreement lengths (default 4096; dry run 128)")
    p.add_argument("--presses", default=",".join(PRESSES), help="comma-separated press configs timed")
    p.add_argument(
        "--agree-presses", default=",".join(AGREE_PRESSES), help="comma-separated press configs compared CPU vs GPU"
    )
    p.add_argument("--ratio", type=float, default=0.5, help="compression_ratio of every press")
    p.add_argument("--decode-tokens", type=int, default=None, help="greedy steps timed (default 32; dry run 2)")
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="stop starting measurements after this many seconds (default 240; none in the dry run)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the "device" run interprets it
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU plumbing check", file=sys.stderr)
        return 2
    from evaluation.studies.bench_speed_memory.measure import measure_row
    from evaluation.studies.bench_speed_memory.sweep import make_press

    t_start = time.perf_counter()
    time_limit = args.time_limit_s if args.time_limit_s is not None else (math.inf if args.dry_run else 240.0)
    device = "cpu" if args.dry_run else "cuda:0"
    lengths = [int(x) for x in (args.lengths or ("128" if args.dry_run else "8192,32768")).split(",") if x]
    agree = [int(x) for x in (args.agree_lengths or ("128" if args.dry_run else "4096")).split(",") if x]
    decode_tokens = args.decode_tokens if args.decode_tokens is not None else (2 if args.dry_run else 32)
    presses = [p for p in args.presses.split(",") if p]
    agree_presses = [p for p in args.agree_presses.split(",") if p]
    for flag, names, allowed in (("--presses", presses, PRESSES), ("--agree-presses", agree_presses, AGREE_PRESSES)):
        bad = [p for p in names if p not in allowed]
        if bad:
            print(f"{flag} {bad} not among {allowed}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = DRY_RUN_MODEL if args.dry_run else SMOLLM2_135M
    notes: list[str] = []
    tok, words = build_tokenizer(seed=args.seed)
    model = build_model(config, args.seed)
    # KVzip's presses load the model's tokenizer by its name (kvpress's KVzipPress.__call__): the word-level one
    tok_dir = tempfile.mkdtemp(prefix="gpu_e2e_tokenizer_")
    tok.save_pretrained(tok_dir)
    model.config._name_or_path = tok_dir
    dev_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu (dry run, TRITON_INTERPRET=1)"
    meta = {
        "device": dev_name,
        "dry_run": args.dry_run,
        "versions": versions(),
        "command": " ".join(sys.argv),
        "model_config": config,
        "qk_gain": QK_GAIN,
        "seed": args.seed,
        "compression_ratio": args.ratio,
        "presses": presses,
        "agree_presses": agree_presses,
        "entroprefill_overrides": ENTROPREFILL_OVERRIDES,
        "dry_run_overrides": DRY_RUN_OVERRIDES if args.dry_run else {},
        "agree_lengths": agree,
        "lengths": lengths,
        "decode_tokens": decode_tokens,
        "tokenizer_vocab": len(tok),
        "notes": notes,
        "cpu_threads": torch.get_num_threads(),
    }

    def over_time() -> bool:
        return time.perf_counter() - t_start > time_limit

    def press_for(name: str):
        overrides = dict(ENTROPREFILL_OVERRIDES) if name == "entroprefill" else {}
        if args.dry_run:
            overrides.update(DRY_RUN_OVERRIDES.get(name, {}))
        return make_press(name, args.ratio, args.seed, tok, overrides or None)

    def save_meta():
        meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_atomic(out / "meta.json", json.dumps(meta, indent=2, default=str) + "\n")

    save_meta()
    # ------------------------------------------------------------------ 1. timing (bfloat16 on the GPU)
    timing_rows = []
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    fast_model = model if args.dry_run else copy.deepcopy(model).to(device, dtype)
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    warmed: set[str] = set() if not args.dry_run else {NO_PRESS, *presses}  # the dry run times nothing
    for T in lengths:
        ids = build_prompt(tok, words, T, seed=args.seed)
        q_ids = ids[:, -1:]  # the decode loop starts by re-reading the prompt's last token at position T
        for name in [NO_PRESS, *presses]:
            row = {"press": name, "T": T, "dtype": str(dtype).replace("torch.", ""), "compression_ratio": args.ratio}
            if over_time():
                row["error"] = "skipped: time limit"
                timing_rows.append(row)
                continue
            try:
                press = None if name == NO_PRESS else press_for(name)
                if name not in warmed:
                    measure_row(fast_model, press, ids, q_ids, min(2, decode_tokens), device)
                    warmed.add(name)
                sync()
                res = measure_row(fast_model, press, ids, q_ids, decode_tokens, device)
                row.update(res)
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"
            timing_rows.append(row)
            print(
                f"timing T={T} {name}: "
                + ", ".join(
                    f"{k}={row.get(k, '')}" if not isinstance(row.get(k), float) else f"{k}={row[k]:.4g}"
                    for k in ("prefill_s", "press_s", "decode_tok_s", "peak_mem_mb", "error")
                ),
                flush=True,
            )
            write_rows(out / "timing.csv", timing_rows, TIMING_COLUMNS)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    write_rows(out / "timing.csv", timing_rows, TIMING_COLUMNS)
    del fast_model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ 2. agreement (float32)
    agreement_rows, summary_rows = [], []
    dev_model = model if args.dry_run else copy.deepcopy(model).to(device)
    dev_mode = "triton"  # forced: compiled on the GPU, interpreted in the dry run
    for T in agree:
        ids = build_prompt(tok, words, T, seed=args.seed)
        for name in agree_presses:
            row = {"press": name, "T": T, "dtype": "float32"}
            if over_time():
                row["error"] = "skipped: time limit"
                summary_rows.append(row)
                continue
            try:
                t0 = time.perf_counter()
                ref_pi, dev_pi = [], []  # the SNIS presses' proposals, per layer
                with kernel_mode("reference"):
                    ref, ref_detail = kept_sets(model, name, press_for(name), ids, args.seed, ref_pi)
                t1 = time.perf_counter()
                with kernel_mode(dev_mode):
                    dev, dev_detail = kept_sets(dev_model, name, press_for(name), ids, args.seed, dev_pi)
                t2 = time.perf_counter()
                with kernel_mode("reference"):
                    dev_ref, _ = kept_sets(dev_model, name, press_for(name), ids, args.seed)
                kernel_jac = [r["jaccard"] for r in compare(dev_ref, dev)]
                rows = compare(ref, dev)
                agreement_rows += [{"press": name, "T": T, **r} for r in rows]
                jac = [r["jaccard"] for r in rows]
                row.update(
                    layer_groups=len(rows),
                    mean_jaccard=f"{sum(jac) / len(jac):.6f}",
                    min_jaccard=f"{min(jac):.6f}",
                    identical_fraction=f"{sum(j == 1.0 for j in jac) / len(jac):.4f}",
                    kept_reference_mean=f"{sum(r['kept_reference'] for r in rows) / len(rows):.1f}",
                    kept_device_mean=f"{sum(r['kept_device'] for r in rows) / len(rows):.1f}",
                    kernels_mean_jaccard=f"{sum(kernel_jac) / len(kernel_jac):.6f}",
                    kernels_min_jaccard=f"{min(kernel_jac):.6f}",
                    proposal_max_abs_diff=f"{proposal_max_abs_diff(ref_pi, dev_pi):.3g}" if ref_pi else "",
                    reference_s=f"{t1 - t0:.2f}",
                    device_s=f"{t2 - t1:.2f}",
                    reference_detail=ref_detail,
                    device_detail=dev_detail,
                )
            except Exception as err:  # one press failing must not lose the others' rows
                row["error"] = f"{type(err).__name__}: {err}"
            summary_rows.append(row)
            print(
                f"agreement T={T} {name}: "
                + ", ".join(
                    f"{k}={row.get(k, '')}"
                    for k in (
                        "mean_jaccard",
                        "min_jaccard",
                        "identical_fraction",
                        "kernels_mean_jaccard",
                        "reference_s",
                        "device_s",
                        "error",
                    )
                ),
                flush=True,
            )
            write_rows(out / "agreement.csv", agreement_rows, AGREEMENT_COLUMNS)
            write_rows(out / "agreement_summary.csv", summary_rows, SUMMARY_COLUMNS)
            save_meta()
    write_rows(out / "agreement.csv", agreement_rows, AGREEMENT_COLUMNS)
    write_rows(out / "agreement_summary.csv", summary_rows, SUMMARY_COLUMNS)
    if over_time():
        notes.append(f"time limit {time_limit:g} s reached: later rows say 'skipped: time limit'")
    save_meta()
    shutil.rmtree(tok_dir, ignore_errors=True)
    print(f"wrote {out} in {meta['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
