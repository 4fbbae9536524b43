"""Weight sync: the trainer's pipeline stages broadcast Hugging Face named tensors to every generator.

```
 stage 0 source ──group "areal-ws-0"──┬──> generator 0 (engine worker tp 0 .. gen_tp-1)
 stage 1 source ──group "areal-ws-1"──┤──> generator 1 ...
   ...  (each source gathers, packs  └──> ...
         and sends on its own)
```

One process group per pipeline stage s: group rank 0 is `layout.stage_source_rank(s)`; the engine
workers of generator g take the group ranks `layout.weight_sync_ranks(g)`, one per tensor-parallel rank. A generator's receive runs where its
model lives: inside the vLLM worker (the engine's worker extension calls `WeightReceiver.receive`),
which on CPU with gen_tp 1 is the generator rank itself; with gen_tp > 1 each worker process joins
the group with its own rank. For that reason the groups connect lazily, on the first send/receive:
`setup_weight_sync` (a collective over the MPI world, before any engine exists) only has each
source open the group's TCPStore on a free port and share (host, port) over MPI.

The agreed order. Every receiver is a member of every stage's group, so on its device it drives one
communicator per stage. NCCL documents concurrent communicators on one device as a deadlock risk
unless every rank issues their collectives in the same order (two receivers that each wait in a
different group's kernel can each hold up the other group). So a receiver issues all its collectives
from one thread, in an order every receiver derives from the data alone: round robin over the stages
that have not yet sent their end marker, a bucket (or the end marker) each, stages in index order:

    (0, bucket 0), (1, bucket 0), (0, bucket 1), (1, bucket 1), (1, bucket 2), (1, end) ...

A source belongs to one group only and issues its own bucket stream in order, which is that order's
subsequence, so no cycle of waits can form. What overlaps, safely: the sources gather and pack their
stages at the same time (each on its own device), and a receiver loads one bucket into its engine
(the caller's thread) while its receiving thread takes the next ones.

Backend: gloo on cpu, NCCL on cuda (`device.backend` of the rank's `RankContext.device`); the
tensors' device is the only other difference. The members of a group must agree:
`setup_weight_sync` refuses, on every member, a group whose members resolved different devices.
A group is `ProcessGroup{Gloo,NCCL}(PrefixStore(name, TCPStore(host, port, size, is_master)), rank,
size, timeout)`, built directly beside the rank's own default group (no global torch.distributed state).

Wire format, per bucket (three broadcasts from group rank 0):
  1. int64 [2]: (header bytes, payload bytes); (0, 0) ends the stream;
  2. uint8 [header bytes]: JSON list of [name, dtype, shape, offset];
  3. uint8 [payload bytes]: the tensors' bytes, each at a 16-byte aligned offset.
Every broadcast and every rendezvous waits at most `timeout_s` (cfg.train.collective_timeout_s) and
raises `WeightSyncError` naming the group when it does not complete: nothing hangs.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from areal_hpc.runtime import RankContext

_ALIGN = 16  # bytes; lets every dtype be viewed in place from the payload buffer


class WeightSyncError(RuntimeError):
    """A weight-sync collective failed or timed out; the run cannot continue with stale weights."""


@dataclass(frozen=True)
class GroupSpec:
    """Where one stage's weight-sync group meets: enough for any member process to join it."""

    name: str
    stage: int
    host: str
    port: int
    size: int
    """Members: 1 source + generators x gen_tp workers."""
    backend: str
    """gloo (cpu) or nccl (cuda)."""
    timeout_s: float


