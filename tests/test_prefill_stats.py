"""Probabilistic-eviction proposal statistics computed inside the prefill's attention (issue 18).

- :func:`presses.core.prefill_stats.attention_with_column_sums` (torch: the fused CPU flash kernel with its
  log-sum-exp, then a column pass) returns transformers' ``sdpa`` output bit for bit and
  :func:`presses.core.columns.column_sums` over all rows (paper 003 eqs. 16, 36);
- its Triton kernel (:mod:`presses.kernels.fused_prefill`, run by the interpreter) matches it: ``T`` not a
  multiple of the block, ``r`` in {1, 3, 4}, float32 / bfloat16 / float16;
- :class:`presses.probabilistic.ProbabilisticEvictionPress` with the fused path (the default) against today's path
  (prefill statistics off, proposal recomputed after the prefill): the same attention outputs (bit for bit on
  CPU), proposals equal to float32 round-off, and the same kept entries for a fixed seed, for every all-row
  proposal and both budgets, on tiny models and on the embedded model;
- the wrapper of :mod:`presses.probabilistic.prefill_attention` changes nothing without a request, falls back where it
cannot
  fuse (eager's mask, padded batches), composes with the SNIS decode wrapper and leaves decoding alone.

Tolerances: attention outputs as the decode kernels of ``tests/test_kernels.py`` (fp32 ``1e-5 / 1e-4``; bf16
``1e-2 / 1.6e-2``; fp16 ``2e-3 / 2e-3``: the kernel rounds ``p`` to the value dtype before ``p @ v`` as flash
attention does, the reference does not); column sums as its attention statistics (fp32 ``1e-6 / 1e-4``, bf16 and
fp16 inputs ``1e-5 / 1e-3``). Proposal ``pi`` of the press ``1e-6 / 1e-4``.
"""

from __future__ import annotations

import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process

import pytest
import torch
from conftest import decode_biases
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import presses.probabilistic.press as snis_press
import presses.probabilistic.proposals as proposals
from presses import attention
from presses.core.columns import column_sums, harmonic_prior
from presses.core.model import attention_modules
from presses.core.prefill_stats import attention_with_column_sums
from presses.probabilistic import ProbabilisticEvictionPress
from presses.probabilistic.prefill_attention import PrefillStats, request_statistics, take_prefill_stats

OUT_TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
STAT_TOL = {torch.float32: (1e-6, 1e-4), torch.bfloat16: (1e-5, 1e-3), torch.float16: (1e-5, 1e-3)}
D = 20  # head dim: not a power of two


