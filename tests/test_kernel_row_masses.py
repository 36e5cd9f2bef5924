"""EntroPrefill's row kernel (presses/kernels/row_masses.py) against its torch reference, run by the Triton
interpreter on CPU, and EntroPrefill through the dispatch point (same patterns and tolerances as
tests/test_kernels.py, whose module header sets TRITON_INTERPRET and the device).

Shapes: ``T`` never a multiple of the 64-key block, ``r`` in {1, 3, 4}, rows in any order (audit positions) or the
last ``W`` (proposal observers), chunks with gaps between them (protected tokens), more chunks than one chunk
block (128) once; float32 / bfloat16 / float16 inputs.
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

from presses.core.row_masses import chunk_ids, chunk_masses_from_rows, row_chunk_masses_reference
from presses.kernels import row_chunk_masses, use_triton
from presses.kernels.row_masses import row_chunk_masses_triton


def _chunks(t, k, seed):
    """``k`` disjoint chunks with gaps, inside ``[4, t)``."""
    cuts = sorted(torch.randperm(t - 5, generator=_gen(seed))[: 2 * k].add(5).tolist())
    return [(cuts[2 * i], cuts[2 * i + 1]) for i in range(k)]


def _rows(t, n, seed, last):
    if last:
        return torch.arange(t - n, t, device=DEVICE)
    return torch.randperm(t, generator=_gen(seed))[:n].to(DEVICE)


# (G, r, n, T, k, last rows): r in {1, 3, 4}; T never a multiple of 64
CASES = [(3, 1, 8, 37, 3, True), (1, 3, 8, 70, 6, True), (2, 4, 20, 133, 12, False), (1, 3, 5, 300, 140, False)]
PARAMS = (
    [(*c, torch.float32) for c in CASES]
    + [(*CASES[i], torch.bfloat16) for i in (0, 2)]
    + [(*CASES[i], torch.float16) for i in (1, 3)]
)
if ON_GPU:  # compiled: every shape in every dtype
    PARAMS = [(*c, dtype) for dtype in ALL_DTYPES for c in CASES]


@pytest.mark.parametrize(("G", "r", "n", "T", "k", "last", "dtype"), PARAMS, ids=_dtype_id)
def test_row_chunk_masses_match_reference(G, r, n, T, k, last, dtype):
    q, keys = _qk(1, G, r, n, T, dtype, seed=G * 100 + r * 10 + n)
    rows = _rows(T, n, seed=T, last=last)
    ids = chunk_ids(T, _chunks(T, k, seed=k), DEVICE)
    w = torch.rand(n, generator=_gen(n)).to(DEVICE)
    masses, average = row_chunk_masses_triton(q, keys, rows, ids, k, w)
    ref_masses, ref_average = row_chunk_masses_reference(q, keys, rows, ids, k, w)
    atol, rtol = STAT_TOL[dtype]
    assert masses.shape == (1, G * r, n, k) and average.shape == (1, G * r, T)
    torch.testing.assert_close(masses, ref_masses, atol=atol, rtol=rtol)
    torch.testing.assert_close(average, ref_average, atol=atol, rtol=rtol)
    # the masses are parts of probability rows: they sum to at most 1, and to the average's mass on the chunks
    assert bool((masses.sum(-1) <= 1 + 1e-5).all())
    on_chunks = (average * (ids >= 0)).sum(-1)
    torch.testing.assert_close((masses * w.view(n, 1)).sum((-1, -2)), on_chunks, atol=1e-5, rtol=1e-4)


def test_row_chunk_masses_by_hand():
    """One head, two keys per chunk, queries with equal logits on their visible keys: masses are counts / visible."""
    q = torch.zeros(1, 1, 3, 16, device=DEVICE)  # zero queries: uniform rows over the visible keys
    keys = torch.randn(1, 1, 7, 16, generator=_gen(1)).to(DEVICE)
    ids = torch.tensor([-1, 0, 0, -1, 1, 1, -1], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([6, 2, 4], device=DEVICE)
    expected = torch.tensor([[2 / 7, 2 / 7], [2 / 3, 0.0], [2 / 5, 1 / 5]], device=DEVICE)
    masses, average = row_chunk_masses_triton(q, keys, rows, ids, 2, torch.tensor([1.0, 0.0, 0.0], device=DEVICE))
    torch.testing.assert_close(masses[0, 0], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(average[0, 0], torch.full((7,), 1 / 7, device=DEVICE), atol=1e-6, rtol=0)
    torch.testing.assert_close(row_chunk_masses_reference(q, keys, rows, ids, 2)[0][0, 0], expected, atol=1e-6, rtol=0)


def test_row_chunk_masses_tiles_splits_and_strides():
    """Several row blocks, several key blocks per split, split merging, no average, strided inputs."""
    q, keys = _qk(1, 2, 3, 12, 150, torch.float32, seed=7)
    rows = _rows(150, 12, seed=3, last=False)
    ids = chunk_ids(150, _chunks(150, 9, seed=2), DEVICE)
    ref, _ = row_chunk_masses_reference(q, keys, rows, ids, 9)
    masses, average = row_chunk_masses_triton(q, keys, rows, ids, 9, None, block_m=16, block_n=16, num_splits=3)
    assert average is None
    torch.testing.assert_close(masses, ref, atol=1e-6, rtol=1e-4)
    qt, kt = q.transpose(2, 3).contiguous().transpose(2, 3), keys.transpose(2, 3).contiguous().transpose(2, 3)
    assert not qt.is_contiguous() and not kt.is_contiguous()
    torch.testing.assert_close(row_chunk_masses_triton(qt, kt, rows, ids, 9)[0], ref, atol=1e-6, rtol=1e-4)


def test_row_chunk_masses_chunk_tiles_and_tuning_knobs():
    """More chunks than one chunk tile (three tiles of 16 for 40 chunks), and the sweep's knobs
    (evaluation.studies.tune_row_masses): every setting gives the reference's masses."""
    q, keys = _qk(1, 2, 2, 5, 300, torch.float32, seed=11)
    rows = _rows(300, 5, seed=4, last=True)
    ids = chunk_ids(300, _chunks(300, 40, seed=5), DEVICE)
    w = torch.rand(5, generator=_gen(5)).to(DEVICE)
    ref = row_chunk_masses_reference(q, keys, rows, ids, 40, w)
    for knobs in ({"max_block_k": 16}, {"max_block_k": 16, "num_warps": 8, "mass_precision": "ieee"}, {}):
        masses, average = row_chunk_masses_triton(q, keys, rows, ids, 40, w, **knobs)
        torch.testing.assert_close(masses, ref[0], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(average, ref[1], atol=1e-6, rtol=1e-4)


def test_row_chunk_masses_bad_input():
    q, keys = _qk(1, 1, 2, 4, 20, torch.float32)
    ids = chunk_ids(20, [(4, 9)], DEVICE)
    rows = torch.arange(16, 20, device=DEVICE)
    with pytest.raises(ValueError, match=r"chunk ids must lie in \[-1, num_chunks=1\)"):
        row_chunk_masses_triton(q, keys, rows, ids + 1, 1)
    with pytest.raises(ValueError, match=r"expected \(20,\) \(one per key\)"):
        row_chunk_masses_triton(q, keys, rows, ids[:10], 1)
    with pytest.raises(ValueError, match=r"row positions must lie in \[0, t=20\)"):
        row_chunk_masses_triton(q, keys, rows + 1, ids, 1)
    with pytest.raises(ValueError, match="num_kv_heads=2 must divide num_heads=3"):
        q3, _ = _qk(1, 1, 3, 4, 20, torch.float32)
        row_chunk_masses_triton(q3, keys.expand(1, 2, 20, keys.shape[-1]), rows, ids, 1)
    with pytest.raises(ValueError, match="max_block_k must be a power of two >= 16, got 24"):
        row_chunk_masses_triton(q, keys, rows, ids, 1, max_block_k=24)
    with pytest.raises(ValueError, match=r"mass_precision must be one of \('ieee', 'tf32x3'\), got 'tf32'"):
        row_chunk_masses_triton(q, keys, rows, ids, 1, mass_precision="tf32")
    with pytest.raises(ValueError, match="overlaps another chunk"):
        chunk_ids(20, [(4, 9), (8, 12)])
    with pytest.raises(ValueError, match="outside"):
        chunk_ids(20, [(4, 21)])


def test_dispatch_routes_by_mode(monkeypatch):
    import presses.kernels.row_masses as row_masses

    q, keys = _qk(1, 1, 3, 8, 40, torch.float32, seed=9)
    rows, ids = _rows(40, 8, 0, last=True), chunk_ids(40, [(5, 12), (14, 30)], DEVICE)
    w = torch.full((8,), 1 / 8, device=DEVICE)
    calls = []
    real = row_masses.row_chunk_masses_triton
    monkeypatch.setattr(row_masses, "row_chunk_masses_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    if ON_GPU:
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "reference")
    else:
        monkeypatch.delenv("KVPRESS_RESEARCH_KERNELS", raising=False)
        assert not use_triton(keys)
    ref = row_chunk_masses(q, keys, rows, ids, 2, w)
    assert calls == []  # the reference, not the kernel
    exact = row_chunk_masses_reference(q, keys, rows, ids, 2, w)
    # the reference's chunk masses sum with index_add_, whose CUDA order is not fixed (the GPU check found
    # last-bit differences between two calls): equal on the CPU, equal to float32 rounding on a GPU
    tol = dict(atol=1e-7, rtol=1e-6) if ON_GPU else dict(atol=0.0, rtol=0.0)
    torch.testing.assert_close(ref[0], exact[0], **tol)
    torch.testing.assert_close(ref[1], exact[1], **tol)
    monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", "triton")
    got = row_chunk_masses(q, keys, rows, ids, 2, w)
    assert calls == [1]
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-4)
    # the eager path's helper reduces given rows the same way
    probs = torch.softmax(torch.randn(1, 3, 8, 40, generator=_gen(4)), -1).to(DEVICE)
    m = chunk_masses_from_rows(probs, ids, 2)
    torch.testing.assert_close(m[..., 1], probs[..., 14:30].sum(-1), atol=1e-6, rtol=0)


