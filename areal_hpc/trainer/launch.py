"""Run a function on N local trainer ranks (spawned processes, gloo): for tests and benchmarks.

`run_ranks(fn, world, tp, pp, *args)` starts `world` processes; each calls `init_parallel` and then
`fn(par, *args)`; what a rank returns (if not None) comes back in a dict rank -> value. A rank that
fails fails the call with its traceback; nothing waits longer than `timeout_s`.
"""

from __future__ import annotations

import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, tp, pp, port, out_dir, fn, args):
    from areal_hpc.trainer.engine import init_parallel, shutdown_parallel

    torch.set_num_threads(1)
    try:
        par = init_parallel(rank, world, tp, pp, "127.0.0.1", port, timeout_s=120)
        result = fn(par, *args)
        if result is not None:
            torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        shutdown_parallel()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(fn, world: int, tp: int, pp: int, *args, timeout_s: float = 240.0) -> dict:
    """`fn(par, *args)` on `world` spawned ranks (TP x PP x DP); returns {rank: value} of non-None results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="areal-ranks-") as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, tp, pp, port, out, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        errors = sorted(Path(out).glob("*.err"))
        if errors:
            raise RuntimeError("\n".join(e.read_text() for e in errors))
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"ranks exited with {[p.exitcode for p in procs]} (timeout {timeout_s} s?)")
        return {int(f.stem[4:]): torch.load(f, weights_only=False) for f in Path(out).glob("rank*.pt")}
