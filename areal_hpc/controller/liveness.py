"""Which rank stopped answering: the controller's watch over the ranks it is waiting for.

A rank that dies is mpirun's (or srun's) to notice: the launcher ends the whole job. A rank that hangs
(a deadlock, a stopped process, a collective that never returns) is noticed here: every piece of
work the controller hands out (a generation, a reward, a training step, a save, a weight sync) is
expected back, and a rank with work outstanding that sends nothing for `timeout_s` is taken as hung.

    hung(r)  <=>  outstanding(r) > 0  and  now - last_heard(r) > limit(r)
    limit(r) =  timeout_s                                   after r's first message
                max(timeout_s, startup_s)                   before it (the controller passes
                                                            train.startup_timeout_s, for engine start,
                                                            model load and the weight-sync joins, plus
                                                            train.collective_timeout_s, for their
                                                            start-up broadcast: a rank's own start-up
                                                            error, named, comes first)

`last_heard(r)` is the later of r's last message and the moment it got work while it had none, so
time spent idle never counts. The error names the rank (`layout.describe_rank`) and what it owed;
when several are silent, the one silent longest, except that a generator waiting in a weight sync
comes after a silent trainer (it waits for the trainer's broadcast).
"""

from __future__ import annotations

from areal_hpc.errors import RankFailure

SYNC = "the weight sync"
"""How the controller names an owed SyncDone (`expect(rank, now, f"{SYNC} of version {v}")`)."""


class Liveness:
    def __init__(self, layout, timeout_s: float, startup_s: float):
        self.layout = layout
        self.timeout_s = timeout_s
        self.startup_s = max(timeout_s, startup_s)
        self.outstanding: dict[int, int] = {}
        self.last: dict[int, float] = {}
        self.what: dict[int, str] = {}
        self.answered: set[int] = set()

    def heard(self, rank: int, now: float) -> None:
        self.last[rank] = now
        self.answered.add(rank)

    def expect(self, rank: int, now: float, what: str) -> None:
        """`rank` owes the controller an answer for `what`."""
        if self.outstanding.get(rank, 0) == 0:
            self.last[rank] = max(self.last.get(rank, now), now)
        self.outstanding[rank] = self.outstanding.get(rank, 0) + 1
        self.what[rank] = what

    def done(self, rank: int) -> None:
        self.outstanding[rank] = max(0, self.outstanding.get(rank, 0) - 1)

    def check(self, now: float) -> None:
        """Raise RankFailure if a rank is hung. When one rank hangs, the ranks waiting for it in a
        collective fall silent too, later: the error names the one silent longest, then the others."""
        hung = []
        for rank, n in self.outstanding.items():
            limit = self.timeout_s if rank in self.answered else self.startup_s
            if n and now - self.last[rank] > limit:
                hung.append((now - self.last[rank], rank, limit))
        if not hung:
            return
        # A generator in a weight sync waits for the trainers' broadcast: when both are silent, the
        # trainer is the likelier cause. Otherwise the rank silent longest comes first.
        hung.sort(key=lambda h: (self.what[h[1]].startswith(SYNC), -h[0]))
        silent, rank, limit = hung[0]
        others = "; also silent: " + ", ".join(self.layout.describe_rank(r) for _, r, _ in hung[1:]) if hung[1:] else ""
        raise RankFailure(
            f"{self.layout.describe_rank(rank)} has not answered for {silent:.0f} s (limit {limit:.0f} s; owes "
            f"{self.outstanding[rank]} answer(s), the latest for {self.what[rank]}): taken as hung, ending the run"
            + others
        )
