"""Names a workflow whose episodes block the generator's event loop.

A generator rank runs its engine's steps and every episode on one thread, one event loop
(areal_hpc.generator.worker). An episode that blocks it, a `time.sleep` or a `requests.get` or a long
computation inside `async def arun_episode`, holds up the engine's next step and so every episode of the
rank; nothing fails, the rank is only slow. `install` times each step of the episodes' tasks (the run
from one await to the next) and logs a step longer than THRESHOLD_S, naming the workflow, the time, the
task and where the step ended: its next await (the frame of the workflow's file deepest in the chain of
awaits), or the end of the task. The blocking code ran in that step, somewhere since the task's previous
await: which line took the time is not known after the fact, and the log says as much. Once per place: a
workflow that blocks in every episode writes one line, not one per episode.

Watched: the tasks that the task calling `install` (the generator's pump) creates from then on, the
episodes (`EpisodeRunner.start`), and the tasks those create (a workflow's `gather`, `wait_for`,
TaskGroup). Not watched: the pump's own task, whose engine steps and weight loads block by design, and
tasks made outside any task (the OpenAI endpoint's connection handlers: the project's code, not the
workflow's).

Written here rather than using asyncio's debug mode, which times every callback against
`loop.slow_callback_duration` but also records a stack at every callback scheduled (25x slower per task
step, measured on this machine) and logs every slow callback, the engine's steps among them. Here a task
factory (`loop.set_task_factory`) wraps each watched task's coroutine in `_Steps`, whose `send` and
`throw` read the clock around the real ones: one Python call and two clock reads more per step, 0.34 us
(10,000 trivial steps of 10 tasks: 1.26 us a step without, 1.60 us with; an episode's real steps, its
client's work in them, take far longer). An exception that leaves a watched task (a `gather` child's,
reaching its episode) shows `_Steps.send` as one more frame in its traceback.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import logging
from time import perf_counter

log = logging.getLogger("areal_hpc.generator")

THRESHOLD_S = 0.1
"""A step of an episode longer than this is logged. An engine step takes milliseconds on a GPU, so a tenth
of a second is many steps lost by every turn of the rank; an episode's own work between two awaits (its
chat template, a tokenization) takes milliseconds."""


def install(workflow, spec: str, threshold_s: float = THRESHOLD_S) -> None:
    """Watch the tasks the running task creates from now on, and theirs, on the running loop. `workflow`:
    the built workflow (its class's file is where a step's place is looked for); `spec`: its name in the
    log (rollout.workflow)."""
    watch = _Watch(spec, inspect.getfile(type(workflow)), threshold_s, asyncio.current_task())
    asyncio.get_running_loop().set_task_factory(watch.task)


class _Watch:
    """What `install` set up on one loop: the workflow, the threshold, the pump's task, the places logged."""

    def __init__(self, spec: str, file: str, threshold_s: float, pump: asyncio.Task | None):
        self.spec, self.file, self.threshold_s, self.pump = spec, file, threshold_s, pump
        self.places: set[str] = set()
        """Where each step logged ended: 'file:line in function', or the end of a task (its coroutine)."""

    def task(self, loop, coro, **kwargs) -> asyncio.Task:
        """The loop's task factory: a task that the pump or a watched task creates is watched."""
        creator = asyncio.current_task(loop)
        if creator is not None and (creator is self.pump or isinstance(creator.get_coro(), _Steps)):
            coro = _Steps(coro, self)
        return asyncio.Task(coro, loop=loop, **kwargs)

    def blocked(self, coro, seconds: float) -> None:
        """Log a step of `coro` (the current task's) that took `seconds`, unless one ending at the same
        place was logged."""
        frames = _awaiting(coro)
        frame = next((f for f in reversed(frames) if f.f_code.co_filename == self.file), frames[-1] if frames else None)
        if frame is None:
            where = f"the end of its task ({coro.__qualname__})"
        else:
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        if where in self.places:
            return
        self.places.add(where)
        log.warning(
            "the workflow %s blocked the generator's event loop for %.2f s in one step of its task %s (the code "
            "it ran since its previous await, up to %s): every episode of this rank waited meanwhile; use "
            "await asyncio.sleep, asyncio.to_thread or an async client instead (logged once per place)",
            self.spec, seconds, asyncio.current_task().get_name(), where,
        )  # fmt: skip


class _Steps:
    """A watched task's coroutine: the real one, each step (`send`, `throw`) timed. Anything else (cr_frame,
    cr_code, __qualname__: what asyncio reads for the task's repr and stack) is the real one's."""

    __slots__ = ("coro", "watch")

    def __init__(self, coro, watch: _Watch):
        self.coro, self.watch = coro, watch

    def send(self, value):
        start = perf_counter()
        try:
            return self.coro.send(value)
        finally:
            seconds = perf_counter() - start
            if seconds > self.watch.threshold_s:
                self.watch.blocked(self.coro, seconds)

    def throw(self, *exc):
        start = perf_counter()
        try:
            return self.coro.throw(*exc)
        finally:
            seconds = perf_counter() - start
            if seconds > self.watch.threshold_s:
                self.watch.blocked(self.coro, seconds)

    def __getattr__(self, name: str):
        return getattr(self.coro, name)


collections.abc.Coroutine.register(_Steps)  # what asyncio.Task takes (asyncio.iscoroutine)


def _awaiting(coro) -> list:
    """The frames of a suspended coroutine and of the coroutines it awaits, outermost first; [] once it ended."""
    frames = []
    while (frame := getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)) is not None:
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames
