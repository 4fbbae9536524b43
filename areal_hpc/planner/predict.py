"""The cost of one RL step for a plan (`predict`): decoding, training, the weight sync, the generators at
full load, and the memory per generator and trainer GPU; what the module docstring of areal_hpc.planner
draws. Pure functions: no MPI, no GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from areal_hpc.arch import model_arch
from areal_hpc.generator.choices import step_tokens
from areal_hpc.generator.memory import GeneratorMemory
from areal_hpc.planner.cost import COST, GB, CostModel, Hardware, Lengths, ModelSize, Plan, with_plan
from areal_hpc.protocol import routing_bytes_per_token

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config


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
    gen_budget: GeneratorMemory  # vLLM's share of a generator GPU and the project's additions after it
    train_memory: float  # bytes per trainer GPU
    memory: float  # bytes per GPU
    routing_bytes: float = 0.0  # routing (ppo.routing_replay) of a step's trajectories, through the controller
    controller_bytes: float = 0.0  # the most the controller holds of trajectories (`controller_bytes`)

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
        """Generators and trainers fit their GPUs, vLLM left enough of a generator's (`GeneratorMemory.problem`)."""
        return max(self.gen_memory, self.train_memory) <= self.memory and not self.gen_budget.problem()

    @property
    def bottleneck(self) -> str:
        return "generation" if self.t_gen_full >= self.t_train + self.t_weight_sync else "training"


def decode_step_s(m: ModelSize, hw: Hardware, tp: int, batch, kv_bytes, cost: CostModel = COST):
    """One decode step of an engine at tensor-parallel size tp, with `batch` trajectories whose KV cache
    totals `kv_bytes`: t = t_step + t_traj * batch + TP latency + max(memory time, compute time), where
    memory time = (W_read + KV) / (tp * bandwidth * efficiency) and compute time = 2 P_active batch / (tp *
    flops * mfu) (W_read: all weights of a dense model, a MoE's touched experts, `ModelSize.decode_weight_bytes`);
    t_step grows by `eager_layer_overhead_s` a layer when the engines run without CUDA graphs (`gen_eager`)."""
    memory_s = (m.decode_weight_bytes(batch) + kv_bytes) / (tp * hw.bandwidth * cost.decode_bandwidth_efficiency)
    compute_s = 2 * m.active_params * batch / (tp * hw.flops * cost.decode_mfu)
    tp_s = 2 * m.layers * cost.tp_allreduce_latency_s if tp > 1 else 0.0
    overhead = cost.decode_step_overhead_s + cost.decode_trajectory_overhead_s * batch
    if cost.gen_eager:
        overhead += m.layers * cost.eager_layer_overhead_s
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


def full_load_step_s(m, hw, lengths: Lengths, engines: int, tp: int, concurrent: float, cost=COST) -> float:
    """One decode step of an engine at full load: t(c, c * resident context * kv_bytes), c its running
    trajectories (`running_trajectories`)."""
    c = running_trajectories(m, hw, lengths, engines, tp, concurrent, cost)
    return float(decode_step_s(m, hw, tp, c, c * lengths.resident_context * m.kv_bytes_per_token, cost))


def full_generation_rate(m, hw, lengths: Lengths, engines: int, tp: int, concurrent: float, cost=COST) -> float:
    """Tokens/s of all engines under continuous batching at full load: engines * c / the full-load step, one
    token per running trajectory and decode step."""
    c = running_trajectories(m, hw, lengths, engines, tp, concurrent, cost)
    return engines * c / full_load_step_s(m, hw, lengths, engines, tp, concurrent, cost)


