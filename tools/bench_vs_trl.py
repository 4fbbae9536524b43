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
sys.path.insert(0, str(REPO))
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


def trajectories_per_s_from_metrics(rows: list[dict], warmup: int, trajectories_per_step: int) -> float:
    """Trained trajectories per second after the first `warmup` steps: trajectories / summed
    timing/step_s."""
    from tools.bench_figures import steady_rows

    steady = steady_rows(rows, warmup)
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

    from tools.bench_figures import trajectories_per_step

    args = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=trajectories_per_step(cfg),  # one generation batch = one optimizer step
        gradient_accumulation_steps=1,
        num_generations=cfg.rollout.group_size,
        max_completion_length=cfg.rollout.max_new_tokens,
        max_steps=steps,
        learning_rate=cfg.ppo.lr,
        epsilon=cfg.ppo.eps_clip,
        beta=0.0,
        # TRL's GRPO default recomputes activations in the backward pass to save memory; a tiny model needs
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

    from areal_hpc.data.synthetic import synthetic_rows

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


def bench_trl(cfg, model_dir: Path, out_dir: Path, steps: int, warmup: int, setting: str) -> tuple[Run, list[int]]:
    """One TRL run of `setting`; also the lengths of its answers after the warm-up (for the pooled length row)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from areal_hpc.data.synthetic import synthetic_rows
    from areal_hpc.metrics import length_summary
    from areal_hpc.reward.math import math_reward
    from tools.bench_figures import trajectories_per_step

    torch.set_num_threads(os.cpu_count() or 1)
    rows = synthetic_rows(
        cfg.data.synthetic_size, cfg.experiment.seed, cfg.data.synthetic_task, cfg.data.synthetic_max_operand
    )
    data = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lengths: list[list[int]] = []  # each step's answers' lengths (sampled tokens, the end of text included)

    def reward(completions, answer, completion_ids, **_):
        lengths.append([len(ids) for ids in completion_ids])  # one call a step: the whole batch
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
    print(f"TRL {setting}: {steps} steps in {time.monotonic() - t0:.0f} s", flush=True)
    for i in range(len(ends)):
        step = ends[i] - (ends[i - 1] if i else t0)
        print(
            f"  step {i + 1}: {step:.2f} s, of which generation {gen_s[i]:.2f} s; "
            f"answers mean {statistics.fmean(lengths[i]):.0f} max {max(lengths[i])}"
        )
    generating = sum(gen_s[warmup:]) / (ends[-1] - ends[warmup - 1])
    print(f"TRL {setting}: generation {generating:.0%} of the measured steps' time, training the rest")
    steady = [n for step in lengths[warmup:] for n in step]
    rate = trajectories_per_s_from_step_ends(ends, warmup, trajectories_per_step(cfg))
    return Run(rate, length_summary(steady), generating, 1 - generating), steady


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


def median_of(runs: list[Run], key: str) -> str:
    """'6.10 (median of 2: 6.02, 6.18)' of a Run property over the rounds."""
    v = [getattr(r, key) for r in runs]
    return f"{statistics.median(v):.2f} (median of {len(v)}: {', '.join(f'{x:.2f}' for x in v)})"


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


if __name__ == "__main__":
    sys.exit(main())
