"""One member's end of a weight-sync group (areal_hpc.weight_sync.broadcast): its join, its broadcasts, its leave.

```
 SyncGroup(spec, rank, device, join_timeout_s)       (all within join_timeout_s)
   member reaches the group's TCPStore at spec.host:spec.port; sets joined/<rank> = its own address
   source (rank 0) waits for every joined/<r>        (the error names who never came)
   ProcessGroup{Gloo,NCCL}(PrefixStore(name, store), rank, size, options), bound to the device
   start-up check: int64 [stage, source world rank, STARTUP_CHECK] from the source, checked by all
 broadcast(tensor, what)                             within spec.timeout_s (train.collective_timeout_s)
 leave()                                             this member's end only; nothing collective
```

Every failure is a `WeightSyncError` naming the group, this member and the source (their world ranks
by `layout.describe_rank` and their hosts), the address tried and what to do (`ADVICE`).

Built directly, beside the rank's own default group (no global torch.distributed state). Bound to
the member's device: the communicator is made in the join, on that device
(`eager_connect_single_device`, what `init_process_group(device_id=)` does; gloo has nothing to
connect early), and every thread that issues the group's collectives first makes that device its
current one (`use_device`): a new thread starts on GPU 0, where a stray CUDA call would create a
context. gloo's end listens on the member's own address (areal_hpc.network), never where the host
name points. NCCL's own sockets follow NCCL_SOCKET_IFNAME (set from cluster.network_interface) or
NCCL's choice; the start-up check covers that choice too.

NCCL's watchdog (torch's thread that ends the process when a collective outlives the group's limit)
gets `watchdog_timeout_s`, longer than the wait in `broadcast`: the wait raises first, torch aborts
that communicator, and the rank reports the named error to the controller well before the watchdog,
which sees the aborted collective only after its own pause, ends the process. (Read from torch's
source, ProcessGroupNCCL's wait and watchdog; not yet observed on a GPU.)
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_hpc import network

STARTUP_CHECK = 0x4152_4541  # "AREA": the third number of the start-up broadcast
ADVICE = (
    "the address is cluster.network_interface's, else that of the interface routing toward the group's "
    "members (areal_hpc.network): set cluster.network_interface to an interface every node has (e.g. ib0), "
    "let the nodes reach each other's ports, and run `areal-hpc doctor`"
)


class WeightSyncError(RuntimeError):
    """A weight-sync collective failed or timed out; the run cannot continue with stale weights."""


@dataclass(frozen=True)
class GroupSpec:
    """Where one weight-sync group meets (a stage's, or with expert parallelism one of a stage's):
    enough for any member process to join it."""

    name: str
    stage: int
    host: str
    """The source's address (areal_hpc.network), where the group's TCPStore listens."""
    port: int
    size: int
    """Members: 1 source + generators x gen_tp workers."""
    backend: str
    """gloo (cpu) or nccl (cuda)."""
    timeout_s: float
    """Every collective's limit (train.collective_timeout_s)."""
    interface: str = ""
    """cluster.network_interface: each member's own address comes from it when set."""
    source_rank: int = -1
    """The source's world rank (sent in the start-up broadcast)."""
    members: tuple[str, ...] = ()
    """Who each group rank is, for errors: 'generator 1 (world rank 3) on host n2'."""
    expert: int | None = None
    """The expert rank whose experts the group carries when the trainer is expert-parallel (its stage
    has one group per expert rank); None for a stage's only group."""

    @property
    def key(self) -> tuple[int, int]:
        """(stage, expert rank): the order in which members join the groups and receivers take their streams."""
        return self.stage, self.expert or 0

    @property
    def label(self) -> str:
        return group_label(self.stage, self.expert)

    def who(self, rank: int) -> str:
        return self.members[rank] if rank < len(self.members) else f"group rank {rank}"


def group_label(stage: int, expert: int | None) -> str:
    """'stage 1' or 'stage 1, expert rank 0': how messages name what a group carries."""
    return f"stage {stage}" + (f", expert rank {expert}" if expert is not None else "")


def watchdog_timeout_s(timeout_s: float) -> float:
    """NCCL's own limit for a collective of a group: longer than the wait in `SyncGroup.broadcast`."""
    return 2 * timeout_s + 60


def own_device(backend: str) -> torch.device:
    """Where a member's tensors of a group live: on nccl the calling thread's current GPU (the
    trainer's, or the one vLLM gave the engine worker), else the CPU. Read in the member's own thread
    and handed to the others: the current GPU is per thread, and a new thread's is GPU 0."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current one (module docstring: no CUDA context on GPU 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def current_stream(device: torch.device):
    """The calling thread's current CUDA stream on `device` (in a vLLM worker, the dedicated stream vLLM
    made current, on which it loads weights and runs the model); None on the CPU, which has no streams."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def use_stream(stream) -> None:
    """Make `stream` (from `current_stream`, possibly another thread's) this thread's current stream."""
    if stream is not None:
        torch.cuda.set_stream(stream)