def _qkv(B, G, r, T, dtype=torch.float32, seed=0, scale=1.5, dv=D):
    """Queries in transformers' layout (a transposed view of (B, T, H_Q, d)), keys and values."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, G * r, D, generator=g) * scale).to(dtype).transpose(1, 2)
    k = (torch.randn(B, G, T, D, generator=g) * scale).to(dtype)
    v = torch.randn(B, G, T, dv, generator=g).to(dtype)
    return q, k, v


def _sdpa(q, k, v, scaling):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=scaling, enable_gqa=True
    )
    return out.to(q.dtype)


# ------------------------------------------------------------------------------ torch implementation
# (B, G, r, T, block_size, num_workers, weights, d_v): T never a multiple of the block; r in {1, 3, 4}
TORCH_CASES = [
    (1, 3, 3, 200, 64, 2, "harmonic", D),
    (2, 2, 1, 77, 16, 3, None, D),
    (1, 1, 4, 5, 64, 1, "harmonic", D),
    (1, 2, 3, 130, 7, 2, "random", 12),
    (1, 2, 4, 65, 64, 4, None, D),
]


@pytest.mark.parametrize(("B", "G", "r", "T", "block", "workers", "weights", "dv"), TORCH_CASES)
def test_torch_path_equals_sdpa_and_column_sums(B, G, r, T, block, workers, weights, dv):
    q, k, v = _qkv(B, G, r, T, seed=T + r, dv=dv)
    w = {
        "harmonic": harmonic_prior(T),
        "random": torch.rand(T, generator=torch.Generator().manual_seed(1)),
        None: None,
    }[weights]
    threads = torch.get_num_threads()
    with torch.inference_mode():  # the workers write the caller's inference tensors
        out, sums = attention_with_column_sums(q, k, v, w, 0.3, block, workers)
    assert torch.get_num_threads() == threads  # restored after the workers ran single-threaded
    assert out.shape == (B, G * r, T, dv)
    if dv == D:  # torch's fused CPU kernel, the one sdpa runs: the model's own output, bit for bit
        assert torch.equal(out, _sdpa(q, k, v, 0.3))
    else:  # another value head dim: sdpa's output and a separate log-sum-exp
        torch.testing.assert_close(out, _sdpa(q, k, v, 0.3), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sums, column_sums(q, k, w, torch.arange(T), 0.3), atol=1e-6, rtol=1e-4)
    total = (w.sum() if w is not None else torch.tensor(float(T))).expand(B, G * r)
    torch.testing.assert_close(sums.sum(-1), total, atol=1e-4, rtol=1e-5)  # every row sums to 1


@pytest.mark.parametrize("tile", [None, 1], ids=["one_key_chunk", "64_key_chunks"])
def test_torch_path_does_not_depend_on_blocks_chunks_or_workers_beyond_round_off(tile, monkeypatch):
    """Row blocks, key chunks (the smallest tile makes 64-key chunks, crossing the causal diagonal inside and
    at the edges of blocks) and workers only reorder float32 sums."""
    import presses.core.prefill_stats as prefill_stats

    q, k, v = _qkv(1, 2, 3, 150, seed=9)
    w = harmonic_prior(150)
    ref_out, ref_sums = attention_with_column_sums(q, k, v, w, None, 150, 1)  # one block, one worker
    torch.testing.assert_close(ref_sums, column_sums(q, k, w, torch.arange(150)), atol=1e-6, rtol=1e-4)
    if tile is not None:
        monkeypatch.setattr(prefill_stats, "TILE_ELEMENTS", tile)
    for block, workers in ((1, 1), (13, 2), (64, 5), (100, 1)):
        out, sums = attention_with_column_sums(q, k, v, w, None, block, workers)
        assert torch.equal(out, ref_out)
        torch.testing.assert_close(sums, ref_sums, atol=1e-7, rtol=1e-5)


def test_generic_log_sum_exp_path_matches_the_fused_kernel(monkeypatch):
    """Without torch's fused CPU kernel (another device, or an older torch) the output comes from
    ``scaled_dot_product_attention`` and ``lse`` from a blocked ``logsumexp``: the same values."""
    import presses.core.prefill_stats as prefill_stats

    q, k, v = _qkv(1, 2, 3, 300, seed=12)
    fused_out, fused_lse = prefill_stats.causal_attention_lse(q, k, v, 0.3)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None, raising=False)
    out, lse = prefill_stats.causal_attention_lse(q, k, v, 0.3)
    torch.testing.assert_close(out, fused_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, fused_lse, atol=1e-5, rtol=1e-5)
    logits = torch.matmul(q, k.repeat_interleave(3, 1).transpose(-1, -2)) * 0.3
    logits = logits.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)  # the definition


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torch_path_low_precision_inputs(dtype):
    q, k, v = _qkv(1, 2, 3, 70, dtype, seed=3)
    w = harmonic_prior(70)
    out, sums = attention_with_column_sums(q, k, v, w, None, 32, 2)
    assert out.dtype == dtype and sums.dtype == torch.float32
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, sdpa)  # the same low-precision kernel as the model's sdpa
    atol, rtol = STAT_TOL[dtype]
    torch.testing.assert_close(sums, column_sums(q, k, w, torch.arange(70)), atol=atol, rtol=rtol)


def test_torch_path_bad_input():
    q, k, v = _qkv(1, 2, 3, 10)
    with pytest.raises(ValueError, match=r"key of shape \(1, 2, 9, 20\) does not match query"):
        attention_with_column_sums(q, k[:, :, :9], v)
    with pytest.raises(ValueError, match="num_kv_heads=4 must divide num_heads=6"):
        attention_with_column_sums(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    with pytest.raises(ValueError, match=r"row_weights has shape \(9,\), expected \(10,\)"):
        attention_with_column_sums(q, k, v, torch.ones(9))
    with pytest.raises(ValueError, match="block_size=0 must be >= 1"):
        attention_with_column_sums(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="num_workers=0 must be >= 1"):
        attention_with_column_sums(q, k, v, num_workers=0)


# ------------------------------------------------------------------------------ Triton kernel (interpreter)
# (G, r, T): T never a multiple of the 64-row / 64-key tiles; r in {1, 3, 4}
TRITON_CASES = [(2, 1, 37), (1, 3, 70), (2, 4, 100)]
TRITON_PARAMS = (
    [(*c, torch.float32) for c in TRITON_CASES]
    + [(*TRITON_CASES[i], torch.bfloat16) for i in (0, 1)]
    + [(*TRITON_CASES[i], torch.float16) for i in (1, 2)]
)


@pytest.mark.parametrize(("G", "r", "T", "dtype"), TRITON_PARAMS)
def test_triton_matches_reference(G, r, T, dtype):
    pytest.importorskip("triton")
    from presses.kernels.fused_prefill import attention_with_column_sums_triton

    q, k, v = _qkv(1, G, r, T, dtype, seed=G * 100 + r * 10 + T)
    w = harmonic_prior(T) if r != 1 else None
    out, sums = attention_with_column_sums_triton(q, k, v, w, 0.3)
    ref_out, ref_sums = attention_with_column_sums(q, k, v, w, 0.3)
    assert out.dtype == dtype and out.shape == ref_out.shape and out.transpose(1, 2).is_contiguous()
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    atol, rtol = STAT_TOL[dtype]
    torch.testing.assert_close(sums, ref_sums, atol=atol, rtol=rtol)


def test_triton_small_tiles_batch_and_strides():
    """Several row and key tiles with partial last ones, batch 2, and keys / values read through strides."""
    pytest.importorskip("triton")
    from presses.kernels.fused_prefill import attention_with_column_sums_triton

    q, k, v = _qkv(2, 2, 3, 45, seed=11)
    kt, vt = k.transpose(2, 3).contiguous().transpose(2, 3), v.transpose(2, 3).contiguous().transpose(2, 3)
    assert not kt.is_contiguous()
    out, sums = attention_with_column_sums_triton(q, kt, vt, None, None, block_m=16, block_n=16)
    ref_out, ref_sums = attention_with_column_sums(q, k, v)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sums, ref_sums, atol=1e-6, rtol=1e-4)


def test_dispatch_routes_by_mode(monkeypatch):
    pytest.importorskip("triton")
    import presses.kernels.fused_prefill as fused_prefill
    from presses.kernels import attention_with_column_sums as dispatch

    calls = []
    real = fused_prefill.attention_with_column_sums_triton
    monkeypatch.setattr(
        fused_prefill, "attention_with_column_sums_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v = _qkv(1, 1, 3, 20, seed=2)
    monkeypatch.delenv("KVPRESS_RESEARCH_KERNELS", raising=False)
    ref = dispatch(q, k, v)  # CPU tensors: the torch path
    assert calls == []
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    out = dispatch(q, k, v)
    assert calls == [1]
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------------ the press: fused vs today's path
def _run_press(model, ids, fused: bool, monkeypatch, **press_kwargs):
    """Prefill with the press; returns (last hidden state, proposals, biases, cache, recompute calls, taken)."""
    captured, recomputed, taken = [], [], []
    real_compute, real_cols, real_take = (
        proposals.compute_proposal,
        proposals.attention_column_sums,
        proposals.take_prefill_stats,
    )
    monkeypatch.setattr(
        snis_press, "compute_proposal", lambda *a, **kw: captured.append(real_compute(*a, **kw)) or captured[-1]
    )
    monkeypatch.setattr(
        proposals, "attention_column_sums", lambda *a, **kw: recomputed.append(1) or real_cols(*a, **kw)
    )
    monkeypatch.setattr(proposals, "take_prefill_stats", lambda *a: taken.append(real_take(*a)) or taken[-1])
    if not fused:  # today's path: no statistics requested, the proposal is recomputed after the prefill
        monkeypatch.setattr(snis_press, "request_statistics", lambda *a: None)
    press = ProbabilisticEvictionPress(**press_kwargs)
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        hidden = model.model(input_ids=ids, past_key_values=cache).last_hidden_state
    biases = decode_biases(cache)
    monkeypatch.undo()
    return hidden, captured, biases, cache, recomputed, [t for t in taken if t is not None]


@pytest.mark.parametrize("budget", ["global", "head"])
@pytest.mark.parametrize("proposal", ["h2o", "h2o_h", "min_h", "min"])
def test_press_fused_equals_todays_path(tiny_llama, monkeypatch, proposal, budget):
    model = tiny_llama(num_heads=6, num_kv_heads=2, num_layers=3, hidden=96, attn_implementation="sdpa", seed=2)
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(4))
    kw = {"compression_ratio": 0.6, "proposal": proposal, "budget": budget, "seed": 7, "block_size": 32}
    h_new, pi_new, b_new, c_new, recomputed_new, taken_new = _run_press(model, ids, True, monkeypatch, **kw)
    h_old, pi_old, b_old, c_old, recomputed_old, taken_old = _run_press(model, ids, False, monkeypatch, **kw)
    # the fused path was taken in every layer and nothing was recomputed; today's path recomputed every layer
    assert len(taken_new) == 3 and taken_old == []
    assert recomputed_new == [] and len(recomputed_old) == (0 if proposal == "min" else 3)
    assert torch.equal(h_new, h_old)  # the same attention outputs: sdpa's own kernel, bit for bit
    for a, b in zip(pi_new, pi_old, strict=True):  # the same proposals
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for i in range(3):  # the same kept entries in the same slots, the same correction
        assert torch.equal(torch.isfinite(b_new[i]), torch.isfinite(b_old[i]))
        torch.testing.assert_close(b_new[i], b_old[i], atol=1e-4, rtol=1e-4)
        assert torch.equal(c_new.layers[i].keys, c_old.layers[i].keys)
        assert torch.equal(c_new.layers[i].values, c_old.layers[i].values)


def test_press_through_forced_triton_keeps_the_same_entries(tiny_llama, monkeypatch):
    """The press's prefill goes through the fused Triton kernel when it is forced (interpreter here) and keeps
    the entries the torch path keeps."""
    pytest.importorskip("triton")
    import presses.kernels.fused_prefill as fused_prefill

    model = tiny_llama(num_heads=6, num_kv_heads=2, num_layers=2, hidden=96, attn_implementation="sdpa", seed=3)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(5))
    results, calls = {}, []
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", mode)
        real = fused_prefill.attention_with_column_sums_triton
        monkeypatch.setattr(
            fused_prefill,
            "attention_with_column_sums_triton",
            lambda *a, _mode=mode, _real=real, **kw: calls.append(_mode) or _real(*a, **kw),
        )
        press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o_h", budget="head", seed=0)
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            hidden = model.model(input_ids=ids, past_key_values=cache).last_hidden_state
        results[mode] = (hidden, decode_biases(cache))
        monkeypatch.undo()
    assert calls == ["triton", "triton"]  # one call per layer, only when forced
    torch.testing.assert_close(results["triton"][0], results["reference"][0], atol=1e-5, rtol=1e-4)
    for a, b in zip(results["triton"][1], results["reference"][1]):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_eager_recomputes_column_sums_but_min_reads_the_last_row(tiny_llama, monkeypatch):
    """Eager attention always passes a mask: the column sums are not fused (recomputed, same result as
    today), while ``min``'s last row comes from the layer's own query with any attention implementation."""
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="eager", seed=1)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    kw = {"compression_ratio": 0.5, "seed": 1}
    _, pi_new, b_new, _, recomputed, taken = _run_press(model, ids, True, monkeypatch, proposal="h2o_h", **kw)
    _, pi_old, b_old, _, _, _ = _run_press(model, ids, False, monkeypatch, proposal="h2o_h", **kw)
    assert taken == [] and len(recomputed) == 2
    for a, b in zip(pi_new + b_new, pi_old + b_old):  # the very same computation
        assert torch.equal(a, b)
    _, pi_new, b_new, _, _, taken = _run_press(model, ids, True, monkeypatch, proposal="min", **kw)
    _, pi_old, b_old, _, _, _ = _run_press(model, ids, False, monkeypatch, proposal="min", **kw)
    assert len(taken) == 2
    for a, b in zip(pi_new, pi_old):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for a, b in zip(b_new, b_old):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))


def test_padded_batch_is_not_fused(tiny_llama, monkeypatch):
    """A left-padded batch gets an sdpa mask: the wrapper leaves the prefill to sdpa and the press recomputes."""
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa", seed=1)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0
    taken = []
    real = proposals.take_prefill_stats
    monkeypatch.setattr(proposals, "take_prefill_stats", lambda *a: taken.append(real(*a)) or taken[-1])
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o", budget="head", seed=0)
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache())
    assert len(taken) == 2 and all(t is None for t in taken)


def test_wrapper_is_a_passthrough_without_request_and_decoding_is_untouched(tiny_llama):
    model = tiny_llama(num_heads=6, num_kv_heads=2, num_layers=2, attn_implementation="sdpa", seed=6)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(6))
    nxt = torch.tensor([[7]])

    def logits_after(prefill_press):
        cache = DynamicCache()
        with torch.no_grad():
            with prefill_press(model) if prefill_press else contextlib.nullcontext():
                model.model(input_ids=ids, past_key_values=cache)
            return model(input_ids=nxt, past_key_values=cache, position_ids=torch.tensor([[50]])).logits

    before = logits_after(None)  # whatever ALL_ATTENTION_FUNCTIONS holds before the install
    attention.install()
    assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_kvpress_research_attention", False)
    assert torch.equal(logits_after(None), before)  # no request: bit for bit the wrapped function
    cache = DynamicCache()
    request_statistics(cache, "h2o_h")
    with torch.no_grad():
        other = DynamicCache()  # a cache without the request is untouched
        model.model(input_ids=ids, past_key_values=other)
        assert attention.requests_of(other) is None and not attention.requests_of(cache).results
        model.model(input_ids=ids, past_key_values=cache)
        stats = dict(attention.requests_of(cache).results)
        assert sorted(stats) == [0, 1] and all(isinstance(s, PrefillStats) for s in stats.values())
        model.model(input_ids=nxt, past_key_values=cache, position_ids=torch.tensor([[50]]))  # decode step
        # a decode step inside the context neither computes nor drops the prefill's statistics
        assert attention.requests_of(cache).results == stats
    request_statistics(cache, None)
    assert attention.requests_of(cache).prefill is None and not attention.requests_of(cache).results


def test_install_is_idempotent(tiny_llama):
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    attention.install()
    chain = ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_ATTENTION_FUNCTIONS["eager"]
    for _ in range(3):  # a press entered again and again does not grow the wrapper chain
        with ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o")(model), torch.no_grad():
            model.model(input_ids=ids, past_key_values=DynamicCache())
        attention.install()
        assert (ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_ATTENTION_FUNCTIONS["eager"]) == chain


def test_take_checks_kind_and_key_tensor_and_is_taken_once():
    cache = DynamicCache()
    keys = torch.zeros(1, 1, 4, 2)
    scores = torch.full((1, 2, 4), 0.25)
    results = attention.requests_of(cache, create=True).results
    results[0] = PrefillStats("harmonic_columns", scores, keys)
    assert take_prefill_stats(cache, 0, keys.clone(), "h2o_h") is None  # another tensor (e.g. a replayed cache)
    results[0] = PrefillStats("harmonic_columns", scores, keys)
    assert take_prefill_stats(cache, 0, keys, "h2o") is None  # h2o needs unweighted column sums
    results[0] = PrefillStats("harmonic_columns", scores, keys)
    assert take_prefill_stats(cache, 1, keys, "min_h") is None  # another layer's
    assert take_prefill_stats(cache, 0, keys, "min_h") is scores  # min_h and h2o_h share the harmonic sums
    assert take_prefill_stats(cache, 0, keys, "min_h") is None  # taken once
    assert take_prefill_stats(None, 0, keys, "min_h") is None  # no cache, nothing to take


def test_fused_prefill_clears_stale_adakv_masking(tiny_llama):
    """The fused path replaces the wrapped function's prefill call, so it clears kvpress's
    ``masked_key_indices`` (AdaKV) as kvpress's attention patch does at every prefill."""
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    for module in attention_modules(model):
        module.masked_key_indices = (torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
    press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o")
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.randint(3, 128, (1, 30)), past_key_values=DynamicCache())
    assert all(m.masked_key_indices is None for m in attention_modules(model))


def test_embedded_model_keeps_the_same_entries(embedded_model, monkeypatch):
    """End to end on SmolLM2-135M (9 query heads, 3 KV groups, 30 layers): ``h2o_h`` with the global budget
    keeps the same entries with the fused path as with today's recompute (prefill outputs bit for bit)."""
    model, _ = embedded_model
    ids = torch.randint(100, 40000, (1, 400), generator=torch.Generator().manual_seed(0))
    kw = {"compression_ratio": 0.5, "proposal": "h2o_h", "seed": 42}
    h_new, _, b_new, _, _, taken = _run_press(model, ids, True, monkeypatch, **kw)
    h_old, _, b_old, _, _, _ = _run_press(model, ids, False, monkeypatch, **kw)
    assert len(taken) == 30
    assert torch.equal(h_new, h_old)
    for a, b in zip(b_new, b_old):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