def interruption_s(
    m, hw, lengths: Lengths, engines: int, tp: int, concurrent: float, max_step_tokens: int, cost=COST
) -> float:
    """After a weight update an interrupted engine recomputes the KV of its running trajectories: c * resident
    context tokens of prefill at 2 P_active FLOPs each, in engine steps of at most `max_step_tokens` tokens
    (vLLM's max_num_batched_tokens: areal_hpc.generator.choices.step_tokens), each paying a decode step's
    fixed cost (its step's and its running trajectories', and TP latency) and reading the weights at least once."""
    c = running_trajectories(m, hw, lengths, engines, tp, concurrent, cost)
    tokens = c * lengths.resident_context
    steps = math.ceil(tokens / max_step_tokens)
    compute = 2 * m.active_params * tokens / (tp * hw.flops * cost.prefill_mfu)
    weights = steps * m.weight_bytes / (tp * hw.bandwidth * cost.decode_bandwidth_efficiency)
    tp_s = 2 * m.layers * cost.tp_allreduce_latency_s if tp > 1 else 0.0
    overhead = cost.decode_step_overhead_s + cost.decode_trajectory_overhead_s * c + tp_s
    return steps * overhead + max(compute, weights)


def train_step_s(
    m, hw, lengths: Lengths, gpus: int, tp: int, pp: int, trajectories: int, cfg: Config, cost=COST, *, ep: int = 1
) -> float:
    """One PPO step on `gpus` trainer GPUs (TP tp, PP pp, DP d = gpus / (tp pp), EP ep) over trajectories of
    length s = prompt + L (P_active: the parameters a token uses, P for a dense model):
      FLOPs = 8 P_active N E[s] + 8 layers h N E[s^2]   (forward + backward = 6 P_active per token, plus
              the forward that recomputes prox_logprobs = 2 P_active; causal attention 2 h s^2 per layer
              and pass; x (8 + 2 + 2) / 8 with ppo.recompute full (the forward again in the backward) and
              ppo.kl_coef > 0 (the reference policy's forward), each counted when on)
              + 2 P_teacher N E[s] + 2 layers_t h_t N E[s^2] with distill.teacher (the teacher's forward)
      compute = FLOPs / (gpus * flops * mfu) * (m + pp - 1) / m   (1F1B bubble, m micro-batches per
              DP rank and minibatch, each ppo.max_tokens_per_mb tokens)
      + TP all-reduces (6 per layer and token, h * dtype bytes each) over NVLink
      + a MoE's expert all-to-alls (`expert_alltoall_s`)
      + DP gradient all-reduce per minibatch over the network (fp32): 2 (d-1)/d of the dense P / (tp pp) * 4
        bytes, and a MoE's experts 2 (e-1)/e of P_experts / (ep pp) * 4 bytes over their e = tp d / ep
        replicas (experts are not split by TP)."""
    d = gpus // (tp * pp)
    p = lengths.prompt
    mean_s = p + lengths.mean
    second_s = p * p + 2 * p * lengths.mean + lengths.second_moment
    tokens = trajectories * mean_s
    flops = 8 * m.active_params * tokens + 8 * m.layers * m.hidden * trajectories * second_s
    # in forwards' worth of 2 P: 4 (forward, backward, prox forward), + recompute full, + reference forward;
    # with LoRA the backward computes no gradient of the frozen weights: a forward's worth
    passes = 4 - bool(m.lora_params) + (cfg.ppo.recompute == "full") + (cfg.ppo.kl_coef > 0)
    flops *= passes / 4
    if m.teacher:
        t = m.teacher
        flops += 2 * t.active_params * tokens + 2 * t.layers * t.hidden * trajectories * second_s
    minibatches = cfg.ppo.minibatches
    micro = max(1.0, math.ceil(tokens / (d * minibatches * cfg.ppo.max_tokens_per_mb)))
    bubble = (micro + pp - 1) / micro
    compute = flops / (gpus * hw.flops * cost.train_mfu) * bubble
    tp_comm = 0.0
    if tp > 1:
        volume = (tokens / d) * (m.layers / pp) * 6 * m.hidden * m.dtype_bytes * 2 * (tp - 1) / tp
        tp_comm = volume / (cost.nvlink_gbs * GB) * bubble
    forwards = passes - 2  # the backward moves as many tokens as a forward
    a2a = expert_alltoall_s(m, hw, tokens / (d * tp) * (forwards + 1), pp, ep, cfg.cluster.gpus_per_node, cost)
    dp_comm = 0.0
    if d > 1:  # the gradients' all-reduce: the adapters' alone with LoRA
        reduced = m.lora_params / pp if m.lora_params else m.dense_params / (tp * pp)
        dp_comm = minibatches * 2 * (d - 1) / d * 4 * reduced / hw.network
    e = tp * d // ep
    if m.experts and e > 1:
        dp_comm += minibatches * 2 * (e - 1) / e * 4 * m.expert_params / (ep * pp) / hw.network
    return compute + tp_comm + a2a * bubble + dp_comm


