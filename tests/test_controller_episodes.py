"""The controller's loop with episodes whose workflow raised (lost) or scored them itself, against the
simulated world of tests/support/sim_world.py: a group trains on the episodes that came back, a group with none is
left out and another prompt takes its place, more than half of a step's episodes lost ends the run with the
first traceback (its exception on the console's line), and a workflow's own reward wins over `reward.kind` (no reward request is sent for it), in
training and in the evaluation between steps.
"""

import asyncio
import io
import json
import re
import traceback
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from areal_hpc.algo.staleness import StalenessGate
from areal_hpc.controller import Controller
from areal_hpc.controller.rollouts import EpisodesLost, Rollouts, raised, single_turn
from areal_hpc.data.dataset import Example
from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.exit_codes import EXIT_DONE
from areal_hpc.layout import Role
from areal_hpc.main import _fail
from areal_hpc.protocol import Envelope, EvalTrajectory, RewardRequest, RewardResult, Trajectory
from areal_hpc.rank_context import RankContext
from tests.support.sim_world import Prompts, World, lost, make, metrics, run


def test_a_group_trains_on_the_episodes_that_came_back(tmp_path):
    """Episode 0 of every even group is lost: those prompts train n - 1 episodes, the others n, and every
    lost episode that arrived before the last row is counted in rollout/workflow_errors."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.max_staleness=1")
    world = World(layout, build_tokenizer(), seed=1, lose=lambda g, i: g % 2 == 0 and i == 0)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE
    n = cfg.rollout.group_size
    trained = Counter(world.trained_prompts)
    assert len(trained) == 12 * 4 and set(trained.values()) == {n - 1, n}
    for prompt, count in trained.items():
        assert count == sum(not t.error for t in world.episodes[prompt])
    rows = metrics(run_dir)
    lost = sum(bool(t.error) for episodes in world.episodes.values() for t in episodes)
    assert 0 < sum(r["rollout/workflow_errors"] for r in rows) <= lost
    assert sum(r["rollout/lost_groups"] for r in rows) == 0


def test_a_group_with_every_episode_lost_is_not_trained_and_another_prompt_takes_its_place(tmp_path):
    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.max_staleness=1")
    world = World(layout, build_tokenizer(), seed=2, lose=lambda g, i: g % 5 == 0)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE
    all_lost = {p for p, episodes in world.episodes.items() if all(t.error for t in episodes)}
    assert all_lost and not all_lost & set(world.trained_prompts)
    assert len(Counter(world.trained_prompts)) == 12 * 4, "every step still trains B prompts"
    assert 0 < sum(r["rollout/lost_groups"] for r in metrics(run_dir)) <= len(all_lost)


def test_more_than_half_of_a_steps_episodes_lost_stops_the_run_with_the_first_traceback(tmp_path):
    cfg, layout, run_dir, tok_dir = make(tmp_path)
    world = World(layout, build_tokenizer(), lose=lambda g, i: g >= 6 and (g + i) % 4 != 0)
    with pytest.raises(EpisodesLost, match=r"(?s)rollout\.workflow.*ZeroDivisionError: group \d+") as e:
        run(cfg, layout, run_dir, tok_dir, world, Prompts())
    errors = {t.error for episodes in world.episodes.values() for t in episodes if t.error}
    assert int(re.match(r"(\d+) of the last 12 episodes were lost", str(e.value))[1]) > 6
    assert any(str(e.value).endswith(error) for error in errors)


def test_the_workflows_own_reward_wins_over_reward_kind(tmp_path):
    """Episode 0 of each group returns its own reward 0.75; the others are scored by the reward workers,
    which answer 0 here: no reward request for the first, and each step's mean reward is 0.75 / n."""

    class Zero(World):
        def send(self, dest, msg):
            if isinstance(msg, RewardRequest):
                self.reward_requests += 1
                self.later.append((1, Envelope(dest, RewardResult(msg.request_id, 0.0, "ok"))))
                return
            super().send(dest, msg)

    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.max_staleness=1")
    world = Zero(layout, build_tokenizer(), seed=3, reward=lambda g, i: 0.75 if i == 0 else None)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE
    n = cfg.rollout.group_size
    assert all(r["reward/mean"] == pytest.approx(0.75 / n) for r in metrics(run_dir))
    sent = [t for episodes in world.episodes.values() for t in episodes]
    assert 12 * 4 * (n - 1) <= world.reward_requests <= sum(t.index != 0 for t in sent)


