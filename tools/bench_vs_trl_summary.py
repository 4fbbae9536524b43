"""The figures tools/bench_vs_trl.py prints over its rounds: a timed run's figures (Run), the medians over
the rounds, the answer-length rows (tools.bench_figures), each system's throughput, the line on what
bounds a ratio below 2x, and last the ratio of areal-hpc's median to the best TRL setting's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Run:
    """One timed run: trained trajectories per second after the warm-up, the answers of those steps (a
    length_summary), and the shares of the time spent generating and training (TRL: of its steps, in
    turn; areal-hpc: its generator's and its trainer's busy shares, which overlap)."""

    trajectories_per_s: float
    lengths: dict
    generating: float
    training: float

    @property
    def answer_tokens_per_s(self) -> float:
        """Effective throughput: the answers' tokens trained per second (every step trains as many answers)."""
        return self.trajectories_per_s * self.lengths["mean"]


def median_of(runs: list[Run], key: str) -> str:
    """'6.10 (median of 2: 6.02, 6.18)' of a Run property over the rounds."""
    v = [getattr(r, key) for r in runs]
    return f"{statistics.median(v):.2f} (median of {len(v)}: {', '.join(f'{x:.2f}' for x in v)})"


def ratio(areal: float, trl: float) -> float:
    return areal / trl


def bound_line(ratio: float, setting: str, trl_generating: float, gen_busy: float, train_busy: float) -> str | None:
    """Below 2x, what bounds the ratio: TRL's share g of its step spent generating caps what overlapping
    generation with training at TRL's speeds can gain at 1 / max(g, 1 - g); areal-hpc is bounded by the
    busier of its generator and its trainer (`gen_busy`, `train_busy`: their busy shares of its steps)."""
    if ratio >= 2:
        return None
    overlap = 1 / max(trl_generating, 1 - trl_generating)
    side = "generator" if gen_busy >= train_busy else "trainer"
    return (
        f"below 2x: TRL {setting} generates {trl_generating:.0%} of its step (overlapping generation and "
        f"training at its speeds gains at most {overlap:.2f}x); areal-hpc's generator is busy {gen_busy:.0%} "
        f"of its steps, its trainer {train_busy:.0%}: bounded by its {side}"
    )


def summarize(cfg, tokens_of, trl: dict, trl_answers: dict, areal: list[Run], areal_rows: list[dict]) -> None:
    """The figures over the rounds, the ratio to the best TRL setting last: `trl` and `trl_answers` by
    setting (its runs, its answers' lengths after the warm-up), `areal_rows` areal-hpc's steady metrics rows."""
    from areal_hpc.metrics import length_summary
    from tools.bench_figures import format_lengths, planner_lengths, run_lengths, task_lengths

    cap = cfg.rollout.max_new_tokens
    print("answer tokens (the steps after each run's warm-up)")
    print(format_lengths(f"task ({cfg.data.synthetic_task})", task_lengths(cfg, tokens_of), cap))
    print(format_lengths("planner 1.5B, scaled", planner_lengths(cap), cap))
    for setting, answers in trl_answers.items():
        print(format_lengths(f"TRL {setting}", length_summary(answers), cap))
    print(format_lengths("areal-hpc", run_lengths(areal_rows), cap))

    for setting, runs in trl.items():
        print(
            f"TRL {setting}: trained trajectories/s {median_of(runs, 'trajectories_per_s')}, "
            f"answer tokens/s {median_of(runs, 'answer_tokens_per_s')}, generation "
            f"{statistics.median(r.generating for r in runs):.0%} of its step"
        )
    print(
        f"areal-hpc: trained trajectories/s {median_of(areal, 'trajectories_per_s')}, "
        f"answer tokens/s {median_of(areal, 'answer_tokens_per_s')}, generator busy "
        f"{statistics.median(r.generating for r in areal):.0%}, trainer busy {statistics.median(r.training for r in areal):.0%}"
    )
    rate = {s: statistics.median(r.trajectories_per_s for r in runs) for s, runs in trl.items()}
    best = max(rate, key=rate.get)
    areal_rate = statistics.median(r.trajectories_per_s for r in areal)
    tokens = [statistics.median(r.answer_tokens_per_s for r in runs) for runs in (areal, trl[best])]
    print(f"areal-hpc/TRL {best} answer tokens per second: {ratio(*tokens):.2f}x")
    bound = bound_line(
        ratio(areal_rate, rate[best]),
        best,
        statistics.median(r.generating for r in trl[best]),
        statistics.median(r.generating for r in areal),
        statistics.median(r.training for r in areal),
    )
    if bound:
        print(bound)
    print(
        f"areal-hpc/TRL {best} (the best TRL setting here) trained trajectories per second: "
        f"{ratio(areal_rate, rate[best]):.2f}x"
    )
