"""The figures the benchmark scripts print (tools/bench_async_vs_sync.py, tools/bench_vs_trl.py), pure
functions of metrics rows and settings.

Rows: the steps a figure is computed over (after a run's warm-up) and the trajectories each trained.
Answer lengths: what a run's answers were, what the task asks for, and the planner's model of the AReaL
paper's run at the same cap, one row each, so a reader sees the shape a throughput figure was measured on.
Throughput: the async/sync bounds, the share of trajectories staleness dropped, how full a synchronous
batch is, the interruption effect, and the line that says why a speedup stays under 2x.
Bias and learning: the p90 of the answers trained over that of the answers generated, the reward of a
run's last fifth of steps.
"""

from __future__ import annotations

import numpy as np

from areal_hpc.metrics import length_summary

PAPER_CAP = 27648
"""The AReaL paper's 1.5B run: its answers' limit (configs/qwen1.5b.yaml, rollout.max_new_tokens)."""


def steady_rows(rows: list[dict], warmup: int) -> list[dict]:
    """A run's metrics rows after its first `warmup` steps (engine warm-up, the asynchronous pipeline
    filling): what the figures are computed over. ValueError when none is left."""
    steady = [r for r in rows if r["step"] > warmup]
    if not steady:
        raise ValueError(f"no steps after the {warmup} warm-up steps ({len(rows)} rows)")
    return steady


def trajectories_per_step(cfg) -> int:
    """Trajectories trained each step: `rollout.prompts_per_step` x `rollout.group_size`."""
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size


def run_lengths(rows: list[dict]) -> dict:
    """A run's answers from its metrics rows (`rollout/answer_tokens_*`, one summary per step). Every step
    trains the same number of episodes, so the mean of the steps' means is the run's mean; the median and
    p90 are the medians of the steps' own (a pooled quantile is not recoverable from per-step rows), the
    max the largest."""
    if not rows:
        raise ValueError("no metrics rows")
    col = {
        k: np.array([r[f"rollout/answer_tokens_{k}"] for r in rows], np.float64)
        for k in ("mean", "median", "p90", "max")
    }
    return {
        "mean": float(col["mean"].mean()),
        "median": float(np.median(col["median"])),
        "p90": float(np.median(col["p90"])),
        "max": int(col["max"].max()),
    }


def task_lengths(cfg, tokens_of, n: int = 2000, seed: int = 0) -> dict:
    """What the synthetic task asks for: the length of the worked response (`worked_steps`, the boxed answer
    and the end of text) of `n` training rows, capped at `rollout.max_new_tokens`; `tokens_of(text)` counts
    a text's tokens."""
    from areal_hpc.data.synthetic import synthetic_rows, worked_steps

    d, cap = cfg.data, cfg.rollout.max_new_tokens
    rows = synthetic_rows(n, seed, d.synthetic_task, d.synthetic_max_operand)
    return length_summary(
        [
            min(cap, tokens_of(worked_steps(d.synthetic_task, r["prompt"]) + f"\\boxed{{{r['answer']}}}") + 1)
            for r in rows
        ]
    )


def planner_lengths(cap: int) -> dict:
    """The planner's model of the paper's answers (`planner.COST`: a lognormal body, a share at the cap),
    its median scaled from the paper's 27,648-token cap to `cap`: the same shape at this cap."""
    from areal_hpc.planner import COST, Lengths

    s = Lengths(cap, COST.trajectory_median_tokens * cap / PAPER_CAP, COST.trajectory_sigma, COST.truncated_fraction, 0)
    survival = s.survival  # P(L > k), k = 0 .. cap - 1

    def quantile(q: float) -> float:
        below = np.nonzero(survival <= 1 - q)[0]
        return float(below[0]) if below.size else float(cap)

    return {"mean": s.mean, "median": quantile(0.5), "p90": quantile(0.9), "max": cap}


