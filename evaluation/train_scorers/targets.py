"""KVzip+ targets and layer-input features of the corpus documents, from the project's own KVzip path; stored as
what training needs: per-layer moments for the ridge surrogate, a row subsample for the MLP, held-out scores.

Per document (:func:`document_targets`): the document goes through the harness's pipeline preprocessing (the chat
template, as an evaluation context with the question after compression), one uncompressed prefill is recorded
(:class:`evaluation.replay.PrefillCapture`) and :func:`evaluation.kvzip_path.score` runs kvpress's KVzip
reconstruction pass over it with the press of ``configs/press/kvzip_plus.yaml``: the scores are exactly those
kvpress's KVzip+ selects with in this project's runs (``(L, 1, G, T)``, before the selection). Features are each
attention layer's input hidden states in the prefill (``kwargs["hidden_states"]`` of its forward hook, what
``KVzapPress.score`` receives), at the positions the pass scores (the context after the chat template's prefix:
kvpress's ``start_idx`` to ``end_idx``); targets are the natural log of the scores there.

How these targets relate to kvpress's own KVzap recipe (``kvzap/data.py`` of kvpress's repository): both take, per
context key, the most attention any reconstruction query pays it, divided by that query's hidden-state norm and
multiplied by ``||W_o v||``, the maximum over the GQA group's query heads, then the log. They differ in the pass
that produces the attention: ``kvzap/data.py`` runs one eager forward over ``user: <context> Repeat the previous
context exactly. assistant: <context>`` and keeps the rows of the repeated context only, softmax over the whole
causal prefix; kvpress's KVzipPress (here) prefills the context, then feeds ``Repeat the previous context
exactly.``, the chat template's assistant suffix and the context in chunks of ``chunk_size`` (2048) tokens against
the cache, with its softmax over the attention sinks, the chunk being reconstructed and the repeat window only
(not the rest of the chat prefix), and its maximum over every row of the repeat window (the instruction's and the
suffix's rows too). So targets here follow the selection that the ``kvzip_plus`` runs make.

Storage (one work directory per :class:`Settings`, :func:`work_dir`): documents are taken in the corpus's seeded
training order (:func:`evaluation.train_scorers.corpus.split`) and dealt to :data:`SHARDS` shards by position
(document ``i`` to shard ``i mod SHARDS``), each shard's moments (:class:`evaluation.train_scorers.moments.Moments`)
merged document by document in order and saved after every document with its resume point (``shard<s>/running.npz``);
a shard's moments at a milestone (the first ``k`` training documents) are kept as ``shard<s>/docs<k>.npz``, so a
fit on the first ``k`` documents merges the shards' files in shard order, whatever the number of workers that made
them (bit-equal for a fixed thread count). The MLP's rows are ``rows/<i>.npz`` (a seeded subsample of a training
document's positions: features float16 ``(n, L, D)``, targets float32 ``(n, L, G)``); held-out documents keep their
raw scores (``heldout/<id>.npz``). A killed run continues at each shard's next document.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from evaluation.atomic import write_atomic
from evaluation.train_scorers import corpus
from evaluation.train_scorers.moments import Moments

__all__ = [
    "GROWTH_TOKENS",
    "KVZIP_PLUS_CONFIG",
    "SHARDS",
    "DocumentTargets",
    "Settings",
    "compute",
    "document_targets",
    "heldout_scores",
    "kvzip_plus_press",
    "milestone_docs",
    "shard_moments",
    "train_rows",
    "work_dir",
]

#: The press config whose scores are the targets (KVzip+ as the harness runs it).
KVZIP_PLUS_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "press" / "kvzip_plus.yaml"
#: Shards the training documents are dealt to (the most workers that can share a run).
SHARDS = 2
#: Training-token counts at which every run keeps its moments (how the fit grows with the tokens).
GROWTH_TOKENS = (10_000, 20_000, 50_000, 100_000, 200_000, 300_000, 500_000, 1_000_000)
#: float16 holds the features (the MLP's rows) only below this magnitude.
_FLOAT16_MAX = 65504.0


@dataclass(frozen=True)
class Settings:
    """What a target computation depends on (its work directory's key).

    Attributes:
        model: the model's name for :func:`evaluation.models.load_model` (``smollm2-135m``).
        seed: the corpus split's and the MLP rows' seed.
        mlp_rows_per_doc: positions per training document kept for the MLP.
        threads: torch's CPU threads per worker (results are bit-equal for one thread count).
    """

    model: str = "smollm2-135m"
    seed: int = 0
    mlp_rows_per_doc: int = 256
    threads: int = 1

    def __post_init__(self):
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.mlp_rows_per_doc < 0:
            raise ValueError(f"mlp_rows_per_doc={self.mlp_rows_per_doc} must be >= 0")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1")

    def identity(self) -> dict:
        """Everything the stored results depend on: these fields, the corpus, the KVzip+ config, the shards and the
        library versions."""
        import kvpress
        import transformers

        return {
            **dataclasses.asdict(self),
            "shards": SHARDS,
            "corpus_sha256": corpus.corpus_sha256(),
            "kvzip_plus_config": KVZIP_PLUS_CONFIG.read_text(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvpress": getattr(kvpress, "__version__", "unknown"),
        }


def work_dir(settings: Settings, root: Path | None = None) -> Path:
    """``<root>/<model>/kvzap-<hash of the identity>`` (default root: ``<model cache>/scorers``), with
    ``settings.json`` written on first use."""
    from evaluation.models import cache_dir

    identity = settings.identity()
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    path = (root or cache_dir() / "scorers") / settings.model / f"kvzap-{key}"
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "settings.json").exists():
        write_atomic(path / "settings.json", json.dumps(identity, indent=1, sort_keys=True) + "\n")
    return path


def kvzip_plus_press():
    """kvpress's KVzipPress as ``configs/press/kvzip_plus.yaml`` builds it (at ratio 0.5: the ratio selects, the
    scores do not depend on it, :data:`evaluation.kvzip_path.SELECTION_FIELDS`)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"compression_ratio": 0.5, "press": OmegaConf.load(KVZIP_PLUS_CONFIG)})
    return instantiate(cfg.press)


