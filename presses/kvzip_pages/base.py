"""The press contract (:mod:`presses.base`) for this project's subclasses of kvpress's ``KVzipPress``."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from kvpress import KVzipPress

from presses.base import ResearchPress, check_prompt_positions
from presses.core.model import attention_modules, language_model

__all__ = ["KVzipResearchPress"]

logger = logging.getLogger(__name__)


class KVzipResearchPress(ResearchPress, KVzipPress):
    """A kvpress ``KVzipPress`` that is also a :class:`presses.base.ResearchPress`: the harness reads its
    capabilities from the press (scored by KVzip's pass, ``scores_as``; the fields only its selection reads,
    ``selection_fields``), and it keeps its statistics and decode-time state through the contract.

    KVzip's own ``__call__`` does the prefill's bookkeeping (it records the context and the cache, runs the
    reconstruction pass, then ``compress_post``), and it does not enter through kvpress's ``BasePress.__call__``,
    which :mod:`presses.base` tracks: so these presses register no model hooks and reset nothing per prefill
    themselves (``compress_post`` replaces what a previous request left). Their ``__call__`` adds one hook for the
    block's length: a prompt longer than the model's positions is refused when its prefill starts
    (:func:`presses.base.check_prompt_positions`), as for every press of the project.
    """

    @contextmanager
    def __call__(self, model):
        """kvpress's ``KVzipPress.__call__``, with the prefill's length checked against the model's positions.

        Raises:
            ValueError: when the prefill has more tokens than ``max_position_embeddings``.
        """
        handle = language_model(model).register_forward_pre_hook(self._check_prefill_length, with_kwargs=True)
        try:
            with KVzipPress.__call__(self, model):
                yield
        finally:
            handle.remove()

    def _check_prefill_length(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length() == 0:  # the prefill, not the reconstruction pass
            check_prompt_positions(module, args, kwargs, type(self).__name__)

    def model_hooks(self, model) -> list:
        """None (see the class)."""
        return []

    def selection(self):
        """The press that made the last prefill's selection (the subclass's ``compress_post`` records it with
        :meth:`record_selection`), for its statistics; None before the first prefill or after :meth:`reset`."""
        return self.__dict__.get("_last")

    def record_selection(self, press) -> None:
        """Keep ``press`` as the last prefill's selection (outside the dataclass fields: not a setting)."""
        self.__dict__["_last"] = press

    def reset(self) -> None:
        """Forget the last prefill's selection and its statistics."""
        self.__dict__.pop("_last", None)

    def compress_post(self, model):
        """kvpress's KVzip selection on ``self.score_val`` (the lowest ``int(L B G T ratio)`` masked over all layers
        and heads, per layer with ``layerwise``, the first ``n_sink`` positions last); a head that would lose every
        entry keeps its best one (:meth:`keep_one_per_head`)."""
        super().compress_post(model)
        if self.compression_ratio > 0:
            self.keep_one_per_head(model)

    def keep_one_per_head(self, model) -> int:
        """After kvpress's masking (``KVzipPress.compress_post``), give back to every KV head that lost all its
        entries its best-scored one: never an empty head (docs/methods.md §1.12).

        kvpress masks the ``int(L B G T ratio)`` lowest scores over all layers and heads (per layer with
        ``layerwise``), the first ``n_sink`` positions last; on a prompt of a few tokens a head can lose every entry,
        and then decodes on no context at all. Heads that keep one entry or more are left as kvpress masked them.

        Args:
            model: the causal LM whose attention modules hold kvpress's ``masked_key_indices``; ``self.score_val``
                ``(L, B, G, T)`` the scores the masking ranked (ties go to the lower position).

        Returns:
            The number of (layer, batch row, KV head) given back an entry; logged once per press and setting.
        """
        fixed = 0
        for module in attention_modules(model):
            masked = getattr(module, "masked_key_indices", None)
            if masked is None:
                continue
            rows, heads, positions = masked
            scores = self.score_val[int(module.layer_idx)]  # (B, G, T)
            Bsz, G, T = scores.shape
            flat = rows * G + heads
            empty = (torch.bincount(flat, minlength=Bsz * G) >= T).nonzero().flatten()
            if not empty.numel():
                continue
            best = scores.reshape(Bsz * G, T).float().argmax(-1).to(positions.device)  # the first maximum
            give_back = torch.zeros_like(flat, dtype=torch.bool)
            for row in empty.tolist():
                give_back |= (flat == row) & (positions == best[row])
            module.masked_key_indices = (rows[~give_back], heads[~give_back], positions[~give_back])
            fixed += empty.numel()
        setting = (self.compression_ratio, self.layerwise, self.n_sink, getattr(self, "page_size", None))
        warned = self.__dict__.setdefault("_warned_settings", set())
        if fixed and setting not in warned:
            warned.add(setting)
            logger.warning(
                "%s: compression_ratio=%s masked every entry of %d KV heads of a %d-token prompt; each keeps its "
                "best entry instead (docs/methods.md §1.12; logged once per press and setting)",
                type(self).__name__,
                self.compression_ratio,
                fixed,
                self.score_val.shape[-1],
            )
        return fixed