def _own_device(backend: str) -> torch.device:
    """Where a member's tensors of a group live: on nccl the calling thread's current GPU (the
    trainer's, or the one vLLM gave the engine worker), else the CPU. Read in the member's own thread
    and handed to the receiving thread: the current GPU is per thread, and a new thread's is GPU 0."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _Group:
    """One connected member of a weight-sync group."""

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device, master_store=None):
        self.spec, self.rank, self.device = spec, rank, device
        self.timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            store = master_store
            if store is None:
                store = dist.TCPStore(
                    spec.host, spec.port, spec.size, False, timeout=self.timeout, wait_for_workers=False
                )
            prefixed = dist.PrefixStore(spec.name, store)
            if spec.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.size, self.timeout)
        except Exception as e:
            raise WeightSyncError(
                f"weight-sync group {spec.name} (stage {spec.stage}) at {spec.host}:{spec.port}: rank {rank} of "
                f"{spec.size} could not join within {spec.timeout_s:g} s: {e}"
            ) from e
        self._store = store  # keep the store (and, on the source, its server) alive with the group

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([tensor], opts).wait(self.timeout)
        except Exception as e:
            raise WeightSyncError(
                f"weight-sync group {self.spec.name} (stage {self.spec.stage}), rank {self.rank}: broadcast of the "
                f"{what} did not complete within {self.spec.timeout_s:g} s: {e}"
            ) from e


# --- sender (trainer stage source) -------------------------------------------------------------


@dataclass
class WeightSender:
    """A trainer rank's end. Only a stage's source rank (`is_source`) sends; the others take part in
    the trainer's own TP gather and hold this handle only to say which stage they belong to."""

    stage: int
    is_source: bool
    spec: GroupSpec | None = None
    _master_store: object = field(default=None, repr=False)
    _group: _Group | None = field(default=None, repr=False)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict:
        """Broadcast full (TP-gathered) tensors under their Hugging Face names, in buckets of about
        `bucket_bytes` (a tensor larger than that travels alone). Returns {bytes, buckets, tensors, seconds}."""
        if not self.is_source:
            raise RuntimeError(f"this trainer rank is not the weight-sync source of stage {self.stage}")
        t0 = time.perf_counter()
        if self._group is None:
            self._group = _Group(self.spec, 0, _own_device(self.spec.backend), self._master_store)
        stats = {"bytes": 0, "buckets": 0, "tensors": 0}
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                self._send_bucket(bucket, stats)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += _aligned(nbytes)
        if bucket:
            self._send_bucket(bucket, stats)
        self._group.broadcast(torch.zeros(2, dtype=torch.int64, device=self._group.device), "end marker")
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], stats: dict) -> None:
        group = self._group
        header, offset = [], 0
        for name, t in bucket:
            header.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
            offset += _aligned(t.numel() * t.element_size())
        payload = torch.empty(offset, dtype=torch.uint8, device=group.device)
        for (_, t), (_, _, _, off) in zip(bucket, header):
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            payload[off : off + flat.numel()].copy_(flat)
        head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(group.device)
        sizes = torch.tensor([head.numel(), payload.numel()], dtype=torch.int64, device=group.device)
        group.broadcast(sizes, "bucket sizes")
        group.broadcast(head, "bucket header")
        group.broadcast(payload, "bucket payload")
        stats["bytes"] += payload.numel()
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)


# --- receiver (generator engine workers) -------------------------------------------------------


