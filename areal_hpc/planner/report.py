"""What `areal-hpc plan` prints below the layout's table: the predictions, synchronous and asynchronous,
why, the memory per GPU, and what `--search` would choose instead.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from areal_hpc.errors import ConfigError
from areal_hpc.planner.cost import GB, ModelSize
from areal_hpc.planner.memory import check_host_fits, controller_problem, memory_advice
from areal_hpc.planner.predict import Prediction, colocated_step_s, predict, tok_rate
from areal_hpc.planner.search import choose

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config

BYTES = ("GB", "MB", "kB")


def report(cfg: Config, p: Prediction) -> str:
    """The prediction table (synchronous and asynchronous) and why, below the Layout table."""

    steps = cfg.train.total_steps
    rows = [("prediction", "steps/hour", "effective tokens/s", "step time", f"{steps} steps")]

    def row(name: str, t: float) -> tuple[str, ...]:
        return (name, f"{3600 / t:,.1f}", tok_rate(p.tokens / t), f"{t:,.1f} s", f"{steps * t / 3600:,.1f} h")

    rows.append(row("synchronous (max_staleness 0)", p.t_sync))
    rows.append(row(f"asynchronous (max_staleness {p.eta})", p.t_async()))
    rows.append(row("synchronous, colocated (all GPUs per phase)", colocated_step_s(cfg, p.plan)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    sweep = ", ".join(f"{e}: {tok_rate(p.tokens_per_s(e))}" for e in (0, 1, 2, 4, 8, 16))
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
        f"a generator GPU: vLLM is given {p.gen_budget.utilization:.3f} of it (weights, activations, KV cache and "
        f"any CUDA graphs); after it the project adds {p.gen_budget.describe()} (areal_hpc.generator.memory)",
        f"controller: holds at most {p.controller_bytes / GB:,.1f} GB of trajectories"
        + (f"  -- DOES NOT FIT: {problem}" if (problem := controller_problem(cfg, p)) else ""),
        "model and constants: docs/planner.md (GPU figures from cluster.gpu_tflops, gpu_memory_bandwidth_gbs, "
        "interconnect_gbps)",
    ]
    m = ModelSize.from_config(cfg)
    if m.experts:
        ep = p.plan.train_ep
        lines.insert(
            -1,
            f"mixture of experts: {m.active_params / 1e9:,.2f}B of {m.params / 1e9:,.2f}B parameters per token "
            f"(top {m.experts_per_token} of {m.experts} experts); trainer expert parallel EP {ep} "
            f"(allocation.train_ep): {m.experts // ep} experts of each layer per GPU",
        )
    if m.lora_params:
        lines.insert(
            -1,
            f"LoRA rank {cfg.lora.rank} (lora.*): {_count(m.lora_params)} adapter parameters trained, "
            f"{m.lora_params / m.params:.2%} of the model's {_count(m.params)}, the rest frozen; a weight sync "
            f"sends {_count(m.sync_bytes, BYTES, ' ')} instead of {_count(m.weight_bytes, BYTES, ' ')}",
        )
    if cfg.ppo.routing_replay and m.experts:
        plain = predict(dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, routing_replay=False)), p.plan)
        lines.insert(
            -1,
            f"routing replay (ppo.routing_replay): the engines decode eagerly, without CUDA graphs (vLLM's router "
            f"hook is installed after they are captured): generation at full load {p.t_gen_full:,.1f} s/step, "
            f"{plain.t_gen_full:,.1f} s without replay ({p.t_gen_full / plain.t_gen_full - 1:+.0%}, with the routing "
            f"table's memory); "
            f"{p.routing_bytes / GB:,.1f} GB of routing a step through the controller",
        )
    if cfg.cluster.device == "cpu":
        lines.append(
            "cluster.device is cpu: these figures are for GPUs with the cluster.gpu_* numbers, not this machine"
        )
        try:
            lines.append(check_host_fits(cfg))
        except ConfigError as e:
            lines.append(f"DOES NOT FIT {e}")
    return "\n".join(lines)


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
    ep = f" x EP {b.train_ep}" if ModelSize.from_config(cfg).experts else ""
    return (
        f"--search would choose {b.gen_gpus} generator GPUs (TP {b.gen_tp}) and trainer TP {b.train_tp} x PP "
        f"{b.train_pp}{ep}: {tok_rate(best.tokens_per_s())} effective tokens/s asynchronous"
        + (f" ({gain:.2f}x this plan)" if p.fits else "")
        + f", {best.bottleneck}-bound"
    )


def _count(n: float, units=("B", "M", "k"), sep: str = "") -> str:
    """268.4M, 32.76B, 45.1k parameters; with units ("GB", "MB", "kB") and sep " ", bytes."""
    for unit, scale in zip(units, (1e9, 1e6, 1e3), strict=True):
        if n >= scale:
            return f"{n / scale:,.{2 if scale == 1e9 else 1}f}{sep}{unit}"
    return f"{n:,.0f}"
