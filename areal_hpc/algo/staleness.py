"""Staleness control, the pure rule: the admission gate, the consumption schedule and check.

B = `rollout.prompts_per_step` (prompt groups per training step), eta = `rollout.max_staleness`,
v = the policy version (completed training steps, each of `ppo.minibatches` optimizer steps; the version
the next step trains), read from an injected callable so the gate needs no MPI and tests drive it directly.
A group's key is the version at its admission: its tokens are sampled by that version or a later one.

    admission:    admit a new prompt group only while
                      accepted + running < (eta + v + 1) * B   and   running < max_concurrent
    schedule:     a step at version v takes the B oldest finished groups (by key), but waits while a
                  running group would otherwise be left too old for the steps to come: while, for some
                  k in 0 .. eta - 1, the groups of key <= v - eta + k left unconsumed after this step
                  (running, or finished and not taken) number more than k * B and one of them is running
    consumption:  when a step is assembled at version v, every buffered group whose oldest generated
                  token has version < v - eta is dropped; then the B oldest of the rest, if B
                  remain and the schedule does not wait, are consumed (`consume`, one call).

The schedule is what keeps long answers. A group of key a must be trained by the step at version
a + eta; an answer that takes longer than eta + 1 steps to write (interrupted by weight updates, it
goes on with each new version) would be dropped at consumption. The schedule holds the version back
instead: the trainer waits for it, at the last step that can train it within the bound. The
generators go on meanwhile, though finished groups waiting for the step hold gate slots: with (eta +
1) * B well above max_concurrent they stay full, and where generation is the slower side the wait then
costs nothing; otherwise the wait is what the bound costs, which the planner's T0 / (eta + 1) predicts
(areal_hpc.planner). Why it never drops and never stalls: the gate
lets at most (eta + 1) * B groups be unconsumed, so if every step leaves at most k * B groups of key
<= v - eta + k for each k, the next one can again; taking the oldest finished groups first is the
best a step can do, and it waits only for a running group, which finishes. docs/design.md (The
algorithm) has the long form. The consumption check stays for what the schedule cannot hold: groups
restored from a checkpoint written before it, or a changed B at a resume.

Counters, in prompt groups:

    running   admitted, not finished yet (generating or being rewarded)
    accepted  finished and accepted into the buffer and not dropped since: buffered or consumed
    consumed  trained on (the trainer takes exactly B per step, so consumed = v * B)

Lifecycle of a group and the rule for what counts as accepted:

    admit()                  running += 1
    finish(accepted=True)    running -= 1, accepted += 1     into the buffer
    finish(accepted=False)   running -= 1                    filtered out or lost: frees its slot
    consume: trained on      consumed += 1                   still counted in accepted
    consume: dropped         accepted -= 1, dropped += 1     too stale: frees its slot

A dropped group must leave `accepted`, or each drop would hold a slot for ever and the gate would
stall; why that rule and the two checks together keep the bound is the long form of docs/design.md (The
algorithm); the worked example of a run is in the controller's docstring (areal_hpc.controller).

A GRPO group is dropped or consumed whole: its trajectories are scored against each other, so its
oldest version is the minimum over all of its trajectories (`oldest_version`).

The gate also keeps what each step's metrics report (`take_metrics`): staleness/max, the largest
v - oldest version over the groups consumed since the last report (at most eta, the guarantee), and
staleness/dropped, the trajectories dropped since then.

Checkpoints: `state_dict()` is a plain JSON-able dict; a gate restored with `load_state_dict` from
it (and the same version) makes exactly the decisions the uninterrupted one would. Groups that
were running at the checkpoint are still counted as running: the controller either generates them
again (and finishes them as usual) or releases each with `finish(accepted=False)`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np


@dataclass
class StalenessState:
    """The gate's counters (prompt groups, except `dropped_trajectories`); what a checkpoint holds."""

    running: int = 0
    accepted: int = 0
    consumed: int = 0
    rejected: int = 0
    dropped: int = 0
    dropped_trajectories: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StalenessState:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"staleness state keys {sorted(data)} differ from {sorted(names)}")
        values = {k: int(v) for k, v in data.items()}
        if any(v < 0 for v in values.values()):
            raise ValueError(f"staleness state has negative counters: {values}")
        if values["consumed"] > values["accepted"]:
            raise ValueError(f"staleness state: consumed > accepted: {values}")
        return cls(**values)


class Buffered(Protocol):
    """What the consumption check reads of a buffered prompt group (`areal_hpc.controller.rollouts.Group`)."""

    @property
    def oldest_version(self) -> int | None: ...  # of its generated tokens (`oldest_version`)

    @property
    def admitted(self) -> int: ...  # the version at its admission: its key in the schedule

    @property
    def n(self) -> int: ...  # its trajectories


G = TypeVar("G", bound=Buffered)


@dataclass
class Consumption(Generic[G]):
    """What `StalenessGate.consume` decided about a buffer, every group in exactly one list."""

    consumed: list[G]
    """The step's B groups, trained on at version v; empty when fewer than B fresh groups are buffered."""
    dropped: list[G]
    """Too stale (oldest < v - eta): counted, their slots freed, never trained on."""
    buffered: list[G]
    """The rest, still waiting, in the given order: the buffer from now on."""
    waits_for: int = 0
    """Running groups the step waits for (the schedule): while > 0, `consumed` is empty."""


