"""What `areal-hpc doctor` runs on every rank of its probe job: `python doctor_probe.py DIR DEVICE STARTS SOURCES IFACE`.

```
 every rank   DIR/token readable? (the login node wrote it)   -> DIR/rank<r>.json   (before anything can hang)
              the memory the task may use (its cgroup's limit, its node's total)
              IFACE (cluster.network_interface) on its node?
 first rank   python doctor_probe.py --versions (a child):    -> its node's torch, vllm, megatron.core, mpi4py
   of a node  a program in the code sandbox (bubblewrap)       -> "ok", or what went wrong
 every rank   MPI: allreduce over the world                    -> DIR/rank<r>.json again, with the result
 GPU ranks    GPUs they see; all-reduce of every GPU rank (generators and trainers) over
              torch.distributed with the run's backend (nccl on cuda, gloo on cpu) -> DIR/rank<r>.json again
 sync         the run's start-up weight-sync broadcasts: each group's source to every generator rank,
   sources +  one group per (pipeline stage, expert rank), opened, joined and checked as a run does
 generators   (areal_hpc.weight_sync.broadcast: open_groups, then each end's join)
                                                               -> DIR/rank<r>.json again
```

Only the standard library at import: on a node where the environment is broken this still runs and says
so. The versions come from a child process so that vLLM is imported before MPI is initialised in no
process (a generator rank never sees that order either). STARTS: the first world rank of each role,
controller, reward, generator, trainer ("0,1,2,3"; `Layout.ranks`); SOURCES: each weight-sync group's source as stage:expert rank:world rank (`Layout.sync_sources`,
"0:0:4,0:1:5,1:0:8,1:1:9"; expert rank 0 only when the trainer is not expert-parallel). A check that fails
on one rank fails on every rank taking part (areal_hpc.network.offer, `agree`), which all go on to the
next check: the probe ends and every rank writes its report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

PACKAGES = ("torch", "vllm", "megatron.core", "mpi4py")
"""What the ranks import; each must import on the nodes, at the login node's version. (areal_hpc itself is
imported as the ranks import it, from the job's working directory or the install: a node without it is named
by the checks that import it.)"""
JOIN_S = 120.0
"""How long the weight-sync check's join waits (the ranks start together; the probe job has 5 minutes)."""


