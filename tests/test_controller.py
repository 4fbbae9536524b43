"""The controller's loop against a simulated world (no MPI, tests/support/sim_world.py): generators whose
trajectories take random times and carry the version of the weights they were sampled with, reward
workers, a trainer that checks what it is given. The real staleness gate, buffer, advantages, packer,
metrics and checkpoint code run; only the other ranks are simulated.

What must hold: the staleness bound on every step (also synchronous at max_staleness = 0), every
prompt trained on at most once, a stop checkpoints and a resumed controller continues the step count
without training on the same prompts again, and a rank that stops answering ends the run naming it.
"""

import copy
import json
import logging
import pickle
import re
from collections import Counter

import numpy as np
import pytest

from areal_hpc.checkpoint.controller import Checkpoints, read_state
from areal_hpc.checkpoint.files import checkpoint_dir, latest_checkpoint, record_files
from areal_hpc.checkpoint.in_flight import read_in_flight, write_in_flight
from areal_hpc.config import load_config
from areal_hpc.controller import Controller
from areal_hpc.controller.rollouts import Group, Rollouts, single_turn
from areal_hpc.data.dataset import Example
from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.errors import RankFailure
from areal_hpc.exit_codes import EXIT_DONE, EXIT_STOPPED, STOP_REASON_ENV
from areal_hpc.layout import Layout, Role
from areal_hpc.metrics import REQUIRED
from areal_hpc.protocol import GenerateRequest, SavedTurn, context_digest
from areal_hpc.rank_context import RankContext
from tests.support.sim_world import Prompts, World, lost, make, metrics, run


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_bound_and_every_prompt_once(tmp_path, eta):
    cfg, layout, run_dir, tok_dir = make(tmp_path, f"rollout.max_staleness={eta}")
    world = World(layout, build_tokenizer(), seed=eta)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        assert set(REQUIRED) <= set(r) and r["ppo/loss"] == 0.1
        assert 0 <= r["staleness/max"] <= eta
        assert 0 <= r["timing/gen_idle_frac"] <= 1 and 0 <= r["timing/train_idle_frac"] <= 1
    assert sum(r["reward/errors"] for r in rows) > 0
    # the episodes' figures (tests/support/sim_world.py: a third each of one turn, two turns around a tool call of
    # 0.5 s, two sequences)
    assert all(1 < r["rollout/turns_mean"] < 2 and 0 < r["rollout/tool_calls_mean"] < 1 for r in rows)
    assert all(r["rollout/tool_s_mean"] == 0.5 and r["rollout/episode_tokens_mean"] > 0 for r in rows)
    assert all(
        0 < r["rollout/answer_tokens_median"] <= r["rollout/answer_tokens_p90"] <= r["rollout/answer_tokens_max"]
        for r in rows
    )
    assert sum(r["rollout/tool_errors"] for r in rows) > 0 and sum(r["rollout/template_rewrites"] for r in rows) > 0
    assert sum(r["rollout/workflow_errors"] + r["rollout/lost_groups"] for r in rows) == 0
    if eta == 0:  # synchronous: each step trains what the weights of that very version generated
        assert all(r["staleness/max"] == 0 and r["staleness/dropped"] == 0 for r in rows)
    assert eta == 0 or max(r["staleness/max"] for r in rows) > 0  # asynchronous: it does run ahead
    # groups finish in any order, yet none is dropped: the schedule holds a step back for an old one instead
    assert sum(r["staleness/dropped"] for r in rows) == 0
    assert eta != 1 or sum(r["staleness/wait_s"] for r in rows) > 0  # with this seed it does wait
    longest = max(r["rollout/answer_tokens_max"] for r in rows)
    assert all(0 < r[f"rollout/{k}_tokens_p90"] <= longest for r in rows for k in ("generated", "trained"))
    assert rows[0]["rollout/trained_tokens_p90"] == rows[0]["rollout/answer_tokens_p90"]  # the window: one step yet
    n = cfg.rollout.group_size
    assert len(world.trained_prompts) == 12 * 4 * n
    assert set(Counter(world.trained_prompts).values()) == {n}, "a prompt was trained on twice"
    assert world.continued and set(world.continued) <= set(world.trained_prompts), "second sequences trained"
    assert world.stopped == set(range(1, layout.world_size))
    assert latest_checkpoint(run_dir).name == "step_12"


