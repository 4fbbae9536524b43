"""Episodes on a real vLLM engine (areal_hpc.generator.episodes), on a tiny Qwen2 model built here.

The runner is pumped as the generator's loop pumps it (`advance`), and the test loads weights between two
rounds as a WeightSync would. A scripted workflow samples a turn, waits for the test's asyncio.Event
(rows that ask for it), calls a tool, appends the tool's tokens and samples a second turn; so a weight
update can land inside turn 1 or while the episode waits between turns. Every sampled token is held to
transformers' logprobs under the weights of its version, each turn given the exact tokens the engine saw.
The tool pool is a stand-in with ToolPool's interface that can hold calls back (the runner's part is
what is tested: an episode waiting on a tool holds no vLLM request and holds up no other episode).
"""

import asyncio
import logging
import math

import numpy as np
import pytest
import torch

from areal_hpc.config import RolloutConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.device import resolve_device
from areal_hpc.protocol import EPISODE_STATS, EvalTrajectory, GenerateRequest, Trajectory
from areal_hpc.workflow import Workflow
from tests.support.generator_runs import load, perturb, reference_logprobs, run_episodes
from tests.support.shapes import GENERATOR

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPERATURE = 0.8
MAX_NEW = 16
TOL = 1e-3
EOS = 1
TOOL_IDS = [40, 41, 42]
"""The tool message's tokens the scripted workflow appends before its second turn."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from areal_hpc.generator.engine import GenerationEngine

    path = build_tiny_model(GENERATOR, tmp_path_factory.mktemp("episodes"), seed=1)
    engine = GenerationEngine.create(
        path, device=resolve_device(), temperature=TEMPERATURE, max_model_len=256, max_num_seqs=32, seed=0
    )
    model_a = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model_b = perturb(Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), seed=5)
    yield engine, AutoTokenizer.from_pretrained(str(path)), model_a, model_b
    engine.close()


class Pool:
    """ToolPool's interface (areal_hpc.workflow.tools) in this process: a call is answered at the next poll,
    except calls of the tools in `held`, answered only once the test empties `held`."""

    def __init__(self):
        self.held: set[str] = set()
        self.calls: list[tuple] = []  # (key, name, arguments), in order
        self.closed = False

    def submit(self, key, name, arguments):
        self.calls.append((key, name, arguments))

    def poll(self, wait_s=0.0):
        ready = [c for c in self.calls if c[1] not in self.held]
        self.calls = [c for c in self.calls if c[1] in self.held]
        return [(key, f"{name} says hi", True, 0.25) for key, name, _ in ready]

    def close(self):
        self.closed = True


class Scripted(Workflow):
    """Turn 1; the row's `wait`: wait for `gate`; the `fail`-th episode started raises the row's `exception`
    (RuntimeError) here; a call of the row's `tool` with its `arguments`; turn 2 after prompt + turn 1 +
    TOOL_IDS; returns the row's `reward`."""

    def __init__(self):
        self.gate: asyncio.Event | None = None  # made by the test, in the running loop
        self.waiting = 0
        self.started = 0
        self.tool_outputs: list[str] = []

    async def arun_episode(self, client, row):
        self.started += 1
        me = self.started
        first = await client.generate(row["prompt_ids"])
        if row.get("wait"):
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1
        if me == row.get("fail"):
            raise row.get("exception", RuntimeError)("the workflow failed on purpose")
        self.tool_outputs.append(await client.run_tool(row.get("tool", "echo"), row.get("arguments", {"text": "x"})))
        await client.generate(row["prompt_ids"] + first.token_ids + TOOL_IDS)
        return row.get("reward")


def runner_of(engine, tokenizer, workflow, pool=None, **rollout):
    from areal_hpc.generator.episodes import EpisodeRunner

    cfg = RolloutConfig(temperature=TEMPERATURE, max_new_tokens=MAX_NEW, **rollout)
    pool = pool or Pool()
    return EpisodeRunner(engine, workflow, tokenizer, cfg, lambda: pool)


