"""The answer-length figures the benchmark scripts print (tools/bench_async_vs_sync.py, tools/bench_vs_trl.py):
what a run's answers were, what the task asks for, and the planner's model of the AReaL paper's run at the
same cap, one row each, so a reader sees the shape a throughput figure was measured on.
"""

from __future__ import annotations

import numpy as np

from areal_hpc.metrics import length_summary

PAPER_CAP = 27648
"""The AReaL paper's 1.5B run: its answers' limit (configs/qwen1.5b.yaml, rollout.max_new_tokens)."""


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
    from areal_hpc.synthetic import synthetic_rows, worked_steps

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
