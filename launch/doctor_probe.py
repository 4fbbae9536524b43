"""What `areal-hpc doctor` runs on every rank of its probe job: `python doctor_probe.py DIR DEVICE STARTS`.

```
 every rank   DIR/token readable? (the login node wrote it)   -> DIR/rank<r>.json   (before anything can hang)
 first rank   python doctor_probe.py --versions (a child):    -> its node's torch, vllm, megatron.core, mpi4py
   of a node
 every rank   MPI: allreduce over the world                    -> DIR/rank<r>.json again, with the result
 GPU ranks    GPUs they see; all-reduce of their component's ranks over torch.distributed with the
   (comps 1+) run's backend (nccl on cuda, gloo on cpu)        -> DIR/rank<r>.json again
```

Only the standard library at import: on a node where the environment is broken this still runs and says
so. The versions come from a child process so that vLLM is imported before MPI is initialised in no
process (a generator rank never sees that order either). STARTS: the first world rank of each component.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

PACKAGES = ("torch", "vllm", "megatron.core", "mpi4py")
"""What the ranks import; each must import on the nodes, at the login node's version."""
REPO = str(Path(__file__).resolve().parent.parent)


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


def main(out: Path, device: str, starts: list[int]) -> None:
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    component = max(i for i, s in enumerate(starts) if s <= rank)
    report = {"rank": rank, "component": component, "host": os.environ.get("SLURMD_NODENAME", socket.gethostname())}
    try:
        report["token"] = (out / "token").read_text()
    except OSError as e:
        report["token_error"] = str(e)

    def write() -> None:
        tmp = out / f".rank{rank}.json"
        tmp.write_text(json.dumps(report))
        tmp.replace(out / f"rank{rank}.json")

    write()
    if os.environ.get("SLURM_LOCALID", "0") == "0":
        child = subprocess.run([sys.executable, __file__, "--versions"], capture_output=True, text=True, timeout=300)
        report["versions"] = json.loads(child.stdout) if child.returncode == 0 else {"error": child.stderr[-2000:]}
        write()
    try:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        report["mpi"] = {"size": world.Get_size(), "sum": world.allreduce(1)}
        write()
        comm = world.Split(color=component, key=rank)
    except Exception:  # noqa: BLE001
        report["mpi_error"] = traceback.format_exc(limit=2)[-2000:]
        write()
        return
    if component > 0:  # the GPU components: generators, trainers
        try:
            report["gpus"], report["allreduce"] = gpus_and_allreduce(comm, device)
        except Exception:  # noqa: BLE001
            report["allreduce_error"] = traceback.format_exc(limit=3)[-2000:]
        write()
    world.Barrier()


def gpus_and_allreduce(comm, device: str) -> tuple[dict, dict]:
    """The GPUs this rank sees, and an all-reduce over this component's ranks with the run's backend:
    the same device decision (areal_hpc.device) and the same rendezvous over MPI as the trainers'."""
    sys.path.insert(0, REPO)
    import datetime

    import torch
    import torch.distributed as dist

    from areal_hpc.device import backend, resolve_device

    gpus = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    dev = resolve_device(device, gpus=True)
    if dev == "cuda":
        gpus["torch"] = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", "0")) % gpus["torch"])
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    addr = comm.bcast(f"tcp://{socket.gethostname()}:{port}" if comm.Get_rank() == 0 else None)
    kind = backend(dev)
    dist.init_process_group(
        kind, init_method=addr, rank=comm.Get_rank(), world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=60)
    )
    x = torch.ones(1024, device=dev if dev == "cpu" else "cuda")
    dist.all_reduce(x)
    ok = bool((x == comm.Get_size()).all())
    dist.destroy_process_group()
    return gpus, {"backend": kind, "ranks": comm.Get_size(), "ok": ok}


if __name__ == "__main__":
    if sys.argv[1:] == ["--versions"]:
        print(json.dumps(versions()))
    else:
        main(Path(sys.argv[1]), sys.argv[2], [int(s) for s in sys.argv[3].split(",")])