def request(group: int, prompt: list[int], n: int, **row) -> GenerateRequest:
    return GenerateRequest(group, np.asarray(prompt, np.int32), {"prompt": "", "target": "", "kind": "math", **row}, n)


async def pump(runner, replies: list, until, rounds: int = 2000) -> None:
    """Advance the runner until `until()` holds, collecting the replies."""
    for _ in range(rounds):
        if until():
            return
        replies += await runner.advance()
    raise AssertionError(f"not reached in {rounds} rounds")


def sampled_runs(t: Trajectory) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens (loss_mask 1): the turns, in order."""
    mask = np.concatenate([[0], t.loss_mask.astype(int), [0]])
    edges = np.flatnonzero(np.diff(mask))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def check_scripted(t: Trajectory, prompt: list[int], tool_s: float = 0.25) -> tuple[list[int], list[int]]:
    """The layout of a Scripted episode: prompt, turn 1, TOOL_IDS, turn 2 in one sequence, context tokens at
    version -1 and logprob 0; returns turn 1's and turn 2's tokens."""
    assert not t.error, t.error
    (s1, e1), (s2, e2) = sampled_runs(t)
    tokens = t.tokens.tolist()
    assert (s1, s2, e2) == (len(prompt), e1 + len(TOOL_IDS), len(tokens))
    assert tokens[:s1] == prompt and tokens[e1:s2] == TOOL_IDS
    assert t.seq_lens.tolist() == [len(tokens)] and t.answer_ids.tolist() == tokens[s2:]
    context = t.loss_mask == 0
    assert (t.versions[context] == -1).all() and (t.behav_logprobs[context] == 0).all()
    assert (t.versions[~context] >= 0).all()
    assert t.stats["turns"] == 2 and t.stats["tool_calls"] == 1 and t.stats["tool_s"] == tool_s
    assert t.finish_reason == ("stop" if tokens[-1] == EOS else "length")
    return tokens[s1:e1], tokens[s2:]


def check_logprobs(t: Trajectory, start: int, end: int, model) -> None:
    """Tokens [start, end) of `t` against transformers' logprobs under `model`, given all that precedes them."""
    tokens = t.tokens.tolist()
    ref = reference_logprobs(model, tokens[:start], tokens[start:end], TEMPERATURE)
    np.testing.assert_allclose(t.behav_logprobs[start:end], ref, atol=TOL, rtol=0)


def test_a_weight_update_inside_a_turn(setup):
    """The update interrupts turn 1: its tokens switch from v0 to v0 + 1 exactly where it was interrupted,
    and turn 2, sampled after the update, is all v0 + 1; each segment matches the weights of its version."""
    engine, tokenizer, model_a, model_b = setup
    v0 = engine.version + 1
    load(engine, model_a, v0)
    workflow = Scripted()
    runner = runner_of(engine, tokenizer, workflow)
    prompt = [5, 6, 7, 8]

    async def scenario():
        replies = []
        runner.start(request(0, prompt, n=4))
        for _ in range(6):  # the episodes' first turns a few tokens in
            replies += await runner.advance()
        first = {t.key: len(t.sampled.token_ids) for t in engine.partial()}
        load(engine, model_b, v0 + 1)
        await pump(runner, replies, lambda: not runner.episodes)
        return first, replies

    first, replies = asyncio.run(scenario())
    assert sorted(t.index for t in replies) == [0, 1, 2, 3] and all(t.group_id == 0 for t in replies)
    switched = 0
    for t in replies:
        turn1, turn2 = check_scripted(t, prompt)
        (s1, e1), (s2, e2) = sampled_runs(t)
        k = first.get(f"group0.{t.index}.t0", len(turn1))  # absent: turn 1 had finished before the update
        assert t.versions[s1:e1].tolist() == [v0] * k + [v0 + 1] * (len(turn1) - k)
        assert t.versions[s2:e2].tolist() == [v0 + 1] * len(turn2)
        check_logprobs(t, s1, s1 + k, model_a)
        check_logprobs(t, s1 + k, e1, model_b)
        check_logprobs(t, s2, e2, model_b)
        switched += 0 < k < len(turn1)
    assert switched >= 1