def test_weight_sync_times_are_the_slowest_generators(tmp_path):
    """timing/weight_sync_s and timing/sync_drain_s are the latest completed sync's slowest load and slowest
    drain, each kept apart: with two generators the first reports a load of 0.02 s, the second, last,
    0.01 s; their drains of 0.03 s and 0.06 s change places from one version to the next.
    timing/weight_sync_bytes is what that sync brought a generator (1000 bytes x its version here)."""
    cfg, layout, run_dir, tok_dir = make(
        tmp_path, "cluster.gpus_per_node=2", "allocation.gen_gpus=2", "train.total_steps=4"
    )
    assert len(layout.ranks(Role.GENERATOR)) == 2
    _, code = run(cfg, layout, run_dir, tok_dir, World(layout, build_tokenizer()), Prompts())
    assert code == EXIT_DONE
    rows = metrics(run_dir)
    assert [r["timing/weight_sync_s"] for r in rows][1:] == [0.02] * 3
    assert [r["timing/sync_drain_s"] for r in rows][1:] == [0.06] * 3
    assert [r["timing/weight_sync_bytes"] for r in rows] == [0, 1000, 2000, 3000]  # the sync before the step


def test_the_log_and_the_metrics_number_a_step_alike(tmp_path, caplog):
    """A step's number is the policy version after it (steps completed): the controller's "step N trains
    prompts" line and the metrics row of that step say the same N, and so does the step's checkpoint."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "train.total_steps=3", "train.save_every=3")
    with caplog.at_level("INFO", logger="areal_hpc.controller"):
        _, code = run(cfg, layout, run_dir, tok_dir, World(layout, build_tokenizer()), Prompts())
    assert code == EXIT_DONE
    logged = [int(r.getMessage().split()[1]) for r in caplog.records if " trains prompts " in r.getMessage()]
    assert logged == [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert latest_checkpoint(run_dir).name == "step_3"


def test_each_replica_gets_its_batch_once_at_its_first_rank(tmp_path):
    """Trainer TP 2 x PP 2 x DP 2: one TrainBatch per replica and step, to its first rank (which relays
    it); the Saves and the Stop reach every trainer rank the same way."""
    over = ["cluster.gpus_per_node=8", "allocation.gen_gpus=8", "allocation.train_tp=2", "allocation.train_pp=2"]
    over.append("rollout.max_staleness=1")
    cfg, layout, run_dir, tok_dir = make(tmp_path, *over)
    assert layout.train_dp == 2 and len(layout.ranks(Role.TRAINER)) == 8
    world = World(layout, build_tokenizer(), seed=1)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE
    firsts = [layout.replica_ranks(d)[0] for d in range(2)]
    assert world.batch_dests == [(v, rank) for v in range(12) for rank in firsts]
    assert latest_checkpoint(run_dir).name == "step_12", "every trainer rank's Saved arrived"
    assert world.stopped == set(range(1, layout.world_size))


@pytest.mark.parametrize("older_checkpoint", [False, True])
def test_stop_checkpoints_and_resume_continues_without_reusing_data(tmp_path, older_checkpoint):
    """With `older_checkpoint`, the controller state is rewritten as the code before the prompt was held
    once saved it (the prompt's token ids in every buffered group and trajectory too): it resumes alike."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.max_staleness=2")
    tok = build_tokenizer()
    first = World(layout, tok, seed=1)
    c, code = run(cfg, layout, run_dir, tok_dir, first, Prompts(), stop_at=7)
    assert code == EXIT_STOPPED
    assert latest_checkpoint(run_dir).name == "step_7"
    if older_checkpoint:
        rewrite_as_before_the_prompt_was_held_once(latest_checkpoint(run_dir))
    state = json.loads((latest_checkpoint(run_dir) / "controller.json").read_text())
    assert state["version"] == 7
    steps_before = [r["step"] for r in metrics(run_dir)]
    assert steps_before == list(range(1, 8))

    second = World(layout, tok, seed=2)
    second.trainer_version = 7  # the trainers load step_7
    c2, code = run(cfg, layout, run_dir, tok_dir, second, Prompts())
    assert code == EXIT_DONE
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))
    n = cfg.rollout.group_size
    trained = Counter(first.trained_prompts + second.trained_prompts)
    assert len(trained) == 12 * 4
    assert set(trained.values()) == {n}, "a prompt was trained on before and after the resume"
    # The gate did not admit more after the resume than the uninterrupted run could have.
    g = c2.rollouts.gate.state
    assert g.accepted + g.running <= (cfg.rollout.max_staleness + 12 + 1) * 4


