"""Tiny random-weight models of every family ``configs/model/`` and ``evaluation.guards`` name, with their real
configs' shape ratios and features.

Written by hand from the published ``config.json`` of each checkpoint (offline: no hub). Each tiny model keeps the
family's architecture (Qwen2: biases on the q/k/v projections; Qwen3: per-head RMS norms on queries and keys and
``H_Q d != hidden``; Llama 3: ``llama3`` RoPE scaling; Gemma2: the attention logit soft-cap, sliding and full
layers in turn, ``query_pre_attn_scalar``; Gemma3: q/k norms, sliding and full layers with their own RoPE bases,
``query_pre_attn_scalar``; Mistral: a sliding window on every layer; Phi-3: fused ``qkv_proj``, LongRoPE, Phi-4-mini's
partial rotary embedding), its GQA ratio ``r = H_Q / G``, its ratio of attention width ``H_Q d`` to hidden size, and
its ratio of MLP to hidden size; heads are 16 wide (8 for SmolLM2, whose real heads are 64 wide against the
others' 128), with 2 layers. Sliding windows are scaled to the tests' 320-token prompts (16 or 32 positions), so
that they exclude positions as the real ones (512 to 4096) do on long prompts.
"""

from __future__ import annotations

import torch

#: family name -> (transformers architecture, real config values, tiny config values)
FAMILIES = {
    # Qwen/Qwen2.5-1.5B-Instruct: hidden 1536, 12 heads / 2 KV heads of 128 (r=6), MLP 8960, q/k/v biases, tied
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=192,
            intermediate_size=1120,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        ),
    ),
    # Qwen/Qwen3-4B: hidden 2560, 32 heads / 8 KV heads of 128 (r=4, H_Q d = 4096 = 1.6 hidden), MLP 9728,
    # q_norm / k_norm, no biases, tied
    "qwen3-4b": (
        "qwen3",
        dict(
            hidden_size=80,
            intermediate_size=304,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=40960,
            rope_theta=1e6,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        ),
    ),
    # meta-llama/Llama-3.2-3B-Instruct: hidden 3072, 24 heads / 8 KV heads of 128 (r=3), MLP 8192, llama3 RoPE
    # scaling (factor 32), tied
    "llama-3.2-3b": (
        "llama",
        dict(
            hidden_size=96,
            intermediate_size=256,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    # meta-llama/Llama-3.1-8B-Instruct: hidden 4096, 32 heads / 8 KV heads of 128 (r=4), MLP 14336, llama3 RoPE
    # scaling (factor 8), untied
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=128,
            intermediate_size=448,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded model): hidden 576, 9 heads / 3 KV heads of 64 (r=3),
    # MLP 1536, tied
    "smollm2-135m": (
        "llama",
        dict(
            hidden_size=72,
            intermediate_size=192,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    # google/gemma-2-27b-it: hidden 4608, 32 heads / 16 KV heads of 128 (r=2, H_Q d = 0.89 hidden), MLP 36864,
    # query_pre_attn_scalar 144 = hidden / heads (so the scale is not d ** -0.5), attention soft-cap 50 (here 5: the
    # tiny model's logits are smaller), final soft-cap 30, sliding window 4096 of 8192 positions on every other
    # layer (layer 0 sliding), tied
    "gemma-2-27b": (
        "gemma2",
        dict(
            hidden_size=72,
            intermediate_size=576,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=18,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            sliding_window=16,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
    # google/gemma-3-27b-it (text model): hidden 5376, 32 heads / 16 KV heads of 128 (r=2, H_Q d = 0.76 hidden), MLP
    # 21504, q/k norms, query_pre_attn_scalar 168 = hidden / heads, sliding window 1024 on 5 of 6 layers (layer 0
    # sliding) with RoPE base 10000, full layers with base 1e6 and linear scaling 8, 131072 positions, tied
    "gemma-3-27b": (
        "gemma3_text",
        dict(
            hidden_size=84,
            intermediate_size=336,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=21,
            sliding_window=32,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
            max_position_embeddings=131072,
            tie_word_embeddings=True,
        ),
    ),
    # mistralai/Mistral-7B-v0.1: hidden 4096, 32 heads / 8 KV heads of 128 (r=4), MLP 14336, a sliding window of 4096
    # (of 32768 positions) on every layer, untied
    "mistral-7b-v0.1": (
        "mistral",
        dict(
            hidden_size=128,
            intermediate_size=448,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=16,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
    ),
    # microsoft/Phi-3.5-mini-instruct: hidden 3072, 32 heads / 32 KV heads of 96 (MHA, r=1), MLP 8192, fused qkv_proj,
    # LongRoPE (original 4096 of 131072 positions), sliding window 262144 (no shorter than the positions: full), untied
    "phi-3.5-mini": (
        "phi3",
        dict(
            hidden_size=48,
            intermediate_size=128,
            num_attention_heads=3,
            num_key_value_heads=3,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.8, 2.5],
                "long_factor": [1.0, 1.1, 1.3, 1.8, 3.0, 6.0, 12.0, 24.0],
            },
            sliding_window=262144,
            tie_word_embeddings=False,
        ),
    ),
    # microsoft/Phi-4-mini-instruct: hidden 3072, 24 heads / 8 KV heads of 128 (r=3), MLP 8192, partial rotary
    # embedding (0.75 of each head), LongRoPE, sliding window 262144 (full), tied
    "phi-4-mini": (
        "phi3",
        dict(
            hidden_size=96,
            intermediate_size=256,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            partial_rotary_factor=0.75,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
                "long_factor": [1.0, 1.5, 2.5, 5.0, 10.0, 20.0],
            },
            sliding_window=262144,
            tie_word_embeddings=True,
        ),
    ),
}


def make_tiny_family(
    family: str,
    vocab: int = 260,
    num_layers: int = 2,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A random-weight causal LM of ``family`` (a key of :data:`FAMILIES`), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, values = FAMILIES[family]
    cfg = AutoConfig.for_model(
        arch, vocab_size=vocab, num_hidden_layers=num_layers, bos_token_id=1, eos_token_id=2, pad_token_id=0, **values
    )
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    with torch.no_grad():  # trained norms are not all ones (with all-ones q/k norms, Qwen3's key norms would tie)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def save_tiny_checkpoint(family: str, path, tokenizer, seed: int = 0) -> None:
    """``save_pretrained`` a tiny ``family`` model (vocab 128) and ``tokenizer`` into ``path``, as a downloaded
    checkpoint would be (what ``model.path=`` reads)."""
    model = make_tiny_family(family, vocab=128, seed=seed)
    with torch.no_grad():  # sharper logits: greedy answers depend on the cache
        model.get_output_embeddings().weight.mul_(5.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
