"""Weight sync: the trainer's pipeline stages broadcast Hugging Face named tensors to every generator.

```
 stage 0 source ──group "areal-ws-0"──┬──> generator 0 (engine worker tp 0 .. gen_tp-1)
 stage 1 source ──group "areal-ws-1"──┤──> generator 1 ...
   ...  (each source gathers, packs  └──> ...
         and sends on its own)
```

One process group per pipeline stage s: group rank 0 is the stage's source, its (tp 0, dp 0) trainer;
the engine workers of generator g take the group ranks `layout.weight_sync_ranks(g)`, one per
tensor-parallel rank. A generator's receive runs where its model lives: inside the vLLM worker (the
engine's worker extension calls `WeightReceiver.join` and `receive`), which on CPU with gen_tp 1 is the
generator rank itself; with gen_tp > 1 each worker process joins the group with its own rank.

With an expert-parallel trainer (allocation.train_ep = EP > 1) every trainer holds 1/EP of each MoE
layer's experts, so a stage has EP sources, one group each, "areal-ws-{s}-{e}":

```
 (s, 0) source: tp 0, dp 0 of stage s ──"areal-ws-s-0"──┐  dense tensors (TP-gathered) + its experts
 (s, e) source: first rank of s with expert rank e ──"areal-ws-s-e"──┤  its experts only, no gather
                                                                   └──> every generator's workers
```

The sources are `layout.sync_sources()` (stage, expert rank, world rank); every generator worker is a
member of every group, with the same group ranks. Each source streams what the trainer's export yields
on it (`Engine.export`: the dense tensors on the (s, 0) source, a rank's own experts under their
global names on each expert source); with EP 1 the stage's source gets everything, as above.

Order at start, so that a wrong address or a blocked port fails before the first prompt:
  1. `setup_weight_sync` (a collective over the MPI world, before any engine exists): each group's
     members check that they resolved the same device; the source opens the group's TCPStore on a
     port the OS picks, at its address (areal_hpc.network: cluster.network_interface's, else the interface
     that routes to the group's members; 127.0.0.1 when they all share its host) and shares it over MPI
     (`network.offer`: when it cannot, every member of the group raises its error, not only the source).
  2. A trainer source joins right after its engine is built (`WeightSender.join`); a generator
     right after its engine exists, inside vLLM's workers (`WeightReceiver.join`, every group in
     (stage, expert rank) order). A join is the rendezvous (each member reaches the store and says
     so; the source waits for all of them, then the process group connects) and one small
     broadcast from the source, int64 [stage, source world rank, STARTUP_CHECK], which every
     receiver checks. All of it within `train.startup_timeout_s` of step 1 (engine start takes
     minutes); the error names both ends (`layout.describe_rank`), their hosts and the address tried.
  3. Each sync: the buckets (wire format below), every collective within `train.collective_timeout_s`.
  4. On Stop, every member leaves its end (`leave`).
A rank's errors reach the controller as `Failure` from its serve loop, start-up included; the controller allows a
rank's first answer `train.startup_timeout_s` + `train.collective_timeout_s`, so the named error comes first.

The agreed order. Every receiver is a member of every group, so on its device it drives one
communicator per group. NCCL documents concurrent communicators on one device as a deadlock risk
unless every rank issues their collectives in the same order (two receivers that each wait in a
different group's kernel can each hold up the other group). So a receiver issues all its collectives
from one thread, in an order every receiver derives from the data alone: round robin over the stages
that have not yet sent their last end marker, a bucket (or an end marker) each, stages in index
order, where a stage's stream is its groups' streams one after the other, expert ranks in order:

    EP 1:  (0, bucket 0), (1, bucket 0), (0, bucket 1), (1, bucket 1), (1, bucket 2), (1, end) ...
    EP 2:  (0,0) b0, (1,0) b0, (0,0) b1, (1,0) end + (1,1) b0, (0,0) end + (0,1) b0, (1,1) end, ...

(an end marker that leaves a stage with groups to go is taken in the same turn as the next group's
first bucket). Each trainer rank issues, per sync, (1) every TP gather of its stage's dense tensors,
in the export's order, then (2) if it is a source, its bucket stream; the (s, 0) source's sends
interleave with its gathers. No cycle of waits can form: a source's stream is a subsequence of the
receivers' order; an (s, e > 0) source, which may be a TP peer in the (s, 0) source's gathers, sends
only after its gathers, and the receivers reach its group only after (s, 0)'s end marker, when every
gather of the stage is done. Why not round robin over all the groups: a receiver waiting on the
(s, 1) source's first bucket, while that source waits in a gather for the (s, 0) source, which
waits for the receivers to take its next bucket, would close such a cycle. What overlaps, safely:
the stages gather and pack at the same time (each on its own devices), a stage's expert sources
pack theirs while (s, 0) sends, and a receiver loads one bucket into its engine (the caller's thread)
while its receiving thread takes the next ones. The joins at start follow the same order (every
group in (stage, expert rank) order; a source joins its own only).

Backend and devices: gloo on cpu, NCCL on cuda (`device.backend` of the rank's `RankContext.device`);
the tensors' device is the only other difference. The members of a group must agree:
`setup_weight_sync` refuses, on every member, a group whose members resolved different devices. How a
member's end is built, bound to its device and kept within NCCL's watchdog: areal_hpc.weight_sync.group.

Wire format, per bucket (three broadcasts from group rank 0):
  1. int64 [2]: (header bytes, payload bytes); (0, 0) ends the stream;
  2. uint8 [header bytes]: JSON list of [name, dtype, shape, offset];
  3. uint8 [payload bytes]: the tensors' bytes, each at a 16-byte aligned offset.
Nothing hangs: every wait has its limit and raises `WeightSyncError` naming the group and both ends.
"""

