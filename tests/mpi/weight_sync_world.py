"""A real MPI world for tests/test_weight_sync.py: controller, reward, 2 generators, 2 trainers (PP 2, one
source per stage). The groups are joined as at start (each source joins its own, each generator both,
stage 0 first), each join ending with the source's start-up check (`JOINED` lines: six in all).
The stages send the state dict saved at $AREAL_TEST_STATE in buckets of unequal size;
each generator checks it bit-exact, and rank 0 prints the order in which each receiver issued its
collectives (`ORDERS`) beside the agreed one (`AGREED`). Then the sources stay silent and each receiver
must time out (`timed out after`). Last line of rank 0: `RESULT 1` when all held.

    mpirun -n 6 python tests/mpi/weight_sync_world.py
"""

import os
import sys
import time

import torch
from mpi4py import MPI

from areal_hpc.config import load_config
from areal_hpc.layout import Layout, Role
from areal_hpc.runtime import RankContext
from areal_hpc.sync_group import SyncGroup, WeightSyncError
from areal_hpc.weight_sync import WeightReceiver, WeightSender, setup_weight_sync


def abort(*exc):  # a failing rank ends the run at once instead of leaving the others waiting
    sys.__excepthook__(*exc)
    MPI.COMM_WORLD.Abort(1)


sys.excepthook = abort

# Record the order in which this rank issues its collectives: the stage of each bucket's first
# broadcast (its sizes; the end marker's too), from whichever thread issues it.
issued = []
broadcast = SyncGroup.broadcast


def traced(group, tensor, what, *rest):
    if what == "bucket sizes":
        issued.append(group.spec.stage)
    return broadcast(group, tensor, what, *rest)


SyncGroup.broadcast = traced

cfg = load_config(
    None,
    [
        "cluster.nodes=2",
        "cluster.gpus_per_node=2",
        "allocation.gen_nodes=1",
        "allocation.train_pp=2",
        "train.collective_timeout_s=3",
        "model.hidden_size=64",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
    ],
)
layout = Layout.from_config(cfg)
world = MPI.COMM_WORLD
ctx = RankContext(cfg, layout, world, layout.split(world), run_dir=".", model_path=".")
sync = setup_weight_sync(ctx)
rank, role = world.Get_rank(), layout.role_of(world.Get_rank())
if sync is not None:
    for line in [sync.join()] if role == Role.TRAINER else sync.join():
        print(f"JOINED {line}", flush=True)  # one write: mpirun may interleave the ranks
state = torch.load(os.environ["AREAL_TEST_STATE"])  # a Hugging Face Qwen2 state dict, saved by the test
names = sorted(state)
# stage 0 sends the embedding and layer 0, stage 1 the rest (as a pipeline would).
stage_names = [[n for n in names if "embed" in n or ".layers.0." in n], None]
stage_names[1] = [n for n in names if n not in stage_names[0]]
out = {"ok": 1}
buckets = None
if role == Role.TRAINER:
    assert isinstance(sync, WeightSender) and sync.is_source, sync
    # smaller buckets for stage 1: the stages send different numbers of buckets
    bucket_bytes = 16_000 if sync.stage == 0 else 6_000
    stats = sync.send(((n, state[n]) for n in stage_names[sync.stage]), bucket_bytes=bucket_bytes)
    assert stats["buckets"] >= 2, stats
    buckets = (sync.stage, stats["buckets"])
elif role == Role.GENERATOR:
    assert isinstance(sync, WeightReceiver) and len(sync.specs) == 2
    got = {}
    for bucket in sync.receive():
        for n, t in bucket:
            assert n not in got, n
            got[n] = t.clone()
    assert sorted(got) == names, (len(got), len(names))
    for n in names:
        assert got[n].dtype == state[n].dtype and torch.equal(got[n], state[n]), n
else:
    assert sync is None
# (stage, bucket) in the order each receiver issued them ("end": the stage's end marker)
seen, order = {}, []
for stage in issued:
    seen[stage] = seen.get(stage, -1) + 1
    order.append((stage, seen[stage]))
order = [(s, "end" if k == seen[s] else k) for s, k in order]
orders = world.gather(order if role == Role.GENERATOR else None)
counts = world.gather(buckets)
if rank == 0:
    counts = dict(x for x in counts if x)
    orders = [o for o in orders if o is not None]
    print("ORDERS", orders, "BUCKETS", counts, flush=True)
    # round robin over the stages still sending, stages in index order
    agreed = [
        (s, k if k < counts[s] else "end")
        for k in range(max(counts.values()) + 1)
        for s in sorted(counts)
        if k <= counts[s]
    ]
    print("AGREED", agreed, flush=True)
    if len(orders) != 2 or any(o != agreed for o in orders):
        out["ok"] = 0
world.Barrier()
issued.clear()
# Round 2: the sources never send; every receiver must fail with a timeout, not hang.
if role == Role.GENERATOR:
    t0 = time.monotonic()
    try:
        list(sync.receive())
        out["ok"] = 0
    except WeightSyncError as e:
        assert "within 3 s" in str(e), e
        print(f"rank {rank}: timed out after {time.monotonic() - t0:.1f} s: {str(e)[:120]}", flush=True)
elif role == Role.TRAINER:
    time.sleep(4.5)  # stay alive, silent, while the receivers time out
ok = world.allreduce(out["ok"], op=MPI.MIN)
if rank == 0:
    print("RESULT", ok, flush=True)
