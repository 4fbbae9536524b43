"""What a generator rank's log (RUN_DIR/logs/generator-<i>.log) says about its vLLM engine: the settings
vLLM resolved and how long the engine took to start, for the GPU check's summary and its start-up check.

A rank's own lines start with the time (`%(asctime)s <role> <LEVEL> ...`, areal_hpc.main); vLLM's
lines, in the same file, have a format of their own and are not read. The engine's line, logged
once it has started:

    2026-11-24 10:00:41,207 generator INFO generator 0 (world rank 2) vLLM engine: vllm=0.32.0 model_runner=V1 ...

(areal_hpc.generator.worker logs it from `GenerationEngine.settings()`: key=value, no spaces in a value).

Start time: from the rank's first line (where it runs: areal_hpc.main.narrow_gpus) to that line. The
log is appended to across resumes; the first start in it is read. A log without the engine's line (a
generator older than it) has no start time and no settings: the check says so rather than guess.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import NamedTuple

ENGINE_LINE = "vLLM engine:"
_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}) ")
_SETTING = re.compile(r"([A-Za-z_][\w.]*)=(\S+)")


class EngineStart(NamedTuple):
    started: dt.datetime | None
    """The rank's first line."""
    ready: dt.datetime | None
    """The engine's line after it (None: not in the log)."""
    settings: dict[str, str]
    """Its key=value pairs ({}: no such line)."""

    @property
    def seconds(self) -> float | None:
        return (self.ready - self.started).total_seconds() if self.started and self.ready else None


def engine_start(log_text: str) -> EngineStart:
    """The first engine start in a generator's log (see the module docstring)."""
    started = None
    for line in log_text.splitlines():
        stamp = _STAMP.match(line)
        if not stamp:
            continue
        at = dt.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if started is None:
            started = at
        _, found, rest = line.partition(ENGINE_LINE)
        if found:
            return EngineStart(started, at, dict(_SETTING.findall(rest)))
    return EngineStart(started, None, {})


STARTUP_MARGIN = 0.5
"""The share of train.startup_timeout_s a start may take here: the check's models are small, a real
one loads, compiles and captures longer, so a start past half the limit leaves it no room."""


def startup_verdict(start: EngineStart, timeout_s: float) -> tuple[str, str]:
    """PASS, FAIL or SKIP, and why: the engine's start time against `timeout_s`
    (train.startup_timeout_s, how long the controller waits for a rank's first answer)."""
    if start.started is None:
        return "FAIL", "the generator's log has no line of its own (did the rank start?)"
    if start.seconds is None:
        return "SKIP", f"no '{ENGINE_LINE}' line in the generator's log: its start time is not logged"
    verdict = "PASS" if start.seconds <= STARTUP_MARGIN * timeout_s else "FAIL"
    return verdict, (
        f"the engine started in {start.seconds:.0f} s: {start.seconds / timeout_s:.0%} of train.startup_timeout_s "
        f"({timeout_s:.0f} s; at most {STARTUP_MARGIN:.0%} passes)"
    )
