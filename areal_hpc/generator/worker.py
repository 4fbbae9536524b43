"""A generator rank: one vLLM engine and the workflow's episodes, serving the controller.

```
 start: the workflow (rollout.workflow: a bad one fails here, before vLLM starts), the vLLM engine, then
        every stage's weight-sync group joined inside its workers (start-up check), the episode runner and
        its OpenAI endpoint (rollout.openai_endpoint: its URL logged)
 loop (asyncio, one thread):
        poll the controller (never blocks)
          GenerateRequest(group_id, prompt_ids, row, n, eval) -> start n episodes of the workflow on the (eval) row
          WeightSync(version) -> interrupt the turns in flight, receive + load the broadcast, resume them
                                 -> SyncDone(version, s, nbytes: what it received)
                                 rollout.interruptible false: hold new turns (engine.hold) and drain
          Save(version, path) -> the training episodes' turns so far into the checkpoint -> Saved(version)
          Stop                -> (a drain: load now, SyncDone) cancel the episodes, close the tool pool, flush, exit
        draining and no turn running in vLLM -> receive + load each version waiting, in order, start the held
                                 turns -> SyncDone(version, s, drain_s, nbytes) each
        advance the runner (areal_hpc.generator.episodes): step the engine if turns are running, poll the
        tool pool, let every episode whose turn or tool call came back run to its next await (IDLE_S sleep
        when nothing happened) -> each finished episode's reply (Trajectory; EvalTrajectory to an eval request)
```

Messages are handled in arrival order, between rounds of the runner. A WeightSync interrupts the turns in
flight: they resume under the new weights with what they sampled so far, and an episode between two turns
samples its next one under the new weights. A request that arrived in the same poll, before the
WeightSync, has only had its episodes created (`runner.start` makes their tasks; they first run at the
next `advance`), so even their first turn is sampled under the new weights.

Without interruption (`rollout.interruptible` false) the WeightSync starts a drain instead: turns submitted
from then on are held out of vLLM (an episode between two turns waits with its next one), the runner keeps
advancing until the turns running in vLLM have finished under the old weights, then the rank receives the
broadcast (the trainers wait in it meanwhile, within train.collective_timeout_s) and its held turns start
under the new weights. A WeightSync that comes during a drain (a trainer's broadcast may return before its
receivers read it, the bytes in the sockets' buffers) joins it: the versions waiting load in order once
the drain ends. A Stop during a drain loads at once (interrupting: the episodes are cancelled anyway), so
the trainers' broadcast completes rather than waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

log = logging.getLogger("areal_hpc.generator")


def serve(ctx, sync) -> None:
    """Run the generator rank until the controller sends Stop. `sync` is this rank's
    `weight_sync.WeightReceiver` (from `setup_weight_sync`)."""
    asyncio.run(_serve(ctx, sync))


async def _serve(ctx, sync) -> None:
    from areal_hpc.generator import loop_watch
    from areal_hpc.generator.engine import GenerationEngine
    from areal_hpc.generator.episodes import EpisodeRunner
    from areal_hpc.protocol import Failure, GenerateRequest, Mailbox, Save, Saved, Stop, SyncDone, WeightSync
    from areal_hpc.rank_context import CONTROLLER_RANK
    from areal_hpc.workflow import load_workflow

    mailbox, runner = Mailbox(ctx.world), None
    # (version, when its WeightSync came) of each sync waiting while the turns in vLLM finish (rollout.interruptible
    # false); more than one when the trainers' broadcast of a version returns before this rank has read it
    draining: list[tuple[int, float]] = []

    def load(version: int, drain_s: float = 0.0) -> None:
        seconds = engine.update_weights(sync, version)
        mailbox.send(CONTROLLER_RANK, SyncDone(version, seconds, drain_s, engine.synced_bytes))

    def load_drained() -> None:
        """Every sync waiting, in order (each broadcast is on the wire in that order)."""
        for version, since in draining:
            load(version, time.perf_counter() - since)
        draining.clear()

    try:
        workflow = load_workflow(ctx.cfg.rollout.workflow)()
        loop_watch.install(workflow, ctx.cfg.rollout.workflow)  # a workflow that blocks the loop is named in the log
        engine = GenerationEngine.from_config(ctx.cfg, ctx.model_path, ctx.device, seed_offset=ctx.rank)
        settings = " ".join(f"{k}={v}" for k, v in engine.settings().items())
        log.info("%s vLLM engine: %s", ctx.layout.describe_rank(ctx.rank), settings)
        if engine.memory is not None:
            m = engine.memory
            log.info(
                "%s GPU memory: vLLM given %.3f of %.1f GB; after it the project adds %s (areal_hpc.generator.memory)",
                ctx.layout.describe_rank(ctx.rank), m.utilization, m.gpu_bytes / 1e9, m.describe(),
            )  # fmt: skip
        for line in engine.join_weight_sync(sync, sync.startup_left_s()):
            log.info("%s", line)
        runner = EpisodeRunner.from_config(ctx.cfg, engine, ctx.model_path, workflow)
        url = await runner.open_endpoint()
        if url:
            log.info(
                "%s OpenAI endpoint of its episodes: %s (rollout.openai_endpoint)",
                ctx.layout.describe_rank(ctx.rank),
                url,
            )
        while True:
            for envelope in mailbox.poll(source=CONTROLLER_RANK):
                msg = envelope.msg
                if isinstance(msg, GenerateRequest):
                    runner.start(msg)
                elif isinstance(msg, WeightSync) and ctx.cfg.rollout.interruptible:
                    load(msg.version)
                elif isinstance(msg, WeightSync):
                    engine.hold()
                    draining.append((msg.version, time.perf_counter()))
                elif isinstance(msg, Save):
                    t0 = time.perf_counter()
                    episodes, tokens, nbytes = runner.save_in_flight(msg.path, ctx.rank, msg.version)
                    log.info(
                        "checkpoint of version %d: %d episodes in flight saved, %d sampled tokens, %.1f MB in %.2f s",
                        msg.version, episodes, tokens, nbytes / 1e6, time.perf_counter() - t0,
                    )  # fmt: skip
                    mailbox.send(CONTROLLER_RANK, Saved(msg.version))
                elif isinstance(msg, Stop):
                    load_drained()
                    runner.close()
                    await runner.close_endpoint()
                    engine.leave_weight_sync()
                    engine.close()
                    mailbox.flush()
                    return
                else:
                    raise RuntimeError(f"generator got an unexpected {type(msg).__name__} from the controller")
            if draining and not engine.running:
                load_drained()
            for reply in await runner.advance():
                mailbox.send(CONTROLLER_RANK, reply)
    except Exception:
        if runner is not None:
            runner.close()
        mailbox.send(
            CONTROLLER_RANK, Failure(ctx.rank, f"{ctx.layout.describe_rank(ctx.rank)}: {traceback.format_exc()}")
        )
        mailbox.flush(timeout_s=10)
        raise