@dataclass
class WeightReceiver:
    """A generator's end: picklable, so a vLLM worker process can join with its own TP rank."""

    specs: list[GroupSpec]
    group_ranks: tuple[int, ...]
    """This generator's rank in every group, by its engine workers' tensor-parallel rank
    (`Layout.weight_sync_ranks`)."""
    _groups: dict = field(default_factory=dict, repr=False)

    def __getstate__(self):
        return {**self.__dict__, "_groups": {}}  # connections stay in the process that made them

    def receive(self, tp_rank: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket (a list of (hf_name, tensor)) of every stage, in the agreed order (module
        docstring), until all stages have sent their end marker. One thread receives, in that order;
        the caller consumes a bucket while the next ones arrive (at most 2 waiting)."""
        device = _own_device(self.specs[0].backend)  # the caller's: a thread does not inherit it
        out: queue.Queue = queue.Queue(maxsize=2)
        done = object()

        def pump() -> None:
            try:
                for bucket in self._in_agreed_order(tp_rank, device):
                    out.put(bucket)
                out.put(done)
            except BaseException as e:  # handed to the consumer, which raises it
                out.put(e)

        thread = threading.Thread(target=pump, name="areal-weight-receive", daemon=True)
        thread.start()
        # Each collective times out on its own; this bound only guards against a thread that died silently.
        patience = max(s.timeout_s for s in self.specs) * 3 + 10
        while True:
            try:
                item = out.get(timeout=patience)
            except queue.Empty:
                raise WeightSyncError(f"weight sync: no bucket from any stage within {patience:g} s") from None
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
        thread.join()

    def _in_agreed_order(self, tp_rank: int, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Round robin over the stages still sending, a bucket each, stages in index order. Every
        group is joined first, in stage order: each source waits at most `timeout_s` for its members."""
        specs = sorted(self.specs, key=lambda s: s.stage)
        groups = {spec.stage: self._join(spec, tp_rank, device) for spec in specs}
        streams = {stage: self._stream(group) for stage, group in groups.items()}
        while streams:
            for stage, stream in list(streams.items()):
                bucket = next(stream, None)
                if bucket is None:  # its end marker
                    del streams[stage]
                else:
                    yield bucket

    def _join(self, spec: GroupSpec, tp_rank: int, device: torch.device) -> _Group:
        key = (spec.name, tp_rank)
        if key not in self._groups:
            self._groups[key] = _Group(spec, self.group_ranks[tp_rank], device)
        return self._groups[key]

    def _stream(self, group: _Group) -> Iterator[list[tuple[str, torch.Tensor]]]:
        while True:
            sizes = torch.empty(2, dtype=torch.int64, device=group.device)
            group.broadcast(sizes, "bucket sizes")
            head_n, payload_n = (int(x) for x in sizes.tolist())
            if head_n == 0:
                return
            head = torch.empty(head_n, dtype=torch.uint8, device=group.device)
            group.broadcast(head, "bucket header")
            payload = torch.empty(payload_n, dtype=torch.uint8, device=group.device)
            group.broadcast(payload, "bucket payload")
            bucket = []
            for name, dtype, shape, off in json.loads(bytes(head.cpu().numpy()).decode()):
                dt = getattr(torch, dtype)
                n = _numel(shape) * torch.empty((), dtype=dt).element_size()
                bucket.append((name, payload[off : off + n].view(dt).view(shape)))
            yield bucket


# --- setup (collective over the MPI world) -----------------------------------------------------


def setup_weight_sync(ctx: RankContext) -> WeightSender | WeightReceiver | None:
    """Every world rank calls this once, before `serve`. Returns a `WeightSender` on trainer ranks, a
    `WeightReceiver` on generator ranks, None on the controller and reward workers.

    For each stage s, the members ([stage_source_rank(s)] + generators) split off the world, check
    that they all resolved the same device, and the source opens the group's TCPStore on a free port
    and broadcasts (host, port) to them.
    """
    from mpi4py import MPI

    from areal_hpc.device import backend as backend_of
    from areal_hpc.layout import Role

    layout, world, rank = ctx.layout, ctx.world, ctx.world.Get_rank()
    role = layout.role_of(rank)
    backend = backend_of(ctx.device)
    timeout_s = float(ctx.cfg.train.collective_timeout_s)
    size = layout.weight_sync_size
    specs, my_stage, master = [], None, None
    for stage in range(layout.train_pp):
        source = layout.stage_source_rank(stage)
        member = rank == source or role == Role.GENERATOR
        comm = world.Split(MPI.UNDEFINED if not member else 0, 0 if rank == source else 1 + rank)
        if comm == MPI.COMM_NULL:
            continue
        members = comm.allgather((rank, socket.gethostname(), ctx.device))
        _check_devices(f"areal-ws-{stage}", members, layout)
        hosts = [host for _, host, _ in members]
        info = None
        if rank == source:
            host = "127.0.0.1" if len(set(hosts)) == 1 else _routable_host()
            master = dist.TCPStore(
                host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
            )
            info = (host, master.port)
            my_stage = stage
        host, port = comm.bcast(info, root=0)
        comm.Free()
        specs.append(GroupSpec(f"areal-ws-{stage}", stage, host, port, size, backend, timeout_s))
    if role == Role.GENERATOR:
        return WeightReceiver(specs, layout.weight_sync_ranks(rank))
    if role == Role.TRAINER:
        if my_stage is not None:
            return WeightSender(my_stage, True, specs[0], master)
        return WeightSender(layout.trainer_coords(rank).pp, False)
    return None


def _check_devices(group: str, members: list[tuple[int, str, str]], layout) -> None:
    """Every member of a group on the same device (one backend), or the same error on every member."""
    on: dict[str, list[int]] = {}  # device -> the members (world ranks) on it
    for rank, _, device in members:
        on.setdefault(device, []).append(rank)
    if len(on) > 1:
        sides = " but ".join(
            f"{layout.describe_rank(ranks[0])}{f' and {len(ranks) - 1} more' if len(ranks) > 1 else ''} on {dev}"
            for dev, ranks in on.items()
        )
        raise WeightSyncError(
            f"weight-sync group {group}: {sides}; its members must share one backend (nccl on cuda, gloo on cpu). "
            "With cluster.device auto a rank is on the CPU when torch sees no GPU there: check the GPUs of "
            "those nodes (each rank's log starts with them), or set cluster.device to cuda (a rank without a "
            "GPU then fails at start) or cpu"
        )


def _routable_host() -> str:
    """This node's address as other nodes reach it (AREAL_WEIGHT_SYNC_HOST overrides)."""
    if os.environ.get("AREAL_WEIGHT_SYNC_HOST"):
        return os.environ["AREAL_WEIGHT_SYNC_HOST"]
    return socket.gethostbyname(socket.getfqdn())


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["GroupSpec", "WeightReceiver", "WeightSender", "WeightSyncError", "setup_weight_sync"]
