"""The chunked token logprobs (`trainer.logprobs.token_logprobs`) at any chunk size: the logprobs, entropies
and gradients of the whole vocabulary's log_softmax at once, over one and two TP ranks, with and without
sequence parallelism, with the output weight's gradient in Megatron's `main_grad` or returned."""

from __future__ import annotations

import pytest
import torch

from areal_hpc.trainer.spawn import run_ranks

pytestmark = pytest.mark.megatron

SEQ, ROWS, HIDDEN, VOCAB = 12, 2, 16, 40
CHUNKS = ("1 position", "5 positions", "budget", "64 MiB")
"""Chunk sizes: 1 and 5 positions (many chunks, the last one short), the budget `LOGPROB_CHUNK_BYTES` and
the former fixed 64 MiB (one chunk each at this vocabulary)."""
WEIGHT_GRADS = ("returned", "main_grad", "main_grad, zero_out_wgrad")
"""How the output weight's gradient leaves: returned (no Megatron DDP), into `main_grad` with a
placeholder returned, into `main_grad` with None returned (an embedding tied on the same stage)."""


def _inputs():
    """Hidden states [s, b, h], the whole output weight [V, h], positions (row, column) predicting
    targets, the targets, an upstream gradient: the same on every rank."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQ, ROWS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    cols = torch.tensor([c for c in range(SEQ) if c % 4 != 3])  # a few positions predict nothing
    where = (torch.arange(ROWS).repeat_interleave(len(cols)), cols.repeat(ROWS))
    targets = torch.randint(0, VOCAB, (len(where[0]),), generator=g)
    upstream = torch.randn(len(targets), generator=g)
    return hidden, weight, where, targets, upstream


def _chunks_rank(par, sequence_parallel: bool, temperature: float):
    """On each TP rank: the dense reference (the whole vocabulary's log_softmax, autograd), then for each
    chunk size and weight-gradient route the chunked function's logprobs, entropies and gradients (this
    rank's part of the hidden states' and of the weight's)."""
    from areal_hpc.trainer.logprobs import LOGPROB_CHUNK_BYTES, token_logprobs

    tp, rank = par.grid.tp, par.coords.tp
    hidden, weight, where, targets, upstream = _inputs()
    rows = VOCAB // tp
    my_rows = slice(rank * rows, (rank + 1) * rows)
    my_seq = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp) if sequence_parallel else slice(None)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_all = torch.log_softmax(h[where[1], where[0]] @ w.t() / temperature, dim=-1)  # [n, V]
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    (logp * upstream).sum().backward()
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    out = {"dense": (logp.detach(), entropy.detach(), h.grad[my_seq], w.grad[my_rows])}

    position = 4 * rows  # bytes of one position's fp32 logits on this rank
    sizes = {"1 position": position, "5 positions": 5 * position, "budget": LOGPROB_CHUNK_BYTES, "64 MiB": 64 << 20}
    for chunk_name in CHUNKS:
        for route in WEIGHT_GRADS:
            x = hidden[my_seq].clone().requires_grad_()
            w = weight[my_rows].clone().requires_grad_()
            if route != "returned":  # what Megatron's DDP gives its parameters
                w.main_grad = torch.zeros_like(w)
                w.grad_added_to_main_grad = False
                w.zero_out_wgrad = route.endswith("zero_out_wgrad")
            logp, entropy = token_logprobs(
                x, w, where, targets, temperature, sequence_parallel, True, sizes[chunk_name]
            )
            (logp * upstream).sum().backward()
            main = route != "returned"
            out[chunk_name, route] = (
                logp.detach(),
                entropy,
                x.grad,
                w.main_grad if main else w.grad,
                {"marked": getattr(w, "grad_added_to_main_grad", None), "returned": w.grad is not None} if main else {},
            )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_every_chunk_size_gives_the_whole_vocabularys_logprobs_and_gradients(tp, sequence_parallel):
    got = run_ranks(_chunks_rank, tp, tp, 1, sequence_parallel, 0.7)
    for rank, out in got.items():
        want = out["dense"]
        for chunk_name in CHUNKS:
            for route in WEIGHT_GRADS:
                *values, marks = out[chunk_name, route]
                what = f"rank {rank}, {chunk_name}, weight gradient {route}"
                for name, a, b in zip(("logp", "entropy", "grad hidden", "grad weight"), values, want):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")
                if route == "main_grad":  # a placeholder reaches DDP's hook, which must not add it
                    assert marks == {"marked": True, "returned": True}, what
                elif route.endswith("zero_out_wgrad"):  # the tied embedding's gradient reaches the hook
                    assert marks == {"marked": True, "returned": False}, what


def test_the_planners_logprob_transients_are_two_chunks():
    from areal_hpc.planner.cost import COST
    from areal_hpc.trainer.logprobs import LOGPROB_CHUNK_BYTES

    assert COST.logprob_transient_bytes == 2 * LOGPROB_CHUNK_BYTES
