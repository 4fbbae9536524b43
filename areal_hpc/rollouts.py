"""The controller's prompt groups from admission to the trainer, and the staleness gate that counts them.

A group is one prompt and its `n` trajectories (the GRPO group). `Rollouts` is the one owner of the
groups and of the gate's counters over them (the controller asks it, never the gate):

```
 prompts.next() --admit, while the gate has room (gate.admit)--> running[group_id]
 requeued: prompts of the groups running at the restored checkpoint --admit first (the gate counts them)--^
 running   each trajectory as it comes back from a generator (add_trajectory), each reward (add_reward)
   the last reward in --gate.finish(accepted=True)---> buffer, by group id: oldest first
                      --gate.finish(accepted=False)--> left out (rollout.filter_uniform_groups: every
                                                       reward equal, the group teaches nothing): its slot
                                                       admits another prompt
 buffer --take_batch (gate.consume): stale groups dropped, then the oldest B--> the step's groups
```

The buffer is ordered by admission (group id), so a step trains the oldest groups first: those most at
risk of going stale. The gate's rules are areal_hpc.algo.staleness's; the version it reads is the
controller's, injected (`from_config`).

Pure bookkeeping over numpy arrays, no MPI: the controller drives it, tests drive it directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from areal_hpc.algo.staleness import StalenessGate, oldest_version
from areal_hpc.data import Example
from areal_hpc.protocol import Trajectory

log = logging.getLogger(__name__)

FILTERED_WARN_STEPS = 10
"""With rollout.filter_uniform_groups, the log warns each time this many steps' worth of groups
(`prompts_per_step` each) has been left out at one policy version: when every prompt's trajectories
are all right or all wrong, no step comes, and the run must not look busy without a word."""
RENAMED = {"sample_idx": "index"}
"""Trajectory fields under the names older controller checkpoints saved them with -> their names now."""
REMOVED = "prompt_ids"
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
                Trajectory(**{RENAMED.get(k, k): v for k, v in t.items() if k != REMOVED}) for t in s["trajectories"]
            ],
            rewards=list(s["rewards"]),
        )


class Rollouts:
    """Groups in flight (`running`, by group id), finished groups (`buffer`, oldest first), and the
    staleness gate's counters over them (`gate`)."""

    def __init__(self, gate: StalenessGate, group_size: int, filter_uniform: bool = False):
        self.gate = gate
        self.group_size, self.filter_uniform = group_size, filter_uniform
        self.running: dict[int, Group] = {}
        self.buffer: list[Group] = []
        self.requeued: list[Example] = []
        """Prompts of the groups running at the restored checkpoint: the gate counts them as running already."""
        self.next_group_id = 0
        self.filtered = 0
        """Groups left out by rollout.filter_uniform_groups since the last `take_metrics`."""

    @classmethod
    def from_config(cls, rollout, version: Callable[[], int]) -> Rollouts:
        """From the `rollout` config section; `version()` is the policy version (the controller's)."""
        gate = StalenessGate.from_config(rollout, version)
        return cls(gate, rollout.group_size, rollout.filter_uniform_groups)

    def admit(self, prompts) -> list[Group]:
        """The groups to start now, running from here: the requeued ones first (already counted), then one
        for each next prompt of `prompts` while the gate has room."""
        started = []
        while self.requeued or self.gate.can_admit():
            if self.requeued:
                example = self.requeued.pop(0)
            else:
                example = prompts.next()
                self.gate.admit()
            group = Group(self.next_group_id, example, self.group_size)
            self.next_group_id += 1
            self.running[group.group_id] = group
            started.append(group)
        return started

    def add_trajectory(self, traj: Trajectory) -> Group:
        group = self.running[traj.group_id]
        if group.trajectories[traj.index] is not None:
            raise RuntimeError(f"group {traj.group_id} trajectory {traj.index} arrived twice")
        group.trajectories[traj.index] = traj
        return group

    def add_reward(self, group_id: int, index: int, reward: float) -> None:
        """Record a reward. The group's last one finishes it: into the buffer, in admission order (a late
        group goes before younger ones); or, with `rollout.filter_uniform_groups`, a group whose
        trajectories all got the same reward is left out: it finishes unaccepted, which frees its
        admission slot (the gate's `finish(accepted=False)`, as a stale drop does), so another prompt
        takes its place."""
        group = self.running[group_id]
        group.rewards[index] = float(reward)
        if not group.complete:
            return
        del self.running[group_id]
        if self.filter_uniform and group.uniform:
            self.gate.finish(accepted=False)
            self.filtered += 1
            if self.filtered % (FILTERED_WARN_STEPS * self.gate.prompts_per_step) == 0:
                log.warning(
                    "%d prompt groups left out at policy version %d: each one's trajectories all got the same reward "
                    "(rollout.filter_uniform_groups); if no step comes, the prompts are too easy or too hard "
                    "for the model: change data.train_path or set rollout.filter_uniform_groups=false",
                    self.filtered,
                    self.gate.version(),
                )
            return
        self.buffer.append(group)
        self.buffer.sort(key=lambda g: g.group_id)
        self.gate.finish(accepted=True)

    def take_batch(self) -> list[Group]:
        """The step's B groups, oldest first, or [] while fewer than B fresh ones are buffered; stale groups
        are dropped first (counted, their slots freed: `StalenessGate.consume`)."""
        taken = self.gate.consume(self.buffer)
        self.buffer = taken.buffered
        return taken.consumed

    def take_metrics(self) -> dict:
        """staleness/max, staleness/dropped and rollout/filtered since the last call; starts anew."""
        row = {**self.gate.take_metrics(), "rollout/filtered": self.filtered}
        self.filtered = 0
        return row

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The gate's counters, the buffered groups, and the prompts of the running ones (generated again
        after a restore: still counted as running, they finish as usual)."""
        running = sorted(self.running.values(), key=lambda g: g.group_id)
        return {
            "gate": self.gate.state_dict(),
            "requeued": [g.example for g in running] + list(self.requeued),
            "buffer": [g.to_state() for g in self.buffer],
            "next_group_id": self.next_group_id,
        }

    def load_state_dict(self, state: dict) -> None:
        self.gate.load_state_dict(state["gate"])
        self.requeued = list(state["requeued"])
        self.buffer = [Group.from_state(g) for g in state["buffer"]]
        self.next_group_id = state["next_group_id"]
