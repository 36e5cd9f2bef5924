"""The model's own queries on the corpus documents, as the statistics that Q-Filters and expected attention need:
per layer and query head, the moments of the queries before RoPE and after it, accumulated in float64.

Which queries (what kvpress's presses multiply the statistics with):

- kvpress's ``ExpectedAttentionStatsPress`` takes the mean and covariance of the queries **before RoPE** and applies
  the average rotation of the next ``n_future_positions`` itself (``ExpectedAttentionPress.apply_avg_rope``), then
  scores the cache's (rotated) keys; kvpress's own collection (``expected_attention_with_stats.collect_queries``)
  captures the queries before ``apply_rotary_pos_emb``. Here they are kvpress's
  ``kvpress.utils.get_prerope_query_states(module, hidden_states)``, what its ``ExpectedAttentionPress`` computes from
  the context.
- kvpress's ``QFilterPress`` scores ``-(filter . key)`` with the cache's keys, **after RoPE**, so its filter is a
  direction of the rotated queries (what a later query's logit ``q . k`` is made of): the queries above rotated by
  the model's own ``apply_rotary_pos_emb`` with the layer's ``position_embeddings`` of the prefill.

Per document (:func:`document_queries`): the document goes through the harness's pipeline preprocessing (the chat
template, as an evaluation context; the same token ids as :func:`evaluation.train_scorers.targets.document_targets`),
one uncompressed prefill is recorded (:class:`evaluation.replay.PrefillCapture`), and the queries at positions
``n_sink`` and after are kept (kvpress's collection leaves out the first ``n_sink`` positions, attention sinks whose
queries are outliers). Moments are :class:`evaluation.train_scorers.moments.Moments` with no targets, one row of
``x`` per (layer, query head): the count, the mean and the centred cross-products, merged document by document
(pairwise, no cancellation); the uncentred second moment of a group of heads is ``sum (C + n m m^T)``.

Storage (:func:`compute`): one work directory per :class:`Settings` in the model cache (:func:`work_dir`); documents
in the corpus's seeded training order; the moments after every document with its resume point
(``running.pre.npz``, ``running.post.npz``), kept at each milestone (the first ``k`` documents:
``docs<k>.pre.npz``, ``docs<k>.post.npz``), so a killed run continues at its next document and both commands
(``qfilter``, ``ea_stats``) read one pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from evaluation.atomic import write_atomic
from evaluation.train_scorers import corpus
from evaluation.train_scorers.moments import Moments

__all__ = [
    "DEFAULT_TRAIN_TOKENS",
    "GROWTH_TOKENS",
    "N_SINK",
    "QueryMoments",
    "Settings",
    "compute",
    "context_ids",
    "document_queries",
    "layer_queries",
    "seconds",
    "work_dir",
]

#: Training tokens of the committed statistics (about 30 documents). A mean of 64 numbers, a 64 x 64 covariance
#: (2,080 free values) and one principal direction per head are estimated from as many queries per head; kvpress's
#: hub statistics use 100 BookSum samples cut to 1,000 characters (about 25k tokens). The held-out fit at
#: :data:`GROWTH_TOKENS` shows what more would add (results/scorers/<model>/qfilter_fit.md, ea_stats_fit.md).
DEFAULT_TRAIN_TOKENS = 50_000
#: Smaller training-token counts fitted and reported beside it by default (prefixes of the same pass).
GROWTH_TOKENS = (10_000, 20_000)


def _kvpress_n_sink() -> int:
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStatsPress

    return ExpectedAttentionStatsPress.n_sink  # the dataclass default


#: Leading positions whose queries are left out: kvpress's default ``n_sink`` (ExpectedAttentionStatsPress).
N_SINK = _kvpress_n_sink()


@dataclass(frozen=True)
class Settings:
    """What a query pass depends on (its work directory's key).

    Attributes:
        model: the model's name for :func:`evaluation.models.load_model`.
        seed: the corpus split's seed.
        threads: torch's CPU threads (moments are bit-equal for one thread count).
        n_sink: leading positions left out of every document.
    """

    model: str = "smollm2-135m"
    seed: int = 0
    threads: int = 1
    n_sink: int = N_SINK

    def __post_init__(self):
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1")
        if self.n_sink < 0:
            raise ValueError(f"n_sink={self.n_sink} must be >= 0")

    def identity(self) -> dict:
        """These fields, the corpus and the library versions."""
        import kvpress
        import transformers

        return {
            **dataclasses.asdict(self),
            "corpus_sha256": corpus.corpus_sha256(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvpress": getattr(kvpress, "__version__", "unknown"),
        }


@dataclass
class QueryMoments:
    """Moments of the queries of the first ``docs`` training documents.

    Attributes:
        pre: :class:`Moments` of the queries before RoPE, row ``l * H + h`` for layer ``l`` and query head ``h``.
        post: the same after RoPE.
        layers, heads: ``L`` and ``H`` (query heads).
        docs, tokens: training documents and queries (per head) in the moments.
    """

    pre: Moments
    post: Moments
    layers: int
    heads: int
    docs: int = 0

    @property
    def tokens(self) -> int:
        return int(self.pre.count[0])

    @classmethod
    def zeros(cls, layers: int, heads: int, head_dim: int) -> QueryMoments:
        return cls(
            Moments.zeros(layers * heads, head_dim, 0), Moments.zeros(layers * heads, head_dim, 0), layers, heads
        )

    def add(self, queries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Merge one document's queries (:func:`document_queries`)."""
        for layer, (pre, post) in enumerate(queries):
            none = pre.new_zeros(pre.shape[1], 0)  # no targets: moments of the queries alone
            for head in range(self.heads):
                row = layer * self.heads + head
                self.pre.add(row, pre[head], none)
                self.post.add(row, post[head], none)
        self.docs += 1

    def mean(self, which: str = "pre") -> np.ndarray:
        """``(L, H, d)`` float64: the mean query."""
        m = getattr(self, which)
        return m.mean_x.reshape(self.layers, self.heads, -1)

    def covariance(self, which: str = "pre") -> np.ndarray:
        """``(L, H, d, d)`` float64: the covariance with ``n - 1`` in the denominator (kvpress's
        ``collect_queries``)."""
        m = getattr(self, which)
        d = m.mean_x.shape[1]
        return (m.cxx / (m.count[:, None, None] - 1)).reshape(self.layers, self.heads, d, d)

    def second_moment(self, which: str = "post") -> np.ndarray:
        """``(L, H, d, d)`` float64: the uncentred sum ``sum q q^T`` (``C + n m m^T``)."""
        m = getattr(self, which)
        n = m.count[:, None, None]
        outer = m.cxx + n * m.mean_x[:, :, None] * m.mean_x[:, None, :]
        d = m.mean_x.shape[1]
        return outer.reshape(self.layers, self.heads, d, d)

    def save(self, stem: Path, **extra) -> None:
        """``<stem>.pre.npz`` and ``<stem>.post.npz`` (each atomic; ``extra`` in both)."""
        for which in ("pre", "post"):
            getattr(self, which).save(stem.with_name(f"{stem.name}.{which}.npz"), docs=self.docs, **extra)

    @classmethod
    def load(cls, stem: Path, layers: int, heads: int) -> tuple[QueryMoments, dict]:
        """What :meth:`save` wrote: the moments and the extra arrays.

        Raises:
            ValueError: the two files hold different documents (a run stopped between writing them).
        """
        pre, extra = Moments.load(stem.with_name(f"{stem.name}.pre.npz"))
        post, other = Moments.load(stem.with_name(f"{stem.name}.post.npz"))
        if int(extra["docs"]) != int(other["docs"]):
            raise ValueError(f"{stem}.pre.npz holds {int(extra['docs'])} documents, .post.npz {int(other['docs'])}")
        return cls(pre, post, layers, heads, int(extra.pop("docs"))), extra


def context_ids(pipe, text: str) -> torch.Tensor:
    """``(1, T)``: ``text`` as an evaluation context (the harness's preprocessing, question after it; the ids of
    :func:`evaluation.train_scorers.targets.document_targets`)."""
    return pipe.preprocess(text, [""], "", max_context_length=10**9)["context_ids"]


def prefill(model, ids: torch.Tensor):
    """One uncompressed prefill of ``ids`` recorded (:class:`evaluation.replay.PrefillCapture`)."""
    from transformers import DynamicCache

    from evaluation.replay import PrefillCapture

    with torch.inference_mode(), PrefillCapture(model) as capture:
        model.model(input_ids=ids.to(model.device), past_key_values=DynamicCache())
    return capture


def _rope(module):
    """The model's ``apply_rotary_pos_emb`` (the attention module's modeling module).

    Raises:
        ValueError: the modeling module has none (kvpress's collection supports no such model either).
    """
    modeling = importlib.import_module(type(module).__module__)
    rope = getattr(modeling, "apply_rotary_pos_emb", None)
    if rope is None:
        raise ValueError(f"{type(module).__name__}'s module {modeling.__name__} has no apply_rotary_pos_emb")
    return rope


def layer_queries(module, kwargs: dict, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pre, post)``: one attention layer's queries ``(H, T - start, d)`` float32 at positions ``start`` and after,
    from its recorded forward's ``kwargs``: before RoPE (kvpress's ``get_prerope_query_states``) and after it (the
    model's ``apply_rotary_pos_emb`` with the layer's recorded ``position_embeddings``)."""
    from kvpress.utils import get_prerope_query_states

    with torch.inference_mode():
        pre = get_prerope_query_states(module, kwargs["hidden_states"][:, start:])  # (1, H, T - start, d)
        cos, sin = (x[:, start:] for x in kwargs["position_embeddings"])
        post, _ = _rope(module)(pre, pre, cos, sin)
    return pre[0].float().cpu(), post[0].float().cpu()


def document_queries(capture, model, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per attention layer of the recorded prefill ``capture``, :func:`layer_queries` at positions ``start`` and
    after."""
    from presses.core.model import language_model

    layers = language_model(model).layers
    return [layer_queries(layer.self_attn, kwargs, start) for layer, (_, kwargs, *_r) in zip(layers, capture.layers)]