def test_entroprefill_same_decisions_through_dispatch(monkeypatch):
    """EntroPrefill (docs/methods.md §4) with the reference forced and with Triton forced (interpreter on CPU):
    the kernel is called, and the press removes the same chunks, audits the same loss and keeps the same cache."""
    from conftest import make_tiny_llama
    from test_entroprefill import TOK, prompt, run_press

    import presses.kernels.row_masses as row_masses
    from presses.entroprefill import EntroPrefillPress

    model = make_tiny_llama(num_heads=6, num_kv_heads=2, num_layers=3, attn_implementation="sdpa", seed=5).to(DEVICE)
    ids = prompt(6).to(DEVICE)
    calls = []
    real = row_masses.row_chunk_masses_triton
    monkeypatch.setattr(row_masses, "row_chunk_masses_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVPRESS_RESEARCH_KERNELS", mode)
        press = EntroPrefillPress(
            tokenizer=TOK,
            compression_ratio=0.3,
            n_sink=2,
            epsilon=0.9,
            epsilon_audit=0.95,
            stability_streak=0,
            monitored_layers=[0, 1],
            audit_size=64,
        )
        logits, cache = run_press(model, ids, press, [70])
        results[mode] = (press.summary(), logits, cache)
        # proposal and audit rows at the accepted layer 0: two kernel calls with Triton, none with the reference
        assert len(calls) == (0 if mode == "reference" else 2)
    (st_ref, lg_ref, c_ref), (st, lg, c) = results["reference"], results["triton"]
    assert st_ref["bypass_reason"] == "" and st_ref["n_removed"] > 0
    for key in ("accepted_layer", "removed_chunks", "T_prime", "D_l"):
        assert st[key] == st_ref[key], key
    assert st["eta_hat_max"] == pytest.approx(st_ref["eta_hat_max"], abs=1e-5)
    assert st["U_l"] == pytest.approx(st_ref["U_l"], rel=1e-4)
    for layer, ref_layer in zip(c.layers, c_ref.layers):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lg, lg_ref, atol=1e-4, rtol=1e-4)