@pytest.mark.parametrize("eta_at_resume", [2, 0])
def test_answers_in_flight_at_a_stop_go_on_from_their_tokens_after_the_resume(tmp_path, caplog, eta_at_resume):
    """Long answers (up to 40 ticks, a token each) stopped at version 7: the generators' answers in flight are in
    the checkpoint, and after the resume, on 2 generators instead of 1, each goes on from the tokens and versions it had (the trajectory's sampled
    versions begin with them), counted in rollout/resumed_tokens of the steps that train them; every step once,
    every prompt trained once, the bound kept on every step (the simulated trainer checks it). Resumed at
    max_staleness 0, what was sampled before version 7 is too old for the next step: dropped, counted, sampled
    again."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.max_staleness=2")
    tok = build_tokenizer()
    first = World(layout, tok, seed=3, max_ticks=40)
    _, code = run(cfg, layout, run_dir, tok_dir, first, Prompts(), stop_at=7)
    assert code == EXIT_STOPPED
    checkpoint = latest_checkpoint(run_dir)
    saved = read_in_flight(checkpoint, 7)
    assert saved and all(len(turns[0].token_ids) for turns in saved.values())
    assert {f"in-flight-{g}.pkl" for g in layout.ranks(Role.GENERATOR)} <= set(
        json.loads((checkpoint / "FILES.json").read_text())["files"]
    )

    resume_cfg = copy.deepcopy(cfg)
    resume_cfg.rollout.max_staleness = eta_at_resume
    resume_cfg.cluster.gpus_per_node, resume_cfg.allocation.gen_gpus = 2, 2  # and 2 generators, not 1
    second = World(Layout.from_config(resume_cfg), tok, seed=4, max_ticks=40)
    second.trainer_version = 7
    with caplog.at_level(logging.INFO, logger="areal_hpc.controller"):
        _, code = run(resume_cfg, second.layout, run_dir, tok_dir, second, Prompts())
    assert code == EXIT_DONE
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))
    trained = Counter(first.trained_prompts + second.trained_prompts)
    assert set(trained.values()) == {cfg.rollout.group_size}, "every prompt trained once, each of its episodes"
    carried = re.search(r"(\d+) answers in flight \((\d+) tokens\).*: (\d+) answers \((\d+) tokens\)", caplog.text)
    kept, dropped = int(carried[2]), int(carried[4])
    assert kept + dropped == sum(len(turns[0].token_ids) for turns in saved.values())
    if eta_at_resume == 0:
        assert kept == 0 and dropped > 0 and not second.resumed
        return
    assert kept > 0 and dropped == 0 and len(second.resumed) == int(carried[1])
    for (prompt, index), (_, versions) in second.resumed.items():
        assert versions and max(versions) < 7  # sampled before the stop
        traj = next(t for t in second.episodes[prompt] if t.index == index)
        assert traj.versions[traj.loss_mask == 1][: len(versions)].tolist() == versions
    resumed_rows = [r["rollout/resumed_tokens"] for r in metrics(run_dir) if r["step"] > 7]
    assert sum(resumed_rows) == kept, "every carried token is trained once, in the row of its step"


def test_a_carried_group_whose_last_episodes_came_back_lost_as_it_was_saved_finishes_when_admitted():
    """A running group saved with every episode back (two scored, the last one lost while the generator saved):
    nothing is left to generate or score, so its admission after the resume finishes it into the buffer, rather
    than leaving it running, holding its gate slot and the schedule for ever."""
    cfg = load_config("configs/tiny-cpu.yaml", ["rollout.group_size=3", "rollout.prompts_per_step=1"])
    example = Prompts().next()
    ids = np.asarray(example.prompt_ids, np.int32)
    episodes = [single_turn(5, i, ids, [7, 8], [-1.0, -1.0], [2, 2], "stop") for i in range(2)]
    group = Group(5, example, 3, [*episodes, lost(5, 2, "Traceback ...\nValueError")], [1.0, 0.0, None], admitted=2)
    rollouts = Rollouts.from_config(cfg.rollout, version=lambda: 3)
    gate = {"running": 1, "accepted": 3, "consumed": 3, "rejected": 0, "dropped": 0, "dropped_trajectories": 0}
    state = {"gate": gate, "requeued": [], "running": [group.to_state()], "buffer": [], "next_group_id": 6}
    carried = rollouts.load_state_dict(state, {})
    assert carried["groups"] == 1 and carried["episodes"] == 3
    started = rollouts.admit(Prompts())  # group 5, then new prompts in the room it leaves
    assert started[0].group_id == 5 and started[0].complete
    assert 5 not in rollouts.running and [g.group_id for g in rollouts.buffer] == [5]
    assert rollouts.gate.state.accepted == 4 and rollouts.gate.state.running == len(started) - 1


def test_a_version_saved_again_keeps_no_answers_of_its_unfinished_save(tmp_path):
    """A save of version 4 died before COMPLETE, written by generator ranks the run no longer has; the run resumed
    from an earlier checkpoint and saves version 4 again: the old save's answers in flight (and a half-written
    file) go at the start, so the new checkpoint holds and records only its own generators'."""
    path = checkpoint_dir(tmp_path, 4)
    path.mkdir(parents=True)
    turn = SavedTurn(context_digest([1, 2]), np.array([3], np.int32), np.zeros(1, np.float32), np.array([4], np.int32))
    write_in_flight(path, 7, 4, {(1, 0): [turn]})
    (path / "in-flight-3.tmp").write_bytes(b"half")
    Checkpoints(tmp_path, keep=0, resume_from=None).begin(4, {"running": []}, [2])
    assert not list(path.glob("in-flight-*")) and read_in_flight(path, 4) == {}