def test_a_weight_update_between_turns_while_other_episodes_run(setup):
    """Group 0's episodes wait between their turns (no vLLM request held) while group 1's run to the end;
    a weight update then lands between group 0's turns: turn 1 is all v0, turn 2 all v0 + 1."""
    engine, tokenizer, model_a, model_b = setup
    v0 = engine.version + 1
    load(engine, model_a, v0)
    workflow = Scripted()
    runner = runner_of(engine, tokenizer, workflow)
    prompts = {0: [9, 10, 11], 1: [12, 13, 14]}

    async def scenario():
        replies = []
        workflow.gate = asyncio.Event()
        runner.start(request(0, prompts[0], n=3, wait=True))
        await pump(runner, replies, lambda: workflow.waiting == 3)
        assert engine.in_flight == 0  # the waiting episodes hold no vLLM request
        runner.start(request(1, prompts[1], n=3))
        await pump(runner, replies, lambda: len(replies) == 3)
        assert {t.group_id for t in replies} == {1} and workflow.waiting == 3
        load(engine, model_b, v0 + 1)
        workflow.gate.set()
        await pump(runner, replies, lambda: not runner.episodes)
        return replies

    replies = asyncio.run(scenario())
    assert sorted((t.group_id, t.index) for t in replies) == [(g, i) for g in (0, 1) for i in range(3)]
    for t in replies:
        turn1, turn2 = check_scripted(t, prompts[t.group_id])
        (s1, e1), (s2, e2) = sampled_runs(t)
        assert set(t.versions[s1:e1].tolist()) == {v0}
        check_logprobs(t, s1, e1, model_a)
        v, model = (v0 + 1, model_b) if t.group_id == 0 else (v0, model_a)
        assert set(t.versions[s2:e2].tolist()) == {v}
        check_logprobs(t, s2, e2, model)


def test_without_interruption_turn_1_ends_on_its_version_and_turn_2_waits_for_the_next(setup):
    """rollout.interruptible false: the engine is held (`GenerationEngine.hold`, as the generator's WeightSync
    does) while the episodes' first turns run. Turn 1 runs on to its end on v0; turn 2, submitted during the
    hold, waits outside vLLM and is sampled on v0 + 1 once the weights load. (A turn 2 already running at the
    hold would end on v0 as well.)"""
    engine, tokenizer, model_a, model_b = setup
    v0 = engine.version + 1
    load(engine, model_a, v0)
    runner = runner_of(engine, tokenizer, Scripted(), interruptible=False)
    prompt = [15, 16, 17, 18]

    async def scenario():
        replies = []
        runner.start(request(2, prompt, n=4))
        for _ in range(6):  # the episodes' first turns a few tokens in
            replies += await runner.advance()
        at_hold = {t.key: len(t.sampled.token_ids) for t in engine.partial()}
        engine.hold()
        # every episode left has its next turn held, nothing runs in vLLM
        await pump(runner, replies, lambda: not engine.running and engine.in_flight == runner.episodes)
        held = [t.key for t in engine.partial()]
        assert held and all(not t.sampled.token_ids for t in engine.partial())
        load(engine, model_b, v0 + 1)
        await pump(runner, replies, lambda: not runner.episodes)
        return at_hold, held, replies

    at_hold, held, replies = asyncio.run(scenario())
    assert sorted(t.index for t in replies) == [0, 1, 2, 3] and all(t.group_id == 2 for t in replies)
    assert {k.rsplit(".", 1)[1] for k in held} == {"t1"}  # the held turns are second turns
    went_on = 0
    for t in replies:
        turn1, turn2 = check_scripted(t, prompt)
        (s1, e1), (s2, e2) = sampled_runs(t)
        assert t.versions[s1:e1].tolist() == [v0] * len(turn1)
        check_logprobs(t, s1, e1, model_a)
        v, model = (v0, model_a) if f"group2.{t.index}.t1" in at_hold else (v0 + 1, model_b)
        assert f"group2.{t.index}.t1" in held or v == v0
        assert t.versions[s2:e2].tolist() == [v] * len(turn2)
        check_logprobs(t, s2, e2, model)
        went_on += len(turn1) > at_hold.get(f"group2.{t.index}.t0", len(turn1))
    assert went_on >= 1  # a turn 1 caught mid-way at the hold ran on past it, on v0


