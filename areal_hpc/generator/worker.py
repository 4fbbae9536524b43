"""A generator rank: one vLLM engine serving the controller.

```
 start: the vLLM engine, then every stage's weight-sync group joined inside its workers (start-up check)
 loop:  poll the controller (never blocks)
          GenerateRequest(group_id, prompt_ids, n) -> queue n trajectories
          EvalRequest(prompt_index, prompt_ids, n) -> the same, for an eval prompt
          WeightSync(version) -> interrupt, receive + load the broadcast, resume -> SyncDone(version, s)
          Stop                -> flush, exit
        step the engine if anything is in flight -> for each trajectory that finished, its request's reply
                                                    (Trajectory; EvalTrajectory to an EvalRequest)
```

Messages are handled in arrival order, so a request sent before a WeightSync is queued before the
interruption and resumes under the new weights with what it produced so far.
"""

from __future__ import annotations

import logging
import time
import traceback

log = logging.getLogger("areal_hpc.generator")

IDLE_S = 0.001
"""Sleep between polls when nothing is in flight (keeps an idle generator off the CPU)."""


def serve(ctx, sync) -> None:
    """Run the generator rank until the controller sends Stop. `sync` is this rank's
    `weight_sync.WeightReceiver` (from `setup_weight_sync`)."""
    from areal_hpc.generator.engine import GenerationEngine
    from areal_hpc.protocol import EvalRequest, Failure, GenerateRequest, Mailbox, Stop, SyncDone, WeightSync
    from areal_hpc.runtime import CONTROLLER_RANK

    mailbox = Mailbox(ctx.world)
    try:
        engine = GenerationEngine.from_config(ctx.cfg, ctx.model_path, ctx.device, seed_offset=ctx.rank)
        settings = " ".join(f"{k}={v}" for k, v in engine.settings().items())
        log.info("%s vLLM engine: %s", ctx.layout.describe_rank(ctx.rank), settings)
        for line in engine.join_weight_sync(sync, sync.startup_left_s()):
            log.info("%s", line)
        while True:
            for envelope in mailbox.poll(source=CONTROLLER_RANK):
                msg = envelope.msg
                if isinstance(msg, GenerateRequest | EvalRequest):
                    engine.add(msg)
                elif isinstance(msg, WeightSync):
                    seconds = engine.update_weights(sync, msg.version)
                    mailbox.send(CONTROLLER_RANK, SyncDone(msg.version, seconds))
                elif isinstance(msg, Stop):
                    engine.leave_weight_sync()
                    engine.close()
                    mailbox.flush()
                    return
                else:
                    raise RuntimeError(f"generator got an unexpected {type(msg).__name__} from the controller")
            if engine.in_flight:
                for reply in engine.step():
                    mailbox.send(CONTROLLER_RANK, reply)
            else:
                time.sleep(IDLE_S)
    except Exception:
        mailbox.send(
            CONTROLLER_RANK, Failure(ctx.rank, f"{ctx.layout.describe_rank(ctx.rank)}: {traceback.format_exc()}")
        )
        mailbox.flush(timeout_s=10)
        raise