def test_a_data_rows_other_fields_reach_the_generators_and_survive_a_resume(tmp_path):
    """A JSONL row's own fields (here an agent task's environment) are in every GenerateRequest.row for it
    (the controller's own prompt stream reads the file), and in the controller checkpoint: the groups
    running at a stop are asked for again after the resume with them."""
    path = tmp_path / "agent.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "env": f"env{i}"}) + "\n" for i in range(100))
    )
    cfg, layout, run_dir, tok_dir = make(tmp_path, f"data.train_path={path}", "rollout.max_staleness=2")
    requests = []

    class Recording(World):
        def send(self, dest, msg):
            if isinstance(msg, GenerateRequest):
                requests.append(msg.row)
            super().send(dest, msg)

    def row(i: int) -> dict:
        return {"prompt": f"{i}+1=", "target": str(i + 1), "kind": "math", "env": f"env{i}"}

    _, code = run(cfg, layout, run_dir, tok_dir, Recording(layout, build_tokenizer(), seed=1), None, stop_at=7)
    assert code == EXIT_STOPPED and len(requests) >= 7 * 4
    assert all(r == row(int(r["prompt"].split("+")[0])) for r in requests)
    state = read_state(latest_checkpoint(run_dir))
    assert state["running"], "the test means a stop with groups running"
    for example in [g["example"] for g in state["running"] + state["buffer"]]:
        assert example.row == row(int(example.prompt.split("+")[0]))
    requests.clear()
    second = Recording(layout, build_tokenizer(), seed=2)
    second.trainer_version = 7  # the trainers load step_7
    _, code = run(cfg, layout, run_dir, tok_dir, second, None)
    assert code == EXIT_DONE
    asked = [g["example"].row for g in state["running"] if None in g["trajectories"]]  # some episode to run
    assert asked and requests[: len(asked)] == asked


def rewrite_as_before_the_prompt_was_held_once(path):
    """The controller state of checkpoint `path` as the code before the prompt was held once wrote it: the
    prompt's token ids in every group and trajectory, a trajectory its sampled tokens only (`output_ids`:
    before episodes), Examples without `extra` (before rows kept their other fields), and the running
    groups as their prompts only, without the generators' answers in flight (before those were kept)."""
    with open(path / "controller.pkl", "rb") as f:
        state = pickle.load(f)
    assert state["buffer"] and state["running"], "the test means a checkpoint with buffered and running groups"
    state["requeued"] = [group["example"] for group in state.pop("running")]
    for file in path.glob("in-flight-*.pkl"):
        file.unlink()
    for example in state["requeued"] + [group["example"] for group in state["buffer"]]:
        del example.__dict__["extra"]
    for group in state["buffer"]:
        group["prompt_ids"] = np.asarray(group["example"].prompt_ids, np.int32)
        for i, t in enumerate(group["trajectories"]):
            sampled = t["loss_mask"] == 1
            group["trajectories"][i] = {
                "group_id": t["group_id"],
                "index": t["index"],
                "prompt_ids": group["prompt_ids"],
                "output_ids": t["tokens"][sampled],
                "behav_logprobs": t["behav_logprobs"][sampled],
                "versions": t["versions"][sampled],
                "finish_reason": t["finish_reason"],
            }
    with open(path / "controller.pkl", "wb") as f:
        pickle.dump(state, f)
    record_files(path)  # the checkpoint's checksums, of this file too


