"""A Qwen2, Qwen3 or Qwen3-MoE model as a Megatron GPTModel: the architecture read from a Hugging Face
directory (`areal_hpc.arch.QwenArch`) turned into Megatron's TransformerConfig, and this rank's pipeline
stage built with tensor- and expert-parallel layers.

Megatron's local (non transformer-engine) layer spec: RMSNorm (torch), SwiGLU MLP (gated linear_fc1),
self-attention with grouped query heads, RoPE with the model's base. The two architectures differ in
the attention only: Qwen2 has a QKV bias; Qwen3 has none, normalizes each query and key head
(RMSNorm over the head, before RoPE: Megatron's `qk_layernorm`), and sets its head size apart from
hidden_size / heads (`head_dim`, Megatron's `kv_channels`).

Qwen3-MoE is Qwen3 with every layer's MLP a Megatron `MoELayer`: a `TopKRouter` (softmax scores in
fp32; Qwen's `norm_topk_prob` renormalises the top-k probabilities, which is Megatron's softmax over
the top-k logits, `moe_router_pre_softmax` False; without it, softmax over all experts then top-k,
pre_softmax True) and `SequentialMLP` experts (one SwiGLU `linear_fc1`/`linear_fc2` pair each, no
grouped GEMM: no TransformerEngine). Experts are split over the expert-parallel ranks
(`expert_model_parallel_size`) and never over TP (`expert_tensor_parallel_size` 1); the tokens go to
their experts' ranks by Megatron's all-to-all dispatcher. The load-balancing loss is Megatron's
`aux_loss` with `ppo.load_balancing_coef` (null: config.json's `router_aux_loss_coef`), computed per
micro-batch over all its rows' tokens, padding and untrained (prompt) tokens included, and weighted
by that count over the step's trained tokens (the loss's denominator, `ppo.loss_agg: token_mean`, the
only aggregation the config allows with a load-balancing loss): the effective coefficient is the
configured one times rows / trained tokens. The router class is
`areal_hpc.trainer.moe.ReplayRouter` (routing replay; without targets a plain TopKRouter).

Three pieces replace Megatron's own, because the local spec runs on the CPU and on a bare GPU machine
(no TransformerEngine, no Apex) and the rows are packed:
- the core attention is `packed.SegmentAttention` and RoPE is Megatron's `mrope` at explicit
  per-sequence positions (why: `trainer.packed`);
- the last stage returns hidden states, not logits (`HiddenGPTModel`): `trainer.logprobs` turns them
  into token logprobs a chunk at a time;
- the norm is torch's RMSNorm marked for sequence parallelism (`RMSNorm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel

from areal_hpc.arch import QwenArch
from areal_hpc.config.choices import RECOMPUTE
from areal_hpc.trainer.packed import SegmentAttention


def transformer_config(
    arch: QwenArch,
    tp: int,
    pp: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    recompute: str = "none",
    sequence_parallel: bool = False,
    ep: int = 1,
    load_balancing_coef: float | None = None,
):
    """Megatron's TransformerConfig of the model on `device`, with the CPU-safe kernels (no fusions).
    `ep`: expert-parallel size; `load_balancing_coef`: the MoE aux-loss weight (None: config.json's)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **(_moe_fields(arch, ep, load_balancing_coef) if arch.moe else {}),
        **RECOMPUTE[recompute],
        sequence_parallel=sequence_parallel,
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
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # mrope with one section: standard RoPE at explicit positions (see areal_hpc.trainer.packed).
        mrope_section=[arch.head_dim // 2, 0, 0],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=torch.device(device).type == "cpu",
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


def _moe_fields(arch: QwenArch, ep: int, load_balancing_coef: float | None) -> dict:
    """TransformerConfig's mixture-of-experts fields (module docstring)."""
    coef = arch.router_aux_loss_coef if load_balancing_coef is None else load_balancing_coef
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_intermediate_size,
        "moe_router_topk": arch.num_experts_per_tok,
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": coef,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
    }


class HiddenGPTModel(GPTModel):
    """Megatron's GPTModel whose last stage returns its final hidden states ([s, b, h], after the final
    norm; [s / TP, b, h] with sequence parallelism) instead of logits. The loss turns them into token
    logprobs chunk by chunk (`logprobs.token_logprobs`), so a micro-batch's logits never exist whole. The
    output weight stays where Megatron keeps it: checkpoints, tied embeddings and their gradient sync are
    Megatron's own."""

    def _postprocess(self, hidden_states, *args, **kwargs):
        return hidden_states

    def output_weight(self) -> torch.Tensor:
        """[V / TP, h]: the output projection (the input embedding when tied)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as the layer spec's norm, usable with sequence parallelism.

    Megatron's own torch wrapper (WrappedTorchNorm) refuses sequence parallelism: under it each TP rank
    normalises a slice of the sequence, so the norm's weight gradient must be summed over the TP ranks,
    which Megatron does for parameters marked `sequence_parallel` (finalize_model_grads). The fused
    norms that mark it need TransformerEngine or Apex, absent on the CPU and on a bare GPU machine.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def build_stage(arch: QwenArch, config, device: torch.device) -> HiddenGPTModel:
    """This rank's pipeline stage of the model (parallel_state must be initialized)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )
    if config.num_moe_experts:
        from areal_hpc.trainer.moe import ReplayRouter

        spec.submodules.mlp.submodules.router = ReplayRouter
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:  # Qwen3: per head, over head_dim; Megatron sums their gradients over TP by name
        spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)
    model = HiddenGPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="mrope",
        rotary_base=arch.rope_theta,
    )
    _mark_experts(model)
    return model.to(device)


def _mark_experts(model) -> None:
    """Mark every expert weight as expert-parallel (`allreduce` False), as TransformerEngine's layers
    and Megatron's GroupedMLP do; the local linear layers of SequentialMLP leave it unset, and DDP and
    the optimizer would reduce the experts' gradients over all data-parallel ranks, which hold other
    experts at ep > 1. Marked at every ep (at ep 1 the expert-DP group is the DP group): the optimizer
    is the same chain of two at every expert-parallel size, so its checkpoint loads at any."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):
            for p in module.parameters():
                p.allreduce = False
