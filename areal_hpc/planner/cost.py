"""The cost model's inputs: its constants (`CostModel`, each a documented field; docs/planner.md says where
each comes from), the model's size, the cluster's hardware, the distribution of trajectory lengths, and
a `Plan`, the allocation whose cost is predicted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING

import numpy as np

from areal_hpc.arch import DTYPE_BYTES, QwenArch, model_arch, teacher_arch
from areal_hpc.layout import Layout

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class CostModel:
    """Constants of the model that are not properties of the cluster (those are `cluster.*` fields).
    'calibrated' marks the three constants fitted to the AReaL paper's 1.5B run (docs/planner.md)."""

    prompt_tokens: int = 200
    """Prompt length (tokens). Math prompts are a few hundred tokens; it matters only for KV size."""
    trajectory_median_tokens: float = 1257.0
    """Median of the lognormal body of trajectory lengths (calibrated: gives a mean trajectory of 2,319
    tokens at a 27,648 cap, which the paper's 41.0 h x 128.7k tokens/s over 1000 steps x 8192
    trajectories implies)."""
    trajectory_sigma: float = 1.0
    """Log-space spread of the lognormal body (assumed: a long tail, mean/median = e^(sigma^2/2))."""
    truncated_fraction: float = 0.01
    """Share of trajectories that run into max_new_tokens (assumed: reasoning models loop until the cap
    on a few percent of hard prompts); with thousands of trajectories per step the longest one hits the
    cap."""
    decode_bandwidth_efficiency: float = 0.6
    """Achieved share of memory bandwidth while decoding (assumed: decode kernels reach 60-80% of peak)."""
    decode_step_overhead_s: float = 0.00122
    """Fixed time per decode step: scheduling, sampling, kernel launches (calibrated to the paper's
    synchronous 128.7k tokens/s)."""
    eager_layer_overhead_s: float = 150e-6
    """Added to a decode step per layer when the engines decode eagerly, without CUDA graphs (assumed: some
    30 kernel launches a layer at about 5 us each, which a graph replays at once); they do with
    ppo.routing_replay (areal_hpc.generator.routing), `gen_eager`."""
    gen_eager: bool = False
    """Whether the engines decode eagerly: `plan_cost` sets it from ppo.routing_replay."""
    decode_trajectory_overhead_s: float = 10e-6
    """Time per decode step and running trajectory outside the GPU kernels: scheduling, sampling,
    detokenising (assumed; the engines' CPU work grows with the batch)."""
    decode_mfu: float = 0.5
    """Share of peak FLOP/s in the compute-bound part of a decode step (assumed)."""
    prefill_mfu: float = 0.4
    """Share of peak FLOP/s when an interrupted generator recomputes the KV cache of its running
    trajectories after a weight update (assumed)."""
    train_mfu: float = 0.237
    """Model FLOP utilisation of the trainer (calibrated to the paper's asynchronous plateau, ~370k
    tokens/s with 4 trainer nodes; Megatron reaches 0.3-0.5 on large dense models, less on a 1.5B
    model with 2,500-token sequences)."""
    tp_allreduce_latency_s: float = 10e-6
    """Latency of one small all-reduce inside a node (decode steps do two per layer at TP > 1; assumed)."""
    nvlink_gbs: float = 200.0
    """Achieved all-reduce bandwidth inside a node, GB/s (assumed; H800 NVLink is 400 GB/s)."""
    gen_memory_fraction: float = 0.92
    """Share of GPU memory a vLLM engine is given (its gpu_memory_utilization): vLLM 0.32's default here;
    `plan_cost` sets each plan's own, what the project's additions after vLLM leave of it
    (areal_hpc.generator.memory, which the engines compute alike from their GPU's memory)."""
    gen_reserve_gb: float = 4.0
    """Engine memory outside weights and KV cache: activations, CUDA graphs (assumed)."""
    train_memory_fraction: float = 0.9
    """Share of GPU memory the trainer may fill (the rest is fragmentation and NCCL buffers)."""
    activation_factor: float = 1.31
    """Activation memory of one layer per token, with `ppo.recompute` none or selective: this factor x
    (8 h + 4 f) values of the dtype (what a pre-norm SwiGLU layer keeps for its backward pass: about 8 h
    in the attention block (norm input and output, q, k, v, the attention output, the projection's input,
    the residual) and 4 f in the MLP (gate, up, the activation and the product). Measured by
    tools/bench_trainer.py on its CPU model (h 512, f 1,408, 8 layers, fp32): 1.64 GiB for a 4,096-token
    micro-batch less its 84 MiB of logprob chunks (then 64 MiB ones). Selective recomputes the core
    attention, which keeps no attention matrix here (SDPA): it saves nothing, on the CPU and on an H100
    alike. With full recompute a layer keeps its input (h values) and one layer at a time holds the above
    during its backward pass."""
    logprob_transient_bytes: float = 2**30
    """The token logprobs' temporaries beside the embedding's gradient: two chunks of fp32 logits (or a
    chunk and its gradient) of areal_hpc.trainer.logprobs.LOGPROB_CHUNK_BYTES, 512 MiB each (less for a
    micro-batch whose logits are smaller); 84 MiB measured on the CPU with the former 64 MiB chunks."""
    weight_sync_fixed_s: float = 1.0
    """Fixed cost of a weight update on a generator: pause, load, clear prefix cache, resume (assumed)."""


