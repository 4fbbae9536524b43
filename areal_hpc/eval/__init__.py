"""How good a model is on held-out prompts: the unbiased pass@k, and one round's bookkeeping (`EvalRound`:
K trajectories to each prompt, scored, and what they add up to).

Two users share them: the command, `areal-hpc eval` (areal_hpc.eval.command: one model, a local engine),
and the evaluation between training steps (areal_hpc.eval.training: the run's own generators and reward
workers, driven by the controller). A trajectory is correct when its reward is 1 (math: the boxed answer
equals the reference; code: every test passes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.data.dataset import Example
from areal_hpc.metrics import length_summary


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n trajectories of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1 and its numerically stable product form):

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks(samples: int) -> list[int]:
    """k = 1, 2, 4, ... up to K, and K itself."""
    out = [1 << i for i in range(int(math.log2(samples)) + 1)]
    return out if out[-1] == samples else [*out, samples]


@dataclass
class EvalRound:
    """K trajectories to each of a list of prompts, scored; what they add up to (`report`)."""

    examples: list[Example]
    samples: int
    rewards: list[list[float | None]] = field(init=False)
    lengths: list[list[int | None]] = field(init=False)
    """Tokens of each trajectory (None until it has come back: a trajectory may have none)."""
    truncated: int = 0
    errors: int = 0
    """Trajectories scored 0 for a reward timeout or error."""
    workflow_errors: int = 0
    """Episodes lost (their workflow raised), scored 0."""

    def __post_init__(self):
        self.rewards = [[None] * self.samples for _ in self.examples]
        self.lengths = [[None] * self.samples for _ in self.examples]

    def arrived(self, prompt: int, index: int, length: int, truncated: bool) -> None:
        self.lengths[prompt][index] = length
        self.truncated += truncated

    def scored(self, prompt: int, index: int, reward: float, reason: str = "ok") -> None:
        self.rewards[prompt][index] = float(reward)
        self.errors += reason != "ok"

    def lost(self, prompt: int, index: int) -> None:
        """A lost episode: it scores 0, counted as a workflow error (never as a reward error)."""
        self.rewards[prompt][index] = 0.0
        self.workflow_errors += 1

    def generated(self, prompt: int) -> bool:
        """Every trajectory to the prompt has come back from the generator."""
        return all(n is not None for n in self.lengths[prompt])

    @property
    def done(self) -> bool:
        return all(r is not None for rs in self.rewards for r in rs)

    def report(self) -> dict:
        """pass@k, mean reward and `episode_tokens` (each episode's trained tokens, all its sequences);
        `per_prompt` has each prompt's correct count."""
        n = self.samples
        correct = [sum(r >= 1.0 for r in rs) for rs in self.rewards]
        return {
            "prompts": len(self.examples),
            "samples": n,
            "pass@k": {str(k): float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks(n)},
            "reward_mean": float(np.mean([r for rs in self.rewards for r in rs])),
            "episode_tokens": length_summary(self.lengths),
            "truncated_frac": self.truncated / (len(self.examples) * n),
            "reward_errors": self.errors,
            "workflow_errors": self.workflow_errors,
            "per_prompt": [
                {"where": e.where, "prompt": e.prompt, "correct": c, "tokens": self.lengths[i]}
                for i, (e, c) in enumerate(zip(self.examples, correct))
            ],
        }
