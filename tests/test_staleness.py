"""Staleness gate and consumption check: the worked example, checkpoints, and a simulated system."""

import json
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.staleness import StalenessGate, StalenessState, oldest_version
from areal_hpc.config import RolloutConfig
from areal_hpc.controller.rollouts import Group, Rollouts, single_turn
from areal_hpc.data.dataset import Example


class Version:
    """The injected version source: the trainer's step counter."""

    def __init__(self):
        self.v = 0

    def __call__(self):
        return self.v


@dataclass
class Rollout:
    """A buffered prompt group as the consumption check sees it."""

    oldest_version: int | None
    n: int = 1
    admitted: int = 0


def test_worked_example():
    # B = 4, eta = 1: 8 groups at v = 0; 4 more after one step; a group from v = 0 is dropped at v = 2.
    version = Version()
    gate = StalenessGate(prompts_per_step=4, max_staleness=1, max_concurrent=100, version=version)
    for _ in range(8):
        gate.admit()
    assert not gate.can_admit() and gate.room() == 0
    with pytest.raises(RuntimeError, match="closed"):
        gate.admit()
    for _ in range(7):  # one straggler still generating
        gate.finish(accepted=True)
    step = gate.consume([Rollout(0) for _ in range(7)])
    assert (len(step.consumed), step.dropped, len(step.buffered)) == (4, [], 3)
    assert gate.take_metrics() == {"staleness/max": 0, "staleness/dropped": 0}
    version.v = 1
    assert gate.room() == 4  # (1 + 1 + 1) * 4 - 7 accepted - 1 running
    for _ in range(4):
        gate.admit()
    for _ in range(4):
        gate.finish(accepted=True)
    step = gate.consume(step.buffered + [Rollout(1) for _ in range(4)])
    # still fresh at v = 1 (0 >= 1 - 1): the 3 from v = 0 and one of the new groups make step 2
    assert [g.oldest_version for g in step.consumed] == [0, 0, 0, 1] and not step.dropped
    assert gate.take_metrics() == {"staleness/max": 1, "staleness/dropped": 0}
    version.v = 2
    assert gate.room() == 4  # (1 + 2 + 1) * 4 - 11 accepted - 1 running
    gate.finish(accepted=True)  # the straggler, admitted first, goes first in the buffer
    straggler = Rollout(0, n=8)
    step = gate.consume([straggler, *step.buffered])
    # 0 < 2 - 1: dropped, its slot free again; the 3 left are too few for a step
    assert (step.consumed, step.dropped, len(step.buffered)) == ([], [straggler], 3)
    assert gate.room() == 5
    assert gate.state.dropped == 1 and gate.state.dropped_trajectories == 8
    restored = StalenessGate(4, 1, 100, version)
    restored.load_state_dict(gate.state_dict())
    assert gate.take_metrics() == {"staleness/max": 0, "staleness/dropped": 8}
    assert gate.take_metrics()["staleness/dropped"] == 0  # counted once
    assert restored.take_metrics()["staleness/dropped"] == 0  # its rows before the checkpoint are written


