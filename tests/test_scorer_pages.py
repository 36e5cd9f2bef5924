"""Pages ranked by a kvpress scorer's per-token scores (``presses.ScorerPagePress``; docs/methods.md §1.17): its Triton
page-score kernel equals the torch reference, it keeps whole pages under the strict budget with the protected pages
first, it works inside kvpress's wrappers, and the shared-prefill replay rebuilds its cache bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_llama
from kvpress import (
    AdaKVPress,
    ComposedPress,
    KeyRerotationPress,
    KnormPress,
    KVzapPress,
    ScorerPress,
    SnapKVPress,
)
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
from transformers import DynamicCache

from evaluation import replay
from evaluation.loop import seed_example
from presses import ScorerPagePress
from presses.core.paging import page_budget, page_scores, protected_page_mask
from presses.kernels import scorer_page_scores
from presses.kernels.references import scorer_page_scores_reference
from presses.kernels.scorer_pages import scorer_page_scores_triton

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method", ["block_max", "mass", "mean", "halo_max"])
def test_triton_page_scores_equal_the_reference(method):
    """Under the interpreter (conftest sets TRITON_INTERPRET=1): every method, partial last pages, heads shared."""
    gen = torch.Generator().manual_seed(0)
    for T, page_size, shared in itertools.product([1, 7, 32, 33, 95], [1, 4, 32], [False, True]):
        tokens = torch.randn(2, 3, T, generator=gen)
        ref = scorer_page_scores_reference(tokens, page_size, method, shared)
        assert ref.shape == (2, 1 if shared else 3, -(-T // page_size))
        torch.testing.assert_close(scorer_page_scores_triton(tokens, page_size, method, shared), ref)


def test_page_scores_reference_is_the_paging_rule_and_refuses_bad_input():
    tokens = torch.tensor([[[1.0, 5.0, 2.0, 0.0, 3.0], [4.0, 0.0, 0.0, 8.0, 1.0]]])
    assert scorer_page_scores(tokens, 2, "block_max").tolist() == [[[5.0, 2.0, 3.0], [4.0, 8.0, 1.0]]]
    assert scorer_page_scores(tokens, 2, "mean", shared=True).tolist() == [[[2.5, 2.5, 2.0]]]
    torch.testing.assert_close(scorer_page_scores(tokens, 2, "halo_max"), page_scores(tokens, 2, "halo_max"))
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        scorer_page_scores(tokens, 0, "block_max")
    with pytest.raises(ValueError, match="page_score='top' is not one of"):
        scorer_page_scores(tokens, 2, "top")
    with pytest.raises(ValueError, match=r"expected \(B, G, T\)"):
        scorer_page_scores(tokens[0], 2, "mean")


def test_options_are_checked():
    with pytest.raises(ValueError, match="must be a kvpress ScorerPress"):
        ScorerPagePress(press=None)
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        ScorerPagePress(press=KnormPress(), page_size=0)
    with pytest.raises(ValueError, match="group_selection='union' is not one of"):
        ScorerPagePress(press=KnormPress(), group_selection="union")
    with pytest.raises(ValueError, match="compression_ratio=1.0 must be in"):
        ScorerPagePress(press=KnormPress(), compression_ratio=1.0)


def random_kvzap(model, model_type: str = "linear", seed: int = 0) -> KVzapPress:
    """A KVzapPress with random surrogate weights for ``model`` (offline: kvpress's hub load is skipped because the
    press already holds the model it would load)."""
    cfg = model.config
    torch.manual_seed(seed)
    kvzap = KVzapPress(model_type=model_type)
    kvzap.kvzap_model = KVzapModel(
        KVzapConfig(
            input_dim=cfg.hidden_size,
            output_dim=cfg.num_key_value_heads,
            n_modules=cfg.num_hidden_layers,
            hidden_dim=None if model_type == "linear" else 16,
        )
    )
    kvzap.kvzap_model_name = f"nvidia/KVzap-{model_type}-{cfg.name_or_path.split('/')[-1]}"
    return kvzap


class _Recorder(ScorerPress):
    """A scorer that records the token scores its inner scorer gives each layer."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.seen = inner, {}

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.inner.score(module, hidden_states, keys, values, attentions, kwargs)
        self.seen[module.layer_idx] = scores.detach().clone()
        return scores


