"""What the controller sends the trainers and the generators' weights: a step to every data-parallel
replica, the weight sync after it, a save; and what it measures of them.

```
 train(groups, v)   advantages, pack (areal_hpc.controller.batch) -> one TrainBatch per replica, to its first rank,
                    which passes every message on to the replica's other TP x PP ranks (ReplicaRelay);
                    trainer rank 0 owes the TrainResult
 trained(result)    the step's BatchInfo back (its metrics); how long it took (for the stop decision)
 sync(v)            WeightSync(v) to every replica and every generator; each generator owes a SyncDone
 synced(g, done)    generator g runs version v (timing/weight_sync_s, timing/sync_drain_s: the slowest of a sync;
                    timing/weight_sync_bytes)
 save(v, path)      Save(v) to every replica; every trainer rank owes a Saved
```

Order is the guarantee: each rank handles the controller's messages in the order they were sent, so a
WeightSync sent before a GenerateRequest is loaded before it runs, and a TrainBatch sent after a Save
trains only once the version saved is on disk.
"""

from __future__ import annotations

import time

from areal_hpc.controller.batch import BatchInfo, build_train_batches
from areal_hpc.controller.liveness import SYNC, Liveness
from areal_hpc.controller.timeline import Timeline
from areal_hpc.layout import Layout, Role
from areal_hpc.metrics import IdleClock
from areal_hpc.protocol import Mailbox, Save, SyncDone, TrainResult, WeightSync


class Trainers:
    """The trainer ranks as the controller drives them. `idle` is the trainers' clock (timing/train_idle_frac):
    busy while a step is in flight."""

    def __init__(self, box: Mailbox, layout: Layout, cfg, liveness: Liveness, timeline: Timeline, idle: IdleClock):
        self.box, self.liveness, self.timeline, self.idle = box, liveness, timeline, idle
        self.ppo, self.train_pp, self.train_dp = cfg.ppo, cfg.allocation.train_pp, layout.train_dp
        self.ranks = list(layout.ranks(Role.TRAINER))
        self.first_ranks = [layout.replica_ranks(d)[0] for d in range(layout.train_dp)]
        """Where a replica's messages go (its first rank relays them to the others)."""
        self.generator_ranks = list(layout.ranks(Role.GENERATOR))
        self.step: BatchInfo | None = None
        """The step in flight, what its metrics need of the data it trains on."""
        self.started = 0.0
        self.last_step_s = 0.0
        self.syncing: dict[int, set[int]] = {}  # version -> generators not done loading it
        self.sync_s: dict[int, tuple[float, float, int]] = {}  # version -> the slowest load and drain, the bytes so far
        self.last_sync_s = 0.0
        self.last_drain_s = 0.0
        self.last_sync_bytes = 0

    @property
    def busy(self) -> bool:
        return self.step is not None

    def train(self, groups: list, version: int) -> None:
        """The step from policy version `version` on `groups` (the rollouts' batch)."""
        p = self.ppo
        batches, self.step = build_train_batches(
            groups,
            version,
            self.train_dp,
            p.minibatches,
            p.max_tokens_per_mb,
            p.adv_norm,
            self.train_pp,
            mask_truncated=p.mask_truncated,
        )
        for rank, batch in zip(self.first_ranks, batches):
            self.box.send(rank, batch)
        self.idle.busy(0, True)
        self.started = time.monotonic()
        self.timeline.mark("train_start", version=version)
        self.liveness.expect(self.ranks[0], self.started, f"training step {version + 1}")

    def trained(self, res: TrainResult) -> BatchInfo:
        """The step is done (trainer rank 0 answers for all); its BatchInfo."""
        info, self.step = self.step, None
        self.last_step_s = time.monotonic() - self.started
        self.idle.busy(0, False)
        self.timeline.mark("train_end", version=res.version)
        self.liveness.done(self.ranks[0])
        return info

    def step_left_s(self, now: float) -> float:
        """Seconds until the running step is back, were it as long as the last one (0: none running)."""
        return max(0.0, self.last_step_s - (now - self.started)) if self.busy else 0.0

    def sync(self, version: int) -> None:
        """The weights of `version` to every generator. Sent before any request that should run on them:
        generators handle messages in order."""
        for rank in self.first_ranks + self.generator_ranks:
            self.box.send(rank, WeightSync(version))
        self.syncing[version] = set(self.generator_ranks)
        self.timeline.mark("sync_start", version=version)
        for g in self.generator_ranks:
            self.liveness.expect(g, time.monotonic(), f"{SYNC} of version {version}")

    def synced(self, src: int, msg: SyncDone) -> None:
        """Generator `src` runs version `msg.version`; once every generator does, that sync's slowest load is
        `last_sync_s` (timing/weight_sync_s), its slowest drain `last_drain_s` (timing/sync_drain_s: the
        wait for the turns in flight to finish first, rollout.interruptible false) and what one generator
        received `last_sync_bytes` (timing/weight_sync_bytes)."""
        waiting = self.syncing[msg.version]
        waiting.discard(src)
        self.timeline.mark("sync_done", rank=src, version=msg.version, seconds=msg.seconds)
        self.liveness.done(src)
        load_s, drain_s, nbytes = self.sync_s.get(msg.version, (0.0, 0.0, 0))
        self.sync_s[msg.version] = (max(load_s, msg.seconds), max(drain_s, msg.drain_s), max(nbytes, msg.nbytes))
        if not waiting:
            del self.syncing[msg.version]
            self.last_sync_s, self.last_drain_s, self.last_sync_bytes = self.sync_s.pop(msg.version)

    def save(self, version: int, path) -> None:
        """Every trainer rank saves version `version` to `path` (each answers Saved)."""
        for rank in self.first_ranks:
            self.box.send(rank, Save(version, str(path)))
        for rank in self.ranks:
            self.liveness.expect(rank, time.monotonic(), f"the checkpoint of version {version}")
