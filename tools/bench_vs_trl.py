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
  TRL         GRPOTrainer in this process on both cores: generation, then training, in turn, in each
              setting of TRL_SETTINGS that passes a check first (check_trl_setting: two steps at a large
              learning rate; the second step's answers must be likelier under the weights after the
              first step than before it, or the generator samples from stale weights): `padded`
              (transformers' generate), `paged` (transformers' continuous batching), `vllm` (a vLLM
              engine in this process, TRL's `vllm_mode="colocate"`). A setting that fails or does not
              follow is printed with why and not timed; the last line compares with the fastest of the rest.

The two alternate for `--rounds` rounds (each TRL setting, areal-hpc, each TRL setting, ...), so that a change in
the machine's load over the invocation falls on both (TRL's figure alone moved between 3.1 and 4.6
trajectories/s from one invocation to another here). Prints each run's trained trajectories per
second over the steps after `--warmup` (areal-hpc: from metrics.jsonl, trajectories / summed
timing/step_s; TRL: from the step-end times of a trainer callback), each round's ratio, each system's
median over the rounds, and the ratio of areal-hpc's median to the best TRL setting's last. Needs the
`bench` extra (pip install -e .[bench]).

    python tools/bench_vs_trl.py                          # 2 rounds, 2 warm-up + 8 measured steps each run
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


def bench_areal(root: Path, name: str, trial: str, steps: int, warmup: int, extra: list[str]) -> float:
    """`name`: the run's experiment.name (its directory under `root`)."""
    from areal_hpc.metrics import read_metrics

    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(CONFIG), "--fresh", f"experiment.root={root}"]
    cmd += [f"experiment.trial={trial}", f"train.total_steps={steps}", f"train.save_every={steps}", *OVERRIDES, *extra]
    log = root / f"{trial}.out"
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        sys.exit(f"areal-hpc run failed (exit {code}); its output: {log}")
    rows = read_metrics(root / name / trial)
    print(f"areal-hpc: {steps} steps in {time.monotonic() - t0:.0f} s (start-up included); output {log}", flush=True)
    for r in rows:
        print(
            f"  step {r['step']}: {r['timing/step_s']:.2f} s, idle gen {r['timing/gen_idle_frac']:.0%} "
            f"train {r['timing/train_idle_frac']:.0%}, staleness {r['staleness/max']}"
        )
    return trajectories_per_s_from_metrics(rows, warmup, TRAJECTORIES_PER_STEP)


# --- TRL ---------------------------------------------------------------------------------------

# GRPOConfig settings of each TRL generation path tried (the trainer's own model in every case but vllm,
# which loads the trained weights into a vLLM engine in this process before each generation).
TRL_SETTINGS = {
    "padded": {},  # transformers' generate on the left-padded batch (TRL's default)
    "paged": {"use_transformers_continuous_batching": True},  # transformers' continuous batching (paged KV cache)
    "vllm": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3},
}


VERDICTS = {
    "follows": "runs, and its generator follows the trained weights: timed",
    "stale": "its generator does not follow the trained weights: not counted",
    "unclear": "the check's step moved the weights too little to tell: not counted",
}


def weights_verdict(gain_per_answer: list[float]) -> str:
    """Whether a generator followed a training step, from the answers it sampled just after the step:
    each answer's log p_after(answer) - log p_before(answer) under the trained model after and before it.

    An answer sampled from the trained weights gains on average (the mean estimates KL(after || before)
    >= 0); one sampled from stale weights loses (-KL(before || after) <= 0). 'follows' or 'stale' when
    the mean is three standard errors from 0, 'unclear' otherwise (the step moved the weights too little)."""
    n = len(gain_per_answer)
    if n < 2:
        raise ValueError(f"need at least 2 answers, got {n}")
    mean = statistics.fmean(gain_per_answer)
    se = statistics.stdev(gain_per_answer) / n**0.5
    if mean > 3 * se:
        return "follows"
    if mean < -3 * se:
        return "stale"
    return "unclear"