@dataclass
class DocumentTargets:
    """One document's features and scores.

    Attributes:
        features: ``(L, n, D)`` float32, the attention layers' inputs at the scored positions.
        scores: ``(L, G, n)`` float32, KVzip+'s raw scores there (log them for the targets).
        start, end: the scored positions ``[start, end)`` of the prefill's ``T`` tokens.
        seconds: ``{"prefill": s, "kvzip": s}``.
    """

    features: torch.Tensor
    scores: torch.Tensor
    start: int
    end: int
    seconds: dict


def document_targets(model, pipe, press, text: str) -> DocumentTargets:
    """Prefill ``text`` as an evaluation context and score it with the project's KVzip path.

    Args:
        model: the causal LM (sdpa attention, as the harness loads it).
        pipe: the harness's :class:`evaluation.pipeline.TextGenerationPipeline` on ``model``.
        press: :func:`kvzip_plus_press`'s press.
        text: the document.
    """
    from transformers import DynamicCache

    from evaluation import kvzip_path
    from evaluation.replay import PrefillCapture
    from presses.core.model import language_model

    context_ids = pipe.preprocess(text, [""], "", max_context_length=10**9)["context_ids"].to(model.device)
    start = time.perf_counter()
    with torch.inference_mode(), PrefillCapture(model) as capture:
        model.model(input_ids=context_ids, past_key_values=DynamicCache())
    prefilled = time.perf_counter()
    span: list[int] = []  # kvpress's (start_idx, end_idx) of every reconstruction chunk

    def chunk(module, args, kwargs):
        span.extend((press.start_idx, press.end_idx))

    handle = language_model(model).register_forward_pre_hook(chunk, with_kwargs=True)
    try:
        with torch.inference_mode():
            (scores,) = kvzip_path.score([press], model, capture, context_ids).values()
    finally:
        handle.remove()
    lo, hi = min(span), max(span)
    features = torch.stack([layer[1]["hidden_states"][0, lo:hi] for layer in capture.layers]).float()
    seconds = {"prefill": prefilled - start, "kvzip": time.perf_counter() - prefilled}
    return DocumentTargets(features.cpu(), scores[:, 0, :, lo:hi].float().cpu(), lo, hi, seconds)


def milestone_docs(train: list, tokens: list[int]) -> dict[int, int]:
    """Per token count, the number of leading training documents (``train``, in order) whose manifest tokens first
    reach it (all of them when the corpus holds fewer)."""
    cumulative = np.cumsum([d.tokens for d in train])
    return {n: min(int(np.searchsorted(cumulative, n)) + 1, len(train)) for n in tokens}


