"""The generator's routing record: for every token position it computed, the experts each MoE layer chose.

With `ppo.routing_replay` the trainer's routers replay the experts the generator used (areal_hpc.trainer.moe),
so the generator records them. `RoutingRecorder` lives in vLLM's worker (installed by the worker extension,
`engine.WeightLoader.areal_record_routing`) and keeps one entry per KV-cache slot:

```
 slots [num_blocks * block_size + 1, L, K]   row 1 + slot: the top-k expert ids of every MoE layer for the
                                             token whose KV sits in that slot; row 0 takes the padded rows
 forward pass, MoE layer l: vLLM's router calls our capture fn with its top-k ids [T, K] (logical ids,
   before any expert-load-balancing map): slots[1 + slot_mapping[:T], l] = ids   (tensor ops only)
 a turn finished (read right after the engine step, before vLLM's worker forgets the request or the
   scheduler hands its blocks to another): the rows of its positions 0 .. n-1, through its block table
```

Which routing a position carries: that of the last forward pass that computed its KV in the
turn's final attempt. A prefix-cache hit therefore finds the routing of the pass that computed the shared
prefix (the same weights, the same tokens: the same experts). After a weight update the prefix cache is
reset and an interrupted turn is resubmitted as context + partial output, so its final attempt computes
every position again under the new weights: all its positions carry the new version's routing. The last
position of a turn (the last sampled token, whose KV is never computed) is `protocol.routing_unknown`, as
is context appended after an episode's last turn (areal_hpc.workflow.conversation): the trainer routes those
itself.

The capture goes through vLLM's router hook (`BaseRouter.set_capture_fn`), the same one vLLM's own
routed-experts capturer uses; that capturer is not used because it needs vLLM's V2 model runner (Triton:
GPU only), while this one runs wherever the V1 runner does. The hook is read when vLLM compiles or captures
the model (on the CPU Dynamo traces the MoE layer into the compiled graph; on a GPU CUDA graphs record it),
and the worker extension can only install it after the engine is built, so an engine that records routing
runs eagerly (`engine_args(..., record_routing=True)` sets `enforce_eager`), on both devices.

Memory: the slot table holds L x K bytes per KV slot on the worker's device, allocated after vLLM sized its
KV cache, so outside `gpu_memory_utilization` (Qwen3-30B-A3B, 500k KV slots: 192 MB).

Size: L x K bytes per token with uint8 ids (`protocol.routing_dtype`): 4 B for the tiny MoE (2 layers,
top-2), 384 B for Qwen3-30B-A3B (48 x 8), 752 B for Qwen3-235B-A22B (94 x 8), against 13 B per token of
the other per-token arrays of a `Trajectory` (token, mask, logprob, version).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from areal_hpc.protocol import routing_dtype, routing_unknown


class RoutingRecorder:
    """The routing of every KV slot of one vLLM worker's cache (the module docstring); `take` reads a
    request's."""

    def __init__(self, model_runner):
        import torch
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.model_runner = model_runner
        model_config = model_runner.model_config
        self.layers = model_config.get_total_num_hidden_layers()
        self.top_k = model_config.get_num_experts_per_tok()
        self.dtype = routing_dtype(model_config.get_num_experts())
        groups = model_runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"routing capture expects one KV-cache group (all layers full attention), got {len(groups)}"
            )
        self.block_size = groups[0].kv_cache_spec.block_size
        slots = model_runner.kv_cache_config.num_blocks * self.block_size
        unknown = routing_unknown(self.dtype)
        torch_dtype = getattr(torch, self.dtype.name)
        self.slots = torch.full(
            (slots + 1, self.layers, self.top_k), unknown, dtype=torch_dtype, device=model_runner.device
        )
        runners = [m for m in model_runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError(
                f"ppo.routing_replay: {model_config.model} has no MoE layer (routing replay is for MoE models)"
            )
        for runner in runners:
            if runner._quant_method.is_monolithic or not isinstance(runner.router, BaseRouter):
                raise ValueError(
                    f"ppo.routing_replay: the MoE kernel of {model_config.model} "
                    f"({type(runner._quant_method).__name__}) routes inside the kernel, past vLLM's router hook, "
                    "so the routing cannot be recorded: set ppo.routing_replay=false, or use a MoE backend that "
                    "routes with vLLM's router (the unquantized default)"
                )
            runner.router.set_capture_fn(partial(self._capture, runner.layer_id))

    def _capture(self, layer: int, topk_ids) -> None:
        """vLLM's router hook: `topk_ids` [T, K], one row per token of the step (padded rows included)."""
        from vllm.forward_context import get_forward_context

        slot_mapping = get_forward_context().slot_mapping
        if not slot_mapping:  # a warm-up or profiling pass before the KV cache exists: no token to record
            return
        slots = next(iter(slot_mapping.values()))[: topk_ids.shape[0]]  # padded rows hold -1: row 0
        self.slots[slots + 1, layer] = topk_ids.to(self.slots.dtype)

    def take(self, requests: list[tuple[str, int]]) -> list[np.ndarray]:
        """[n, L, K] per (vLLM request id, n): the routing of positions 0 .. n-1 of each request, which must
        be finished in the engine step just run (or running); the last position, never computed, unknown."""
        import torch

        out = []
        for request_id, n in requests:
            blocks = torch.as_tensor(self.model_runner.requests[request_id].block_ids[0], dtype=torch.long)
            positions = torch.arange(n - 1)  # the last one has no KV (its block may not even exist)
            slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
            routing = np.full((n, self.layers, self.top_k), routing_unknown(self.dtype), self.dtype)
            routing[: n - 1] = self.slots[(slots + 1).to(self.slots.device)].cpu().numpy()
            out.append(routing)
        return out