def grpo_args(cfg, setting: str, out_dir: Path, steps: int, **changes):
    """TRL's GRPOConfig for one setting (TRL_SETTINGS), the benchmark's batch unless `changes` say else."""
    from trl import GRPOConfig

    args = dict(
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
    return GRPOConfig(**{**args, **TRL_SETTINGS[setting], **changes})


def check_trl_setting(cfg, model_dir: Path, out_dir: Path, setting: str) -> str:
    """'follows', 'stale' or 'unclear' (weights_verdict), or 'fails: <error>': two TRL steps of
    `setting` at a large learning rate on a reward that varies within each group (so the first step
    moves the weights), then the second step's answers scored under the weights before and after the first."""
    import copy
    import traceback
    import zlib

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from areal_hpc.synthetic import synthetic_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = copy.deepcopy(model).eval()  # a copy made before the trainer wraps the model's forward
    after = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers: list = []  # (prompt text, completion ids) of step 2

    def noise_reward(prompts, completions, completion_ids, trainer_state, **_):
        if trainer_state.global_step == 1:
            answers.extend(zip(prompts, completion_ids, strict=True))
        return [float(zlib.crc32(str(ids).encode()) % 2) for ids in completion_ids]

    class AfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                # a copy of the module would keep calling the trained one (accelerate wraps `forward`)
                after.load_state_dict(model.state_dict())

    rows = synthetic_rows(64, cfg.experiment.seed, cfg.data.synthetic_task, cfg.data.synthetic_max_operand)
    args = grpo_args(
        cfg,
        setting,
        out_dir,
        2,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=32,
        learning_rate=1e-2,
    )
    try:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=noise_reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[AfterStep1()],
        )
        trainer.train()
    except Exception as e:  # noqa: BLE001 - any failure means the setting does not run here; say which
        where = traceback.extract_tb(e.__traceback__)[-1]
        return (
            f"fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} ({where.filename}:{where.lineno})"
        )

    def logp(m, prompt: str, ids: list[int]) -> float:
        p = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logits = m(torch.tensor([p + ids])).logits[0, len(p) - 1 : -1]
        return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).sum().item()

    return weights_verdict([logp(after, p, ids) - logp(before, p, ids) for p, ids in answers if ids])


def check_apart(cfg, model_dir: Path, out_dir: Path, setting: str) -> str:
    """check_trl_setting in a process of its own: what a setting leaves behind (a vLLM engine and its
    threads and KV cache, after a failed weight sync) must not weigh on the timed runs; a crash is a verdict."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(check_trl_setting, cfg, model_dir, out_dir, setting).result()
        except BrokenProcessPool:
            return "fails: the check's process died"


def bench_trl(cfg, model_dir: Path, out_dir: Path, steps: int, warmup: int, setting: str = "padded") -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from areal_hpc.reward.math import math_reward
    from areal_hpc.synthetic import synthetic_rows

    torch.set_num_threads(os.cpu_count() or 1)
    rows = synthetic_rows(
        cfg.data.synthetic_size, cfg.experiment.seed, cfg.data.synthetic_task, cfg.data.synthetic_max_operand
    )
    data = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def reward(completions, answer, **_):
        return [math_reward(c, a, cfg.reward.timeout_s) for c, a in zip(completions, answer, strict=True)]

    ends: list[float] = []
    gen_s: list[float] = []  # each generation's seconds (one per step: the whole batch at once)

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.monotonic())

    args = grpo_args(cfg, setting, out_dir, steps)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    generate = trainer._generate_single_turn  # TRL's one generation call of every setting (private)

    def timed_generate(*args, **kwargs):
        t = time.monotonic()
        out = generate(*args, **kwargs)
        gen_s.append(time.monotonic() - t)
        return out

    trainer._generate_single_turn = timed_generate
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
    counted = []
    for setting in args.trl:
        verdict = check_apart(cfg, model_dir, root / f"check-{setting}", setting)
        print(f"TRL {setting}: {VERDICTS.get(verdict) or 'does not run here: ' + verdict.removeprefix('fails: ')}")
        if verdict == "follows":
            counted.append(setting)
    if not counted:
        sys.exit("no TRL setting runs here with a generator that follows the trained weights")
    run_name = load_config(CONFIG, [*OVERRIDES, *args.overrides]).experiment.name
    trl: dict[str, list[float]] = {s: [] for s in counted}
    areal: list[float] = []
    for k in range(1, args.rounds + 1):
        for setting in counted:
            trl[setting].append(bench_trl(cfg, model_dir, root / f"trl-{setting}{k}", args.steps, args.warmup, setting))
        areal.append(bench_areal(root, run_name, f"areal{k}", args.steps, args.warmup, args.overrides))
        each = ", ".join(f"TRL {s} {v[-1]:.2f}" for s, v in trl.items())
        print(f"round {k}: {each}, areal-hpc {areal[-1]:.2f} trained trajectories/s")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    medians = {s: statistics.median(v) for s, v in trl.items()}
    for setting, v in trl.items():
        print(
            f"TRL {setting}: {medians[setting]:.2f} trained trajectories/s "
            f"(median of {args.rounds}: {', '.join(f'{x:.2f}' for x in v)})"
        )
    areal_s = statistics.median(areal)
    print(
        f"areal-hpc: {areal_s:.2f} trained trajectories/s "
        f"(median of {args.rounds}: {', '.join(f'{x:.2f}' for x in areal)})"
    )
    best = max(medians, key=medians.get)
    print(
        f"areal-hpc/TRL {best} (the best TRL setting here) trained trajectories per second: {ratio(areal_s, medians[best]):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
