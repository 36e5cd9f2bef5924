"""KVzip's selection on KVzap's learned scores read during the prefill: KVzip's allocation over all layers and KV
heads at one prefill's cost (docs/methods.md §1.19)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress import KVzapPress

from presses.base import Capabilities
from presses.core.model import attention_modules
from presses.kvzip_pages.base import KVzipResearchPress
from presses.kvzip_pages.press import KVzipPagePress

__all__ = ["KVzapGlobalPress", "KVzapGlobalPagePress"]


def _linear_kvzap() -> KVzapPress:
    return KVzapPress(model_type="linear")


@dataclass
class KVzapScored(KVzipResearchPress):
    """A KVzip press whose scores come from KVzap's surrogate in the prefill instead of KVzip's reconstruction pass.

    During the prefill a hook on every attention module reads the layer's input hidden states ``(B, T, D)`` and
    records KVzap's predicted log-scores ``(B, G, T)`` (kvpress's ``KVzapPress.score``: one linear layer, or the MLP,
    per layer, arXiv 2601.07891); when the prefill ends they become KVzip's ``score_val`` ``(L, B, G, T)`` and the
    subclass's KVzip selection runs on them (kvpress's ``compress_post``: the lowest ``int(L B G T ratio)`` over all
    layers and heads masked, the first ``n_sink`` positions last). No reconstruction forward runs: the cost is the
    prefill's plus the surrogate's products. The scorer is the field ``press``, which
    :func:`evaluation.registry.attach_kvzap` gives the weights trained for the model.
    """

    press: KVzapPress = field(default_factory=_linear_kvzap)

    @property
    def capabilities(self) -> Capabilities:
        """The press contract (:mod:`presses.base`): kvpress's head-wise masks for decoding, so no shared replay, but
        its scores are the uncompressed prefill's and do not depend on the ratio: a sweep computes them once per
        example from its shared prefill (:meth:`scores_from_prefill`) and selects per ratio
        (``evaluation/kvzip_path.py``)."""
        return Capabilities(shares_prefill=False, scores_once=True, prefill_scores=self.scores_from_prefill)

    def __post_init__(self):
        if not isinstance(self.press, KVzapPress):
            raise ValueError(f"press={self.press!r} must be a kvpress KVzapPress")
        kvzip_log = logging.getLogger("kvpress.presses.kvzip_press")
        level = kvzip_log.level
        kvzip_log.setLevel(logging.ERROR)  # its warning of the reconstruction pass's cost: no such pass here
        try:
            super().__post_init__()
        finally:
            kvzip_log.setLevel(level)

    def _reset_internal_parameters(self):
        super()._reset_internal_parameters()
        self.__dict__["_prefill_scores"] = {}

    def post_init_from_model(self, model):
        """The scorer's weights (kvpress's ``KVzapPress.post_init_from_model``; the project's when attached), then
        the KVzip press's own setup."""
        self.press.post_init_from_model(model)
        super().post_init_from_model(model)

    @contextmanager
    def __call__(self, model):
        """The KVzip press's context manager (:class:`presses.kvzip_pages.base.KVzipResearchPress`) with the scoring
        hooks on the attention modules while it is open."""
        self._reset_internal_parameters()
        hooks = [m.register_forward_hook(self._record_scores, with_kwargs=True) for m in attention_modules(model)]
        try:
            with super().__call__(model):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def _record_scores(self, module, args, kwargs, output):
        hidden_states = kwargs["hidden_states"]
        position = kwargs.get("cache_position")
        if position is not None and int(position[0]) != 0:
            return output  # not a prefill from the start (a later forward): nothing to score
        scores = self.press.score(module, hidden_states, None, None, None, kwargs)  # (B, G, T)
        self.__dict__["_prefill_scores"][int(module.layer_idx)] = scores.detach().float()
        return output

    def _recorded_scores(self, model) -> torch.Tensor:
        """The scores the hooks recorded, ``(L, B, G, T)``.

        Raises:
            RuntimeError: when a layer recorded no scores (the prefill did not run through the hooks).
        """
        recorded = self.__dict__.get("_prefill_scores", {})
        n_layers = len(attention_modules(model))
        missing = [i for i in range(n_layers) if i not in recorded]
        if missing:
            raise RuntimeError(f"{type(self).__name__}: no KVzap scores recorded for layers {missing} in the prefill")
        return torch.stack([recorded[i] for i in range(n_layers)])

    def _perform_kvzip_compression(self, model, tokenizer):
        """The recorded scores as ``score_val``, then the selection (no reconstruction pass)."""
        self.context_length = self._context_ids.shape[1]
        self.score_val = self._recorded_scores(model)
        self.compress_post(model)

    def scores_from_prefill(self, model, layer_calls) -> torch.Tensor:
        """The scores the press's own prefill would record, ``(L, B, G, T)``, from a prefill recorded elsewhere: the
        hook run on ``layer_calls[i] = (args, kwargs, output)``, attention layer ``i``'s call in an uncompressed
        prefill from position 0 (its capability ``prefill_scores``; a sweep's shared prefill,
        ``evaluation.kvzip_path``).

        Raises:
            RuntimeError: when ``layer_calls`` lacks a layer, or a call is not a prefill from position 0.
        """
        self.press.post_init_from_model(model)
        self.__dict__["_prefill_scores"] = {}
        try:
            for module, (args, kwargs, output) in zip(attention_modules(model), layer_calls):
                self._record_scores(module, args, kwargs, output)
            return self._recorded_scores(model)
        finally:
            self.__dict__["_prefill_scores"] = {}


