"""A Qwen2 or Qwen3 model as a Megatron GPTModel: the architecture read from a Hugging Face
directory, one pipeline stage built per rank with tensor-parallel layers, and the inputs of a packed row.

Megatron's local (non transformer-engine) layer spec: RMSNorm (torch), SwiGLU MLP (gated linear_fc1),
self-attention with grouped query heads, RoPE with the model's base. The two architectures differ in
the attention only: Qwen2 has a QKV bias; Qwen3 has none, normalizes each query and key head
(RMSNorm over the head, before RoPE: Megatron's `qk_layernorm`), and sets its head size apart from
hidden_size / heads (`head_dim`, Megatron's `kv_channels`).

Packing. Several sequences share one row of a micro-batch and must not see each other. Two things
make that exact, and keep the cost of attention that of the sequences, not of the row:
- `SegmentAttention`, the layers' core attention: it gathers each sequence of the rows into a
  padded batch and runs causal `scaled_dot_product_attention` on it (cost: sequences x longest
  sequence squared; a dense block-diagonal mask over a row of s tokens costs s squared, some 40 times
  more for a 4096-token row of 100-token sequences). Where the sequences lie reaches it through
  Megatron's `packed_seq_params` argument, as a `Segments` (a `PackedSeqParams` in the `sbhd` layout,
  which Megatron passes to the core attention untouched);
- per-sequence positions for RoPE. Megatron's plain `rope` embedding always rotates position 0..s-1
  of the row, and its per-sequence variant needs the THD layout with transformer-engine or flash
  attention (neither runs on the CPU). So the model is built with Megatron's `mrope` rotary embedding,
  which rotates explicit `position_ids`; with the three position components equal (text tokens) it is
  exactly standard RoPE at those positions (Qwen2-VL's property), which is what Qwen2 and Qwen3 compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from areal_hpc.arch import QwenArch
from areal_hpc.trainer.choices import RECOMPUTE


def transformer_config(
    arch: QwenArch,
    tp: int,
    pp: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    recompute: str = "none",
    sequence_parallel: bool = False,
):
    """Megatron's TransformerConfig of the model on `device`, with the CPU-safe kernels (no fusions)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
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
        # mrope with one section: standard RoPE at explicit positions (see the module docstring).
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


class HiddenGPTModel(GPTModel):
    """Megatron's GPTModel whose last stage returns its final hidden states ([s, b, h], after the final
    norm; [s / TP, b, h] with sequence parallelism) instead of logits. The loss turns them into token
    logprobs chunk by chunk (`token_logprobs`), so a micro-batch's logits never exist whole. The output
    weight stays where Megatron keeps it: checkpoints, tied embeddings and their gradient sync are
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

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
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
    return model.to(device)


# --- token logprobs from hidden states, chunk by chunk -------------------------------------------

LOGPROB_CHUNK_BYTES = 64 << 20
"""Size of one chunk's fp32 logits ([positions, V / TP] x 4 bytes): the positions per chunk follow from
the vocabulary. A chunk's forward or backward holds about two such tensors at once."""
WGRAD_BLOCK_BYTES = 64 << 20
"""Largest temporary of the output weight's gradient ([vocabulary rows, h] in the weight's dtype)."""


