"""areal-hpc against Hugging Face TRL's GRPOTrainer, side by side on the same model, task and cores.

Both train the same initial weights (a Qwen2 of ~21M parameters: hidden 512, 8 layers, GQA 8/2 heads,
the tiny tokenizer's vocabulary; built by areal_hpc.tiny, no warm start) in float32 on the synthetic
`a+b=` task with boxed answers (areal_hpc.synthetic.synthetic_rows, the same math reward), 8 prompts x 8
trajectories per step, up to 128 new tokens, one optimizer step per batch, no KL term:

  areal-hpc   `areal-hpc run` (asynchronous, max_staleness 2) with cluster.nodes=3: a vLLM generator
              and two Megatron trainer ranks (data parallel), one thread each, sharing both cores with
              the controller and the reward worker (training is about two thirds of the work here: with
              one core each, the generator's core would stand idle half the time). The proximal
              logprobs by ppo.prox_logp=loglinear: with one minibatch per step it gives exactly the
              recomputed ones (the first minibatch's prox is the current logprob) without the extra
              forward pass, and TRL with one iteration per batch makes none either.
  TRL         GRPOTrainer in this process on both cores: transformers generation, then training, in turn.

The two alternate for `--rounds` rounds (TRL, areal-hpc, TRL, areal-hpc, ...), so that a change in
the machine's load over the invocation falls on both (TRL's figure alone moved between 3.1 and 4.6
trajectories/s from one invocation to another here). Prints each run's trained trajectories per
second over the steps after `--warmup` (areal-hpc: from metrics.jsonl, trajectories / summed
timing/step_s; TRL: from the step-end times of a trainer callback), each round's ratio, each system's
median over the rounds, and the ratio of the medians last. Needs the `bench` extra (pip install -e .[bench]).

    python tools/bench_vs_trl.py                          # 2 rounds, 2 warm-up + 8 measured steps each run
    python tools/bench_vs_trl.py --rounds 3 --steps 6 --warmup 2
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
PROMPTS, GROUP, MAX_NEW = 8, 8, 128
TRAJECTORIES_PER_STEP = PROMPTS * GROUP
OVERRIDES = [
    "model.hidden_size=512",
    "model.intermediate_size=1280",
    "model.num_layers=8",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=2",
    "sft.examples=0",  # both start from the same random weights: every trajectory runs to the token limit
    f"rollout.prompts_per_step={PROMPTS}",
    f"rollout.group_size={GROUP}",
    f"rollout.max_new_tokens={MAX_NEW}",
    "rollout.max_concurrent=64",
    "rollout.max_staleness=2",
    "cluster.nodes=3",  # 1 generator + 2 trainer ranks (areal_hpc.layout.Layout.core_plan: one thread each, unpinned)
    "ppo.prox_logp=loglinear",
    "ppo.minibatches=1",
    "ppo.max_tokens_per_mb=4096",
    "logging.tensorboard=false",
    "train.rank_timeout_s=900",
]


def trajectories_per_s_from_metrics(rows: list[dict], warmup: int, trajectories_per_step: int) -> float:
    """Trained trajectories per second after the first `warmup` steps: trajectories / summed
    timing/step_s."""
    steady = [r for r in rows if r["step"] > warmup]
    if not steady:
        raise ValueError(f"no steps after the {warmup} warm-up steps")
    return trajectories_per_step * len(steady) / sum(r["timing/step_s"] for r in steady)


def trajectories_per_s_from_step_ends(ends: list[float], warmup: int, trajectories_per_step: int) -> float:
    """Trained trajectories per second from the end times of steps 1..n, counting the steps after
    `warmup` (timed from the end of the last warm-up step)."""
    if len(ends) <= warmup or warmup < 1:
        raise ValueError(f"need more than {warmup} (>= 1) step end times, got {len(ends)}")
    return trajectories_per_step * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])


def ratio(areal: float, trl: float) -> float:
    return areal / trl


# --- areal-hpc ---------------------------------------------------------------------------------


def bench_areal(root: Path, trial: str, steps: int, warmup: int, extra: list[str]) -> float:
    from areal_hpc.metrics import read_metrics

    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(CONFIG), "--fresh", f"experiment.root={root}"]
    cmd += [f"experiment.trial={trial}", f"train.total_steps={steps}", f"train.save_every={steps}", *OVERRIDES, *extra]
    log = root / f"{trial}.out"
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        sys.exit(f"areal-hpc run failed (exit {code}); its output: {log}")
    rows = read_metrics(root / "tiny-cpu" / trial)
    print(f"areal-hpc: {steps} steps in {time.monotonic() - t0:.0f} s (start-up included); output {log}", flush=True)
    for r in rows:
        print(
            f"  step {r['step']}: {r['timing/step_s']:.2f} s, idle gen {r['timing/gen_idle_frac']:.0%} "
            f"train {r['timing/train_idle_frac']:.0%}, staleness {r['staleness/max']}"
        )
    return trajectories_per_s_from_metrics(rows, warmup, TRAJECTORIES_PER_STEP)


# --- TRL ---------------------------------------------------------------------------------------


def bench_trl(cfg, model_dir: Path, out_dir: Path, steps: int, warmup: int) -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_hpc.reward.math import math_reward
    from areal_hpc.synthetic import synthetic_rows

    torch.set_num_threads(os.cpu_count() or 1)
    rows = synthetic_rows(cfg.data.synthetic_size, cfg.experiment.seed, max_operand=cfg.data.synthetic_max_operand)
    data = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def reward(completions, answer, **_):
        return [math_reward(c, a, cfg.reward.timeout_s) for c, a in zip(completions, answer, strict=True)]

    ends: list[float] = []
    gen_s: list[float] = []  # each generate call's seconds (one per step: the whole batch at once)
    plain_generate = model.generate

    def timed_generate(*args, **kwargs):  # GRPOTrainer calls the model's own generate (one CPU process)
        t = time.monotonic()
        out = plain_generate(*args, **kwargs)
        gen_s.append(time.monotonic() - t)
        return out

    model.generate = timed_generate

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.monotonic())

    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=TRAJECTORIES_PER_STEP,  # one generation batch = one optimizer step
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=MAX_NEW,
        max_steps=steps,
        learning_rate=cfg.ppo.lr,
        epsilon=cfg.ppo.eps_clip,
        beta=0.0,
        # TRL's GRPO default recomputes activations in the backward pass to save memory; a 21M model needs
        # none saved, and areal-hpc's trainer recomputes nothing: off, so both train at full speed.
        gradient_checkpointing=False,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=cfg.experiment.seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    t0 = time.monotonic()
    trainer.train()
    print(f"TRL: {steps} steps in {time.monotonic() - t0:.0f} s", flush=True)
    for i in range(len(ends)):
        step = ends[i] - (ends[i - 1] if i else t0)
        print(f"  step {i + 1}: {step:.2f} s, of which generation {gen_s[i]:.2f} s")
    steady = ends[-1] - ends[warmup - 1]
    print(f"TRL: generation {sum(gen_s[warmup:]) / steady:.0%} of the measured steps' time, training the rest")
    return trajectories_per_s_from_step_ends(ends, warmup, TRAJECTORIES_PER_STEP)


def main(argv: list[str] | None = None) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.sft import initial_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="steps of each system (warm-up included)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the figures")
    p.add_argument("--rounds", type=int, default=2, help="runs per system, alternating TRL and areal-hpc")
    p.add_argument("--root", default=None, help="run root (default: a temporary directory)")
    p.add_argument(
        "overrides", nargs="*", help="more areal-hpc settings (section.field=value), e.g. ppo.prox_logp=recompute"
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or not 1 <= args.warmup < args.steps:
        p.error(f"need --rounds >= 1 and 1 <= --warmup < --steps (got {args.rounds}, {args.warmup}, {args.steps})")
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-trl-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(CONFIG, [f"experiment.root={root}", *OVERRIDES])
    model_dir = initial_model(cfg)  # built once here; areal-hpc finds it cached under the same root
    import torch
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    print(
        f"model {model_dir} ({n_params / 1e6:.1f}M parameters, float32); {PROMPTS} prompts x {GROUP} "
        f"trajectories per step, up to {MAX_NEW} new tokens; torch {torch.__version__}"
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)", flush=True)
    trl, areal = [], []
    for k in range(1, args.rounds + 1):
        trl.append(bench_trl(cfg, model_dir, root / f"trl{k}", args.steps, args.warmup))
        areal.append(bench_areal(root, f"areal{k}", args.steps, args.warmup, args.overrides))
        print(
            f"round {k}: TRL {trl[-1]:.2f}, areal-hpc {areal[-1]:.2f} trained trajectories/s: "
            f"{ratio(areal[-1], trl[-1]):.2f}x"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    areal_s, trl_s = statistics.median(areal), statistics.median(trl)
    print(
        f"areal-hpc: {areal_s:.2f} trained trajectories/s "
        f"(median of {args.rounds}: {', '.join(f'{x:.2f}' for x in areal)})"
    )
    print(
        f"TRL GRPOTrainer: {trl_s:.2f} trained trajectories/s "
        f"(median of {args.rounds}: {', '.join(f'{x:.2f}' for x in trl)})"
    )
    print(f"areal-hpc/TRL trained trajectories per second: {ratio(areal_s, trl_s):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