@dataclass
class KVzapGlobalPress(KVzapScored):
    """KVzap's learned scores with KVzip's selection: all layers and KV heads ranked at once, evicted entries masked.

    KVzap (arXiv 2601.07891) predicts KVzip+'s scores (arXiv 2505.23416) from the hidden states; kvpress's
    ``KVzapPress`` ranks them per layer and head under the layer's budget, and kvpress's ``DMSPress`` thresholds them
    (every layer and head keeps what scores above ``threshold``, so the budget follows the scores but the ratio is
    what the threshold gives). This press keeps the ratio and lets the budget follow the scores as KVzip does: the
    lowest ``int(L B G T compression_ratio)`` predicted scores over all layers and KV heads are masked for decoding
    (kvpress's attention patch; the cache keeps its memory, as KVzip's), the first ``n_sink`` positions last, and a
    head that would lose every entry keeps its best one. The cost is one prefill (docs/methods.md §1.19).

    Args:
        press: the kvpress ``KVzapPress`` whose scores rank the entries (default: the linear surrogate).
        compression_ratio: fraction of the cached pairs masked, ``[0, 1)``.
        layerwise, n_sink: kvpress's ``KVzipPress`` (``layerwise=True``: the same count per layer).

    Raises:
        ValueError: for a ``press`` that is not a ``KVzapPress``; kvpress's assertions for the other fields.
    """


@dataclass
class KVzapGlobalPagePress(KVzapScored, KVzipPagePress):
    """KVzap's learned scores with KVzip's selection by pages: every page of ``page_size`` positions of each KV head
    scores its best predicted entry, and the lowest pages over all layers and heads are masked
    (:class:`presses.KVzipPagePress`'s selection on :class:`KVzapGlobalPress`'s scores; docs/methods.md §1.19).

    Based on KVzap (https://arxiv.org/abs/2601.07891), KVzip (https://arxiv.org/abs/2505.23416) and ChunkKV
    (https://arxiv.org/abs/2502.00299).

    Args:
        press: the kvpress ``KVzapPress`` whose scores rank the entries (default: the linear surrogate).
        compression_ratio: fraction of the cached pairs masked, ``[0, 1)``.
        page_size: positions per page, ``>= 1`` (32, as :class:`presses.KVzipPagePress`; not tuned here).
        layerwise, n_sink: kvpress's ``KVzipPress``.

    Raises:
        ValueError: for a ``press`` that is not a ``KVzapPress`` or ``page_size < 1``; kvpress's assertions.
    """