class SyncGroup:
    """One member's end of a weight-sync group: joined and checked when made, then `broadcast`, `leave`."""

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device, join_timeout_s: float, master_store=None):
        self.spec, self.rank, self.device = spec, rank, device
        t0 = time.monotonic()
        join = datetime.timedelta(seconds=join_timeout_s)
        at = f"{spec.host}:{spec.port}"
        address = spec.host if rank == 0 else network.own_address(spec.interface, spec.host)
        try:
            store = master_store or dist.TCPStore(
                spec.host, spec.port, spec.size, False, timeout=join, wait_for_workers=False
            )
        except Exception as e:
            raise self._error(f"could not reach the group's store at {at} within {_s(join_timeout_s)} s", e) from e
        store.set_timeout(join)
        prefixed = dist.PrefixStore(spec.name, store)
        prefixed.set(f"joined/{rank}", address)
        if rank == 0:
            self._wait_for_members(prefixed, join_timeout_s, at)
        try:  # within what is left of the join's limit
            left = datetime.timedelta(seconds=until(t0 + join_timeout_s))
            self.pg = _process_group(spec, prefixed, rank, device, address, left)
            self.pg.eager_connect_single_device(device)  # gloo: nothing to do
        except Exception as e:
            if rank != 0 and not prefixed.check(["joined/0"]):  # the source never came (still starting?)
                what = f"waited {_s(join_timeout_s)} s at {at} for the source, which never joined (train.startup_timeout_s)"
            else:
                what = f"reached the store at {at}, but the group did not connect (own end {address})"
            raise self._error(what, e) from e
        store.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
        self._store = store  # keep the store (and, on the source, its server) alive with the group
        self._startup_check(min(spec.timeout_s, until(t0 + join_timeout_s)))
        peer = f"its {spec.size - 1} receiver(s)" if rank == 0 else spec.who(0)
        self.joined = (
            f"weight-sync group {spec.name} ({spec.label}): {spec.who(rank)} joined {peer} at {at} "
            f"({spec.backend}, own end {address}); start-up check passed in {time.monotonic() - t0:.1f} s"
        )

    def broadcast(self, tensor: torch.Tensor, what: str, timeout_s: float | None = None) -> None:
        """From group rank 0 to every member, within `timeout_s` (default: the spec's)."""
        timeout_s = self.spec.timeout_s if timeout_s is None else timeout_s
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise self._error(f"broadcast of the {what} did not complete within {_s(timeout_s)} s", e) from e

    def leave(self) -> None:
        """Release this end: NCCL's communicator is finalized and destroyed (as `destroy_process_group`
        does), gloo's pairs go with the object."""
        self.pg.shutdown()
        self.pg = self._store = None

    def _startup_check(self, timeout_s: float) -> None:
        spec = self.spec
        expected = [spec.stage, spec.source_rank, STARTUP_CHECK]
        got = torch.tensor(expected if self.rank == 0 else [0, 0, 0], dtype=torch.int64, device=self.device)
        self.broadcast(got, "start-up check", timeout_s)
        if got.tolist() != expected:
            raise self._error(f"the start-up broadcast brought {got.tolist()}, not {expected}", None)

    def _wait_for_members(self, store, join_timeout_s: float, at: str) -> None:
        """The source: every member reached the store within the join's limit, or the error names who did not."""
        keys = [f"joined/{r}" for r in range(1, self.spec.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=join_timeout_s))
        except Exception as e:
            missing = [r for r, key in enumerate(keys, 1) if not store.check([key])]
            names = ", ".join(self.spec.who(r) for r in missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            )
            raise self._error(
                f"waited {_s(join_timeout_s)} s at {at} for {names}, which never reached it "
                f"({len(keys) - len(missing)} of {len(keys)} did)",
                e,
            ) from e

    def _error(self, what: str, cause: Exception | None) -> WeightSyncError:
        spec, me = self.spec, self.spec.who(self.rank)
        ends = me if self.rank == 0 else f"{me} (with the source {spec.who(0)})"
        if cause is not None:
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            what = f"{what}: {type(cause).__name__}: {first}"
        return WeightSyncError(f"weight-sync group {spec.name} ({spec.label}): {ends} {what}; {ADVICE}")


def _process_group(spec: GroupSpec, store, rank: int, device: torch.device, address: str, join):
    """The backend's process group of one member. NCCL: its watchdog limit (`watchdog_timeout_s`); its
    communicator is made by `eager_connect_single_device`, the members meeting through the store.
    gloo: its end listens on `address`; connecting waits up to `join` for every member."""
    if spec.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=watchdog_timeout_s(spec.timeout_s))
        return dist.ProcessGroupNCCL(store, rank, spec.size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = join
    opts._threads = 2
    pg = dist.ProcessGroupGloo(store, rank, spec.size, opts)
    pg.set_timeout(datetime.timedelta(seconds=spec.timeout_s))  # each collective's own limit in gloo
    return pg


def _s(seconds: float) -> str:
    return f"{round(seconds, 1):g}"


def until(deadline: float, at_least: float = 1.0) -> float:
    """Seconds to `deadline` (time.monotonic), at least `at_least`."""
    return max(at_least, deadline - time.monotonic())


__all__ = [
    "ADVICE",
    "GroupSpec",
    "STARTUP_CHECK",
    "SyncGroup",
    "WeightSyncError",
    "group_label",
    "own_device",
    "until",
    "current_stream",
    "use_device",
    "use_stream",
    "watchdog_timeout_s",
]
