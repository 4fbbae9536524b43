"""Dynamic filtering and overlong trajectories: `rollout.filter_uniform_groups` against the simulated world
of tests/support/sim_world.py (the real gate, buffer, batches and metrics), the gate's invariant with filtered
groups (a property test over the controller's loop), the gate's slot accounting for a filtered group,
DAPO's soft length penalty, and masking truncated trajectories out of the loss."""

import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.staleness import StalenessGate
from areal_hpc.config import ConfigError, load_config
from areal_hpc.controller.batch import build_train_batches
from areal_hpc.controller.rollouts import FILTERED_WARN_STEPS, Group, single_turn
from areal_hpc.data.dataset import Example
from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.exit_codes import EXIT_DONE
from areal_hpc.protocol import Envelope, RewardRequest, RewardResult
from areal_hpc.reward import overlong_penalty
from tests.support.sim_world import Prompts, World, make, metrics, run


class CoinWorld(World):
    """Rewards are coin flips (`p_right`): some groups all right or all wrong, most mixed. Every
    trained sequence's advantage is recorded."""

    p_right = 0.5

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_advantages: list[float] = []

    def send(self, dest, msg):
        if isinstance(msg, RewardRequest):
            reward = float(self.rng.random() < self.p_right)
            self.later.append((self.rng.randint(0, 2), Envelope(dest, RewardResult(msg.request_id, reward, "ok"))))
            return
        super().send(dest, msg)

    def on_train_batch(self, dest, batch):
        for k in range(len(batch.cu_seqlens) - 1):
            seq = slice(batch.cu_seqlens[k], batch.cu_seqlens[k + 1])
            sampled = batch.versions[seq] >= 0
            self.trained_advantages.append(float(batch.advantages[seq][sampled][0]))
        super().on_train_batch(dest, batch)


@pytest.mark.parametrize("filtering", [False, True])
def test_uniform_groups_are_left_out_and_their_slots_refilled(tmp_path, filtering):
    cfg, layout, run_dir, tok_dir = make(
        tmp_path, "rollout.max_staleness=1", f"rollout.filter_uniform_groups={str(filtering).lower()}"
    )
    world = CoinWorld(layout, build_tokenizer(), seed=3)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE, "filtering must not stall the run"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    filtered = sum(r["rollout/filtered"] for r in rows)
    zero_advantage = sum(a == 0.0 for a in world.trained_advantages)
    if not filtering:  # without the filter, groups whose trajectories all agree are trained on, and teach nothing
        assert filtered == 0 and zero_advantage > 0
        return
    assert filtered > 0 and zero_advantage == 0, "a uniform group reached the trainer"
    g = c.rollouts.gate.state
    # A filtered group finished unaccepted: its slot went to another prompt, the bound still holds. Groups that
    # finish after the last step's row (while the run ends) are counted for a row that never comes.
    assert g.rejected == filtered + c.rollouts.filtered
    assert g.accepted + g.running <= (cfg.rollout.max_staleness + c.version + 1) * cfg.rollout.prompts_per_step
    assert c.prompts.position >= 12 * 4 + filtered, "every filtered group was replaced by a new prompt"


class CheckedGate(StalenessGate):
    """The real gate, its invariant checked after every call that changes a counter."""

    def check(self):
        s = self.state
        assert 0 <= s.running <= self.max_concurrent
        assert s.consumed <= s.accepted
        assert s.accepted + s.running <= (self.max_staleness + self.version() + 1) * self.prompts_per_step

    def admit(self):
        super().admit()
        self.check()

    def finish(self, accepted=True):
        super().finish(accepted)
        self.check()

    def consume(self, buffer, running=None):
        step = super().consume(buffer, running)
        self.check()
        return step


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    B=st.integers(1, 4),
    eta=st.integers(0, 2),
    n=st.integers(2, 4),
    concurrent=st.integers(1, 8),
    p_right=st.sampled_from([0.2, 0.5, 0.8]),
    seed=st.integers(0, 1000),
)
def test_the_gate_invariant_holds_with_filtered_groups(tmp_path_factory, B, eta, n, concurrent, p_right, seed):
    """Whatever the batch, bound, group size, concurrency and share of uniform groups: after every gate
    call accepted + running <= (eta + v + 1) * B, every admitted group is accounted for exactly once
    (running, accepted, filtered or dropped as stale), no uniform group is trained on, and the run
    reaches its last step (a filtered group never holds a slot)."""
    steps = 6
    cfg, layout, run_dir, tok_dir = make(
        tmp_path_factory.mktemp("gate"),
        f"rollout.prompts_per_step={B}",
        f"rollout.max_staleness={eta}",
        f"rollout.group_size={n}",
        f"rollout.max_concurrent={concurrent}",
        "rollout.filter_uniform_groups=true",
        "ppo.minibatches=1",
        f"train.total_steps={steps}",
    )
    world = CoinWorld(layout, build_tokenizer(), seed=seed)
    world.p_right = p_right
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("areal_hpc.controller.rollouts.StalenessGate", CheckedGate)
        c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert isinstance(c.rollouts.gate, CheckedGate) and code == EXIT_DONE
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    s = c.rollouts.gate.state
    filtered = sum(r["rollout/filtered"] for r in rows) + c.rollouts.filtered  # and after the last step
    assert s.consumed == steps * B and s.rejected == filtered
    assert c.prompts.position == s.running + s.accepted + s.rejected + s.dropped
    assert 0.0 not in world.trained_advantages, "a uniform group reached the trainer"


