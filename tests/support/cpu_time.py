"""`pytest --cpu-time` (`tools/test.sh --cpu-time`): where the suite's time goes, beside `--durations`. For each
test file its wall time and the busy CPU seconds of the whole machine meanwhile (every process: the ranks, engines
and Slurm daemons a test starts, not only pytest's), then the session's. Busy CPU over wall time and cores says how
full the cores were; busy CPU over the cores is the least wall time the same work could take here: a file whose
cores stood half idle is one a second worker could share, a session whose CPU alone fills its wall time is not
made faster by more workers.

Read from the first line of /proc/stat (Linux), so a figure is only the test's own when nothing else runs; under
pytest-xdist (the unit tier) only the session's line.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass

import pytest

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""Of /proc/stat's cpu line: user, nice, system, irq, softirq, steal (guest time is counted in user already)."""
TOP = 20
"""The files listed, by wall time."""


def busy_cpu_s(stat_line: str | None = None) -> float:
    """The machine's busy CPU seconds since boot, all cores (`stat_line`: /proc/stat's first line)."""
    if stat_line is None:
        with open("/proc/stat") as f:
            stat_line = f.readline()
    ticks = [int(x) for x in stat_line.split()[1:]]
    return sum(ticks[i] for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def cores() -> int:
    """The machine's, which /proc/stat's first line counts."""
    return os.cpu_count() or 1


@dataclass
class Span:
    wall_s: float
    cpu_s: float


def report(spans: dict[str, list[Span]], session: Span, n_cores: int, top: int = TOP) -> list[str]:
    """The lines printed: the `top` files of `spans` (a test file -> its tests' spans) by wall time, the others
    in one line, then the session."""

    def row(name: str, tests: int, s: Span) -> str:
        full = s.cpu_s / (s.wall_s * n_cores) if s.wall_s > 0 else 0.0
        return f"{s.wall_s:8.1f} {s.cpu_s:8.1f} {full:6.0%} {tests or '-':>5}  {name}"

    def total(parts) -> Span:
        return Span(sum(s.wall_s for s in parts), sum(s.cpu_s for s in parts))

    files = {f: total(parts) for f, parts in spans.items()}
    ranked = sorted(files, key=lambda f: -files[f].wall_s)
    lines = [f"{'wall s':>8} {'CPU s':>8} {'cores':>6} {'tests':>5}  (the machine's busy CPU, {n_cores} cores)"]
    lines += [row(f, len(spans[f]), files[f]) for f in ranked[:top]]
    if rest := [s for f in ranked[top:] for s in spans[f]]:
        lines.append(row(f"the other {len(ranked) - top} files", len(rest), total(rest)))
    lines.append(row("the session", sum(map(len, spans.values())), session))
    lines.append(
        f"the session's CPU alone takes {session.cpu_s / n_cores:.0f} s on {n_cores} cores at full use; "
        f"it took {session.wall_s:.0f} s"
    )
    return lines


class CpuTime:
    """The plugin: a span per test, its setup, call and teardown (a shared fixture's setup counts for the first test
    that uses it, its teardown for the last)."""

    def __init__(self):
        self.spans: dict[str, list[Span]] = defaultdict(list)
        self.start = (time.monotonic(), busy_cpu_s())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        t0, c0 = time.monotonic(), busy_cpu_s()
        yield
        self.spans[item.nodeid.split("::")[0]].append(Span(time.monotonic() - t0, busy_cpu_s() - c0))

    def pytest_terminal_summary(self, terminalreporter):
        t0, c0 = self.start
        session = Span(time.monotonic() - t0, busy_cpu_s() - c0)
        terminalreporter.section("cpu time")
        for line in report(self.spans, session, cores()):
            terminalreporter.write_line(line)
