"""The SNIS logit bias in full precision (issue 17 item 6): on the sdpa and eager paths a biased layer of a
half-precision model is computed in float32, so the importance log-weights reach the logits unrounded."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import presses.attention_bias as attention_bias
from presses import attention
from presses.attention_bias import AttentionBias

LOG_WEIGHT = 0.123456  # bf16 rounds it to 0.12354 (8 significant bits)


class _Attn(torch.nn.Module):
    def __init__(self, r):
        super().__init__()
        self.num_key_value_groups, self.layer_idx, self.is_causal = r, 0, True
        self.eval()


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bias_reaches_the_logits_in_float32(impl, q_len, monkeypatch):
    assert torch.tensor(LOG_WEIGHT, dtype=torch.bfloat16).item() != torch.tensor(LOG_WEIGHT).item()
    g = torch.Generator().manual_seed(q_len)
    B, G, r, P, d = 1, 2, 2, 6, 8
    K = P + q_len + 1
    q = torch.randn(B, G * r, q_len, d, generator=g).to(torch.bfloat16)
    k = torch.randn(B, G, K, d, generator=g).to(torch.bfloat16)
    v = torch.randn(B, G, K, d, generator=g).to(torch.bfloat16)
    bias = torch.randn(B, G, P, generator=g)
    bias[0, 0, 2] = LOG_WEIGHT
    bias[0, 1, 5] = float("-inf")  # padding
    module = _Attn(r)
    cache = DynamicCache()
    k, v = cache.update(k, v, 0)  # the bias belongs to the cache whose layer 0 holds these keys
    attention.set_decode_bias(cache, 0, AttentionBias(bias))
    masks = []
    real = attention_bias.bias_mask
    monkeypatch.setattr(attention_bias, "bias_mask", lambda *a: masks.append(real(*a)) or masks[-1])
    out, _ = ALL_ATTENTION_FUNCTIONS[impl](module, q, k, v, None, dropout=0.0, scaling=d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (B, q_len, G * r, d)
    (mask,) = masks
    # the logits get the float32 log-weights bit for bit (the bf16 cast would change them by up to 2^-9 |w|)
    assert mask.dtype == torch.float32
    assert torch.equal(mask[:, :, :, :P], bias.repeat_interleave(r, 1).unsqueeze(2).expand(B, G * r, q_len, P))
    assert mask[0, 0, 0, 2].item() == torch.tensor(LOG_WEIGHT).item()
    # the output is the float32 reference (on the same bf16 inputs) up to its own rounding to bf16
    logits = q.float() @ k.float().repeat_interleave(r, 1).transpose(-1, -2) * d**-0.5
    full = torch.zeros(B, G * r, q_len, K)
    full[..., :P] = bias.repeat_interleave(r, 1).unsqueeze(2)
    post = torch.arange(K - P).view(1, -1) <= torch.arange(K - P - q_len, K - P).view(-1, 1)  # causal
    full[..., P:] = torch.zeros(q_len, K - P).masked_fill(~post, float("-inf"))
    ref = (torch.softmax(logits + full, -1) @ v.float().repeat_interleave(r, 1)).transpose(1, 2)
    assert (out.float() - ref).abs().max() <= 2**-8 * ref.abs().max()
