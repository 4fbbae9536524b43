"""A pool of child processes that run one named function, each call in a child's main thread, under a
deadline: the reward workers score with it (`ScorerPool`: `areal_hpc.reward:score`), the generators run
tools with it (`areal_hpc.workflow.tools.ToolPool`: `run_tool`).

```
 TaskPool (in a rank)                                child: python -m areal_hpc.reward.pool
   start  -> a new child --("init", "module:function", warm-up args)--> import it, call it once, "ready"
   submit -> queue -> an idle child --args----------->   function(*args) (its own time limit: a timer,
   poll()  <- (key, *result) <--result---------------    a sandbox deadline)
           deadline + grace passed -> SIGKILL the child, (key, *failed("timeout")), start a new child
           child died mid-task     -> (key, *failed("error: <name> process died (...)")), start a new child
```

Every submitted task comes out of `poll` (or `close`) exactly once, whatever happens to the children.
The function returns a tuple (the result after the key); `failed(reason, seconds)` makes the same
shape for a task the pool itself had to answer.

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
over the child's stdin/stdout: length-prefixed pickles, one task at a time. Each child has its own
pid, hence its own sandbox uid (reward/code.py), so concurrent sandboxes do not share a process limit.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_MPI_ENV_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "OPAL_", "HYDRA_", "I_MPI_", "MPICH_")


@dataclass
class _Task:
    key: Any
    args: tuple


@dataclass
class _Child:
    proc: subprocess.Popen
    started: float
    ready: bool = False
    task: _Task | None = None
    dispatched: float = 0.0
    deadline: float = float("inf")
    buf: bytearray = field(default_factory=bytearray)

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()


def pool_size(processes: int) -> int:
    """A pool size setting (`reward.processes`, `rollout.tool_processes`), or one process per core this
    rank may run on when it is 0."""
    return processes if processes > 0 else max(1, len(os.sched_getaffinity(0)))


class TaskPool:
    """`processes` children running `function` ("package.module:name"); a task's result comes within
    `timeout_s + grace_s` of its start. `warm_up`: arguments of one call a new child makes before it
    reports ready (imports done before the first deadline counts). `name` names the children in logs
    and errors ("scorer", "tool")."""

    def __init__(
        self,
        function: str,
        processes: int,
        timeout_s: float,
        failed: Callable[[str, float], tuple],
        warm_up: tuple | None = None,
        name: str = "task",
        grace_s: float = 2.0,
        start_timeout_s: float = 120.0,
        max_start_failures: int = 3,
    ):
        if processes < 1:
            raise ValueError(f"a {name} pool needs at least 1 process (got {processes})")
        self.function, self.failed, self.warm_up, self.name = function, failed, warm_up, name
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

    def submit(self, key: Any, *args) -> None:
        """Queue `function(*args)`; its result comes out of `poll` as `(key, *result)`."""
        self.queue.append(_Task(key, args))

    @property
    def pending(self) -> int:
        """Tasks submitted and not yet returned by `poll`."""
        return len(self.queue) + sum(c.task is not None for c in self.children)

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    def poll(self, wait_s: float = 0.0) -> list[tuple]:
        """Results `(key, *result)` ready now, waiting up to `wait_s` for the first one."""
        results: list[tuple] = []
        self._dispatch(results)
        by_fd = {c.fd: c for c in self.children}
        if by_fd:
            poller = select.poll()  # not select.select: a rank with many sockets (agents' calls) has fds past 1024
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(wait_s * 1000):  # readable, or the child's end closed: both are read
                if by_fd[fd] in self.children:  # not replaced earlier in this loop
                    self._read(by_fd[fd], results)
        elif wait_s > 0:
            time.sleep(wait_s)
        self._check_deadlines(results)
        self._dispatch(results)
        return results

    def close(self, reason: str = "error: cancelled") -> list[tuple]:
        """Kill every child and answer every queued and running task as `(key, *failed(reason))`; no child
        is started again, and a task submitted afterwards fails at its first `poll`. Closing twice is
        harmless (the second answers nothing)."""
        now = time.monotonic()
        out = [(c.task.key, *self.failed(reason, now - c.dispatched)) for c in self.children if c.task is not None]
        out += [(t.key, *self.failed(reason, 0.0)) for t in self.queue]
        self.queue.clear()
        for child in self.children:
            _kill(child.proc)
        self.children.clear()
        self.broken = f"the {self.name} pool is closed"
        return out

    # --- children --------------------------------------------------------------------------------

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV_PREFIXES)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_hpc.reward.pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: nothing left in a buffer to flush into a dead child's pipe
            env=env,
            start_new_session=True,  # the rank's Ctrl-C is the controller's to act on, not the children's
        )
        self.children.append(_Child(proc, time.monotonic()))
        try:
            _write(proc.stdin, ("init", self.function, self.warm_up))
        except OSError:  # it died at once: its closed stdout says so in `_read`, counted as a failed start
            pass

    def _replace(self, child: _Child) -> None:
        _kill(child.proc)
        self.children.remove(child)
        self.replaced += 1
        if self.start_failures >= self.max_start_failures:
            self.broken = f"{self.start_failures} {self.name} processes in a row failed to start (see the log above)"
            log.error("%s pool: %s", self.name, self.broken)
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
                reason = f"error: {self.name} process died ({_exit_text(code)})"
                results.append((child.task.key, *self.failed(reason, time.monotonic() - child.dispatched)))
            elif not child.ready:
                self.start_failures += 1
            log.warning("%s process %d died (%s); starting another", self.name, child.proc.pid, _exit_text(code))
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
                results.append((child.task.key, *msg[1]))
                child.task, child.deadline = None, float("inf")

    def _check_deadlines(self, results: list) -> None:
        now = time.monotonic()
        for child in list(self.children):
            if child.task is not None and now > child.deadline:
                log.warning("%s call over its limit: killing %s process %d", self.name, self.name, child.proc.pid)
                results.append((child.task.key, *self.failed("timeout", now - child.dispatched)))
                self._replace(child)
            elif not child.ready and now > child.started + self.start_timeout_s:
                log.warning(
                    "%s process %d not ready after %.0f s: killing it", self.name, child.proc.pid, self.start_timeout_s
                )
                self.start_failures += 1
                self._replace(child)

    def _dispatch(self, results: list) -> None:
        if self.broken:
            results.extend((t.key, *self.failed(f"error: {self.broken}", 0.0)) for t in self.queue)
            self.queue.clear()
            return
        for child in list(self.children):
            if not self.queue:
                return
            if not child.ready or child.task is not None:
                continue
            task = self.queue.popleft()
            try:
                _write(child.proc.stdin, task.args)
            except OSError:  # it died while idle: the task never reached it, so it goes to another child
                self.queue.appendleft(task)
                self._replace(child)
                continue
            child.task, child.dispatched = task, time.monotonic()
            child.deadline = child.dispatched + self.timeout_s + self.grace_s


class ScorerPool(TaskPool):
    """The reward workers' pool: `submit(key, kind, response, target)`, results `(key, reward, reason)`
    with reason "ok", "timeout" or "error: ..." (`areal_hpc.reward.score`)."""

    def __init__(self, processes: int, timeout_s: float, **kwargs):
        super().__init__(
            "areal_hpc.reward:score",
            processes,
            timeout_s,
            failed=lambda reason, seconds: (0.0, reason),
            warm_up=("math", "\\boxed{x+1}", "1+x", None),
            name="scorer",
            **kwargs,
        )

    def submit(self, key: Any, kind: str, response: str, target) -> None:
        super().submit(key, kind, response, target, self.timeout_s)


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
    """A rank killed outright (MPI abort) must not leave its children running: PR_SET_PDEATHSIG."""
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
    init = _read_frame(inp)
    if init is None or init[0] != "init":
        return
    _, spec, warm_up = init
    module, _, name = spec.partition(":")
    function = getattr(importlib.import_module(module), name)
    if warm_up is not None:
        function(*warm_up)  # imports (sympy, math-verify) done before the first deadline counts
    _write(out, ("ready", os.getpid()))
    while (args := _read_frame(inp)) is not None:
        _write(out, ("result", tuple(function(*args))))


if __name__ == "__main__":
    _child_main()
