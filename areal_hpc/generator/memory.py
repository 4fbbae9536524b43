"""The generator's GPU memory: what the project allocates in a vLLM worker after vLLM has sized its KV cache,
and the share of the GPU vLLM is given for the rest (its `gpu_memory_utilization`). One budget, which an
engine starts with (`GenerationEngine.from_config` on a GPU, logged at start) and the planner predicts
with (areal_hpc.planner.predict).

```
 GPU memory M
 |<------------- vLLM: utilization x M ------------->|<--- the project's additions --->|<- headroom ->|
 | weights / tp | activations, CUDA graphs | KV cache | routing | communicators | receive | context,   |
 |              |                          |          |  table  |  (NCCL)       | buffers | fragments  |
```

vLLM fills its share with the weights, the activations of a profiled step and CUDA graphs, and gives the
rest to the KV cache; whatever is allocated in the worker afterwards comes out of what is left:

- the routing table (`ppo.routing_replay`, areal_hpc.generator.routing): L x K ids per KV slot, so a
  share of the KV cache: L K id bytes per kv bytes of a token on one worker (Qwen3-30B-A3B at gen_tp 4:
  384 B per 24 KiB, 1.6%);
- the weight-sync communicators: one per group the worker joins (train_pp x train_ep: one per pipeline
  stage, and per expert rank), `NCCL_COMMUNICATOR_BYTES` each;
- the receive buffers: up to `RECEIVE_BUFFERS` payloads in flight (areal_hpc.weight_sync.broadcast: one
  being loaded, one waiting, one being received), each a bucket (`train.weight_sync_bucket_mb`) or the
  one tensor larger than that (every worker receives whole tensors: the embedding, 1.56 GB for Qwen2.5-32B).

vLLM 0.32 takes `VLLM_SHARE` of the GPU by default and leaves the rest to the CUDA context and
fragmentation; the project keeps that headroom and gives vLLM `VLLM_SHARE` less its additions. The
routing table grows with the KV cache, which is at most vLLM's share: it is counted at that bound.

On the CPU the KV cache is sized in bytes (areal_hpc.generator.kv_cache) and nothing here is used but
the planner's figures, which are for GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_hpc.arch import DTYPE_BYTES, model_arch
from areal_hpc.protocol import routing_bytes_per_token

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config

VLLM_SHARE = 0.92
"""vLLM 0.32's default gpu_memory_utilization (`CacheConfig.gpu_memory_utilization`)."""
NCCL_COMMUNICATOR_BYTES = 256 * 2**20
"""GPU memory of one NCCL communicator of a weight-sync group (assumed: NCCL's buffers of its default
4 MiB per channel and protocol for a broadcast ring's peers, over its channels; tools/gpu_check.sh's
run reports the engine's memory)."""
RECEIVE_BUFFERS = 3
"""Payloads a generator worker holds at once during a weight sync (areal_hpc.weight_sync.broadcast)."""
LEAST_SHARE = 0.5
"""Below this share of its GPU for vLLM the additions are refused: the weights and KV cache would be
left too little."""


@dataclass(frozen=True)
class GeneratorMemory:
    """One generator GPU's budget (the module docstring): vLLM's share and the project's additions."""

    gpu_bytes: float
    routing_per_kv_byte: float
    """Routing-table bytes per KV-cache byte (0 without routing replay)."""
    communicators: float
    """Bytes of the weight-sync groups' NCCL communicators."""
    receive_buffers: float
    """Bytes of the weight-sync payloads in flight."""

    @classmethod
    def of(cls, cfg: Config, gpu_bytes: float) -> GeneratorMemory:
        """The budget of a generator GPU of `gpu_bytes` under `cfg` (its model, allocation and weight sync)."""
        arch, a = model_arch(cfg.model), cfg.allocation
        dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
        routing = 0.0
        if cfg.ppo.routing_replay:  # a MoE's (areal_hpc.config refuses it for a dense model)
            routing = routing_bytes_per_token(arch) / arch.kv_bytes_per_token(dtype_bytes, a.gen_tp)
        largest = max(arch.vocab_size * arch.hidden_size, arch.intermediate_size * arch.hidden_size) * dtype_bytes
        payload = max(cfg.train.weight_sync_bucket_mb * 2**20, largest)
        groups = a.train_pp * a.train_ep
        return cls(gpu_bytes, routing, groups * NCCL_COMMUNICATOR_BYTES, RECEIVE_BUFFERS * payload)

    @property
    def utilization(self) -> float:
        """vLLM's share: (VLLM_SHARE M - communicators - buffers) / ((1 + routing per KV byte) M), so that
        vLLM's share, a routing table for a KV cache as large as that share, and the rest fit in
        VLLM_SHARE of the GPU."""
        fixed = self.communicators + self.receive_buffers
        return (VLLM_SHARE * self.gpu_bytes - fixed) / ((1 + self.routing_per_kv_byte) * self.gpu_bytes)

    @property
    def routing_table(self) -> float:
        """At most: a table for a KV cache of vLLM's whole share."""
        return self.routing_per_kv_byte * self.utilization * self.gpu_bytes

    def parts(self) -> dict[str, float]:
        """The additions by name, in bytes."""
        return {
            "routing table": self.routing_table,
            "weight-sync communicators": self.communicators,
            "receive buffers": self.receive_buffers,
        }

    def problem(self) -> str:
        """Why vLLM would be left too little ('' when it is not)."""
        if self.utilization >= LEAST_SHARE:
            return ""
        return (
            f"vLLM would get {self.utilization:.2f} of the generator GPU's {self.gpu_bytes / 1e9:,.1f} GB after "
            f"the project's additions ({self.describe()}): lower train.weight_sync_bucket_mb, or use fewer "
            "weight-sync groups (allocation.train_pp, train_ep)"
        )

    def describe(self) -> str:
        """'routing table 0.9 GB, weight-sync communicators 1.1 GB, receive buffers 1.9 GB' (those not 0)."""
        return ", ".join(f"{name} {b / 1e9:,.1f} GB" for name, b in self.parts().items() if b)