@pytest.mark.parametrize(
    "options",
    [{}, {"page_size": 8, "page_score": "halo_max"}, {"group_selection": "shared", "protect": "none"}],
)
def test_keeps_the_protected_pages_and_the_best_pages_under_the_budget(options):
    """The kept positions are the plan's protected pages plus the best-scored other pages of each KV head, rebuilt
    here from the scorer's own token scores, and their count is the plan's (at most the budget)."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    recorder = _Recorder(random_kvzap(model))
    recorder.inner.post_init_from_model(model)
    press = ScorerPagePress(press=recorder, compression_ratio=0.6, **options)
    T = 300
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(1))
    full, cache = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=full)
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
    plan = page_budget(T, 0.6, press.page_size, press.n_sink, press.window_size, "shrink", press.protect)
    assert 0 < plan.kept_tokens <= plan.budget
    for i in range(2):
        tokens = recorder.seen[i]
        if press.group_selection == "shared":
            tokens = tokens.mean(1, keepdim=True)
        pages = page_scores(tokens, press.page_size, press.page_score)[0]  # (G or 1, P)
        protected = protected_page_mask(T, press.page_size, press.n_sink, press.window_size, press.protect)
        assert torch.equal(plan.protected, protected & plan.protected)
        keys = cache.layers[i].keys
        assert keys.shape[2] == plan.kept_tokens
        for g in range(2):
            free = (~plan.protected).nonzero().squeeze(-1)
            best = free[pages[min(g, pages.shape[0] - 1), free].argsort(descending=True, stable=True)]
            chosen = torch.cat([plan.protected.nonzero().squeeze(-1), best[: plan.num_selected]]).sort().values
            positions = (chosen.unsqueeze(-1) * press.page_size + torch.arange(press.page_size)).flatten()
            positions = positions[positions < T]
            assert torch.equal(keys[0, g], full.layers[i].keys[0, g, positions])
    summary = press.summary()
    assert summary["kept_tokens"] == plan.kept_tokens and summary["budget_tokens"] == plan.budget
    assert summary["effective_compression"] == pytest.approx(1 - plan.kept_tokens / T)


def test_works_inside_kvpress_wrappers():
    """kvpress's wrappers call ``score`` (AdaKV: protected pages' tokens rank first) or ``compress``
    (KeyRerotation, a ComposedPress it leads); each compresses and decodes."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=2, attn_implementation="sdpa")
    ids = torch.randint(4, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    for wrapper in (
        AdaKVPress(ScorerPagePress(press=random_kvzap(model), compression_ratio=0.5)),
        KeyRerotationPress(ScorerPagePress(press=random_kvzap(model), compression_ratio=0.5)),
        ComposedPress([ScorerPagePress(press=random_kvzap(model), compression_ratio=0.5), SnapKVPress(0.2)]),
    ):
        cache = DynamicCache()
        with torch.inference_mode():
            with wrapper(model):
                model.model(input_ids=ids, past_key_values=cache)
            out = model(input_ids=ids[:, -1:], past_key_values=cache, position_ids=torch.tensor([[200]]))
        assert torch.isfinite(out.logits).all()
        if not isinstance(wrapper, AdaKVPress):  # AdaKV masks instead of evicting
            assert cache.get_seq_length() < 200


def test_the_shared_prefill_replay_rebuilds_the_cache_exactly():
    """``evaluation.fused`` replays the press's hooks on one recorded prefill: the same cache, bit for bit."""
    model = make_tiny_llama(num_heads=4, num_kv_heads=2, num_layers=3, attn_implementation="sdpa")
    press = ScorerPagePress(press=random_kvzap(model, "mlp"), compression_ratio=0.6)
    ids = torch.randint(4, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        direct = DynamicCache()
        with press(model):
            model.model(input_ids=ids, past_key_values=direct)
        with replay.PrefillCapture(model) as capture:
            model.model(input_ids=ids, past_key_values=DynamicCache())
        seed_example(42, "x")
        replayed = replay.replay_prefill(model, press, capture)
    for i in range(3):
        assert direct.layers[i].keys.shape[2] < 400
        assert torch.equal(replayed.layers[i].keys, direct.layers[i].keys)
        assert torch.equal(replayed.layers[i].values, direct.layers[i].values)