def work_dir(settings: Settings, root: Path | None = None) -> Path:
    """``<root>/<model>/queries-<hash of the identity>`` (default root: ``<model cache>/scorers``), with
    ``settings.json`` written on first use."""
    from evaluation.models import cache_dir

    identity = settings.identity()
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    path = (root or cache_dir() / "scorers") / settings.model / f"queries-{key}"
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "settings.json").exists():
        write_atomic(path / "settings.json", json.dumps(identity, indent=1, sort_keys=True) + "\n")
    return path


def _stem(work: Path, k: int) -> Path:
    return work / f"docs{k:05d}"


def _kept(work: Path, k: int) -> bool:
    """Whether the moments of the first ``k`` documents are kept (the post-RoPE file is written last)."""
    return (work / f"docs{k:05d}.post.npz").exists()


def compute(settings: Settings, tokens: list[int], root: Path | None = None) -> tuple[Path, dict[int, QueryMoments]]:
    """The query moments of the first training documents that reach each count of ``tokens`` (manifest tokens,
    :func:`evaluation.train_scorers.targets.milestone_docs`), computing (or resuming) what is missing, one document
    at a time with ``settings.threads`` threads; the work directory's lock is held meanwhile (a second process
    waits, then finds the moments).

    Returns:
        ``(work directory, {tokens: QueryMoments})``.

    Raises:
        ValueError: a count is < 1.
    """
    from filelock import FileLock

    from evaluation.train_scorers.targets import milestone_docs

    if min(tokens) < 1:
        raise ValueError(f"training tokens {min(tokens)} must be >= 1")
    torch.set_num_threads(settings.threads)
    work = work_dir(settings, root)
    train, _ = corpus.split(settings.seed)
    docs = milestone_docs(train, sorted(tokens))
    wanted = sorted(set(docs.values()))
    with FileLock(work / "queries.lock"):
        if not all(_kept(work, k) for k in wanted):
            _run(settings, work, train, wanted)
        shape = json.loads((work / "shape.json").read_text())
        moments = {k: QueryMoments.load(_stem(work, k), shape["layers"], shape["heads"])[0] for k in wanted}
    return work, {n: moments[docs[n]] for n in tokens}


def _run(settings: Settings, work: Path, train: list, wanted: list[int]) -> None:
    from evaluation.models import load_model
    from evaluation.pipeline import TextGenerationPipeline
    from presses.core.model import text_config

    model, tokenizer = load_model(settings.model)
    pipe = TextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)
    config = text_config(model)
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    write_atomic(work / "shape.json", json.dumps({"layers": layers, "heads": heads, "head_dim": head_dim}) + "\n")
    running, position = work / "running", 0
    if running.with_name("running.post.npz").exists():
        try:
            moments, extra = QueryMoments.load(running, layers, heads)
            position = int(extra["next"])
        except ValueError as err:  # stopped between its two files: the pass again (minutes)
            print(f"queries: {err}; again", flush=True)
    behind = [k for k in wanted if k < position and not _kept(work, k)]
    if behind:  # a milestone asked for after the pass went past it: the pass again (minutes)
        print(f"queries: the pass in {work} went past {behind[0]} documents without keeping them; again", flush=True)
        position = 0
    if position == 0:
        moments = QueryMoments.zeros(layers, heads, head_dim)
    with (work / "timings.jsonl").open("a") as log:
        while position < wanted[-1]:
            for k in wanted:  # every document before k is merged, none after
                if k == position and not _kept(work, k):
                    moments.save(_stem(work, k))
            doc = train[position]
            t0 = time.perf_counter()
            ids = context_ids(pipe, doc.text)
            queries = document_queries(prefill(model, ids), model, settings.n_sink)
            t1 = time.perf_counter()
            moments.add(queries)
            position += 1
            moments.save(running, next=position)
            row = {"position": position - 1, "id": doc.id, "tokens": int(ids.shape[1]), "prefill": round(t1 - t0, 3)}
            row["moments"] = round(time.perf_counter() - t1, 3)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(
                f"queries {row['position']} {doc.id} {row['tokens']} tokens {row['prefill']:.1f}s + "
                f"{row['moments']:.1f}s",
                flush=True,
            )
    for k in wanted:
        if not _kept(work, k) and moments.docs == k:
            moments.save(_stem(work, k))


def seconds(work: Path, docs: int) -> float:
    """Seconds the first ``docs`` documents took (prefill and moments; the last record of each)."""
    seen = {}
    path = work / "timings.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if row["position"] < docs:
            seen[row["position"]] = row["prefill"] + row["moments"]
    return sum(seen.values())
