"""The planner: a small cost model of one RL step, and the split of nodes it chooses with it.

```
 synchronous (max_staleness 0)        gen |==longest trajectory==|              train |==|  sync |.|
                                      T0 = T_gen_sync + T_train + T_ws
 asynchronous (max_staleness eta)     gen |=====|=====|=====|=====|   (never waits for the longest)
                                      train   |==|  |==|  |==|  |==|
                                      T(eta) = min(T0, max(T_cap, T0 / (eta + 1)))
```

- Synchronous (eta = 0): the batch of N = prompts_per_step x group_size trajectories is decoded on
  the generator nodes until the longest trajectory ends, then trained on the trainer nodes, then the
  weights go to the generators. Decoding is memory-bandwidth bound: every decode step reads the weights
  and the KV cache of the trajectories still running, so the long tail of trajectory lengths keeps the
  generators busy at a small batch, which is the inefficiency asynchronous RL removes.
- Asynchronous: the staleness gate admits at most (eta + 1) batches beyond those trained. By Little's
  law, throughput = (work in flight) / (time in flight): (eta + 1) batches in flight for the time a
  batch takes from admission to the version bump (T0) gives a step every T0 / (eta + 1), until the
  slower of the two sides saturates: T_cap = max(generation at full load, training) per step.
  eta = 0 is exactly synchronous; large eta approaches the pipelined limit T_cap.

Every constant is a documented field of `CostModel`; docs/planner.md says where each comes from and
compares the predictions with the AReaL paper's figures. Pure functions: no MPI, no GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING

import numpy as np

from areal_hpc.arch import model_arch
from areal_hpc.errors import ConfigError

if TYPE_CHECKING:
    from areal_hpc.config import Config

GB = 1e9
GiB = 2**30
ALLOCATION_FIELDS = ("gen_nodes", "gen_tp", "train_tp", "train_pp")
"""The allocation fields the planner chooses with `--search` (unless fixed on the command line)."""


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
    gen_memory_fraction: float = 0.9
    """Share of GPU memory a vLLM engine uses (its gpu_memory_utilization)."""
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
    micro-batch less its 84 MiB of logprob chunks. Selective recomputes the core attention, which keeps no
    attention matrix here (SDPA): it saves nothing, on the CPU and on an H100 alike. With full recompute a
    layer keeps its input (h values) and one layer at a time holds the above during its backward pass."""
    logprob_transient_bytes: float = 128 * 2**20
    """The token logprobs' temporaries beside the embedding's gradient: chunks of fp32 logits and their
    gradient (areal_hpc.trainer.logprobs.LOGPROB_CHUNK_BYTES, 64 MiB each); 84 MiB measured on the CPU."""
    weight_sync_fixed_s: float = 1.0
    """Fixed cost of a weight update on a generator: pause, load, clear prefix cache, resume (assumed)."""


COST = CostModel()