def format_lengths(label: str, s: dict, cap: int) -> str:
    """'  areal-hpc sync        mean  281  median  190  p90  690  max 1024  (0.27 of the cap)'"""
    return (
        f"  {label:24s} mean {s['mean']:5.0f}  median {s['median']:5.0f}  p90 {s['p90']:5.0f}  max {s['max']:5.0f}"
        f"  ({s['mean'] / cap:.2f} of the cap)"
    )


# --- the throughput figures of tools/bench_async_vs_sync.py ----------------------------------------


def ideal_ratio(gen_s: float, train_s: float) -> float:
    """Best async/sync speedup from overlapping a step's generation G and training T: (G + T) / max(G, T)."""
    return (gen_s + train_s) / max(gen_s, train_s)


def dropped_share(rows: list[dict], trajectories_per_step: int) -> float:
    """The share of the trajectories generated that staleness dropped: the rows' `staleness/dropped`
    summed, over that plus the trajectories trained (`trajectories_per_step` a row)."""
    dropped = sum(r["staleness/dropped"] for r in rows)
    return dropped / (dropped + trajectories_per_step * len(rows))


def trained_over_generated_p90(rows: list[dict]) -> float:
    """The p90 of the answers trained over the p90 of those generated, the median over the rows of
    `rollout/trained_tokens_p90` / `rollout/generated_tokens_p90` (each over the last ten steps' worth
    of episodes; rows before any episode came left out): under 1 when staleness dropped long answers."""
    ratios = [
        r["rollout/trained_tokens_p90"] / r["rollout/generated_tokens_p90"]
        for r in rows
        if r["rollout/generated_tokens_p90"] > 0
    ]
    if not ratios:
        raise ValueError("no step with an episode generated")
    return float(np.median(ratios))


def last_fifth_reward(rows: list[dict]) -> float:
    """The mean `reward/mean` of a run's last fifth of steps (at least one): what the policy learned, for
    comparing modes that trained as many steps."""
    return float(np.mean([r["reward/mean"] for r in rows[-max(1, len(rows) // 5) :]]))


def occupancy(rows: list[dict]) -> float:
    """The share of a synchronous batch's decode slots its answers use: the mean over steps of
    answer_tokens_mean / answer_tokens_max (a synchronous step's answers start together and the step
    decodes until its longest ends)."""
    return float(np.mean([r["rollout/answer_tokens_mean"] / r["rollout/answer_tokens_max"] for r in rows]))


def bounds_line(sync_gen_s: float, sync_train_s: float, sync_step_s: float, gen_s: float, train_s: float) -> str:
    """The two bounds on async/sync: the balanced one from the sync run's G and T, and the sync step over
    the asynchronous run's busier side (its G and T), which says which side bounds it."""
    side = "training" if train_s > gen_s else "generation"
    return (
        f"bounds: balanced (G + T) / max(G, T) with the sync run's G, T = {ideal_ratio(sync_gen_s, sync_train_s):.2f}x; "
        f"sync step / max(async G, async T) = {sync_step_s / max(gen_s, train_s):.2f}x "
        f"(async bounded by {side}: G {gen_s:.2f} s, T {train_s:.2f} s)"
    )


def signed_percent(ratio: float) -> str:
    """1.09 -> '+9%', 0.97 -> '-3%'."""
    return f"{ratio - 1:+.0%}"


def interruption_line(ratio: float, round_ratios: list[float]) -> str:
    """'interruption (async / async-noint): +9% (rounds +7%, +11%)': effective throughput with interruption
    over without, with its sign."""
    rounds = ", ".join(signed_percent(r) for r in round_ratios)
    return f"interruption (async / async-noint): {signed_percent(ratio)} (rounds {rounds})"


def below_2x_line(gen_s: float, train_s: float, step_s: float, fill: float) -> str:
    """Why a speedup stays under 2x, from the sync run: its G and T as shares of its step, and `fill` (the
    `occupancy` of its batches)."""
    return (
        f"below 2x: generation is {gen_s / step_s:.0%} of the sync step, training {train_s / step_s:.0%}, "
        f"answers fill {fill:.0%} of the batch"
    )
