"""areal-hpc against Hugging Face TRL's GRPOTrainer, side by side on the same model, task and cores.

Both train the same initial weights in float32 with the same math reward, 8 prompts x 8 trajectories per
step, one optimizer step per batch, no KL term, the config's learning rate and clip, on one of two
workloads (`--workload`, WORKLOADS):

  short       (default) configs/tiny-cpu.yaml made a Qwen2 of ~21M parameters (hidden 512, 8 layers, GQA
              8/2 heads) from random weights (no warm start) on `a+b=`: every answer runs to the
              128-token limit. areal-hpc with cluster.nodes=3: a vLLM generator and two Megatron trainer
              ranks (data parallel), one thread each, sharing both cores with the controller and the reward
              worker (training is about two thirds of the work here).
  reasoning   configs/tiny-reasoning-cpu.yaml as shipped: its warm-started 2-layer model on the chain task
              (`a%b=` answered by a countdown), long-tailed answers up to 1,024 tokens, cluster.nodes 2
              (one generator, one trainer rank: generation dominates).

On both, areal-hpc (`areal-hpc run`, asynchronous) runs with the systems settings SYSTEMS: the proximal
logprobs by ppo.prox_logp=loglinear, which with one minibatch per step gives exactly the recomputed ones
without the extra forward pass (TRL with one iteration per batch makes none either).

TRL's GRPOTrainer runs in this process on both cores, generation then training in turn, in each setting of
TRL_SETTINGS that passes a check first (check_trl_setting, in a process of its own: two steps at a large
learning rate; the second step's answers must be likelier under the weights after the first step than
before it, or the generator samples from stale weights): `padded` (transformers' generate), `paged`
(transformers' continuous batching), `vllm` (a vLLM engine in this process, `vllm_mode="colocate"`). A
setting that fails or does not follow is printed with why and not timed. Gradient checkpointing is off.

The two alternate for `--rounds` rounds (each TRL setting, areal-hpc, each TRL setting, ...), so that a change
in the machine's load over the invocation falls on both. Each run's trained trajectories per second over the
steps after `--warmup` (areal-hpc: from metrics.jsonl, trajectories / summed timing/step_s; TRL: from the
step-end times of a trainer callback), each round's figures, then over the rounds: the answer-length rows
(tools.bench_figures: the task's, the planner's model of the paper's scaled to the cap, each system's answers;
TRL's from the `completion_ids` its reward function receives, areal-hpc's from its metrics rows), each
system's median trained trajectories/s and answer tokens/s (the effective throughput: answer lengths drift
as each system trains), TRL's generation share of its step, areal-hpc's generator and trainer busy shares,
and last the ratio of areal-hpc's median to the best TRL setting's (below 2x, a line before it on what
bounds it). Needs the `bench` extra (pip install -e .[bench]).

Here: the workloads, areal-hpc's runs and the rounds; TRL's side in tools/bench_vs_trl_grpo.py; the
figures over the rounds in tools/bench_vs_trl_summary.py.

    python tools/bench_vs_trl.py                          # short: 2 rounds, 2 warm-up + 8 measured steps a run
    python tools/bench_vs_trl.py --workload reasoning     # long-tailed answers: TRL 2 + 18 steps, areal-hpc 5 + 35
    python tools/bench_vs_trl.py --rounds 3 --steps 6 --warmup 2
    python tools/bench_vs_trl.py --trl padded vllm         # TRL settings to check and time (default: all)
    python tools/bench_vs_trl.py ppo.prox_logp=recompute  # areal-hpc settings given last win
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools.bench_vs_trl_grpo, tools.bench_vs_trl_summary
from tools.bench_vs_trl_grpo import TRL_SETTINGS, VERDICTS, bench_trl, check_apart  # noqa: E402
from tools.bench_vs_trl_summary import Run, summarize  # noqa: E402

# areal-hpc settings of the benchmark's own, on either workload: how the system runs, not what it learns.
SYSTEMS = [
    # with one minibatch a step the log-linear proximal logprobs are exactly the recomputed ones (the
    # first minibatch's prox is the current logprob), without the extra forward pass; TRL makes none either
    "ppo.prox_logp=loglinear",
    "ppo.minibatches=1",
    "ppo.max_tokens_per_mb=4096",
    "logging.tensorboard=false",
    "train.rank_timeout_s=900",  # a loaded machine can stretch a step far past the configs' 300 s
]


@dataclass(frozen=True)
class Workload:
    """A config and the benchmark's changes to it, and the steps of each run that fit two rounds of
    every TRL setting that counts and areal-hpc into about half an hour on a quiet 2-core machine."""

    config: Path
    overrides: tuple[str, ...]
    steps: int
    warmup: int
    areal_steps: int | None = None
    """areal-hpc's runs, when its steps are far shorter than TRL's (None: `steps` and `warmup` as TRL's)."""
    areal_warmup: int | None = None


WORKLOADS = {
    # the 21M model from random weights on `a+b=`: every answer runs to the 128-token limit
    "short": Workload(
        REPO / "configs" / "tiny-cpu.yaml",
        (
            "model.hidden_size=512",
            "model.intermediate_size=1280",
            "model.num_layers=8",
            "model.num_attention_heads=8",
            "model.num_key_value_heads=2",
            "sft.examples=0",  # both start from the same random weights
            "rollout.prompts_per_step=8",
            "rollout.group_size=8",
            "rollout.max_new_tokens=128",
            "rollout.max_concurrent=64",
            "rollout.max_staleness=2",
            "cluster.nodes=3",  # 1 generator + 2 trainer ranks (Layout.core_plan: one thread each, unpinned)
            *SYSTEMS,
        ),
        steps=10,
        warmup=2,
    ),
    # the config as shipped (warm-started 2-layer model, chain task, long-tailed answers up to 1,024 tokens,
    # 8 x 8 a step, cluster.nodes 2: generation dominates, a second trainer rank would take its core).
    # 20 steps: TRL padded waits for the longest answer, ~12 s a step on a quiet machine, paged ~17 s; areal-hpc
    # ~2 s a step, so its runs take 40 steps (5 warm-up: the asynchronous pipeline fills) to be measured over
    # more than seconds. Two rounds: 2 x (20 x 29 s + 95 s) + the checks, about 25 minutes
    "reasoning": Workload(
        REPO / "configs" / "tiny-reasoning-cpu.yaml", tuple(SYSTEMS), steps=20, warmup=2, areal_steps=40, areal_warmup=5
    ),
}


# --- areal-hpc ---------------------------------------------------------------------------------


def trajectories_per_s_from_metrics(rows: list[dict], warmup: int, trajectories_per_step: int) -> float:
    """Trained trajectories per second after the first `warmup` steps: trajectories / summed
    timing/step_s."""
    from tools.bench_figures import steady_rows

    steady = steady_rows(rows, warmup)
    return trajectories_per_step * len(steady) / sum(r["timing/step_s"] for r in steady)


def bench_areal(cfg, workload: Workload, trial: str, steps: int, warmup: int, extra: list[str]) -> tuple[Run, list]:
    """One `areal-hpc run` of the workload; also its steady metrics rows (for the pooled length row)."""
    from areal_hpc.config import load_config
    from areal_hpc.metrics import read_metrics
    from tools.bench_figures import run_lengths, steady_rows, trajectories_per_step

    root = cfg.experiment.root
    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(workload.config), "--fresh", f"experiment.root={root}"]
    cmd += [f"experiment.trial={trial}", f"train.total_steps={steps}", f"train.save_every={steps}"]
    cmd += [*workload.overrides, *extra]
    log = Path(root) / f"{trial}.out"
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        sys.exit(f"areal-hpc run failed (exit {code}); its output: {log}")
    run_name = load_config(workload.config, [*workload.overrides, *extra]).experiment.name
    rows = read_metrics(Path(root) / run_name / trial)
    print(f"areal-hpc: {steps} steps in {time.monotonic() - t0:.0f} s (start-up included); output {log}", flush=True)
    for r in rows:
        print(
            f"  step {r['step']}: {r['timing/step_s']:.2f} s, idle gen {r['timing/gen_idle_frac']:.0%} "
            f"train {r['timing/train_idle_frac']:.0%}, staleness {r['staleness/max']}, "
            f"answers mean {r['rollout/answer_tokens_mean']:.0f} max {r['rollout/answer_tokens_max']}"
        )
    rate = trajectories_per_s_from_metrics(rows, warmup, trajectories_per_step(cfg))
    steady = steady_rows(rows, warmup)
    busy = {k: 1 - statistics.fmean(r[f"timing/{k}_idle_frac"] for r in steady) for k in ("gen", "train")}
    return Run(rate, run_lengths(steady), busy["gen"], busy["train"]), steady


