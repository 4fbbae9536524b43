"""The controller's rollouts: prompt groups in flight, and the buffer of finished groups, oldest first.

A group is one prompt and its `n` trajectories (the GRPO group). It lives in `running` from admission
until every trajectory has come back from a generator and been scored by a reward worker; then it moves
to the buffer, where it waits to be trained on. The buffer is ordered by admission (group id), so
the staleness gate's `consume` gives the trainer the oldest groups first: those most at risk of
going stale.

Pure bookkeeping over numpy arrays, no MPI: the controller drives it, tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from areal_hpc.algo.staleness import oldest_version
from areal_hpc.data import Example
from areal_hpc.protocol import Trajectory

RENAMED = {"sample_idx": "index"}
"""Trajectory fields under the names older controller checkpoints saved them with -> their names now."""
DROPPED = "prompt_ids"
"""What older controller checkpoints saved in each group and each trajectory besides its Example's own copy
(the prompt's token ids): read and left out."""


@dataclass
class Group:
    group_id: int
    example: Example
    """The prompt of the data set, its token ids (`prompt_ids`, the one copy the controller holds) and its
    target (the reward's); saved in checkpoints."""
    n: int
    trajectories: list = field(default_factory=list)
    """Trajectory by index (None until it arrives)."""
    rewards: list = field(default_factory=list)
    """Reward by index (None until scored)."""

    def __post_init__(self):
        if not self.trajectories:
            self.trajectories = [None] * self.n
        if not self.rewards:
            self.rewards = [None] * self.n

    @property
    def generated(self) -> bool:
        """Every trajectory has come back from the generator."""
        return all(t is not None for t in self.trajectories)

    @property
    def complete(self) -> bool:
        """Every trajectory is back and scored."""
        return self.generated and all(r is not None for r in self.rewards)

    @cached_property
    def oldest_version(self) -> int | None:
        """Oldest generated-token version over the trajectories (read once the group is complete)."""
        return oldest_version(t.versions for t in self.trajectories if t is not None)

    @property
    def uniform(self) -> bool:
        """Every trajectory got the same reward: every GRPO advantage is 0, the group teaches nothing."""
        return len(set(self.rewards)) == 1

    @property
    def response_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.trajectories if t is not None)

    def to_state(self) -> dict:
        """Plain data (numpy arrays inside) for the controller checkpoint."""
        return {
            "group_id": self.group_id,
            "example": self.example,
            "n": self.n,
            "rewards": list(self.rewards),
            "trajectories": [vars(t).copy() for t in self.trajectories],
        }

    @classmethod
    def from_state(cls, s: dict) -> Group:
        return cls(
            group_id=s["group_id"],
            example=s["example"],
            n=s["n"],
            trajectories=[
                Trajectory(**{RENAMED.get(k, k): v for k, v in t.items() if k != DROPPED}) for t in s["trajectories"]
            ],
            rewards=list(s["rewards"]),
        )


class Rollouts:
    """Groups in flight (`running`, by group id) and finished groups (`buffer`, oldest first)."""

    def __init__(self):
        self.running: dict[int, Group] = {}
        self.buffer: list[Group] = []

    def start(self, group: Group) -> None:
        self.running[group.group_id] = group

    def add_trajectory(self, traj: Trajectory) -> Group:
        group = self.running[traj.group_id]
        if group.trajectories[traj.index] is not None:
            raise RuntimeError(f"group {traj.group_id} trajectory {traj.index} arrived twice")
        group.trajectories[traj.index] = traj
        return group

    def add_reward(self, group_id: int, index: int, reward: float) -> Group | None:
        """Record a reward; returns the group if that completed it (no longer running: `accept` it
        into the buffer, or leave it out)."""
        group = self.running[group_id]
        group.rewards[index] = float(reward)
        if not group.complete:
            return None
        del self.running[group_id]
        return group

    def accept(self, group: Group) -> None:
        """A completed group into the buffer, in admission order (a late group goes before younger ones)."""
        self.buffer.append(group)
        self.buffer.sort(key=lambda g: g.group_id)
