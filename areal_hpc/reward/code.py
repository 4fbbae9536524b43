"""Code reward: the last fenced Python block of a response, run against stdin/stdout tests in a sandbox.

    reward = (tests whose stdout matches, line by line, trailing whitespace ignored) / (tests)

A test passes when the program exits 0 within its limits and prints the expected output. Over the
call's time limit the whole call scores 0 with reason "timeout".

The sandbox is bubblewrap, one per test run:
  - namespaces: network (only a loopback that nothing listens on), PID (the program sees only its
    own processes and cannot signal ours), IPC, UTS, cgroup, mounts;
  - files: /usr and the Python installation read-only, a private size-limited tmpfs on /tmp,
    /proc and a minimal /dev; everything else (the root too) read-only; no /etc, /home, /work;
  - environment: none of ours (`--clearenv`, and bwrap itself starts with a minimal one, so that
    its /proc/<pid>/environ holds nothing either);
  - limits (setrlimit, set by a small launcher inside the sandbox before the program runs): CPU
    seconds, address space, processes, file size, open files, no core dumps; output is read with a
    cap; a wall-clock deadline;
  - cleanup: bwrap's child is PID 1 of the sandbox's PID namespace; when it exits, or we SIGKILL it
    at the deadline, the kernel kills every process left in the namespace, and we return only once
    they are gone: nothing the program started outlives the call.

Processes limit and root. RLIMIT_NPROC counts processes per user and is not enforced for uid 0 of
the host. Run as root, bwrap keeps the host's user namespace (a new one would map the sandbox to
uid 0 again), drops every capability except setuid/setgid, and the launcher switches to an
unprivileged uid of its own (which drops those two as well) before the program runs. Run as
another user, bwrap makes a user namespace (`--unshare-all`) and the limit counts only the
sandbox's processes.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}
STDERR_BYTES = 8192
"""Stderr kept of a run (its tail); the rest is only counted against `SandboxLimits.output_bytes`."""
SANDBOX_UID_BASE = 200_000
"""Run as root, the program runs as uid SANDBOX_UID_BASE + (caller's pid % 100000): distinct per
concurrent caller process, so that their process limits do not add up."""

# Runs inside the sandbox as `python -I -c LAUNCHER cpu_s memory processes fsize nofile uid`: limits,
# then (as root) an unprivileged uid, then the program in a fresh __main__ module of this interpreter.
LAUNCHER = r"""
import os, resource, sys, types
cpu, mem, nproc, fsize, nofile, uid = (int(a) for a in sys.argv[1:7])
for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_FSIZE, fsize, fsize),
                        (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
with open("/sandbox/solution.py") as f:
    source = f.read()
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
main = types.ModuleType("__main__")
main.__file__ = "/sandbox/solution.py"
sys.modules["__main__"] = main
sys.argv = ["solution.py"]
del os, resource, types, cpu, mem, nproc, fsize, nofile, uid, res, soft, hard, f
exec(compile(source, "solution.py", "exec"), main.__dict__)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run (one test)."""

    cpu_s: int = 4
    """CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)."""
    wall_s: float = 6.0
    """Wall-clock seconds of one run (sleeping programs use no CPU)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS)."""
    processes: int = 8
    """Processes and threads of the sandbox user (RLIMIT_NPROC)."""
    output_bytes: int = 1 << 20
    """Stdout read at most (and stderr drained at most); a program printing more fails."""
    tmp_mb: int = 16
    """Size of the private /tmp, and the largest file the program may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""


@dataclass
class RunResult:
    stdout: str
    exit_code: int | None
    """The program's exit status (bwrap passes it on); None when we killed it."""
    status: str
    """"ok" (it ran to its end), "timeout", "output-limit", or "error: ..." (the sandbox failed)."""
    seconds: float
    stderr: str = ""
    """The last STDERR_BYTES of what the program wrote to stderr (a traceback ends there)."""


def extract_program(response: str) -> str | None:
    """The last fenced block tagged python/py/python3; without one, the last untagged block."""
    blocks = _FENCE.findall(response)
    tagged = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    found = tagged or untagged
    return found[-1] if found else None


