"""A step's batch built from episodes (areal_hpc.controller.batch): one training sequence per sequence of an episode,
exactly its tokens and loss mask; the episode's advantage on the sampled tokens of every sequence of it; a
group's sequences in one PPO minibatch; lost episodes left out; the step's episode figures."""

import numpy as np
import pytest

from areal_hpc.controller.batch import build_train_batches
from areal_hpc.controller.rollouts import Group, single_turn
from areal_hpc.data.dataset import Example
from areal_hpc.protocol import Trajectory, routing_dtype, routing_unknown
from tests.support.sim_world import lost

PROMPT = np.array([5, 6], np.int32)


def two_sequences(group_id: int, index: int, finish_reason: str = "stop") -> Trajectory:
    """Sequence 1: prompt, a turn [7 7] (v3), tool output [9] (context), a turn [8] (v4); sequence 2 (the agent
    rewrote its history): [4] (context), the prompt, the final turn [7 8 1] (v4)."""
    return Trajectory(
        group_id,
        index,
        tokens=np.array([5, 6, 7, 7, 9, 8, 4, 5, 6, 7, 8, 1], np.int32),
        seq_lens=np.array([6, 6], np.int32),
        loss_mask=np.array([0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1], np.uint8),
        behav_logprobs=np.array([0, 0, -1, -1, 0, -2, 0, 0, 0, -1, -1, -1], np.float32),
        versions=np.array([-1, -1, 3, 3, -1, 4, -1, -1, -1, 4, 4, 4], np.int32),
        answer_ids=np.array([7, 8, 1], np.int32),
        finish_reason=finish_reason,
        stats={"turns": 3, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.25, "template_rewrites": 0},
    )


def group(group_id: int, trajectories: list, rewards: list) -> Group:
    return Group(
        group_id, Example(group_id, "p", "1", "math", prompt_ids=PROMPT), len(trajectories), trajectories, rewards
    )


def sequences(batch) -> list[dict]:
    cu = batch.cu_seqlens
    keys = ("tokens", "loss_mask", "advantages", "versions", "behav_logprobs")
    return [{k: getattr(batch, k)[a:b].tolist() for k in keys} for a, b in zip(cu[:-1], cu[1:])]


def one_turn(group_id: int, index: int, n: int = 2) -> Trajectory:
    return single_turn(group_id, index, PROMPT, np.full(n, 7), np.full(n, -0.5), np.full(n, 3), "stop")


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_both_sequences_of_an_episode_train_with_its_advantage(mask_truncated):
    g = group(0, [two_sequences(0, 0, "length"), one_turn(0, 1)], [1.0, 0.0])
    (batch,), info = build_train_batches([g], 4, 1, 1, 64, mask_truncated=mask_truncated)
    seqs = sequences(batch)
    assert len(seqs) == info.sequences == 3
    first, second = (next(s for s in seqs if s["tokens"] == want) for want in ([5, 6, 7, 7, 9, 8], [4, 5, 6, 7, 8, 1]))
    assert first["versions"] == [-1, -1, 3, 3, -1, 4] and first["behav_logprobs"] == [0, 0, -1, -1, 0, -2]
    assert second["versions"] == [-1, -1, -1, 4, 4, 4]
    a = pytest.approx(1.0, abs=1e-5)  # GRPO over rewards [1, 0]
    assert first["advantages"] == [0, 0, a, a, 0, a] and second["advantages"] == [0, 0, 0, a, a, a]
    if mask_truncated:  # a 'length' episode: no loss anywhere in it, but its advantage counts in its group
        assert first["loss_mask"] == second["loss_mask"] == [0] * 6
    else:
        assert first["loss_mask"] == [0, 0, 1, 1, 0, 1] and second["loss_mask"] == [0, 0, 0, 1, 1, 1]
    assert info.response_tokens == 6 + 2 and info.truncated == 1
    assert info.turns_mean == 2.0 and info.tool_calls_mean == 0.5 and info.tool_s_mean == 0.25
    assert info.episode_tokens_mean == (12 + 4) / 2 and info.reward_mean == 0.5
    # the answers' lengths: 6 sampled tokens in the two-sequence episode (masked or not), 2 in the other
    assert info.answer_tokens == {"mean": 4.0, "median": 4.0, "p90": pytest.approx(5.6), "max": 6}


