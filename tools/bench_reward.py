"""Reward throughput on this machine: math calls/s (fast path and sympy path), code calls/s in the
sandbox, and the same through a scorer pool (what a reward worker rank sustains).

    python tools/bench_reward.py [--processes N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import time

from areal_hpc.reward.code import code_score
from areal_hpc.reward.math import math_score
from areal_hpc.reward.pool import ScorerPool

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = '[{"input": "1 2", "output": "3"}, {"input": "5 7", "output": "12"}, {"input": "0 0", "output": "0"}]'
CASES = {
    "math tiny (\\boxed{19} vs 19)": ("math", lambda i: (f"\\boxed{{{i % 200}}}", str(i % 200))),
    "math sympy (\\frac{i}{2i} vs 0.5)": (
        "math",
        lambda i: (f"\\boxed{{\\frac{{{i % 50 + 1}}}{{{2 * (i % 50 + 1)}}}}}", "0.5"),
    ),
    "code (3 tests)": ("code", lambda i: (ADD, TESTS)),
}


def in_process(kind: str, make, seconds: float) -> float:
    score = math_score if kind == "math" else code_score
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        reward, reason = score(*make(n))
        assert reward == 1.0, (reward, reason)
        n += 1
    return n / (time.perf_counter() - started)


def pooled(pool: ScorerPool, kind: str, make, seconds: float) -> float:
    # keep every scorer busy: twice as many tasks in flight as processes
    n, done, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        while pool.pending < 2 * len(pool.pids):
            pool.submit(n, kind, *make(n))
            n += 1
        for _, reward, reason in pool.poll(0.001):
            assert reward == 1.0, (reward, reason)
            done += 1
    return done / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    print(f"{'case':40s} {'in-process calls/s':>20s} {f'pool of {args.processes} calls/s':>22s}")
    pool = ScorerPool(args.processes, timeout_s=10.0)
    try:
        while not all(c.ready for c in pool.children):
            pool.poll(0.05)
        for name, (kind, make) in CASES.items():
            one = in_process(kind, make, args.seconds)
            many = pooled(pool, kind, make, args.seconds)
            print(f"{name:40s} {one:20.1f} {many:22.1f}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
