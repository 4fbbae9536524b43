"""Asynchronous versus synchronous RL on this machine: the speedup of overlapping generation and training.

Runs the tiny config in both modes in one invocation, identical but for `rollout.max_staleness` (0:
synchronous, generation and training take turns; > 0: asynchronous, they overlap), each run with a fresh
run directory under one root, the modes alternating for `--rounds` rounds (sync, async, sync, async, ...)
so that a change in the machine's load over the invocation falls on both. `areal-hpc run` pins the
generator rank and the trainer rank to their own cores (the CPU stand-in for separate GPUs;
areal_hpc.layout.Layout.core_plan). Then prints, per mode, over the steady-state steps of all its rounds (the
first `--warmup` steps of each run left out: engine warm-up, and the asynchronous pipeline filling):

  effective throughput   generated tokens consumed by training per second, computed from metrics.jsonl:
                         sum(throughput/effective_tokens_per_s * timing/step_s) / sum(timing/step_s)
  idle fractions         timing/gen_idle_frac and timing/train_idle_frac, weighted by step time
  G, T                   per-step generation time (generator busy) and training time (trainer busy):
                         G = (1 - gen_idle_frac) * step_s, T = (1 - train_idle_frac) * step_s

and the ideal speedup the synchronous run's costs allow, (G + T) / max(G, T) (2.0 when generation and
training cost the same; overlap cannot hide more than the cheaper of the two), each round's ratio, then
last `async/sync effective throughput: X.XXx` over all rounds.

    python tools/bench_async_vs_sync.py                   # 2 rounds of 60 steps per mode
    python tools/bench_async_vs_sync.py --rounds 1 --steps 100 ppo.prox_logp=loglinear

Settings given on the command line apply to both modes. The ratio follows the balance of G and T
(overlap hides only the cheaper of the two): with tiny-cpu's own settings they come out about equal on
this machine. The measured ratio can come close to the ideal one, or pass it: the synchronous step also
waits for the rewards and the weight sync (step_s > G + T), which the asynchronous run overlaps too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
ASYNC_STALENESS = 2
BENCH_OVERRIDES = ["logging.tensorboard=false"]  # tiny-cpu as shipped, less the TensorBoard writes


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
    steady = [r for r in rows if r["step"] > warmup]
    if not steady:
        raise ValueError(f"no steps after the {warmup} warm-up steps ({len(rows)} rows)")
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


def ideal_ratio(gen_s: float, train_s: float) -> float:
    """Best async/sync speedup from overlapping a step's generation G and training T: (G + T) / max(G, T)."""
    return (gen_s + train_s) / max(gen_s, train_s)


def speedup(sync: Summary, asyn: Summary) -> float:
    return asyn.effective_tokens_per_s / sync.effective_tokens_per_s


def describe(name: str, s: Summary) -> str:
    return (
        f"{name:5s}  {s.effective_tokens_per_s:8.0f} effective tok/s over {s.steps} steps  "
        f"step {s.step_s:.3f} s (G {s.gen_s:.3f} s, T {s.train_s:.3f} s)  "
        f"idle: generator {s.gen_idle_frac:.0%}, trainer {s.train_idle_frac:.0%}  staleness max {s.staleness_max}"
    )


# --- running -----------------------------------------------------------------------------------


def run_mode(root: Path, trial: str, staleness: int, steps: int, overrides: list[str], log: Path) -> Path:
    """One fresh `areal-hpc run` of the tiny config; returns its run directory (under root/tiny-cpu/trial)."""
    cmd = [
        sys.executable,
        "-m",
        "areal_hpc.cli",
        "run",
        str(CONFIG),
        "--fresh",
        f"experiment.root={root}",
        f"experiment.trial={trial}",
        f"rollout.max_staleness={staleness}",
        f"train.total_steps={steps}",
        f"train.save_every={steps}",
        *BENCH_OVERRIDES,
        *overrides,
    ]
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        sys.exit(f"{trial}: areal-hpc run failed (exit {code}); its output: {log}")
    print(f"{trial}: {steps} steps in {time.monotonic() - t0:.0f} s (start-up included); output {log}", flush=True)
    return root / "tiny-cpu" / trial


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the figures")
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating sync and async")
    p.add_argument("--staleness", type=int, default=ASYNC_STALENESS, help="max_staleness of the async runs")
    p.add_argument("--root", default=str(REPO / "runs" / "bench"), help="run root of all runs")
    p.add_argument("overrides", nargs="*", help="more config overrides for every run (section.field=value)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps <= args.warmup:
        p.error(f"need --rounds >= 1 and --steps > --warmup (got {args.rounds}, {args.steps}, {args.warmup})")
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    print(f"settings: {' '.join(BENCH_OVERRIDES + args.overrides)}", flush=True)
    steady: dict[str, list[dict]] = {"sync": [], "async": []}
    for k in range(1, args.rounds + 1):
        this_round = {}
        for name, staleness in (("sync", 0), ("async", args.staleness)):
            trial = f"{name}{k}"
            run_dir = run_mode(root, trial, staleness, args.steps, args.overrides, root / f"{trial}.out")
            rows = [r for r in read_metrics(run_dir) if r["step"] > args.warmup]
            this_round[name] = summarize(rows, 0)
            steady[name] += rows
        print(f"round {k}: async/sync {speedup(this_round['sync'], this_round['async']):.2f}x", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sync, asyn = summarize(steady["sync"], 0), summarize(steady["async"], 0)
    print(describe("sync", sync))
    print(describe("async", asyn))
    print(
        f"ideal ratio on this machine (sync G, T): (G + T) / max(G, T) = {ideal_ratio(sync.gen_s, sync.train_s):.2f}x"
    )
    print(f"async/sync effective throughput: {speedup(sync, asyn):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
