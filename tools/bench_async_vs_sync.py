"""Asynchronous versus synchronous RL on this machine: the speedup of overlapping generation and training.

Runs the tiny config twice in one invocation, identical but for `rollout.max_staleness` (0: synchronous,
generation and training take turns; > 0: asynchronous, they overlap), each with a fresh run directory
under one root. `areal-hpc run` pins the generator rank and the trainer rank to their own cores (the CPU
stand-in for separate GPUs; areal_hpc.main.core_plan). Then prints, per mode, over the steady-state
steps (the first `--warmup` steps left out: engine warm-up, and the asynchronous pipeline filling):

  effective throughput   generated tokens consumed by training per second, computed from metrics.jsonl:
                         sum(throughput/effective_tokens_per_s * timing/step_s) / sum(timing/step_s)
  idle fractions         timing/gen_idle_frac and timing/train_idle_frac, weighted by step time
  G, T                   per-step generation time (generator busy) and training time (trainer busy):
                         G = (1 - gen_idle_frac) * step_s, T = (1 - train_idle_frac) * step_s

and the ideal speedup the synchronous run's costs allow, (G + T) / max(G, T) (2.0 when generation and
training cost the same; overlap cannot hide more than the cheaper of the two), then last
`async/sync effective throughput: X.XXx`.

    python tools/bench_async_vs_sync.py                   # BENCH_OVERRIDES, 40 steps per mode
    python tools/bench_async_vs_sync.py --steps 60 rollout.max_new_tokens=24

The benchmark's own settings (BENCH_OVERRIDES) make generation and training comparable in cost on two
cores; without them the tiny config's steps take ~0.1 s and the controller's per-message overhead, not
the overlap, decides the ratio. Settings given on the command line come after them and win.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
ASYNC_STALENESS = 2
BENCH_OVERRIDES = [
    "rollout.prompts_per_step=16",
    "rollout.max_new_tokens=12",
    "rollout.max_concurrent=48",
    "logging.tensorboard=false",
]


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


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl, in step order (a torn last line is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(rows, key=lambda r: r["step"])


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
    """One fresh `areal-hpc run` of the tiny config; returns its run directory."""
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
    p.add_argument("--steps", type=int, default=40, help="training steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    p.add_argument("--staleness", type=int, default=ASYNC_STALENESS, help="max_staleness of the async run")
    p.add_argument("--root", default=str(REPO / "runs" / "bench"), help="run root of both runs")
    p.add_argument("overrides", nargs="*", help="more config overrides for both runs (section.field=value)")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    print(f"settings: {' '.join(BENCH_OVERRIDES + args.overrides)}", flush=True)
    runs = {}
    for name, staleness in (("sync", 0), ("async", args.staleness)):
        run_dir = run_mode(root, name, staleness, args.steps, args.overrides, root / f"{name}.out")
        runs[name] = summarize(read_metrics(run_dir / "metrics.jsonl"), args.warmup)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sync, asyn = runs["sync"], runs["async"]
    print(describe("sync", sync))
    print(describe("async", asyn))
    print(
        f"ideal ratio on this machine (sync G, T): (G + T) / max(G, T) = {ideal_ratio(sync.gen_s, sync.train_s):.2f}x"
    )
    print(f"async/sync effective throughput: {speedup(sync, asyn):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