def old_trajectories(ids, index_name="index") -> list[dict]:
    """Two trajectories of group 3 as controller checkpoints before episodes saved them (the prompt's token
    ids in each, the sampled ones as `output_ids`)."""
    return [
        {"group_id": 3, index_name: i, "prompt_ids": ids, "output_ids": ids + i, "behav_logprobs": np.full(2, -0.5, np.float32),
         "versions": np.array([4, 5], np.int32), "finish_reason": "stop"}
        for i in range(2)
    ]  # fmt: skip


def test_a_checkpoint_from_before_the_rename_of_sample_idx_restores():
    """Controller checkpoints written before `Trajectory.index` saved it as sample_idx."""
    ids = np.array([7, 8], np.int32)
    example = Example(0, "p", "1", "math", prompt_ids=ids)
    state = {
        "group_id": 3,
        "example": example,
        "n": 2,
        "rewards": [0.0, 1.0],
        "trajectories": old_trajectories(ids, "sample_idx"),
    }
    assert [t.index for t in Group.from_state(state).trajectories] == [0, 1]


def test_a_checkpoint_that_holds_the_prompt_in_every_group_and_trajectory_restores():
    """Controller checkpoints written before the prompt was held once (and before episodes): each group's
    state has its prompt's token ids beside its Example, and each trajectory has them too, with its sampled
    tokens as `output_ids`. The group restores with the Example's (the one copy), each trajectory as the
    one-turn episode of that prompt and answer, and saves the prompt only in the Example."""
    ids = np.array([7, 8], np.int32)
    example = Example(0, "p", "1", "math", prompt_ids=ids)
    old = {
        "group_id": 3,
        "example": example,
        "prompt_ids": ids,
        "n": 2,
        "rewards": [0.0, 1.0],
        "trajectories": old_trajectories(ids),
    }
    group = Group.from_state(old)
    assert group.example.prompt_ids is ids and [t.index for t in group.trajectories] == [0, 1]
    assert [list(t.tokens) for t in group.trajectories] == [[7, 8, 7, 8], [7, 8, 8, 9]] and group.rewards == [0.0, 1.0]
    for i, t in enumerate(group.trajectories):
        assert list(t.seq_lens) == [4] and list(t.answer_ids) == list(ids + i) and not t.error
        assert list(t.loss_mask) == [0, 0, 1, 1] and list(t.versions) == [-1, -1, 4, 5]
        assert list(t.behav_logprobs) == [0, 0, -0.5, -0.5]
    assert group.oldest_version == 4
    state = group.to_state()
    assert "prompt_ids" not in state and not any("prompt_ids" in t for t in state["trajectories"])
    assert [list(t.tokens) for t in Group.from_state(state).trajectories] == [[7, 8, 7, 8], [7, 8, 8, 9]]


def test_a_checkpoint_from_before_the_data_package_restores(tmp_path):
    """Controller checkpoints written while the prompts' module was areal_hpc.data (now areal_hpc.data.dataset)
    name Example there: read_state finds it where it moved (checkpoint.controller.MOVED)."""
    example = Example(0, "p", "1", "math", prompt_ids=np.array([7, 8], np.int32))
    data = pickle.dumps({"requeued": [example]}, protocol=2)  # protocol 2 names a class as text: module, name
    moved = b"careal_hpc.data.dataset\nExample\n"
    assert moved in data
    (tmp_path / "controller.pkl").write_bytes(data.replace(moved, b"careal_hpc.data\nExample\n"))
    with pytest.raises(AttributeError):  # what a plain unpickler makes of it
        pickle.loads((tmp_path / "controller.pkl").read_bytes())
    assert read_state(tmp_path)["requeued"] == [example]


