"""Token logprobs from the last stage's hidden states, a chunk of positions at a time: the policy's
log_softmax(h W^T / T)[next token] and its entropy, without a micro-batch's logits ever existing whole.

    hidden [s, b, h] --(gather over TP)--> h [n, h] at the positions that predict a token
    for each chunk of c positions:   logits [c, V / TP] = h W^T / T  (fp32, at most LOGPROB_CHUNK_BYTES)
        max, sum exp, target's logit: all-reduced over the TP ranks (the vocabulary is split over them)

The loop never waits for the device: every index it takes is a Python number or a tensor op (no
`nonzero`, `.item()` or `.tolist()`), so on a GPU the host queues every chunk's kernels and all-reduces
ahead of them.

Why written by hand: a micro-batch's logits are [tokens, vocabulary] (a row of 4096 tokens over Qwen's
151936-token vocabulary: 2.3 GiB in fp32); megatron-core 0.16.1 has no fused output layer + cross entropy,
and the fused ones elsewhere need TransformerEngine or Liger's Triton kernels (neither runs on the CPU).
The output weight stays Megatron's (`model.HiddenGPTModel.output_weight`): checkpoints, tied embeddings
and their gradient sync are unchanged.
"""

from __future__ import annotations

import torch

LOGPROB_CHUNK_BYTES = 512 << 20
"""Memory budget of one chunk's fp32 logits ([positions, V / TP] x 4 bytes): the positions per chunk are
this over 4 V / TP. A chunk's forward or backward holds about two such tensors at once, on top of the
micro-batch's activations (the planner's `CostModel.logprob_transient_bytes` is those two).

Why 512 MiB: each chunk costs two all-reduces over the TP ranks and a dozen kernels whatever its size,
so chunks should be few; but they sit on top of the activation peak. At Qwen's vocabulary (151,936) a
32,768-token micro-batch is 38 chunks at TP 1, 19 at TP 2, 10 at TP 4 (64 MiB chunks: 150 at TP 2, 300
all-reduces); 1 GiB would halve that and put the shipped qwen7b split (TP 4 x PP 2, 32,768-token
micro-batches) over 80 GB by the planner's memory model."""
WGRAD_BLOCK_BYTES = 64 << 20
"""Largest temporary of the output weight's gradient ([vocabulary rows, h] in the weight's dtype)."""


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    target: torch.Tensor,
    temperature: float,
    sequence_parallel: bool,
    with_entropy: bool = True,
    chunk_bytes: int = LOGPROB_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n] log_softmax(h W^T / T)[target], [n] entropy of softmax(h W^T / T), no gradient) at the
    positions `where` ((row, column) pairs) of `hidden`; the entropy is None without `with_entropy`.

    The softmax is over the whole (vocabulary-parallel) vocabulary, exact; only a chunk's logits exist
    at a time (at most `chunk_bytes` of them), forward or backward (`_TokenLogprobs`).
    """
    h = output_input(hidden, sequence_parallel)[where[1], where[0]]  # [s, b, h] -> [n, h]
    chunk = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _TokenLogprobs.apply(h, weight, target, temperature, chunk, with_entropy)


def output_input(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The hidden states as the output layer sees them on every TP rank: the whole sequence, and in the
    backward pass the TP ranks' gradients summed (what Megatron's ColumnParallelLinear does). The checks'
    dense reference (`tests.support.trainer_runs.full_logits`) starts from it too."""
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

    What it keeps for the backward pass is h and one log-sum-exp per position; the backward recomputes
    each chunk's logits once. The output weight's gradient goes straight into Megatron's `main_grad` (in
    vocabulary blocks of at most WGRAD_BLOCK_BYTES), as Megatron's own gradient-accumulation fusion does,
    instead of a whole [V / TP, h] gradient per chunk (without `main_grad`, the gradient is returned as
    usual). Then, as that fusion does (megatron-core 0.16, `LinearWithGradAccumulationAndAsyncCommunication`),
    the weight is marked `grad_added_to_main_grad` and gets an unused placeholder gradient: Megatron's DDP
    counts a parameter ready for the overlapped data-parallel reduce when a gradient reaches it (its
    backward post-hook), and adds what reaches it unless the mark is set. A weight Megatron marks
    `zero_out_wgrad` (the input embedding's, on this stage) gets None instead: the embedding's own
    gradient reaches the hook, which adds that one.
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
            del logits, shifted, e  # before the next chunk's: at most two chunks' logits at a time
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
            # minus one at each target on this rank's slice (a scatter that adds -0 elsewhere: indexing
            # the rows inside would wait for the device every chunk)
            probs.scatter_add_(1, local[:, None], inside.to(probs.dtype).neg_()[:, None])
            # d logp / d logits = onehot - softmax; times the upstream gradient, over T
            dlogits = probs.mul_((-grad[a : a + chunk] / t)[:, None]).to(weight.dtype)
            grad_hidden[a : a + chunk] = (dlogits @ weight).to(hidden.dtype)
            for v in range(0, weight.shape[0], block):
                grad_weight[v : v + block] += dlogits[:, v : v + block].t() @ h
            del probs, dlogits  # before the next chunk's logits
        if main_grad is None:
            return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None
        weight.grad_added_to_main_grad = True
        placeholder = None if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)
        return grad_hidden, placeholder, None, None, None, None


def _local_target(target: torch.Tensor, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as rows of this rank's vocabulary slice (0 outside it), and whether each is inside."""
    local = target - first
    inside = (local >= 0) & (local < rows)
    return local.where(inside, 0), inside
