"""A real MPI world for tests/test_reward_worker.py: rank 1 runs the reward worker's `serve`, rank 0 drives
it as the controller would (a scorer killed mid-request, math and code rewards right, wrong, hanging and
broken, a Stop with a request running) and prints `CONTROLLER OK`; the worker prints `WORKER CLEAN`, the
processes it left and the sandboxes still running.

    mpirun -n 2 python tests/support/mpi/reward_world.py
"""

import os
import tempfile
import time
from pathlib import Path

import numpy as np


def children_of(pid):
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def comm(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def started_s(pid) -> float:
    """When a process started, in seconds since boot (/proc/PID/stat's starttime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def leftovers(since_s: float):
    """The worker's children (but its shell) and the sandboxes still running anywhere that started after
    `since_s` (seconds since boot): this world's, not those another program on the machine left."""
    children = [p for p in children_of(os.getpid()) if comm(p) != "sh"]
    bwraps = 0
    for p in Path("/proc").iterdir():
        try:
            bwraps += (
                p.name.isdigit()
                and comm(int(p.name)) == "bwrap"
                and b"/sandbox/solution.py" in (p / "cmdline").read_bytes()
                and started_s(p.name) >= since_s
            )
        except OSError:  # it ended while we looked
            pass
    return children, bwraps


def main():
    from mpi4py import MPI

    from areal_hpc.config import Config
    from areal_hpc.data.tiny import build_tokenizer
    from areal_hpc.layout import Layout
    from areal_hpc.protocol import Mailbox, RewardRequest, RewardResult, Stop
    from areal_hpc.rank_context import RankContext

    world = MPI.COMM_WORLD
    tok = build_tokenizer()  # the worker decodes the trajectories' tokens with the run's tokenizer
    cfg = Config()
    cfg.allocation.gen_gpus = 1  # the split of the default 2 nodes of 1 GPU
    cfg.reward.timeout_s = 4.0  # room for a sandboxed program on a loaded machine; the hanging tasks never end
    cfg.reward.processes = 2
    layout = Layout.from_config(cfg)
    if world.rank == 1:
        from areal_hpc.reward.worker import serve

        since = uptime_s() - 1.0  # the clock ticks of /proc/PID/stat round down
        world.send(os.getpid(), dest=0)
        model = Path(tempfile.mkdtemp())
        tok.save_pretrained(model)
        assert serve(RankContext(cfg, layout, world, None, Path("."), model)) == 0
        # Every process was sent SIGKILL before `serve` returned; the kernel ends them a moment later, a
        # longer moment on a loaded machine: what is still there after 10 s was left behind.
        give_up = time.monotonic() + 10.0
        while (left := leftovers(since)) != ([], 0) and time.monotonic() < give_up:
            time.sleep(0.05)
        print("WORKER CLEAN", *left, flush=True)
        return

    box = Mailbox(world)
    worker = world.recv(source=1)

    def request(request_id, kind, response, target):
        ids = np.array(tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], np.int32)
        return RewardRequest(request_id, kind, ids, target)

    def collect(ids, timeout_s=60):
        got = {}
        while set(got) != set(ids):
            msg = box.recv(source=1, timeout_s=timeout_s).msg
            assert isinstance(msg, RewardResult), msg
            assert msg.request_id in ids and msg.request_id not in got, f"unexpected or repeated {msg.request_id}"
            got[msg.request_id] = (msg.reward, msg.reason)
        return got

    # 1. A scorer process crashes mid-request (killed from outside): answered with the cause.
    box.send(1, request(100, "code", "```python\nimport time\ntime.sleep(3)\nprint(5)\n```", TESTS))
    give_up, busy = time.monotonic() + 60, None
    while busy is None:
        assert time.monotonic() < give_up, "no scorer started the sandbox"
        for pid in children_of(worker):
            if any(comm(c) == "bwrap" for c in children_of(pid)):
                busy = pid
        time.sleep(0.005)
    os.kill(busy, 9)
    got = collect({100})
    assert got[100] == (0.0, "error: scorer process died (signal SIGKILL)"), got

    # 2. Math and code, right and wrong, hanging, broken: every one answered with its reward and reason.
    want = {
        1: ("math", "\\boxed{19}", "19", (1.0, "ok")),
        2: ("math", "I think \\boxed{18}", "19", (0.0, "ok")),
        3: ("math", "\\boxed{\\frac{1}{2}}", "0.5", (1.0, "ok")),
        4: ("math", "\\boxed{9^{9^{9}}}", "1", (0.0, "timeout")),  # sympy: minutes
        5: ("code", ADD, TESTS, (1.0, "ok")),
        6: ("code", ADD.replace("a + b", "a * b if a > 1 else a + b"), TESTS, (0.5, "ok")),
        7: ("code", "```python\nwhile True:\n    pass\n```", TESTS, (0.0, "timeout")),
        8: ("code", ADD, "not json", None),
        9: ("poetry", "roses", "red", None),
    }
    for i in range(10, 50):
        want[i] = ("math", f"\\boxed{{{i}}}", str(i), (1.0, "ok"))
    started = time.monotonic()
    for request_id, (kind, response, target, _) in want.items():
        box.send(1, request(request_id, kind, response, target))
    got = collect(set(want))
    for request_id, (*_, expected) in want.items():
        if expected is None:
            assert got[request_id][0] == 0.0 and got[request_id][1].startswith("error: "), got[request_id]
        else:
            assert got[request_id] == expected, (request_id, got[request_id], expected)
    print(f"BATCH {len(want)} requests answered in {time.monotonic() - started:.2f} s", flush=True)

    # 3. Stop with a request still running: it is answered (cancelled) before the worker returns.
    box.send(1, request(200, "code", "```python\nimport time\ntime.sleep(5)\n```", TESTS))
    time.sleep(0.3)
    box.send(1, Stop("done"))
    got = collect({200})
    assert got[200] == (0.0, "error: cancelled (stop)"), got
    box.flush()
    print("CONTROLLER OK", flush=True)


TESTS = [{"input": "2 3", "output": "5"}, {"input": "1 1", "output": "2"}]
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"

if __name__ == "__main__":
    main()