@pytest.mark.parametrize("grace_s", [60, 0])
def test_preemption_checkpoints_if_there_is_time_else_stops_at_once(tmp_path, monkeypatch, grace_s):
    """SIGTERM (Slurm's preemption) with cluster.grace_s left, at version 7 with step_5 complete: the
    running step and a save fit in 60 s, so the run checkpoints there; in 0 s nothing fits, so it stops at
    once and the resumed run goes on from step_5, training the steps after it again (their old metrics
    lines go). Step 7's result waits until step_5 is complete (its files are recorded on the checkpoint
    thread, which may lag any number of steps), so the stop always comes at version 7, before step 8."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, f"cluster.grace_s={grace_s}")
    monkeypatch.setenv(STOP_REASON_ENV, str(tmp_path / "stop_reason"))  # what the batch script reads
    tok = build_tokenizer()
    world = World(layout, tok, seed=1, hold=lambda c, version: version >= 7 and c.ckpt.saved_version < 5)
    at_7 = lambda c: c.version >= 7 and c.ckpt.saved_version >= 5  # noqa: E731
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts(), signal="SIGTERM", stop_when=at_7)
    assert code == EXIT_STOPPED and c.stop.at_once == (grace_s == 0)
    assert c.version == 7
    assert (tmp_path / "stop_reason").read_text() == "SIGTERM\n"
    resumed_from = c.version if grace_s else 5
    assert latest_checkpoint(run_dir).name == f"step_{resumed_from}"
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, c.version + 1))

    second = World(layout, tok, seed=2)
    second.trainer_version = resumed_from
    c2, code = run(cfg, layout, run_dir, tok_dir, second, Prompts())
    assert code == EXIT_DONE
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13)), "every step exactly once"
    assert max(r["staleness/max"] for r in rows) <= cfg.rollout.max_staleness


def test_time_based_saves_keep_the_newest_and_report_the_stall(tmp_path):
    # save_every never comes; every step ends more than the interval after the last save began
    cfg, layout, run_dir, tok_dir = make(
        tmp_path, "train.save_every=100", "train.save_interval_min=0.00001", "train.keep_checkpoints=2"
    )
    c, code = run(cfg, layout, run_dir, tok_dir, World(layout, build_tokenizer(), seed=3), Prompts())
    assert code == EXIT_DONE
    left = sorted((run_dir / "checkpoints").iterdir(), key=lambda d: int(d.name.split("_")[1]))
    assert [d.name for d in left] == ["step_11", "step_12"]
    assert all((d / "COMPLETE").exists() and (d / "FILES.json").exists() for d in left)
    rows = metrics(run_dir)
    assert all(r["timing/save_s"] >= 0 for r in rows) and sum(r["timing/save_s"] > 0 for r in rows) >= 5


def test_a_rank_that_stops_answering_ends_the_run_naming_it(tmp_path):
    # a rank's first answer may take startup_timeout_s + collective_timeout_s (its start-up broadcast)
    timeouts = ("train.rank_timeout_s=0.5", "train.startup_timeout_s=0.3", "train.collective_timeout_s=0.2")
    cfg, layout, run_dir, tok_dir = make(tmp_path, *timeouts)
    reward_rank = layout.ranks(Role.REWARD)[0]
    world = World(layout, build_tokenizer(), hang=reward_rank)
    with pytest.raises(RankFailure, match=r"reward 0 \(world rank 1\) has not answered"):
        run(cfg, layout, run_dir, tok_dir, world, Prompts())


def test_liveness_names_the_rank_silent_longest_and_ignores_idle_time():
    from areal_hpc.controller.liveness import Liveness

    lay = Layout.from_config(load_config("configs/tiny-cpu.yaml"))
    live = Liveness(lay, timeout_s=10, startup_s=30)
    gen, trainer = lay.ranks(Role.GENERATOR)[0], lay.ranks(Role.TRAINER)[0]
    for r in (gen, trainer):
        live.heard(r, 0.0)
    live.check(1000.0)  # nothing outstanding: silence is fine
    live.expect(trainer, 1000.0, "training step 3")  # idle time before this does not count
    live.check(1009.0)
    live.expect(gen, 1005.0, "the weight sync of version 4")  # waits for the trainer, falls silent later
    with pytest.raises(
        RankFailure, match=r"^trainer 0 \(world rank 3\) has not answered for 16 s.*also silent: generator 0"
    ):
        live.check(1016.0)
    live.heard(gen, 990.0)  # silent longer than the trainer, but inside a weight sync: the trainer is named
    with pytest.raises(RankFailure, match=r"^trainer 0 \(world rank 3\)"):
        live.check(1016.0)
    live.done(gen)
    live.expect(gen, 995.0, "a generation")  # silent longest, not waiting on anyone: named first
    with pytest.raises(RankFailure, match=r"^generator 0 \(world rank 2\)"):
        live.check(1016.0)
    live.done(trainer)
    live.done(gen)
    live.check(2000.0)


def test_bad_training_data_fails_the_controller_with_the_loaders_error(tmp_path):
    from areal_hpc.config import ConfigError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    cfg, layout, run_dir, tok_dir = make(tmp_path, f"data.train_path={bad}")
    ctx = RankContext(cfg, layout, None, None, run_dir, tok_dir, None)
    with pytest.raises(ConfigError, match=f"{bad}:2: field 'answer'"):
        Controller(ctx, mailbox=World(layout, build_tokenizer()))


@pytest.mark.slow  # about 3 s
def test_a_resume_with_other_operational_settings_goes_on_and_the_controller_says_so(tmp_path, caplog):
    """Issue 32's case: stopped at step 7, resumed saving every 4 steps (not 5), printing every 3, for
    longer: the run goes on from step_7 with the new cadence, and the controller's log names each change."""
    cfg, layout, run_dir, tok_dir = make(tmp_path)
    tok = build_tokenizer()
    c, code = run(cfg, layout, run_dir, tok_dir, World(layout, tok, seed=1), Prompts(), stop_at=7)
    assert code == EXIT_STOPPED and latest_checkpoint(run_dir).name == "step_7"
    cfg2, layout, run_dir, tok_dir = make(
        tmp_path, "train.save_every=4", "logging.progress_every=3", "cluster.time=02:00:00"
    )
    second = World(layout, tok, seed=2)
    second.trainer_version = 7
    with caplog.at_level(logging.INFO, logger="areal_hpc.controller"):
        c2, code = run(cfg2, layout, run_dir, tok_dir, second, Prompts())
    assert code == EXIT_DONE
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))
    said = [r.getMessage() for r in caplog.records if "settings changed since this checkpoint" in r.getMessage()]
    assert len(said) == 1
    for change in ("train.save_every: 5 -> 4", "logging.progress_every: 10 -> 3", "cluster.time: 00:30:00 -> 02:00:00"):
        assert f"{change}  (operational)" in said[0]
    assert (run_dir / "checkpoints" / "step_8" / "COMPLETE").exists()  # saved at the new cadence