def test_an_episode_waiting_on_a_tool_holds_up_nothing(setup):
    """Calls of a slow tool are held back: their episodes wait with no vLLM request while another group's
    episodes call a quick tool and finish; released, the slow ones finish too. Stop cancels them all."""
    engine, tokenizer, _, _ = setup
    pool = Pool()
    pool.held.add("slow")
    runner = runner_of(engine, tokenizer, Scripted(), pool)

    async def scenario():
        replies = []
        runner.start(request(5, [20, 21], n=2, tool="slow"))
        await pump(runner, replies, lambda: len(pool.calls) == 2)
        assert engine.in_flight == 0 and runner.episodes == 2
        runner.start(request(6, [22, 23], n=2, tool="echo"))
        await pump(runner, replies, lambda: len(replies) == 2)
        assert {t.group_id for t in replies} == {6} and len(pool.calls) == 2
        pool.held.clear()
        await pump(runner, replies, lambda: not runner.episodes)
        runner.start(request(7, [24, 25], n=2, tool="echo"))
        await runner.advance()
        assert engine.in_flight == 2
        runner.close()  # Stop: the episodes are cancelled, the pool closed
        await asyncio.sleep(0)
        return replies

    replies = asyncio.run(scenario())
    assert sorted((t.group_id, t.index) for t in replies) == [(5, 0), (5, 1), (6, 0), (6, 1)]
    for t in replies:
        check_scripted(t, [20, 21] if t.group_id == 5 else [22, 23])
    assert pool.closed and not runner.episodes
    engine.interrupt()  # the cancelled episodes' turns


def test_tool_calls_run_in_the_tool_pool(setup):
    """With the real ToolPool (child processes): the calculator's answers reach the episodes, a failing call
    answers an error that is counted, and the pool goes with the runner."""
    from areal_hpc.workflow.tools import ToolPool

    engine, tokenizer, _, _ = setup
    workflow, pool = Scripted(), ToolPool(processes=1, timeout_s=10, output_chars=100)
    runner = runner_of(engine, tokenizer, workflow, pool)
    replies = run_episodes(
        runner,
        [
            request(50, [5, 6], n=2, tool="calculator", arguments={"expression": "6*7"}),
            request(51, [5, 6], n=1, tool="calculator", arguments={"expression": "6*"}),
        ],
    )
    runner.close()
    assert workflow.tool_outputs.count("42") == 2
    [error] = [text for text in workflow.tool_outputs if text != "42"]
    assert error.startswith("error")
    for t in replies:
        check_scripted(t, [5, 6], tool_s=t.stats["tool_s"])
        assert 0 < t.stats["tool_s"] < 10 and t.stats["tool_errors"] == (t.group_id == 51)