def expert_alltoall_s(m, hw, tokens: float, pp: int, ep: int, gpus_per_node: int, cost=COST) -> float:
    """A MoE's expert-parallel all-to-alls on one trainer GPU for `tokens` passes of a token through its
    layers / pp layers (a forward or a backward each): per layer and pass a dispatch and a combine, each
    sending h k dtype bytes per token, the share (ep - 1) / ep of it to the other ranks: over NVLink when
    the ep ranks (consecutive in Megatron's order) share a node (ep divides the node's GPUs), else over the
    network. 0 for a dense model or ep 1."""
    if not m.experts or ep == 1:
        return 0.0
    volume = tokens * (m.layers / pp) * 2 * m.hidden * m.experts_per_token * m.dtype_bytes * (ep - 1) / ep
    return volume / (cost.nvlink_gbs * GB if gpus_per_node % ep == 0 else hw.network)


def weight_sync_s(m: ModelSize, hw: Hardware, pp: int, cost: CostModel = COST) -> float:
    """Each pipeline stage broadcasts its W / pp bytes (all parameters: a MoE's experts too, from its
    expert-parallel ranks in turn; with LoRA the adapters alone) over the network (pipelined broadcast: about
    one link's time), plus the fixed pause/load/resume cost."""
    return m.sync_bytes / pp / hw.network + cost.weight_sync_fixed_s


def gen_memory(m: ModelSize, hw: Hardware, tp: int, lengths: Lengths, cost: CostModel = COST) -> float:
    """Bytes per generator GPU: (W + KV of one longest trajectory) / tp + reserve, over the engine's
    share of memory (so it compares with the GPU's memory)."""
    need = (m.weight_bytes + (lengths.prompt + lengths.cap) * m.kv_bytes_per_token) / tp + cost.gen_reserve_gb * GB
    return need / cost.gen_memory_fraction if cost.gen_memory_fraction > 0 else math.inf