def test_lost_episodes_are_counted_a_steps_worth_at_a_time():
    """B = 2 prompts x n = 2: every 4 episodes as they arrive, more than 2 lost stops the run, naming the
    first lost one's traceback of those 4; exactly half goes on, and the count starts anew."""
    gate = StalenessGate(prompts_per_step=2, max_staleness=3, max_concurrent=8, version=lambda: 0)
    rollouts = Rollouts(gate, group_size=2)
    example = Example(0, "p", "1", "math", prompt_ids=np.array([5], np.int32))
    assert len(rollouts.admit(SimpleNamespace(next=lambda: example))) == 8
    for t in (episode(0, 0), lost(0, 1, "A"), lost(1, 0, "B"), episode(1, 1)):  # 2 of 4
        rollouts.add_trajectory(t)
    for t in (lost(2, 0, "C"), lost(2, 1, "D"), episode(3, 0)):
        rollouts.add_trajectory(t)
    assert rollouts.take_metrics()["rollout/lost_groups"] == 1  # group 2
    with pytest.raises(EpisodesLost, match="3 of the last 4 episodes were lost.*\n(?s:.*)C$"):
        rollouts.add_trajectory(lost(3, 1, "E"))


def test_the_console_line_of_lost_episodes_says_what_the_first_one_raised(tmp_path):
    """A failed rank's console line is its error's first line (areal_hpc.main._fail): for lost episodes it
    names the first one's exception, a message of two lines on one, not only the log to open; the error
    keeps its traceback for the log."""

    def arun_episode():
        raise ValueError("temperature=0.5 differs from rollout.temperature 1.0:\nset it in the config")

    try:
        arun_episode()
    except ValueError:
        error = traceback.format_exc()
    gate = StalenessGate(prompts_per_step=1, max_staleness=3, max_concurrent=2, version=lambda: 0)
    rollouts = Rollouts(gate, group_size=2)
    example = Example(0, "p", "1", "math", prompt_ids=np.array([5], np.int32))
    rollouts.admit(SimpleNamespace(next=lambda: example))
    rollouts.add_trajectory(lost(0, 0, error))
    with pytest.raises(EpisodesLost) as e:
        rollouts.add_trajectory(lost(0, 1, "Traceback ...\nKeyError: 'x'"))
    console, aborted = io.StringIO(), []
    _fail(SimpleNamespace(Abort=aborted.append), "controller 0", e.value, console, tmp_path / "controller-0.log")
    assert aborted == [1] and console.getvalue().count("\n") == 1
    assert console.getvalue().startswith("areal-hpc: controller 0 failed: EpisodesLost: 2 of the last 2 episodes")
    assert (
        "The first one raised ValueError: temperature=0.5 differs from rollout.temperature 1.0: set it in the "
        "config (traceback in "
    ) in console.getvalue()
    assert str(e.value).endswith(error)


def test_what_an_exception_group_raised_is_its_innermost_exception():
    """A workflow's asyncio.TaskGroup raises an ExceptionGroup, whose traceback draws the sub-exception's
    inside "  | " prefixes: the console line names the sub-exception, its message on one line."""

    async def tool():
        raise ValueError("tool 'calc' failed:\nbad input")

    async def arun_episode():
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(tool())

    try:
        asyncio.run(arun_episode())
    except ExceptionGroup:
        error = traceback.format_exc()
    assert "  |   File" in error  # the group's drawing, which hid the exception before
    assert raised(error) == "ValueError: tool 'calc' failed: bad input"
    try:
        raise ExceptionGroup("two tools", [KeyError("x"), TypeError("y")])
    except ExceptionGroup:
        assert (
            raised(traceback.format_exc()) == "ExceptionGroup: two tools (2 sub-exceptions) KeyError: 'x' TypeError: y"
        )


def episode(group_id: int, index: int) -> Trajectory:
    """A one-turn episode: prompt [5], answer [7]."""
    return single_turn(group_id, index, np.array([5], np.int32), np.array([7], np.int32), [-0.1], [0], "stop")


def test_an_eval_episode_scores_the_workflows_reward_or_0_when_lost(tmp_path):
    """Between steps: an eval episode with its own reward is scored with it, a lost one 0 (counted as a
    workflow error, not a reward error), and only the others go to a reward worker."""
    rows = [{"prompt": "1+1=", "answer": "2"}]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, layout, run_dir, tok_dir = make(tmp_path, "eval.every_steps=4", f"eval.data={data}", "eval.samples=3")
    world = World(layout, build_tokenizer())
    ctx = RankContext(cfg, layout, None, None, run_dir, tok_dir, None)
    c = Controller(ctx, mailbox=world, prompts=Prompts())
    c.start_eval()
    gen = layout.ranks(Role.GENERATOR)[0]
    answer = np.array([7], np.int32)
    c.handle(gen, EvalTrajectory(0, 0, answer, 4, "stop", reward=0.5))
    c.handle(gen, EvalTrajectory(0, 1, answer[:0], 0, "stop", error="Traceback ...\nKeyError: 'x'"))
    assert world.reward_requests == 0 and c.evals.round.rewards == [[0.5, 0.0, None]]
    c.handle(gen, EvalTrajectory(0, 2, answer, 5, "stop"))
    assert world.reward_requests == 1 and (c.evals.round.errors, c.evals.round.workflow_errors) == (0, 1)
