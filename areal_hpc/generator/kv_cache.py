"""The KV cache a generator's vLLM engine asks for on the CPU: room for every trajectory it runs at once
at full length (`rollout.engine_seqs` x the model's context), within `CPU_KV_CACHE_BYTES`. vLLM's CPU
default reserves 92% of the node's memory, which fails on a machine shared with the other roles. (On a
GPU vLLM sizes its cache from its memory share.) The planner's host-memory check counts the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_hpc.arch import QwenArch

CPU_KV_CACHE_BYTES = (64 << 20, 4 << 30)
"""The least and the most KV cache a CPU engine asks for, in bytes."""


def cpu_kv_cache_bytes(arch: QwenArch, tp: int, max_num_seqs: int, max_model_len: int) -> int:
    """KV cache bytes of one of the engine's `tp` workers: K and V in fp32 at most (the engine's dtype or
    less) for `max_num_seqs` sequences of `max_model_len` tokens, within CPU_KV_CACHE_BYTES."""
    low, high = CPU_KV_CACHE_BYTES
    return int(min(max(arch.kv_bytes_per_token(4, tp) * max_num_seqs * max_model_len, low), high))
