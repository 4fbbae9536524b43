"""A program run for an episode (`client.run_command`): an agent in another process, a CLI, a harness.

The program runs in a process group of its own, awaited without blocking the generator's event loop
(asyncio's subprocess support), and that whole group is killed when the program exits, when it passes its
time limit and when its episode is cancelled: a child it left running in the background goes with it. Only
a process that leaves the group on purpose (setsid, a daemon) escapes; a sandbox's own runtime is the place
to contain those. Written here because the standard library's `asyncio.wait_for(proc.communicate())` kills
the program alone and leaves its children.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass


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
    try:
        out, err = await asyncio.wait_for(
            proc.communicate(None if input is None else input.encode()), timeout=time_limit_s
        )
    except TimeoutError:
        raise TimeoutError(
            f"{_name(args)} ran past its time limit of {time_limit_s:g} s: killed, with its process group"
        ) from None
    finally:
        _kill_group(proc.pid)
        if proc.returncode is None:
            await proc.wait()
    seconds = time.monotonic() - started
    return CommandResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), seconds)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _name(args) -> str:
    return repr(args if isinstance(args, str) else " ".join(str(a) for a in args))[:200]
