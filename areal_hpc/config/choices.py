"""Settings that a config chooses by name, and what each name means: owned by the config, in a module
without torch or megatron-core, so that the config (which every rank loads before it may import torch) can
list and check them, and the trainer and the data read them from here.

`ppo.recompute` is Megatron's activation recompute (`RECOMPUTE` maps each name to its TransformerConfig
fields; trainer/model.py builds the config with them); `ppo.prox_logp` is how the step gets the proximal
logprobs of the decoupled loss (trainer/step.py); `ppo.lr_decay` is a style of Megatron's
OptimizerParamScheduler (trainer/engine.py).
"""

from __future__ import annotations

RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
"""`ppo.recompute` as Megatron's TransformerConfig fields: none keeps every layer's activations; selective
recomputes the core attention in the backward pass; full keeps each layer's input and recomputes the layer."""
RECOMPUTES = tuple(RECOMPUTE)
"""The values of `ppo.recompute`."""
PROX_LOGPS = ("recompute", "loglinear")
"""The values of `ppo.prox_logp`: recompute (a forward pass with the weights at the start of the step;
exact) or loglinear (interpolated between the behaviour and the current logprobs; no extra pass)."""
LR_DECAYS = ("constant", "linear", "cosine")
"""The values of `ppo.lr_decay`: Megatron's OptimizerParamScheduler styles of those names."""
SYNTHETIC_TASKS = ("arithmetic", "multiplication", "chain")
"""The values of `data.synthetic_task` (what each one is: areal_hpc.data.synthetic)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes as `max_lora_rank` (its `MaxLoRARanks`): a generator serves an adapter of
`lora.rank` at the first of them that holds it (`lora_serving_rank`)."""


def lora_serving_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for adapters of `rank` (at most the last of `VLLM_LORA_RANKS`)."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)