def test_a_groups_sequences_stay_in_one_minibatch_and_lost_episodes_are_left_out():
    groups = [
        group(0, [two_sequences(0, 0), one_turn(0, 1, 3), lost(0, 2, "boom")], [1.0, 0.0, None]),
        group(1, [one_turn(1, 0, 4), two_sequences(1, 1), two_sequences(1, 2)], [0.0, 0.5, 1.0]),
    ]
    batches, info = build_train_batches(groups, 4, 2, 2, 64)
    assert info.sequences == 3 + 5 and info.reward_mean == pytest.approx(2.5 / 5)
    for k in range(2):  # minibatch k holds exactly group k's sequences, over both ranks
        held = []
        for batch in batches:
            seqs = sequences(batch)
            held += [len(seqs[i]["tokens"]) for mb in batch.microbatches[k] for i in mb]
        assert sorted(held) == ([2 + 3, 6, 6] if k == 0 else [2 + 4, 6, 6, 6, 6])
    adv = {tuple(s["tokens"]): max(s["advantages"], key=abs) for b in batches for s in sequences(b)}
    assert adv[(5, 6, 7, 7, 7)] == pytest.approx(-1.0, abs=1e-5), "group 0's advantages are over its 2 kept episodes"


def routed(t: Trajectory) -> Trajectory:
    """`t` with routing [N, 2 layers, top-2]: row i holds (i, i + 1) on layer 0, (i + 2, i + 3) on layer 1."""
    n = len(t.tokens)
    t.routing = (np.arange(n)[:, None, None] + np.array([[0, 1], [2, 3]])).astype(np.uint8)
    return t


def test_routing_follows_the_tokens_and_an_episode_without_is_unknown():
    """Routing replay: each sequence's routing rows sit beside its tokens (cut like them), over both
    DP ranks; an episode without routing (a checkpoint written before) is unknown throughout."""
    groups = [
        group(0, [routed(two_sequences(0, 0)), routed(one_turn(0, 1, 3))], [1.0, 0.0]),
        group(1, [one_turn(1, 0, 4), routed(two_sequences(1, 1))], [0.0, 1.0]),
    ]
    batches, _ = build_train_batches(groups, 4, 2, 1, 64)
    rows = {}
    for batch in batches:
        assert batch.routing.shape == (len(batch.tokens), 2, 2) and batch.routing.dtype == np.uint8
        cu = batch.cu_seqlens
        for a, b in zip(cu[:-1], cu[1:]):
            rows.setdefault(tuple(batch.tokens[a:b]), []).append(batch.routing[a:b, 0, 0].tolist())
    assert rows[(5, 6, 7, 7, 9, 8)] == [list(range(6))] * 2  # the first sequence of each two_sequences
    assert rows[(4, 5, 6, 7, 8, 1)] == [list(range(6, 12))] * 2  # the second: rows 6..11 of its episode
    assert rows[(5, 6, 7, 7, 7)] == [list(range(5))]
    assert rows[(5, 6, 7, 7, 7, 7)] == [[255] * 6]  # no routing: unknown (protocol.routing_unknown)
    (plain,), _ = build_train_batches([group(0, [one_turn(0, 0), one_turn(0, 1)], [1.0, 0.0])], 4, 1, 1, 64)
    assert plain.routing is None  # no routing replay: nothing carried


def test_a_checkpointed_group_keeps_its_routing_and_an_older_one_loads_without():
    g = group(0, [routed(two_sequences(0, 0)), one_turn(0, 1)], [1.0, 0.0])
    restored = Group.from_state(g.to_state())
    np.testing.assert_array_equal(restored.trajectories[0].routing, g.trajectories[0].routing)
    assert restored.trajectories[1].routing is None
    older = g.to_state()
    for t in older["trajectories"]:
        del t["routing"]
    assert [t.routing for t in Group.from_state(older).trajectories] == [None, None]


def test_routing_ids_fit_the_smallest_dtype_with_room_for_unknown():
    assert routing_dtype(4) == routing_dtype(254) == np.uint8 and routing_unknown(np.uint8) == 255
    assert routing_dtype(255) == routing_dtype(512) == np.int16 and routing_unknown(np.int16) == 32767
