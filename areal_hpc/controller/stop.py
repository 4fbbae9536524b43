"""When the run stops, and whether it checkpoints first.

```
 SIGUSR2 (Slurm, before the time limit), SIGTERM (preemption, scancel), SIGINT, or the launcher's STOP file
   -> no new step; checkpoint once the running step is back, then Stop every rank
   -> or stop at once (no checkpoint: the run resumes from the last one) when Slurm kills the job before
      that checkpoint could be complete: the running step's rest and a save, each as long as the last
      one measured, against cluster.grace_s after SIGTERM, cluster.requeue_signal_s after SIGUSR2
```

The STOP file wins over a signal (the local launcher's Ctrl-C sends SIGUSR2 too): there is no deadline
then. The reason goes to the file $AREAL_STOP_REASON_FILE names, for the batch script (requeue or not).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from areal_hpc.exit_codes import STOP_REASON_ENV
from areal_hpc.rundir import STOP_FILE

log = logging.getLogger(__name__)

STOP_BUDGETS = {"SIGTERM": "grace_s", "SIGUSR2": "requeue_signal_s"}
"""The cluster setting that says how long Slurm leaves after each stop signal (preemption, time limit)."""
FILE_CHECK_S = 0.5
"""How often the STOP file is looked for (a signal is read on every pass of the loop)."""

_received: list[str] = []  # names of the stop signals received (set by the handlers below)


def install_stop_signals() -> None:
    """SIGUSR2 (Slurm, before the time limit), SIGTERM, SIGINT: checkpoint and stop, not die. main.py
    installs these first thing, so a signal during start-up is not lost either."""

    def record(signum, frame):
        _received.append(signal.Signals(signum).name)

    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, record)


def received_stop_signal() -> str | None:
    """The name of the first stop signal received, or None."""
    return _received[0] if _received else None


class StopRequest:
    """A stop asked of the run (`reason`), and whether there is no time to checkpoint first (`at_once`).

    `signal()` returns the name of a stop signal received, or None (`serve`: `received_stop_signal`;
    tests pass their own).
    """

    def __init__(self, cluster, run_dir: str | Path, signal: Callable[[], str | None]):
        self.cluster, self.signal = cluster, signal
        self.stop_file = Path(run_dir) / STOP_FILE
        self.reason: str | None = None
        self.at_once = False
        """No time to checkpoint before Slurm's kill: every rank ends now (`serve`)."""
        self._next_file_check = 0.0

    def check(self, need_s: Callable[[float], float | None], saved_version: int) -> bool:
        """Whether a stop has been asked for. The first time: at once if Slurm would kill the job within
        `need_s(now)` seconds (what the running step and its checkpoint take; None: nothing new to
        save); `saved_version` is the checkpoint the run would then resume from (-1: none)."""
        if self.reason is not None:
            return True
        now = time.monotonic()
        reason = self.signal()
        if reason is None and now >= self._next_file_check:
            self._next_file_check = now + FILE_CHECK_S
            reason = "stop file" if self.stop_file.exists() else None
        if reason is None:
            return False
        if self.stop_file.exists():  # Ctrl-C of the local launcher (with SIGUSR2): no deadline
            reason = "stop file"
        self.reason = reason
        if os.environ.get(STOP_REASON_ENV):
            Path(os.environ[STOP_REASON_ENV]).write_text(reason + "\n")
        budget = STOP_BUDGETS.get(reason)  # how long until Slurm kills the job
        need = need_s(now)
        if budget and need is not None and need >= getattr(self.cluster, budget):
            self.at_once = True
            log.warning(
                "stop requested (%s): the running step and its checkpoint need about %.0f s (as last measured), "
                "no less than the %d s of cluster.%s: stopping at once; the run resumes from %s",
                reason, need, getattr(self.cluster, budget), budget,
                f"version {saved_version}" if saved_version >= 0 else "the start",
            )  # fmt: skip
            return True
        log.warning("stop requested (%s): checkpointing at the end of the running step", reason)
        return True