COST = CostModel()


@dataclass(frozen=True)
class ModelSize:
    """The model as the cost model sees it: its architecture (`areal_hpc.arch.model_arch`, which counts the
    parameters and the KV bytes per token) in the config's dtype. A mixture of experts stores all its
    parameters (`params`: memory, weight sync) but runs a token through `active_params` (its FLOPs);
    expert parallelism splits `expert_params` where tensor parallelism splits the rest."""

    params: float
    """All parameters."""
    layers: int
    hidden: int
    vocab: int
    dtype_bytes: int
    mlp_values: int
    """Values one token keeps per layer in its MLP for the backward pass: 4 f (gate, up, the activation and
    the product) for a dense model; a MoE: k (4 f_e + 2 h), the same in each of its k experts plus the
    token's routed copy in and out of them (the dispatcher's permuted rows)."""
    kv_bytes_per_token: float
    """K and V of every layer, one token, in the dtype (`QwenArch.kv_bytes_per_token`)."""
    active_params: float
    """The parameters one token uses (= params for a dense model)."""
    expert_params: float = 0.0
    """The experts' parameters, all layers (0 for a dense model)."""
    experts: int = 0
    """Routed experts per layer (0: dense)."""
    experts_per_token: int = 0
    """The router's top-k."""
    lora_params: float = 0.0
    """With LoRA (lora.rank > 0) the adapters' parameters, the only ones trained and synced (the rest frozen);
    0: full training."""
    teacher: ModelSize | None = None
    """With distill.teacher, the teacher (dense, in its own dtype), which the trainer ranks hold and run
    forward once per step; None: none."""

    @classmethod
    def from_config(cls, cfg: Config) -> ModelSize:
        arch, dtype_bytes = model_arch(cfg.model), DTYPE_BYTES[cfg.model.dtype]
        lora = arch.lora_params(cfg.lora.rank, cfg.lora.target_modules) if cfg.lora.rank else 0.0
        teacher = teacher_arch(cfg.distill.teacher)
        teacher = teacher and cls.of(teacher, DTYPE_BYTES[cfg.distill.teacher.dtype or cfg.model.dtype])
        return cls.of(arch, dtype_bytes, lora, teacher)

    @classmethod
    def of(cls, m: QwenArch, dtype_bytes: int, lora_params: float = 0.0, teacher: ModelSize | None = None) -> ModelSize:
        k = m.num_experts_per_tok
        mlp_values = k * (4 * m.moe_intermediate_size + 2 * m.hidden_size) if m.moe else 4 * m.intermediate_size
        return cls(
            m.params, m.num_layers, m.hidden_size, m.vocab_size, dtype_bytes, mlp_values,
            m.kv_bytes_per_token(dtype_bytes), m.active_params, m.expert_params, m.num_experts, k, lora_params,
            teacher,
        )  # fmt: skip

    @property
    def dense_params(self) -> float:
        """Everything but the experts: what tensor parallelism splits."""
        return self.params - self.expert_params

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def sync_bytes(self) -> float:
        """What a weight sync sends: the whole model, or with LoRA the adapters."""
        return (self.lora_params or self.params) * self.dtype_bytes

    def decode_weight_bytes(self, batch):
        """Weight bytes a decode step of `batch` trajectories reads: the dense weights, and of each layer's
        experts those some token of the batch is routed to, E (1 - (1 - k/E)^batch) of E for independent
        uniform routing (all of them from a few dozen trajectories; k of E for one)."""
        if not self.experts:
            return self.weight_bytes
        touched = 1 - (1 - self.experts_per_token / self.experts) ** np.maximum(batch, 1)
        return (self.dense_params + self.expert_params * touched) * self.dtype_bytes