def _mallopt() -> None:
    """Keep glibc from returning the reconstruction pass's large buffers to the kernel after every layer (mmap and
    trim disabled): measured 44 s -> 23 s per 2k-token document on one core; it changes no number."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc
    libc.mallopt(-4, 0)  # M_MMAP_MAX
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


def _log_targets(scores: torch.Tensor) -> torch.Tensor:
    """``(n, L, G)`` log-scores from ``(L, G, n)`` scores (a zero score gives ``-inf``: left out of the fits)."""
    return scores.permute(2, 0, 1).log()


def _row_sample(n: int, k: int, seed: int, position: int) -> np.ndarray:
    return np.sort(np.random.default_rng([seed, position]).choice(n, size=min(k, n), replace=False))


def _atomic_savez(path: Path, **arrays) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _worker(
    settings: Settings, work: Path, n_train: int, n_heldout: int, milestones: list[int], worker: int, workers: int
) -> None:
    """Compute the first ``n_heldout`` held-out documents ``worker, worker + workers, ...`` and the training
    documents of the shards ``s = worker mod workers`` up to position ``n_train``, resuming where each stopped."""
    from filelock import FileLock, Timeout

    from evaluation.models import load_model
    from evaluation.pipeline import TextGenerationPipeline

    torch.set_num_threads(settings.threads)
    _mallopt()
    shards = [s for s in range(SHARDS) if s % workers == worker]
    locks = [FileLock(work / f"shard{s}.lock") for s in shards]
    try:
        for lock in locks:
            lock.acquire(timeout=0)
    except Timeout:
        raise RuntimeError(
            f"another process is computing targets in {work} (its lock {lock.lock_file} is held)"
        ) from None
    try:
        model, tokenizer = load_model(settings.model)
        pipe = TextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)
        press = kvzip_plus_press()
        train, heldout = corpus.split(settings.seed)
        cfg = model.config
        log = (work / f"timings.w{worker}.jsonl").open("a")

        def note(kind: str, position: int, doc, result: DocumentTargets, extra: float) -> None:
            row = {"kind": kind, "position": position, "id": doc.id, "rows": result.end - result.start}
            row.update({k: round(v, 3) for k, v in result.seconds.items()}, store=round(extra, 3))
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(
                f"[w{worker}] {kind} {position} {doc.id} rows {row['rows']} "
                + " ".join(f"{k} {v:.1f}s" for k, v in row.items() if k in ("prefill", "kvzip", "store")),
                flush=True,
            )

        (work / "heldout").mkdir(exist_ok=True)
        for i, doc in enumerate(heldout[:n_heldout]):
            path = work / "heldout" / f"{doc.id}.npz"
            if i % workers != worker or path.exists():
                continue
            result = document_targets(model, pipe, press, doc.text)
            t0 = time.perf_counter()
            _atomic_savez(path, scores=result.scores.numpy(), start=result.start, end=result.end)
            note("heldout", i, doc, result, time.perf_counter() - t0)

        (work / "rows").mkdir(exist_ok=True)
        states = {}
        for s in shards:
            (work / f"shard{s}").mkdir(exist_ok=True)
            running = work / f"shard{s}" / "running.npz"
            if running.exists():
                moments, extra = Moments.load(running)
                states[s] = [moments, int(extra["next"])]
            else:
                states[s] = [Moments.zeros(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads), s]
        for position in range(n_train):
            s = position % SHARDS
            if s not in states or position < states[s][1]:
                continue
            moments = states[s][0]
            for k in milestones:  # every shard document before k is merged, none after
                snapshot = work / f"shard{s}" / f"docs{k:05d}.npz"
                if k <= position and not snapshot.exists():
                    moments.save(snapshot)
            doc = train[position]
            result = document_targets(model, pipe, press, doc.text)
            t0 = time.perf_counter()
            y = _log_targets(result.scores)  # (n, L, G)
            x = result.features.permute(1, 0, 2)  # (n, L, D)
            finite = torch.isfinite(y).all(-1)  # (n, L)
            for layer in range(cfg.num_hidden_layers):
                keep = finite[:, layer]
                moments.add(layer, x[keep, layer], y[keep, layer])
            if settings.mlp_rows_per_doc:
                rows = _row_sample(x.shape[0], settings.mlp_rows_per_doc, settings.seed, position)
                if float(x[rows].abs().max()) >= _FLOAT16_MAX:
                    raise ValueError(f"{doc.id}: a feature exceeds float16's range ({_FLOAT16_MAX:g})")
                _atomic_savez(work / "rows" / f"{position:05d}.npz", x=x[rows].half().numpy(), y=y[rows].numpy())
            states[s][1] = position + SHARDS
            moments.save(work / f"shard{s}" / "running.npz", next=position + SHARDS)
            note("train", position, doc, result, time.perf_counter() - t0)
        for s in shards:  # milestones at the end of the documents computed
            for k in milestones:
                snapshot = work / f"shard{s}" / f"docs{k:05d}.npz"
                if k <= n_train and states[s][1] >= k and not snapshot.exists():
                    states[s][0].save(snapshot)
        log.close()
    finally:
        for lock in locks:
            if lock.is_locked:
                lock.release()


def compute(
    settings: Settings,
    train_tokens: int,
    heldout_docs: int | None = None,
    workers: int = 1,
    root: Path | None = None,
    milestone_tokens: tuple[int, ...] = (),
) -> Path:
    """Compute (or resume) the targets of the first ``heldout_docs`` held-out documents (None: all) and of the
    training documents up to ``train_tokens`` manifest tokens, with ``workers`` processes (each ``settings.threads``
    threads), keeping the moments at ``train_tokens``, :data:`GROWTH_TOKENS` and ``milestone_tokens`` (those not
    passed yet: :func:`shard_moments` names a milestone the run had already passed when it was asked for).

    Returns:
        The work directory (:func:`work_dir`).

    Raises:
        ValueError: ``workers`` outside ``1..SHARDS`` or ``train_tokens`` < 1.
        RuntimeError: another process holds the work directory's shards, or a worker failed.
    """
    if not 1 <= workers <= SHARDS:
        raise ValueError(f"workers={workers} must be between 1 and {SHARDS} (the shards)")
    if train_tokens < 1:
        raise ValueError(f"train_tokens={train_tokens} must be >= 1")
    work = work_dir(settings, root)
    train, heldout = corpus.split(settings.seed)
    n_heldout = len(heldout) if heldout_docs is None else min(heldout_docs, len(heldout))
    docs = milestone_docs(train, sorted({*GROWTH_TOKENS, *milestone_tokens, train_tokens}))
    n_train = docs[train_tokens]
    milestones = sorted(set(docs.values()))
    wanted = [work / f"shard{s}" / f"docs{k:05d}.npz" for s in range(SHARDS) for k in milestones if k <= n_train]
    wanted += [work / "heldout" / f"{doc.id}.npz" for doc in heldout[:n_heldout]]
    if all(path.exists() for path in wanted):  # computed (perhaps by a run going further): no worker, no lock
        return work
    if workers == 1:
        _worker(settings, work, n_train, n_heldout, milestones, 0, 1)
        return work
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=_worker, args=(settings, work, n_train, n_heldout, milestones, w, workers))
        for w in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [w for w, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        raise RuntimeError(
            f"target workers {failed} failed (exit codes {[procs[w].exitcode for w in failed]}): "
            f"run the command again to resume in {work}"
        )
    return work


def shard_moments(work: Path, k: int) -> Moments:
    """The moments of the first ``k`` training documents: the shards' milestone files merged in shard order.

    Raises:
        FileNotFoundError: a shard has no milestone at ``k`` (the targets were not computed that far, or ``k`` is
            not a milestone of the run), naming the file.
    """
    total = None
    for s in range(SHARDS):
        path = work / f"shard{s}" / f"docs{k:05d}.npz"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist: the targets of the first {k} training documents are "
                "not computed (run the training command with that many training tokens)"
            )
        moments, _ = Moments.load(path)
        total = moments if total is None else total.merge(moments)
    return total


def train_rows(work: Path, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The MLP rows of the first ``k`` training documents, in order: features ``(N, L, D)`` float16 and log-score
    targets ``(N, L, G)`` float32 (``-inf`` where a score was zero).

    Raises:
        FileNotFoundError: a document's rows are missing, naming the file.
    """
    xs, ys = [], []
    for position in range(k):
        path = work / "rows" / f"{position:05d}.npz"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist: the MLP rows of training document {position} are not "
                "computed (run the training command with that many training tokens)"
            )
        with np.load(path) as data:
            xs.append(data["x"])
            ys.append(data["y"])
    return np.concatenate(xs), np.concatenate(ys)


def heldout_scores(work: Path, seed: int) -> list[tuple]:
    """``(document, scores (L, G, n) float32, start, end)`` of every held-out document computed, by id."""
    _, heldout = corpus.split(seed)
    out = []
    for doc in heldout:
        path = work / "heldout" / f"{doc.id}.npz"
        if path.exists():
            with np.load(path) as data:
                out.append((doc, data["scores"], int(data["start"]), int(data["end"])))
    return out
