"""Probabilistic KV eviction with decode-time SNIS correction (paper 003; SPEC section 3)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress import BasePress
from torch import nn
from transformers import QuantizedCache

from presses.budget import BUDGETS, search_num_samples, sample_counts
from presses.prefill_attention import prefill_statistics
from presses.proposals import PROPOSALS, compute_proposal
from presses.snis_attention import (
    SUPPORTED_ATTENTION,
    SNISLayerState,
    clear_snis_state,
    install_snis_attention,
    snis_bias,
)

__all__ = ["ProbabilisticEvictionPress"]


@dataclass
class ProbabilisticEvictionPress(BasePress):
    """Sample the kept entries from a proposal and correct decoding by self-normalised importance sampling.

    Per layer and KV group, build a proposal ``pi`` over the ``t`` prompt entries
    (:mod:`presses.proposals`, paper 003 appendix H / D), pick the number of draws ``m`` whose
    expected kept count is ``(1 - compression_ratio) t`` (:mod:`presses.budget`, appendix F), draw
    ``m`` samples with replacement, keep exactly the entries drawn at least once, and store each layer
    dense, padded to its largest kept count (padding masked). At decode the kept prompt entries get
    the logit bias ``(log c_i - log m - log pi_i) / tau`` (Algorithm 1 with eq. 10), entries written
    after eviction get 0 and padding ``-inf`` (:mod:`presses.snis_attention`; sdpa and eager).

    ``budget="global"`` (the paper's setting, F.1) uses ONE ``m`` for all groups of all layers of a
    request, chosen so the mean expected kept count over them hits the target. To see every layer's
    proposal first, eviction of all layers is deferred to a forward hook on the language model (after
    the last layer and norm of the prefill); this is exact because the prefill itself attends over the
    full cache and cache entries are only read again at decode. ``budget="head"`` evicts in each
    layer's own hook with one ``m`` per group.

    The generator is re-seeded with ``seed`` at every prefill, so a request's draws do not depend on
    the requests before it. At least one draw is made per group (``m >= 1``).

    Parameters:
        compression_ratio: target fraction ``r*`` of prompt entries to evict, in ``[0, 1)``.
        proposal: ``"min"``, ``"min_h"``, ``"h2o"``, ``"h2o_h"`` (appendix H) or a kvpress scorer
            adapter ``"snapkv"``, ``"tova"``, ``"knorm"`` (appendix D, softmax of the score).
        correction: apply the SNIS correction; ``False`` is the "uncorrected" estimator.
        tau: importance-weight temperature (eq. 10), ``> 0``; ``inf`` = no correction.
        budget: ``"global"`` or ``"head"`` (per KV group).
        proposal_temperature: ``T``, ``pi ~ pi ** (1/T)`` / ``softmax(score / T)`` (appendix D.1).
        uniform_mix: weight ``a`` of the uniform in ``pi' = (1 - a) pi + a / t`` (appendix D.1).
        seed: seed of the sampling generator.
        block_size: query rows per block for the all-row proposals (prefill attention and recompute alike).
        window_size, kernel_size: SnapKV adapter parameters.
        score_normalization: ``"softmax"`` (SPEC) or ``"sum"`` (appendix D eqs. 17, 20) for adapters.
    """

    compression_ratio: float = 0.0
    proposal: str = "min_h"
    correction: bool = True
    tau: float = 1.0
    budget: str = "global"
    proposal_temperature: float = 1.0
    uniform_mix: float = 0.0
    seed: int = 0
    block_size: int = 128
    window_size: int = 64
    kernel_size: int = 5
    score_normalization: str = "softmax"
    _pending: dict = field(default_factory=dict, init=False, repr=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False)
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _seq_len: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        if not (0.0 <= self.compression_ratio < 1.0):
            raise ValueError(f"compression_ratio={self.compression_ratio} must be in [0, 1)")
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal={self.proposal!r} must be one of {PROPOSALS}")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget={self.budget!r} must be one of {BUDGETS}")
        if not (self.tau > 0):
            raise ValueError(f"tau={self.tau} must be > 0 (inf = no correction)")
        if not (self.proposal_temperature > 0):
            raise ValueError(f"proposal_temperature={self.proposal_temperature} must be > 0")
        if not (0.0 <= self.uniform_mix <= 1.0):
            raise ValueError(f"uniform_mix={self.uniform_mix} must be in [0, 1]")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.score_normalization not in ("softmax", "sum"):
            raise ValueError(f"score_normalization={self.score_normalization!r} must be 'softmax' or 'sum'")

    # ------------------------------------------------------------------ per-request state
    def _reset(self) -> None:
        self._pending = {}
        self._stats = {}
        self._generator = None
        self._seq_len = 0

    def _get_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    # ------------------------------------------------------------------ eviction
    def _evict(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor,
               num_samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw, keep the drawn entries, pad the layer, and leave the correction on ``module``.

        Args:
            keys, values: ``(B, G, t, d)`` the layer's prefill cache.
            pi: ``(B, G, t)`` group proposals.
            num_samples: int64 ``m`` broadcastable to ``(B, G)``.

        Returns:
            ``(B, G, P, d)`` keys and values, ``P`` the layer's largest kept count.
        """
        B, G, t, d = keys.shape
        m = num_samples.clamp_min(1).expand(B, G)
        counts = sample_counts(pi, m, self._get_generator(pi.device))
        kept = counts > 0
        n_kept = kept.sum(-1)
        P = int(n_kept.max())
        order = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :P]
        valid = torch.arange(P, device=keys.device).view(1, 1, P) < n_kept.unsqueeze(-1)
        rows = (order + torch.arange(B * G, device=keys.device).view(B, G, 1) * t).reshape(-1)  # whole rows
        pad = ~valid.unsqueeze(-1)
        new_keys = keys.reshape(B * G * t, d).index_select(0, rows).view(B, G, P, d).masked_fill_(pad, 0)
        new_values = values.reshape(B * G * t, -1).index_select(0, rows).view(B, G, P, -1).masked_fill_(pad, 0)
        bias = snis_bias(counts, m, pi, self.tau, self.correction).gather(-1, order)
        module._snis_state = SNISLayerState(bias.masked_fill(~valid, float("-inf")))
        self._stats[module.layer_idx] = {
            "padded": P,
            "kept": float(n_kept.double().mean()),
            "m": float(m.double().mean()),
        }
        return new_keys, new_values

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor | None, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Head budget: evict now. Global budget: record the proposal; eviction happens in
        :meth:`finalize` once every layer's proposal is known."""
        module._snis_state = None
        if self.compression_ratio == 0:
            return keys, values
        cache = kwargs.get("past_key_values")
        if isinstance(cache, QuantizedCache):
            raise NotImplementedError("ProbabilisticEvictionPress does not support QuantizedCache")
        self._seq_len = keys.shape[2]
        pi = compute_proposal(self.proposal, module, hidden_states, keys, values, attentions, kwargs,
                              self.proposal_temperature, self.uniform_mix, self.block_size, self.window_size,
                              self.kernel_size, self.score_normalization)
        if self.budget == "head":
            m = search_num_samples(pi, self.compression_ratio)  # (B, G)
            return self._evict(module, keys, values, pi, m)
        self._pending[module.layer_idx] = (module, cache, pi)
        return keys, values

    def finalize(self) -> None:
        """Global budget (paper 003 F.1): one ``m`` per request for all groups of all pending layers,
        matching the MEAN expected kept count to ``(1 - r*) t``; then evict every pending layer."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        layers = sorted(pending)
        pis = torch.stack([pending[i][2] for i in layers], dim=1)  # (B, L, G, t)
        m = search_num_samples(pis, self.compression_ratio, pool_dims=(1, 2)).view(-1, 1)  # (B, 1)
        for i in layers:
            module, cache, pi = pending[i]
            layer = cache.layers[module.layer_idx]
            layer.keys, layer.values = self._evict(module, layer.keys, layer.values, pi, m)

    # ------------------------------------------------------------------ hooks
    def _start_hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length() == 0:
            self._reset()
            clear_snis_state(module)

    def _finish_hook(self, module, args, kwargs, output):
        self.finalize()
        return output

    @contextmanager
    def __call__(self, model):
        """Register the kvpress layer hooks plus a pre/post hook on the language model (reset at each
        prefill / deferred global eviction), install the correcting attention wrapper, and have the prefill's
        attention compute the all-row proposal statistics (:func:`presses.prefill_attention.prefill_statistics`).

        Raises:
            ValueError: if the model's attention implementation is not sdpa or eager.
        """
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"attn_implementation={impl!r} is not supported by ProbabilisticEvictionPress: "
                             f"use one of {SUPPORTED_ATTENTION} (the correction is an additive float mask)")
        install_snis_attention()
        language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
        handles = [
            language_model.register_forward_pre_hook(self._start_hook, with_kwargs=True),
            language_model.register_forward_hook(self._finish_hook, with_kwargs=True),
        ]
        # the all-row proposals' statistics come out of the prefill's own attention (presses.prefill_attention)
        stats = self.proposal if self.compression_ratio > 0 else None
        try:
            with super().__call__(model), prefill_statistics(model, stats, self.block_size):
                yield
        finally:
            for handle in handles:
                handle.remove()

    # ------------------------------------------------------------------ diagnostics
    def summary(self) -> dict[str, float | int | str]:
        """Statistics of the last prefill: logical (kept) and physical (padded) compression per layer
        (comma-separated strings, layer order) and averaged over layers, and the mean draws ``m``."""
        if not self._stats or self._seq_len == 0:
            return {"logical_compression": 0.0, "physical_compression": 0.0, "num_layers_evicted": 0}
        t = self._seq_len
        layers = sorted(self._stats)
        logical = [1.0 - self._stats[i]["kept"] / t for i in layers]
        physical = [1.0 - self._stats[i]["padded"] / t for i in layers]
        return {
            "proposal": self.proposal,
            "budget": self.budget,
            "context_length": t,
            "num_layers_evicted": len(layers),
            "num_samples_mean": sum(self._stats[i]["m"] for i in layers) / len(layers),
            "logical_compression": sum(logical) / len(layers),
            "physical_compression": sum(physical) / len(layers),
            "logical_compression_per_layer": ",".join(f"{x:.4f}" for x in logical),
            "physical_compression_per_layer": ",".join(f"{x:.4f}" for x in physical),
        }