def test_a_workflow_that_raises_loses_only_its_episode(setup, caplog):
    """The second episode of a group raises: its reply carries the traceback and no tokens (and it is logged);
    the group's other episodes, with the reward their workflow returned, come back whole. A SystemExit from
    the workflow is answered the same way (the run goes on), and a reward that is not a finite number loses
    its episode too."""
    engine, tokenizer, _, _ = setup
    runner = runner_of(engine, tokenizer, Scripted())
    with caplog.at_level("ERROR", logger="areal_hpc.generator"):
        replies = run_episodes(
            runner,
            [
                request(8, [30, 31], n=3, fail=2, reward=0.5),  # episodes 1-3 started
                request(9, [30, 31], n=1, reward="yes"),  # 4
                request(10, [30, 31], n=1, fail=5, exception=SystemExit),  # 5
                request(11, [30, 31], n=1, reward=math.inf),
                request(12, [30, 31], n=1, reward=math.nan),
            ],
        )
    lost = {(t.group_id, t.index) for t in replies if t.error}
    assert len(replies) == 7 and len(lost) == 5 and {(9, 0), (10, 0), (11, 0), (12, 0)} <= lost
    want = {
        8: "RuntimeError: the workflow failed on purpose",
        9: "TypeError: arun_episode returned 'yes'",
        10: "SystemExit: the workflow failed on purpose",
        11: "arun_episode returned inf: return a finite float, or None to leave the reward to reward.kind",
        12: "arun_episode returned nan: return a finite float",
    }
    for t in replies:
        if t.error:
            assert t.tokens.size == t.seq_lens.size == t.loss_mask.size == t.answer_ids.size == 0
            assert math.isnan(t.reward) and t.stats == dict.fromkeys(EPISODE_STATS, 0)
            assert want[t.group_id] in t.error and "Traceback" in t.error
        else:
            check_scripted(t, [30, 31])
            assert t.reward == 0.5
    assert sum("episode group8." in r.getMessage() and "lost" in r.getMessage() for r in caplog.records) == 1


def test_the_single_turn_default_is_the_single_turn_rollout(setup):
    """SingleTurn (rollout.workflow's default): one turn of at most rollout.max_new_tokens after the prompt,
    trained as prompt (context) + answer (sampled), scored by the reward workers; an eval row's episodes
    come back as EvalTrajectory."""
    from areal_hpc.workflow.builtin import SingleTurn

    engine, tokenizer, model_a, _ = setup
    v = engine.version + 1
    load(engine, model_a, v)
    runner = runner_of(engine, tokenizer, SingleTurn())
    prompts = {0: [5, 6, 7], 1: [8, 9]}
    replies = run_episodes(
        runner,
        [
            request(40, prompts[0], n=4),
            GenerateRequest(
                3, np.asarray(prompts[1], np.int32), {"prompt": "", "target": "", "kind": "math"}, 2, eval=True
            ),
        ],
    )
    trajs = [t for t in replies if isinstance(t, Trajectory)]
    evals = [t for t in replies if isinstance(t, EvalTrajectory)]
    assert sorted(t.index for t in trajs) == [0, 1, 2, 3] and sorted((t.prompt_index, t.index) for t in evals) == [
        (3, 0),
        (3, 1),
    ]
    for t in trajs:
        p, tokens = len(prompts[0]), t.tokens.tolist()
        answer = tokens[p:]
        assert tokens[:p] == prompts[0] and 1 <= len(answer) <= MAX_NEW and t.answer_ids.tolist() == answer
        assert t.seq_lens.tolist() == [len(tokens)] and t.loss_mask.tolist() == [0] * p + [1] * len(answer)
        assert t.versions.tolist() == [-1] * p + [v] * len(answer) and (t.behav_logprobs[:p] == 0).all()
        check_logprobs(t, p, len(tokens), model_a)
        assert t.finish_reason == ("stop" if answer[-1] == EOS else "length")
        assert t.finish_reason == "stop" or len(answer) == MAX_NEW
        assert math.isnan(t.reward) and not t.error and t.stats["turns"] == 1 and t.stats["tool_calls"] == 0
    for t in evals:
        assert 1 <= t.answer_ids.size <= MAX_NEW and t.num_tokens == len(prompts[1]) + t.answer_ids.size
        assert t.finish_reason in ("stop", "length") and math.isnan(t.reward) and not t.error


