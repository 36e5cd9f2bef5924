"""Page-EntroKV with reconstruction observers: the queries of KVzip's context-reconstruction pass observe every page
(docs/methods.md §1.16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from kvpress import KVzipPress

from presses.base import Capabilities, RemovedField
from presses.core.model import attention_modules
from presses.core.observer import attention_logit_options, window_queries
from presses.kernels import column_maxes
from presses.kvzip_pages.base import KVzipResearchPress
from presses.page_entrokv.press import PageEntroKVPress

__all__ = ["PageEntroKVReconstructionPress", "SELECTION_FIELDS"]

_DEFAULTS = PageEntroKVPress  # the page fields' defaults are Page-EntroKV's, but pooling and protect (tuned here)

#: The fields of :class:`PageEntroKVReconstructionPress` only the selection reads (its :meth:`pages`): one
#: reconstruction pass serves every value of them (``evaluation.kvzip_path``).
SELECTION_FIELDS = (
    "compression_ratio",
    "layerwise",
    "window_size",
    "page_size",
    "alpha",
    "tau",
    "pooling",
    "page_score",
    "protect",
    "group_selection",
    "max_fallback",
    "on_budget_conflict",
)


@dataclass
class PageEntroKVReconstructionPress(KVzipResearchPress):
    """Page-EntroKV whose observers are the queries of a context-reconstruction pass, so pages are chosen without
    the question.

    Page-EntroKV's default observers are the prompt's last ``window_size`` queries: with the question after the
    compression they know nothing of it, and the pages they favour are the end of the context. Here, as in KVzip,
    the model reads its own cache again and is asked to repeat the context chunk by chunk (kvpress's ``KVzipPress``
    pass, unchanged: ``chunk_size`` tokens per chunk, the prefill's cache reused, its cost KVzip's); every query of
    that pass is an observer. For each layer and query head, a context position's observer attention is the most
    attention a reconstruction query of its chunk pays it (each chunk's queries see the sinks, their chunk and
    themselves, as KVzip's scoring does; KVzip then also takes the max over the group's heads), computed through the
    column-max kernel (:func:`presses.kernels.column_maxes`: Triton on CUDA, the torch reference elsewhere); the
    sinks take their max over the chunks. Those rows then go through Page-EntroKV's pooling and paging
    (:meth:`presses.PageEntroKVPress.score_observed`): by default the max over each GQA group's heads (KVzip's
    reduction) and no protected pages, the development split's choice over Page-EntroKV's own sink-isolated Rényi
    weights and protected sink and window pages (``results/tuning/page_entrokv_reconstruction/``: 14 / 13 of 20 at
    0.75 / 0.9 against 9 / 6; config ``page_entrokv_reconstruction_entropy`` keeps Page-EntroKV's), then block-max
    page scores. The budget:

    - ``layerwise=False`` (default, KVzip's): the ``int(L G T ratio)`` lowest-scored entries over all layers and
      groups are masked (kvpress's ``KVzipPress.compress_post`` on the page scores; the cache stays dense, as
      KVzip's), so layers whose pages the reconstruction needs keep more of them; a group that would lose every
      entry (a prompt of a few tokens) keeps its best one;
    - ``layerwise=True``: Page-EntroKV's own selection in every layer, the strict budget
      ``floor(T (1 - compression_ratio))`` per layer and group (:meth:`presses.PageEntroKVPress.compress_observed`),
      the cache cut to the kept pages (a budget below one page: a partial page of the best tokens, as
      Page-EntroKV's, docs/methods.md §1.12).

    Why a max and not Page-EntroKV's mean over observers: the mean over thousands of reconstruction queries favours
    the tokens every query glances at, while a needle's digits are attended by the one query that copies them
    (measured: docs/methods.md §1.16).

    A press of its own rather than a field of :class:`presses.PageEntroKVPress`: its prefill is kvpress's KVzip
    context manager (a second pass after the prefill, batch size 1), not attention hooks, so what the harness may
    do with it differs (its capabilities).

    Based on KVzip (https://arxiv.org/abs/2505.23416) and Page-EntroKV (paper 000; page policy paper 001 section 7,
    https://arxiv.org/abs/2610.09757).

    Args:
        compression_ratio: fraction of the context evicted, ``[0, 1)``.
        n_sink: leading sink positions, isolated from the entropy and protected (Page-EntroKV) and never evicted
            (KVzip); kvpress's default 4, Page-EntroKV's too.
        chunk_size: tokens reconstructed per forward of the pass (kvpress's ``KVzipPress``).
        window_size, page_size, alpha, tau, page_score, group_selection, max_fallback, on_budget_conflict:
            :class:`presses.PageEntroKVPress`'s, with its defaults and values (its former ``budget`` field, which
            saved runs list as ``"tokens"``: :attr:`removed_fields`).
        pooling: :class:`presses.PageEntroKVPress`'s field, default ``"max"`` here (tuned, see above).
        protect: :class:`presses.PageEntroKVPress`'s field, default ``"none"`` here (tuned, see above).
        layerwise: the budget (see above): ``False`` over all layers (KVzip's default), ``True`` per layer.
        kvzip_plus_normalization: kvpress's field; must stay ``False`` (the scores are attention, not KVzip+'s).

    Raises:
        ValueError: for invalid page fields (naming the value, as :class:`presses.PageEntroKVPress` does) or
            ``kvzip_plus_normalization=True``; kvpress's assertions for KVzip's fields.
    """

    window_size: int = _DEFAULTS.window_size
    page_size: int = _DEFAULTS.page_size
    alpha: float = _DEFAULTS.alpha
    tau: float = _DEFAULTS.tau
    pooling: str = "max"  # tuned on the development split (results/tuning/page_entrokv_reconstruction/)
    page_score: str = _DEFAULTS.page_score
    protect: str = "none"  # tuned with pooling
    group_selection: str = _DEFAULTS.group_selection
    max_fallback: float | None = _DEFAULTS.max_fallback
    on_budget_conflict: str = _DEFAULTS.on_budget_conflict

    #: Page-EntroKV's ``budget`` field, which this press passed on, left with the ablation ladder.
    removed_fields: ClassVar[dict[str, RemovedField]] = {"budget": _DEFAULTS.removed_fields["budget"]}

    @property
    def capabilities(self) -> Capabilities:
        """The press contract (:mod:`presses.base`): a reconstruction pass after the prefill, scored once per example
        in a sweep (``evaluation/kvzip_path.py``; its own scores, not KVzip's); a dense cache, masked
        (``layerwise=False``) or cut per layer (``layerwise=True``): to the same count in every layer, except with
        ``group_selection="union"``, whose union differs from layer to layer (``uneven_layers``)."""
        return Capabilities(
            shares_prefill=False,
            scores_once=True,
            extra_forwards=True,
            selection_fields=SELECTION_FIELDS,
            pass_as=KVzipPress,  # kvpress's pass, unchanged: a sweep shares it with KVzip and KVzip+
            empty_scores=self.empty_scores,  # per query head
            uneven_layers=self.layerwise and self.pages().capabilities.uneven_layers,
        )

    def __post_init__(self):
        if self.kvzip_plus_normalization:
            raise ValueError("kvzip_plus_normalization=True: this press scores attention, not KVzip+'s normalisation")
        self.pages()  # Page-EntroKV checks the page fields, naming the value
        super().__post_init__()

    def pages(self) -> PageEntroKVPress:
        """A Page-EntroKV press with this press's page fields: the pooling, paging and selection (its short-prompt
        warnings logged once per setting of this press, not of each new page press)."""
        fields = {name: getattr(self, name) for name in SELECTION_FIELDS if name != "layerwise"}
        press = PageEntroKVPress(n_sink=self.n_sink, **fields)
        press.__dict__["_warned_settings"] = self.__dict__.setdefault("_warned_settings", set())
        return press

    def prepare(self, model, tokenizer, prev_postfix_size=8):
        """kvpress's chunks, with the scores kept per query head (:meth:`empty_scores`)."""
        chunks = super().prepare(model, tokenizer, prev_postfix_size)
        self.score_val = self.empty_scores(model, self.score_val.shape[-1], self.score_val.device)
        return chunks

    @staticmethod
    def empty_scores(model, context_length: int, device) -> torch.Tensor:
        """Zero scores, one per layer, query head and context position: ``(L, 1, H_Q, T)`` float32 (kvpress's are
        per KV head; ``evaluation.kvzip_path`` takes these from the capabilities when another press leads the pass)."""
        L, H = model.config.num_hidden_layers, model.config.num_attention_heads
        return torch.zeros(L, 1, H, context_length, device=device)

    def score_kvzip(self, module, hidden_states, keys, values, attentions, kwargs):
        """The observer attention of one chunk's reconstruction queries (see the class), into ``score_val``.

        Args:
            module: the attention layer; hidden_states ``(1, n, D)`` the reconstruction queries' inputs; keys,
                values ``(1, G, t, d)`` the cache with the pass's own ``n`` entries last; kwargs the hook's.

        Returns:
            ``(keys, values)`` cut back to the context (kvpress's ``score_kvzip`` contract).
        """
        n = hidden_states.shape[1]
        sink = min(self.n_sink, self.start_idx)
        chunk = self.end_idx - self.start_idx
        observed = torch.cat([keys[:, :, :sink], keys[:, :, self.start_idx : self.end_idx], keys[:, :, -n:]], dim=2)
        queries = window_queries(module, hidden_states, n, kwargs["position_embeddings"])
        t = observed.shape[2]
        scaling, softcap = attention_logit_options(module)
        attn = column_maxes(queries, observed, torch.arange(t - n, t, device=keys.device), scaling, softcap)
        scores = self.score_val[int(module.layer_idx)]  # (1, H_Q, T)
        scores[..., self.start_idx : self.end_idx] = attn[..., sink : sink + chunk]
        scores[..., :sink] = torch.maximum(scores[..., :sink], attn[..., :sink])
        return keys[:, :, : self.context_length], values[:, :, : self.context_length]

    def compress_post(self, model):
        """Page-EntroKV's pooling and pages on each layer's reconstruction observer attention, then the budget over
        all layers (kvpress's masking) or per layer (the cache cut to the kept pages); see the class."""
        self.check_cache(self._cache)
        pages = self.pages()
        self.record_selection(pages)
        modules = attention_modules(model)
        if not self.layerwise:
            G, T = self._cache.layers[0].keys.shape[1], self.score_val.shape[-1]
            scores = torch.stack([pages.score_observed(self.score_val[int(m.layer_idx)], G) for m in modules])
            protected = pages.protected_positions(T, scores.device)
            self.score_val = scores.masked_fill(protected, float(scores.amax()) + 1.0)  # above every layer's pages
            # the sinks raised too, the lowest masked over all layers, never an empty head (docs/methods.md §1.12)
            KVzipResearchPress.compress_post(self, model)
            return
        # the statistics' observer count: the context positions the pass reconstructed (one copy query each; the
        # chat template's prefix, which it does not reconstruct, scores 0)
        observers = int((self.score_val[0, 0, 0, self.n_sink :] > 0).sum())
        for module in modules:
            i = int(module.layer_idx)
            layer = self._cache.layers[i]
            layer.keys, layer.values = pages.compress_observed(
                module, layer.keys, layer.values, self.score_val[i], observers
            )

    def summary(self) -> dict[str, Any]:
        """The selection's statistics of the last prefill (:meth:`presses.PageEntroKVPress.summary`)."""
        last = self.selection()
        if last is None:
            return {}
        if not self.layerwise:  # kvpress's masking: the harness counts the masked entries
            return {"observers_from": "reconstruction", "budget_over": "layers"}
        return {**last.summary(), "observers_from": "reconstruction", "budget_over": "layer"}