def test_the_controllers_worked_example_waits_rather_than_drops():
    """areal_hpc.controller's table, B = 3, eta = 1: step 2 waits for g5 (admitted at v0, still running),
    which step 3 could no longer train, then takes g3, g4, g5; step 3 takes g6, g7, g8; nothing dropped."""
    version = Version()
    gate = StalenessGate(prompts_per_step=3, max_staleness=1, max_concurrent=100, version=version)
    g = {i: Rollout(0, admitted=0) for i in range(6)}
    for _ in range(6):
        gate.admit()
    for _ in range(3):
        gate.finish()
    step = gate.consume([g[0], g[1], g[2]], {0: 3})
    assert step.consumed == [g[0], g[1], g[2]] and not step.waits_for
    version.v = 1
    for i in (6, 7, 8):
        gate.admit()
        g[i] = Rollout(1, admitted=1)
    for _ in range(3):  # g3, g4, g6
        gate.finish()
    assert (gate.state.running, gate.state.accepted, gate.state.consumed, gate.room()) == (3, 6, 3, 0)
    step = gate.consume([g[3], g[4], g[6]], {0: 1, 1: 2})  # g5 at key 0, g7 and g8 at 1 running
    assert (step.consumed, step.dropped, step.buffered, step.waits_for) == ([], [], [g[3], g[4], g[6]], 1)
    gate.finish()  # g5, its tokens of v0 and v1
    step = gate.consume([g[3], g[4], g[5], g[6]], {1: 2})
    assert step.consumed == [g[3], g[4], g[5]] and step.buffered == [g[6]]
    assert (gate.state.running, gate.state.accepted, gate.state.consumed, gate.room()) == (2, 7, 6, 0)
    assert gate.take_metrics() == {"staleness/max": 1, "staleness/dropped": 0}
    version.v = 2
    assert gate.room() == 3
    for i in (9, 10, 11):
        gate.admit()
        g[i] = Rollout(2, admitted=2)
    for _ in range(3):  # g7, g8, g9
        gate.finish()
    step = gate.consume([g[6], g[7], g[8], g[9]], {2: 2})
    assert step.consumed == [g[6], g[7], g[8]] and not step.dropped
    assert (gate.state.running, gate.state.accepted, gate.state.consumed, gate.room()) == (2, 10, 9, 0)


def test_a_restore_keys_the_requeued_groups_at_the_version_it_resumes_from():
    """Groups running at a checkpoint start again at the version the run resumes from: that is their key
    from then on (the schedule never waits at once for an answer begun again); a buffered group keeps its
    key, and one saved before keys were kept is keyed by its oldest token."""

    class Stream:
        position = 0

        def next(self):
            self.position += 1
            return Example(self.position, "p", "1", "math", prompt_ids=np.array([5, 6], np.int32))

    version = Version()
    rollout = RolloutConfig(prompts_per_step=2, max_staleness=1, max_concurrent=4, group_size=1)
    rollouts = Rollouts.from_config(rollout, version)
    started = rollouts.admit(Stream())
    assert [g.admitted for g in started] == [0] * 4 and rollouts.running_keys == Counter({0: 4})
    done = started[1].group_id
    rollouts.add_trajectory(single_turn(done, 0, [5, 6], [7, 8], [-0.5, -0.5], [1, 1], "stop"))
    rollouts.add_reward(done, 0, 1.0)
    assert [g.group_id for g in rollouts.buffer] == [done] and rollouts.running_keys == Counter({0: 3})
    state = rollouts.state_dict()
    version.v = 3
    restored = Rollouts.from_config(rollout, version)
    restored.load_state_dict(state)
    assert restored.buffer[0].admitted == 0
    again = restored.admit(Stream())
    assert [g.example.index for g in again[:3]] == [1, 3, 4]  # the requeued first, then a new prompt
    assert all(g.admitted == 3 for g in again) and restored.running_keys == Counter({3: len(again)})
    del state["buffer"][0]["admitted"]  # as a checkpoint written before keys were kept
    assert Group.from_state(state["buffer"][0]).admitted == 1


def test_max_concurrent_and_rejections_free_slots():
    gate = StalenessGate(prompts_per_step=8, max_staleness=4, max_concurrent=3, version=lambda: 0)
    for _ in range(3):
        gate.admit()
    assert gate.room() == 0  # the staleness bound allows 40, max_concurrent 3
    gate.finish(accepted=False)
    assert gate.room() == 1 and gate.state.rejected == 1 and gate.state.accepted == 0


def test_misuse_raises():
    gate = StalenessGate(1, 0, 1, version=lambda: 0)
    with pytest.raises(RuntimeError):
        gate.finish()
    with pytest.raises(RuntimeError, match="only 0 are buffered"):
        gate.consume([Rollout(0)])
    with pytest.raises(ValueError):
        StalenessGate(0, 0, 1, version=lambda: 0)
    with pytest.raises(ValueError):
        StalenessState.from_dict({"running": 1})
    with pytest.raises(ValueError):
        StalenessState.from_dict({**StalenessState().to_dict(), "running": -1})


