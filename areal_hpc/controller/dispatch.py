"""Generation and rewards to the least-loaded ranks: whom each request goes to, what it owes, whom its
answer is for.

```
 generate(request)   GenerateRequest (a prompt group's, or an eval prompt's) -> the generator with the fewest
                     requests in flight (ties: the lowest rank); it owes a generation (liveness) and is busy
                     (its idle clock)
 generated(src, t)   t was the last trajectory of its request: src owes one generation less
 save(v, path)       Save(v, path) to every generator: each writes its answers in flight there and owes a Saved
 score(t, target)    RewardRequest(a fresh request id, t's final answer's token ids, target) -> the
                     reward worker with the fewest requests open; the id -> t, the episode the result is for
 scored(result)      -> that trajectory (a Trajectory: a prompt group's; an EvalTrajectory: an eval prompt's)
```

Least-loaded by count, not by tokens: requests are alike (n episodes of one prompt, one episode's
reward), and a count needs no estimate of what a generation will cost.
"""

from __future__ import annotations

import time

from areal_hpc.controller.liveness import Liveness
from areal_hpc.controller.timeline import Timeline
from areal_hpc.layout import Layout, Role
from areal_hpc.metrics import IdleClock
from areal_hpc.protocol import (
    EvalTrajectory,
    GenerateRequest,
    Mailbox,
    RewardRequest,
    RewardResult,
    Save,
    Trajectory,
)


class Dispatch:
    """The controller's requests to the generators and reward workers. `idle` is the generators' clock
    (timing/gen_idle_frac): a generator is busy while it has a request in flight."""

    def __init__(
        self, box: Mailbox, layout: Layout, reward_kind: str, liveness: Liveness, timeline: Timeline, idle: IdleClock
    ):
        self.box, self.reward_kind = box, reward_kind
        self.liveness, self.timeline, self.idle = liveness, timeline, idle
        self.generator_ranks = list(layout.ranks(Role.GENERATOR))
        self.reward_ranks = list(layout.ranks(Role.REWARD))
        self.gen_load = dict.fromkeys(self.generator_ranks, 0)  # requests in flight per generator
        self.reward_load = dict.fromkeys(self.reward_ranks, 0)  # reward requests open per reward worker
        self.pending: dict[int, tuple[Trajectory | EvalTrajectory, int]] = {}  # request id -> (scored, rank)
        self.next_reward_id = 0

    def generate(self, request: GenerateRequest) -> None:
        """n trajectories to one prompt, from the least-loaded generator."""
        gen = min(self.generator_ranks, key=lambda g: (self.gen_load[g], g))
        self.box.send(gen, request)
        self.timeline.mark("gen_start", rank=gen, **_timeline_name(request))
        self.gen_load[gen] += 1
        self.idle.busy(self.generator_ranks.index(gen), True)
        self.liveness.expect(gen, time.monotonic(), "a generation")

    def generated(self, src: int, last: Trajectory | EvalTrajectory) -> None:
        """Generator `src` sent `last`, the last trajectory of its request."""
        self.timeline.mark("gen_done", rank=src, **_timeline_name(last))
        self.gen_load[src] -= 1
        self.liveness.done(src)
        if self.gen_load[src] == 0:
            self.idle.busy(self.generator_ranks.index(src), False)

    def save(self, version: int, path) -> None:
        """Every generator writes its answers in flight into the checkpoint at `path` (each answers Saved)."""
        for rank in self.generator_ranks:
            self.box.send(rank, Save(version, str(path)))
            self.liveness.expect(rank, time.monotonic(), f"the checkpoint of version {version}")

    def score(self, traj: Trajectory | EvalTrajectory, target) -> None:
        """Score one episode's final answer (`answer_ids`) against `target` (its Example's) on the
        least-loaded reward worker."""
        rank = min(self.reward_ranks, key=lambda r: (self.reward_load[r], r))
        request_id, self.next_reward_id = self.next_reward_id, self.next_reward_id + 1
        self.pending[request_id] = (traj, rank)
        self.box.send(rank, RewardRequest(request_id, self.reward_kind, traj.answer_ids, target))
        self.reward_load[rank] += 1
        self.liveness.expect(rank, time.monotonic(), "a reward")

    def scored(self, res: RewardResult) -> Trajectory | EvalTrajectory:
        """The trajectory a reward result is for."""
        traj, rank = self.pending.pop(res.request_id)
        self.reward_load[rank] -= 1
        self.liveness.done(rank)
        return traj


def _timeline_name(msg: GenerateRequest | Trajectory | EvalTrajectory) -> dict:
    """What a generation is called in the timeline (areal_hpc.controller.timeline): its group, or its eval prompt."""
    if isinstance(msg, EvalTrajectory):
        return {"eval": msg.prompt_index}
    return {"eval" if isinstance(msg, GenerateRequest) and msg.eval else "group": msg.group_id}
