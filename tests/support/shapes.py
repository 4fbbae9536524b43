"""The tiny model shapes the tests and tools build (`areal_hpc.data.tiny.build_tiny_model`), each defined
once here, each with why it has that shape. A field left out takes the tiny default (ModelConfig's
docstrings: hidden 64, intermediate 256, 2 layers, 2 query and 2 key/value heads, vocabulary 128, 512
positions, tied embeddings; qwen3_moe: 4 experts, top 2, experts of width 64).
"""

from __future__ import annotations

import dataclasses

from areal_hpc.config import ModelConfig

# --- for the trainer (Megatron) ---------------------------------------------------------------------

QWEN2 = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2)
"""The trainer checks' model: grouped-query attention (4 query heads share 2 key/value heads, both split
over TP 2), tied embeddings."""

QWEN3 = dataclasses.replace(QWEN2, architecture="qwen3", head_dim=32)
"""A tiny Qwen3: q/k norms, no QKV bias, heads of size 32 (not 64 / 4), grouped-query, tied embeddings."""

QWEN2_UNTIED = dataclasses.replace(QWEN2, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
"""The export checks' Qwen2: an lm_head of its own (untied), QKV bias, 2 heads of size 64 / 2."""

QWEN2_DEEP_UNTIED = ModelConfig(
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
)
"""The conversion's other settings: untied, 4 layers, 4 query heads per key/value head, another RoPE base
and norm epsilon."""

QWEN2_MHA = ModelConfig(
    hidden_size=96, intermediate_size=192, num_layers=2, num_attention_heads=4, num_key_value_heads=4
)
"""Plain multi-head attention (as many key/value heads as query heads) for the conversion."""

TRAINER_MOE = ModelConfig(architecture="qwen3_moe", num_attention_heads=4, head_dim=32, tie_word_embeddings=False)
"""The MoE trainer and export checks' Qwen3-MoE (the tiny experts): heads of 32 (vLLM's CPU attention
needs that), 4 query heads per 2 key/value heads, untied; `norm_topk_prob` set by each check."""

ROUTER_MOE = ModelConfig(
    architecture="qwen3_moe",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
"""The routing-replay checks' Qwen3-MoE: 8 experts of width 32, top 2 (Qwen's renormalised top-k
probabilities), heads of 32 (4 query heads per 2 key/value heads)."""

TINY_MOE = ModelConfig(architecture="qwen3_moe")
"""The tiny Qwen3-MoE as `model.path: tiny` builds it: 4 experts, top 2, per-expert tensor names."""

# --- for the generator (vLLM on the CPU) --------------------------------------------------------------

GENERATOR = ModelConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
"""The generator checks' Qwen2: heads of 32 (vLLM's CPU attention needs at least that), 2 query heads per
key/value head, 256 positions (the engines' max_model_len)."""

GENERATOR_MOE = dataclasses.replace(GENERATOR, architecture="qwen3_moe")
"""GENERATOR with the tiny experts of a Qwen3-MoE: routing capture and per-expert weight loading."""

GENERATOR_TP = ModelConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
"""Heads of 32 whose 4 query and 2 key/value heads both split over 2 tensor-parallel vLLM workers."""

INTERRUPTION = ModelConfig(
    dtype="bfloat16", hidden_size=256, intermediate_size=512, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip
"""The GPU check's interruption model: a small bf16 Qwen2 with heads of 64, the size every vLLM attention
backend supports."""
