"""Whether a config's ranks fit their memory, and what to change when they do not: on GPUs by the cost
model's memory per GPU (`check_fits`, `memory_advice`), on this host's CPUs against its available memory
(`check_host_fits`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from areal_hpc.arch import model_arch
from areal_hpc.errors import ConfigError
from areal_hpc.generator.kv_cache import cpu_kv_cache_bytes
from areal_hpc.layout import Layout
from areal_hpc.parallel import gen_tp_problem
from areal_hpc.planner.cost import COST, GB, CostModel, GiB, ModelSize
from areal_hpc.planner.predict import Prediction, predict, train_memory_parts

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config


def memory_advice(cfg: Config, p: Prediction, cost: CostModel = COST) -> str:
    """What to change so that `p`'s generator and trainer fit their GPUs ('' when they do): the settings
    by name, each with what it would need."""
    fixes = [problem] if (problem := p.gen_budget.problem()) else []
    if p.gen_memory > p.memory:
        g = cfg.cluster.gpus_per_node
        more = [t for t in range(p.plan.gen_tp + 1, g + 1) if not gen_tp_problem(model_arch(cfg.model), g, t)]
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
        sizes = (
            "allocation.train_tp, train_pp or train_ep"
            if model_arch(cfg.model).moe
            else "allocation.train_tp or allocation.train_pp"
        )
        options.append(f"raise {sizes} (`areal-hpc plan --search` finds a split that fits)")
        fixes.append(
            f"the trainer needs {p.train_memory / GB:,.1f} GB of {p.memory / GB:g} GB: " + ", or ".join(options)
        )
    return "; ".join(fixes)


def _with_ppo(cfg: Config, **fields) -> Config:
    return dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, **fields))


CONTROLLER_SHARE = 0.5
"""Of the memory of the controller's CPU node, the share its trajectories may take (the rest: the reward
workers, which share the node, and the processes themselves)."""
_SLURM_MEM_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def slurm_mem_bytes(text: str) -> float:
    """Bytes of an `sbatch --mem` value: a number with an optional unit K, M, G or T (none: megabytes)."""
    value = text.strip().upper()
    unit = _SLURM_MEM_UNITS.get(value[-1:], None)
    number = value[:-1] if unit else value
    if not number.isdigit():
        raise ConfigError(f"cluster.controller_mem {text!r} is not a memory size as sbatch --mem takes it (e.g. 64G)")
    return int(number) * (unit or 2**20)


def controller_problem(cfg: Config, p: Prediction) -> str:
    """Why the controller's CPU node would not hold the trajectories it may hold (`Prediction.controller_bytes`)
    in CONTROLLER_SHARE of `cluster.controller_mem` ('' when it would, or when the controller has no CPU
    node of its own or that memory is not set, or 0: all of the node's)."""
    c = cfg.cluster
    if not c.controller_mem or not Layout.from_config(cfg).reward_nodes:
        return ""
    have = slurm_mem_bytes(c.controller_mem)
    if have == 0 or p.controller_bytes <= CONTROLLER_SHARE * have:  # --mem=0: all of the node's
        return ""
    routing = f", {p.routing_bytes / GB:,.1f} GB of routing each" if p.routing_bytes else ""
    need = math.ceil(p.controller_bytes / CONTROLLER_SHARE / GiB)
    return (
        f"the controller may hold {p.controller_bytes / GB:,.1f} GB of trajectories (max_staleness + 2 = "
        f"{cfg.rollout.max_staleness + 2} steps' worth{routing}), more than {CONTROLLER_SHARE:.0%} of "
        f"cluster.controller_mem ({c.controller_mem}), which its node shares with the reward workers: raise it "
        f"to at least {need}G, or lower rollout.max_staleness"
    )


def check_fits(cfg: Config) -> None:
    """ConfigError naming what to change when the config's generator or trainer does not fit its GPUs, or
    its controller's trajectories do not fit the memory asked for its CPU node."""

    p = predict(cfg)
    if not p.fits:
        raise ConfigError(
            f"{cfg.experiment.name} DOES NOT FIT GPU memory by the planner's model: {memory_advice(cfg, p)}"
        )
    problem = controller_problem(cfg, p)
    if problem:
        raise ConfigError(f"{cfg.experiment.name} DOES NOT FIT: {problem}")


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
    transients (`train_memory_parts`), each generator's weights and the KV cache its engine asks for
    (`areal_hpc.generator.kv_cache.cpu_kv_cache_bytes`)."""
    layout, m, arch = Layout.from_config(cfg), ModelSize.from_config(cfg), model_arch(cfg.model)
    a = cfg.allocation
    parts = train_memory_parts(m, a.train_tp, a.train_pp, layout.train_dp, cfg, ep=a.train_ep)
    kv = cpu_kv_cache_bytes(arch, a.gen_tp, cfg.rollout.engine_seqs, arch.max_position_embeddings)
    return {
        "trainer": layout.trainers * sum(parts.values()),
        "generator": layout.generators * a.gen_tp * (m.weight_bytes / a.gen_tp + kv),
    }
