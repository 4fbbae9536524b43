"""Episodes next to the engine: every request's episodes run as asyncio tasks on the generator's thread.

```
 start(GenerateRequest)               -> n tasks, each:  client = EpisodeClient(tokenizer, rollout, max_model_len,
                                                                                sample, tool)
                                                          reward = await workflow.arun_episode(client, row)
                                                          -> its reply (Trajectory | EvalTrajectory), queued
 the client's sample(token_ids, max_tokens) -> engine.submit(turn key, ...); a future the engine's step resolves
 the client's tool(name, arguments)        -> ToolPool.submit(call key, ...); a future the pool's poll resolves
 advance()                                 -> step the engine if turns are running, poll the tool pool, let every
                                              episode whose future resolved run to its next await; the replies
```

The engine's step is a blocking call and episodes run between steps, on one thread: an episode waiting for
a turn or a tool holds up nothing, and one waiting for a tool holds no vLLM request either. Each episode
stays on the engine of the rank that got its request, so its turns reuse that engine's prefix cache.

Names: an episode is `group{g}.{i}` (`eval{p}.{i}` for an eval row), its turns `<episode>.t{k}` (the
engine's keys), its tool calls `<episode>.c{k}` (the pool's keys).

At a checkpoint (`save_in_flight`, the generator's Save) every training episode's turns so far go into the
checkpoint; a request carried over one (`GenerateRequest.resume`) starts its episodes with the turns they
had, which they meet again in order (areal_hpc.generator.resume).

What an episode may do, and what a failure costs it, is the contract in `areal_hpc.workflow.Workflow`'s
docstring. Here: a lost episode (its workflow raised, sampled nothing, or returned neither a finite float
nor None) still replies, with the traceback (`error`, also logged) and no tokens, since its group waits
for every reply; only a cancellation (`close`, at Stop) ends an episode without a reply. The tool pool starts at the first tool call, so a workflow without tools costs no
processes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import numbers
import traceback
from dataclasses import dataclass

import numpy as np

from areal_hpc.generator.resume import EpisodeResume, saved_turn
from areal_hpc.protocol import EPISODE_STATS, EvalTrajectory, GenerateRequest, SavedTurn, Trajectory

log = logging.getLogger("areal_hpc.generator")

IDLE_S = 0.001
"""Sleep of a pump that had nothing to do (keeps an idle generator off the CPU)."""


class EpisodeRunner:
    """Runs episodes of one workflow on one engine (`GenerationEngine`).

    `workflow`: a built `areal_hpc.workflow.Workflow`; `tokenizer`: the model's (the one the engine's
    tokens are ids of); `rollout`: the RolloutConfig; `tool_pool`: builds the `ToolPool` tool calls go
    to, called at the first tool call; `endpoint`: the episodes' `EpisodeEndpoint` (None: no HTTP), which
    `open_endpoint` starts in the running event loop.
    """

    def __init__(self, engine, workflow, tokenizer, rollout, tool_pool, endpoint=None):
        self.engine, self.workflow, self.tokenizer, self.rollout = engine, workflow, tokenizer, rollout
        self._new_pool, self._pool = tool_pool, None
        self.endpoint = endpoint
        self._turns: dict[str, asyncio.Future] = {}  # turn key -> what its episode awaits
        self._calls: dict[str, asyncio.Future] = {}  # tool call key -> what its episode awaits
        self._tasks: set[asyncio.Task] = set()  # each episode's, until it is done (however it ended)
        self._live: dict[str, _Live] = {}  # each training episode's, until it ends: what a checkpoint saves of it
        self._replies: list[Trajectory | EvalTrajectory] = []

    @classmethod
    def from_config(cls, cfg, engine, model_path, workflow=None) -> EpisodeRunner:
        """The runner of a generator rank: `rollout.workflow` (unless `workflow`, already built, is given),
        the model's tokenizer, the tool pool of `rollout.tool_*`."""
        from transformers import AutoTokenizer

        from areal_hpc.workflow import load_workflow
        from areal_hpc.workflow.client import served_model
        from areal_hpc.workflow.endpoint import EpisodeEndpoint

        workflow = workflow if workflow is not None else load_workflow(cfg.rollout.workflow)()
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))

        def tool_pool():
            from areal_hpc.workflow.tools import ToolPool

            return ToolPool.from_config(cfg.rollout)

        where = cfg.rollout.openai_endpoint
        endpoint = None
        if where != "off":
            endpoint = EpisodeEndpoint(where, served_model(tokenizer), cfg.cluster.network_interface)
        return cls(engine, workflow, tokenizer, cfg.rollout, tool_pool, endpoint)

    async def open_endpoint(self) -> str | None:
        """Start the episodes' HTTP endpoint (none: None); its base URL (EndpointError: it cannot listen)."""
        return None if self.endpoint is None else await self.endpoint.start()

    async def close_endpoint(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()

    # --- inside the generator's event loop ---
    def start(self, request: GenerateRequest) -> None:
        """Start the request's `n` episodes (tasks of the running event loop)."""
        name = f"{'eval' if request.eval else 'group'}{request.group_id}"
        prompt_ids = [int(t) for t in request.prompt_ids]
        loop = asyncio.get_running_loop()
        resume = request.resume or {}
        for i in range(request.n) if request.indices is None else request.indices:
            row = dict(request.row, prompt_ids=list(prompt_ids))
            if not request.eval:
                self._live[f"{name}.{i}"] = _Live(request.group_id, i, [], EpisodeResume(resume.get(i, [])))
            task = loop.create_task(self._episode(request, i, f"{name}.{i}", row), name=f"{name}.{i}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @property
    def episodes(self) -> int:
        """Episodes started and not ended yet. Counted by their tasks, so no way an episode ends (a reply,
        an exception past its handler, a cancellation) can leave the count behind."""
        return len(self._tasks)

    async def advance(self) -> list[Trajectory | EvalTrajectory]:
        """One round of the pump: one engine step if turns are running in vLLM, the tool calls that finished, then
        every episode whose turn or call came back runs to its next await. Returns the episodes' replies
        that are ready (each as soon as its episode ended). Sleeps IDLE_S when nothing happened."""
        woken = 0
        if self.engine.running:  # not the turns held for the next weights (`GenerationEngine.hold`)
            for turn in self.engine.step():
                woken += _resolve(self._turns.pop(turn.key, None), turn.sampled)  # the workflow's Turn, as is
        if self._calls:
            for key, text, ok, seconds in self._pool.poll(0.0):
                woken += _resolve(self._calls.pop(key, None), (text, ok, seconds))
        await asyncio.sleep(0)  # the woken episodes run, each up to its next turn or call
        if not woken and not self.engine.running:
            await asyncio.sleep(IDLE_S)
        replies, self._replies = self._replies, []
        return replies

    def save_in_flight(self, path, rank: int, version: int) -> tuple[int, int, int]:
        """Write every training episode's turns so far into the checkpoint at `path`
        (areal_hpc.checkpoint.in_flight): its finished turns, and the one in flight as vLLM has sampled it
        (read without stopping it), or, before it meets them, the turns it was resumed with. Returns
        (episodes, sampled tokens, bytes written)."""
        from areal_hpc.checkpoint.in_flight import sampled_tokens, write_in_flight

        in_flight = {turn.key.rpartition(".t")[0]: turn for turn in self.engine.partial()}
        episodes = {}
        for name, live in self._live.items():
            turn = in_flight.get(name)
            now = [saved_turn(turn.context_ids, turn.sampled, finished=False)] if turn else live.resume.saved
            if live.turns or now:
                episodes[(live.group_id, live.index)] = [*live.turns, *now]
        nbytes = write_in_flight(path, rank, version, episodes)
        return len(episodes), sum(sampled_tokens(t) for t in episodes.values()), nbytes

    def close(self) -> None:
        """Cancel every episode (at Stop: their groups go on after a resume, from the turns the checkpoint holds)
        and stop the tool pool. The runner can start episodes again afterwards."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._live.clear()
        for future in self._turns.values():  # an HTTP call awaiting one ends too
            future.cancel()
        if self._pool is not None:
            self._pool.close()  # the calls' answers go nowhere: their episodes are cancelled
            self._pool = None
        self._turns.clear()
        self._calls.clear()

    # --- one episode ---
    async def _episode(self, request: GenerateRequest, index: int, name: str, row: dict) -> None:
        from areal_hpc.workflow.client import EpisodeClient

        live = self._live.get(name)
        client = EpisodeClient(
            self.tokenizer,
            self.rollout,
            self.engine.max_model_len,
            self._sampler(name, live),
            self._caller(name),
            self.endpoint,
        )
        try:
            reward = _reward(await self.workflow.arun_episode(client, row))
            client.resumed_tokens = live.resume.kept if live else 0
            fields = client.trajectory_fields()
            if not len(fields["seq_lens"]):
                raise RuntimeError("the episode sampled no token (no turn, or none within its limits)")
            error = ""
        except (asyncio.CancelledError, GeneratorExit):  # cancelled at Stop (close), or the task closed
            raise
        except BaseException:  # noqa: BLE001 - a SystemExit or KeyboardInterrupt in user code too: its group waits for every reply
            error = traceback.format_exc()
            log.error("episode %s lost: %s", name, error)
            fields, reward = _lost(), math.nan
        finally:
            client.close()
            self._live.pop(name, None)
            if live and live.resume.discarded:
                log.info(
                    "episode %s: %d saved tokens did not meet its turns and were sampled again",
                    name,
                    live.resume.discarded,
                )
        self._replies.append(_reply(request, index, fields, reward, error))

    def _sampler(self, name: str, live: _Live | None):
        """The episode's `sample`: one turn on the engine, awaited. A training episode's (`live`) meets the turns
        it was resumed with first, and records each finished turn for the next checkpoint."""
        from areal_hpc.workflow.client import Turn

        count = itertools.count()

        async def sample(token_ids: list[int], max_tokens: int) -> Turn:
            key = f"{name}.t{next(count)}"
            finished, prefix = live.resume.meet(token_ids, max_tokens) if live else (None, None)
            if finished is None:
                future = asyncio.get_running_loop().create_future()
                self.engine.submit(key, token_ids, max_tokens, prefix)
                self._turns[key] = future
                finished = await future  # the engine turn's `sampled` record (advance)
            if live is not None:
                live.turns.append(saved_turn(token_ids, finished))
            return finished

        return sample

    def _caller(self, name: str):
        """The episode's `tool`: one call in the tool pool, awaited; (text, ok, seconds)."""
        count = itertools.count()

        async def tool(tool_name: str, arguments: dict) -> tuple[str, bool, float]:
            key = f"{name}.c{next(count)}"
            future = asyncio.get_running_loop().create_future()
            if self._pool is None:
                self._pool = self._new_pool()
            self._pool.submit(key, tool_name, arguments)
            self._calls[key] = future
            return await future

        return tool


@dataclass
class _Live:
    """A training episode as a checkpoint sees it: its place, its finished turns, the turns it was resumed with."""

    group_id: int
    index: int
    turns: list[SavedTurn]
    resume: EpisodeResume


def _reward(value) -> float:
    """The workflow's return value as a reward: NaN for None (left to `reward.kind`), else a finite float."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"arun_episode returned {value!r}: return a reward (a float) or None")
    if not math.isfinite(value):
        raise ValueError(
            f"arun_episode returned {value!r}: return a finite float, or None to leave the reward to reward.kind"
        )
    return float(value)


def _resolve(future: asyncio.Future | None, result) -> int:
    """Hand `result` to the episode awaiting `future` (none: the episode was cancelled); 1 if one woke."""
    if future is None or future.done():
        return 0
    future.set_result(result)
    return 1


def _lost() -> dict:
    """The fields of a lost episode's reply: no tokens."""
    empty = {k: np.zeros(0, np.int32) for k in ("tokens", "seq_lens", "versions", "answer_ids")}
    return dict(
        empty,
        loss_mask=np.zeros(0, np.uint8),
        behav_logprobs=np.zeros(0, np.float32),
        finish_reason="error",
        stats=dict.fromkeys(EPISODE_STATS, 0),
    )


def _reply(request, index: int, fields: dict, reward: float, error: str) -> Trajectory | EvalTrajectory:
    if request.eval:
        return EvalTrajectory(
            request.group_id,
            index,
            fields["answer_ids"],
            int(len(fields["tokens"])),
            fields["finish_reason"],
            reward,
            fields["stats"],
            error,
        )
    return Trajectory(request.group_id, index, **fields, reward=reward, error=error)
