"""Triton scoring kernels against their torch references, run by the Triton interpreter on CPU (issue 7).

Every kernel of :mod:`presses.kernels` is compared with its reference on small shapes covering: ``T`` not a
multiple of the key block, ``r`` in {1, 3, 4, 8}, ``W`` in {1, 16, 64}, float32 / bfloat16 / float16 inputs.
Then the presses are run through the dispatch point with the reference forced, the default (reference
on CPU) and Triton forced, and must keep the same positions.

Tolerances (``torch.testing.assert_close`` ``atol`` / ``rtol``), per input dtype. The kernels accumulate in
float32 (float64 for ``E[J]``) on the same input values the references upcast, so only summation order
and ``exp2`` vs ``exp`` differ:

- attention statistics (window attention, column sums; float32 outputs in ``[0, 1]``):
  fp32 ``1e-6 / 1e-4``; bf16 and fp16 inputs ``1e-5 / 1e-3`` (a GPU's low-precision MMA may order its
  float32 accumulation differently);
- Rényi / pooled / page scores (float32 in, float32 out): ``1e-6 / 1e-5``; entropies ``1e-5 / 1e-5``;
- ``E[J(m)]`` (float64): ``1e-12 / 1e-12``;
- biased decode attention (output in the input dtype, ``p`` rounded to the value dtype before ``p @ v``
  as in flash decoding): fp32 ``1e-5 / 1e-4``; bf16 ``1e-2 / 1.6e-2`` (one bf16 ulp near 1 is 7.8e-3);
  fp16 ``2e-3 / 2e-3``.

Note: the interpreter multiplies bfloat16 tiles as raw integers, so under the interpreter the kernels
upcast bfloat16 tiles to float32 before ``tl.dot`` (exact); on a GPU the native bf16 ``tl.dot`` runs.

Compiled on a GPU: ``KVPRESS_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/test_kernels.py`` puts every
input (and the tiny models) on the GPU, so the kernels are compiled rather than interpreted, and runs every
low-precision-capable test in float32, bfloat16 and float16 (``scripts/gpu_check.sh`` does this). Inputs are
drawn on the CPU from the same seeds and then moved, so both devices test the same values.
"""

from __future__ import annotations

import os

DEVICE_NAME = os.environ.get("KVPRESS_TEST_DEVICE", "cpu")
if DEVICE_NAME == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process

import pytest
import torch

pytest.importorskip("triton")

DEVICE = torch.device(DEVICE_NAME)
ON_GPU = DEVICE.type == "cuda"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if ON_GPU and not torch.cuda.is_available():
    raise RuntimeError(f"KVPRESS_TEST_DEVICE={DEVICE_NAME} but torch sees no CUDA device")
if ON_GPU and INTERPRET:
    raise RuntimeError(f"KVPRESS_TEST_DEVICE={DEVICE_NAME} needs TRITON_INTERPRET=0 (compiled kernels)")
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

from presses.core.columns import column_maxes as column_maxes_reference
from presses.core.columns import column_sums as column_sums_reference
from presses.core.observer import observer_attention_reference
from presses.kernels import (
    biased_decode_attention,
    column_maxes,
    column_sums,
    expected_unique_many,
    pooled_page_scores,
    use_triton,
    window_attention,
)
from presses.kernels.attention_columns import column_maxes_triton, column_sums_triton, window_attention_triton
from presses.kernels.biased_decode import biased_decode_triton
from presses.kernels.expected_unique import expected_unique_many_triton
from presses.kernels.references import (
    biased_decode_reference,
    expected_unique_many_reference,
    pooled_page_scores_reference,
)
from presses.kernels.renyi_pages import pooled_page_scores_triton
from presses.probabilistic.proposals import harmonic_prior

STAT_TOL = {torch.float32: (1e-6, 1e-4), torch.bfloat16: (1e-5, 1e-3), torch.float16: (1e-5, 1e-3)}
DECODE_TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
D = 20  # head dim: not a power of two, so the padded head-dim lanes are exercised


