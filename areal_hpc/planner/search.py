"""Choosing a plan: every allocation the system can run (`candidates`), the one predicted fastest that
fits memory (`choose`), and the GPU split a run is launched on (`resolve_split`: `allocation.gen_gpus`
as set, the split nearest `allocation.gen_share`, or with `gen_share: auto` the fastest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_hpc.arch import model_arch
from areal_hpc.errors import ConfigError
from areal_hpc.parallel import gen_tp_problem, split_problem, train_ep_problem, train_pp_problem, train_tp_problem
from areal_hpc.planner.cost import COST, CostModel, Plan, with_plan
from areal_hpc.planner.predict import Prediction, predict, tok_rate

if TYPE_CHECKING:
    from areal_hpc.arch import QwenArch
    from areal_hpc.config.schema import Config

ALLOCATION_FIELDS = ("gen_gpus", "gen_tp", "train_tp", "train_pp", "train_ep")
"""The allocation fields the planner chooses with `--search` (unless fixed on the command line)."""


def candidates(cfg: Config, fixed: dict[str, int] | None = None):
    """Every plan the system can run (`areal_hpc.parallel`'s rules: generator TP within a node, both TPs
    splitting the model evenly, PP dividing the layers, whole engines, trainer GPUs in whole TP x PP replicas
    with each TP group within a node, a MoE's EP dividing its experts and the trainer's DP size; 1 for a dense
    model), as the search narrows them: a trainer's TP group inside a node (NVLink; a config may set a larger
    one) and PP at most 16. Any number of generator GPUs the rules allow, not only whole nodes. Fields in
    `fixed` keep their value."""
    fixed = fixed or {}
    m, n, g = model_arch(cfg.model), cfg.cluster.nodes, cfg.cluster.gpus_per_node
    gen_gpus = [fixed["gen_gpus"]] if "gen_gpus" in fixed else range(1, n * g)
    gen_tps = [fixed["gen_tp"]] if "gen_tp" in fixed else [t for t in range(1, g + 1) if not gen_tp_problem(m, g, t)]
    train_tps = (
        [fixed["train_tp"]]
        if "train_tp" in fixed
        else [t for t in range(1, g + 1) if g % t == 0 and not train_tp_problem(m, t)]
    )
    pps = [fixed["train_pp"]] if "train_pp" in fixed else [p for p in range(1, 17) if not train_pp_problem(m, p)]
    eps = [fixed["train_ep"]] if "train_ep" in fixed else range(1, max(m.num_experts, 1) + 1)
    eps = [ep for ep in eps if not train_ep_problem(m, ep)]  # dividing the experts; the DP size per split below
    # trainer_problem's two checks, the split's once per split rather than once per EP size
    for k in gen_gpus:
        for gtp in gen_tps:
            for ttp in train_tps:
                for pp in pps:
                    if split_problem(n, g, k, gtp, ttp, pp):
                        continue
                    dp = (n * g - k) // (ttp * pp)
                    for ep in eps:
                        if not train_ep_problem(m, ep, dp):
                            yield Plan(k, gtp, ttp, pp, ep)


def trainer_problem(
    arch: QwenArch, nodes: int, gpus_per_node: int, gen_gpus: int, gen_tp: int, tp: int, pp: int, ep: int
) -> str | None:
    """What keeps a split from running at these sizes: whole engines, the trainer's GPUs in whole TP x PP
    replicas with node-local TP groups (`split_problem`), and EP dividing the experts and its DP size
    (`train_ep_problem`)."""
    problem = split_problem(nodes, gpus_per_node, gen_gpus, gen_tp, tp, pp)
    if problem:
        return problem
    return train_ep_problem(arch, ep, (nodes * gpus_per_node - gen_gpus) // (tp * pp))


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
        key = (
            round(p.tokens_per_s(), -2),
            -plan.gen_tp - plan.train_tp * plan.train_pp,
            -plan.train_ep,
            plan.gen_gpus,
        )
        if best is None or key > best[0]:
            best = (key, p)
    if not tried:
        raise ConfigError(
            f"no split of {cfg.cluster.nodes} nodes x {cfg.cluster.gpus_per_node} GPUs can run "
            f"{'these parallel sizes (' + str(fixed) + ')' if fixed else 'the model'}: the trainer's GPUs must hold "
            "whole allocation.train_tp x train_pp replicas (a MoE's allocation.train_ep dividing their number), and "
            "allocation.gen_tp must divide a node's GPUs; change cluster.nodes or the parallel sizes"
        )
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
    """`allocation.gen_share: auto`: the generator GPUs of the fastest plan (`choose`) with the config's
    gen_tp, train_tp, train_pp and train_ep; returns (gen_gpus, why). Deterministic: every rank finds the
    same."""

    a = cfg.allocation
    fixed = {f: getattr(a, f) for f in ALLOCATION_FIELDS if f != "gen_gpus"}
    try:
        p, _ = choose(cfg, fixed, cost)
        fits = ""
    except ConfigError:  # `plan` shows it DOES NOT FIT and `plan --search` finds what does
        p, _ = choose(cfg, fixed, cost, fit=False)
        fits = "; no split fits GPU memory with these parallel sizes"
    why = (
        f"allocation.gen_share auto: the planner's fastest split at max_staleness {p.eta} "
        f"({tok_rate(p.tokens_per_s())} effective tokens/s predicted, {p.bottleneck}-bound{fits})"
    )
    return p.plan.gen_gpus, why


def resolve_split(cfg: Config) -> tuple[Config, str]:
    """The config a run is launched with, its GPU split a number (`allocation.gen_gpus`), and why:
    `allocation.gen_gpus` when set; with `gen_share: auto` the fastest split (`auto_split`); else the
    split nearest `gen_share` of whole engines whose trainer GPUs hold whole TP x PP replicas (as many as EP
    divides) with node-local TP groups. Launchers call this once and write the result into the run's
    config.yaml, which every rank then reads (the Layout reads numbers)."""
    a, n, g = cfg.allocation, cfg.cluster.nodes, cfg.cluster.gpus_per_node
    if a.gen_gpus is not None:
        return cfg, f"allocation.gen_gpus = {a.gen_gpus} (set in the config)"
    if a.gen_share == "auto":
        gen_gpus, why = auto_split(cfg)
    else:
        target = a.gen_share * n * g
        arch = model_arch(cfg.model)
        sizes = (a.gen_tp, a.train_tp, a.train_pp, a.train_ep)
        fits = [k for k in range(1, n * g) if not trainer_problem(arch, n, g, k, *sizes)]
        if not fits:
            raise ConfigError(
                f"no split of {n} nodes x {g} GPUs gives the generators whole engines of allocation.gen_tp "
                f"({a.gen_tp}) GPUs and the trainer a multiple of train_tp x train_pp "
                f"({a.train_tp} x {a.train_pp} = {a.train_tp * a.train_pp}) GPUs"
                + (f" in a number of replicas that train_ep ({a.train_ep}) divides" if a.train_ep > 1 else "")
                + "; change cluster.nodes, cluster.gpus_per_node or the parallel sizes"
            )
        gen_gpus = min(fits, key=lambda k: (abs(k - target), -k))
        why = (
            f"allocation.gen_share {a.gen_share:g} of {n * g} GPUs = {target:g}; nearest split of whole engines "
            f"whose trainer GPUs divide by train_tp x train_pp ({a.train_tp * a.train_pp}): {gen_gpus} generator GPUs"
        )
    return with_plan(cfg, Plan(gen_gpus, a.gen_tp, a.train_tp, a.train_pp, a.train_ep)), why