def test_from_config_and_state_round_trip():
    version = Version()
    gate = StalenessGate.from_config(RolloutConfig(prompts_per_step=2, max_staleness=1, max_concurrent=5), version)
    assert (gate.prompts_per_step, gate.max_staleness, gate.max_concurrent) == (2, 1, 5)
    for _ in range(3):
        gate.admit()
    gate.finish()
    restored = StalenessGate(2, 1, 5, version)
    restored.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    assert restored.state == gate.state and restored.room() == gate.room() == 1


def test_oldest_version_ignores_prompt_tokens():
    assert oldest_version([np.array([-1, -1, 3, 4]), np.array([-1, 2, 5])]) == 2
    assert oldest_version([np.array([-1, -1]), np.array([], dtype=np.int32)]) is None
    assert oldest_version([]) is None


def test_an_episodes_context_tokens_never_make_it_stale():
    """A multi-turn episode's prompt and tool output carry version -1: its group's staleness is its oldest
    sampled token's (5 here), so at v = 6 with eta = 1 it trains, and at v = 7 it is dropped."""
    versions = np.array([-1, -1, 5, 5, -1, -1, -1, 6, 6], np.int32)  # prompt, turn 1, tool output, turn 2
    group = Group(0, Example(0, "p", "1", "math"), 1, trajectories=[SimpleNamespace(versions=versions)])
    assert group.oldest_version == 5
    for v, kept in ((6, True), (7, False)):
        gate = StalenessGate(prompts_per_step=1, max_staleness=1, max_concurrent=4, version=lambda v=v: v)
        gate.admit()
        gate.finish()
        taken = gate.consume([group])
        assert (taken.consumed == [group]) == kept and (taken.dropped == [group]) != kept


# --- a simulated controller: admissions, completions in any order, training steps --------------


class System:
    """Controller + generators + trainer reduced to the gate's calls. Every gate call goes to the
    original gate and to any gate restored from a checkpoint of it; their answers must agree."""

    def __init__(self, B, eta, max_concurrent, oldest_first, schedule=False):
        """`schedule`: the step is given the running groups' keys (as the controller's is), so it may wait."""
        self.B, self.eta, self.schedule = B, eta, schedule
        self.version = Version()
        self.gates = [StalenessGate(B, eta, max_concurrent, self.version)]
        self.running = []  # admission version of each running group
        self.buffer = []  # each accepted group (its oldest-token version), in arrival order
        self.oldest_first = oldest_first
        self.staleness = []  # v - oldest of every consumed group
        self.dropped = 0
        self.reported_drops = 0  # self.dropped at the last metrics row

    def call(self, name, *args):
        answers = {getattr(g, name)(*args) for g in self.gates}
        assert len(answers) == 1, f"restored gate disagrees on {name}{args}"
        return answers.pop()

    def checkpoint(self):
        state = json.loads(json.dumps(self.gates[0].state_dict()))
        g = self.gates[0]
        restored = StalenessGate(g.prompts_per_step, g.max_staleness, g.max_concurrent, self.version)
        restored.load_state_dict(state)
        self.gates.append(restored)

    def admit(self):
        if self.call("can_admit"):
            self.call("admit")
            self.running.append(self.version.v)  # generation starts now: its first token has this version
        self.check()

    def finish(self, k, accepted):
        if self.running:
            v0 = self.running.pop(k % len(self.running))
            self.call("finish", accepted)
            if accepted:
                self.buffer.append(Rollout(v0, n=8, admitted=v0))
        self.check()

    def train(self):
        if self.oldest_first:
            self.buffer.sort(key=lambda g: g.oldest_version)
        running = Counter(self.running) if self.schedule else None
        steps = [g.consume(self.buffer, running) for g in self.gates]
        step = steps[0]
        assert all(s == step for s in steps), "restored gate disagrees on consume"
        if step.waits_for:  # only for running groups admitted before this version
            assert not step.consumed and 0 < step.waits_for <= sum(a < self.version.v for a in self.running)
        assert sorted(map(id, step.consumed + step.dropped + step.buffered)) == sorted(map(id, self.buffer))
        self.buffer = step.buffered
        self.dropped += len(step.dropped)
        if step.consumed:
            ages = [self.version.v - g.oldest_version for g in step.consumed]
            rows = [g.take_metrics() for g in self.gates]  # the step's metrics row
            assert all(row["staleness/max"] == max(ages) for row in rows)
            assert rows[0]["staleness/dropped"] == 8 * (self.dropped - self.reported_drops)
            self.reported_drops = self.dropped
            self.staleness += ages
            self.version.v += 1
        self.check()

    def play(self, stream, restore_at, reject):
        """The ops of `stream` (admit, finish the k-th running group, train), a checkpoint before the
        `restore_at`-th; a finish is accepted unless `reject` and its flag is false."""
        for i, (op, k, flag) in enumerate(stream):
            if i == restore_at:
                self.checkpoint()
            if op == "admit":
                self.admit()
            elif op == "finish":
                self.finish(k, accepted=flag or not reject)
            else:
                self.train()

    def drain(self, steps=3):
        """Admit while the gate lets, finish everything, train; `steps` more steps must come."""
        start = self.version.v
        for _ in range(50 * self.B):
            if self.version.v >= start + steps:
                break
            while self.call("can_admit"):
                self.admit()
            while self.running:
                self.finish(0, accepted=True)
            self.train()
        assert self.version.v >= start + steps, "stall"

    def check(self):
        v, B, eta = self.version.v, self.B, self.eta
        for g in self.gates:
            s = g.state
            assert s.running == len(self.running) <= g.max_concurrent
            assert s.accepted + s.running <= (eta + v + 1) * B
            assert s.accepted - s.consumed == len(self.buffer)
            assert s.consumed == v * B
            assert s.dropped == self.dropped and s.dropped_trajectories == 8 * self.dropped
        # Liveness: with nothing running and too little buffered for a step, the gate must admit.
        if not self.running and len(self.buffer) < B:
            assert self.call("can_admit"), "stall: the trainer waits and the gate admits nothing"
        # The guarantee: no consumed group is staler than eta.
        assert all(s <= eta for s in self.staleness)


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "admit", "finish", "train"]), st.integers(0, 100), st.booleans()),
    min_size=40,  # long enough for stragglers to grow stale (hypothesis favours short lists)
    max_size=160,
)