class StalenessGate:
    """Admission gate and consumption check; see the module docstring for the rules.

    `version()` returns the current policy version v (the controller passes a function reading
    its own counter; tests pass a lambda over a variable).
    """

    def __init__(
        self, prompts_per_step: int, max_staleness: int, max_concurrent: int, version: Callable[[], int]
    ) -> None:
        if prompts_per_step < 1 or max_staleness < 0 or max_concurrent < 1:
            raise ValueError(
                f"need prompts_per_step >= 1, max_staleness >= 0, max_concurrent >= 1 "
                f"(got {prompts_per_step}, {max_staleness}, {max_concurrent})"
            )
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.version = version
        self.state = StalenessState()
        self._staleness_max = 0  # since the last take_metrics
        self._reported_drops = 0  # state.dropped_trajectories at the last take_metrics

    @classmethod
    def from_config(cls, rollout, version: Callable[[], int]) -> StalenessGate:
        """From the `rollout` config section (prompts_per_step, max_staleness, max_concurrent)."""
        return cls(rollout.prompts_per_step, rollout.max_staleness, rollout.max_concurrent, version)

    # --- admission --------------------------------------------------------------------------

    def room(self) -> int:
        """Prompt groups admissible now:
        min(max_concurrent - running, (eta + v + 1) * B - accepted - running), at least 0."""
        s = self.state
        bound = (self.max_staleness + self.version() + 1) * self.prompts_per_step
        return max(0, min(self.max_concurrent - s.running, bound - s.accepted - s.running))

    def can_admit(self) -> bool:
        return self.room() > 0

    def admit(self) -> None:
        """Count one new prompt group as running; raises if the gate is closed."""
        if not self.can_admit():
            raise RuntimeError(f"staleness gate closed (v={self.version()}, {self.state})")
        self.state.running += 1

    def finish(self, accepted: bool = True) -> None:
        """A running group finished: into the buffer (accepted) or not (filtered or lost)."""
        if self.state.running <= 0:
            raise RuntimeError("finish() without a running group")
        self.state.running -= 1
        if accepted:
            self.state.accepted += 1
        else:
            self.state.rejected += 1

    # --- consumption ------------------------------------------------------------------------

    def consume(self, buffer: Sequence[G], running: Mapping[int, int] | None = None) -> Consumption[G]:
        """The consumption check and the schedule at version v over `buffer` (the accepted groups not yet
        consumed, in the order they are to be trained: oldest key first) and `running` (how many
        groups are running, by key).

        Every group whose oldest generated-token version is < v - eta is dropped and counted (its
        trajectories too), which frees its slot; a group without generated tokens is fresh. Then, if
        at least B fresh groups remain and the schedule does not wait for a running one (`waits_for`),
        the first B are consumed (trained on at v).
        """
        s, v, eta = self.state, self.version(), self.max_staleness
        if len(buffer) > s.accepted - s.consumed:
            raise RuntimeError(f"consume() of {len(buffer)} groups, but only {s.accepted - s.consumed} are buffered")
        stale = [g.oldest_version is not None and g.oldest_version < v - eta for g in buffer]
        fresh = [g for g, old in zip(buffer, stale) if not old]
        dropped = [g for g, old in zip(buffer, stale) if old]
        s.accepted -= len(dropped)
        s.dropped += len(dropped)
        s.dropped_trajectories += sum(g.n for g in dropped)
        if len(fresh) < self.prompts_per_step:
            return Consumption([], dropped, fresh)
        consumed, fresh = fresh[: self.prompts_per_step], fresh[self.prompts_per_step :]
        waits_for = self.waits_for(fresh, running or {})
        if waits_for:
            return Consumption([], dropped, consumed + fresh, waits_for)
        s.consumed += len(consumed)
        ages = [v - g.oldest_version for g in consumed if g.oldest_version is not None]
        self._staleness_max = max([self._staleness_max, *ages])
        return Consumption(consumed, dropped, fresh)

    def waits_for(self, left: Sequence[Buffered], running: Mapping[int, int]) -> int:
        """The schedule (module docstring): the running groups a step at v waits for, 0 when it may go.
        `left`: the finished groups the step would leave; `running`: running groups by key."""
        v, eta, B = self.version(), self.max_staleness, self.prompts_per_step
        if not running or min(running) > v - 1:  # the common case, checked without counting `left`
            return 0
        left_keys = Counter(g.admitted for g in left)
        for k in range(eta):
            edge = v - eta + k
            behind = sum(n for key, n in running.items() if key <= edge)
            if behind and behind + sum(n for key, n in left_keys.items() if key <= edge) > k * B:
                return behind
        return 0

    # --- metrics ----------------------------------------------------------------------------

    def take_metrics(self) -> dict[str, int]:
        """staleness/max and staleness/dropped since the last call (module docstring); starts anew."""
        row = {
            "staleness/max": self._staleness_max,
            "staleness/dropped": self.state.dropped_trajectories - self._reported_drops,
        }
        self._staleness_max, self._reported_drops = 0, self.state.dropped_trajectories
        return row

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return self.state.to_dict()

    def load_state_dict(self, data: dict) -> None:
        """The counters of a checkpoint; the metrics count from here (the rows after it are written anew)."""
        self.state = StalenessState.from_dict(data)
        self._staleness_max, self._reported_drops = 0, self.state.dropped_trajectories


def oldest_version(versions: Iterable[np.ndarray]) -> int | None:
    """Oldest policy version among the generated tokens of a group's trajectories.

    `versions`: one per-token version array per trajectory; prompt tokens (-1) are ignored.
    None when the group generated no token at all.
    """
    oldest = None
    for v in versions:
        v = np.asarray(v)
        v = v[v >= 0]
        if v.size:
            low = int(v.min())
            oldest = low if oldest is None else min(oldest, low)
    return oldest