@pytest.mark.parametrize("harm", ["damaged", "missing", "unreadable"])
def test_a_checkpoint_whose_answers_in_flight_are_bad_resumes_without_them(tmp_path, caplog, harm):
    """A generator's in-flight file damaged (its CRC-32 no longer the recorded one), gone, or not a pickle
    (recorded as such): the checkpoint still counts, the resume leaves the file out with a warning naming
    it, and those episodes run again from their rows: every step and prompt once."""
    cfg, layout, run_dir, tok_dir = make(tmp_path, "rollout.max_staleness=2")
    tok = build_tokenizer()
    first = World(layout, tok, seed=3, max_ticks=40)
    assert run(cfg, layout, run_dir, tok_dir, first, Prompts(), stop_at=7)[1] == EXIT_STOPPED
    checkpoint = latest_checkpoint(run_dir)
    (file,) = checkpoint.glob("in-flight-*.pkl")
    assert read_in_flight(checkpoint, 7), "the test means answers in flight"
    if harm == "damaged":
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    elif harm == "missing":
        file.unlink()
    else:
        file.write_bytes(b"not a pickle")
        record_files(checkpoint)
    assert latest_checkpoint(run_dir) == checkpoint, "the checkpoint counts without its answers in flight"
    second = World(layout, tok, seed=4, max_ticks=40)
    second.trainer_version = 7
    with caplog.at_level(logging.WARNING):
        assert run(cfg, layout, run_dir, tok_dir, second, Prompts())[1] == EXIT_DONE
    assert f"{file.name} " in caplog.text and "its answers in flight are left out and run again" in caplog.text
    assert not second.resumed
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))
    trained = Counter(first.trained_prompts + second.trained_prompts)
    assert set(trained.values()) == {cfg.rollout.group_size}