def _dtype_id(value):
    """Test ids name the dtype (``float32``) rather than ``dtype0``."""
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else None


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qk(B, G, r, n, t, dtype, seed=0, scale=1.5):
    g = _gen(seed)
    q = (torch.randn(B, G * r, n, D, generator=g) * scale).to(DEVICE, dtype)
    k = (torch.randn(B, G, t, D, generator=g) * scale).to(DEVICE, dtype)
    return q, k


@pytest.fixture(autouse=True)
def _auto_kernels(monkeypatch):
    monkeypatch.delenv("KVPRESS_RESEARCH_KERNELS", raising=False)


# ------------------------------------------------------------------------------ window attention
# (G, r, W, T): T never a multiple of the 64-key block; r in {1, 3, 4, 8}; W in {1, 16, 64}
# float32 runs every shape; each low-precision dtype runs two of them (all r and W between them)
WINDOW_CASES = [(2, 1, 1, 37), (1, 3, 16, 70), (1, 4, 64, 100), (1, 8, 16, 75)]
WINDOW_PARAMS = (
    [(*c, torch.float32) for c in WINDOW_CASES]
    + [(*WINDOW_CASES[i], torch.bfloat16) for i in (0, 2)]
    + [(*WINDOW_CASES[i], torch.float16) for i in (1, 3)]
)
if ON_GPU:  # compiled: every shape in every dtype
    WINDOW_PARAMS = [(*c, dtype) for dtype in ALL_DTYPES for c in WINDOW_CASES]


@pytest.mark.parametrize(("G", "r", "W", "T", "dtype"), WINDOW_PARAMS, ids=_dtype_id)
def test_window_attention_matches_reference(G, r, W, T, dtype):
    q, k = _qk(1, G, r, W, T, dtype, seed=G * 100 + r * 10 + W)
    out = window_attention_triton(q, k)
    ref = observer_attention_reference(q, k)
    atol, rtol = STAT_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.sum(-1), torch.ones(1, G * r, device=DEVICE), atol=1e-5, rtol=0)
    # causality: window query u never sees keys after T - W + u, so the last key gets only 1/W of a row
    assert bool((out[..., -1] <= 1.0 / W + 1e-6).all())


def test_window_attention_small_tiles_and_key_splits():
    """Several row blocks, several key blocks per split, a partial last block, and split merging."""
    q, k = _qk(1, 2, 3, 16, 70, torch.float32, seed=7)
    out = window_attention_triton(q, k, block_m=16, block_n=16, num_splits=3)
    torch.testing.assert_close(out, observer_attention_reference(q, k), atol=1e-6, rtol=1e-4)
    # non-contiguous inputs (strided views) are read through their strides
    qt, kt = q.transpose(2, 3).contiguous().transpose(2, 3), k.transpose(2, 3).contiguous().transpose(2, 3)
    assert not qt.is_contiguous() and not kt.is_contiguous()
    torch.testing.assert_close(window_attention_triton(qt, kt), out, atol=1e-6, rtol=1e-4)


def test_window_attention_bad_input():
    q, k = _qk(1, 1, 2, 8, 5, torch.float32)
    with pytest.raises(ValueError, match="shorter than window_size=8"):
        window_attention_triton(q, k)
    q, k = _qk(1, 1, 3, 2, 9, torch.float32)
    with pytest.raises(ValueError, match="num_kv_heads=2 must divide num_heads=3"):
        window_attention_triton(q, k.expand(1, 2, 9, D))


# ------------------------------------------------------------------------------ proposal column sums
@pytest.mark.parametrize("dtype", ALL_DTYPES if ON_GPU else [torch.float32], ids=_dtype_id)
def test_column_sums_harmonic_prior_all_rows(dtype):
    """``h2o_h``: all t rows weighted by the harmonic prior (paper 003 eq. 35-36), r = 4."""
    t = 45
    q, k = _qk(1, 1, 4, t, t, dtype, seed=3)
    prior = harmonic_prior(t, DEVICE)
    rows = torch.arange(t, device=DEVICE)
    out = column_sums_triton(q, k, prior, rows)
    ref = column_sums_reference(q, k, prior, rows)
    atol, rtol = STAT_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.sum(-1), torch.ones(1, 4, device=DEVICE), atol=1e-5, rtol=0)  # the prior sums to 1
    # the press's query blocks: summing per-block column sums gives the same result
    blocks = sum(
        column_sums_triton(q[:, :, s : s + 16], k, prior[s : s + 16], rows[s : s + 16]) for s in range(0, t, 16)
    )
    torch.testing.assert_close(blocks, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(ALL_DTYPES) if ON_GPU else [torch.bfloat16, torch.float16], ids=_dtype_id)
