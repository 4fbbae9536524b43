"""areal_hpc.generator.loop_watch on a real event loop: an episode that blocks the loop is named in the log
with the time and the place its step ended, once per place; an episode that does not block, the pump's own
blocking step, and a task made outside any task are not."""

import asyncio
import inspect
import logging
import time

from areal_hpc.generator import loop_watch

SPEC = "tests.test_loop_watch:Sleepy"
BLOCK_S = 0.2


class Sleepy:
    """Stands for a workflow: the file of its class is where a step's place is looked for."""

    async def arun_episode(self, blocks: int) -> float:
        for _ in range(blocks):
            time.sleep(BLOCK_S)
            await asyncio.sleep(0)  # every block's step ends here
        return 1.0

    async def arun_parallel(self) -> float:
        """Two calls in tasks of their own (gather), the first blocking until its end."""
        await asyncio.gather(self.finish_blocking(), self.arun_episode(0))
        return 1.0

    async def finish_blocking(self) -> None:
        time.sleep(BLOCK_S)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "areal_hpc.generator"]


def test_a_blocking_episode_is_named_once_per_place_and_the_pump_and_a_quick_episode_are_not(caplog):
    workflow = Sleepy()

    async def pump():
        loop_watch.install(workflow, SPEC)
        episodes = [
            asyncio.create_task(workflow.arun_episode(2), name="group0.0"),  # two blocks, one place
            asyncio.create_task(workflow.arun_episode(0), name="group0.1"),
        ]
        time.sleep(BLOCK_S)  # an engine step: the pump's own
        await asyncio.sleep(0)
        return await asyncio.gather(*episodes)

    with caplog.at_level(logging.WARNING, "areal_hpc.generator"):
        assert asyncio.run(pump()) == [1.0, 1.0]
    lines, source = inspect.getsourcelines(Sleepy.arun_episode)
    place = f"{__file__}:{source + next(i for i, line in enumerate(lines) if '# every block' in line)} in arun_episode"
    [message] = warnings(caplog)
    assert message.startswith(f"the workflow {SPEC} blocked the generator's event loop for 0.2")
    assert f"one step of its task group0.0 (the code it ran since its previous await, up to {place})" in message


def test_a_task_of_an_episode_is_watched_and_a_task_made_outside_any_task_is_not(caplog):
    workflow = Sleepy()

    async def pump():
        loop_watch.install(workflow, SPEC)
        episode = asyncio.create_task(workflow.arun_parallel(), name="group1.0")
        outside = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(lambda: outside.set_result(asyncio.create_task(workflow.arun_episode(1))))
        await (await outside)
        return await episode

    with caplog.at_level(logging.WARNING, "areal_hpc.generator"):
        assert asyncio.run(pump()) == 1.0
    [message] = warnings(caplog)
    assert "of its task Task-" in message and "up to the end of its task (Sleepy.finish_blocking))" in message