def _output_input(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The hidden states as the output layer sees them on every TP rank: the whole sequence, and in the
    backward pass the TP ranks' gradients summed (what Megatron's ColumnParallelLinear does)."""
    from megatron.core import tensor_parallel

    if sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(h W^T / T)[target] for [n, h] hidden states, a chunk of positions at a time, over the
    vocabulary-parallel W ([V / TP, h], this TP rank's rows of the vocabulary); and, as a second output
    without a gradient, the entropy of each position's next-token distribution p = softmax(z), z = h W^T / T:

        H = -sum_v p_v log p_v = log S - sum_v e_v s_v / S,   s = z - max z, e = exp(s), S = sum_v e_v

    (S and sum_v e_v s_v summed over the TP ranks, with the target's logit, in one all-reduce per chunk;
    with `with_entropy` false, as in the no-grad prox and reference passes, sum_v e_v s_v is skipped and
    exp is taken in place, and the entropy output is None).

    Written by hand: megatron-core 0.16.1 has no fused output layer + cross entropy, and the fused ones
    elsewhere need TransformerEngine or Liger's Triton kernels (neither runs on the CPU). What it keeps for
    the backward pass is h and one log-sum-exp per position; the backward recomputes each chunk's logits
    once. The output weight's gradient goes straight into Megatron's `main_grad` (in vocabulary blocks of
    at most WGRAD_BLOCK_BYTES), as Megatron's own gradient-accumulation fusion does, instead of a whole
    [V / TP, h] gradient per chunk; the engine's DDP does not overlap the gradient reduce, so no hook
    needs a gradient for the weight (without `main_grad`, the gradient is returned as usual).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature: float, chunk: int, with_entropy: bool):
        from megatron.core import parallel_state as ps

        group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        first = ps.get_tensor_model_parallel_rank() * weight.shape[0]  # this rank's first vocabulary id
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(out), (torch.empty_like(out) if with_entropy else None)
        for a in range(0, n, chunk):
            logits = (hidden[a : a + chunk].to(weight.dtype) @ weight.t()).float().div_(temperature)  # [c, V/TP]
            local, inside = _local_target(target[a : a + chunk], first, weight.shape[0])
            top = logits.max(1).values
            if tp > 1:
                torch.distributed.all_reduce(top, torch.distributed.ReduceOp.MAX, group=group)
            shifted = logits.sub_(top[:, None])  # s, in place
            picked = shifted.gather(1, local[:, None]).squeeze(1) * inside  # the target's s (0 off this rank)
            e = shifted.exp() if with_entropy else shifted.exp_()
            # [3, c]: S, sum e s (a batched dot: no [c, V/TP] product), the target's s
            e_dot_s = torch.einsum("cv,cv->c", e, shifted) if with_entropy else torch.zeros_like(picked)
            sums = torch.stack([e.sum(1), e_dot_s, picked])
            if tp > 1:
                torch.distributed.all_reduce(sums, group=group)
            total, e_dot_s, picked = sums
            log_total = total.log()
            lse[a : a + chunk] = top + log_total
            out[a : a + chunk] = picked - log_total
            if with_entropy:
                entropy[a : a + chunk] = log_total - e_dot_s / total
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.temperature, ctx.chunk, ctx.first = temperature, chunk, first
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        hidden, weight, target, lse = ctx.saved_tensors
        t, chunk, first = ctx.temperature, ctx.chunk, ctx.first
        grad_hidden = torch.empty_like(hidden)
        main_grad = getattr(weight, "main_grad", None)
        grad_weight = main_grad if main_grad is not None else torch.zeros_like(weight, dtype=torch.float32)
        block = max(1, WGRAD_BLOCK_BYTES // (weight.shape[1] * weight.element_size()))
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a : a + chunk].to(weight.dtype)
            probs = (h @ weight.t()).float().div_(t).sub_(lse[a : a + chunk, None]).exp_()  # softmax [c, V/TP]
            local, inside = _local_target(target[a : a + chunk], first, weight.shape[0])
            rows = inside.nonzero().squeeze(1)
            probs[rows, local[rows]] -= 1.0
            # d logp / d logits = onehot - softmax; times the upstream gradient, over T
            dlogits = probs.mul_((-grad[a : a + chunk] / t)[:, None]).to(weight.dtype)
            grad_hidden[a : a + chunk] = (dlogits @ weight).to(hidden.dtype)
            for v in range(0, weight.shape[0], block):
                grad_weight[v : v + block] += dlogits[:, v : v + block].t() @ h
        return grad_hidden, (None if main_grad is not None else grad_weight.to(weight.dtype)), None, None, None, None


def _local_target(target: torch.Tensor, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as rows of this rank's vocabulary slice (0 outside it), and whether each is inside."""
    local = target - first
    inside = (local >= 0) & (local < rows)
    return local.where(inside, 0), inside


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    target: torch.Tensor,
    temperature: float,
    sequence_parallel: bool,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n] log_softmax(h W^T / T)[target], [n] entropy of softmax(h W^T / T), no gradient) at the
    positions `where` ((row, column) pairs) of `hidden`; the entropy is None without `with_entropy`.

    The softmax is over the whole (vocabulary-parallel) vocabulary, exact; only a chunk's logits exist
    at a time, forward or backward (`_TokenLogprobs`).
    """
    h = _output_input(hidden, sequence_parallel)[where[1], where[0]]  # [s, b, h] -> [n, h]
    chunk = max(1, LOGPROB_CHUNK_BYTES // (4 * weight.shape[0]))
    return _TokenLogprobs.apply(h, weight, target, temperature, chunk, with_entropy)


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, V] logits of the whole vocabulary (gathered over TP): for checks on short sequences."""
    from megatron.core import tensor_parallel

    # the last stage's hidden states are fp32 under Float16Module: the product in the weight's dtype, as in training
    logits = (_output_input(hidden, sequence_parallel).to(weight.dtype) @ weight.t()).float()  # [s, b, V / TP]
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits).transpose(0, 1)


# --- attention within each packed sequence ------------------------------------------------------


@dataclass
class Segments(PackedSeqParams):
    """Where the sequences of a micro-batch's rows lie, for `SegmentAttention`.

    The rows' tokens are numbered row by row (`row * width + column`); every token belongs to exactly
    one segment: a sequence, or a row's padding tail. Segments of similar length share a bucket, padded
    to its longest: bucket k is a [n_k, L_k] table of token numbers (a segment's start past its end).
    """

    buckets: list[torch.Tensor] | None = None
    scatter: torch.Tensor | None = None  # [b * s] place of each token in the buckets' padded layouts, end to end

    def to(self, device) -> Segments:
        return Segments(
            qkv_format=self.qkv_format, buckets=[g.to(device) for g in self.buckets], scatter=self.scatter.to(device)
        )


BUCKET_RATIO = 0.7
"""A bucket holds segments longer than this fraction of its longest: padding at most doubles the
attention cost of a segment (cost ~ length squared)."""


def segments(seg_ids: torch.Tensor) -> Segments:
    """The Segments of rows labelled `seg_ids` ([b, s]: one id per segment, its tokens contiguous in one row)."""
    flat = seg_ids.reshape(-1)
    starts = torch.cat([torch.tensor([True]), flat[1:] != flat[:-1]]).nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([flat.numel()]))
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    buckets, place, offset, i = [], torch.empty(flat.numel(), dtype=torch.long), 0, 0
    while i < len(order):
        longest = int(lengths[order[i]])
        k = i
        while k < len(order) and lengths[order[k]] > BUCKET_RATIO * longest:
            k += 1
        members = torch.tensor(order[i:k])
        j = torch.arange(longest)
        buckets.append(starts[members, None] + torch.where(j < lengths[members, None], j, 0))
        for row, seg in enumerate(order[i:k]):
            a, n = int(starts[seg]), int(lengths[seg])
            place[a : a + n] = offset + row * longest + torch.arange(n)
        offset += (k - i) * longest
        i = k
    return Segments(qkv_format="sbhd", buckets=buckets, scatter=place)


class SegmentAttention(MegatronModule):
    """Megatron core attention (the local spec's DotProductAttention's place) in which each token attends
    causally within its own segment only, as `packed_seq_params` (a Segments) gives them.

    Query/key/value come as [s, b, heads, head_dim] (key/value with the query groups of GQA); the
    output is [s, b, heads * head_dim], as Megatron expects.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__(config=config)
        if config.attention_dropout:
            raise ValueError("SegmentAttention has no attention dropout (the config asks for some)")
        self.scale = softmax_scale

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if not isinstance(packed_seq_params, Segments) or attention_bias is not None:
            raise ValueError("SegmentAttention needs the rows' Segments as packed_seq_params, and no attention bias")
        s, b, heads, dim = query.shape
        q, k, v = (x.transpose(0, 1).reshape(b * s, x.shape[2], dim) for x in (query, key, value))
        outs = []
        for gather in packed_seq_params.buckets:  # [n, L] -> [n, h, L, d] per input
            # Positions past a segment's end come after all of its tokens: the causal mask hides them.
            out = F.scaled_dot_product_attention(
                *(x[gather].transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=self.scale, enable_gqa=True
            )
            outs.append(out.transpose(1, 2).reshape(-1, heads * dim))
        out = torch.cat(outs)[packed_seq_params.scatter]  # [b * s, h * d]
        return out.view(b, s, heads * dim).transpose(0, 1).contiguous()


# --- inputs of a packed row ----------------------------------------------------------------------


@dataclass
class PackedRows:
    """A micro-batch: sequences packed into rows, with what the model needs to keep them apart."""

    tokens: torch.Tensor  # [b, s] int64 (pad 0)
    position_ids: torch.Tensor  # [3, b, s] int64, position within its own sequence (mrope layout)
    segments: Segments  # which tokens attend to which (each to its own sequence's earlier ones)
    seq_slices: list  # per sequence: (row, start, length) in the rows

    def forward(self, model) -> torch.Tensor:
        """The model stage's output on these rows ([s, b, h] hidden states, on the last stage too)."""
        return model(self.tokens, self.position_ids, None, packed_seq_params=self.segments)

    def to(self, device) -> PackedRows:
        return PackedRows(
            self.tokens.to(device), self.position_ids.to(device), self.segments.to(device), self.seq_slices
        )


def pack_rows(seqs: list[torch.Tensor], padded: bool = False, multiple: int = 1) -> PackedRows:
    """Put `seqs` (1-D token tensors) in one row (packing), or one row each padded to the longest; the
    width padded up to a multiple of `multiple` (sequence parallelism splits it over the TP ranks).

    A row's padding tail is its own segment: it never attends to, or is attended by, a sequence.
    """
    groups = [[i] for i in range(len(seqs))] if padded else [list(range(len(seqs)))]
    width = -(-max(sum(len(seqs[i]) for i in g) for g in groups) // multiple) * multiple
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
    return PackedRows(tokens, pos.unsqueeze(0).expand(3, -1, -1).contiguous(), segments(seg), slices)