def test_episodes_saved_at_a_checkpoint_go_on_from_their_turns_on_another_runner(setup, tmp_path, caplog):
    """A checkpoint while group 0's episodes wait between their turns and group 1's are mid turn 1
    (`save_in_flight`); a fresh runner (as after the resume, here under other weights) starts them from their
    rows with the saved turns: a finished turn 1 comes back as sampled (tokens, logprobs, version) and the tool
    runs again; a turn in flight goes on from its tokens, the new ones of the new version and weights. An
    episode whose context differs from its saved turn's (another prompt) samples anew, counted and logged."""
    from areal_hpc.checkpoint.in_flight import read_in_flight

    engine, tokenizer, model_a, model_b = setup
    v0 = engine.version + 1
    load(engine, model_a, v0)
    workflow = Scripted()
    runner = runner_of(engine, tokenizer, workflow)
    prompts = {0: [9, 10, 11], 1: [12, 13, 14]}

    async def before_the_stop():
        replies = []
        workflow.gate = asyncio.Event()  # never set: group 0 waits after turn 1
        runner.start(request(0, prompts[0], n=2, wait=True))
        await pump(runner, replies, lambda: workflow.waiting == 2)
        runner.start(request(1, prompts[1], n=3))
        for _ in range(4):  # group 1's first turns a few tokens in
            replies += await runner.advance()
        return runner.save_in_flight(tmp_path, 0, v0), replies

    (episodes, tokens, nbytes), replies = asyncio.run(before_the_stop())
    runner.close()
    engine.interrupt()  # the stop: its turns in vLLM go with the process
    assert not replies and episodes == 5 and nbytes > 0
    saved = read_in_flight(tmp_path, v0)
    assert sum(len(t.token_ids) for turns in saved.values() for t in turns) == tokens
    assert all(saved[(0, i)][0].finish_reason for i in range(2)), "group 0's turn 1 had finished"
    assert any(0 < len(saved[(1, i)][0].token_ids) for i in range(3)) and not any(
        saved[(1, i)][0].finish_reason for i in range(3)
    )

    load(engine, model_b, v0 + 1)
    resumed = Scripted()
    resumed.gate = None
    again = runner_of(engine, tokenizer, resumed)
    requests = [request(g, prompts[g], n=n) for g, n in ((0, 2), (1, 3))]
    for r in requests:
        r.resume = {i: turns for (g, i), turns in saved.items() if g == r.group_id}
    other = request(2, [15, 16, 17], n=1)  # group 1's episode 0 saved turns, met with another context
    other.resume = {0: saved[(1, 0)]}
    with caplog.at_level(logging.INFO, logger="areal_hpc.generator"):
        replies = run_episodes(again, [*requests, other])
    by = {(t.group_id, t.index): t for t in replies}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    for (g, i), turns in saved.items():
        t, turn = by[(g, i)], turns[0]
        check_scripted(t, prompts[g])
        (s1, e1), (s2, e2) = sampled_runs(t)
        k = len(turn.token_ids)
        assert t.tokens[s1 : s1 + k].tolist() == turn.token_ids.tolist()
        assert t.behav_logprobs[s1 : s1 + k].tolist() == turn.behav_logprobs.tolist()
        assert t.versions[s1 : s1 + k].tolist() == [v0] * k
        assert t.stats["resumed_tokens"] == k
        if turn.finish_reason:
            assert e1 - s1 == k  # came back whole, not sampled again
        check_logprobs(t, s1 + k, e1, model_b)
        assert set(t.versions[s2:e2].tolist()) == {v0 + 1}
        check_logprobs(t, s2, e2, model_b)
    fresh = by[(2, 0)]
    assert fresh.stats["resumed_tokens"] == 0 and set(fresh.versions[fresh.loss_mask == 1].tolist()) == {v0 + 1}
    if len(saved[(1, 0)][0].token_ids):
        assert f"episode group2.0: {len(saved[(1, 0)][0].token_ids)} saved tokens did not meet" in caplog.text