from __future__ import annotations

import datetime
import itertools
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from areal_hpc import network
from areal_hpc.protocol import arrive
from areal_hpc.weight_sync.group import (
    GroupSpec,
    SyncGroup,
    WeightSyncError,
    current_stream,
    group_label,
    own_device,
    until,
    use_device,
    use_stream,
)

if TYPE_CHECKING:
    from areal_hpc.rank_context import RankContext

_ALIGN = 16  # bytes; lets every dtype be viewed in place from the payload buffer
MIN_JOIN_S = 10.0
"""A join gets at least this long, even when the engine's start used up `train.startup_timeout_s`."""


# --- sender (trainer stage source) -------------------------------------------------------------


@dataclass
class WeightSender:
    """A trainer rank's end. Only a group's source rank (`is_source`, one group each) sends; the others
    take part in the trainer's own TP gather and hold this handle only to say which stage they belong to."""

    stage: int
    is_source: bool
    spec: GroupSpec | None = None
    join_by: float = 0.0
    """When the join at start must be done (time.monotonic; `setup_weight_sync`: + train.startup_timeout_s)."""
    _master_store: object = field(default=None, repr=False)
    _group: SyncGroup | None = field(default=None, repr=False)

    def join(self, timeout_s: float | None = None) -> str | None:
        """Join its group (waiting up to `timeout_s`, default: until `join_by`, for every member)
        and send the start-up check; returns the log line. A rank that is no source has nothing to join."""
        if not self.is_source:
            return None
        if self._group is None:
            timeout_s = until(self.join_by, MIN_JOIN_S) if timeout_s is None else timeout_s
            self._group = SyncGroup(self.spec, 0, own_device(self.spec.backend), timeout_s, self._master_store)
        return self._group.joined

    def leave(self) -> None:
        if self._group is not None:
            self._group.leave()
        self._group = self._master_store = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict:
        """Broadcast full (TP-gathered) tensors under their Hugging Face names, in buckets of about
        `bucket_bytes` (a tensor larger than that travels alone). Returns {bytes, buckets, tensors, seconds}."""
        if not self.is_source:
            raise RuntimeError(f"this trainer rank is no weight-sync source (stage {self.stage})")
        if self._group is None:
            raise WeightSyncError(f"the source of {self.spec.label} sends before joining its group (join)")
        t0 = time.perf_counter()
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
    join_by: float = 0.0
    """When the joins at start must be done (time.monotonic, in the generator rank's process)."""
    _groups: dict = field(default_factory=dict, repr=False)
    """(stage, expert rank) (`GroupSpec.key`) -> this process's connected `SyncGroup`."""

    def __getstate__(self):
        return {**self.__dict__, "_groups": {}}  # connections stay in the process that made them

    def startup_left_s(self) -> float:
        """Seconds left for the joins (handed to vLLM's workers, whose clocks are their own)."""
        return until(self.join_by, MIN_JOIN_S)

    def join(self, tp_rank: int = 0, timeout_s: float | None = None) -> list[str]:
        """Join every group as the worker of tensor-parallel rank `tp_rank`, in (stage, expert rank)
        order, each ending with the source's start-up check, all within `timeout_s` (default: until
        `join_by`); returns a log line per group. Called once per process, at start."""
        if not self._groups:
            deadline = time.monotonic() + (self.startup_left_s() if timeout_s is None else timeout_s)
            device = own_device(self.specs[0].backend)
            for spec in sorted(self.specs, key=lambda s: s.key):
                self._groups[spec.key] = SyncGroup(spec, self.group_ranks[tp_rank], device, until(deadline))
        return [g.joined for _, g in sorted(self._groups.items())]

    def leave(self) -> None:
        for group in self._groups.values():
            group.leave()
        self._groups.clear()

    @property
    def device(self) -> torch.device:
        """Where this process's ends of the groups live (joined: `join`)."""
        return next(iter(self._groups.values())).device

    def receive(self, loading=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket (a list of (hf_name, tensor)) of every group, in the agreed order (module
        docstring), until all groups have sent their end marker. One thread receives, in that order;
        the caller consumes a bucket while the next one waits and the one after it arrives: at most three
        payloads at once (areal_hpc.generator.memory.RECEIVE_BUFFERS counts them on the GPU).

        On a GPU the receiving thread works on `loading`, the stream the caller copies the weights into the
        model on (default: the one current in the caller's thread when the iteration begins; a vLLM worker
        passes vLLM's own). A bucket's payload is then allocated, received (the collective's stream waits
        for that stream's earlier work, and NCCL's wait orders that stream after the collective) and copied
        into the model on one stream: no copy starts before its bytes arrived, and a payload's memory,
        freed once the caller drops the bucket, is reused by a later allocation only after the copies
        queued before it (not so on the thread's own default stream). The GPU takes the transfers and
        copies in turn: what overlaps is the host's work, unpacking and the loaders' Python."""
        if not self._groups:
            raise WeightSyncError("weight sync: this generator receives before joining its groups (join)")
        out: queue.Queue = queue.Queue(maxsize=1)
        done = object()
        device = self.device
        loading = loading if loading is not None else current_stream(device)

        def pump() -> None:
            try:
                use_device(device)
                use_stream(loading)
                for bucket in self._in_agreed_order():
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
                raise WeightSyncError(f"weight sync: no bucket from any group within {patience:g} s") from None
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
        thread.join()

    def _in_agreed_order(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Round robin over the stages still sending, a bucket each, stages in index order; a stage's
        stream is its groups' streams one after the other, expert ranks in order (each group's stream
        starts once the one before it has ended)."""
        groups: dict[int, list[SyncGroup]] = {}
        for (stage, _), group in sorted(self._groups.items()):
            groups.setdefault(stage, []).append(group)
        streams = {
            stage: itertools.chain.from_iterable(self._stream(g) for g in stage_groups)
            for stage, stage_groups in groups.items()
        }
        while streams:
            for stage, stream in list(streams.items()):
                bucket = next(stream, None)
                if bucket is None:  # its end marker
                    del streams[stage]
                else:
                    yield bucket
                    del bucket  # this frame pauses in the next `next`: hold nothing there

    def _stream(self, group: SyncGroup) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One group's buckets until its end marker. Its paused frame holds no bucket (`yield from` a call
        iterator): with a stream per stage paused in the round robin, a frame holding its last bucket would
        keep one payload alive per stage (areal_hpc.generator.memory counts three in all)."""
        yield from iter(lambda: self._bucket(group), None)

    @staticmethod
    def _bucket(group: SyncGroup) -> list[tuple[str, torch.Tensor]] | None:
        """The group's next bucket, None at its end marker."""
        sizes = torch.empty(2, dtype=torch.int64, device=group.device)
        group.broadcast(sizes, "bucket sizes")
        head_n, payload_n = (int(x) for x in sizes.tolist())
        if head_n == 0:
            return None
        head = torch.empty(head_n, dtype=torch.uint8, device=group.device)
        group.broadcast(head, "bucket header")
        payload = torch.empty(payload_n, dtype=torch.uint8, device=group.device)
        group.broadcast(payload, "bucket payload")
        bucket = []
        for name, dtype, shape, off in json.loads(bytes(head.cpu().numpy()).decode()):
            dt = getattr(torch, dtype)
            n = _numel(shape) * torch.empty((), dtype=dt).element_size()
            bucket.append((name, payload[off : off + n].view(dt).view(shape)))
        return bucket


# --- setup (collective over the MPI world) -----------------------------------------------------


def setup_weight_sync(ctx: RankContext) -> WeightSender | WeightReceiver | None:
    """Every world rank calls this once, before `serve`. Returns a `WeightSender` on trainer ranks, a
    `WeightReceiver` on generator ranks, None on the controller and reward workers; the joins come
    later, once the engines exist (module docstring), by `join_by` = now + train.startup_timeout_s.

    The groups: `open_groups` of the sources (`layout.sync_sources`) and the generators.
    """
    from areal_hpc.layout import Role

    layout, world, rank, cfg = ctx.layout, ctx.world, ctx.world.Get_rank(), ctx.cfg
    role = layout.role_of(rank)
    join_by = time.monotonic() + float(cfg.train.startup_timeout_s)
    specs, master = open_groups(
        world,
        "areal-ws",
        layout.sync_sources(),
        layout.ranks(Role.GENERATOR),
        ctx.device,
        layout.weight_sync_ranks,
        layout.describe_rank,
        cfg.cluster.network_interface,
        float(cfg.train.collective_timeout_s),
    )
    if role == Role.GENERATOR:
        return WeightReceiver(specs, layout.weight_sync_ranks(rank), join_by)
    if role == Role.TRAINER:
        if specs:  # a source: its own group only
            return WeightSender(specs[0].stage, True, specs[0], join_by, master)
        return WeightSender(layout.trainer_coords(rank).pp, False)
    return None


def open_groups(
    world,
    prefix: str,
    sources: Sequence[tuple[int, int, int]],
    receivers: Container[int],
    device: str,
    ranks_of: Callable[[int], tuple[int, ...]],
    describe: Callable[[int], str],
    interface: str,
    timeout_s: float,
) -> tuple[list[GroupSpec], object | None]:
    """Collective over `world`: for each group in the order of `sources` ((stage, expert rank, source
    world rank), `Layout.sync_sources`), its members (the source first, then every rank of `receivers`)
    split off and `open_group` "{prefix}-{stage}", or "{prefix}-{stage}-{expert rank}" when the stages
    have several groups. Returns this rank's specs (a receiver's: every group's; a source's: its own;
    none on the others) and, on a source, its group's store. A group that fails to open fails on all
    its members (`open_group`), who still open the later groups, so no rank waits in their
    collectives; then the first error is raised."""
    from mpi4py import MPI

    rank = world.Get_rank()
    arrive(world)
    several = len({e for _, e, _ in sources}) > 1  # expert-parallel: a group per (stage, expert rank)
    specs, master, failed = [], None, None
    for stage, e, source in sources:
        member = rank == source or rank in receivers
        comm = world.Split(0 if member else MPI.UNDEFINED, 0 if rank == source else 1 + rank)
        if comm == MPI.COMM_NULL:
            continue
        expert = e if several else None
        name = f"{prefix}-{stage}" + (f"-{e}" if several else "")
        try:
            spec, store = open_group(comm, name, stage, expert, rank, device, ranks_of, describe, interface, timeout_s)
        except Exception as e:  # noqa: BLE001 - raised once every group is open
            failed = failed or e
            continue
        finally:
            comm.Free()
        if rank == source:
            master = store
        specs.append(spec)
    if failed is not None:
        raise failed
    return specs, master


def open_group(
    comm,
    name: str,
    stage: int,
    expert: int | None,
    me: int,
    device: str,
    ranks_of: Callable[[int], tuple[int, ...]],
    describe: Callable[[int], str],
    interface: str,
    timeout_s: float,
) -> tuple[GroupSpec, object | None]:
    """Collective over `comm`, the members of group `name` (carrying stage `stage`, and with expert
    parallelism expert rank `expert`) with the source first (world rank `me` each, on `device`):
    every member's host and device are shared and checked, the source opens the group's TCPStore at
    its address and offers it (areal_hpc.network). Returns the spec, and on the source the
    store (it must live as long as the group); or raises on every member, the same check failing or the
    source's error offered to all. `ranks_of(world rank)`: a receiver's group ranks, one per engine
    worker; `describe(world rank)`: how errors name it."""
    from areal_hpc.device import backend

    members = comm.allgather((me, socket.gethostname(), device))
    _check_devices(name, members, describe)
    source, source_host, _ = members[0]
    who = {0: f"{describe(source)} on host {source_host}"}
    for rank, h, _ in members[1:]:
        ranks = ranks_of(rank)
        for tp, group_rank in enumerate(ranks):
            who[group_rank] = f"{describe(rank)}{f' worker tp {tp}' if len(ranks) > 1 else ''} on host {h}"
    master = None

    def open_store() -> tuple[str, int]:
        nonlocal master
        host = network.address(interface, [h for _, h, _ in members])
        # Its waits are the join's from then on (`SyncGroup`).
        master = dist.TCPStore(
            host, 0, len(who), True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return host, master.port

    what = f"weight-sync group {name} ({group_label(stage, expert)}): its source {who[0]}"
    host, port = network.offer(comm, open_store, what)
    members_text = tuple(who[r] for r in range(len(who)))
    spec = GroupSpec(
        name, stage, host, port, len(who), backend(device), timeout_s, interface, source, members_text, expert
    )
    return spec, master


def _check_devices(group: str, members: list[tuple[int, str, str]], describe: Callable[[int], str]) -> None:
    """Every member of a group on the same device (one backend), or the same error on every member."""
    on: dict[str, list[int]] = {}  # device -> the members (world ranks) on it
    for rank, _, device in members:
        on.setdefault(device, []).append(rank)
    if len(on) > 1:
        sides = " but ".join(
            f"{describe(ranks[0])}{f' and {len(ranks) - 1} more' if len(ranks) > 1 else ''} on {dev}"
            for dev, ranks in on.items()
        )
        raise WeightSyncError(
            f"weight-sync group {group}: {sides}; its members must share one backend (nccl on cuda, gloo on cpu). "
            "With cluster.device auto a rank is on the CPU when torch sees no GPU there: check the GPUs of "
            "those nodes (each rank's log starts with them), or set cluster.device to cuda (a rank without a "
            "GPU then fails at start) or cpu"
        )


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = [
    "WeightReceiver",
    "WeightSender",
    "open_group",
    "open_groups",
    "setup_weight_sync",
]
