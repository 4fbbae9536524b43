"""TRL's side of tools/bench_vs_trl.py: its GRPOTrainer in each setting of TRL_SETTINGS (padded, paged,
vllm), the check that a setting's generator follows the trained weights (check_trl_setting, in a process
of its own: check_apart), and a timed run (bench_trl). Needs the `bench` extra (trl, transformers,
datasets), imported where used.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from tools.bench_vs_trl_summary import Run

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


def trajectories_per_s_from_step_ends(ends: list[float], warmup: int, trajectories_per_step: int) -> float:
    """Trained trajectories per second from the end times of steps 1..n, counting the steps after
    `warmup` (timed from the end of the last warm-up step)."""
    if len(ends) <= warmup or warmup < 1:
        raise ValueError(f"need more than {warmup} (>= 1) step end times, got {len(ends)}")
    return trajectories_per_step * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])
