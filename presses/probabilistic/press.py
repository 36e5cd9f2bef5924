"""Probabilistic KV eviction with decode-time SNIS correction (paper 003; docs/methods.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress import ComposedPress, PrefillDecodingPress, ScorerPress
from torch import nn

from presses import attention
from presses.attention_bias import AttentionBias
from presses.base import KEPT_ENTRIES, SAVED_BEFORE, Capabilities, ResearchPress, kept_entries_text
from presses.core.model import language_model
from presses.core.paging import check_compression_ratio, num_pages
from presses.probabilistic.budget import BUDGETS, DRAWS, layer_generator, sample_counts, search_num_samples
from presses.probabilistic.correction import snis_bias
from presses.probabilistic.page_sampling import UNITS, expand_pages, page_proposal, page_target, page_tolerance
from presses.probabilistic.prefill_attention import request_statistics
from presses.probabilistic.proposals import (
    NORMALIZATIONS,
    check_proposal,
    compute_proposal,
    needs_attention_weights,
    proposal_label,
    proposal_scorer,
)
from presses.probabilistic.survivors import row_fingerprints, surviving_positions

__all__ = ["ProbabilisticEvictionPress"]


@dataclass
class ProbabilisticEvictionPress(ResearchPress):
    """Sample the kept entries from a proposal and correct decoding by self-normalised importance sampling.

    Paper: R. Geh, A. Chen, D. Israel, A. Grover, G. Van den Broeck, *A Probabilistic Interpretation of KV Cache
    Eviction* (paper 003, 2026; the text we work from names no arXiv id). Method, defaults and the choices we
    settled: ``docs/methods.md`` §3 (§3.8 for ``unit="page"``, an extension of ours).

    Per layer and KV group, build a proposal ``pi`` over the ``t`` prompt entries
    (:mod:`presses.probabilistic.proposals`, paper 003 appendix H / D), pick the number of draws ``m`` whose
    expected kept count is ``(1 - compression_ratio) t`` (:mod:`presses.probabilistic.budget`, appendix F), draw
    ``m`` samples with replacement, keep exactly the entries drawn at least once, and store each layer
    dense, padded to its largest kept count (padding masked). At decode the kept prompt entries get
    the logit bias ``(log c_i - log m - log pi_i) / tau`` (Algorithm 1 with eq. 10), entries written
    after eviction get 0 and padding ``-inf`` (:mod:`presses.attention_bias`; sdpa and eager).

    ``budget="global"`` (the paper's setting, F.1) uses ONE ``m`` for all groups of all layers of a
    request, chosen so the mean expected kept count over them hits the target. To see every layer's
    proposal first, eviction of all layers is deferred to a forward hook on the language model (after
    the last layer and norm of the prefill); this is exact because the prefill itself attends over the
    full cache and cache entries are only read again at decode. ``budget="head"`` evicts in each
    layer's own hook with one ``m`` per group.

    Each layer draws from a CPU generator of its own, seeded from ``(seed, layer)``
    (:func:`presses.probabilistic.budget.layer_generator`), so a layer's draws depend only on the seed, the layer
    and its proposal: not on the requests before it, the other layers, the order they evict in, nor the devices
    they live on (``device_map``). ``draws="sequential"`` instead seeds one CPU generator per request and lets the
    layers consume it in layer order (the scheme of the runs committed before this rule; a layer's draws then also
    depend on the layers drawn before it). At least one draw is made per group (``m >= 1``).

    Inside kvpress's wrappers (the press contract, :mod:`presses.base`): alone in a ``ComposedPress`` or as the
    ``prefilling_press`` of a ``PrefillDecodingPress`` it gives the same cache and correction as direct use.
    With ``budget="global"`` it may be the FIRST press of a ``ComposedPress``: its proposals see the whole
    prefill, and its eviction, deferred to the end of the prefill, draws among the entries the later presses
    kept (``pi`` renormalised over them, target ``(1 - compression_ratio)`` of them), so the composition keeps
    ``prod (1 - ratio)`` of the prompt, as ``ComposedPress`` reports. Any other place in a ``ComposedPress``,
    ``budget="head"`` next to another press, and a ``PrefillDecodingPress`` with a decoding press (which would
    evict entries the correction refers to) raise a ``ValueError`` when the prefill starts.

    ``unit="page"`` samples pages instead of tokens (:mod:`presses.probabilistic.page_sampling`; docs/methods.md §3.8):
    the page proposal
    is the token proposal summed over each page of ``page_size`` positions (the last page may be
    partial), ``m`` is searched on the expected number of distinct pages with the target
    ``j*_pages = (1 - r) T / page_size`` and the tolerance ``0.5 / page_size`` pages (the token unit's
    unfloored ``(1 - r) t`` and 0.5-token tolerance divided by the page size, so that ``page_size=1``
    makes exactly the token unit's search, draws and bias; with full pages the expected kept token
    count is then ``(1 - r) T``, as for tokens), every token of a drawn page is kept and
    gets its page's bias ``(log c_p - log m - log pi_p) / tau``. Storage, padding and the decode-time
    correction are those of the token unit. The page unit does not share a ``ComposedPress`` with other presses.

    Any kvpress scorer as the proposal (paper 003 appendix D: a top-k score read as an unnormalised proposal):
    ``proposal=ExpectedAttentionPress()``, or any other ``ScorerPress`` instance, takes the scorer's per-KV-head
    scores ``s`` (``score(module, hidden_states, keys, values, attentions, kwargs)``, shape ``(B, G, t)``) and
    normalises them per group, ``softmax(s / T)`` (``score_normalization="softmax"``, eq. 18) or
    ``s^(1/T) / sum s^(1/T)`` for non-negative scores (``"sum"``, eqs. 17 and 20); ``T`` is ``proposal_temperature``
    (D.1). Only the scorer's ``score`` is called: its own ``compression_ratio`` does not evict anything (a score
    that reads it, like StreamingLLM's window, sees the value the scorer was built with). The names ``"snapkv"``,
    ``"tova"`` and ``"knorm"`` are this path with ``SnapKVPress(window_size, kernel_size)``, ``TOVAPress()`` and
    ``KnormPress()``. A scorer that reads attention weights (``ObservedAttentionPress``) needs eager attention, and
    then the press cannot share a prefill (:attr:`capabilities`). From Hydra the scorer is a nested ``_target_``
    (``configs/press/snis_expected_attention.yaml``).

    Parameters:
        compression_ratio: target fraction ``r*`` of prompt entries to evict, in ``[0, 1)``.
        proposal: ``"min"``, ``"min_h"``, ``"h2o"``, ``"h2o_h"`` (appendix H), a kvpress ``ScorerPress`` instance,
            or the name of one, ``"snapkv"``, ``"tova"``, ``"knorm"`` (appendix D).
        correction: apply the SNIS correction; ``False`` is the "uncorrected" estimator.
        tau: importance-weight temperature (eq. 10), ``> 0``; ``inf`` = no correction.
        budget: ``"global"`` or ``"head"`` (per KV group).
        proposal_temperature: ``T``, ``pi ~ pi ** (1/T)`` / ``softmax(score / T)`` (appendix D.1).
        uniform_mix: weight ``a`` of the uniform in ``pi' = (1 - a) pi + a / t`` (appendix D.1).
        seed: seed of the sampling generator (42, the harness's default run seed).
        block_size: query rows per block for the all-row proposals.
        window_size, kernel_size: parameters of the ``"snapkv"`` name's SnapKVPress.
        score_normalization: how a scorer's scores become the proposal: ``"softmax"`` (default; any real score,
            docs/methods.md §3 item 1) or ``"sum"`` (non-negative scores, appendix D eqs. 17, 20).
        unit: sampling unit, ``"token"`` (paper 003) or ``"page"`` (pages of ``page_size`` positions).
        page_size: positions per page for ``unit="page"``, ``>= 1`` (unused for tokens).
        draws: ``"per_layer"`` (a random stream per (seed, layer)) or ``"sequential"`` (one stream per request in
            layer order, to reproduce runs made before per-layer streams).
    """

    compression_ratio: float = 0.0
    proposal: str | ScorerPress = "min_h"
    correction: bool = True
    tau: float = 1.0
    budget: str = "global"
    proposal_temperature: float = 1.0
    uniform_mix: float = 0.0
    seed: int = 42
    block_size: int = 128
    window_size: int = 64
    kernel_size: int = 5
    score_normalization: str = "softmax"
    unit: str = "token"
    page_size: int = 16
    draws: str = field(default="per_layer", metadata={SAVED_BEFORE: "sequential"})
    _pending: dict = field(default_factory=dict, init=False, repr=False)
    _stats: dict = field(default_factory=dict, init=False, repr=False)
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _seq_len: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        check_compression_ratio(self.compression_ratio)
        check_proposal(self.proposal)
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
        if self.score_normalization not in NORMALIZATIONS:
            raise ValueError(f"score_normalization={self.score_normalization!r} must be one of {NORMALIZATIONS}")
        if self.unit not in UNITS:
            raise ValueError(f"unit={self.unit!r} must be one of {UNITS}")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1")
        if self.draws not in DRAWS:
            raise ValueError(f"draws={self.draws!r} must be one of {DRAWS}")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")

    @property
    def capabilities(self) -> Capabilities:
        """The press contract (:mod:`presses.base`): decode-time state always; with a scorer proposal that reads the
        layers' attention weights (:data:`presses.probabilistic.proposals.ATTENTION_WEIGHT_SCORERS`) also eager
        attention, and then no shared prefill (the scorer alone replays from an eager capture, :mod:`evaluation.replay`;
        this press with it is not tested to, so it runs through kvpress's pipeline)."""
        if needs_attention_weights(self.scorer):
            return Capabilities(shares_prefill=False, decode_state=True, needs_eager=True, uneven_layers=True)
        return Capabilities(decode_state=True, uneven_layers=True)

    @property
    def scorer(self) -> ScorerPress | None:
        """The kvpress scorer behind :attr:`proposal` (a new one for the names ``snapkv``, ``tova``, ``knorm``), or None
        for an attention proposal."""
        return proposal_scorer(self.proposal, self.window_size, self.kernel_size)

    # ------------------------------------------------------------------ per-request state
    def reset(self) -> None:
        """Forget the previous request: pending layers, statistics and the generator (re-seeded at first use)."""
        self._pending = {}
        self._stats = {}
        self._generator = None
        self._seq_len = 0

    def check_wrappers(self, path: list) -> None:
        """Refuse the wrappers this press cannot work in (see the class docstring).

        Raises:
            ValueError: naming the wrapper and what to do instead.
        """
        for i, wrapper in enumerate(path[:-1]):
            inner = path[i + 1]
            if isinstance(wrapper, ComposedPress) and len(wrapper.presses) > 1:
                if self.unit == "page":
                    raise ValueError(
                        "ProbabilisticEvictionPress(unit='page') cannot share a ComposedPress with other "
                        "presses: a later press would select single tokens of the drawn pages"
                    )
                if self.budget == "head":
                    raise ValueError(
                        "ProbabilisticEvictionPress(budget='head') cannot share a ComposedPress with "
                        "other presses: it evicts and pads each layer at once, and a later press "
                        "would select among padding slots; use budget='global' as the first press"
                    )
                if wrapper.presses[0] is not inner:
                    raise ValueError(
                        "ProbabilisticEvictionPress must be the first press of a ComposedPress: its "
                        "proposals need the uncompressed prefill (a press before it removes entries "
                        f"and their positions); got it at position {wrapper.presses.index(inner)}"
                    )
            elif isinstance(wrapper, PrefillDecodingPress) and wrapper.decoding_press is not None:
                raise ValueError(
                    "ProbabilisticEvictionPress cannot be combined with a decoding press in "
                    "PrefillDecodingPress: decoding compression would remove cache entries that its "
                    "decode-time correction refers to"
                )

    def _get_generator(self, layer_idx: int) -> torch.Generator:
        """The CPU generator layer ``layer_idx`` draws from: its own, seeded from ``(seed, layer_idx)``, or with
        ``draws="sequential"`` the request's one generator, seeded with ``seed`` at the request's first draw and
        consumed in the order the layers draw. Always on the CPU, whatever device the layer's proposal lives on
        (with ``device_map``, a generator per device re-seeded at each device change made a layer replay another
        layer's draws; seeded CUDA and CPU draws differ)."""
        if self.draws == "per_layer":
            return layer_generator(self.seed, layer_idx)
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    # ------------------------------------------------------------------ eviction
    def _evict(
        self,
        module: nn.Module,
        cache,
        keys: torch.Tensor,
        values: torch.Tensor,
        pi: torch.Tensor,
        num_samples: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw, keep the drawn entries, pad the layer, and leave the correction with ``cache``.

        Args:
            module, cache: the layer's attention module and the prefill's cache (it keeps the decode-time bias).
            keys, values: ``(B, G, t, d)`` the layer's prefill cache.
            pi: ``(B, G, n)`` group proposals over the sampling units (``n = t`` tokens, or
                ``ceil(t / page_size)`` pages for ``unit="page"``).
            num_samples: int64 ``m`` broadcastable to ``(B, G)``.

        Returns:
            ``(B, G, P, d)`` keys and values, ``P`` the layer's largest kept count.
        """
        B, G, t, d = keys.shape
        m = num_samples.clamp_min(1).expand(B, G)
        counts = sample_counts(pi, m, self._get_generator(module.layer_idx))  # drawn on the CPU (sample_counts)
        kept_units = (counts > 0).sum(-1)
        if self.unit == "page":  # every token of a drawn page is kept, with its page's count and mass
            counts, pi = expand_pages(counts, self.page_size, t), expand_pages(pi, self.page_size, t)
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
        # decoding continues at position T, the prefill's length (t is less when a later press of a ComposedPress cut)
        state = AttentionBias(bias.masked_fill(~valid, float("-inf")), context_length=self._seq_len or t)
        attention.set_decode_bias(cache, module.layer_idx, state)
        self._stats[module.layer_idx] = {
            "padded": P,
            "kept": float(n_kept.double().mean()),
            "m": float(m.double().mean()),
            "kept_units": float(kept_units.double().mean()),
        }
        return new_keys, new_values

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head budget: evict now. Global budget: record the proposal; eviction happens in
        :meth:`finalize` once every layer's proposal is known.

        Raises:
            ValueError: when an earlier press already removed entries of this layer (``keys`` shorter than the
                prefill), which only happens inside a ``ComposedPress`` (see :meth:`check_wrappers`).
        """
        cache = kwargs.get("past_key_values")
        attention.set_decode_bias(cache, module.layer_idx, None)
        if self.compression_ratio == 0:
            return keys, values
        if keys.shape[2] != hidden_states.shape[1]:
            raise ValueError(
                f"ProbabilisticEvictionPress got {keys.shape[2]} cache entries for a prefill of "
                f"{hidden_states.shape[1]} tokens: another press compressed this layer first; it "
                "must be the first press of a ComposedPress"
            )
        self._seq_len = keys.shape[2]
        with torch.no_grad():  # the selection needs no gradient (kvpress's own tests call the model with autograd on)
            pi = compute_proposal(
                self.proposal,
                module,
                hidden_states,
                keys,
                values,
                attentions,
                kwargs,
                self.proposal_temperature,
                self.uniform_mix,
                self.block_size,
                self.window_size,
                self.kernel_size,
                self.score_normalization,
                self.memo,
            )
        return self._schedule(module, cache, keys, values, pi)

    def _schedule(
        self, module: nn.Module, cache, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head budget: evict the layer now from its token proposal ``pi`` ``(B, G, t)``. Global budget: keep it
        for :meth:`finalize`. Returns the layer's keys and values as the cache should hold them now."""
        if self.unit == "page":
            pi = page_proposal(pi, self.page_size)  # (B, G, P): pages are the sampling unit
        if self.budget == "head":
            m = search_num_samples(pi, self.compression_ratio, **self._search_options())  # (B, G)
            return self._evict(module, cache, keys, values, pi, m)
        composed = len(self.__dict__.get("_wrapper_path") or [self]) > 1
        # inside a wrapper a later press may select among this layer's entries before finalize: remember them
        self._pending[module.layer_idx] = (module, cache, pi, keys, row_fingerprints(keys) if composed else None)
        return keys, values

    def evict_with_proposals(self, modules: list[nn.Module], cache, proposals: list[torch.Tensor]) -> None:
        """Evict every layer of a filled prefill ``cache`` by sampling from proposals computed elsewhere, with this
        press's budget, unit, draws and correction (the proposal field is not read).

        For proposals that exist only after the prefill, e.g. KVzip's context-reconstruction scores
        (:class:`presses.kvzip_pages.KVzipSamplingPress`); given the proposals the prefill's own hooks would compute,
        the cache and decode-time bias are those of a prefill with this press (``tests/test_kvzip_sampling.py``).

        Args:
            modules: the attention modules, one per layer of ``cache`` (``module.layer_idx`` indexes it).
            cache: a ``DynamicCache`` holding ``t`` uncompressed prompt entries per layer; its layers are replaced
                by the kept entries (padded) and it receives the decode-time bias (:mod:`presses.attention`).
            proposals: per layer, ``(B, G, t)`` token proposals (rows summing to 1, non-negative).

        Raises:
            ValueError: if the numbers of modules, proposals and cache layers differ, or a proposal's length is not
                the cache's.
        """
        if not (len(modules) == len(proposals) == len(cache)):
            raise ValueError(
                f"{len(modules)} attention modules and {len(proposals)} proposals for a cache of {len(cache)} layers"
            )
        self.reset()
        self._seq_len = cache.get_seq_length(0)
        for module, pi in zip(modules, proposals):
            attention.set_decode_bias(cache, module.layer_idx, None)
            layer = cache.layers[module.layer_idx]
            if pi.shape[-1] != layer.keys.shape[2]:
                raise ValueError(
                    f"layer {module.layer_idx}: a proposal over {pi.shape[-1]} entries for {layer.keys.shape[2]} "
                    "cached entries"
                )
            if self.compression_ratio > 0:
                layer.keys, layer.values = self._schedule(module, cache, layer.keys, layer.values, pi.float())
        self.finalize()

    def finalize(self) -> None:
        """Global budget (paper 003 F.1): one ``m`` per request for all groups of all pending layers,
        matching the MEAN expected kept count to ``(1 - r*) t``; then evict every pending layer."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        layers = sorted(pending)
        pis = {}
        for i in layers:
            module, cache, pi, keys, fingerprints = pending[i]
            layer = cache.layers[module.layer_idx]
            if layer.keys is keys:
                pis[i] = pi
                continue
            # a later press of a ComposedPress kept a subset of the entries: draw among them (class docstring)
            if fingerprints is None:
                raise ValueError(
                    f"layer {i}: the cache was replaced after ProbabilisticEvictionPress recorded "
                    "its proposal, outside a wrapper it knows"
                )
            positions = surviving_positions(fingerprints, layer.keys)  # (B, G, t')
            sub = pi.gather(-1, positions)
            pis[i] = sub / sub.sum(-1, keepdim=True).clamp_min(torch.finfo(sub.dtype).tiny)
        lengths = {pis[i].shape[-1] for i in layers}
        if len(lengths) != 1:
            raise ValueError(
                f"the global budget needs the same number of surviving entries in every layer, got "
                f"{sorted(lengths)}: use budget='head' alone, or presses that keep equal counts"
            )
        device = pis[layers[0]].device  # one search for all layers, on one device (device_map may spread them)
        m = search_num_samples(
            torch.stack([pis[i].to(device) for i in layers], dim=1),
            self.compression_ratio,
            pool_dims=(1, 2),
            **self._search_options(),
        ).view(-1, 1)  # (B, 1)
        for i in layers:
            module, cache = pending[i][:2]
            layer = cache.layers[module.layer_idx]
            layer.keys, layer.values = self._evict(module, cache, layer.keys, layer.values, pis[i], m)

    def _search_options(self) -> dict:
        """Options of :func:`presses.probabilistic.budget.search_num_samples` for the unit: none for tokens (target
        ``(1 - r) t``, tolerance 0.5); for pages the target :func:`presses.probabilistic.page_sampling.page_target`
        and the tolerance :func:`presses.probabilistic.page_sampling.page_tolerance`, both in pages."""
        if self.unit == "token":
            return {}
        return {
            "target": page_target(self._seq_len, self.compression_ratio, self.page_size),
            "tol": page_tolerance(self.page_size),
        }

    # ------------------------------------------------------------------ setup and hooks
    def post_init_from_model(self, model):
        """Check the attention implementation, install the correcting attention wrapper and register the
        model hooks (reset at each prefill, deferred global eviction after the last layer).

        A scorer proposal's own ``post_init_from_model`` is called too (kvpress scorers that load weights do it there).

        Raises:
            ValueError: if the model's attention implementation is not sdpa or eager, or not eager for a scorer
                proposal that reads attention weights.
        """
        impl = attention.check_implementation(model, "ProbabilisticEvictionPress")
        scorer = self.scorer
        if needs_attention_weights(scorer) and impl != "eager":
            raise ValueError(
                f"proposal={scorer!r} reads the layers' attention weights: load the model with "
                f"attn_implementation='eager' (it has {impl!r})"
            )
        if scorer is not None and not isinstance(self.proposal, str):
            scorer.post_init_from_model(model)
        attention.install()
        super().post_init_from_model(model)

    def model_hooks(self, model):
        """The contract's prefill-start hook, a pre-hook on the language model that asks the prefill's own
        attention for the proposal's statistics (:mod:`presses.probabilistic.prefill_attention`: the all-row
        column sums come out of the same pass over the keys instead of a second one), and a forward hook that
        withdraws that request and runs :meth:`finalize` (the global budget's eviction) once the prefill has passed
        every layer."""
        lm = language_model(model)
        return [
            *super().model_hooks(model),
            (lm, "forward_pre", self._request_statistics),
            (lm, "forward", self._finish_hook),
        ]

    def _request_statistics(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() == 0 and self.compression_ratio > 0:
            request_statistics(cache, self.proposal, self.block_size)

    def _finish_hook(self, module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        if cache is not None:
            request_statistics(cache, None)
        self.finalize()
        return output

    # ------------------------------------------------------------------ diagnostics
    def summary(self) -> dict[str, float | int | str]:
        """Statistics of the last prefill: logical (kept) and physical (padded) compression per layer
        (comma-separated strings, layer order) and averaged over layers, the mean draws ``m`` and the
        sampling ``unit``, ``kept_entries`` (the contract's :data:`presses.base.KEPT_ENTRIES`: mean kept entries per
        KV group, per layer); for ``unit="page"`` also ``page_size``, ``num_pages`` (``ceil(T / page_size)``)
        and the kept (drawn) pages per KV group, averaged over groups (per layer) and over layers."""
        if not self._stats or self._seq_len == 0:
            return {"logical_compression": 0.0, "physical_compression": 0.0, "num_layers_evicted": 0}
        t = self._seq_len
        layers = sorted(self._stats)
        logical = [1.0 - self._stats[i]["kept"] / t for i in layers]
        physical = [1.0 - self._stats[i]["padded"] / t for i in layers]
        return {
            "proposal": proposal_label(self.proposal),
            "budget": self.budget,
            "context_length": t,
            "num_layers_evicted": len(layers),
            "num_samples_mean": sum(self._stats[i]["m"] for i in layers) / len(layers),
            "logical_compression": sum(logical) / len(layers),
            "physical_compression": sum(physical) / len(layers),
            "logical_compression_per_layer": ",".join(f"{x:.4f}" for x in logical),
            "physical_compression_per_layer": ",".join(f"{x:.4f}" for x in physical),
            "unit": self.unit,
            KEPT_ENTRIES: kept_entries_text(self._stats[i]["kept"] for i in layers),
            **(self._page_summary(layers) if self.unit == "page" else {}),
        }

    def _page_summary(self, layers: list[int]) -> dict[str, float | int | str]:
        """The page unit's entries of :meth:`summary`."""
        pages = [self._stats[i]["kept_units"] for i in layers]
        return {
            "page_size": self.page_size,
            "num_pages": num_pages(self._seq_len, self.page_size),
            "kept_pages_mean": sum(pages) / len(pages),
            "kept_pages_per_layer": ",".join(f"{x:.2f}" for x in pages),
        }
