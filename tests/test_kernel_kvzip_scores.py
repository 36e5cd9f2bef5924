"""KVzip's reconstruction-score kernel (presses/kernels/kvzip_scores.py) against its torch reference
(presses/core/kvzip_scores.py), run by the Triton interpreter on CPU, and KVzipFastPress through the dispatch point
(same patterns and tolerances as tests/test_kernels.py, whose module header sets TRITON_INTERPRET and the device).

Shapes: ``c`` (the scored keys) never a multiple of the 64-key block, ``r`` in {1, 3, 4}, ``n`` rows over more than
one row block, normalisers over more keys than those scored; KVzip+'s row and column weights; float32 / bfloat16 /
float16 inputs.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import (
    ALL_DTYPES,
    DEVICE,
    ON_GPU,
    STAT_TOL,
    _dtype_id,
    _gen,
    _qk,
)  # importing test_kernels sets TRITON_INTERPRET first

from presses.core.kvzip_scores import reconstruction_column_maxes as reference
from presses.kernels import reconstruction_column_maxes
from presses.kernels.kvzip_scores import reconstruction_column_maxes_triton

SCALING = 0.3


def _inputs(G, r, n, c, dtype, weights, seed=0):
    """Queries, the ``c`` scored keys, each row's normaliser over those and 30 more keys, and (``weights``) KVzip+'s
    row and column weights."""
    q, keys = _qk(1, G, r, n, c + 30, dtype, seed=seed)
    logits = torch.einsum("bhnd,bhtd->bhnt", q.float(), keys.float().repeat_interleave(r, dim=1)) * SCALING
    lse = torch.logsumexp(logits, -1)
    rows = cols = None
    if weights:
        rows = (torch.rand(1, n, generator=_gen(seed + 1)) + 0.5).to(DEVICE)
        cols = (torch.rand(1, G * r, c, generator=_gen(seed + 2)) * 2).to(DEVICE)
    return q, keys[:, :, :c], lse, rows, cols, logits[..., :c]


# (G, r, n, c, weights): c never a multiple of 64; n over one row block of 64 and below it
CASES = [(2, 1, 20, 37, False), (1, 3, 70, 100, True), (2, 4, 130, 65, True), (1, 3, 9, 150, False)]
PARAMS = (
    [(*c, torch.float32) for c in CASES]
    + [(*CASES[i], torch.bfloat16) for i in (1, 2)]
    + [(*CASES[i], torch.float16) for i in (0, 3)]
)
if ON_GPU:  # compiled: every shape in every dtype
    PARAMS = [(*c, dtype) for dtype in ALL_DTYPES for c in CASES]


@pytest.mark.parametrize(("G", "r", "n", "c", "weights", "dtype"), PARAMS, ids=_dtype_id)
def test_reconstruction_column_maxes_match_reference(G, r, n, c, weights, dtype):
    q, keys, lse, rows, cols, logits = _inputs(G, r, n, c, dtype, weights, seed=G * 100 + r * 10 + n)
    ref = reference(q, keys, lse, SCALING, rows, cols)
    atol, rtol = STAT_TOL[dtype]
    for blocks in ({}, {"block_m": 16, "block_n": 16}):
        out = reconstruction_column_maxes_triton(q, keys, lse, SCALING, rows, cols, **blocks)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # the reference against the explicit weights: a softmax over c + 30 keys, its first c scored
    probs = torch.exp(logits - lse[..., None])
    if weights:
        probs = probs * rows[:, None, :, None] * cols[:, :, None, :]
    dense = probs.view(1, G, r, n, c).amax(dim=(2, 3))
    torch.testing.assert_close(ref, dense, atol=1e-6, rtol=1e-5)
    assert float(ref.min()) > 0 and (weights or float(ref.max()) < 1.0)


def test_empty_rows_and_bad_input():
    q, keys, lse, rows, cols, _ = _inputs(1, 3, 8, 20, torch.float32, True)
    empty = reconstruction_column_maxes_triton(q[:, :, :0], keys, lse[..., :0], SCALING)
    assert empty.shape == (1, 1, 20) and not empty.any()
    assert torch.equal(empty, reference(q[:, :, :0], keys, lse[..., :0], SCALING))
    with pytest.raises(ValueError, match=r"lse has shape \(1, 3, 7\), expected \(1, 3, 8\)"):
        reconstruction_column_maxes_triton(q, keys, lse[..., :7], SCALING)
    with pytest.raises(ValueError, match=r"row_weights has shape \(8,\), expected \(1, 8\)"):
        reconstruction_column_maxes_triton(q, keys, lse, SCALING, rows[0])
    with pytest.raises(ValueError, match=r"column_weights has shape \(1, 3, 19\), expected \(1, 3, 20\)"):
        reference(q, keys, lse, SCALING, rows, cols[..., :19])
    with pytest.raises(ValueError, match="num_kv_heads=2 must divide num_heads=3"):
        reconstruction_column_maxes_triton(q, torch.cat([keys, keys], 1), lse, SCALING)
    with pytest.raises(ValueError, match="queries dtype torch.float32 differs from keys dtype torch.float16"):
        reconstruction_column_maxes_triton(q, keys.half(), lse, SCALING)


def test_dispatch_routes_by_mode(monkeypatch):
    """Auto on CPU (reference forced on a GPU) is the reference bit for bit; forced Triton is the kernel's result."""
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "reference" if ON_GPU else "auto")
    q, keys, lse, rows, cols, _ = _inputs(2, 3, 20, 40, torch.float32, True, seed=5)
    ref = reconstruction_column_maxes(q, keys, lse, SCALING, rows, cols)
    assert torch.equal(ref, reference(q, keys, lse, SCALING, rows, cols))
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    atol, rtol = STAT_TOL[torch.float32]
    out = reconstruction_column_maxes(q, keys, lse, SCALING, rows, cols)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("plus", [False, True])
def test_kvzip_fast_press_scores_through_the_kernel(monkeypatch, tmp_path, plus):
    """KVzipFastPress (KVzip and KVzip+, two chunks) scores the same through the Triton kernel as through the
    reference, and the kernel is what ran."""
    from _tiny_tokenizer import char_tokenizer
    from conftest import make_tiny_llama
    from test_kvzip_fast import _scored

    import presses.kernels.kvzip_scores as kernel_module
    from presses import KVzipFastPress

    model = make_tiny_llama(num_heads=6, num_kv_heads=2, num_layers=2, attn_implementation="sdpa", seed=4).to(DEVICE)
    char_tokenizer().save_pretrained(tmp_path)  # KVzip's pass reloads the tokenizer from the model's path
    model.config.name_or_path = str(tmp_path)
    ids = torch.randint(4, 128, (1, 130), generator=_gen(3)).to(DEVICE)
    press = KVzipFastPress(0.5, kvzip_plus_normalization=plus, chunk_size=80)
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "reference")
    expected, _ = _scored(press, model, ids)
    calls = []
    real = kernel_module.reconstruction_column_maxes_triton
    monkeypatch.setattr(kernel_module, "reconstruction_column_maxes_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    scores, _ = _scored(press, model, ids)
    assert len(calls) == 2 * 2  # layers x chunks
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)