@dataclass(frozen=True)
class Hardware:
    """One GPU of the cluster as the cost model sees it (the `cluster.gpu_*` and `interconnect_gbps` fields);
    how many a node has is the Layout's to count."""

    memory: float  # bytes per GPU
    flops: float  # peak FLOP/s per GPU
    bandwidth: float  # memory bytes/s per GPU
    network: float  # inter-node bytes/s per GPU

    @classmethod
    def from_config(cls, cfg: Config) -> Hardware:
        c = cfg.cluster
        return cls(
            c.gpu_memory_gb * GB, c.gpu_tflops * 1e12, c.gpu_memory_bandwidth_gbs * GB, c.interconnect_gbps / 8 * GB,
        )  # fmt: skip


@dataclass(frozen=True)
class Lengths:
    """Trajectory lengths: a lognormal body, cut at `cap`, plus a share `p_cap` that runs to the cap.
    S(k) = P(L > k) = p_cap + (1 - p_cap) * P(X > k) for k < cap, X ~ lognormal(ln median, sigma)."""

    cap: int
    median: float
    sigma: float
    p_cap: float
    prompt: int

    @cached_property
    def survival(self) -> np.ndarray:
        """S(k) for k = 0 .. cap - 1: the share of trajectories still decoding at step k."""
        k = np.arange(self.cap, dtype=float)
        z = (np.log(np.maximum(k, 1e-9)) - math.log(self.median)) / (self.sigma * math.sqrt(2))
        tail = 0.5 * (1 - _erf(z))
        tail[0] = 1.0
        return self.p_cap + (1 - self.p_cap) * tail

    @cached_property
    def mean(self) -> float:
        """E[L] = sum_k S(k)."""
        return float(self.survival.sum())

    @cached_property
    def second_moment(self) -> float:
        """E[L^2] = sum_k (2k + 1) S(k)."""
        k = np.arange(self.cap, dtype=float)
        return float(((2 * k + 1) * self.survival).sum())

    @property
    def resident_context(self) -> float:
        """Mean context of a running trajectory under continuous batching: a decode step sees a trajectory
        of length L at every context prompt .. prompt + L, so averaged over steps: prompt + E[L^2] / 2E[L]."""
        return self.prompt + self.second_moment / (2 * self.mean)

    def longest(self, n: int) -> int:
        """Length of the longest of n trajectories: the cap when n * p_cap >= 1, else the 1 - 1/n
        quantile."""
        if n * self.p_cap >= 1:
            return self.cap
        return int(np.searchsorted(-self.survival, -1.0 / n)) or 1

    @classmethod
    def from_config(cls, cfg: Config, cost: CostModel = COST) -> Lengths:
        return _lengths(
            cfg.rollout.max_new_tokens, cost.trajectory_median_tokens, cost.trajectory_sigma,
            cost.truncated_fraction, cost.prompt_tokens,
        )  # fmt: skip


@cache
def _lengths(*args) -> Lengths:
    return Lengths(*args)  # one instance per distribution: its survival curve is computed once


def _erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf and scipy is not a dependency."""
    s, x = np.sign(x), np.abs(x)
    t = 1 / (1 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1 - poly * np.exp(-x * x))


@dataclass(frozen=True)
class Plan:
    """An allocation whose cost the planner predicts: what `plan --search` chooses."""

    gen_gpus: int
    gen_tp: int
    train_tp: int
    train_pp: int
    train_ep: int = 1
    """Expert parallelism of the trainer (1 for a dense model)."""

    @classmethod
    def of(cls, cfg: Config) -> Plan:
        """The allocation of a config whose split is resolved (`resolve_split`; its `layout` refuses one that
        is not)."""
        a = cfg.allocation
        return cls(a.gen_gpus, a.gen_tp, a.train_tp, a.train_pp, a.train_ep)

    def layout(self, cfg: Config) -> Layout:
        """The rank map of this plan on the config's cluster: its generators (engines) and trainers."""
        return Layout.from_config(with_plan(cfg, self))


def with_plan(cfg: Config, plan: Plan) -> Config:
    """A copy of cfg whose allocation is `plan`."""
    a = dataclasses.replace(cfg.allocation, **dataclasses.asdict(plan))
    return dataclasses.replace(cfg, allocation=a)
