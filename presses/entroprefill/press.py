"""EntroPrefill: query-aware pruning of whole chunks in the middle of prefill.

Paper 001 (EntroPrefill), Algorithm 1; docs/methods.md §4. Math helpers of this module implement
eqs. 2-5 (proposal and floored Rényi pooling), 8-9 (chunk priorities), Theorem 4.1 (deletion
envelope), eq. 17 (Hoeffding audit radius), eq. 19 (set change) and eq. 32 (analytic saving); the
greedy scan and the dual certificate (eqs. 14-16) live in :mod:`presses.entroprefill.dual`, chunking in
:mod:`presses.entroprefill.chunking`, sink isolation and collision entropy in :mod:`presses.core.renyi`.

How the press sees the prompt: inside ``with press(model):`` a forward pre-hook on the decoder
stack (``model.model``) captures ``input_ids`` of the prefill call, decodes them with the
tokenizer (``tokenizer`` field, else ``AutoTokenizer.from_pretrained(model.name_or_path)``), finds
the question as the LAST match of ``question_pattern`` (the question and everything after it is
the protected query span) and splits the text before it into chunks (:func:`presses.entroprefill.chunking.plan_chunks`).
The question must be in the prefill (``query_aware=true`` in the harness), otherwise a
``ValueError`` is raised.

Pruning mechanics: attention forward hooks on the monitored layers compute the statistics of
Algorithm 1 on the unpruned trajectory. When layer ``l*`` (a 0-based ``layer_idx``) is accepted,
its hook gathers the KV cache of layers ``0..l*`` at the retained support ``R`` (ascending token
indices), and forward pre-hooks on decoder layers ``> l*`` replace ``hidden_states`` by its rows
at ``R`` and the kwargs ``position_ids`` / ``position_embeddings`` by the ORIGINAL positions of
``R``, ``cache_position`` by the compact storage offsets ``0..T'-1`` and a 4-D ``attention_mask`` by
its ``R x R`` block (``None`` stays ``None``: causal on the compact support). The model's final norm
then sees ``T'`` rows. Decoding continues at position ``T`` because kvpress's pipeline passes
``position_ids`` starting at the original context length, while the cache holds ``T'`` entries.
Only batch size 1 and ``DynamicCache`` are supported.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from kvpress import ComposedPress

from presses.base import KEPT_ENTRIES, Capabilities, ResearchPress, kept_entries_text
from presses.core.model import language_model, sliding_layers, text_config
from presses.core.paging import check_compression_ratio
from presses.core.row_masses import chunk_ids
from presses.entroprefill.chunking import CHUNK_MODES, ChunkPlan, find_question, plan_chunks, token_offsets
from presses.entroprefill.dual import dual_certificate, greedy_feasible_scan
from presses.entroprefill.equations import (
    analytic_saving,
    chunk_priorities,
    floor_weights,
    hoeffding_radius,
    layer_cost_coefficients,
    pooled_proposal,
    row_chunk_statistics,
    set_change,
)
from presses.entroprefill.page_policy import PagePolicyDriver

logger = logging.getLogger(__name__)

__all__ = ["EntroPrefillPress", "PROPOSAL_OBSERVERS"]

#: the proposal observers (Algorithm 1 step 1): the last ``proposal_window`` query positions, or all of them
PROPOSAL_OBSERVERS = ("suffix", "query")


# ---------------------------------------------------------------------------------------------
# The press
# ---------------------------------------------------------------------------------------------


@dataclass
class EntroPrefillPress(ResearchPress):
    """Query-aware chunk pruning during prefill (paper 001 Algorithm 1; docs/methods.md §4).

    Paper: *EntroPrefill: Rényi-Guided Context Pruning with Conditional Stability Guarantees for Retrieval-Augmented
    Generation* (2026), https://arxiv.org/abs/2610.09757. Method, defaults and the choices we settled:
    ``docs/methods.md`` §4 (§4 step 7 for ``page_policy``).

    At each monitored layer: proposal rows of the query tokens (eq. 2), floored sink-isolated collision weights (eqs.
    3-5), chunk priorities (eqs. 8-9),
    greedy feasible scan and dual certificate (eqs. 14-15), stability streak (eq. 19) and an
    independent Hoeffding audit at question positions drawn with a seeded generator (eq. 17).
    The first layer passing the token target, the streak and the audit is ``l*``; the remaining
    layers run on the retained support only (original positions). Any failure runs the ordinary
    full prefill and :meth:`summary` says why.

    Parameters:
        compression_ratio: token-saving target as a fraction of the candidate document tokens
            ``N`` (0 prunes nothing, as for every kvpress press; the benchmark runs 0.5): the scan stops once
            ``ceil(compression_ratio * N)`` tokens are removed
            (``B_pref = N - target``); a layer whose greedy saving falls short is not accepted.
        chunking: ``"passage" | "paragraph" | "regex" | "block"`` (:mod:`presses.entroprefill.chunking`).
        delimiter: regex for ``chunking="regex"``.
        block_size: tokens per chunk for ``chunking="block"``.
        doc_start_pattern: ``"block"`` mode: documents start after this regex's first match.
        protect_pattern: optional regex whose matches are protected (and protect their chunk).
        question_pattern: regex marking the question; its LAST match starts the protected query.
        n_sink: leading sink tokens ``|S|`` (protected, excluded from entropy).
        proposal_window: ``W_p``, the last question tokens used as proposal observers (``"suffix"``).
        proposal_observers: ``"query"`` (default): every position of the query span; ``"suffix"``: its last
            ``proposal_window`` positions (paper 001 section 2.1 allows any fixed set from the user query; the
            suffix of a templated question holds no question word, docs/methods.md §4 ambiguity 1).
        monitored_layers: 0-based ``layer_idx`` values in ``[0, L-2]``; ``None`` gives the five middle
            layers ``L // 2 - 2 .. L // 2 + 2`` clipped to ``[0, L-2]`` (13..17 for 30).
        tau: entropy temperature; zeta: group floor; z_min: eligibility threshold (eqs. 3-4).
        doc_mass_min: ``Z_min``; a layer with pooled document mass below it is invalid.
        smoothing: ``eps_s`` of eq. 8; lambda_: ``lambda`` of eq. 9.
        epsilon: row tolerance ``eps_a`` of every proposal-row constraint (eq. 14).
        min_chunks: ``m_0``, chunks always retained (eq. 14).
        stability_streak: ``v``, valid transitions with ``d_l <= theta`` required (0: none).
        theta: set-change threshold of eq. 19.
        audit_size: ``m_a`` audit observers (with replacement, uniform on the question span).
        delta: audit failure probability; epsilon_audit: accept when ``eta_hat + b <= epsilon_audit``.
        seed: seed of the audit generator (independent of the deterministic proposal).
        use_lp: LP-relaxation dual prices (scipy) for ``U_l``; False: ``y = 0, t = 0``.
        tokenizer: tokenizer of the model (loaded from ``model.name_or_path`` when None).
        force_layer: TESTING: accept at this layer regardless of target, streak and audit.
        force_chunks: TESTING (with ``force_layer``): remove exactly these chunk indices.
        page_policy: optional press that evicts the cache of the retained support after the prune, at every
            layer (Algorithm 1 step 7; e.g. a :class:`presses.page_entrokv.PageEntroKVPress`; any kvpress press
            whose ``compress`` evicts one layer's cache, see :mod:`presses.entroprefill.page_policy`). It is driven
            by this press's hooks, not registered on the model; on a bypass it evicts the full prefill's cache.
            Its own ``compression_ratio`` applies to the retained support ``T'``.
    """

    compression_ratio: float = 0.0
    chunking: str = "passage"
    delimiter: str | None = None
    block_size: int = 128
    doc_start_pattern: str | None = None
    protect_pattern: str | None = None
    question_pattern: str = r"Question:"
    n_sink: int = 4
    proposal_window: int = 8
    proposal_observers: str = "query"
    monitored_layers: Sequence[int] | None = None
    tau: float = 0.5
    zeta: float = 0.2
    z_min: float = 0.05
    doc_mass_min: float = 1e-3
    smoothing: float = 0.1
    lambda_: float = 0.5
    epsilon: float = 0.35
    min_chunks: int = 1
    stability_streak: int = 1
    theta: float = 0.35
    audit_size: int = 256
    delta: float = 0.1
    epsilon_audit: float = 0.3
    seed: int = 0
    use_lp: bool = True
    tokenizer: Any = None
    force_layer: int | None = None
    force_chunks: Sequence[int] | None = None
    page_policy: Any = None

    capabilities: ClassVar[Capabilities] = Capabilities(shares_prefill=False, needs_question=True, changes_prefill=True)

    _stats: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        check_compression_ratio(self.compression_ratio)
        if self.chunking not in CHUNK_MODES:
            raise ValueError(f"chunking={self.chunking!r} must be one of {CHUNK_MODES}")
        if self.chunking == "regex" and not self.delimiter:
            raise ValueError("chunking='regex' needs a delimiter regex")
        if self.proposal_observers not in PROPOSAL_OBSERVERS:
            raise ValueError(f"proposal_observers={self.proposal_observers!r} must be one of {PROPOSAL_OBSERVERS}")
        if self.proposal_window < 1:
            raise ValueError(f"proposal_window={self.proposal_window} (W_p) must be >= 1")
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon={self.epsilon} (row tolerance eps_a) must be in [0, 1)")
        if not 0 <= self.epsilon_audit < 1:
            raise ValueError(f"epsilon_audit={self.epsilon_audit} must be in [0, 1)")
        if self.min_chunks < 0:
            raise ValueError(f"min_chunks={self.min_chunks} (m_0) must be >= 0")
        if self.stability_streak < 0:
            raise ValueError(f"stability_streak={self.stability_streak} must be >= 0")
        if not 0 <= self.theta <= 1:
            raise ValueError(f"theta={self.theta} must lie in [0, 1]")
        if self.n_sink < 0:
            raise ValueError(f"n_sink={self.n_sink} must be >= 0")
        hoeffding_radius(1, 1, self.delta, self.audit_size)  # validates delta and audit_size
        floor_weights(torch.full((1, 2), 0.5), 1, 0, self.tau, self.zeta, self.z_min)  # validates
        chunk_priorities(torch.ones(2), [(0, 2)], self.smoothing, self.lambda_)  # validates
        if self.force_chunks is not None and self.force_layer is None:
            raise ValueError("force_chunks needs force_layer")
        self._model_info: dict = {}
        self._pages = PagePolicyDriver(self.page_policy) if self.page_policy is not None else None
        self._reset(None)

    # -- setup -----------------------------------------------------------------------------

    def post_init_from_model(self, model):
        """Read layer/head counts and FLOP coefficients, load the tokenizer if none was given, and register the
        model hooks (:meth:`model_hooks`).

        Raises:
            ValueError: for a model with sliding-window layers (:func:`presses.core.model.sliding_layers`): the
                layers after ``l*`` run on the retained support at compact cache slots, which such a layer's mask
                reads as positions, so its window would be wrong; or for monitored layers outside ``[0, L-2]``.
        """
        sliding = sliding_layers(model)
        if sliding:
            raise ValueError(
                f"EntroPrefillPress does not support sliding-window layers (layers {sorted(sliding)}, window "
                f"{max(sliding.values())}): the layers after the pruned one would attend by compact cache slot"
            )
        cfg = text_config(model)
        L = cfg.num_hidden_layers
        if self.monitored_layers is None:
            monitored = list(range(max(0, L // 2 - 2), min(L - 2, L // 2 + 2) + 1))
        else:
            monitored = sorted({int(i) for i in self.monitored_layers})
        bad = [i for i in monitored if not 0 <= i <= L - 2]
        if bad:
            raise ValueError(f"monitored_layers {bad} must lie in [0, L-2={L - 2}] (a later layer must remain)")
        monitored = [i for i in monitored if 0 <= i <= L - 2]
        if self.force_layer is not None:
            if not 0 <= self.force_layer <= L - 2:
                raise ValueError(f"force_layer={self.force_layer} must lie in [0, L-2={L - 2}]")
            monitored = [self.force_layer]
        if not monitored:
            raise ValueError(f"no monitored layer: the model has L={L} layers")
        a, b = layer_cost_coefficients(cfg)
        self._model_info = {
            "L": L,
            "H": cfg.num_attention_heads,
            "G": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            "monitored": monitored,
            "a": a,
            "b": b,
        }
        if self.tokenizer is None:
            self.tokenizer = _load_tokenizer(model)
        if self.page_policy is not None:  # as kvpress's wrappers do for the presses they hold
            self.page_policy.post_init_from_model(model)
        super().post_init_from_model(model)

    def _reset(self, plan: ChunkPlan | None):
        self._plan = plan
        self._active = False
        self._state = "idle"
        self._retained: torch.Tensor | None = None
        self._accepted_layer = -1
        self._pred: set[int] | None = None
        self._streak = 0
        self._reasons: dict[int, str] = {}
        self._pruned_kwargs: dict | None = None
        self._t0 = 0.0
        self._stats = {}
        if self.__dict__.get("_pages") is not None:
            self._pages.reset()

    # -- summary ---------------------------------------------------------------------------

    def summary(self) -> dict[str, float | int | str]:
        """Per-request diagnostics of the LAST prefill (contract ``press_stats``).

        Keys: ``accepted_layer`` (0-based, -1 if none), ``removed_chunks`` (comma-separated chunk
        indices of the plan, "" if none), ``n_chunks``, ``n_candidates``, ``n_removed``,
        ``target_saving``, ``D_l`` (greedy token saving) and ``U_l`` (dual bound) of the accepted
        layer or, on bypass, of the last layer that reached the scan, ``dual_method``,
        ``audit_bound`` (``b``), ``eta_hat_max`` (largest audited ``eta_hat``), ``bypass_reason``
        ("" when pruned), ``layer_reasons`` (``layer:reason;...``), ``T``, ``T_prime``,
        ``compression`` (the total, ``1 - kept/T`` with ``kept`` the cache entries per layer averaged over
        layers), split into ``prune_compression`` (``1 - T'/T``) and ``page_compression`` (``1 - kept/T'``, 0
        without a page policy), ``analytic_saving`` (eq. 32) and ``prefill_time_s`` (wall time of the decoder
        stack, chunk planning and the page policy included), ``kept_entries`` (the cache entries per layer after the
        prefill, the contract's :data:`presses.base.KEPT_ENTRIES`). With a page policy: ``page_kept_tokens`` and the
        policy's own ``summary()`` keys prefixed ``page_``.
        """
        return dict(self._stats)

    # -- hooks -----------------------------------------------------------------------------

    def model_hooks(self, model):
        """The contract's prefill-start hook, plus: a forward pre-hook and a forward hook on the language model
        (find the question and plan the chunks; close the request's statistics) and a forward pre-hook on every
        decoder layer (run the layers after ``l*`` on the retained support only)."""
        lm = language_model(model)
        hooks = [
            *super().model_hooks(model),
            (lm, "forward_pre", self._model_pre_hook),
            (lm, "forward", self._model_post_hook),
        ]
        hooks += [
            (layer, "forward_pre", functools.partial(self._layer_pre_hook, i)) for i, layer in enumerate(lm.layers)
        ]
        return hooks

    def check_wrappers(self, path: list) -> None:
        """Refuse a ``ComposedPress`` with other presses: EntroPrefill prunes the prefill itself, so the shallow
        layers' cache it gathers at ``l*`` must be its own. A press that should evict after the prune is its
        ``page_policy``.

        Raises:
            ValueError: naming the wrapper.
        """
        for wrapper in path[:-1]:
            if isinstance(wrapper, ComposedPress) and len(wrapper.presses) > 1:
                raise ValueError(
                    "EntroPrefillPress cannot share a ComposedPress with other presses: it prunes "
                    "whole chunks during the prefill and gathers the shallow layers' cache itself; "
                    "pass the press that should evict afterwards as EntroPrefillPress(page_policy=...)"
                )

    def reset(self) -> None:
        """Forget the previous request (plan, search state, statistics)."""
        self._reset(None)

    def _bypass(self, reason: str):
        self._state = "bypass"
        self._stats["bypass_reason"] = reason

    def _model_pre_hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if cache is not None and cache.get_seq_length() > 0:
            self._active = False  # a decoding step inside the context: nothing to do
            return None
        if input_ids is None:
            raise ValueError(
                "EntroPrefillPress needs input_ids in the prefill call (inputs_embeds given): "
                "it locates the question and chunks from the token ids"
            )
        if input_ids.shape[0] != 1:
            raise ValueError(f"EntroPrefillPress supports batch size 1, got {input_ids.shape[0]}")
        if self.tokenizer is None:
            raise ValueError(
                "EntroPrefillPress needs a tokenizer: pass tokenizer=... or use a model whose "
                "name_or_path AutoTokenizer can load"
            )
        self._reset(None)
        self._t0 = _now(input_ids)
        ids = input_ids[0].tolist()
        T = len(ids)
        text, offsets = token_offsets(self.tokenizer, ids)
        q_char = find_question(text, self.question_pattern)
        if q_char is None:
            raise ValueError(
                f"EntroPrefillPress found no question (question_pattern={self.question_pattern!r}) in the "
                f"{T}-token prefill: EntroPrefill is query-aware and needs the question inside the context; "
                "set query_aware=true"
            )
        plan = plan_chunks(
            text,
            offsets,
            mode=self.chunking,
            question_start=q_char,
            n_sink=self.n_sink,
            delimiter=self.delimiter,
            block_size=self.block_size,
            protect_pattern=self.protect_pattern,
            doc_start_pattern=self.doc_start_pattern,
        )
        self._plan = plan
        self._active = True
        self._device = input_ids.device
        cand = plan.candidates
        q0, q1 = plan.question
        info = self._model_info
        self._stats = {
            "accepted_layer": -1,
            "removed_chunks": "",
            "n_chunks": len(plan.chunks),
            "n_candidates": len(cand),
            "n_removed": 0,
            "target_saving": 0,
            "D_l": 0,
            "U_l": float("nan"),
            "dual_method": "",
            "audit_bound": float("nan"),
            "eta_hat_max": float("nan"),
            "bypass_reason": "",
            "layer_reasons": "",
            "T": T,
            "T_prime": T,
            "compression": 0.0,
            "prune_compression": 0.0,
            "page_compression": 0.0,
            "analytic_saving": 0.0,
            "prefill_time_s": float("nan"),
        }
        if self._pages is not None:
            self._pages.start(T, [plan.chunks[i] for i in cand])
        N = sum(plan.sizes[i] for i in cand)
        self._target = math.ceil(self.compression_ratio * N - 1e-9)
        self._stats["target_saving"] = self._target
        if self.force_chunks is not None:
            bad = [i for i in self.force_chunks if i not in cand]
            if bad:
                raise ValueError(f"force_chunks {bad} are not candidate chunks {cand}")
        if not cand:
            return self._bypass("no_chunks")
        if q1 - q0 < 1:
            return self._bypass("empty_question")
        if self.n_sink >= T:
            return self._bypass("prompt_shorter_than_sinks")
        if self._target <= 0 and self.force_layer is None:
            return self._bypass("zero_target")
        if cache is not None and type(cache).__name__ != "DynamicCache":
            return self._bypass(f"unsupported_cache_{type(cache).__name__}")
        W = min(self.proposal_window, q1 - q0) if self.proposal_observers == "suffix" else q1 - q0
        self._proposal_pos = torch.arange(T - W, T, device=input_ids.device)
        self._chunk_ids = chunk_ids(T, [plan.chunks[i] for i in cand], input_ids.device)  # candidate i -> i
        gen = torch.Generator().manual_seed(self.seed)
        draws = torch.randint(q0, q1, (self.audit_size,), generator=gen)
        uniq, counts = torch.unique(draws, return_counts=True)
        self._audit_pos = uniq.to(input_ids.device)
        self._audit_w = counts.double() / self.audit_size
        self._b = hoeffding_radius(len(info["monitored"]), info["H"], self.delta, self.audit_size)
        self._stats["audit_bound"] = self._b
        self._state = "search"
        return None

    def _model_post_hook(self, module, args, kwargs, output):
        if not self._active:
            return output
        self._active = False
        if self._pages is not None:
            if self._pages.pending and kwargs.get("past_key_values") is not None:
                self._pages.flush(kwargs["past_key_values"], None)  # no layer accepted: the full prompt's cache
            self._stats.update(self._pages.stats(self._stats["T"], self._stats["T_prime"]))
        if self._state == "search":
            reasons = set(self._reasons.values())
            self._bypass(reasons.pop() if len(reasons) == 1 else "no_layer_accepted")
        self._stats["layer_reasons"] = ";".join(f"{k}:{v}" for k, v in sorted(self._reasons.items()))
        self._stats["prefill_time_s"] = _now(self._device) - self._t0
        cache = kwargs.get("past_key_values")
        if cache is not None:  # the dense cache holds exactly the kept entries (retained support, paged)
            self._stats[KEPT_ENTRIES] = kept_entries_text(cache.get_seq_length(i) for i in range(len(cache)))
        return output

    def _layer_pre_hook(self, layer_idx, module, args, kwargs):
        if not self._active or self._state != "accepted" or layer_idx <= self._accepted_layer:
            return None
        R = self._retained
        if args:
            hs = args[0]
            if hs.shape[1] != R.numel():
                args = (hs[:, R],) + tuple(args[1:])
        elif kwargs.get("hidden_states") is not None and kwargs["hidden_states"].shape[1] != R.numel():
            kwargs["hidden_states"] = kwargs["hidden_states"][:, R]
        if self._pruned_kwargs is None:
            new = {}
            if kwargs.get("position_ids") is not None:
                new["position_ids"] = kwargs["position_ids"][:, R]
            if kwargs.get("position_embeddings") is not None:
                cos, sin = kwargs["position_embeddings"]
                new["position_embeddings"] = (cos[:, R], sin[:, R])
            if kwargs.get("cache_position") is not None:
                new["cache_position"] = torch.arange(R.numel(), device=R.device)
            mask = kwargs.get("attention_mask")
            if mask is not None:
                if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
                    raise NotImplementedError(
                        f"EntroPrefillPress supports 4-D tensor or None attention masks, got {type(mask)}"
                    )
                new["attention_mask"] = mask[:, :, R][:, :, :, R]
            self._pruned_kwargs = new
        kwargs.update(self._pruned_kwargs)
        return args, kwargs

    def forward_hook(self, module, input, kwargs, output):
        """Attention hook: Algorithm 1 steps 2-6 at a monitored layer during the prefill, and the page policy's
        eviction (step 7; :mod:`presses.entroprefill.page_policy`)."""
        if not self._active:
            return output
        idx = module.layer_idx
        if self._state != "search":
            # after l* (the retained support) or after a bypass (the full prompt): the page policy evicts now
            return self._pages.forward(module, input, kwargs, output) if self._pages is not None else output
        if self._pages is not None:
            if idx <= max(self._model_info["monitored"]):  # l* may still come: evict once R is known
                self._pages.defer(module, kwargs["hidden_states"], kwargs["position_embeddings"])
            else:  # the monitored window passed without acceptance: the full prompt is the support
                self._pages.flush(kwargs["past_key_values"], None)
                output = self._pages.forward(module, input, kwargs, output)
        if idx not in self._model_info["monitored"]:
            return output
        cache = kwargs.get("past_key_values")
        if cache is None:
            self._bypass("no_cache")
            return output
        try:
            with torch.no_grad():  # statistics only: nothing here needs gradients
                self._monitor(module, kwargs, cache, output[1], idx)
        except _Invalid as err:
            self._reasons[idx] = str(err)
            self._pred, self._streak = None, 0
        return output

    # -- Algorithm 1 -----------------------------------------------------------------------

    def _monitor(self, module, kwargs, cache, attentions, idx: int):
        plan, info = self._plan, self._model_info
        hs, pe = kwargs["hidden_states"], kwargs["position_embeddings"]
        keys = cache.layers[idx].keys
        cand = plan.candidates
        W = self._proposal_pos.numel()
        # eq. 2 and eq. 14's per-row chunk masses, from one pass over the rows (kernel dispatch)
        masses, a = row_chunk_statistics(
            module,
            hs,
            keys,
            self._proposal_pos,
            pe,
            self._chunk_ids,
            len(cand),
            torch.full((W,), 1.0 / W, device=keys.device),
            attentions,
        )
        masses, a = masses[0], a[0]  # (H, W_p, k), (H, T)
        if not (torch.isfinite(masses).all() and torch.isfinite(a).all()):
            raise _Invalid("nonfinite")
        fw = floor_weights(a, info["G"], self.n_sink, self.tau, self.zeta, self.z_min)
        if bool(fw["group_fallback"].all()):
            raise _Invalid("all_heads_ineligible")
        mu = pooled_proposal(a, fw["w"])  # eq. 5
        chunks = [plan.chunks[i] for i in cand]
        doc_mass = float(sum(mu[s:e].sum() for s, e in chunks))
        if not math.isfinite(doc_mass) or not torch.isfinite(mu).all():
            raise _Invalid("nonfinite")
        if doc_mass < self.doc_mass_min:
            raise _Invalid("doc_mass_below_min")
        pr = chunk_priorities(mu, chunks, self.smoothing, self.lambda_)  # eqs. 8-9
        if not torch.isfinite(pr["S"]).all():
            raise _Invalid("nonfinite")
        masses = masses.reshape(-1, len(cand)).double().cpu()  # (A, k), row a = (h, u)
        eps = torch.full((masses.shape[0],), float(self.epsilon), dtype=torch.float64)
        sizes = torch.tensor([e - s for s, e in chunks])
        m0 = min(self.min_chunks, len(cand))
        removed_local, _ = greedy_feasible_scan(pr["S"].cpu(), sizes, masses, eps, m0, self._target)
        D = int(sizes[removed_local].sum()) if removed_local else 0
        U, _, _, method = dual_certificate(sizes, masses, eps, m0, self.use_lp)  # eq. 15
        self._stats.update(D_l=D, U_l=U, dual_method=method)
        retained = {cand[i] for i in range(len(cand))} - {cand[i] for i in removed_local}
        if self._pred is None:  # eq. 19: the first valid candidate initialises the predecessor
            self._streak = 0
        else:
            self._streak = self._streak + 1 if set_change(retained, self._pred) <= self.theta else 0
        self._pred = retained
        removed = sorted(cand[i] for i in removed_local)
        if self.force_layer is not None:
            if self.force_chunks is not None:
                removed = sorted(int(i) for i in self.force_chunks)
            return self._accept(idx, removed, cache)
        if U < self._target:
            self._reasons[idx] = "target_infeasible"
            return
        if D < self._target:
            self._reasons[idx] = "target_not_reached"
            return
        if self._streak < self.stability_streak:
            self._reasons[idx] = "unstable"
            return
        # independent audit (eq. 17): rows at the pre-drawn question positions, their mass on the removal set
        audit, _ = row_chunk_statistics(
            module, hs, keys, self._audit_pos, pe, self._chunk_ids, len(cand), None, attentions
        )  # (1, H, P, k)
        lost = audit[0][:, :, [cand.index(i) for i in removed]].sum(-1)  # (H, P)
        eta = (lost.double().cpu() * self._audit_w).sum(-1)  # (H,)
        eta_max = float(eta.max())
        self._stats["eta_hat_max"] = eta_max
        if not math.isfinite(eta_max):
            raise _Invalid("nonfinite")
        if eta_max + self._b <= self.epsilon_audit:
            return self._accept(idx, removed, cache)
        self._reasons[idx] = "audit_failed"

    def _accept(self, idx: int, removed: list[int], cache):
        plan, info = self._plan, self._model_info
        R = plan.retained_indices(removed).to(cache.layers[idx].keys.device)
        for j in range(idx + 1):  # shallow layers' KV at the retained support
            layer = cache.layers[j]
            layer.keys = layer.keys[:, :, R]
            layer.values = layer.values[:, :, R]
        if self._pages is not None:
            self._pages.flush(cache, R)
        self._retained = R
        self._accepted_layer = idx
        self._state = "accepted"
        self._reasons[idx] = "accepted"
        T, Tp = plan.n_tokens, int(R.numel())
        self._stats.update(
            accepted_layer=idx,
            removed_chunks=",".join(map(str, removed)),
            n_removed=len(removed),
            T_prime=Tp,
            compression=1.0 - Tp / T,
            prune_compression=1.0 - Tp / T,
            bypass_reason="",
            analytic_saving=analytic_saving(idx + 1, info["L"], T, Tp, info["a"], info["b"]),
        )


class _Invalid(Exception):
    """An invalid proposal at a monitored layer (Algorithm 1 step 3): resets the streak."""


def _now(t: torch.Tensor | torch.device) -> float:
    device = t if isinstance(t, torch.device) else t.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _load_tokenizer(model):
    """``AutoTokenizer`` for ``model.name_or_path`` (also a ``.gguf`` file or a folder holding one)."""
    import os

    from transformers import AutoTokenizer

    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path:
        return None
    try:
        if os.path.isfile(path) and path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        if os.path.isdir(path):
            ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
            if ggufs and not os.path.exists(os.path.join(path, "tokenizer_config.json")):
                return AutoTokenizer.from_pretrained(path, gguf_file=ggufs[0])
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        logger.warning("EntroPrefillPress could not load a tokenizer from %r: %s", path, err)
        return None