def _python() -> tuple[str, list[str]]:
    """The interpreter the sandbox runs (the real one behind a venv) and the directories it needs."""
    exe = os.path.realpath(sys.executable)
    roots = {"/usr", os.path.realpath(sys.base_prefix)}
    if not any(exe.startswith(r + "/") for r in roots):
        roots.add(os.path.dirname(os.path.dirname(exe)))
    return exe, sorted(r for r in roots if not (r != "/usr" and r.startswith("/usr/")))


def _bwrap_args(limits: SandboxLimits, src_fd: int, as_root: bool) -> list[str]:
    exe, roots = _python()
    args = ["bwrap", "--die-with-parent", "--new-session", "--clearenv"]
    if as_root:  # see the module docstring: keep the host user namespace, switch uid inside
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all"]
    for name in ("lib", "lib64", "bin", "sbin"):
        target = Path("/") / name
        if target.is_symlink():
            args += ["--symlink", os.readlink(target), str(target)]
        elif target.is_dir():
            args += ["--ro-bind", str(target), str(target)]
    made = set()
    for root in roots:
        for parent in reversed(Path(root).parents):
            if str(parent) != "/" and str(parent) not in made:  # bwrap would make them 0700
                args += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        args += ["--ro-bind", root, root]
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(limits.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--perms", "0755", "--dir", "/sandbox"]
    args += ["--perms", "0444", "--ro-bind-data", str(src_fd), "/sandbox/solution.py"]
    args += ["--remount-ro", "/", "--chdir", "/tmp"]
    for key, value in (
        ("PATH", "/usr/bin:/bin"),
        ("HOME", "/tmp"),
        ("LANG", "C.UTF-8"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("OPENBLAS_NUM_THREADS", "1"),
    ):
        args += ["--setenv", key, value]
    uid = sandbox_uid()
    numbers = [limits.cpu_s, limits.memory_mb << 20, limits.processes, limits.tmp_mb << 20, limits.open_files, uid]
    return [*args, exe, "-I", "-c", LAUNCHER, *map(str, numbers)]


def sandbox_uid() -> int:
    """The uid this process's programs run as, when it runs as root (`SANDBOX_UID_BASE`)."""
    return SANDBOX_UID_BASE + os.getpid() % 100_000


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), wall_s: float | None = None):
    """Run `source` with `stdin` in the sandbox; a RunResult. Every process it started is gone on return."""
    started = time.monotonic()
    wall = limits.wall_s if wall_s is None else min(wall_s, limits.wall_s)
    if shutil.which("bwrap") is None:
        return RunResult("", None, "error: bwrap (bubblewrap) is not installed", 0.0)
    src_fd = _memfd("solution.py", source.encode("utf-8", "replace"))
    in_fd = _memfd("stdin", stdin.encode("utf-8", "replace"))  # a file, not a pipe: no writer to deadlock
    info_r, info_w = os.pipe()  # bwrap writes {"child-pid": <PID 1 of the sandbox>} here
    args = _bwrap_args(limits, src_fd, as_root=os.geteuid() == 0)
    args[1:1] = ["--info-fd", str(info_w)]
    try:
        proc = subprocess.Popen(
            args,
            stdin=in_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(src_fd, info_w),
            # bwrap and the sandbox's PID 1 stay in our process group: whoever kills that group (the
            # scorer pool does, for a scorer over its deadline) ends the sandbox too. Their death
            # alone would not: bwrap's PID 1 outlives a killed bwrap, blocked for good.
            env={"PATH": "/usr/bin:/bin"},  # bwrap's own environ (readable in /proc) holds nothing of ours
        )
    except OSError as e:
        os.close(info_r)
        return RunResult("", None, f"error: cannot start bwrap: {e}", time.monotonic() - started)
    finally:
        for fd in (src_fd, in_fd, info_w):
            os.close(fd)
    out, err, info, status, err_bytes = bytearray(), bytearray(), bytearray(), "ok", 0
    deadline = started + wall
    open_fds = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, info_r: info}
    try:
        while proc.stdout.fileno() in open_fds or proc.stderr.fileno() in open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            ready, _, _ = select.select(list(open_fds), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    del open_fds[fd]
                elif open_fds[fd] is err:  # its tail is kept; all of it is counted
                    err_bytes += len(chunk)
                    err += chunk
                    del err[:-STDERR_BYTES]
                else:
                    open_fds[fd] += chunk
            if len(out) > limits.output_bytes or err_bytes > limits.output_bytes:
                status = "output-limit"
                break
        if status == "ok":
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                status = "timeout"
    finally:
        _end(proc, _child_pid(info, info_r))
        os.close(info_r)
    code = proc.returncode if status == "ok" else None
    stderr = err.decode("utf-8", "replace")
    if status == "ok" and code != 0 and err_bytes == len(err) and err.startswith(b"bwrap:"):
        status = "error: sandbox: " + stderr.strip()[:300]
    stdout = out[: limits.output_bytes].decode("utf-8", "replace")
    return RunResult(stdout, code, status, time.monotonic() - started, stderr)


def _child_pid(info: bytearray, fd: int) -> int | None:
    """PID 1 of the sandbox (as the host numbers it), from bwrap's --info-fd."""
    if b"}" not in info:
        ready, _, _ = select.select([fd], [], [], 0)
        if ready:
            info += os.read(fd, 4096)
    try:
        return int(json.loads(bytes(info))["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _end(proc: subprocess.Popen, init_pid: int | None) -> None:
    """End the sandbox and wait until every process in it is gone.

    SIGKILL to the sandbox's PID 1 makes the kernel kill every process of its PID namespace, and
    PID 1 only becomes a zombie (or vanishes) once they are all reaped: so we wait for that state.
    bwrap itself may exit before its PID 1 has finished (it reports the program's exit status as soon
    as it has it), which is why waiting for bwrap alone is not enough."""
    if proc.poll() is None:  # while bwrap lives, its child's pid cannot be reused: safe to signal
        if init_pid is not None:
            _sigkill(init_pid)
        _sigkill(proc.pid)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    if init_pid is not None:
        give_up = time.monotonic() + 5.0
        while _alive(init_pid) and time.monotonic() < give_up:
            time.sleep(0.002)


def _alive(pid: int) -> bool:
    """Running (not a zombie, not gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_matches(stdout: str, expected: str) -> bool:
    """Line by line, trailing whitespace (and trailing empty lines) ignored."""
    return _lines(stdout) == _lines(expected)


def parse_tests(tests) -> list[dict]:
    """`tests` checked and normalised to a list of {"input": str, "output": str} ("input" defaults to "";
    a JSON string of such a list is accepted, as data files may hold it); ValueError naming the field
    ('tests' or 'tests[i]'). The one check of code tests: data loading and the code reward use it."""
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"'tests' is a string but not JSON: {e}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"'tests' must be a non-empty list of {{input, output}} (got {tests!r:.60})")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("output"), str) or not isinstance(t.get("input", ""), str):
            raise ValueError(f"'tests[{i}]' must be an object with string 'input' and 'output'")
    return [{"input": t.get("input", ""), "output": t["output"]} for t in tests]


def code_score(
    response: str, tests, timeout_s: float | None = 10.0, limits: SandboxLimits = SandboxLimits()
) -> tuple[float, str]:
    """(reward, reason): reason is "ok" (the reward is the fraction passed), "timeout" or "error: ..."."""
    try:
        deadline = time.monotonic() + (timeout_s if timeout_s and timeout_s > 0 else float("inf"))
        try:
            cases = parse_tests(tests)
        except ValueError as e:
            return 0.0, f"error: {e}"[:500]
        source = extract_program(str(response))
        if source is None:
            return 0.0, "ok"
        passed = 0
        for case in cases:
            left = deadline - time.monotonic()
            if left <= 0:
                return 0.0, "timeout"
            run = run_program(source, case["input"], limits, wall_s=left)
            if run.status.startswith("error"):
                return 0.0, run.status[:500]
            if run.status == "timeout" and left < limits.wall_s:  # the call's limit, not the test's
                return 0.0, "timeout"
            passed += run.status == "ok" and run.exit_code == 0 and output_matches(run.stdout, case["output"])
        return passed / len(cases), "ok"
    except Exception as e:  # noqa: BLE001 - a reward never raises; the reason carries the error
        return 0.0, f"error: {type(e).__name__}: {e}"[:500]


def code_reward(response: str, tests, timeout_s: float | None = 10.0, limits: SandboxLimits = SandboxLimits()) -> float:
    """The fraction of `tests` the last fenced Python block of `response` passes, in a sandbox; never raises."""
    return code_score(response, tests, timeout_s, limits)[0]