def main(argv: list[str] | None = None) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.data.initial_model import initial_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload", choices=list(WORKLOADS), default="short", help="what both systems train (default short)"
    )
    p.add_argument(
        "--steps",
        type=int,
        help="steps of each TRL run, warm-up included (default: the workload's; areal-hpc's too where the workload gives it none)",
    )
    p.add_argument(
        "--warmup", type=int, help="first steps of each run left out of the figures (default: the workload's)"
    )
    p.add_argument("--rounds", type=int, default=2, help="runs per system, alternating TRL and areal-hpc")
    p.add_argument("--root", default=None, help="run root (default: a temporary directory)")
    p.add_argument(
        "--trl",
        nargs="+",
        choices=list(TRL_SETTINGS),
        default=list(TRL_SETTINGS),
        help="TRL settings to check and, where they pass, time (default: all)",
    )
    p.add_argument(
        "overrides", nargs="*", help="more areal-hpc settings (section.field=value), e.g. ppo.prox_logp=recompute"
    )
    args = p.parse_args(argv)
    workload = WORKLOADS[args.workload]
    steps = workload.steps if args.steps is None else args.steps
    warmup = workload.warmup if args.warmup is None else args.warmup
    if args.rounds < 1 or not 1 <= warmup < steps:
        p.error(f"need --rounds >= 1 and 1 <= --warmup < --steps (got {args.rounds}, {warmup}, {steps})")
    areal_steps, areal_warmup = workload.areal_steps or steps, workload.areal_warmup or warmup
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-trl-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(workload.config, [f"experiment.root={root}", *workload.overrides])
    model_dir = initial_model(cfg)  # built once here; areal-hpc finds it cached under the same root
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    cap = cfg.rollout.max_new_tokens
    print(
        f"workload {args.workload}: {workload.config.relative_to(REPO)}, {cfg.data.synthetic_task} task; model "
        f"{model_dir} ({n_params / 1e6:.1f}M parameters, float32); {cfg.rollout.prompts_per_step} prompts x "
        f"{cfg.rollout.group_size} trajectories per step, up to {cap} new tokens; torch {torch.__version__}"
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)", flush=True)
    counted = []
    for setting in args.trl:
        verdict = check_apart(cfg, model_dir, root / f"check-{setting}", setting)
        print(f"TRL {setting}: {VERDICTS.get(verdict) or 'does not run here: ' + verdict.removeprefix('fails: ')}")
        if verdict == "follows":
            counted.append(setting)
    if not counted:
        sys.exit("no TRL setting runs here with a generator that follows the trained weights")
    trl: dict[str, list[Run]] = {s: [] for s in counted}
    trl_answers: dict[str, list[int]] = {s: [] for s in counted}
    areal: list[Run] = []
    areal_rows: list[dict] = []
    for k in range(1, args.rounds + 1):
        for setting in counted:
            run, answers = bench_trl(cfg, model_dir, root / f"trl-{setting}{k}", steps, warmup, setting)
            trl[setting].append(run)
            trl_answers[setting] += answers
        run, rows = bench_areal(cfg, workload, f"areal{k}", areal_steps, areal_warmup, args.overrides)
        areal.append(run)
        areal_rows += rows
        each = ", ".join(f"TRL {s} {v[-1].trajectories_per_s:.2f}" for s, v in trl.items())
        print(f"round {k}: {each}, areal-hpc {areal[-1].trajectories_per_s:.2f} trained trajectories/s")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    tokens_of = AutoTokenizer.from_pretrained(model_dir)
    summarize(
        cfg,
        lambda t: len(tokens_of(t, add_special_tokens=False)["input_ids"]),
        trl,
        trl_answers,
        areal,
        areal_rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