def train_memory_parts(
    m: ModelSize, tp: int, pp: int, dp: int, cfg: Config, cost: CostModel = COST, *, ep: int = 1
) -> dict:
    """Bytes per trainer GPU (or CPU rank), by part:
    states:      P_dense / (tp pp) x (dtype weights + 4 fp32 gradient buffer
                                      + (4 fp32 master weights unless fp32 + 8 Adam moments) / dp)
                 + P_experts / (ep pp) x (the same, sharded over e = tp dp / ep expert replicas)
                 (Megatron's distributed optimizer shards the master weights and moments over the replicas;
                 experts are not split by TP; P_dense = P and P_experts = 0 for a dense model)
    activations: tokens / tp x dtype bytes x (layers x a (8 h + mlp)), or with full recompute
                 (layers x h + a (8 h + mlp)) (a: activation_factor; mlp: 4 f, or a MoE's k (4 f_e + 2 h))
                 (1F1B keeps pp micro-batches of layers / pp layers on the first stage: one micro-batch of
                 every layer; sequence parallelism splits what TP does not, and a MoE rank's experts see
                 k of its tokens' rows on average; tokens: ppo.max_tokens_per_mb)
    transients:  the dense gradient of the input embedding (vocab / tp x h x dtype bytes, made in its
                 backward) + the token logprobs' chunk temporaries. No micro-batch's whole logits: the
                 token logprobs come chunk by chunk.
    reference:   with ppo.kl_coef > 0, the frozen initial policy: P_dense / (tp pp) + P_experts / (ep pp)
                 x dtype bytes (else 0).
    teacher:     with distill.teacher, its weights: P_teacher / (tp pp) x dtype bytes (else 0; its forward
                 keeps no activations, and its logprobs come chunk by chunk as the policy's).
    With LoRA (P_lora adapter parameters, dense models only) the base is frozen: states are P / (tp pp) x
    dtype bytes + P_lora / pp x (dtype + 4 + (master + 8) / dp) (adapters counted whole on every TP rank: some
    are replicated, all are small); no embedding gradient among the transients; the reference is the base
    itself (0)."""
    master = 0 if m.dtype_bytes == 4 else 4
    states = m.dense_params / (tp * pp) * (m.dtype_bytes + 4 + (master + 8) / dp)
    states += m.expert_params / (ep * pp) * (m.dtype_bytes + 4 + (master + 8) / (tp * dp / ep))
    layer = cost.activation_factor * (8 * m.hidden + m.mlp_values)  # values per token, one layer
    kept = m.hidden * m.layers + layer if cfg.ppo.recompute == "full" else layer * m.layers
    activations = cfg.ppo.max_tokens_per_mb / tp * kept * m.dtype_bytes
    chunks = min(cost.logprob_transient_bytes, 2 * cfg.ppo.max_tokens_per_mb * m.vocab / tp * 4)  # short batches
    transients = m.vocab / tp * m.hidden * m.dtype_bytes + chunks
    weights = m.dense_params / (tp * pp) + m.expert_params / (ep * pp)
    reference = weights * m.dtype_bytes if cfg.ppo.kl_coef > 0 else 0.0
    if m.lora_params:
        states = weights * m.dtype_bytes + m.lora_params / pp * (m.dtype_bytes + 4 + (master + 8) / dp)
        transients, reference = chunks, 0.0
    teacher = m.teacher.params / (tp * pp) * m.teacher.dtype_bytes if m.teacher else 0.0
    return {
        "states": states,
        "activations": activations,
        "transients": transients,
        "reference": reference,
        "teacher": teacher,
    }


def train_memory(m: ModelSize, tp: int, pp: int, dp: int, cfg: Config, cost: CostModel = COST, *, ep: int = 1) -> float:
    """Bytes per trainer GPU (`train_memory_parts`), over the usable share of memory."""
    return sum(train_memory_parts(m, tp, pp, dp, cfg, cost, ep=ep).values()) / cost.train_memory_fraction


def plan_cost(cfg: Config, plan: Plan, cost: CostModel = COST) -> tuple[CostModel, GeneratorMemory]:
    """`cost` as the engines of `cfg` under `plan` run: their share of their GPUs (`gen_memory_fraction`, the
    one they start with: areal_hpc.generator.memory) and, with routing replay, eager decode (`gen_eager`);
    and that memory budget."""
    budget = GeneratorMemory.of(with_plan(cfg, plan), Hardware.from_config(cfg).memory)
    eager = cfg.ppo.routing_replay  # a recording engine runs eagerly (areal_hpc.generator.routing)
    return dataclasses.replace(cost, gen_memory_fraction=budget.utilization, gen_eager=eager), budget


TRAJECTORY_BYTES_PER_TOKEN = 13
"""A trajectory's arrays per token besides routing: token, mask, logprob, version (areal_hpc.protocol)."""