# --- the model and the cluster -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    dtype_bytes: int
    intermediate: int
    head_dim: int

    @classmethod
    def from_config(cls, cfg: Config) -> ModelSize:
        """Parameters of a Qwen2/Qwen3 decoder of the config's architecture (`model_arch`; d: the head size):
        per layer  q, o: h * heads * d each; k, v: h * kv_heads * d each; MLP: 3 h f;
        plus the embedding v h, and the output projection v h unless tied."""
        m = model_arch(cfg.model)
        h, f, d = m.hidden_size, m.intermediate_size, m.head_dim
        per_layer = 2 * h * m.num_attention_heads * d + 2 * h * m.num_key_value_heads * d + 3 * h * f
        embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
        dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
        params = m.num_layers * per_layer + embed
        return cls(
            params, m.num_layers, h, m.num_attention_heads, m.num_key_value_heads, m.vocab_size, dtype_bytes, f, d
        )

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int
    memory: float  # bytes per GPU
    flops: float  # peak FLOP/s per GPU
    bandwidth: float  # memory bytes/s per GPU
    network: float  # inter-node bytes/s per GPU

    @classmethod
    def from_config(cls, cfg: Config) -> Hardware:
        c = cfg.cluster
        return cls(
            c.gpus_per_node, c.gpu_memory_gb * GB, c.gpu_tflops * 1e12, c.gpu_memory_bandwidth_gbs * GB,
            c.interconnect_gbps / 8 * GB,
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


# --- the plan and its costs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    gen_nodes: int
    gen_tp: int
    train_tp: int
    train_pp: int

    def engines(self, gpus_per_node: int) -> int:
        """vLLM engines on the generator nodes, gen_tp GPUs each."""
        return self.gen_nodes * gpus_per_node // self.gen_tp

    def train_gpus(self, nodes: int, gpus_per_node: int) -> int:
        """GPUs (trainer ranks) on the other nodes; train_tp x train_pp of them make a replica."""
        return (nodes - self.gen_nodes) * gpus_per_node


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    eta: int
    trajectories: int  # N = prompts_per_step * group_size
    tokens: float  # effective (generated) tokens per step: N * E[L]
    longest: int  # the longest of the N trajectories, in tokens
    t_gen_sync: float  # decode of one batch until its longest trajectory ends
    t_train: float
    t_weight_sync: float
    t_gen_full: float  # per step, generators at full load, interruption included
    gen_memory: float  # bytes per generator GPU (weights + KV room for the longest trajectory + reserve)
    train_memory: float  # bytes per trainer GPU
    memory: float  # bytes per GPU

    @property
    def t_sync(self) -> float:
        """T0 = T_gen_sync + T_train + T_ws."""
        return self.t_gen_sync + self.t_train + self.t_weight_sync

    @property
    def t_cap(self) -> float:
        """The pipelined limit: the slower side's time per step."""
        return max(self.t_gen_full, self.t_train + self.t_weight_sync)

    def t_async(self, eta: int | None = None) -> float:
        """T(eta) = T0 at eta = 0, else min(T0, max(T_cap, T0 / (eta + 1))) (Little's law, capped)."""
        eta = self.eta if eta is None else eta
        if eta == 0:
            return self.t_sync
        return min(self.t_sync, max(self.t_cap, self.t_sync / (eta + 1)))

    def tokens_per_s(self, eta: int | None = None) -> float:
        return self.tokens / self.t_async(eta)

    @property
    def fits(self) -> bool:
        return max(self.gen_memory, self.train_memory) <= self.memory

    @property
    def bottleneck(self) -> str:
        return "generation" if self.t_gen_full >= self.t_train + self.t_weight_sync else "training"


def decode_step_s(m: ModelSize, hw: Hardware, tp: int, batch, kv_bytes, cost: CostModel = COST):
    """One decode step of an engine at tensor-parallel size tp, with `batch` trajectories whose KV cache
    totals `kv_bytes`: t = t_step + t_traj * batch + TP latency + max(memory time, compute time), where
    memory time = (W + KV) / (tp * bandwidth * efficiency) and compute time = 2 P batch / (tp * flops * mfu)."""
    memory_s = (m.weight_bytes + kv_bytes) / (tp * hw.bandwidth * cost.decode_bandwidth_efficiency)
    compute_s = 2 * m.params * batch / (tp * hw.flops * cost.decode_mfu)
    tp_s = 2 * m.layers * cost.tp_allreduce_latency_s if tp > 1 else 0.0
    overhead = cost.decode_step_overhead_s + cost.decode_trajectory_overhead_s * batch
    return overhead + tp_s + np.maximum(memory_s, compute_s)


def kv_capacity(m: ModelSize, hw: Hardware, tp: int, cost: CostModel = COST) -> float:
    """KV-cache bytes of one engine (tp GPUs): tp * (fraction * memory - reserve) - W."""
    return tp * (cost.gen_memory_fraction * hw.memory - cost.gen_reserve_gb * GB) - m.weight_bytes


def sync_generation_s(m, hw, lengths: Lengths, engines: int, tp: int, trajectories: int, cost=COST) -> float:
    """Decode a whole batch until its longest trajectory ends: sum over steps k < L_max of
    t(b_k, KV_k), with b_k = n_e S(k) trajectories still running on an engine (n_e = trajectories /
    engines) and KV_k = b_k (prompt + k) kv_bytes. When the batch's KV does not fit the engine,
    trajectories wait for room: the time grows by peak KV demand / KV capacity."""
    n_e = trajectories / engines
    steps = lengths.longest(trajectories)
    s = lengths.survival[:steps]
    running = n_e * s
    kv = running * (lengths.prompt + np.arange(steps)) * m.kv_bytes_per_token
    t = float(decode_step_s(m, hw, tp, running, kv, cost).sum())
    return t * max(1.0, float(kv.max()) / max(kv_capacity(m, hw, tp, cost), 1.0))


def running_trajectories(m, hw, lengths: Lengths, engines: int, tp: int, concurrent: float, cost=COST) -> float:
    """Trajectories one engine runs at full load: c = min(concurrent / engines, KV capacity / (resident
    context * kv_bytes)), at least 1."""
    per_trajectory = lengths.resident_context * m.kv_bytes_per_token
    return max(1.0, min(concurrent / engines, kv_capacity(m, hw, tp, cost) / per_trajectory))


def full_generation_rate(m, hw, lengths: Lengths, engines: int, tp: int, concurrent: float, cost=COST) -> float:
    """Tokens/s of all engines under continuous batching at full load: engines * c / t(c, c * resident
    context * kv_bytes), one token per running trajectory and decode step."""
    c = running_trajectories(m, hw, lengths, engines, tp, concurrent, cost)
    kv = c * lengths.resident_context * m.kv_bytes_per_token
    return engines * c / float(decode_step_s(m, hw, tp, c, kv, cost))


def interruption_s(m, hw, lengths: Lengths, engines: int, tp: int, concurrent: float, cost=COST) -> float:
    """After a weight update an interrupted engine recomputes the KV of its running trajectories:
    c * resident context tokens of prefill at 2 P FLOPs each."""
    c = running_trajectories(m, hw, lengths, engines, tp, concurrent, cost)
    return 2 * m.params * c * lengths.resident_context / (tp * hw.flops * cost.prefill_mfu)


def train_step_s(
    m, hw, lengths: Lengths, gpus: int, tp: int, pp: int, trajectories: int, cfg: Config, cost=COST
) -> float:
    """One PPO step on `gpus` trainer GPUs (TP tp, PP pp, DP d = gpus / (tp pp)) over trajectories of
    length s = prompt + L:
      FLOPs = 8 P N E[s] + 8 layers h N E[s^2]   (forward + backward = 6 P per token, plus the forward
              that recomputes prox_logprobs = 2 P; causal attention 2 h s^2 per layer and pass;
              x (8 + 2 + 2) / 8 with ppo.recompute full (the forward again in the backward) and
              ppo.kl_coef > 0 (the reference policy's forward), each counted when on)
      compute = FLOPs / (gpus * flops * mfu) * (m + pp - 1) / m   (1F1B bubble, m micro-batches per
              DP rank and minibatch, each ppo.max_tokens_per_mb tokens)
      + TP all-reduces (6 per layer and token, h * dtype bytes each) over NVLink
      + DP gradient all-reduce (fp32, 2 (d-1)/d of P / (tp pp) * 4 bytes) per minibatch over the network."""
    d = gpus // (tp * pp)
    p = lengths.prompt
    mean_s = p + lengths.mean
    second_s = p * p + 2 * p * lengths.mean + lengths.second_moment
    tokens = trajectories * mean_s
    flops = 8 * m.params * tokens + 8 * m.layers * m.hidden * trajectories * second_s
    # in forwards' worth of 2 P: 4 (forward, backward, prox forward), + recompute full, + reference forward
    passes = 4 + (cfg.ppo.recompute == "full") + (cfg.ppo.kl_coef > 0)
    flops *= passes / 4
    minibatches = cfg.ppo.minibatches
    micro = max(1.0, math.ceil(tokens / (d * minibatches * cfg.ppo.max_tokens_per_mb)))
    bubble = (micro + pp - 1) / micro
    compute = flops / (gpus * hw.flops * cost.train_mfu) * bubble
    tp_comm = 0.0
    if tp > 1:
        volume = (tokens / d) * (m.layers / pp) * 6 * m.hidden * m.dtype_bytes * 2 * (tp - 1) / tp
        tp_comm = volume / (cost.nvlink_gbs * GB) * bubble
    dp_comm = 0.0
    if d > 1:
        dp_comm = minibatches * 2 * (d - 1) / d * 4 * m.params / (tp * pp) / hw.network
    return compute + tp_comm + dp_comm


def weight_sync_s(m: ModelSize, hw: Hardware, pp: int, cost: CostModel = COST) -> float:
    """Each pipeline stage broadcasts its W / pp bytes over the network (pipelined broadcast: about one
    link's time), plus the fixed pause/load/resume cost."""
    return m.weight_bytes / pp / hw.network + cost.weight_sync_fixed_s


def gen_memory(m: ModelSize, hw: Hardware, tp: int, lengths: Lengths, cost: CostModel = COST) -> float:
    """Bytes per generator GPU: (W + KV of one longest trajectory) / tp + reserve, over the engine's
    share of memory (so it compares with the GPU's memory)."""
    need = (m.weight_bytes + (lengths.prompt + lengths.cap) * m.kv_bytes_per_token) / tp + cost.gen_reserve_gb * GB
    return need / cost.gen_memory_fraction


def train_memory_parts(m: ModelSize, tp: int, pp: int, dp: int, cfg: Config, cost: CostModel = COST) -> dict:
    """Bytes per trainer GPU (or CPU rank), by part:
    states:      P / (tp pp) x (dtype weights + 4 fp32 gradient buffer
                                + (4 fp32 master weights unless fp32 + 8 Adam moments) / dp)
                 (Megatron's distributed optimizer shards the master weights and moments over dp)
    activations: tokens / tp x dtype bytes x (layers x a (8 h + 4 f)), or with full recompute
                 (layers x h + a (8 h + 4 f)) (a: activation_factor)
                 (1F1B keeps pp micro-batches of layers / pp layers on the first stage: one micro-batch of
                 every layer; sequence parallelism splits what TP does not; tokens: ppo.max_tokens_per_mb)
    transients:  the dense gradient of the input embedding (vocab / tp x h x dtype bytes, made in its
                 backward) + the token logprobs' chunk temporaries. No micro-batch's whole logits: the
                 token logprobs come chunk by chunk.
    reference:   with ppo.kl_coef > 0, the frozen initial policy: P / (tp pp) x dtype bytes (else 0)."""
    master = 0 if m.dtype_bytes == 4 else 4
    states = m.params / (tp * pp) * (m.dtype_bytes + 4 + (master + 8) / dp)
    layer = cost.activation_factor * (8 * m.hidden + 4 * m.intermediate)  # values per token, one layer
    kept = m.hidden * m.layers + layer if cfg.ppo.recompute == "full" else layer * m.layers
    activations = cfg.ppo.max_tokens_per_mb / tp * kept * m.dtype_bytes
    chunks = min(cost.logprob_transient_bytes, 2 * cfg.ppo.max_tokens_per_mb * m.vocab / tp * 4)  # short batches
    transients = m.vocab / tp * m.hidden * m.dtype_bytes + chunks
    reference = m.params / (tp * pp) * m.dtype_bytes if cfg.ppo.kl_coef > 0 else 0.0
    return {"states": states, "activations": activations, "transients": transients, "reference": reference}


def train_memory(m: ModelSize, tp: int, pp: int, dp: int, cfg: Config, cost: CostModel = COST) -> float:
    """Bytes per trainer GPU (`train_memory_parts`), over the usable share of memory."""
    return sum(train_memory_parts(m, tp, pp, dp, cfg, cost).values()) / cost.train_memory_fraction


def predict(cfg: Config, plan: Plan | None = None, cost: CostModel = COST) -> Prediction:
    """The cost of one step for `plan` (default: the config's own allocation)."""
    if plan is None:
        plan = config_plan(cfg)
    m, hw, lengths = ModelSize.from_config(cfg), Hardware.from_config(cfg), Lengths.from_config(cfg, cost)
    r = cfg.rollout
    trajectories = r.prompts_per_step * r.group_size
    g, n = hw.gpus_per_node, cfg.cluster.nodes
    engines, train_gpus = plan.engines(g), plan.train_gpus(n, g)
    concurrent = r.max_concurrent * r.group_size
    t_gen_sync = sync_generation_s(m, hw, lengths, engines, plan.gen_tp, trajectories, cost)
    t_train = train_step_s(m, hw, lengths, train_gpus, plan.train_tp, plan.train_pp, trajectories, cfg, cost)
    t_ws = weight_sync_s(m, hw, plan.train_pp, cost)
    rate = full_generation_rate(m, hw, lengths, engines, plan.gen_tp, concurrent, cost)
    tokens = trajectories * lengths.mean
    t_gen_full = tokens / rate + t_ws + interruption_s(m, hw, lengths, engines, plan.gen_tp, concurrent, cost)
    return Prediction(
        plan, r.max_staleness, trajectories, tokens, lengths.longest(trajectories), t_gen_sync, t_train, t_ws,
        t_gen_full,
        gen_memory(m, hw, plan.gen_tp, lengths, cost),
        train_memory(m, plan.train_tp, plan.train_pp, max(1, train_gpus // (plan.train_tp * plan.train_pp)), cfg, cost),
        hw.memory,
    )  # fmt: skip


def colocated_step_s(cfg: Config, plan: Plan, cost: CostModel = COST) -> float:
    """A synchronous system on all GPUs, each phase in turn (what the paper compares against; areal-hpc
    always splits the nodes): T_gen_sync(all engines) + T_train(all GPUs) + T_ws (the engines still
    load the new weights)."""
    m, hw, lengths = ModelSize.from_config(cfg), Hardware.from_config(cfg), Lengths.from_config(cfg, cost)
    r, n, g = cfg.rollout, cfg.cluster.nodes, cfg.cluster.gpus_per_node
    trajectories = r.prompts_per_step * r.group_size
    return (
        sync_generation_s(m, hw, lengths, n * g // plan.gen_tp, plan.gen_tp, trajectories, cost)
        + train_step_s(m, hw, lengths, n * g, plan.train_tp, plan.train_pp, trajectories, cfg, cost)
        + weight_sync_s(m, hw, plan.train_pp, cost)
    )


# --- choosing -----------------------------------------------------------------------------------


def config_plan(cfg: Config) -> Plan:
    """The allocation the config asks for (gen_nodes from `split_nodes` when null)."""
    a = cfg.allocation
    return Plan(split_nodes(cfg)[0], a.gen_tp, a.train_tp, a.train_pp)


def tp_sizes(cfg: Config) -> list[int]:
    """The tensor-parallel sizes a node allows: dividing its GPUs and the query and KV heads."""
    m, g = model_arch(cfg.model), cfg.cluster.gpus_per_node
    return [
        t for t in range(1, g + 1) if g % t == 0 and m.num_attention_heads % t == 0 and m.num_key_value_heads % t == 0
    ]


def candidates(cfg: Config, fixed: dict[str, int] | None = None):
    """Every plan the system can run: generator TP divides the GPUs of a node (an engine never spans
    nodes), trainer TP stays inside a node, both divide the query and KV heads, PP (at most 16) divides
    the layers, and TP x PP divides the trainer GPUs. Fields in `fixed` keep their value."""
    fixed = fixed or {}
    m, n, g = model_arch(cfg.model), cfg.cluster.nodes, cfg.cluster.gpus_per_node
    gen_nodes = [fixed["gen_nodes"]] if "gen_nodes" in fixed else range(1, n)
    gen_tps = [fixed["gen_tp"]] if "gen_tp" in fixed else tp_sizes(cfg)
    train_tps = [fixed["train_tp"]] if "train_tp" in fixed else tp_sizes(cfg)
    pps = (
        [fixed["train_pp"]]
        if "train_pp" in fixed
        else [p for p in range(1, m.num_layers + 1) if m.num_layers % p == 0 and p <= 16]
    )
    for k in gen_nodes:
        for gtp in gen_tps:
            for ttp in train_tps:
                for pp in pps:
                    if 1 <= k < n and g % gtp == 0 and ((n - k) * g) % (ttp * pp) == 0:
                        yield Plan(k, gtp, ttp, pp)


def choose(
    cfg: Config, fixed: dict[str, int] | None = None, cost: CostModel = COST, fit: bool = True
) -> tuple[Prediction, str]:
    """The plan with the highest predicted asynchronous throughput at cfg.rollout.max_staleness among
    those that fit memory (among all when not `fit`); ties go to fewer GPUs per model copy (less
    communication)."""

    best, tried, fitting = None, 0, 0
    for plan in candidates(cfg, fixed):
        tried += 1
        p = predict(cfg, plan, cost)
        if fit and not p.fits:
            continue
        fitting += 1
        key = (round(p.tokens_per_s(), -2), -plan.gen_tp - plan.train_tp * plan.train_pp, plan.gen_nodes)
        if best is None or key > best[0]:
            best = (key, p)
    if best is None:
        raise ConfigError(
            f"no split of {cfg.cluster.nodes} nodes x {cfg.cluster.gpus_per_node} GPUs of {cfg.cluster.gpu_memory_gb:g} GB "
            f"fits the model (tried {tried} plans{' with ' + str(fixed) if fixed else ''}); use more nodes, "
            "larger GPUs, ppo.recompute=full or a smaller ppo.max_tokens_per_mb"
        )
    p = best[1]
    why = (
        f"planner: best of {fitting} plans that fit memory (of {tried}) by predicted asynchronous throughput at "
        f"max_staleness {p.eta}" + (f", with {', '.join(f'{k}={v}' for k, v in fixed.items())} fixed" if fixed else "")
    )
    return p, why


def auto_split(cfg: Config, cost: CostModel = COST) -> tuple[int, str]:
    """`allocation.gen_share: auto`: the generator nodes of the fastest plan (`choose`) with the config's
    gen_tp, train_tp and train_pp; returns (gen_nodes, why). Deterministic: every rank finds the same."""

    a = cfg.allocation
    fixed = {"gen_tp": a.gen_tp, "train_tp": a.train_tp, "train_pp": a.train_pp}
    try:
        p, _ = choose(cfg, fixed, cost)
        fits = ""
    except ConfigError:  # `plan` shows it DOES NOT FIT and `plan --search` finds what does
        p, _ = choose(cfg, fixed, cost, fit=False)
        fits = "; no split fits GPU memory with these parallel sizes"
    why = (
        f"allocation.gen_share auto: the planner's fastest split at max_staleness {p.eta} "
        f"({_tok(p.tokens_per_s())} effective tokens/s predicted, {p.bottleneck}-bound{fits})"
    )
    return p.plan.gen_nodes, why


def split_nodes(cfg: Config) -> tuple[int, str]:
    """The generator nodes of `cfg.cluster.nodes` and why: exactly `allocation.gen_nodes` when set; with
    `gen_share: auto` the fastest split (`auto_split`); else the split nearest `gen_share` whose trainer
    GPUs divide by train_tp x train_pp. The Layout builds the rank map on it."""
    a, n, g = cfg.allocation, cfg.cluster.nodes, cfg.cluster.gpus_per_node
    group = a.train_tp * a.train_pp

    def trains(gen_nodes: int) -> bool:
        return 1 <= gen_nodes < n and ((n - gen_nodes) * g) % group == 0

    if a.gen_nodes is not None:
        if not 1 <= a.gen_nodes < n:
            raise ConfigError(f"allocation.gen_nodes ({a.gen_nodes}) must be between 1 and cluster.nodes - 1 ({n - 1})")
        if not trains(a.gen_nodes):
            raise ConfigError(
                f"allocation.train_tp x train_pp ({a.train_tp} x {a.train_pp} = {group}) must divide the "
                f"trainer GPUs ({n - a.gen_nodes} nodes x {g} = {(n - a.gen_nodes) * g})"
            )
        return a.gen_nodes, f"allocation.gen_nodes = {a.gen_nodes} (set in the config)"
    if a.gen_share == "auto":
        return auto_split(cfg)
    target = a.gen_share * n
    fits = sorted((k for k in range(1, n) if trains(k)), key=lambda k: (abs(k - target), -k))
    if not fits:
        raise ConfigError(
            f"no split of {n} nodes x {g} GPUs leaves the trainer a multiple of train_tp x train_pp "
            f"({a.train_tp} x {a.train_pp} = {group}) GPUs; change cluster.nodes or the parallel sizes"
        )
    why = (
        f"allocation.gen_share {a.gen_share:g} of {n} nodes = {target:g}; nearest split whose trainer "
        f"GPUs divide by train_tp x train_pp ({group}): {fits[0]} generator nodes"
    )
    return fits[0], why


def with_plan(cfg: Config, plan: Plan) -> Config:
    """A copy of cfg whose allocation is `plan` (for Layout.from_config)."""
    a = dataclasses.replace(
        cfg.allocation, gen_nodes=plan.gen_nodes, gen_tp=plan.gen_tp, train_tp=plan.train_tp, train_pp=plan.train_pp
    )
    return dataclasses.replace(cfg, allocation=a)


# --- the report ---------------------------------------------------------------------------------


def _tok(x: float) -> str:
    return f"{x / 1e3:,.1f}k" if x < 1e6 else f"{x / 1e6:,.2f}M"


def report(cfg: Config, p: Prediction) -> str:
    """The prediction table (synchronous and asynchronous) and why, below the Layout table."""

    steps = cfg.train.total_steps
    rows = [("prediction", "steps/hour", "effective tokens/s", "step time", f"{steps} steps")]

    def row(name: str, t: float) -> tuple[str, ...]:
        return (name, f"{3600 / t:,.1f}", _tok(p.tokens / t), f"{t:,.1f} s", f"{steps * t / 3600:,.1f} h")

    rows.append(row("synchronous (max_staleness 0)", p.t_sync))
    rows.append(row(f"asynchronous (max_staleness {p.eta})", p.t_async()))
    rows.append(row("synchronous, colocated (all GPUs per phase)", colocated_step_s(cfg, p.plan)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    sweep = ", ".join(f"{e}: {_tok(p.tokens_per_s(e))}" for e in (0, 1, 2, 4, 8, 16))
    lines += [
        f"speed-up asynchronous / synchronous: {p.t_sync / p.t_async():.2f}x; "
        f"effective tokens/s by max_staleness: {sweep}",
        f"per step: {p.trajectories} trajectories x {p.tokens / p.trajectories:,.0f} tokens on average "
        f"(longest {p.longest:,}); "
        f"synchronous: decode until the longest ends {p.t_gen_sync:,.1f} s + train {p.t_train:,.1f} s + "
        f"weight sync {p.t_weight_sync:,.1f} s",
        f"asynchronous: generation at full load {p.t_gen_full:,.1f} s/step, training {p.t_train + p.t_weight_sync:,.1f} "
        f"s/step: {p.bottleneck} is the bottleneck",
        f"memory per GPU (of {p.memory / GB:g} GB): generator {p.gen_memory / GB:,.1f} GB, trainer "
        f"{p.train_memory / GB:,.1f} GB" + ("" if p.fits else f"  -- DOES NOT FIT: {memory_advice(cfg, p)}"),
        "model and constants: docs/planner.md (GPU figures from cluster.gpu_tflops, gpu_memory_bandwidth_gbs, "
        "interconnect_gbps)",
    ]
    if cfg.cluster.device == "cpu":
        lines.append(
            "cluster.device is cpu: these figures are for GPUs with the cluster.gpu_* numbers, not this machine"
        )
        try:
            lines.append(check_host_fits(cfg))
        except ConfigError as e:
            lines.append(f"DOES NOT FIT {e}")
    return "\n".join(lines)


def memory_advice(cfg: Config, p: Prediction, cost: CostModel = COST) -> str:
    """What to change so that `p`'s generator and trainer fit their GPUs ('' when they do): the settings
    by name, each with what it would need."""
    fixes = []
    if p.gen_memory > p.memory:
        more = [t for t in tp_sizes(cfg) if t > p.plan.gen_tp]
        fixes.append(
            f"the generator needs {p.gen_memory / GB:,.1f} GB of {p.memory / GB:g} GB: "
            + (f"raise allocation.gen_tp (to {more[0]}) or " if more else "")
            + "lower rollout.max_new_tokens (its KV cache is kept for the longest trajectory)"
        )
    if p.train_memory > p.memory:
        options = []
        if cfg.ppo.recompute != "full":
            full = predict(_with_ppo(cfg, recompute="full"), p.plan, cost)
            options.append(f"set ppo.recompute=full ({full.train_memory / GB:,.1f} GB)")
        mb = cfg.ppo.max_tokens_per_mb
        while mb > cfg.rollout.max_new_tokens:  # halving, down to one trajectory's worth: the largest that fits
            mb = max(mb // 2, cfg.rollout.max_new_tokens)
            if predict(_with_ppo(cfg, max_tokens_per_mb=mb), p.plan, cost).train_memory <= p.memory:
                options.append(f"lower ppo.max_tokens_per_mb to {mb:,}")
                break
        options.append(
            "raise allocation.train_tp or allocation.train_pp (`areal-hpc plan --search` finds a split that fits)"
        )
        fixes.append(
            f"the trainer needs {p.train_memory / GB:,.1f} GB of {p.memory / GB:g} GB: " + ", or ".join(options)
        )
    return "; ".join(fixes)


def _with_ppo(cfg: Config, **fields) -> Config:
    return dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, **fields))


def check_fits(cfg: Config) -> None:
    """ConfigError naming what to change when the config's generator or trainer does not fit its GPUs."""

    p = predict(cfg)
    if not p.fits:
        raise ConfigError(
            f"{cfg.experiment.name} DOES NOT FIT GPU memory by the planner's model: {memory_advice(cfg, p)}"
        )


CPU_KV_CACHE_BYTES = (64 << 20, 4 << 30)
"""The KV cache a CPU generator asks vLLM for: every trajectory at full length, within these bounds
(vLLM's CPU default reserves 92% of the node's memory, which fails on a machine shared with the other
roles)."""


def cpu_kv_cache_bytes(per_token: float, tokens: int) -> int:
    low, high = CPU_KV_CACHE_BYTES
    return int(min(max(per_token * tokens, low), high))


def check_host_fits(cfg: Config, available: float | None = None) -> str:
    """For a run on this host's CPUs: one line on the memory its ranks need against what the host has
    available (`available` bytes; default: MemAvailable); ConfigError naming the settings when it is more."""

    need = host_memory_need(cfg)
    total = sum(need.values())
    if available is None:
        available = _mem_available()
    line = (
        f"memory on this host: the ranks need about {total / GiB:,.1f} GiB (trainers "
        f"{need['trainer'] / GiB:,.1f}, generators {need['generator'] / GiB:,.1f}) of {available / GiB:,.1f} GiB available"
    )
    if total > available:
        raise ConfigError(
            f"{line}: set ppo.recompute=full or lower ppo.max_tokens_per_mb (trainers), lower rollout.max_concurrent "
            "or model.max_position_embeddings (the generators' KV cache), or use fewer cluster.nodes"
        )
    return line


def _mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def host_memory_need(cfg: Config) -> dict[str, float]:
    """Bytes the ranks of a CPU run on one host need, by role: each trainer rank's states, activations and
    transients (`train_memory_parts`), each generator's weights and KV cache (`cpu_kv_cache_bytes`, K and
    V in fp32 at most as the engine asks)."""
    plan, m, g = config_plan(cfg), ModelSize.from_config(cfg), cfg.cluster.gpus_per_node
    trainers, generators = plan.train_gpus(cfg.cluster.nodes, g), plan.engines(g)
    parts = train_memory_parts(m, plan.train_tp, plan.train_pp, trainers // (plan.train_tp * plan.train_pp), cfg)
    per_token = m.kv_bytes_per_token * 4 / m.dtype_bytes / plan.gen_tp
    kv = cpu_kv_cache_bytes(per_token, cfg.rollout.engine_seqs * model_arch(cfg.model).max_position_embeddings)
    return {
        "trainer": trainers * sum(parts.values()),
        "generator": generators * plan.gen_tp * (m.weight_bytes / plan.gen_tp + kv),
    }


def search_hint(cfg: Config, p: Prediction) -> str:
    """One line on what `--search` would choose, when it predicts more than the config's plan."""

    try:
        best, _ = choose(cfg)
    except ConfigError as e:
        return f"--search: {e}"
    gain = best.tokens_per_s() / p.tokens_per_s() if p.fits else float("inf")
    if best.plan == p.plan or gain < 1.005:
        return "--search would keep this plan: no other plan that fits is predicted faster"
    b = best.plan
    return (
        f"--search would choose {b.gen_nodes} generator nodes (TP {b.gen_tp}) and trainer TP {b.train_tp} x PP "
        f"{b.train_pp}: {_tok(best.tokens_per_s())} effective tokens/s asynchronous"
        + (f" ({gain:.2f}x this plan)" if p.fits else "")
        + f", {best.bottleneck}-bound"
    )
