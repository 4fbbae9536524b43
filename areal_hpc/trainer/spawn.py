"""Run a function on N local trainer ranks (processes of their own): for tests, benchmarks, the GPU check and export.

`run_ranks(fn, world, tp, pp, *args)` opens the world's TCPStore (on a port the OS picks, bound from the
start), starts `world` processes; each connects to it, calls `init_parallel` and then `fn(par, *args)`; what a rank returns (if not None) comes back in a dict rank -> value. A rank that
fails fails the call with its traceback; nothing waits longer than `timeout_s`.

The device is the one of `default_device()` unless given: AREAL_DEVICE (auto, cpu or cuda; auto when
unset) resolved by `areal_hpc.device`, so that the same tests and checks run on a CPU machine and on a
GPU machine. On GPUs each rank sees one GPU of its own, as trainer ranks do in a run (the launcher
narrows CUDA_VISIBLE_DEVICES); a world larger than the visible GPUs is refused (NCCL cannot put two
ranks on one GPU).

On the CPU the ranks are forks of multiprocessing's fork server, which imports torch and Megatron once per
calling process (`PRELOAD`): a rank then starts in a tenth of a second, where a spawned one spent 8 s
importing them again (this machine; a test session starts a hundred worlds). On GPUs they are spawned:
forking is safe with CUDA only while the server never touched it, which megatron-core's imports do not
promise (it imports TransformerEngine when installed), and a GPU rank's start is CUDA's more than its
imports. Either way a rank takes, as its arguments are unpickled and before `fn`'s module is imported, the
caller's environment of that moment (its own CUDA_VISIBLE_DEVICES on GPUs) and the caller's stdout and
stderr (descriptors sent with the arguments): a fork would otherwise have the server's, as they were when
the server started. Only multiprocessing's import of the caller's main module comes before.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from multiprocessing import reduction
from pathlib import Path

import torch
import torch.multiprocessing as mp

from areal_hpc.device import resolve_device, visible_gpus
from areal_hpc.network import LOOPBACK


def default_device() -> str:
    """The device of trainer tests and checks: AREAL_DEVICE (auto, cpu, cuda), resolved."""
    return resolve_device(os.environ.get("AREAL_DEVICE", "auto"))


PRELOAD = ["areal_hpc.trainer.engine"]
"""What the fork server imports before it forks a rank: torch, megatron-core and the trainer's engine."""


class _Callers:
    """The caller's environment and output, pickled with a rank's arguments (first, so that they are the
    rank's before the rest is unpickled)."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def __reduce__(self):
        fds = [(fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd)]  # multiprocessing sends them on
        return _adopt, (self.env, fds)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _adopt(env: dict[str, str], fds: list) -> None:
    """In the rank: the caller's environment, and its stdout and stderr in place of the server's (a spawned
    rank has them already, under the same numbers)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, dup in fds:
        sent = dup.detach()
        if sent != fd:
            os.dup2(sent, fd)
            os.close(sent)


def _entry(adopted, rank, world, tp, pp, ep, port, device, out_dir, fn, args):
    """`adopted`: what `_Callers` became once unpickled (None, the caller's environment and output adopted)."""
    from areal_hpc.trainer.cuda_allocator import expandable_segments
    from areal_hpc.trainer.engine import init_parallel, shutdown_parallel

    if device == "cpu":
        torch.set_num_threads(1)  # several ranks share this machine's cores
    else:
        expandable_segments()  # as a run's trainer rank has it (areal_hpc.main)
    try:
        timeout = datetime.timedelta(seconds=120)
        store = torch.distributed.TCPStore(LOOPBACK, port, world, False, timeout=timeout)
        par = init_parallel(rank, world, tp, pp, store, device, timeout_s=120, ep=ep)
        result = fn(par, *args)
        if result is not None:
            torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        shutdown_parallel()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(
    fn, world: int, tp: int, pp: int, *args, ep: int = 1, device: str | None = None, timeout_s: float = 240.0
) -> dict:
    """`fn(par, *args)` on `world` local ranks (TP x PP x DP, expert parallel `ep`); returns {rank: value}
    of non-None results."""
    device = device or default_device()
    gpus = visible_gpus() if device == "cuda" else []
    if device == "cuda" and world > len(gpus):
        raise RuntimeError(f"{world} trainer ranks need {world} GPUs; this process sees {len(gpus)} ({gpus})")
    ctx = mp.get_context("forkserver" if device == "cpu" else "spawn")  # why: the module docstring
    if device == "cpu":
        ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="areal-ranks-") as out:
        store = torch.distributed.TCPStore(LOOPBACK, 0, world, True, wait_for_workers=False)
        port = store.port
        procs = []
        for r in range(world):
            callers = _Callers({**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus[r]} if gpus else {})})
            p = ctx.Process(target=_entry, args=(callers, r, world, tp, pp, ep, port, device, out, fn, args))
            p.start()
            procs.append(p)
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
