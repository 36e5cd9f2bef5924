"""PageEntroKVPress mechanics on tiny random GQA Llamas: strict per-layer cache length, kvpress
pipeline and ``model.generate``, RoPE continuity at position T, sdpa/eager agreement, records and
summary (docs/methods.md §1; paper 000 Theorem 3; paper 001 section 7)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _tiny_tokenizer import char_tokenizer
from transformers import DynamicCache

from presses.page_entrokv import PageEntroKVPress

W, B, N_SINK = 16, 8, 4


def expected_kept(T: int, ratio: float, page_size: int = B, n_sink: int = N_SINK, window: int = W) -> int:
    """Strict-budget count from the formula of docs/methods.md §1 step 8, computed independently of
    presses.core.paging."""
    b = math.floor(round(T * (1 - ratio), 9))
    pages = {j // page_size for j in range(T) if j < n_sink or j >= T - window}
    prot = sum(1 for j in range(T) if j // page_size in pages)
    free = -(-T // page_size) - len(pages)
    return prot + min((b - prot) // page_size, free) * page_size


def prefill(model, ids, press):
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def rand_ids(T, batch=1, seed=0):
    return torch.randint(3, 128, (batch, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compression_ratio": 1.0}, r"compression_ratio=1.0 must be in \[0, 1\)"),
        ({"compression_ratio": -0.1}, r"compression_ratio=-0.1"),
        ({"page_size": 0}, "page_size=0 must be an integer >= 1"),
        ({"window_size": 0}, "window_size=0 must be an integer >= 1"),
        ({"n_sink": -1}, "n_sink=-1 must be an integer >= 0"),
        ({"alpha": 0.0}, "alpha=0.0 must be > 0"),
        ({"tau": -1.0}, "tau=-1.0 must be > 0"),
        (
            {"pooling": "median"},
            r"pooling='median' is not one of \('entropy', 'raw_entropy', 'mean', 'max'\) \(ChunkKV's values, the "
            r"ablation ladder's, are evaluation\.studies\.ladder\.PageEntroKVLadderPress's\)",
        ),
        ({"page_score": "sum"}, r"page_score='sum' is not one of \('block_max', 'mass', 'halo_max'\) \(ChunkKV's"),
        ({"page_score": "mean"}, r"page_score='mean' is not one of .* evaluation\.studies\.ladder\.PageEntroKVLadder"),
        ({"group_selection": "shared"}, r"group_selection='shared' is not one of \('group', 'union'\) \(ChunkKV's"),
        ({"on_budget_conflict": "skip"}, "on_budget_conflict='skip' is not one of"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageEntroKVPress(**kwargs)


@pytest.mark.parametrize("r", [1, 2, 4])
def test_pipeline_strict_budget_per_layer(tiny_llama, r):
    from kvpress.pipeline import KVPressTextGenerationPipeline

    impl = "eager" if r == 2 else "sdpa"  # eager passes its attention weights to the press
    model = tiny_llama(num_heads=4, num_kv_heads=4 // r, num_layers=2, attn_implementation=impl, seed=r)
    tok = char_tokenizer()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    context = "The quick brown fox jumps over the lazy dog; the needle is 7421. " * 4
    T = len(tok.encode(tok.bos_token + context, add_special_tokens=False))
    press = PageEntroKVPress(compression_ratio=0.6, window_size=W, page_size=B, n_sink=N_SINK)
    cache = DynamicCache()
    out = pipe(context, question="What is the needle?", press=press, max_new_tokens=4, cache=cache)
    assert isinstance(out["answer"], str)
    n = expected_kept(T, 0.6)
    assert n < T
    assert [cache.get_seq_length(i) for i in range(2)] == [n, n]
    assert cache.layers[0].keys.shape == (1, 4 // r, n, 16)
    s = press.summary()
    assert s["context_length"] == T and s["kept_tokens"] == n and s["layers"] == 2
    assert s["effective_compression"] == pytest.approx(1 - n / T)


@pytest.mark.parametrize("r", [1, 2, 4])
def test_generate_continues_at_position_T_and_gathers_kept_positions(tiny_llama, r):
    """``model.generate`` under the press decodes the first new token at position T, on a cache that
    equals the full cache gathered at the recorded pages (ascending); intra-group UOR is exactly 1."""
    model = tiny_llama(num_heads=4, num_kv_heads=4 // r, num_layers=2, attn_implementation="sdpa", seed=10 + r)
    T, ratio = 150, 0.5
    ids = rand_ids(T, seed=r)
    press = PageEntroKVPress(compression_ratio=ratio, window_size=W, page_size=B, n_sink=N_SINK, record=True)
    with torch.no_grad(), press(model):
        gen = model.generate(
            ids, max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0
        )
    n = expected_kept(T, ratio)
    assert [rec["kept_tokens"] for rec in press.records] == [n, n]
    first = gen.sequences[:, T : T + 1]

    # reference: full prefill without a press, gather the recorded pages, decode at explicit position T
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
    ref = copy.deepcopy(full)
    G = 4 // r
    for rec, layer in zip(press.records, ref.layers):
        pages = rec["kept_pages"]  # (G, n_pages), one selection per group
        pos = (pages.unsqueeze(-1) * B + torch.arange(B)).flatten(-2)
        pos = torch.stack([p[p < T] for p in pos])  # (G, n)
        assert pos.shape == (G, n) and bool((pos[:, 1:] > pos[:, :-1]).all())
        # intra-group UOR: the r query heads of group g all read group g's single selection
        for g in range(G):
            heads = [pos[h // r] for h in range(g * r, (g + 1) * r)]
            assert torch.unique(torch.cat(heads)).numel() / n == 1.0
        idx = pos.unsqueeze(0).unsqueeze(-1).expand(1, G, n, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
    wrong = copy.deepcopy(ref)
    with torch.no_grad():
        at_T = model(input_ids=first, past_key_values=ref, position_ids=torch.tensor([[T]])).logits[0, -1]
        at_n = model(input_ids=first, past_key_values=wrong, position_ids=torch.tensor([[n]])).logits[0, -1]
    assert torch.allclose(gen.logits[1][0], at_T, atol=1e-4)
    assert not torch.allclose(gen.logits[1][0], at_n, atol=1e-4)  # the check can fail


def test_sdpa_and_eager_keep_the_same_pages(tiny_llama):
    ids = rand_ids(200, seed=5)
    kept = {}
    for impl in ("sdpa", "eager"):
        model = tiny_llama(num_heads=8, num_kv_heads=2, num_layers=2, attn_implementation=impl, seed=3)
        press = PageEntroKVPress(compression_ratio=0.7, window_size=W, page_size=B, n_sink=N_SINK, record=True)
        cache = prefill(model, ids, press)
        assert [cache.get_seq_length(i) for i in range(2)] == [expected_kept(200, 0.7)] * 2
        kept[impl] = [rec["kept_pages"] for rec in press.records]
        weights = [rec["weights"] for rec in press.records]
    for a, b in zip(kept["sdpa"], kept["eager"]):
        assert torch.equal(a, b)
    assert weights[0].shape == (2, 4) and torch.allclose(weights[0].sum(-1), torch.ones(2))


def test_records_reset_each_prefill_and_hold_diagnostics(tiny_llama):
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa")
    press = PageEntroKVPress(compression_ratio=0.5, window_size=W, page_size=B, n_sink=N_SINK, record=True)
    prefill(model, rand_ids(120), press)
    assert len(press.records) == 3
    prefill(model, rand_ids(96, seed=1), press)
    assert [rec["layer_idx"] for rec in press.records] == [0, 1, 2]
    rec = press.records[1]
    assert rec["T"] == 96 and rec["entropy"].shape == (4,) and rec["raw_entropy"].shape == (4,)
    assert rec["z"].shape == (4,) and bool(((rec["z"] > 0) & (rec["z"] <= 1 + 1e-6)).all())
    assert bool((rec["entropy"] <= math.log(96 - N_SINK) + 1e-6).all())
    assert rec["effective_compression"] == pytest.approx(1 - expected_kept(96, 0.5) / 96)
    assert rec["kept_pages"].shape[0] == 2 and rec["protected_pages"].tolist() == [0, 10, 11]


def test_no_compression_short_context_and_conflicts(tiny_llama, caplog):
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    ids = rand_ids(100)
    full = prefill(model, ids, PageEntroKVPress(compression_ratio=0.0))
    assert full.get_seq_length() == 100
    # T <= window_size compresses too (docs/methods.md §1.12): T=64, b=6, four full pages, all protected;
    # protection shrinks to nothing (window page 3 first, ..., sink page 0 last) and K = floor(6/16) = 0: whole
    # pages would keep nothing, so one partial page keeps the b = 6 best tokens
    press = PageEntroKVPress(compression_ratio=0.9, window_size=64, page_size=16)
    short = prefill(model, ids[:, :64], press)
    assert short.get_seq_length() == 6 and press.summary()["protection_shrunk"] == 1
    assert press.summary()["partial_page"] == 1
    # T=100, W=64, B=16: protected 84 tokens > b = 50: shrinks to pages {0, 5, 6} = 36 by default
    press = PageEntroKVPress(compression_ratio=0.5, window_size=64, page_size=16)
    assert prefill(model, ids, press).get_seq_length() == 36 and press.summary()["protected_tokens"] == 36
    with pytest.raises(ValueError, match="b=50"):
        prefill(model, ids, PageEntroKVPress(0.5, window_size=64, page_size=16, on_budget_conflict="raise"))
    press = PageEntroKVPress(0.5, window_size=64, page_size=16, on_budget_conflict="keep_protected")
    with caplog.at_level("WARNING", logger="presses.core.paging"):
        cache = prefill(model, ids, press)
    assert cache.get_seq_length() == 84 and press.summary()["budget_conflict"] == 1
    assert sum("budget conflict" in r.getMessage() for r in caplog.records) == 1  # once per prefill


@pytest.mark.parametrize("pooling", ["raw_entropy", "mean", "max"])
def test_ablations_and_batch_rows(tiny_llama, pooling):
    """Batches are supported: each row selects its own pages (as it would alone), same count."""
    model = tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa", seed=4)
    ids = torch.cat([rand_ids(128, seed=8), rand_ids(128, seed=9)])
    kw = {
        "compression_ratio": 0.75,
        "window_size": W,
        "page_size": B,
        "n_sink": N_SINK,
        "pooling": pooling,
        "page_score": "mass" if pooling == "max" else "block_max",
        "record": True,
    }
    press = PageEntroKVPress(**kw)
    cache = prefill(model, ids, press)
    n = expected_kept(128, 0.75)
    assert cache.layers[1].keys.shape[:3] == (2, 2, n)
    both = [rec["kept_pages"] for rec in press.records if rec["layer_idx"] == 1]
    alone = PageEntroKVPress(**kw)
    prefill(model, ids[1:], alone)
    assert torch.equal(both[1], alone.records[1]["kept_pages"])


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [0.5, 0.8])
@pytest.mark.parametrize("n_tokens", [23, 128])
def test_any_prompt_length_compresses_through_the_pipeline(embedded_model, ratio, n_tokens):
    """Issue 14: PageEntroKVPress at its defaults compresses a 23- and a 128-token prompt through kvpress's
    pipeline without an error, keeping within one page of the budget floor(T (1 - ratio)). The chat template
    alone is longer than 23 tokens, so the prompt is the tokenizer's BOS plus the context, as for LongBench's
    template-free tasks."""
    from kvpress import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    from evaluation.harness import chat_template

    model, tokenizer = embedded_model
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    words = "the cat sat on a mat and looked at the bird in the old tree by the river bank".split()
    with chat_template(tokenizer, False):
        text = ""
        for i in range(400):  # grow the context word by word up to n_tokens prompt tokens
            longer = (text + " " + words[i % len(words)]).strip()
            if pipe.preprocess(longer, [""], "", int(1e10))["context_ids"].shape[1] > n_tokens:
                break
            text = longer
        T = pipe.preprocess(text, [""], "", int(1e10))["context_ids"].shape[1]
        press = PageEntroKVPress(compression_ratio=ratio)
        cache = DynamicCache()
        answer = pipe(text, question=" What sat on the mat?", press=press, max_new_tokens=4, cache=cache)["answer"]
    assert n_tokens - 2 <= T <= n_tokens and press.summary()["context_length"] == T
    budget = int(T * (1 - ratio) + 1e-6)
    assert isinstance(answer, str)
    assert abs(press.summary()["kept_tokens"] - budget) < press.page_size
