"""The reward worker: a pool of scorer processes that answers every request once, and the rank over real MPI."""

import os
import signal
import time
from pathlib import Path

import pytest

from areal_hpc.reward.pool import ScorerPool
from tests.support.helpers import MPI_PROGRAMS

TESTS = [{"input": "2 3", "output": "5"}, {"input": "1 1", "output": "2"}]
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def drain(pool: ScorerPool, limit_s: float = 60) -> dict:
    out, give_up = {}, time.monotonic() + limit_s
    while pool.pending:
        for key, reward, reason in pool.poll(0.01):
            assert key not in out, f"task {key} answered twice"
            out[key] = (reward, reason)
        assert time.monotonic() < give_up, f"{pool.pending} tasks unanswered"
    return out


@pytest.mark.slow
def test_pool_answers_every_task_once_and_survives_crashes():
    # The tasks meant to time out never end (sympy evaluating 9^(9^9) takes minutes; 2^(2^30), once used
    # here, takes 1.5 to 7 s, so it ended inside or past a 2 s limit by the machine's load), and the
    # deadline leaves the others room on a loaded machine.
    pool = ScorerPool(2, timeout_s=6.0)
    try:
        tasks = {
            0: ("math", "\\boxed{19}", "19", (1.0, "ok")),
            1: ("math", "\\boxed{18}", "19", (0.0, "ok")),
            2: ("math", "\\boxed{\\frac{1}{2}}", "0.5", (1.0, "ok")),
            3: ("math", "\\boxed{9^{9^{9}}}", "1", (0.0, "timeout")),
            4: ("code", ADD, TESTS, (1.0, "ok")),
            5: ("code", "```python\nwhile True: pass\n```", TESTS, (0.0, "timeout")),
        }
        for key, (kind, response, target, _) in tasks.items():
            pool.submit(key, kind, response, target)
        pool.submit(6, "poetry", "", "")
        got = drain(pool)
        for key, (*_, want) in tasks.items():
            assert got[key] == want, (key, got[key])
        assert got[6][0] == 0.0 and got[6][1].startswith("error: unknown reward kind")

        # A scorer process that dies mid-call: its task is answered with the cause, a new process takes over.
        pool.submit(10, "code", "```python\nimport time\ntime.sleep(5)\nprint(5)\n```", TESTS)
        busy = wait_for_busy_scorer(pool)
        os.kill(busy, signal.SIGKILL)
        got = drain(pool)
        assert got[10][0] == 0.0 and got[10][1] == "error: scorer process died (signal SIGKILL)"
        assert busy not in pool.pids and len(pool.pids) == 2
        for key in range(20, 30):
            pool.submit(key, "math", f"\\boxed{{{key}}}", str(key))
        assert set(drain(pool).values()) == {(1.0, "ok")}
    finally:
        pool.close()
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in pool.pids)


def test_pool_kills_a_scorer_that_overruns_its_deadline():
    """The pool's deadline is the last line of defence when the scorer's own limit fails (a C call that
    a timer cannot interrupt). A negative grace makes the pool's deadline fall before the scorer's own."""
    pool = ScorerPool(1, timeout_s=3.0, grace_s=-2.5)
    try:
        wait_ready(pool)
        first = pool.pids[0]
        started = time.monotonic()
        pool.submit("slow", "code", "```python\nimport time\ntime.sleep(2)\n```", TESTS)
        assert drain(pool) == {"slow": (0.0, "timeout")}
        assert time.monotonic() - started < 1.5
        assert pool.pids != [first], "the overrunning process was replaced"
        pool.submit("next", "math", "\\boxed{4}", "4")
        assert drain(pool) == {"next": (1.0, "ok")}
    finally:
        pool.close()


def test_pool_close_answers_queued_and_running_tasks_and_starts_nothing():
    pool = ScorerPool(1, timeout_s=5.0)
    try:
        for key in range(3):
            pool.submit(key, "code", "```python\nimport time\ntime.sleep(3)\n```", TESTS)
        wait_for_busy_scorer(pool)
        pids = pool.pids
        cancelled = pool.close("error: cancelled (stop)")
        assert sorted(k for k, *_ in cancelled) == [0, 1, 2] and pool.pending == 0
        assert {tuple(r) for _, *r in cancelled} == {(0.0, "error: cancelled (stop)")}
        assert pool.pids == [] and pool.replaced == 0, "closing starts no new scorer"
        assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
        pool.submit(3, "math", "\\boxed{4}", "4")
        assert pool.poll() == [(3, 0.0, "error: the scorer pool is closed")], "after close: answered at once"
        assert pool.close() == []
    finally:
        pool.close()


def wait_ready(pool: ScorerPool, limit_s: float = 60) -> None:
    give_up = time.monotonic() + limit_s
    while not all(c.ready for c in pool.children):
        pool.poll(0.01)
        assert time.monotonic() < give_up


def wait_for_busy_scorer(pool: ScorerPool, limit_s: float = 60) -> int:
    """The scorer process that is running a sandbox (it has a bwrap child); polls the pool meanwhile."""
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        assert pool.poll(0.005) == [], "a task finished before its sandbox was seen"
        for pid in pool.pids:
            if any(_comm(c) == "bwrap" for c in children_of(pid)):
                return pid
    raise AssertionError("no scorer started a sandbox")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- the rank under mpirun ----------------------------------------------------------------------


@pytest.mark.mpi
def test_reward_worker_rank_answers_every_request(run_mpi):
    r = run_mpi(MPI_PROGRAMS / "reward_world.py", n=2, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CONTROLLER OK" in r.stdout, r.stdout + r.stderr
    assert "WORKER CLEAN [] 0" in r.stdout, r.stdout + r.stderr
    print(next(line for line in r.stdout.splitlines() if line.startswith("BATCH")))


def test_pool_answers_in_a_process_with_more_than_1024_open_files():
    """A generator whose agents call over HTTP holds a socket per call: the pool's children get descriptors
    past 1024, which select() cannot watch."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        pool = ScorerPool(1, timeout_s=30.0)
        try:
            pool.submit(0, "math", "\\boxed{4}", "4")
            assert drain(pool) == {0: (1.0, "ok")}
        finally:
            pool.close()
    finally:
        for fd in held:
            os.close(fd)
