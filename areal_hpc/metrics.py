"""Per-step metrics: one line of `metrics.jsonl` and TensorBoard scalars, with the names of docs/design.md
(The run directory and metrics), and the idle-time clocks behind `timing/gen_idle_frac` and
`timing/train_idle_frac`.

Names (one per concept): reward/mean, staleness/max, staleness/dropped (trajectories dropped as too
stale since the previous step), staleness/wait_s (seconds the staleness schedule held a step back for a
running group since the previous step: areal_hpc.algo.staleness), throughput/effective_tokens_per_s, timing/step_s,
timing/weight_sync_s (the latest completed sync: the slowest generator's load), timing/sync_drain_s (its
slowest generator's wait for its turns in flight to finish first, rollout.interruptible false),
timing/weight_sync_bytes (what that sync brought a generator: the whole model, or with LoRA the adapters), timing/gen_idle_frac,
timing/train_idle_frac, timing/save_s (the trainers' time in checkpoint saves since the previous step),
the trainer's ppo/* statistics (ppo/entropy: the mean over trained tokens of the entropy of the
policy's next-token distribution; ppo/kl with ppo.kl_coef > 0: the mean k3 estimate of the KL to the
initial policy; with a mixture-of-experts model ppo/load_balancing_loss and, with ppo.routing_replay,
ppo/routing_agreement: areal_hpc.trainer.moe), with distill.teacher distill/reverse_kl and timing/teacher_s
(areal_hpc.trainer.step), memory/peak_gib (GPU only: trainer rank 0's peak of allocated GPU memory since it
started), reward/errors (rewards scored 0 for a timeout or an error since the
previous step), rollout/filtered (prompt groups left out by rollout.filter_uniform_groups since the
previous step), rollout/truncated (episodes of the step cut at a token limit), the episode figures
(rollout/turns_mean, rollout/tool_calls_mean, rollout/tool_s_mean, rollout/episode_tokens_mean: means over
the step's episodes; rollout/answer_tokens_mean, _median, _p90, _max: the tokens sampled in each of the step's
episodes, all its turns; rollout/generated_tokens_p90 and rollout/trained_tokens_p90: the p90 of the
same over the last ten steps' worth of training episodes generated (trained or not; 0 before any came)
and trained, which differ when staleness drops long answers; rollout/workflow_errors, rollout/tool_errors, rollout/template_rewrites,
rollout/lost_groups: counts since the previous step; rollout/resumed_tokens: the step's sampled tokens carried
over from before the checkpoint the run resumed from, areal_hpc.generator.resume; areal_hpc.controller.step_metrics), and after an
evaluation between steps eval/pass@1 ... (areal_hpc.eval.training). Each line also has `step`, the policy
version after the step.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from areal_hpc.config.schema import Config
from areal_hpc.jsonl import read_jsonl

REQUIRED = (
    "reward/mean",
    "staleness/max",
    "staleness/dropped",
    "throughput/effective_tokens_per_s",
    "timing/step_s",
    "timing/weight_sync_s",
    "timing/gen_idle_frac",
    "timing/train_idle_frac",
)


class MetricsWriter:
    """Appends one JSON line per step (flushed at once, so `tail -f` and the launcher see it), mirrors
    every numeric value as a TensorBoard scalar and, given `wandb` (the run's config, `logging.wandb`
    on), logs the whole row to W&B (areal_hpc.wandb_log)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: Config | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        if wandb is not None:  # first: a W&B that cannot start stops the run before anything is written
            from areal_hpc.wandb_log import WandbLog

            self._wandb = WandbLog(wandb, run_dir)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl in step order (a torn line skipped)."""
    rows = [row for *_, row in read_jsonl(Path(run_dir) / "metrics.jsonl", torn_ok=True)]
    return sorted(rows, key=lambda r: r["step"])


def drop_rows_after(path: Path, version: int) -> None:
    """Cut metrics.jsonl after the line of step `version` (in place: writers append to the same file): a resumed
    run trains the steps after its checkpoint again and writes their lines anew."""
    if not path.exists():
        return
    offset = 0  # the end of the last row kept: a torn last line goes too
    for _, end, row in read_jsonl(path, torn_ok=True):
        if not isinstance(row, dict) or row.get("step", version + 1) > version:
            break  # a later step, or a row that is not one: cut here
        offset = end
    os.truncate(path, offset)


def length_summary(lengths) -> dict:
    """Mean, median, 90th percentile and maximum of token counts (a run's answers, an evaluation's episodes)."""
    import numpy as np

    x = np.asarray(lengths, np.float64).ravel()
    return {
        "mean": float(x.mean()),
        "median": float(np.median(x)),
        "p90": float(np.percentile(x, 90)),
        "max": int(x.max()),
    }


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    return float(v) if isinstance(v, float) else v


def progress_line(row: dict, total_steps: int) -> str:
    """'step 12/100  reward 0.41  staleness 1 (0 dropped, waited 0.2 s)  820 tok/s  step 1.9 s  sync 0.12 s'"""
    return (
        f"step {row['step']}/{total_steps}  reward {row['reward/mean']:.3f}  "
        f"staleness {row['staleness/max']} ({row['staleness/dropped']} dropped, "
        f"waited {row.get('staleness/wait_s', 0.0):.1f} s)  "
        f"{row['throughput/effective_tokens_per_s']:.0f} tok/s  step {row['timing/step_s']:.2f} s  "
        f"sync {row['timing/weight_sync_s']:.2f} s  idle gen {row['timing/gen_idle_frac']:.0%} "
        f"train {row['timing/train_idle_frac']:.0%}"
    )


class IdleClock:
    """Time a set of workers spent with nothing to do, as a fraction of a window.

    `busy(i, flag)` marks worker i busy or idle from now on; `take_fraction()` returns the mean idle
    fraction over the workers since the previous call and starts a new window:

        idle_frac = (1 / n) * sum_i idle_time_i / window
    """

    def __init__(self, n: int, now=time.monotonic):
        self.now = now
        self.n = n
        self._busy = [False] * n
        self._idle = [0.0] * n
        self._since = [now()] * n
        self._window_start = now()

    def busy(self, i: int, flag: bool) -> None:
        if flag == self._busy[i]:
            return
        t = self.now()
        if not self._busy[i]:
            self._idle[i] += t - self._since[i]
        self._busy[i], self._since[i] = flag, t

    def take_fraction(self) -> float:
        t = self.now()
        window = t - self._window_start
        total = 0.0
        for i in range(self.n):
            idle = self._idle[i] + (0.0 if self._busy[i] else t - self._since[i])
            total += idle
            self._idle[i], self._since[i] = 0.0, t
        self._window_start = t
        return 0.0 if window <= 0 else min(1.0, total / (self.n * window))
