"""A program run for an episode (`client.run_command`): an agent in another process, a CLI, a harness.

The program runs in a process group of its own, awaited without blocking the generator's event loop
(asyncio's subprocess support), and that whole group is killed when the program exits, when it passes its
time limit and when its episode is cancelled: a child it left running in the background goes with it. Only
a process that leaves the group on purpose (setsid, a daemon) escapes; a sandbox's own runtime is the place
to contain those. Written here because the standard library's `asyncio.wait_for(proc.communicate())` kills
the program alone and leaves its children, and waits for the end of its output, which a child left in the
background holds open.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

EXIT_POLL_S = 0.05
"""How often a running program's exit is looked for: a program call lasts seconds at least."""
OUTPUT_S = 5.0
"""How long the end of the program's output is awaited once its group is killed (only a process that left
the group can hold it open)."""


@dataclass
class CommandResult:
    returncode: int  # the program's exit status; negative: killed by that signal
    stdout: str  # its output, decoded as UTF-8 (undecodable bytes replaced)
    stderr: str
    seconds: float  # how long it ran


async def run_command(
    args, time_limit_s: float, *, env: dict | None = None, cwd=None, input: str | None = None
) -> CommandResult:
    """Run `args` (a list, or one string run by the shell) with this process's environment updated by `env`,
    `input` on its standard input; its CommandResult, or TimeoutError once `time_limit_s` passed (the process
    group killed, what it wrote lost)."""
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s!r}")
    options = dict(
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,  # its own process group: killed as one
    )
    started = time.monotonic()
    if isinstance(args, str):
        proc = await asyncio.create_subprocess_shell(args, **options)
    else:
        proc = await asyncio.create_subprocess_exec(*[str(a) for a in args], **options)
    # The pipes are read beside the wait for its exit, not by communicate() or wait() (which, before Python
    # 3.12, also waits for the pipes): a child left in the background would hold them open, and the
    # program's exit, not their end, is what ends it.
    out, err = asyncio.ensure_future(proc.stdout.read()), asyncio.ensure_future(proc.stderr.read())
    try:
        if input is not None:
            proc.stdin.write(input.encode())
            proc.stdin.close()
        if not await _exit(proc, time_limit_s):
            raise TimeoutError(
                f"{_name(args)} ran past its time limit of {time_limit_s:g} s: killed, with its process group"
            )
        seconds = time.monotonic() - started
        _kill_group(proc.pid)  # what it left running ends with it, and so do the pipes
        await asyncio.wait([out, err], timeout=OUTPUT_S)
        return CommandResult(proc.returncode, _text(out), _text(err), seconds)
    finally:
        _kill_group(proc.pid)
        await _exit(proc, OUTPUT_S)  # reaped by asyncio's child watcher
        out.cancel()
        err.cancel()


async def _exit(proc, limit_s: float) -> bool:
    """Whether the program exited within `limit_s` (its exit status is read by asyncio's child watcher)."""
    deadline = time.monotonic() + limit_s
    while proc.returncode is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(EXIT_POLL_S)
    return True


def _text(reader: asyncio.Future) -> str:
    if not reader.done():
        return "(not read: a process outside the program's group holds the pipe open)"
    return reader.result().decode(errors="replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _name(args) -> str:
    return repr(args if isinstance(args, str) else " ".join(str(a) for a in args))[:200]