def test_a_run_that_filters_everything_says_so(tmp_path, caplog):
    """Every trajectory wrong for a while: no step can come, and the log says why and what to change."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.filter_uniform_groups=true", "train.total_steps=2")
    groups = FILTERED_WARN_STEPS * cfg.rollout.prompts_per_step

    class Numbered(Prompts):
        """Each prompt's target is its place in the stream (a CoinWorld's rewards ignore targets)."""

        def next(self):
            example = super().next()
            return dataclasses.replace(example, target=str(example.index))

    class LateLearner(CoinWorld):
        """Every trajectory to the first 2 * `groups` prompts is wrong, then they are coin flips."""

        def send(self, dest, msg):
            if isinstance(msg, RewardRequest):
                self.p_right = 0.5 if int(msg.target) >= 2 * groups else 0.0
            super().send(dest, msg)

    world = LateLearner(layout, build_tokenizer(), seed=2)
    with caplog.at_level(logging.WARNING, logger="areal_hpc.controller.rollouts"):
        c, code = run(cfg, layout, run_dir, tok_dir, world, Numbered())
    assert code == EXIT_DONE
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warnings and warnings[0].startswith(f"{groups} prompt groups left out at policy version 0")
    assert "rollout.filter_uniform_groups=false" in warnings[0]
    assert metrics(run_dir)[0]["rollout/filtered"] >= 2 * groups


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.filter_uniform_groups=true", "rollout.group_size=1"], "set rollout.group_size >= 2"),
        (["reward.overlong_penalty=1.0"], "needs reward.overlong_buffer in [1, rollout.max_new_tokens (12)]"),
        (["reward.overlong_penalty=1.0", "reward.overlong_buffer=13"], "(got 13)"),
        (["reward.overlong_penalty=-1"], "reward.overlong_penalty must be >= 0"),
    ],
)
def test_filtering_and_penalty_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny-cpu.yaml", overrides)
    assert message in str(e.value)


def test_a_filtered_group_frees_its_slot_like_a_stale_drop():
    """At a full gate, leaving a finished group out (filter) and dropping a buffered one (staleness)
    each give exactly one slot back."""
    v = [0]
    gates = [StalenessGate(prompts_per_step=2, max_staleness=0, max_concurrent=10, version=lambda: v[0]) for _ in "ab"]
    for gate in gates:
        for _ in range(2):
            gate.admit()
        assert gate.room() == 0
    filtered, stale = gates
    stale_group = SimpleNamespace(oldest_version=0, n=1)
    filtered.finish(accepted=False)  # left out by the filter
    stale.finish(accepted=True)
    v[0] = 1  # one step later the buffered group is too old for eta = 0
    assert stale.consume([stale_group]).dropped == [stale_group]
    v[0] = 0
    assert filtered.room() == stale.room() == 1
    assert filtered.state.running + filtered.state.accepted == stale.state.running + stale.state.accepted == 1


def test_overlong_penalty_by_hand():
    # max_new_tokens 20, buffer 5: nothing up to 15 tokens, then -penalty * (L - 15) / 5.
    assert overlong_penalty(15, 20, 5, 1.0) == 0.0
    assert overlong_penalty(16, 20, 5, 1.0) == pytest.approx(-0.2)
    assert overlong_penalty(20, 20, 5, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(20, 20, 0, 1.0) == overlong_penalty(20, 20, 5, 0.0) == 0.0


def test_controller_adds_the_penalty_to_the_reward_of_each_episode(tmp_path):
    """The penalty reads an episode's final answer (`answer_ids`), not all its sampled tokens: the
    simulated world's two-turn episodes sample more than their answer."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "reward.overlong_penalty=0.5", "reward.overlong_buffer=12")
    world = CoinWorld(layout, build_tokenizer(), seed=1)
    world.p_right = 0.0  # every raw reward 0: the step's mean reward is the mean penalty
    run(cfg, layout, run_dir, tok_dir, world, Prompts())
    rows = metrics(run_dir)
    assert len(rows) == len(world.steps) == 12
    episodes = [[t for p in prompts for t in world.episodes[p]] for prompts in world.steps]
    assert any(t.loss_mask.sum() > len(t.answer_ids) for step in episodes for t in step)
    for row, step in zip(rows, episodes):
        want = np.mean([-0.5 * len(t.answer_ids) / 12 for t in step])  # max_new_tokens 12 = buffer
        assert row["reward/mean"] == pytest.approx(want) and want < 0


def group(trajectories: list[tuple[int, str]], rewards: list[float]) -> Group:
    """A finished group: (response length, finish reason) per trajectory."""
    g = Group(0, Example(0, "p", "1", "math", prompt_ids=np.array([5, 6], np.int32)), len(trajectories))
    for i, (n, reason) in enumerate(trajectories):
        g.trajectories[i] = single_turn(0, i, g.example.prompt_ids, np.full(n, 7), np.zeros(n), np.zeros(n), reason)
    g.rewards = rewards
    return g


@pytest.mark.parametrize("mask", [False, True])
def test_mask_truncated_trajectories(mask):
    g = group([(3, "stop"), (4, "length"), (2, "stop")], [1.0, 0.0, 0.0])
    (batch,), info = build_train_batches([g], 0, 1, 1, 64, mask_truncated=mask)
    bounds = zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])
    trained = {int(b - a - 2): int(batch.loss_mask[a:b].sum()) for a, b in bounds}  # response length -> mask
    assert trained == ({3: 3, 4: 0, 2: 2} if mask else {3: 3, 4: 4, 2: 2})
    assert info.truncated == 1
    truncated = next(a for a, b in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:]) if b - a == 6)
    assert batch.advantages[truncated + 2] != 0, "the truncated trajectory still counts in its group"
