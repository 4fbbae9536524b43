"""Asynchronous versus synchronous RL on this machine: the speedup of overlapping generation and training.

Runs one workload's config in its modes in one invocation, each run with a fresh run directory under one
root (root/experiment.name/<mode><round>), the modes alternating for `--rounds` rounds so that a change
in the machine's load over the invocation falls on all of them. `areal-hpc run` pins the generator rank
and the trainer rank to their own cores (the CPU stand-in for separate GPUs;
areal_hpc.layout.Layout.core_plan). Settings given on the command line apply to every mode.

    python tools/bench_async_vs_sync.py                          # short: 2 rounds of 60 steps per mode
    python tools/bench_async_vs_sync.py --rounds 1 --steps 100 ppo.prox_logp=loglinear
    python tools/bench_async_vs_sync.py --workload reasoning     # 3 rounds x 3 modes, about an hour

Workloads (`--workload`):

  short      configs/tiny-cpu.yaml (short arithmetic answers); modes sync (rollout.max_staleness 0:
             generation and training take turns) and async (--staleness, default the config's 2: they
             overlap), in that order
             every round; 2 rounds unless --rounds.
  reasoning  configs/tiny-reasoning-cpu.yaml (the chain task: long-tailed answers of up to 1,024
             tokens; --staleness default the config's 4); modes sync, async (interruptible: a weight update interrupts the answers in
             flight, loads, resumes them) and async-noint (same staleness, rollout.interruptible=false: a
             generator lets its running answers finish before it loads), the order reversed every
             second round (sync, async, async-noint; then async-noint, async, sync); 3 rounds unless
             --rounds.

Each run prints its wall time as it ends, each round its ratios. Then, per mode, over the steady-state
steps of all its rounds (the first `--warmup` steps of each run left out: engine warm-up, and the
asynchronous pipeline filling):

  effective throughput   generated tokens consumed by training per second, computed from metrics.jsonl:
                         sum(throughput/effective_tokens_per_s * timing/step_s) / sum(timing/step_s)
  idle fractions         timing/gen_idle_frac and timing/train_idle_frac, weighted by step time
  G, T                   per-step generation time (generator busy) and training time (trainer busy):
                         G = (1 - gen_idle_frac) * step_s, T = (1 - train_idle_frac) * step_s

short then prints the ideal speedup the synchronous run's costs allow, (G + T) / max(G, T) (2.0 when
generation and training cost the same; overlap cannot hide more than the cheaper of the two). reasoning
prints, in order:

  answer tokens      mean, median, p90, max of: the task (its worked answers, capped; char tokenizer),
                     the planner's model of the AReaL paper's 1.5B run with its median scaled from 27,648
                     to this cap (the same shape at this cap), and what each mode trained on
  per mode           the figures above, the share of the trajectories generated that staleness dropped
                     (dropped / (dropped + trained)), and for async-noint the mean timing/sync_drain_s
                     (the wait for the running answers before a load)
  bounds             balanced: (G + T) / max(G, T) with the sync run's G and T; and the sync step over
                     max(async G, async T), which names the side bounding the asynchronous run
  interruption       async / async-noint effective throughput as a signed percentage, and each round's
  below 2x           only under 2x: the sync run's G and T as shares of its step, and how full its
                     batches are (mean of answer_tokens_mean / answer_tokens_max: a synchronous step's
                     answers start together and it decodes until the longest ends)
  each round         the figures of the six lines below, round by round

and last six lines, each figure the median of the rounds' own:

  dropped            the share of the trajectories generated that the async run dropped as too stale
  interruption       async / async-noint effective throughput, signed
  p90 answer tokens  trained / generated, of the async run (`rollout/trained_tokens_p90` over
                     `rollout/generated_tokens_p90`, each over ten steps' worth of episodes): under 1
                     when the answers dropped were long ones
  reward             the mean reward of each mode's last fifth of steps (warm-up included in the count)
  balanced bound     async/sync over that round's balanced bound (G + T) / max(G, T)
  headline           async/sync effective throughput

short prints last `async/sync effective throughput: X.XXx` over all rounds. The ratio follows the
balance of G and T: with tiny-cpu's own settings they come out about equal on this machine. The measured
ratio can come close to the balanced bound, or pass it: the synchronous step also waits for the rewards,
the weight sync and (reasoning) its batch's longest answer, which the asynchronous run overlaps too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools.bench_figures

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.metrics import read_metrics  # noqa: E402
from tools.bench_figures import (  # noqa: E402
    PAPER_CAP,
    below_2x_line,
    bounds_line,
    dropped_share,
    format_lengths,
    ideal_ratio,
    interruption_line,
    last_fifth_reward,
    occupancy,
    planner_lengths,
    run_lengths,
    signed_percent,
    steady_rows,
    task_lengths,
    trained_over_generated_p90,
    trajectories_per_step,
)

BENCH_OVERRIDES = ["logging.tensorboard=false"]  # the configs as shipped, less the TensorBoard writes


@dataclass(frozen=True)
class Workload:
    """A config and the modes run on it: (name, overrides given --staleness) in the order of round 1;
    `rotate` reverses the order every second round."""

    config: Path
    modes: tuple[str, ...]
    steps: int
    warmup: int
    rotate: bool
    rounds: int


WORKLOADS = {
    "short": Workload(
        REPO / "configs" / "tiny-cpu.yaml", ("sync", "async"), steps=60, warmup=5, rotate=False, rounds=2
    ),
    "reasoning": Workload(
        REPO / "configs" / "tiny-reasoning-cpu.yaml",
        ("sync", "async", "async-noint"),
        steps=100,  # steps of about 3.0 s sync, 1.9 s async, 2.0 s async-noint, ~40 s start-up a run:
        warmup=10,  # 3 x (100 x 6.9 s + 3 x 40 s) = 40 min
        rotate=True,
        rounds=3,  # each figure the median of the rounds': one round's interruption figure moves by 8 points
    ),
}


def mode_overrides(mode: str, staleness: int) -> list[str]:
    """sync: max_staleness 0; async: `staleness`, interruptible; async-noint: `staleness`, not interruptible."""
    return {
        "sync": ["rollout.max_staleness=0"],
        "async": [f"rollout.max_staleness={staleness}"],
        "async-noint": [f"rollout.max_staleness={staleness}", "rollout.interruptible=false"],
    }[mode]


def round_order(modes: tuple[str, ...], k: int, rotate: bool) -> tuple[str, ...]:
    """The modes of round k (from 1): as given, or reversed in every even round when `rotate`."""
    return modes[::-1] if rotate and k % 2 == 0 else modes


@dataclass(frozen=True)
class Summary:
    """Steady-state figures of one run (step-time weighted means)."""

    steps: int
    effective_tokens_per_s: float
    gen_idle_frac: float
    train_idle_frac: float
    gen_s: float  # G: generator busy time per step
    train_s: float  # T: trainer busy time per step
    step_s: float
    staleness_max: int


def summarize(rows: list[dict], warmup: int) -> Summary:
    """Figures over the rows after the first `warmup` steps.

    Rates are aggregated as totals over totals (tokens = effective_tokens_per_s * step_s summed, over
    the summed step time), and fractions weighted by step time, so a short step counts for its length.
    """
    steady = steady_rows(rows, warmup)
    total_s = sum(r["timing/step_s"] for r in steady)
    tokens = sum(r["throughput/effective_tokens_per_s"] * r["timing/step_s"] for r in steady)

    def weighted(key: str) -> float:
        return sum(r[key] * r["timing/step_s"] for r in steady) / total_s

    gen_idle, train_idle = weighted("timing/gen_idle_frac"), weighted("timing/train_idle_frac")
    step_s = total_s / len(steady)
    return Summary(
        steps=len(steady),
        effective_tokens_per_s=tokens / total_s,
        gen_idle_frac=gen_idle,
        train_idle_frac=train_idle,
        gen_s=(1 - gen_idle) * step_s,
        train_s=(1 - train_idle) * step_s,
        step_s=step_s,
        staleness_max=max(int(r["staleness/max"]) for r in steady),
    )


def speedup(base: Summary, other: Summary) -> float:
    """Effective throughput of `other` over `base`."""
    return other.effective_tokens_per_s / base.effective_tokens_per_s


def describe(name: str, s: Summary) -> str:
    return (
        f"{name:5s}  {s.effective_tokens_per_s:8.0f} effective tok/s over {s.steps} steps  "
        f"step {s.step_s:.3f} s (G {s.gen_s:.3f} s, T {s.train_s:.3f} s)  "
        f"idle: generator {s.gen_idle_frac:.0%}, trainer {s.train_idle_frac:.0%}  staleness max {s.staleness_max}"
    )


# --- running -----------------------------------------------------------------------------------


def run_mode(config: Path, root: Path, trial: str, overrides: list[str], steps: int, log: Path) -> Path:
    """One fresh `areal-hpc run` of `config`; returns its run directory (root/experiment.name/trial)."""
    run_overrides = [
        f"experiment.root={root}",
        f"experiment.trial={trial}",
        f"train.total_steps={steps}",
        f"train.save_every={steps}",
        *BENCH_OVERRIDES,
        *overrides,
    ]
    cfg = load_config(config, run_overrides)
    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(config), "--fresh", *run_overrides]
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        sys.exit(f"{trial}: areal-hpc run failed (exit {code}); its output: {log}")
    print(f"{trial}: {steps} steps in {time.monotonic() - t0:.0f} s (start-up included); output {log}", flush=True)
    return root / cfg.experiment.name / trial


def report_short(steady: dict[str, list[dict]]) -> None:
    sync, asyn = summarize(steady["sync"], 0), summarize(steady["async"], 0)
    print(describe("sync", sync))
    print(describe("async", asyn))
    print(
        f"ideal ratio on this machine (sync G, T): (G + T) / max(G, T) = {ideal_ratio(sync.gen_s, sync.train_s):.2f}x"
    )
    print(f"async/sync effective throughput: {speedup(sync, asyn):.2f}x")


def report_reasoning(cfg, runs: list[dict[str, list[dict]]], warmup: int) -> None:
    """The reasoning workload's figures (module docstring) from `runs`: each round's rows by mode."""
    from areal_hpc.data.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    cap = cfg.rollout.max_new_tokens
    steady = {mode: [r for run in runs for r in steady_rows(run[mode], warmup)] for mode in runs[0]}
    s = {mode: summarize(rows, 0) for mode, rows in steady.items()}
    rounds = [{mode: summarize(rows, warmup) for mode, rows in run.items()} for run in runs]
    print(
        f"answer tokens (task: the chain task's worked answers; planner: its model of the paper's 1.5B run, "
        f"the median scaled from {PAPER_CAP:,} to the cap of {cap}; each mode: what it trained on, steady steps):"
    )
    task = task_lengths(cfg, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    print(format_lengths("task (what it asks)", task, cap))
    print(format_lengths("planner (paper 1.5B)", planner_lengths(cap), cap))
    for mode, rows in steady.items():
        print(format_lengths(mode, run_lengths(rows), cap))
    for mode, rows in steady.items():
        extra = f"  dropped {dropped_share(rows, trajectories_per_step(cfg)):.1%} of the trajectories generated"
        extra += f"  staleness wait {sum(r['staleness/wait_s'] for r in rows) / len(rows):.2f} s a step"
        if mode == "async-noint":
            drain = sum(r["timing/sync_drain_s"] for r in rows) / len(rows)
            extra += f"  sync drain {drain:.2f} s a step"
        print(describe(f"{mode:11s}", s[mode]) + extra)
    sync, asyn, noint = s["sync"], s["async"], s["async-noint"]
    print(bounds_line(sync.gen_s, sync.train_s, sync.step_s, asyn.gen_s, asyn.train_s))
    print(interruption_line(speedup(noint, asyn), [speedup(r["async-noint"], r["async"]) for r in rounds]))
    headline = speedup(sync, asyn)
    if headline < 2:
        print(below_2x_line(sync.gen_s, sync.train_s, sync.step_s, occupancy(steady["sync"])))
    figures = [round_figures(cfg, run, summary, warmup) for run, summary in zip(runs, rounds)]
    for k, f in enumerate(figures, 1):
        rewards = ", ".join(f"{mode} {f['reward'][mode]:.3f}" for mode in f["reward"])
        print(
            f"round {k}: dropped {f['dropped']:.1%}, interruption {signed_percent(f['interruption'])}, "
            f"p90 trained / generated {f['p90']:.2f}, reward last fifth {rewards}, "
            f"of the balanced bound {f['of_bound']:.2f}, async/sync {f['headline']:.2f}x"
        )

    def median(key: str, mode: str | None = None) -> float:
        return float(np.median([f[key][mode] if mode else f[key] for f in figures]))

    rewards = ", ".join(f"{mode} {median('reward', mode):.2f}" for mode in runs[0])
    print(f"dropped: {median('dropped'):.1%} of the trajectories generated (async, interruptible)")
    print(f"interruption: {signed_percent(median('interruption'))} (async / async-noint)")
    print(f"p90 answer tokens, trained / generated: {median('p90'):.2f} (async, interruptible)")
    print(f"reward, last fifth: {rewards}")
    print(f"async/sync of the balanced bound: {median('of_bound'):.2f}")
    print(f"async/sync effective throughput: {median('headline'):.2f}x")


def round_figures(cfg, run: dict[str, list[dict]], summary: dict[str, Summary], warmup: int) -> dict:
    """The six figures of one round (module docstring)."""
    asyn = steady_rows(run["async"], warmup)
    sync = summary["sync"]
    headline = speedup(sync, summary["async"])
    return {
        "dropped": dropped_share(asyn, trajectories_per_step(cfg)),
        "interruption": speedup(summary["async-noint"], summary["async"]),
        "p90": trained_over_generated_p90(asyn),
        "reward": {mode: last_fifth_reward(rows) for mode, rows in run.items()},
        "of_bound": headline / ideal_ratio(sync.gen_s, sync.train_s),
        "headline": headline,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short", help="config and modes (module doc)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the workload's)")
    p.add_argument(
        "--warmup", type=int, help="first steps of each run left out of the figures (default: the workload's)"
    )
    p.add_argument("--rounds", type=int, help="runs per mode, the modes alternating (default: the workload's)")
    p.add_argument("--staleness", type=int, help="max_staleness of the async runs (default: the config's)")
    p.add_argument("--root", default=str(REPO / "runs" / "bench"), help="run root of all runs")
    p.add_argument("overrides", nargs="*", help="more config overrides for every run (section.field=value)")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload]
    steps = w.steps if args.steps is None else args.steps
    warmup = w.warmup if args.warmup is None else args.warmup
    rounds = w.rounds if args.rounds is None else args.rounds
    if rounds < 1 or steps <= warmup:
        p.error(f"need --rounds >= 1 and --steps > --warmup (got {rounds}, {steps}, {warmup})")
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(w.config, BENCH_OVERRIDES + args.overrides)
    if args.staleness is None:
        args.staleness = cfg.rollout.max_staleness
    if args.workload == "reasoning":
        r = cfg.rollout
        print(
            f"workload reasoning: {w.config.relative_to(REPO)}, {cfg.data.synthetic_task} task, up to "
            f"{r.max_new_tokens} new tokens, {r.prompts_per_step} x {r.group_size} a step, async staleness {args.staleness}"
        )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    print(f"settings: {' '.join(BENCH_OVERRIDES + args.overrides)}", flush=True)
    runs: list[dict[str, list[dict]]] = []  # each round's rows by mode
    for k in range(1, rounds + 1):
        this_round = {}
        for mode in round_order(w.modes, k, w.rotate):
            trial = f"{mode}{k}"
            overrides = mode_overrides(mode, args.staleness) + args.overrides
            run_dir = run_mode(w.config, root, trial, overrides, steps, root / f"{trial}.out")
            this_round[mode] = read_metrics(run_dir)
        runs.append({mode: this_round[mode] for mode in w.modes})
        summary = {mode: summarize(rows, warmup) for mode, rows in this_round.items()}
        line = f"round {k}: async/sync {speedup(summary['sync'], summary['async']):.2f}x"
        if "async-noint" in summary:
            line += f", async/async-noint {speedup(summary['async-noint'], summary['async']):.2f}x"
        print(line, flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.workload == "reasoning":
        report_reasoning(cfg, runs, warmup)
    else:
        report_short({mode: [r for run in runs for r in steady_rows(run[mode], warmup)] for mode in w.modes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