def test_column_sums_unsorted_rows_low_precision(dtype):
    q, k = _qk(1, 2, 3, 5, 50, dtype, seed=4)
    rows = torch.tensor([40, 3, 17, 49, 0], device=DEVICE)
    w = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0], device=DEVICE)
    out = column_sums_triton(q, k, w, rows, scaling=0.3)
    ref = column_sums_reference(q, k, w, rows, scaling=0.3)
    atol, rtol = STAT_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match=r"row positions must lie in \[0, t=50\)"):
        column_sums_triton(q, k, w, torch.tensor([0, 1, 2, 3, 50], device=DEVICE))


@pytest.mark.parametrize("dtype", ALL_DTYPES if ON_GPU else [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_column_maxes_match_reference(dtype):
    """KVzip-style importance per query head: the most attention any row pays each key, with unsorted rows, small
    tiles and key splits, against the reference and against a brute-force max over dense softmax rows."""
    q, k = _qk(1, 2, 3, 20, 70, dtype, seed=11)
    rows = torch.tensor([69, 5, 40, 41, 42, 68, 30, 31, 32, 50, 51, 52, 53, 60, 61, 62, 63, 64, 65, 66], device=DEVICE)
    ref = column_maxes_reference(q, k, rows, scaling=0.2)
    atol, rtol = STAT_TOL[dtype]
    for blocks in ({}, {"block_m": 16, "block_n": 16, "num_splits": 3}):
        torch.testing.assert_close(column_maxes_triton(q, k, rows, 0.2, **blocks), ref, atol=atol, rtol=rtol)
    logits = torch.einsum("bgrnd,bgtd->bgrnt", q.float().view(1, 2, 3, 20, D), k.float()) * 0.2
    visible = torch.arange(70, device=DEVICE).view(1, 70) <= rows.view(20, 1)
    dense = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).amax(-2).reshape(1, 6, 70)
    torch.testing.assert_close(ref, dense, atol=1e-6, rtol=1e-5)
    assert float(ref.max()) <= 1.0 and float(ref.min()) > 0  # row 69 sees every key
    with pytest.raises(ValueError, match="reduce='min' is not 'sum' or 'max'"):
        column_sums_reference(q, k, reduce="min")
    with pytest.raises(ValueError, match="reduce='min' is not 'sum' or 'max'"):
        column_sums_triton(q, k, reduce="min")


# ------------------------------------------------------------------------------ Rényi / pooling / pages
# (alpha, pooling, page_size, page_score, G, r): T = 45 is not a multiple of any page size or block
POOL_CASES = [
    (2.0, "entropy", 16, "block_max", 2, 4),
    (1.0, "raw_entropy", 5, "mass", 1, 3),
    (float("inf"), "max", 1, "block_max", 1, 8),
    (0.5, "mean", 7, "mass", 3, 1),
    (2.0, "entropy", 16, "mean", 2, 4),  # ChunkKV's chunk mean (the partial last page over its own length)
    (2.0, "mean", 8, "halo_max", 3, 3),  # the halo across page edges
]


@pytest.mark.parametrize(("alpha", "pooling", "page_size", "page_score", "G", "r"), POOL_CASES)
def test_pooled_page_scores_match_reference(alpha, pooling, page_size, page_score, G, r):
    T, n_sink = 45, 4
    attn = torch.softmax(torch.randn(2, G * r, T, generator=_gen(5)) * 3, dim=-1)
    attn[0, 0] = 0.0
    attn[0, 0, :n_sink] = 1.0 / n_sink  # all mass on the sinks: z = 0, a~ uniform by convention
    attn = attn.to(DEVICE)
    out = pooled_page_scores_triton(attn, G, n_sink, alpha, 0.5, pooling, page_size, page_score, diagnostics=True)
    ref = pooled_page_scores_reference(attn, G, n_sink, alpha, 0.5, pooling, page_size, page_score, diagnostics=True)
    torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=1e-5)
    assert out[1].shape == (2, G, -(-T // page_size))
    for key in ("entropy", "raw_entropy", "z", "weights"):
        if ref[2][key] is None:
            assert out[2][key] is None
        else:
            torch.testing.assert_close(out[2][key], ref[2][key], atol=1e-5, rtol=1e-5)


def test_pooled_page_scores_bad_input():
    attn = torch.softmax(torch.randn(1, 4, 10), -1).to(DEVICE)
    with pytest.raises(ValueError, match="pooling='median' is not one of"):
        pooled_page_scores_triton(attn, 2, 4, 2.0, 0.5, "median", 16, "block_max")
    with pytest.raises(ValueError, match="n_sink=10 must satisfy 0 <= n_sink < T=10"):
        pooled_page_scores_triton(attn, 2, 10, 2.0, 0.5, "entropy", 16, "block_max")
    with pytest.raises(ValueError, match="num_groups=3 must divide"):
        pooled_page_scores_triton(attn, 3, 4, 2.0, 0.5, "entropy", 16, "block_max")
    with pytest.raises(ValueError, match="page_size=0 must be >= 1"):
        pooled_page_scores_triton(attn, 2, 4, 2.0, 0.5, "entropy", 0, "block_max")


# ------------------------------------------------------------------------------ E[J(m)]
def test_expected_unique_many_matches_reference_and_spec_example():
    pi = torch.softmax(torch.randn(3, 50, generator=_gen(6), dtype=torch.float64) * 4, -1)
    pi[0, :3] = 0.0
    pi = (pi / pi.sum(-1, keepdim=True)).to(DEVICE)
    m = torch.tensor([0, 1, 2, 7, 50, 1000, 10**6, 10**12] * 3 + [5], dtype=torch.float64, device=DEVICE)  # M = 25
    out = expected_unique_many_triton(pi, m, block_m=16, block_t=16)
    ref = expected_unique_many_reference(pi, m)
    assert out.dtype == torch.float64 and out.shape == (3, 25)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    # docs/methods.md §3 item 3: pi = (0.8, 0.0998, 0.0001, 0.0001): E[J] is within 0.5 of 3 exactly for m in [2877,
    # 13862]
    spec_pi = torch.tensor([0.8, 0.0998, 0.0001, 0.0001], dtype=torch.float64, device=DEVICE)
    e = expected_unique_many_triton(spec_pi, torch.tensor([2876.0, 2877.0, 13862.0, 13863.0], device=DEVICE))
    assert bool((e[1:3] - 3).abs().le(0.5).all()) and bool((e[[0, 3]] - 3).abs().gt(0.5).all())


# ------------------------------------------------------------------------------ biased decode attention
# (G, r, K, num_splits): K never a multiple of the 16-key tile
DECODE_CASES = [(1, 1, 37, 1), (2, 3, 70, 2), (1, 4, 50, 3), (1, 8, 100, 1)]
DECODE_PARAMS = (
    [(*c, torch.float32) for c in DECODE_CASES]
    + [(*DECODE_CASES[i], torch.bfloat16) for i in (1, 3)]
    + [(*DECODE_CASES[i], torch.float16) for i in (0, 2)]
)
if ON_GPU:  # compiled: every shape in every dtype
    DECODE_PARAMS = [(*c, dtype) for dtype in ALL_DTYPES for c in DECODE_CASES]


@pytest.mark.parametrize(("G", "r", "K", "splits", "dtype"), DECODE_PARAMS, ids=_dtype_id)
def test_biased_decode_matches_reference(G, r, K, splits, dtype):
    g = _gen(K)
    q = torch.randn(2, G * r, 1, D, generator=g).to(dtype)
    k = torch.randn(2, G, K, D, generator=g).to(dtype)
    v = torch.randn(2, G, K, D, generator=g).to(dtype)
    bias = torch.randn(2, G, K, generator=g)
    bias[:, :, -5:] = float("-inf")  # padded slots
    bias[0, 0, 16:32] = float("-inf")  # a whole masked tile (a whole split when splits = 2)
    q, k, v, bias = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bias.to(DEVICE)
    out = biased_decode_triton(q, k, v, bias, scaling=0.3, block_n=16, num_splits=splits)
    ref = biased_decode_reference(q, k, v, bias, scaling=0.3)
    assert out.dtype == dtype and out.shape == (2, G * r, 1, D)
    atol, rtol = DECODE_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(ALL_DTYPES) if ON_GPU else [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_biased_decode_equals_snis_sdpa_path(dtype):
    """The kernel computes what presses.attention_bias's sdpa wrapper computes for one decode token:
    per-group SNIS bias on the prompt slots, -inf padding, the post-eviction entries unbiased."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from presses.attention_bias import AttentionBias, bias_mask

    B, G, r, P, n_after = 2, 2, 3, 30, 4
    g = _gen(11)
    prefix = torch.randn(B, G, P, generator=g)
    prefix[1, 0, 24:] = float("-inf")
    prefix[0, 1, 27:] = float("-inf")
    q = torch.randn(B, G * r, 1, D, generator=g).to(dtype)
    k = torch.randn(B, G, P + n_after, D, generator=g).to(dtype)
    v = torch.randn(B, G, P + n_after, D, generator=g).to(dtype)
    prefix, q, k, v = prefix.to(DEVICE), q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = r, True
    mask = bias_mask(AttentionBias(prefix), q, k, None)  # (B, H_Q, 1, K) in the query dtype
    expected = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0].transpose(1, 2)
    out = biased_decode_triton(q, k, v, mask[:, ::r, 0, :], scaling=0.25, block_n=16, num_splits=2)
    atol, rtol = DECODE_TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_biased_decode_bad_input():
    q, k = torch.randn(1, 4, 1, D, device=DEVICE), torch.randn(1, 2, 9, D, device=DEVICE)
    with pytest.raises(ValueError, match=r"bias has shape \(1, 2, 8\), expected \(B, G, K\) = \(1, 2, 9\)"):
        biased_decode_triton(q, k, k, torch.zeros(1, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="one decode token"):
        biased_decode_triton(torch.randn(1, 4, 2, D, device=DEVICE), k, k, torch.zeros(1, 2, 9, device=DEVICE))


# ------------------------------------------------------------------------------ dispatch
def test_dispatch_names_are_functions_after_kernel_imports():
    """Importing the Triton modules must not shadow a dispatch function of the package."""
    import presses.kernels as kernels
    from presses.kernels import attention_columns, biased_decode, expected_unique, references, renyi_pages  # noqa: F401 - imported to check that each module loads

    for name in (
        "window_attention",
        "column_maxes",
        "column_sums",
        "pooled_page_scores",
        "expected_unique_many",
        "biased_decode_attention",
        "use_triton",
    ):
        assert callable(getattr(kernels, name)), name


def test_kernel_mode_selection(monkeypatch):
    x = torch.zeros(1)
    assert not use_triton(x)  # auto: CPU tensors take the reference
    if ON_GPU:
        assert use_triton(x.to(DEVICE))  # auto: CUDA tensors take Triton
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "reference")
    assert not use_triton(x)
    if ON_GPU:
        assert not use_triton(x.to(DEVICE))
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    if INTERPRET:
        assert use_triton(x)
    else:  # compiled Triton cannot take a CPU tensor
        with pytest.raises(RuntimeError, match="on a CPU tensor needs TRITON_INTERPRET=1"):
            use_triton(x)
    if ON_GPU:
        assert use_triton(x.to(DEVICE))
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"KVPRESS_RESEARCH_KERNELS='fast' is not one of \('auto', 'reference'"):
        use_triton(x)


def test_dispatch_functions_route_by_mode(monkeypatch):
    """Auto on CPU (reference forced on a GPU, where auto picks Triton) returns the reference bit for bit;
    forced Triton returns the kernel's result."""
    if ON_GPU:
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "reference")
    q, k = _qk(1, 1, 3, 16, 40, torch.float32, seed=9)
    attn = window_attention(q, k)
    assert torch.equal(attn, observer_attention_reference(q, k))
    assert torch.equal(column_sums(q, k), column_sums_reference(q, k))
    assert torch.equal(column_maxes(q, k), column_maxes_reference(q, k))
    args = (1, 4, 2.0, 0.5, "entropy", 8, "block_max")
    pooled_ref = pooled_page_scores(attn, *args)
    assert torch.equal(pooled_ref[1], pooled_page_scores_reference(attn, *args)[1])
    pi = torch.softmax(torch.randn(2, 40, generator=_gen(1)), -1).to(DEVICE)
    m = torch.tensor([3.0, 90.0], device=DEVICE)
    assert torch.equal(expected_unique_many(pi, m), expected_unique_many_reference(pi, m))
    v, bias = k.clone(), torch.zeros(1, 1, 40, device=DEVICE)
    dec_ref = biased_decode_attention(q[:, :, -1:], k, v, bias)
    assert torch.equal(dec_ref, biased_decode_reference(q[:, :, -1:], k, v, bias))

    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    torch.testing.assert_close(window_attention(q, k), attn, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(pooled_page_scores(attn, *args)[1], pooled_ref[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(biased_decode_attention(q[:, :, -1:], k, v, bias), dec_ref, atol=1e-5, rtol=1e-4)


def _run_page_entrokv(model, ids, mode, monkeypatch):
    from transformers import DynamicCache

    from presses.page_entrokv import PageEntroKVPress

    if mode is None:
        monkeypatch.delenv("KVPRESS_RESEARCH_KERNELS", raising=False)
    else:
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", mode)
    # T = 83: 11 pages, 4 protected (27 tokens), budget 58 tokens -> the best 3 of 7 free pages
    press = PageEntroKVPress(compression_ratio=0.3, window_size=16, page_size=8, n_sink=4, record=True)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    with torch.no_grad():  # one decode step on the compressed cache
        logits = model(
            input_ids=ids[:, -1:], past_key_values=cache, position_ids=torch.tensor([[ids.shape[1]]], device=ids.device)
        ).logits
    return press.records, cache, logits


def test_page_entrokv_same_pages_through_dispatch(tiny_llama, monkeypatch):
    """docs/methods.md §1 through the dispatch point: reference forced, default (reference on CPU) and Triton
    forced (interpreter) keep the same pages in every layer and give the same cache and logits."""
    model = tiny_llama(num_heads=4, num_kv_heads=1, num_layers=2, attn_implementation="sdpa", seed=3).to(
        DEVICE
    )  # r = 4
    ids = torch.randint(3, 128, (1, 83), generator=_gen(2)).to(DEVICE)
    runs = {mode: _run_page_entrokv(model, ids, mode, monkeypatch) for mode in ("reference", None, "triton")}
    ref_records, ref_cache, ref_logits = runs["reference"]
    for mode in (None, "triton"):
        records, cache, logits = runs[mode]
        assert len(records) == len(ref_records) == 2
        assert ref_records[0]["kept_tokens"] == 27 + 3 * 8
        for rec, ref in zip(records, ref_records):
            assert torch.equal(rec["kept_pages"], ref["kept_pages"])
            torch.testing.assert_close(rec["weights"], ref["weights"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(rec["entropy"], ref["entropy"], atol=1e-5, rtol=1e-5)
        for layer, ref_layer in zip(cache.layers, ref_cache.layers):
            assert torch.equal(layer.keys, ref_layer.keys) and torch.equal(layer.values, ref_layer.values)
        if mode is None and not ON_GPU:  # auto is the reference on CPU (and Triton on a GPU)
            assert torch.equal(logits, ref_logits)
        else:
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_snis_proposal_through_column_sums_kernel(tiny_llama, monkeypatch):
    """The SNIS press recomputing its ``h2o_h`` proposal (harmonic prior, query blocks of 32 rows; prefill
    statistics off, as for a masked or eager prefill) goes through the dispatch point: with Triton forced it
    equals the reference path, and the press keeps the same entries."""
    from conftest import decode_biases
    from transformers import DynamicCache

    import presses.kernels.attention_columns as attention_columns
    import presses.probabilistic.press as snis_press
    import presses.probabilistic.proposals as proposals

    monkeypatch.setattr(snis_press, "request_statistics", lambda *args: None)

    model = tiny_llama(num_heads=6, num_kv_heads=2, num_layers=2, hidden=96, attn_implementation="sdpa", seed=4).to(
        DEVICE
    )
    ids = torch.randint(3, 128, (1, 48), generator=_gen(3)).to(DEVICE)
    results, triton_calls = {}, []
    real_triton = attention_columns.column_sums_triton

    def counting_triton(*args, **kwargs):
        triton_calls.append(1)
        return real_triton(*args, **kwargs)

    monkeypatch.setattr(attention_columns, "column_sums_triton", counting_triton)
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", mode)
        captured = []
        real = proposals.compute_proposal

        def spy(*args, **kwargs):
            captured.append(real(*args, **kwargs))
            return captured[-1]

        monkeypatch.setattr(snis_press, "compute_proposal", spy)
        press = snis_press.ProbabilisticEvictionPress(
            compression_ratio=0.5, proposal="h2o_h", budget="head", block_size=32, seed=0
        )
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=cache)
        results[mode] = (captured, decode_biases(cache))
        # reference mode never reaches Triton; triton mode runs 2 query blocks in each of the 2 layers
        assert len(triton_calls) == (0 if mode == "reference" else 4)
    (pi_ref, bias_ref), (pi_tri, bias_tri) = results["reference"], results["triton"]
    assert len(pi_ref) == len(pi_tri) == 2
    for a, b in zip(pi_tri, pi_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for a, b in zip(bias_tri, bias_ref):  # same kept entries (finite bias) in the same slots
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_snis_decode_through_biased_decode_kernel(tiny_llama, monkeypatch, attn):
    """The SNIS press's one-token decode step goes through the biased-decode dispatch when Triton is
    picked, and its logits equal those of the masked-attention path (reference mode)."""
    from transformers import DynamicCache

    import presses.kernels.biased_decode as biased_decode
    from presses.probabilistic.press import ProbabilisticEvictionPress

    model = tiny_llama(num_heads=6, num_kv_heads=2, num_layers=2, hidden=96, attn_implementation=attn, seed=5).to(
        DEVICE
    )
    ids = torch.randint(3, 128, (1, 40), generator=_gen(5)).to(DEVICE)
    nxt = torch.randint(3, 128, (1, 1), generator=_gen(6)).to(DEVICE)
    calls = []
    real = biased_decode.biased_decode_triton
    monkeypatch.setattr(biased_decode, "biased_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", mode)
        press = ProbabilisticEvictionPress(compression_ratio=0.5, proposal="h2o", budget="head", seed=0)
        cache = DynamicCache()
        with torch.no_grad():
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
            pos = torch.tensor([[ids.shape[1]]], device=DEVICE)  # decoding continues at position T
            out = model(input_ids=nxt, past_key_values=cache, position_ids=pos)
        logits[mode] = out.logits
        assert len(calls) == (0 if mode == "reference" else 2)  # one call per layer when Triton is picked
    assert torch.isfinite(logits["triton"]).all()
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pool_dims", [(), (1, 2)])
def test_budget_search_through_expected_unique_kernel(monkeypatch, pool_dims):
    """Algorithm 2 scores every row's midpoint through the ``E[J(m)]`` dispatch: forced Triton (interpreted
    here) gives the same ``m`` as the reference, head-wise and with the global (pooled) budget, and the
    search meets its tolerance (paper 003 Alg. 2, eq. 24)."""
    import presses.kernels.expected_unique as expected_unique_module
    from presses.core.coupon import expected_unique
    from presses.probabilistic.budget import search_num_samples

    pi = torch.softmax(3 * torch.randn(1, 2, 3, 50, generator=_gen(5), dtype=torch.float64), -1).to(DEVICE)
    calls = []
    real = expected_unique_module.expected_unique_many_triton

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(expected_unique_module, "expected_unique_many_triton", counting)
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "reference")
    m_ref = search_num_samples(pi, 0.6, pool_dims=pool_dims)
    assert not calls
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    m_tri = search_num_samples(pi, 0.6, pool_dims=pool_dims)
    assert len(calls) > 10  # one launch per level of the binary search (~log2(1e12))
    assert torch.equal(m_tri, m_ref)
    e = expected_unique(pi, m_ref)
    if pool_dims:
        e = e.mean(dim=pool_dims)
    assert torch.all((e - 0.4 * 50).abs() <= 0.5)
