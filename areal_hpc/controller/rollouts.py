"""The controller's prompt groups from admission to the trainer, and the staleness gate that counts them.

A group is one prompt and its `n` episodes (the GRPO group; each episode a `Trajectory`). `Rollouts` is
the one owner of the groups and of the gate's counters over them (the controller asks it, never the gate):

```
 prompts.next() --admit, while the gate has room (gate.admit)--> running[group_id]
 carried: the groups running at the restored checkpoint, with what they had generated --admit first--^
          (the gate counts them already; their requests carry the answers in flight: load_state_dict)
 running   each episode as it comes back from a generator (add_trajectory), each reward (add_reward);
           a lost episode (its workflow raised: `Trajectory.error`) gets no reward and drops out
   the last one in --gate.finish(accepted=True)---> buffer, by group id: oldest first
                   --gate.finish(accepted=False)--> left out (rollout.filter_uniform_groups: every
                                                    reward equal, the group teaches nothing; or every
                                                    episode lost): its slot admits another prompt
 buffer --take_batch (gate.consume): stale groups dropped, then the oldest B, unless the schedule
        waits for a running group that would be too old after this step--> the step's groups
```

The buffer is ordered by admission (group id, and so by the version at admission, `Group.admitted`), so
a step trains the oldest groups first: those most at risk of going stale. The gate's rules are
areal_hpc.algo.staleness's; the version it reads is the controller's, injected (`from_config`). The time
a step waits on the schedule is `staleness/wait_s`.

Pure bookkeeping over numpy arrays, no MPI: the controller drives it, tests drive it directly.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from areal_hpc.algo.staleness import StalenessGate, oldest_version
from areal_hpc.checkpoint.in_flight import sampled_tokens
from areal_hpc.data.dataset import Example
from areal_hpc.protocol import EPISODE_STATS, Trajectory

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
RAISED_CHARS = 300
"""The most of a lost episode's exception that EpisodesLost's first line (the console's) shows: a
validation error's message runs to many lines; all of it is in the traceback below."""
_GROUP_PREFIX = re.compile(r"^ *\| ?")
_GROUP_RULE = re.compile(r"^ *\+[-+ ]")


class EpisodesLost(RuntimeError):
    """More than half of a step's worth of episodes were lost: the workflow is broken, the run stops."""


def raised(traceback: str) -> str:
    """What a formatted traceback says was raised, on one line of at most RAISED_CHARS: the exception's
    lines after its last frame (`ValueError: ...`, a message of several lines joined), else its last line.
    EpisodesLost's first line carries it: the console shows that line only (areal_hpc.main), and a user
    should learn what went wrong there, not only which log to open."""
    # An exception group (asyncio.TaskGroup's) draws its sub-exceptions' tracebacks inside a frame of
    # "  | " prefixes and "+---" rules: without them, the last frame is the innermost exception's.
    lines = [_GROUP_PREFIX.sub("", line) for line in traceback.strip().splitlines() if not _GROUP_RULE.match(line)]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else len(lines) - 1
    while start < len(lines) - 1 and lines[start].startswith("    "):  # the frame's source line and its ^^^
        start += 1
    text = " ".join(line.strip() for line in lines[start:])
    return text if len(text) <= RAISED_CHARS else text[: RAISED_CHARS - 3] + "..."


def single_turn(group_id: int, index: int, prompt_ids, output_ids, behav_logprobs, versions, finish_reason: str):
    """The episode of one prompt and one sampled answer (what controller checkpoints written before
    episodes held as `output_ids` beside their Example's prompt)."""
    p, r = len(prompt_ids), len(output_ids)
    return Trajectory(
        group_id,
        index,
        tokens=np.concatenate([prompt_ids, output_ids]).astype(np.int32),
        seq_lens=np.array([p + r], np.int32),
        loss_mask=np.concatenate([np.zeros(p, np.uint8), np.ones(r, np.uint8)]),
        behav_logprobs=np.concatenate([np.zeros(p, np.float32), np.asarray(behav_logprobs, np.float32)]),
        versions=np.concatenate([np.full(p, -1, np.int32), np.asarray(versions, np.int32)]),
        answer_ids=np.asarray(output_ids, np.int32),
        finish_reason=finish_reason,
        stats={**dict.fromkeys(EPISODE_STATS, 0), "turns": 1},
    )


@dataclass
class Group:
    group_id: int
    example: Example
    """The prompt of the data set, its token ids (`prompt_ids`, the one copy the controller holds) and its
    target (the reward's); saved in checkpoints."""
    n: int
    trajectories: list = field(default_factory=list)
    """Episode (Trajectory) by index (None until it arrives)."""
    rewards: list = field(default_factory=list)
    """Reward by index (None until scored, and for ever for a lost episode)."""
    admitted: int = 0
    """The policy version when it was admitted (or requeued after a restore): its tokens are that
    version's or later ones; its key in the staleness schedule."""
    resume: dict = field(default_factory=dict)
    """Index -> the turns its episode had sampled at the checkpoint this group was carried over from
    (`protocol.SavedTurn`s), until its request takes them to a generator."""

    def __post_init__(self):
        if not self.trajectories:
            self.trajectories = [None] * self.n
        if not self.rewards:
            self.rewards = [None] * self.n

    @property
    def generated(self) -> bool:
        """Every episode has come back from the generator."""
        return all(t is not None for t in self.trajectories)

    @property
    def lost(self) -> list[bool]:
        """By index: the episode came back lost (its workflow raised), so it has no tokens and no reward."""
        return [t is not None and bool(t.error) for t in self.trajectories]

    @property
    def complete(self) -> bool:
        """Every episode is back, and every one not lost is scored."""
        return self.generated and all(r is not None or lost for r, lost in zip(self.rewards, self.lost))

    @cached_property
    def oldest_version(self) -> int | None:
        """Oldest version among the sampled tokens of the episodes (read once the group is complete):
        context tokens (prompt, tool output) carry -1 and never count."""
        return oldest_version(t.versions for t in self.trajectories if t is not None)

    @property
    def uniform(self) -> bool:
        """Every episode not lost got the same reward: every GRPO advantage is 0, the group teaches nothing."""
        return len({r for r, lost in zip(self.rewards, self.lost) if not lost}) <= 1

    def to_state(self) -> dict:
        """Plain data (numpy arrays inside) for the controller checkpoint."""
        return {
            "group_id": self.group_id,
            "example": self.example,
            "n": self.n,
            "admitted": self.admitted,
            "rewards": list(self.rewards),
            "trajectories": [None if t is None else vars(t).copy() for t in self.trajectories],
        }

    @classmethod
    def from_state(cls, s: dict) -> Group:
        """A saved group; one saved before `admitted` was kept is keyed by its oldest token (0 without one)."""
        group = cls(
            group_id=s["group_id"],
            example=s["example"],
            n=s["n"],
            trajectories=[None if t is None else _trajectory(t, s["example"].prompt_ids) for t in s["trajectories"]],
            rewards=list(s["rewards"]),
        )
        group.admitted = s["admitted"] if "admitted" in s else group.oldest_version or 0
        return group


def _older(versions, floor: int) -> bool:
    """Some sampled token (version >= 0) of `versions` (per-token arrays) is of a version below `floor`."""
    oldest = oldest_version(versions)
    return oldest is not None and oldest < floor


def _trajectory(saved: dict, prompt_ids) -> Trajectory:
    """A checkpoint's trajectory; one saved before episodes (its `output_ids` only) becomes the episode of
    its prompt and that answer."""
    t = {RENAMED.get(k, k): v for k, v in saved.items() if k != REMOVED}
    if "output_ids" in t:
        return single_turn(
            t["group_id"],
            t["index"],
            prompt_ids,
            t["output_ids"],
            t["behav_logprobs"],
            t["versions"],
            t["finish_reason"],
        )
    return Trajectory(**t)


class Rollouts:
    """Groups in flight (`running`, by group id), finished groups (`buffer`, oldest first), and the
    staleness gate's counters over them (`gate`)."""

    def __init__(self, gate: StalenessGate, group_size: int, filter_uniform: bool = False):
        self.gate = gate
        self.group_size, self.filter_uniform = group_size, filter_uniform
        self.running: dict[int, Group] = {}
        self.running_keys: Counter[int] = Counter()
        """Running groups by `Group.admitted`: what the staleness schedule reads."""
        self.buffer: list[Group] = []
        self.requeued: list[Example] = []
        """Prompts of the groups running at a restored checkpoint that saved no more of them (written before
        answers in flight were kept): the gate counts them as running already."""
        self.carried: list[Group] = []
        """The groups running at the restored checkpoint, with what they had generated (`load_state_dict`):
        counted as running by the gate, admitted first."""
        self.next_group_id = 0
        self.filtered = 0
        """Groups left out by rollout.filter_uniform_groups since the last `take_metrics`."""
        self.lost_groups = 0
        """Groups left out since the last `take_metrics` because every episode of theirs was lost."""
        self.window = [0, 0, ""]
        """Episodes arrived and lost since the last full step's worth, and the first lost one's traceback."""
        self.waiting_since: float | None = None
        """When the schedule began to hold the step back (None: it does not now)."""
        self.wait_s = 0.0
        """Seconds the schedule held steps back since the last `take_metrics`."""

    @classmethod
    def from_config(cls, rollout, version: Callable[[], int]) -> Rollouts:
        """From the `rollout` config section; `version()` is the policy version (the controller's)."""
        gate = StalenessGate.from_config(rollout, version)
        return cls(gate, rollout.group_size, rollout.filter_uniform_groups)

    def admit(self, prompts) -> list[Group]:
        """The groups to start now, running from here: the requeued ones first (already counted), then one
        for each next prompt of `prompts` while the gate has room."""
        started = []
        while self.carried or self.requeued or self.gate.can_admit():
            if self.carried:
                group = self.carried.pop(0)  # its own id and key
                self.running[group.group_id] = group
                self.running_keys[group.admitted] += 1
                started.append(group)
                self._finish(group)  # complete already: its last episodes came back lost as it was saved
                continue
            if self.requeued:
                example = self.requeued.pop(0)
            else:
                example = prompts.next()
                self.gate.admit()
            group = Group(self.next_group_id, example, self.group_size, admitted=self.gate.version())
            self.next_group_id += 1
            self.running[group.group_id] = group
            self.running_keys[group.admitted] += 1
            started.append(group)
        return started

    def add_trajectory(self, traj: Trajectory) -> Group:
        """Record an episode. A lost one (`Trajectory.error`) gets no reward, and may be the group's last.
        When more than half of a step's worth of episodes (`prompts_per_step` x `group_size`, counted as
        they arrive) are lost, raises EpisodesLost with the first one's exception (`raised`) and traceback."""
        group = self.running[traj.group_id]
        if group.trajectories[traj.index] is not None:
            raise RuntimeError(f"group {traj.group_id} trajectory {traj.index} arrived twice")
        group.trajectories[traj.index] = traj
        self._count_lost(traj)
        self._finish(group)
        return group

    def _count_lost(self, traj: Trajectory) -> None:
        w = self.window
        w[0] += 1
        if traj.error:
            w[1] += 1
            w[2] = w[2] or traj.error
        if w[0] < self.gate.prompts_per_step * self.group_size:
            return
        if 2 * w[1] > w[0]:
            raise EpisodesLost(
                f"{w[1]} of the last {w[0]} episodes were lost: their workflow (rollout.workflow) raised, "
                f"more than half of a step's episodes, so the run stops; fix the workflow. The first one "
                f"raised {raised(w[2])}\nIts traceback (every one is in its generator's log):\n{w[2]}"
            )
        self.window = [0, 0, ""]

    def add_reward(self, group_id: int, index: int, reward: float) -> None:
        """Record a reward. The group's last one finishes it (`_finish`)."""
        group = self.running[group_id]
        group.rewards[index] = float(reward)
        self._finish(group)

    def _finish(self, group: Group) -> None:
        """A complete group goes into the buffer, in admission order (a late group goes before younger
        ones); or it is left out, finishing unaccepted, which frees its admission slot (the gate's
        `finish(accepted=False)`, as a stale drop does), so another prompt takes its place: a group whose
        every episode was lost (counted in `rollout/lost_groups`), or, with `rollout.filter_uniform_groups`,
        one whose episodes all got the same reward."""
        if not group.complete:
            return
        del self.running[group.group_id]
        self.running_keys[group.admitted] -= 1
        if not self.running_keys[group.admitted]:
            del self.running_keys[group.admitted]
        if all(group.lost):
            self.gate.finish(accepted=False)
            self.lost_groups += 1
            return
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
        """The step's B groups, oldest first, or [] while fewer than B fresh ones are buffered or the schedule
        waits for a running group (timed: `staleness/wait_s`); stale groups are dropped first (counted,
        their slots freed: `StalenessGate.consume`)."""
        taken = self.gate.consume(self.buffer, self.running_keys)
        self.buffer = taken.buffered
        now = time.monotonic()
        if taken.waits_for and self.waiting_since is None:
            self.waiting_since = now
            log.debug("step %d waits for %d running groups", self.gate.version() + 1, taken.waits_for)
        elif not taken.waits_for and self.waiting_since is not None:
            self.wait_s += now - self.waiting_since
            self.waiting_since = None
        return taken.consumed

    def take_metrics(self) -> dict:
        """staleness/max, staleness/dropped, staleness/wait_s, rollout/filtered and rollout/lost_groups
        since the last call; starts anew."""
        row = {
            **self.gate.take_metrics(),
            "staleness/wait_s": self.wait_s,
            "rollout/filtered": self.filtered,
            "rollout/lost_groups": self.lost_groups,
        }
        self.filtered = self.lost_groups = 0
        self.wait_s = 0.0
        return row

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The gate's counters, the buffered groups, and the running ones with the episodes of theirs that came
        back (their answers in flight are the generators' to save: areal_hpc.checkpoint.in_flight)."""
        running = sorted([*self.running.values(), *self.carried], key=lambda g: g.group_id)
        return {
            "gate": self.gate.state_dict(),
            "requeued": list(self.requeued),
            "running": [g.to_state() for g in running],
            "buffer": [g.to_state() for g in self.buffer],
            "next_group_id": self.next_group_id,
        }

    def load_state_dict(self, state: dict, in_flight: dict | None = None) -> Counter:
        """A checkpoint's groups into a Rollouts with none running. The running ones are carried over with their
        episodes that had come back and, from `in_flight` ((group id, index) -> saved turns), the turns of
        the others; whatever holds a token too old to be trained at the next step (version < v - eta: a
        resume with a smaller max_staleness) is dropped and sampled again. A carried group's key is its oldest
        token's version (v without one). A checkpoint written before running groups were kept gives their
        prompts (`requeued`), admitted at v. Returns what was carried over and dropped, for the log."""
        if self.running:
            raise RuntimeError("load_state_dict() into Rollouts with groups running")
        self.gate.load_state_dict(state["gate"])
        self.requeued = list(state["requeued"])
        self.buffer = [Group.from_state(g) for g in state["buffer"]]
        self.next_group_id = state["next_group_id"]
        self.carried, in_flight = [], in_flight or {}
        v, floor = self.gate.version(), self.gate.version() - self.gate.max_staleness
        counts = Counter()
        for saved in state.get("running", []):
            group = Group.from_state(saved)
            for i, t in enumerate(group.trajectories):
                if t is None:
                    turns = in_flight.get((group.group_id, i), [])
                    tokens = sampled_tokens(turns)
                    too_old = _older([turn.versions for turn in turns], floor)
                    counts["answers_dropped" if too_old else "answers"] += bool(tokens)
                    counts["tokens_dropped" if too_old else "tokens"] += tokens
                    if tokens and not too_old:
                        group.resume[i] = turns
                elif not t.error and _older([t.versions], floor):
                    group.trajectories[i], group.rewards[i] = None, None
                    counts["episodes_dropped"] += 1
                else:
                    counts["episodes"] += 1
            kept = [t.versions for t in group.trajectories if t is not None and not t.error]
            kept += [turn.versions for turns in group.resume.values() for turn in turns]
            oldest = oldest_version(kept)
            group.admitted = v if oldest is None else min(v, oldest)
            self.carried.append(group)
        counts["groups"] = len(self.carried)
        return counts
