"""The evaluation between training steps (`eval.every_steps`): which eval prompts to send when, and what
their scored trajectories add up to, for the controller's metrics.

```
 the controller, after the WeightSync of version v (and at the start):
   start(v)     -> an eval GenerateRequest per eval prompt when a round is due (none while the last still runs)
 EvalTrajectory -> arrived (True: its prompt's last: the generator is done with that request);
                   its reward: the workflow's own when finite (scored at once), 0 when lost (the
                   workflow raised: a workflow error, not a reward error), else a reward worker's, against target(traj)
 RewardResult   -> scored; the round's last -> eval/* figures for the next step's metrics row
```

The bookkeeping is the package's `EvalRound`, as in `areal-hpc eval`.
"""

from __future__ import annotations

import logging

from areal_hpc.config import Config
from areal_hpc.data.dataset import Example, eval_path, load_prompts
from areal_hpc.eval import EvalRound
from areal_hpc.protocol import EvalTrajectory, GenerateRequest

log = logging.getLogger(__name__)


class TrainingEval:
    """Evaluation between training steps (`eval.every_steps`), on the run's own generators and reward
    workers: before the first step and after every `every_steps` steps, one eval request per eval prompt
    (K trajectories each) for the generators, which the controller sends right after the WeightSync of
    that version (they handle it first).

    They are not training data: their requests say so (`GenerateRequest.eval`) and their episodes come back
    as messages of their own (EvalTrajectory), so their trajectories and rewards come back here, never to
    the buffer; the staleness gate never counts them.
    A round still running when the next one is due is left to finish (the next one is skipped). Its
    figures (`eval/pass@1`, `eval/pass@k`, `eval/reward_mean`, `eval/episode_tokens_mean`, and
    `eval/version`, the version it started on: trajectories in flight across a weight update finish on the
    newer weights) go into the metrics row of the next step that ends.
    """

    def __init__(self, examples: list[Example], samples: int, every_steps: int):
        self.examples, self.samples, self.every_steps = examples, samples, every_steps
        self.round: EvalRound | None = None
        self.version = 0
        self.metrics: dict = {}

    @classmethod
    def from_config(cls, cfg: Config, tokenizer) -> TrainingEval:
        """The `eval` section's prompts (eval.data, read only when eval.every_steps is set)."""
        e = cfg.eval
        examples = load_prompts(cfg, tokenizer, eval_path(cfg), "eval.data") if e.every_steps else []
        return cls(examples, e.samples, e.every_steps)

    def start(self, version: int) -> list[GenerateRequest]:
        """The requests of a round of `version` when one is due; none when it is not, or while the last
        round is still running."""
        if not self.every_steps or version % self.every_steps:
            return []
        if self.round is not None:
            log.warning("evaluation of version %d still running: none of version %d", self.version, version)
            return []
        self.round, self.version = EvalRound(self.examples, self.samples), version
        return [GenerateRequest(i, e.prompt_ids, e.row, self.samples, eval=True) for i, e in enumerate(self.examples)]

    def arrived(self, traj: EvalTrajectory) -> bool:
        """Record an episode (its tokens, all sequences); True when it was the last of its prompt (its request
        is done)."""
        self.round.arrived(traj.prompt_index, traj.index, traj.num_tokens, traj.finish_reason == "length")
        return self.round.generated(traj.prompt_index)

    def target(self, traj: EvalTrajectory) -> str | list:
        """What the reward worker compares the trajectory against: its prompt's target."""
        return self.examples[traj.prompt_index].target

    def scored(self, traj: EvalTrajectory, reward: float, reason: str) -> None:
        self.round.scored(traj.prompt_index, traj.index, reward, reason)
        self._end_when_done()

    def lost(self, traj: EvalTrajectory) -> None:
        """A lost episode (its workflow raised): it scores 0, counted as a workflow error."""
        self.round.lost(traj.prompt_index, traj.index)
        self._end_when_done()

    def _end_when_done(self) -> None:
        if not self.round.done:
            return
        report = self.round.report()
        self.round = None
        self.metrics = {f"eval/pass@{k}": v for k, v in report["pass@k"].items()}
        self.metrics.update(
            {
                "eval/reward_mean": report["reward_mean"],
                "eval/episode_tokens_mean": report["episode_tokens"]["mean"],
                "eval/version": self.version,
            }
        )
        log.info("evaluation of version %d: %s", self.version, self.metrics)

    def take_metrics(self) -> dict:
        """The latest finished round's figures, once."""
        out, self.metrics = self.metrics, {}
        return out
