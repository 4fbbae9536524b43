"""A Qwen2 model as a Megatron GPTModel: the architecture read from a Hugging Face directory, one
pipeline stage built per rank with tensor-parallel layers, and the inputs of a packed row.

Megatron's local (non transformer-engine) layer spec: RMSNorm (torch), SwiGLU MLP (gated linear_fc1),
self-attention with a QKV bias and grouped query heads, RoPE with the model's base.

Packing. Several sequences share one row of a micro-batch and must not see each other. Two things
make that exact:
- a block-diagonal causal attention mask (`[b, 1, s, s]`, True = masked), which Megatron's core
  attention applies as given;
- per-sequence positions for RoPE. Megatron's plain `rope` embedding always rotates position 0..s-1
  of the row, and its per-sequence variant needs the THD layout with transformer-engine or flash
  attention (neither runs on the CPU). So the model is built with Megatron's `mrope` rotary embedding,
  which rotates explicit `position_ids`; with the three position components equal (text tokens) it is
  exactly standard RoPE at those positions (Qwen2-VL's property), which is what Qwen2 computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Qwen2Arch:
    """The Qwen2 architecture fields the trainer needs (from config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> Qwen2Arch:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        if c.get("model_type") not in ("qwen2", None):
            raise ValueError(f"{model_dir}: model_type {c.get('model_type')!r} is not a Qwen2 model")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{model_dir}: RoPE scaling {rope.get('rope_type')!r} is not supported by the trainer")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise ValueError naming the field when the model cannot be split `tp` x `pp` ways."""
        for name, n in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ):
            if n % tp:
                raise ValueError(f"allocation.train_tp ({tp}) must divide the model's {name} ({n})")
        if self.num_layers % pp:
            raise ValueError(
                f"allocation.train_pp ({pp}) must divide the model's num_hidden_layers ({self.num_layers})"
            )


def transformer_config(arch: Qwen2Arch, tp: int, pp: int, dtype: torch.dtype = torch.float32):
    """Megatron's TransformerConfig of a Qwen2 model, with the CPU-safe kernels (no fusions)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # mrope with one section: standard RoPE at explicit positions (see the module docstring).
        mrope_section=[arch.head_dim // 2, 0, 0],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        # The weights come from the checkpoint, but Megatron marks a weight as tensor-parallel (which the
        # grad norm and clipping rely on) only in its initialization path: keep it.
        perform_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Loss functions return (sum over tokens, token count): every token of a minibatch weighs the
        # same, whatever micro-batch or data-parallel rank it is on.
        calculate_per_token_loss=True,
    )


def build_stage(arch: Qwen2Arch, config, device: torch.device):
    """This rank's pipeline stage of the model (parallel_state must be initialized)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="mrope",
        rotary_base=arch.rope_theta,
    )
    return model.to(device)


# --- inputs of a packed row ----------------------------------------------------------------------


@dataclass
class PackedRows:
    """A micro-batch: sequences packed into rows, with what the model needs to keep them apart."""

    tokens: torch.Tensor  # [b, s] int64 (pad 0)
    position_ids: torch.Tensor  # [3, b, s] int64, position within its own sequence (mrope layout)
    attention_mask: torch.Tensor  # [b, 1, s, s] bool, True where attention is not allowed
    seq_slices: list  # per sequence: (row, start, length) in the rows


def pack_rows(seqs: list[torch.Tensor], padded: bool = False) -> PackedRows:
    """Put `seqs` (1-D token tensors) in one row (packing), or one row each padded to the longest.

    A row's padding tail is its own segment: it never attends to, or is attended by, a sequence.
    """
    groups = [[i] for i in range(len(seqs))] if padded else [list(range(len(seqs)))]
    width = max(sum(len(seqs[i]) for i in g) for g in groups)
    rows = len(groups)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    pos = torch.zeros(rows, width, dtype=torch.long)
    seg = torch.full((rows, width), -1, dtype=torch.long)
    slices = [None] * len(seqs)
    for r, group in enumerate(groups):
        a = 0
        for i in group:
            n = len(seqs[i])
            tokens[r, a : a + n] = seqs[i]
            pos[r, a : a + n] = torch.arange(n)
            seg[r, a : a + n] = i
            slices[i] = (r, a, n)
            a += n
        pos[r, a:] = torch.arange(width - a)
        seg[r, a:] = len(seqs) + r
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal  # [b, s, s]
    return PackedRows(tokens, pos.unsqueeze(0).expand(3, -1, -1).contiguous(), ~allowed.unsqueeze(1), slices)
