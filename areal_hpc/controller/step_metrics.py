"""The metrics row of each training step (areal_hpc.metrics names them), and the clocks behind its timings.

A step's time runs from the end of the previous one; the first step's from the first trajectory, not from
the start of the engines (minutes on a large model, and no step's doing). The idle clocks are marked by
the controller's parts (the generators' by the dispatch, the trainers' by `Trainers`) and read here.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from areal_hpc.checkpoint.files import checkpoint_version
from areal_hpc.config import Config
from areal_hpc.controller.batch import BatchInfo
from areal_hpc.metrics import IdleClock, MetricsWriter, drop_rows_after, length_summary
from areal_hpc.protocol import Trajectory

LENGTH_WINDOW_STEPS = 10
"""rollout/generated_tokens_p90 and rollout/trained_tokens_p90 are over this many steps' worth of episodes
(prompts_per_step x group_size each): a step's own batch is a few prompt groups, whose answers' lengths go
together, too few to compare two p90s by."""


def p90(lengths) -> float:
    """The 90th percentile of a window of answer lengths, 0 before the first."""
    return length_summary(lengths)["p90"] if lengths else 0.0


ARRIVAL_COUNTS = ("rollout/workflow_errors", "rollout/tool_errors", "rollout/template_rewrites")
"""Counted over the training episodes as they arrive, since the last row (like reward/errors): episodes lost
(their workflow raised), tool calls that failed or timed out, messages whose tokens came from a chat
template that rewrites earlier turns."""


class StepMetrics:
    def __init__(self, run_dir: str | Path, cfg: Config, resume_from: Path | None, generators: int):
        if resume_from is not None:  # steps after the checkpoint run again: their old lines go
            drop_rows_after(Path(run_dir) / "metrics.jsonl", checkpoint_version(resume_from))
        self.writer = MetricsWriter(run_dir, cfg.logging.tensorboard, wandb=cfg if cfg.logging.wandb else None)
        self.gen_idle = IdleClock(generators)
        self.train_idle = IdleClock(1)
        self.reward_errors = 0
        """Training trajectories scored 0 for a reward timeout or error since the last row."""
        self.episode_counts = dict.fromkeys(ARRIVAL_COUNTS, 0)
        """ARRIVAL_COUNTS over the training episodes arrived since the last row."""
        window = LENGTH_WINDOW_STEPS * cfg.rollout.prompts_per_step * cfg.rollout.group_size
        self.generated_tokens: deque[int] = deque(maxlen=window)
        """Tokens sampled in each of the last training episodes to arrive (not lost), trained or not."""
        self.trained_tokens: deque[int] = deque(maxlen=window)
        """Tokens sampled in each of the last episodes trained."""
        self._step_start = time.monotonic()
        self._generating = False

    def generating(self) -> None:
        """A trajectory to train on came back: the first one starts the first step's clock."""
        if self._generating:
            return
        self._generating = True
        self._step_start = time.monotonic()
        self.gen_idle.take_fraction()
        self.train_idle.take_fraction()

    def arrived(self, traj: Trajectory) -> None:
        """Count a training episode as it arrives (lost or not: `rollout/workflow_errors` counts the lost)."""
        c = self.episode_counts
        c["rollout/workflow_errors"] += bool(traj.error)
        c["rollout/tool_errors"] += int(traj.stats.get("tool_errors", 0))
        c["rollout/template_rewrites"] += int(traj.stats.get("template_rewrites", 0))
        if not traj.error:
            self.generated_tokens.append(int(traj.loss_mask.sum()))

    def write(
        self,
        version: int,
        info: BatchInfo,
        stats: dict,
        *,
        rollouts: dict,
        sync_s: float,
        drain_s: float,
        sync_bytes: int,
        save_s: float,
        evals: dict,
    ) -> None:
        """The row of the step that made `version`: `info` of its data, the trainer's `stats`, the
        rollouts' and the evaluation's figures and the episodes' counts since the last row, the latest
        weight sync's load, drain and bytes, and the trainers' time in saves."""
        now = time.monotonic()
        step_s, self._step_start = now - self._step_start, now
        self.trained_tokens.extend(info.answer_lengths)
        row = {
            "reward/mean": info.reward_mean,
            **rollouts,  # staleness/max, staleness/dropped, staleness/wait_s, rollout/filtered, rollout/lost_groups
            "reward/errors": self.reward_errors,
            "rollout/truncated": info.truncated,
            "rollout/turns_mean": info.turns_mean,
            "rollout/tool_calls_mean": info.tool_calls_mean,
            "rollout/tool_s_mean": info.tool_s_mean,
            "rollout/episode_tokens_mean": info.episode_tokens_mean,
            "rollout/resumed_tokens": info.resumed_tokens,
            **{f"rollout/answer_tokens_{k}": v for k, v in info.answer_tokens.items()},
            "rollout/generated_tokens_p90": p90(self.generated_tokens),
            "rollout/trained_tokens_p90": p90(self.trained_tokens),
            **self.episode_counts,
            "throughput/effective_tokens_per_s": info.response_tokens / max(step_s, 1e-9),
            "timing/step_s": step_s,
            "timing/weight_sync_s": sync_s,
            "timing/sync_drain_s": drain_s,
            "timing/weight_sync_bytes": float(sync_bytes),
            "timing/gen_idle_frac": self.gen_idle.take_fraction(),
            "timing/train_idle_frac": self.train_idle.take_fraction(),
            "timing/save_s": save_s,
            **{k: float(v) for k, v in stats.items()},
            **evals,
        }
        self.reward_errors = 0
        self.episode_counts = dict.fromkeys(ARRIVAL_COUNTS, 0)
        self.writer.write(version, row)

    def close(self) -> None:
        self.writer.close()
