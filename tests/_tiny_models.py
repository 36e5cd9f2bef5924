"""Tiny random-weight models of every family ``configs/model/`` names, with their real configs' shape ratios.

Written by hand from the published ``config.json`` of each checkpoint (offline: no hub). Each tiny model keeps the
family's architecture (Qwen2: biases on the q/k/v projections; Qwen3: per-head RMS norms on queries and keys and
``H_Q d != hidden``; Llama 3: ``llama3`` RoPE scaling), its GQA ratio ``r = H_Q / G``, its ratio of attention
width ``H_Q d`` to hidden size, and its ratio of MLP to hidden size; heads are 16 wide (8 for SmolLM2, whose real
heads are 64 wide against the others' 128), with 2 layers.
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