@settings(max_examples=300, deadline=None)
@given(
    B=st.integers(1, 4),
    eta=st.integers(0, 3),
    max_concurrent=st.integers(1, 12),
    oldest_first=st.booleans(),
    stream=ops,
    restore_at=st.integers(0, 160),
    reject=st.booleans(),
)
def test_random_streams_never_exceed_the_bound(B, eta, max_concurrent, oldest_first, stream, restore_at, reject):
    system = System(B, eta, max_concurrent, oldest_first)
    system.play(stream, restore_at, reject)
    if eta == 0:
        # Synchronous RL: every consumed group came from the current version, none was dropped.
        assert all(s == 0 for s in system.staleness)
        assert system.dropped == 0
    system.drain()  # the system keeps training (no stall), whatever was dropped before


@settings(max_examples=300, deadline=None)
@given(
    B=st.integers(1, 4),
    eta=st.integers(0, 3),
    max_concurrent=st.integers(1, 12),
    stream=ops,
    restore_at=st.integers(0, 160),
    reject=st.booleans(),
)
def test_the_schedule_drops_nothing_in_any_completion_order(B, eta, max_concurrent, stream, restore_at, reject):
    """Groups finish in any order, each with its admission version as its oldest token's (the oldest it can
    be: an answer interrupted by every update); given the running groups' keys, a step waits rather than
    leave one too old, so nothing is ever dropped, the bound holds, and training never stalls."""
    system = System(B, eta, max_concurrent, oldest_first=True, schedule=True)
    system.play(stream, restore_at, reject)
    assert system.dropped == 0
    system.drain()  # once everything running has finished, a step goes
    assert system.dropped == 0


@settings(max_examples=100, deadline=None)
@given(B=st.integers(1, 4), eta=st.integers(0, 3), max_concurrent=st.integers(1, 12), stream=ops)
def test_in_order_completion_drops_nothing(B, eta, max_concurrent, stream):
    # The gate alone bounds staleness when groups finish in admission order: the check never fires.
    system = System(B, eta, max_concurrent, oldest_first=False)
    for op, _, _ in stream:
        if op == "admit":
            system.admit()
        elif op == "finish":
            system.finish(0, accepted=True)
        else:
            system.train()
    assert system.dropped == 0