def controller_bytes(cfg: Config, lengths: Lengths, trajectories: int) -> tuple[float, float]:
    """(routing bytes of a step's trajectories, the most bytes of trajectories the controller holds): each
    token of prompt and answer carries TRAJECTORY_BYTES_PER_TOKEN, and with routing replay L x K expert
    ids (a MoE's every layer: the generator records them all); the controller holds at most what the
    staleness gate admits beyond the trained, max_staleness + 1 steps, and the step it packs."""
    tokens = trajectories * (lengths.prompt + lengths.mean)
    routing = tokens * routing_bytes_per_token(model_arch(cfg.model)) if cfg.ppo.routing_replay else 0.0
    held = (cfg.rollout.max_staleness + 2) * (tokens * TRAJECTORY_BYTES_PER_TOKEN + routing)
    return routing, held


def predict(cfg: Config, plan: Plan | None = None, cost: CostModel = COST) -> Prediction:
    """The cost of one step for `plan` (default: the config's own allocation)."""
    if plan is None:
        plan = Plan.of(cfg)
    cost, budget = plan_cost(cfg, plan, cost)
    m, hw, lengths = ModelSize.from_config(cfg), Hardware.from_config(cfg), Lengths.from_config(cfg, cost)
    r = cfg.rollout
    trajectories = r.prompts_per_step * r.group_size
    layout = plan.layout(cfg)
    engines, train_gpus = layout.generators, layout.trainers
    concurrent = r.max_concurrent * r.group_size
    t_gen_sync = sync_generation_s(m, hw, lengths, engines, plan.gen_tp, trajectories, cost)
    t_train = train_step_s(
        m, hw, lengths, train_gpus, plan.train_tp, plan.train_pp, trajectories, cfg, cost, ep=plan.train_ep
    )
    t_ws = weight_sync_s(m, hw, plan.train_pp, cost)
    rate = full_generation_rate(m, hw, lengths, engines, plan.gen_tp, concurrent, cost)
    tokens = trajectories * lengths.mean
    per_step = step_tokens(r.engine_seqs, model_arch(cfg.model).max_position_embeddings)
    t_gen_full = tokens / rate + t_ws + interruption_s(m, hw, lengths, engines, plan.gen_tp, concurrent, per_step, cost)
    return Prediction(
        plan, r.max_staleness, trajectories, tokens, lengths.longest(trajectories), t_gen_sync, t_train, t_ws,
        t_gen_full,
        gen_memory(m, hw, plan.gen_tp, lengths, cost),
        budget,
        train_memory(m, plan.train_tp, plan.train_pp, max(1, layout.train_dp), cfg, cost, ep=plan.train_ep),
        hw.memory,
        *controller_bytes(cfg, lengths, trajectories),
    )  # fmt: skip


def colocated_step_s(cfg: Config, plan: Plan, cost: CostModel = COST) -> float:
    """A synchronous system on all GPUs, each phase in turn (what the paper compares against; areal-hpc
    always splits the nodes): T_gen_sync(all engines) + T_train(all GPUs) + T_ws (the engines still
    load the new weights)."""
    cost, _ = plan_cost(cfg, plan, cost)
    m, hw, lengths = ModelSize.from_config(cfg), Hardware.from_config(cfg), Lengths.from_config(cfg, cost)
    r, n, g = cfg.rollout, cfg.cluster.nodes, cfg.cluster.gpus_per_node
    trajectories = r.prompts_per_step * r.group_size
    return (
        sync_generation_s(m, hw, lengths, n * g // plan.gen_tp, plan.gen_tp, trajectories, cost)
        + train_step_s(m, hw, lengths, n * g, plan.train_tp, plan.train_pp, trajectories, cfg, cost, ep=plan.train_ep)
        + weight_sync_s(m, hw, plan.train_pp, cost)
    )


def tok_rate(x: float) -> str:
    """Tokens per second as the tables show them: 128.6k, 1.25M."""
    return f"{x / 1e3:,.1f}k" if x < 1e6 else f"{x / 1e6:,.2f}M"
