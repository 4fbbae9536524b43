"""A real MPI world for tests/test_weight_sync.py: controller, reward, 2 generators and the trainers at
PP 2: with $AREAL_TEST_EP 1 (default) 2 trainers, one source per stage; with 2, 4 trainers (DP 2, EP 2)
and two sources per stage, one per expert rank. The groups are joined as at start (each source joins
its own, each generator all of them in (stage, expert rank) order), each join ending with the source's
start-up check (`JOINED` lines: 3 per group). The sources send the state dict saved at
$AREAL_TEST_STATE (a stage's share split between its expert ranks) in buckets of unequal size; each
generator checks it bit-exact, and rank 0 prints, as JSON after `ORDERS`, the order in which each
receiver issued its collectives ((stage, expert rank, bucket or "end")) and each group's bucket count,
which the test holds to the agreed order. Then the sources stay silent and each receiver must time out
(`timed out after`). Last line of rank 0: `RESULT 1` when all held.

    mpirun -n 6 python tests/support/mpi/weight_sync_world.py
    AREAL_TEST_EP=2 mpirun -n 8 python tests/support/mpi/weight_sync_world.py
"""

import json
import os
import sys
import time

import torch
from mpi4py import MPI

from areal_hpc.config import load_config
from areal_hpc.layout import Layout, Role
from areal_hpc.rank_context import RankContext
from areal_hpc.weight_sync.broadcast import WeightReceiver, WeightSender, setup_weight_sync
from areal_hpc.weight_sync.group import SyncGroup, WeightSyncError


def abort(*exc):  # a failing rank ends the run at once instead of leaving the others waiting
    sys.__excepthook__(*exc)
    MPI.COMM_WORLD.Abort(1)


sys.excepthook = abort

# Record the order in which this rank issues its collectives: the group (stage, expert rank) of each
# bucket's first broadcast (its sizes; the end marker's too), from whichever thread issues it.
issued = []
broadcast = SyncGroup.broadcast


def traced(group, tensor, what, *rest):
    if what == "bucket sizes":
        issued.append(group.spec.key)
    return broadcast(group, tensor, what, *rest)


SyncGroup.broadcast = traced

ep = int(os.environ.get("AREAL_TEST_EP", "1"))
cfg = load_config(
    None,
    [
        f"cluster.nodes={1 + ep}",
        "cluster.gpus_per_node=2",
        "allocation.gen_gpus=2",
        "allocation.train_pp=2",
        f"allocation.train_ep={ep}",
        "train.collective_timeout_s=3",
        "model.hidden_size=64",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        *(["model.architecture=qwen3_moe"] if ep > 1 else []),
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
# stage 0 sends the embedding and layer 0, stage 1 the rest (as a pipeline would); expert rank e of a
# stage every ep-th of its tensors.
stage_names = [[n for n in names if "embed" in n or ".layers.0." in n], None]
stage_names[1] = [n for n in names if n not in stage_names[0]]
out = {"ok": 1}
buckets = None
if role == Role.TRAINER:
    assert isinstance(sync, WeightSender) and sync.is_source == (rank in [r for _, _, r in layout.sync_sources()])
    if sync.is_source:
        stage, e = sync.spec.key
        assert sync.spec.name == (f"areal-ws-{stage}-{e}" if ep > 1 else f"areal-ws-{stage}"), sync.spec.name
        # smaller buckets for stage 1: the groups send different numbers of buckets
        bucket_bytes = 16_000 if stage == 0 else 6_000
        stats = sync.send(((n, state[n]) for n in stage_names[stage][e::ep]), bucket_bytes=bucket_bytes)
        assert stats["buckets"] >= 2, stats
        buckets = (stage, e, stats["buckets"])
elif role == Role.GENERATOR:
    assert isinstance(sync, WeightReceiver) and len(sync.specs) == 2 * ep
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
# (stage, expert rank, bucket) in the order each receiver issued them ("end": the group's end marker)
seen, order = {}, []
for key in issued:
    seen[key] = seen.get(key, -1) + 1
    order.append((*key, seen[key]))
order = [(s, e, "end" if k == seen[s, e] else k) for s, e, k in order]
orders = world.gather(order if role == Role.GENERATOR else None)
counts = world.gather(buckets)
if rank == 0:
    orders = [o for o in orders if o is not None]
    print("ORDERS", json.dumps({"orders": orders, "buckets": [c for c in counts if c]}), flush=True)
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
