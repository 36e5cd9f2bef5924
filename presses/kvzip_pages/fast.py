"""KVzip's reconstruction scores at a lower cost: no eager attention weights, and by default read off the
reconstruction forward's own attention (docs/methods.md §1.18)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from presses.base import Capabilities
from presses.core.kvzip_scores import attention_with_lse, value_output_norms
from presses.kernels import reconstruction_column_maxes
from presses.kvzip_pages.base import KVzipResearchPress

__all__ = ["KVzipFastPress"]


@dataclass
class KVzipFastPress(KVzipResearchPress):
    """KVzip's scores (and KVzip+'s) from kvpress's reconstruction pass, without its second attention.

    kvpress's ``KVzipPress`` runs the model on "Repeat the previous context" and each chunk of the context over the
    prefill's cache; a hook on every attention module then recomputes the queries and builds the eager attention
    weights ``(H, n, sinks + chunk + n)`` to take, per KV head, the most attention a reconstruction query pays each
    chunk position (KVzip+: divided by the query's hidden-state norm, times the value's output norm). This press
    computes the same scores with the same prompts, chunks, sinks and selection (kvpress's ``compress_post``, a head
    that would lose every entry keeping its best one), but:

    - ``fused=True`` (default): for the reconstruction forwards the model's attention function is replaced by one that
      splits the keys into [sinks + chunk], the rest of the cache, and the repeat tokens (causal), runs a fused
      attention kernel on each (torch's flash kernel on CPU) and merges the three outputs by their log normalisers:
      the model's own attention output (to float round-off), and the log normaliser of KVzip's softmax over
      [sinks + chunk + repeat] with it. The query-key products are computed once by the model's attention and once
      more only against the chunk's keys, for the column maxima;
    - ``fused=False``: the hook recomputes the queries, as kvpress's, and the log normaliser with the fused kernel.

    Either way the scores are ``max exp(q . k / sqrt(d) - lse)`` over the chunk's keys (the normaliser a coordinate
    of the product, :func:`presses.kernels.reconstruction_column_maxes`: a Triton kernel on CUDA), never the
    ``(H, n, keys)`` weights. They equal kvpress's to float round-off (tests/test_kvzip_fast.py), so the kept sets
    are KVzip's; the cost against kvpress's is in results/kvzip_cost/. ``chunk_size`` below the context (kvpress's
    field) shortens each reconstruction: fewer keys per softmax, other scores.

    Based on KVzip (https://arxiv.org/abs/2505.23416).

    Args:
        compression_ratio, layerwise, n_sink, kvzip_plus_normalization, chunk_size: kvpress's ``KVzipPress``.
        fused: take the scores from the reconstruction forward's own attention (see above).

    Raises:
        ValueError: in the pass, for a model whose attention is eager, soft-capped, windowed or scaled otherwise than
            ``1 / sqrt(d)`` (``fused=True``), or whose modules hold kvpress's head-wise masks; kvpress's assertions.
    """

    fused: bool = True

    #: KVzip's (kvpress's registry entry); its own pass (its reconstruction forwards differ from kvpress's)
    capabilities: ClassVar[Capabilities] = Capabilities(shares_prefill=False, scores_once=True, extra_forwards=True)

    def _reset_internal_parameters(self):
        super()._reset_internal_parameters()
        self.__dict__["_stash"] = None  # (layer, queries, lse) of the fused attention call, for its hook

    def _perform_kvzip_compression(self, model, tokenizer):
        """kvpress's pass, with the model's attention function replaced for its forwards when ``fused``."""
        with self._fused_attention(model) if self.fused else contextlib.nullcontext():
            super()._perform_kvzip_compression(model, tokenizer)

    @contextlib.contextmanager
    def _fused_attention(self, model):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name = model.config._attn_implementation
        # an eager model calls its eager function directly, never through the registry (where another module may
        # have registered an "eager" entry): refused by name
        if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attn_implementation={name!r}: KVzipFastPress(fused=True) needs sdpa or flash attention")
        original = ALL_ATTENTION_FUNCTIONS[name]
        ALL_ATTENTION_FUNCTIONS[name] = self._attention
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[name] = original
            self.__dict__["_stash"] = None

    def _check_module(self, module, scaling: float, kwargs: dict) -> None:
        if getattr(module, "masked_key_indices", None) is not None:
            raise ValueError(f"layer {module.layer_idx} holds kvpress's head-wise masks during KVzip's pass")
        for name in ("softcap", "sliding_window"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}={kwargs[name]}: KVzipFastPress scores attention without {name}")
        if abs(scaling - module.head_dim**-0.5) > 1e-9:
            raise ValueError(f"attention scaling={scaling} is not 1/sqrt(head_dim={module.head_dim}) (KVzip's)")

    def _split(self, n: int, total: int) -> tuple[list[slice], list[slice]]:
        """The key ranges of KVzip's softmax (sinks, chunk) and the rest of the cache, for ``n`` repeat tokens."""
        sink, context = min(self.n_sink, self.start_idx), total - n
        rest = [s for s in (slice(sink, self.start_idx), slice(self.end_idx, context)) if s.stop > s.start]
        return [slice(0, sink), slice(self.start_idx, self.end_idx)], rest

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """transformers' attention-function contract for the reconstruction forwards: ``query`` ``(1, H, n, d)``,
        ``key``/``value`` ``(1, G, T + n, d)`` (the prefill's cache and the repeat tokens). Returns the attention
        output ``(1, n, H, d)`` and no weights; keeps the queries and KVzip's log normaliser for the hook."""
        n, total = query.shape[2], key.shape[2]
        scaling = module.head_dim**-0.5 if scaling is None else scaling
        self._check_module(module, scaling, kwargs)
        if query.shape[0] != 1 or total != self.context_length + n:
            raise ValueError(f"KVzip's pass got {tuple(query.shape)} queries over {total} keys, not 1 x n over T + n")
        r = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
        scored, rest = self._split(n, total)
        parts = [attention_with_lse(query, key[:, :, -n:], value[:, :, -n:], True, scaling)]  # the repeat tokens
        for ranges in (scored, rest):
            if ranges:
                k = torch.cat([key[:, :, s] for s in ranges], dim=2)
                v = torch.cat([value[:, :, s] for s in ranges], dim=2)
                parts.append(attention_with_lse(query, k, v, False, scaling))
        lse_kvzip = torch.logaddexp(parts[0][1], parts[1][1])
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
        out = sum(o.float() * torch.exp(p - lse)[..., None] for o, p in parts)
        self.__dict__["_stash"] = (module.layer_idx, query, lse_kvzip)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def _queries_and_lse(self, module, hidden_states, keys, values, kwargs):
        """Without the fused attention: the reconstruction queries (as kvpress's) and KVzip's log normaliser."""
        n = hidden_states.shape[1]
        scaling = module.head_dim**-0.5
        self._check_module(module, scaling, {})
        queries = get_prerope_query_states(module, hidden_states)
        cos, sin = kwargs["position_embeddings"]
        queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
        r = queries.shape[1] // keys.shape[1]
        scored, _ = self._split(n, keys.shape[2])
        k = torch.cat([keys[:, :, s] for s in scored] + [keys[:, :, -n:]], dim=2).repeat_interleave(r, dim=1)
        v = torch.cat([values[:, :, s] for s in scored] + [values[:, :, -n:]], dim=2).repeat_interleave(r, dim=1)
        m = k.shape[2] - n  # sinks + chunk, all visible; then the repeat tokens, causal
        _, lse_scored = attention_with_lse(queries, k[:, :, :m], v[:, :, :m], False, scaling)
        _, lse_repeat = attention_with_lse(queries, k[:, :, m:], v[:, :, m:], True, scaling)
        return queries, torch.logaddexp(lse_scored, lse_repeat)

    def score_kvzip(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's ``score_kvzip`` contract (scores of the chunk into ``score_val``; the keys and values cut back
        to the context), its scores from the fused attention's queries and normaliser, else recomputed."""
        stash = self.__dict__.get("_stash")
        if stash is not None and stash[0] == module.layer_idx and stash[1].shape[2] == hidden_states.shape[1]:
            _, queries, lse = stash
            self.__dict__["_stash"] = None
        else:
            queries, lse = self._queries_and_lse(module, hidden_states, keys, values, kwargs)
        chunk = slice(self.start_idx, self.end_idx)
        rows = cols = None
        if self.kvzip_plus_normalization:
            rows = 1 / torch.norm(hidden_states.float(), dim=-1)
            cols = value_output_norms(module, values[:, :, chunk])
        scores = reconstruction_column_maxes(queries, keys[:, :, chunk], lse, module.head_dim**-0.5, rows, cols)
        self.score_val[int(module.layer_idx)][..., chunk] = scores.to(self.score_val.dtype)
        return keys[:, :, : self.context_length], values[:, :, : self.context_length]
