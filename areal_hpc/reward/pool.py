"""A pool of scorer processes: each reward call runs in the main thread of a child process, under a deadline.

```
 ScorerPool (in a reward worker)                     child: python -m areal_hpc.reward.pool
   submit -> queue -> an idle child --task------->   score(kind, response, target, timeout_s)
   poll()  <- (key, reward, reason) <--result-----   (its own time limit: a timer, a sandbox deadline)
           deadline + grace passed -> SIGKILL the child, (key, 0, "timeout"), start a new child
           child died mid-task     -> (key, 0, "error: scorer process died (...)"), start a new child
```

Every submitted task comes out of `poll` exactly once, whatever happens to the children.

Why not concurrent.futures or multiprocessing:
- A call stuck inside one C call (a huge integer power in sympy) cannot be interrupted, only killed
  with its process. ProcessPoolExecutor cannot kill one task, and a worker that dies breaks the
  executor: every pending future fails with BrokenProcessPool.
- spawn and forkserver start children by importing the parent's `__main__` again; on an MPI rank
  that module (or a test script) may initialise MPI at import, and a child doing so inside mpirun's
  environment joins or hangs the job. A bare fork after MPI_Init copies the MPI library's threads
  and sockets into the child.
So each child is fork + exec of a fresh interpreter running this module (exec right after fork is
safe after MPI_Init), with mpirun's variables removed from its environment. Parent and child talk
over the child's stdin/stdout: length-prefixed pickles, one task at a time.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_MPI_ENV_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "OPAL_", "HYDRA_", "I_MPI_", "MPICH_")
_REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class _Task:
    key: Any
    kind: str
    response: str
    target: Any


@dataclass
class _Child:
    proc: subprocess.Popen
    started: float
    ready: bool = False
    task: _Task | None = None
    deadline: float = float("inf")
    buf: bytearray = field(default_factory=bytearray)

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()


class ScorerPool:
    """`processes` scorer children; a task's result comes within `timeout_s + grace_s` of its start."""

    def __init__(
        self,
        processes: int,
        timeout_s: float,
        grace_s: float = 2.0,
        start_timeout_s: float = 120.0,
        max_start_failures: int = 3,
    ):
        if processes < 1:
            raise ValueError(f"a scorer pool needs at least 1 process (got {processes})")
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.start_timeout_s, self.max_start_failures = start_timeout_s, max_start_failures
        self.queue: collections.deque[_Task] = collections.deque()
        self.children: list[_Child] = []
        self.start_failures = 0  # consecutive children that died or hung before becoming ready
        self.broken: str | None = None  # why no child can start; every task then fails at once
        self.replaced = 0  # children killed or found dead and replaced (a figure for the logs)
        for _ in range(processes):
            self._start()

    # --- public ----------------------------------------------------------------------------------

    def submit(self, key: Any, kind: str, response: str, target) -> None:
        self.queue.append(_Task(key, kind, response, target))

    @property
    def pending(self) -> int:
        """Tasks submitted and not yet returned by `poll`."""
        return len(self.queue) + sum(c.task is not None for c in self.children)

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    def poll(self, wait_s: float = 0.0) -> list[tuple[Any, float, str]]:
        """Results `(key, reward, reason)` ready now, waiting up to `wait_s` for the first one."""
        results: list[tuple[Any, float, str]] = []
        self._dispatch(results)
        by_fd = {c.fd: c for c in self.children}
        if by_fd:
            ready, _, _ = select.select(list(by_fd), [], [], wait_s)
            for fd in ready:
                if by_fd[fd] in self.children:  # not replaced earlier in this loop
                    self._read(by_fd[fd], results)
        elif wait_s > 0:
            time.sleep(wait_s)
        self._check_deadlines(results)
        self._dispatch(results)
        return results

    def cancel(self, reason: str) -> list[tuple[Any, float, str]]:
        """Drop every queued and running task, each as `(key, 0.0, reason)`."""
        out = [(t.key, 0.0, reason) for t in self.queue]
        self.queue.clear()
        for child in list(self.children):
            if child.task is not None:
                out.append((child.task.key, 0.0, reason))
                self._replace(child)
        return out

    def close(self) -> None:
        """Kill every child (a task still running is lost: `cancel` first to answer it)."""
        for child in self.children:
            _kill(child.proc)
        self.children.clear()

    # --- children --------------------------------------------------------------------------------

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV_PREFIXES)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_hpc.reward.pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: nothing left in a buffer to flush into a dead child's pipe
            env=env,
            start_new_session=True,  # the rank's Ctrl-C is the controller's to act on, not the scorers'
        )
        self.children.append(_Child(proc, time.monotonic()))

    def _replace(self, child: _Child) -> None:
        _kill(child.proc)
        self.children.remove(child)
        self.replaced += 1
        if self.start_failures >= self.max_start_failures:
            self.broken = f"{self.start_failures} scorer processes in a row failed to start (see the log above)"
            log.error("reward scorer pool: %s", self.broken)
            return
        self._start()

    def _read(self, child: _Child, results: list) -> None:
        try:
            chunk = os.read(child.fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:  # the child exited or was killed
            code = child.proc.wait()
            if child.task is not None:
                results.append((child.task.key, 0.0, f"error: scorer process died ({_exit_text(code)})"))
            elif not child.ready:
                self.start_failures += 1
            log.warning("reward scorer process %d died (%s); starting another", child.proc.pid, _exit_text(code))
            self._replace(child)
            return
        child.buf += chunk
        while len(child.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(child.buf)
            if len(child.buf) < _HEADER.size + n:
                break
            msg = pickle.loads(bytes(child.buf[_HEADER.size : _HEADER.size + n]))
            del child.buf[: _HEADER.size + n]
            if msg[0] == "ready":
                child.ready, self.start_failures = True, 0
            elif msg[0] == "result" and child.task is not None:
                results.append((child.task.key, float(msg[1]), str(msg[2])))
                child.task, child.deadline = None, float("inf")

    def _check_deadlines(self, results: list) -> None:
        now = time.monotonic()
        for child in list(self.children):
            if child.task is not None and now > child.deadline:
                log.warning("reward call over its limit: killing scorer process %d", child.proc.pid)
                results.append((child.task.key, 0.0, "timeout"))
                self._replace(child)
            elif not child.ready and now > child.started + self.start_timeout_s:
                log.warning(
                    "scorer process %d not ready after %.0f s: killing it", child.proc.pid, self.start_timeout_s
                )
                self.start_failures += 1
                self._replace(child)

    def _dispatch(self, results: list) -> None:
        if self.broken:
            results.extend((t.key, 0.0, f"error: {self.broken}") for t in self.queue)
            self.queue.clear()
            return
        for child in list(self.children):
            if not self.queue:
                return
            if not child.ready or child.task is not None:
                continue
            task = self.queue.popleft()
            try:
                _write(child.proc.stdin, (task.kind, task.response, task.target, self.timeout_s))
            except OSError:  # it died while idle: the task never reached it, so it goes to another child
                self.queue.appendleft(task)
                self._replace(child)
                continue
            child.task, child.deadline = task, time.monotonic() + self.timeout_s + self.grace_s


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _write(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(f.fileno(), view) :]


def _read_frame(f):
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = bytearray()
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return pickle.loads(bytes(data))


def _die_with_parent() -> None:
    """A rank killed outright (MPI abort) must not leave its scorers running: PR_SET_PDEATHSIG."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - not Linux: the parent's pipe closing still ends the child
        pass


def _child_main() -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a library's stray print goes to the log, not into the protocol
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _die_with_parent()
    from areal_hpc.reward import score

    score("math", "\\boxed{x+1}", "1+x", None)  # import sympy and math-verify before the first deadline
    _write(out, ("ready", os.getpid()))
    while (task := _read_frame(inp)) is not None:
        kind, response, target, timeout_s = task
        reward, reason = score(kind, response, target, timeout_s)
        _write(out, ("result", reward, reason))


if __name__ == "__main__":
    _child_main()
