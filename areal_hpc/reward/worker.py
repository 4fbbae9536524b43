"""The reward worker rank: decodes the controller's RewardRequests and scores them in a pool of processes,
in parallel.

```
 loop (never blocks for long):
   mailbox.poll(controller)  RewardRequest -> decode its answer_ids (the run's tokenizer) -> pool queue
                             Stop -> answer what is left, flush, return
   pool.poll(few ms)         (request_id, reward, reason) -> RewardResult to the controller, as each finishes
```

Every request is answered exactly once: a call over `reward.timeout_s` scores 0 with reason
"timeout" (its process is killed and replaced if it does not stop by itself), a scorer process that
dies scores its request 0 with "error: scorer process died (...)", and a request still open at Stop
is answered "error: cancelled (stop)". The controller counts the reasons in its metrics.
"""

from __future__ import annotations

import logging
import time

from areal_hpc.protocol import Failure, Mailbox, RewardRequest, RewardResult, Stop
from areal_hpc.rank_context import CONTROLLER_RANK
from areal_hpc.reward import response_text
from areal_hpc.reward.pool import ScorerPool, pool_size

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01
"""Longest wait for a scorer while nothing is running (bounds how late a new request is noticed)."""
BUSY_WAIT_S = 0.002
"""Wait for a scorer while requests are running."""


def serve(ctx) -> int:
    """Answer RewardRequests from the controller until Stop; returns 0."""
    from transformers import AutoTokenizer

    cfg = ctx.cfg.reward
    box = Mailbox(ctx.world)
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)  # the run's: the controller's and the generators'

    pool = ScorerPool(pool_size(cfg.processes), timeout_s=cfg.timeout_s)
    log.info("reward worker: %d scorer processes, time limit %.1f s per call", len(pool.pids), cfg.timeout_s)
    pending: dict[int, int] = {}  # pool key -> request_id (the key is unique even if a request_id repeats)
    next_key, answered, reported_broken = 0, 0, False
    started = time.monotonic()

    def reply(results) -> None:
        nonlocal answered
        for key, reward, reason in results:
            box.send(CONTROLLER_RANK, RewardResult(pending.pop(key), reward, reason))
            answered += 1

    try:
        while True:
            stop = None
            for env in box.poll(source=CONTROLLER_RANK):
                msg = env.msg
                if isinstance(msg, RewardRequest):
                    pending[next_key] = msg.request_id
                    pool.submit(next_key, msg.kind, response_text(tokenizer, msg.answer_ids), msg.target)
                    next_key += 1
                elif isinstance(msg, Stop):
                    stop = msg
                else:
                    log.warning("reward worker: ignoring unexpected %s", type(msg).__name__)
            if stop is not None:
                log.info("reward worker: stop (%s); %d requests still open", stop.reason, pool.pending)
                reply(pool.close("error: cancelled (stop)"))
                break
            reply(pool.poll(BUSY_WAIT_S if pool.pending else IDLE_WAIT_S))
            if pool.broken and not reported_broken:
                box.send(CONTROLLER_RANK, Failure(ctx.rank, f"reward worker: {pool.broken}"))
                reported_broken = True
    finally:
        pool.close()
        box.flush()
    elapsed = time.monotonic() - started
    log.info(
        "reward worker: %d requests answered in %.0f s; %d scorer processes replaced", answered, elapsed, pool.replaced
    )
    return 0