def versions() -> dict[str, str]:
    """{package: version} or {package: "missing: <the import error>"}."""
    import importlib

    found = {}
    for name in PACKAGES:
        try:
            found[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except Exception as e:  # noqa: BLE001 - every way an import fails is the answer
            found[name] = f"missing: {type(e).__name__}: {e}"
    return found


def task_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> dict:
    """The memory this task may use, in bytes: `node`, its node's MemTotal; `limit`, its cgroup's limit
    (cgroup v2 memory.max, else v1 memory.limit_in_bytes, the nearest set on the way up; None: no limit
    found), which is what Slurm's task/cgroup plugin enforces of --mem."""
    node = None
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            node = int(line.split()[1]) * 1024
    limit = None
    for entry in (proc / "self" / "cgroup").read_text().splitlines():
        hierarchy, controllers, path = entry.split(":", 2)
        if hierarchy == "0":
            base, name = cgroups, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroups / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = base / path.lstrip("/")
        while limit is None and here != base.parent:
            try:
                text = (here / name).read_text().strip()
            except OSError:
                text = "max"
            if text != "max" and int(text) < (node or 0):  # v1 writes a huge number for none
                limit = int(text)
            here = here.parent
    return {"node": node, "limit": limit}


def sandbox() -> str:
    """Whether a program runs in the code sandbox on this node (areal_hpc.reward.code: bubblewrap), as the
    code reward and the `python` tool run theirs: "ok", or what went wrong."""
    try:
        from areal_hpc.reward.code import run_program

        run = run_program("print(6 * 7)")
    except Exception as e:  # noqa: BLE001 - every way it fails is the answer
        return f"{type(e).__name__}: {e}"
    if run.status != "ok":
        return run.status
    if run.stdout.strip() != "42":
        return f"the program printed {run.stdout[:100]!r}, exit status {run.exit_code}"
    return "ok"


def cli(argv: list[str]) -> None:
    """`main` from the command line's DIR DEVICE STARTS SOURCES IFACE (module docstring)."""
    out, device, starts, sources, interface = argv
    main(
        Path(out),
        device,
        [int(s) for s in starts.split(",")],
        [tuple(int(n) for n in group.split(":")) for group in sources.split(",")],
        interface,
    )


def main(out: Path, device: str, starts: list[int], sources: list[tuple[int, int, int]], interface: str) -> None:
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    role = max(i for i, s in enumerate(starts) if s <= rank)  # the index of areal_hpc.layout.Role
    gpu_rank = role >= 2  # a generator or a trainer
    report = {"rank": rank, "role": role, "host": os.environ.get("SLURMD_NODENAME", socket.gethostname())}
    try:
        report["token"] = (out / "token").read_text()
    except OSError as e:
        report["token_error"] = str(e)
    try:
        report["memory"] = task_memory()
    except (OSError, ValueError) as e:
        report["memory_error"] = f"{type(e).__name__}: {e}"

    def write() -> None:
        tmp = out / f".rank{rank}.json"
        tmp.write_text(json.dumps(report))
        tmp.replace(out / f"rank{rank}.json")

    try:
        from areal_hpc.network import check_interface

        check_interface(interface)
    except Exception as e:  # noqa: BLE001 - the interface is missing, or the package does not import
        report["interface_error"] = f"{type(e).__name__}: {e}"
    write()
    if os.environ.get("SLURM_LOCALID", "0") == "0":
        child = subprocess.run([sys.executable, __file__, "--versions"], capture_output=True, text=True, timeout=300)
        report["versions"] = json.loads(child.stdout) if child.returncode == 0 else {"error": child.stderr[-2000:]}
        report["sandbox"] = sandbox()
        write()
    try:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        arrive(world)  # asleep while the first rank of each node reads the versions
        report["mpi"] = {"size": world.Get_size(), "sum": world.allreduce(1)}
        write()
        comm = world.Split(color=int(gpu_rank), key=rank)
    except Exception:  # noqa: BLE001
        report["mpi_error"] = traceback.format_exc(limit=2)[-2000:]
        write()
        return
    if gpu_rank:
        try:
            report["gpus"], report["allreduce"] = gpus_and_allreduce(comm, device, interface)
        except Exception:  # noqa: BLE001
            report["allreduce_error"] = traceback.format_exc(limit=3)[-2000:]
        write()
    try:
        checked = weight_sync_check(world, starts, sources, device, interface)
        if checked is not None:
            report["weight_sync"] = checked
    except Exception as e:  # noqa: BLE001 - a WeightSyncError names both ends
        report["weight_sync_error"] = f"{type(e).__name__}: {e}"
    write()
    arrive(world)


def gpus_and_allreduce(comm, device: str, interface: str) -> tuple[dict, dict]:
    """The GPUs this rank sees, and an all-reduce over the GPU ranks with the run's backend:
    the same device decision (areal_hpc.device) and the same rendezvous over MPI as the trainers'."""
    gpus = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def on_device() -> str:
        import torch

        from areal_hpc.device import resolve_device

        dev = resolve_device(device, gpus=True)
        if dev == "cuda":
            gpus["torch"] = torch.cuda.device_count()
            torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", "0")) % gpus["torch"])
        return dev

    dev = agree(comm, on_device)
    import datetime

    import torch
    import torch.distributed as dist

    from areal_hpc.device import backend
    from areal_hpc.network import world_store

    store = world_store(comm, interface, 60.0)
    kind = backend(dev)
    dist.init_process_group(
        kind,
        store=store,
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        timeout=datetime.timedelta(seconds=60),
    )
    x = torch.ones(1024, device=dev if dev == "cpu" else "cuda")
    dist.all_reduce(x)
    ok = bool((x == comm.Get_size()).all())
    dist.destroy_process_group()
    return gpus, {"backend": kind, "ranks": comm.Get_size(), "ok": ok}


def arrive(comm) -> None:
    """areal_hpc.protocol.arrive, here without the package or numpy (a node may lack both: this probe says so):
    every rank of `comm` meets the others asleep, not spinning in a blocking collective meanwhile."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def agree(comm, step):
    """`step()` on every rank of `comm`, then together (collective): when it raised on some rank, every
    rank raises, that rank its own error and the others one naming it, so that none goes on alone into
    a collective the failed rank never reaches."""
    try:
        result, failed = step(), None
    except Exception as e:  # noqa: BLE001 - the others must hear of it
        result, failed = None, e
    me = int(os.environ.get("SLURM_PROCID", "0"))
    arrive(comm)
    first = [r for r in comm.allgather(None if failed is None else me) if r is not None]
    if failed is not None:
        raise failed
    if first:
        raise RuntimeError(f"not run: world rank(s) {', '.join(map(str, first))} failed first (see their reports)")
    return result


def weight_sync_check(
    world, starts: list[int], sources: list[tuple[int, int, int]], device: str, interface: str
) -> dict | None:
    """The run's start-up weight-sync broadcasts, made as a run makes them (`open_groups`, then each
    end's `join`: the rendezvous, then the source's start-up check, checked by every receiver): from
    each group's source (SOURCES: (stage, expert rank, world rank)) to every generator rank, one group
    rank each, on its current GPU, the groups in (stage, expert rank) order; a
    source joins its own group, a receiver every group. Collective over the world; None on the ranks
    that are not members."""
    rank, generators = world.Get_rank(), range(starts[2], starts[3])
    senders = {source for _, _, source in sources}

    def on_device() -> str:
        from areal_hpc.device import resolve_device
        from areal_hpc.weight_sync.broadcast import open_groups  # noqa: F401 - imports on every rank, or none goes on

        if rank not in senders and rank not in generators:
            return "cpu"  # not a member: opens no group
        try:
            return resolve_device(device, gpus=True)
        except RuntimeError:
            return "cpu"  # every member then refuses the group, naming this rank as on cpu

    dev = agree(world, on_device)
    from areal_hpc.weight_sync.broadcast import WeightReceiver, WeightSender, open_groups

    specs, master = open_groups(
        world,
        "areal-probe",
        sources,
        generators,
        dev,
        lambda r: (1 + r - starts[2],),
        lambda r: f"world rank {r} ({'trainer' if r >= starts[3] else 'generator'})",
        interface,
        JOIN_S,
    )
    if not specs:
        return None
    if rank in senders:
        end = WeightSender(specs[0].stage, True, specs[0], _master_store=master)
    else:
        end = WeightReceiver(specs, (1 + rank - starts[2],))
    try:
        lines = [end.join(JOIN_S)] if rank in senders else end.join(0, JOIN_S)
    finally:
        end.leave()
    joined = [[spec.label, f"{spec.host}:{spec.port}"] for spec in specs]
    return {"backend": specs[0].backend, "joined": joined, "ok": True, "lines": lines}


if __name__ == "__main__":
    # Run by its path, Python put this file's folder first on the path; the ranks of a run start as
    # `python -m areal_hpc.main`, which puts the working directory there instead: so does the probe, so
    # that it imports areal_hpc as they do (an install, or a checkout the job runs in).
    sys.path[0] = os.getcwd()
    if sys.argv[1:] == ["--versions"]:
        print(json.dumps(versions()))
    else:
        cli(sys.argv[1:])
