"""Weight sync: bucketed broadcast of named tensors from trainer sources to generators.

Ladder: the sources of a layout (one per stage, or per stage and expert rank), one process with gloo
(sender and receivers as threads, each joining through the real join: the rendezvous and the start-up
check; with PP 2 x EP 2, four sources, two of them gathering with a TP peer source, every receiver
issuing its collectives in the agreed order), the joins that cannot complete (a port nobody listens
on, a member that never comes, a start-up broadcast from another group) failing within their limit
with both ends named, then real MPI ranks through `setup_weight_sync` (two pipeline stages, or two
stages x two expert ranks, joined at start and sending in parallel to two generators in the agreed
order), the timeout, and groups whose members disagree on the device.
"""

import dataclasses
import datetime
import socket
import threading
import time
from collections import deque

import pytest
import torch
import torch.distributed as dist

from areal_hpc.config import load_config
from areal_hpc.layout import Layout, Role
from areal_hpc.weight_sync.broadcast import WeightReceiver, WeightSender, _check_devices
from areal_hpc.weight_sync.group import STARTUP_CHECK, GroupSpec, SyncGroup, WeightSyncError
from tests.support.helpers import MPI_PROGRAMS

MEMBERS = (
    "trainer 0 (world rank 4) on host a",
    "generator 0 (world rank 2) on host b",
    "generator 1 (world rank 3) on host b",
)


def _local_group(size: int, timeout_s: float = 20.0, name: str = "t", source_rank: int = 4):
    master = dist.TCPStore(
        "127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    spec = GroupSpec(f"areal-ws-{name}", 0, "127.0.0.1", master.port, size, "gloo", timeout_s, "", source_rank, MEMBERS)
    return WeightSender(0, True, spec, _master_store=master), spec


def _connect_all(sender: WeightSender, receivers: list[WeightReceiver], timeout_s: float = 20.0) -> list[str]:
    """Join as at start: every receiver in its own thread, the source here."""
    lines = []
    threads = [threading.Thread(target=lambda r=r: lines.extend(r.join(0, timeout_s))) for r in receivers]
    for th in threads:
        th.start()
    lines.append(sender.join(timeout_s))
    for th in threads:
        th.join(timeout_s)
    return lines


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(128, 64, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(63, generator=g)),  # odd size: alignment
        ("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
        ("big", torch.randn(512, 256, generator=g)),  # larger than a bucket: travels alone
        ("ids", torch.arange(7, dtype=torch.int64)),
        ("scalar", torch.tensor(3.5, dtype=torch.float16)),
    ]


def test_threads_bit_exact_buckets():
    sender, spec = _local_group(3)
    receivers = [WeightReceiver([spec], (rank,)) for rank in (1, 2)]
    lines = _connect_all(sender, receivers)
    assert len(lines) == 3 and all("start-up check passed" in line for line in lines), lines
    assert any(
        "generator 1 (world rank 3) on host b joined trainer 0 (world rank 4) on host a at 127.0.0.1:" in x
        for x in lines
    )
    got = [[], []]

    def recv(i):
        for bucket in receivers[i].receive():
            got[i].append([(n, t.clone()) for n, t in bucket])

    threads = [threading.Thread(target=recv, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    stats = sender.send(_tensors(), bucket_bytes=40_000)
    for th in threads:
        th.join(timeout=30)
    expected = _tensors()
    assert stats["tensors"] == len(expected)
    assert stats["buckets"] == len(got[0]) >= 3  # the 512 KiB tensor forces its own bucket
    for buckets in got:
        flat = [item for bucket in buckets for item in bucket]
        assert [n for n, _ in flat] == [n for n, _ in expected]
        for (_, a), (_, b) in zip(flat, expected):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    # A second sync over the same (already connected) group works too.
    th = threading.Thread(target=lambda: got.append(list(receivers[0].receive())))
    th2 = threading.Thread(target=lambda: list(receivers[1].receive()))
    th.start(), th2.start()
    sender.send([("x", torch.ones(3))], bucket_bytes=1 << 20)
    th.join(30), th2.join(30)
    assert torch.equal(got[-1][0][0][1], torch.ones(3))


def test_the_receiving_thread_works_on_the_stream_of_the_thread_that_loads(monkeypatch):
    """The code path of the GPU's stream discipline, on gloo (the CPU has no streams; a GPU proves the
    loads themselves: tools/gpu_check.sh): the receiving thread allocates and receives every bucket on
    the stream current in the thread that iterates `receive` (vLLM's worker, which loads on it)."""
    from areal_hpc.weight_sync import broadcast

    current = threading.local()
    read_in, broadcasts = [], []
    loading = object()  # the loading thread's stream
    monkeypatch.setattr(broadcast, "current_stream", lambda device: read_in.append(threading.get_ident()) or loading)
    monkeypatch.setattr(broadcast, "use_stream", lambda stream: setattr(current, "stream", stream))
    plain = SyncGroup.broadcast

    def on_which_stream(self, tensor, what, timeout_s=None):
        broadcasts.append((threading.get_ident(), getattr(current, "stream", None), what))
        return plain(self, tensor, what, timeout_s)

    sender, spec = _local_group(2)
    receiver = WeightReceiver([spec], (1,))
    _connect_all(sender, [receiver])
    monkeypatch.setattr(SyncGroup, "broadcast", on_which_stream)
    loader = []

    def load():
        loader.append(threading.get_ident())
        for _ in receiver.receive():
            pass

    th = threading.Thread(target=load)
    th.start()
    sender.send(_tensors(), bucket_bytes=40_000)
    th.join(30)
    received = [(thread, stream) for thread, stream, _ in broadcasts if thread != threading.get_ident()]
    assert read_in == loader  # read once, in the loading thread
    assert len(received) >= 3 * 3 + 1  # sizes, header, payload per bucket, and the end marker
    assert {stream for _, stream in received} == {loading}
    assert loader[0] not in {thread for thread, _ in received}  # received by its own thread
    # the stream the caller names (a vLLM worker names vLLM's own) over the current one
    named, broadcasts[:] = object(), []
    th = threading.Thread(target=lambda: list(receiver.receive(named)))
    th.start()
    sender.send(_tensors(), bucket_bytes=40_000)
    th.join(30)
    assert {stream for thread, stream, _ in broadcasts if thread != threading.get_ident()} == {named}
    assert len(read_in) == 1


@pytest.mark.slow
def test_a_receiver_holds_three_payloads_at_most_whatever_the_stages():
    """Five stages' groups into one receiver whose caller loads slowly: every payload alive is counted (weak
    references) as each bucket is taken. One being loaded, one waiting, one arriving: a stage's stream paused
    in the round robin holds none (areal_hpc.generator.memory budgets three)."""
    import gc
    import weakref

    class Bucket(list):  # a list that weak references can follow
        pass

    unpack, alive = WeightReceiver._bucket, []

    def tracked(group):
        bucket = unpack(group)
        if bucket is not None:
            bucket = Bucket(bucket)
            alive.append(weakref.ref(bucket))
        return bucket

    stages, per_stage = 5, 4
    senders, specs = [], []
    for stage in range(stages):
        master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
        spec = GroupSpec(f"areal-ws-{stage}", stage, "127.0.0.1", master.port, 2, "gloo", 20.0, "", 4 + stage, MEMBERS)
        senders.append(WeightSender(stage, True, spec, _master_store=master))
        specs.append(spec)
    receiver = WeightReceiver(specs, (1,))
    receiver._bucket = tracked
    joins = [threading.Thread(target=receiver.join, args=(0, 20.0))]
    joins += [threading.Thread(target=s.join, args=(20.0,)) for s in senders]
    for th in joins:
        th.start()
    for th in joins:
        th.join(30)
    most = 0
    sends = [
        threading.Thread(target=s.send, args=([(f"s{i}.{j}", torch.ones(1000)) for j in range(per_stage)], 4000))
        for i, s in enumerate(senders)
    ]
    for th in sends:
        th.start()
    for bucket in receiver.receive():
        del bucket
        time.sleep(0.05)  # a slow load: the receiving thread fills what it may meanwhile
        gc.collect()
        most = max(most, sum(ref() is not None for ref in alive))
    for th in sends:
        th.join(30)
    assert len(alive) == stages * per_stage and most <= 3, most


def _layout(*overrides: str) -> Layout:
    return Layout.from_config(
        load_config(
            None,
            ["cluster.nodes=2", "cluster.gpus_per_node=8", "allocation.gen_nodes=1", "model.architecture=qwen3_moe"]
            + list(overrides),
        )
    )


def test_sync_sources_one_per_stage_and_expert_rank():
    dense = _layout("allocation.train_tp=2", "allocation.train_pp=2")
    assert dense.sync_sources() == [(s, 0, dense.stage_source_rank(s)) for s in range(2)]
    # 16 trainers at TP 2 x PP 2 x DP 4, EP 4: a stage's expert ranks 0..3 first sit on (tp, dp) = (0, 0),
    # (1, 0) (a TP peer of the stage source), (0, 1), (1, 1)
    moe = _layout("cluster.nodes=3", "allocation.train_tp=2", "allocation.train_pp=2", "allocation.train_ep=4")
    first = moe.ranks(Role.TRAINER).start
    sources = moe.sync_sources()
    assert [(s, e) for s, e, _ in sources] == [(s, e) for s in range(2) for e in range(4)]
    assert [r - first for _, _, r in sources] == [0, 1, 2, 3, 8, 9, 10, 11]
    grid = moe.trainer_grid
    for stage, e, rank in sources:
        local = rank - first
        assert moe.trainer_coords(rank).pp == stage and grid.expert_rank(local) == e
        # the stage's first rank holding expert rank e; expert rank 0's is the stage source
        stage_ranks = [r for r in range(grid.size) if grid.coords(r).pp == stage]
        assert local == min(r for r in stage_ranks if grid.expert_rank(r) == e)
    assert [r for s, e, r in sources if e == 0] == [moe.stage_source_rank(s) for s in range(2)]
    # TP 1, EP 2: expert rank 1's source is a data-parallel peer (dp 1), not a TP peer
    tp1 = _layout("allocation.train_pp=2", "allocation.train_ep=2")
    assert [tp1.trainer_coords(r) for _, _, r in tp1.sync_sources()] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]


def agreed_order(buckets: dict[tuple[int, int], int]) -> list[tuple[int, int, int | str]]:
    """The order the module docstring derives, written out independently: events (stage, expert rank,
    bucket or "end") of each stage's groups one after the other; round robin over the stages still
    sending, each turn taking events up to and including one bucket (or the stage's last end marker)."""
    pending = {}
    for s, e in sorted(buckets):
        pending.setdefault(s, deque()).extend([*((s, e, k) for k in range(buckets[s, e])), (s, e, "end")])
    order = []
    while pending:
        for s in sorted(pending):
            events = pending[s]
            while events:
                order.append(events.popleft())
                if order[-1][2] != "end":
                    break
            if not events:
                del pending[s]
    return order


def test_agreed_order_written_out():
    order = agreed_order({(0, 0): 2, (0, 1): 1, (1, 0): 1, (1, 1): 1})
    assert order == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, "end"), (1, 1, 0),
        (0, 0, "end"), (0, 1, 0), (1, 1, "end"), (0, 1, "end"),
    ]  # fmt: skip


def _issued(keys: list[tuple[int, int]]) -> list[tuple[int, int, int | str]]:
    """(stage, expert rank, bucket or "end") in the order a receiver issued its bucket broadcasts (`keys`:
    the group key of each "bucket sizes" broadcast, the end markers' too)."""
    keys = [tuple(key) for key in keys]
    seen: dict = {}
    for key in keys:
        seen[key] = seen.get(key, -1) + 1
    order, count = [], {}
    for key in keys:
        count[key] = count.get(key, -1) + 1
        order.append((*key, "end" if count[key] == seen[key] else count[key]))
    return order


def test_pp2_ep2_every_receiver_issues_the_agreed_order(monkeypatch):
    """Four groups (2 stages x 2 expert ranks) into two receivers, the senders as threads. Each
    stage's expert-rank-1 source is a TP peer of its (s, 0) source: both pass every dense tensor
    through a barrier (the export's TP gather) before the peer yields its experts."""
    log, lock = [], threading.Lock()
    broadcast = SyncGroup.broadcast

    def recorded(group, tensor, what, *rest):
        if what == "bucket sizes" and group.rank != 0:
            with lock:
                log.append((group.rank, group.spec.key))
        return broadcast(group, tensor, what, *rest)

    monkeypatch.setattr(SyncGroup, "broadcast", recorded)
    tensor_bytes = 4000
    counts = {(0, 0): (3, 2), (0, 1): (0, 2), (1, 0): (1, 1), (1, 1): (0, 4)}  # (dense, experts) tensors
    senders, specs = {}, []
    for (stage, e), _ in counts.items():
        master = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
        spec = GroupSpec(
            f"areal-ws-{stage}-{e}", stage, "127.0.0.1", master.port, 3, "gloo", 20.0, "", 4 + 2 * stage + e,
            MEMBERS, expert=e,
        )  # fmt: skip
        senders[stage, e] = WeightSender(stage, True, spec, _master_store=master)
        specs.append(spec)
    receivers = [WeightReceiver(specs, (rank,)) for rank in (1, 2)]
    joins = [threading.Thread(target=r.join, args=(0, 20.0)) for r in receivers]
    joins += [threading.Thread(target=s.join, args=(20.0,)) for s in senders.values()]
    for th in joins:
        th.start()
    for th in joins:
        th.join(30)
    gathers = {stage: threading.Barrier(2, timeout=20) for stage in (0, 1)}

    def planned(stage, e):
        """What the export yields on the (stage, e) source: the dense tensors (on e 0), then its experts."""
        dense, experts = counts[stage, e]
        names = [f"s{stage}.dense.{i}" for i in range(dense)] + [f"s{stage}.e{e}.{i}" for i in range(experts)]
        return [(n, torch.full((tensor_bytes // 4,), float(100 * stage + 10 * e + i))) for i, n in enumerate(names)]

    def export(stage, e):
        items, dense = planned(stage, e), counts[stage, e][0]
        for i in range(counts[stage, 0][0]):  # every rank of the stage joins every gather
            gathers[stage].wait()
            if i < dense:
                yield items[i]
        yield from items[dense:]

    got = [{}, {}]

    def receive(i):
        for bucket in receivers[i].receive():
            got[i].update((n, t.clone()) for n, t in bucket)

    stats = {}
    threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
    threads += [
        threading.Thread(target=lambda k=k: stats.update({k: senders[k].send(export(*k), tensor_bytes)}))
        for k in senders
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    buckets = {k: sum(counts[k]) for k in counts}  # one tensor per bucket
    assert {k: v["buckets"] for k, v in stats.items()} == buckets
    expected = dict(item for k in counts for item in planned(*k))
    for i in range(2):
        assert sorted(got[i]) == sorted(expected) and all(torch.equal(got[i][n], expected[n]) for n in expected)
        assert _issued([key for rank, key in log if rank == i + 1]) == agreed_order(buckets)
    for end in [*receivers, *senders.values()]:
        end.leave()


def test_receiver_times_out_when_sender_is_silent():
    sender, spec = _local_group(2, timeout_s=1.5, name="silent")
    receiver = WeightReceiver([spec], (1,))
    _connect_all(sender, [receiver])
    # The source joined the group but never sends: the receiver's first broadcast must time out.
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="within 1.5 s") as e:
        list(receiver.receive())
    assert time.monotonic() - t0 < 20
    assert "generator 0 (world rank 2) on host b (with the source trainer 0 (world rank 4) on host a)" in str(e.value)


def test_a_port_nobody_listens_on_fails_the_join_naming_both_ends():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    spec = GroupSpec("areal-ws-0", 0, "127.0.0.1", port, 3, "gloo", 5.0, "", 4, MEMBERS)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as e:
        WeightReceiver([spec], (2,)).join(0, timeout_s=1.0)
    assert time.monotonic() - t0 < 20  # the store client retries once after its limit
    text = str(e.value)
    assert text.startswith(
        "weight-sync group areal-ws-0 (stage 0): generator 1 (world rank 3) on host b (with the source "
        f"trainer 0 (world rank 4) on host a) could not reach the group's store at 127.0.0.1:{port} within 1 s"
    ), text
    assert "set cluster.network_interface" in text


def test_the_source_names_the_members_that_never_came():
    sender, spec = _local_group(3, timeout_s=5.0, name="absent")
    receiver = WeightReceiver([spec], (1,))  # generator 0 comes, generator 1 never does
    th = threading.Thread(target=lambda: pytest.raises(WeightSyncError, receiver.join, 0, 2.0))
    th.start()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as e:
        sender.join(timeout_s=1.5)
    assert time.monotonic() - t0 < 10
    assert (
        f"trainer 0 (world rank 4) on host a waited 1.5 s at 127.0.0.1:{spec.port} for generator 1 (world rank 3) "
        "on host b, which never reached it (1 of 2 did)"
    ) in str(e.value)
    th.join(20)


def test_a_source_that_never_joins_is_named_by_its_receivers():
    _, spec = _local_group(2, timeout_s=5.0, name="late")  # the store is up, its source never joins
    with pytest.raises(WeightSyncError) as e:
        WeightReceiver([spec], (1,)).join(0, timeout_s=1.0)
    assert (
        "generator 0 (world rank 2) on host b (with the source trainer 0 (world rank 4) on host a) waited 1 s at "
        f"127.0.0.1:{spec.port} for the source, which never joined (train.startup_timeout_s)"
    ) in str(e.value)


def test_a_start_up_broadcast_from_another_source_is_refused():
    sender, spec = _local_group(2, name="other", source_rank=4)
    receiver = WeightReceiver([dataclasses.replace(spec, source_rank=9)], (1,))
    th = threading.Thread(target=sender.join, args=(20.0,))  # its own end sees nothing wrong
    th.start()
    with pytest.raises(WeightSyncError, match=rf"start-up broadcast brought \[0, 4, {STARTUP_CHECK}\], not \[0, 9, "):
        receiver.join(0, 20.0)
    th.join(20)


def test_sending_or_receiving_before_joining_is_an_error_and_close_releases():
    sender, spec = _local_group(2, name="order")
    receiver = WeightReceiver([spec], (1,))
    with pytest.raises(WeightSyncError, match="before joining"):
        sender.send([("x", torch.ones(1))], 1 << 20)
    with pytest.raises(WeightSyncError, match="before joining"):
        list(receiver.receive())
    _connect_all(sender, [receiver])
    sender.leave()
    receiver.leave()
    assert sender._group is None and not receiver._groups


def test_members_on_different_devices_are_refused_by_name():
    layout = Layout.from_config(
        load_config(None, ["cluster.nodes=2", "cluster.gpus_per_node=2", "allocation.gen_nodes=1"])
    )
    _check_devices("areal-ws-0", [(4, "a", "cuda"), (2, "b", "cuda"), (3, "b", "cuda")], layout.describe_rank)
    # every member gets the same list from the allgather, so every member raises the same error
    with pytest.raises(WeightSyncError) as e:
        _check_devices("areal-ws-0", [(4, "a", "cuda"), (2, "b", "cpu"), (3, "b", "cpu")], layout.describe_rank)
    assert "trainer 0 (world rank 4) on cuda but generator 0 (world rank 2) and 1 more on cpu" in str(e.value)
    assert "cluster.device" in str(e.value)


@pytest.mark.mpi
@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_mpi_stages_bit_exact_in_the_agreed_order_then_timeout(run_mpi, tmp_path, ep):
    import json

    from transformers import Qwen2ForCausalLM

    from areal_hpc.data.tiny import hf_config
    from tests.support.shapes import GENERATOR

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(hf_config(GENERATOR))  # the world's model.* shape (positions change no weight)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    # world: controller, reward, 2 generators, 2 x ep trainers (PP 2 x DP ep: a source per stage and expert rank)
    proc = run_mpi(
        MPI_PROGRAMS / "weight_sync_world.py",
        n=4 + 2 * ep,
        timeout=180,
        env={"AREAL_TEST_STATE": str(tmp_path / "state.pt"), "AREAL_TEST_EP": str(ep)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RESULT 1" in proc.stdout, proc.stdout[-3000:]
    # both receivers issued (stage, expert rank, bucket) in the agreed order, groups of unequal length
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ORDERS "))
    report = json.loads(line.removeprefix("ORDERS "))
    buckets = {(s, e): n for s, e, n in report["buckets"]}
    assert sorted(buckets) == [(s, e) for s in range(2) for e in range(ep)] and len(set(buckets.values())) > 1
    assert [[tuple(x) for x in order] for order in report["orders"]] == [agreed_order(buckets)] * 2, line
    assert proc.stdout.count("timed out after") == 2, proc.stdout[-3000:]
    # joined at start: each generator every group, each source its own, all checked
    # (counted in the whole output: mpirun forwards the ranks' stdout and stderr in chunks, so another
    # rank's text may share a line with a JOINED one)
    groups = 2 * ep
    assert proc.stdout.count("JOINED weight-sync group") == 3 * groups, proc.stdout[-3000:]
    assert proc.stdout.count("start-up check passed") == 3 * groups, proc.stdout[-3000:]
    last = "areal-ws-1 (stage 1)" if ep == 1 else "areal-ws-1-1 (stage 1, expert rank 1)"
    assert proc.stdout.count(f"JOINED weight-sync group {last}: generator 1 (world rank 3) on host") == 1


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sync_from_two_expert_sources_reaches_vllms_fused_experts(tmp_path, monkeypatch):
    """A tiny MoE generator receives new weights over two groups, as from a stage's two expert ranks
    ((0, 0): the dense tensors and experts 0-1, (0, 1): experts 2-3, per-expert Hugging Face names):
    its greedy tokens then equal those of a fresh engine on the new weights, and after a sync back,
    its own first ones (vLLM's CPU experts repack their weights on load: generator/weight_loader.py). No
    module goes through vLLM's layerwise reload."""
    import re

    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from areal_hpc.data.tiny import build_tiny_model, build_tokenizer
    from areal_hpc.device import resolve_device
    from areal_hpc.generator.engine import GenerationEngine
    from tests.support.generator_runs import drain, perturb
    from tests.support.shapes import GENERATOR_MOE

    path_a = build_tiny_model(GENERATOR_MOE, tmp_path, seed=1)
    path_b = tmp_path / "b"
    perturb(Qwen3MoeForCausalLM.from_pretrained(path_a, dtype=torch.float32), seed=5).save_pretrained(path_b)
    build_tokenizer().save_pretrained(path_b)
    weights = {name: load_file(str(p / "model.safetensors")) for name, p in (("a", path_a), ("b", path_b))}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights["b"]  # per-expert names, as export sends

    def create(path):
        return GenerationEngine.create(
            path, device=resolve_device(), temperature=0.0, max_model_len=256, max_num_seqs=8, seed=0
        )

    def greedy(engine) -> list[list[int]]:
        for i, prompt in enumerate(([5, 6, 7, 8], [9, 3, 30, 41, 2])):
            engine.submit(f"p{i}", prompt, 16)
        return [t.sampled.token_ids for t in sorted(drain(engine), key=lambda t: t.key)]

    fresh = create(path_b)
    expected_b = greedy(fresh)
    fresh.close()

    def expert_rank(name: str) -> int:  # experts 0-1 on expert rank 0 (with the dense tensors), 2-3 on 1
        found = re.search(r"\.mlp\.experts\.(\d+)\.", name)
        return int(found.group(1)) // 2 if found else 0

    specs, senders = [], []
    for e in range(2):
        master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        spec = GroupSpec(f"areal-ws-0-{e}", 0, "127.0.0.1", master.port, 2, "gloo", 60.0, "", 4 + e, expert=e)
        specs.append(spec)
        senders.append(WeightSender(0, True, spec, _master_store=master))
    receiver = WeightReceiver(specs, (1,))
    engine = create(path_a)
    from vllm.model_executor.model_loader.reload import layerwise  # once vLLM's environment is chosen

    layerwise_calls = []
    monkeypatch.setattr(layerwise, "_layerwise_process", lambda *a: layerwise_calls.append(a))
    try:
        expected_a = greedy(engine)
        assert expected_a != expected_b  # the test can tell the weights apart
        joins = [threading.Thread(target=s.join, args=(60,)) for s in senders]
        for th in joins:
            th.start()
        joined = engine.join_weight_sync(receiver, 60)
        for th in joins:
            th.join(60)
        assert [line.split(":")[0] for line in joined] == [
            "weight-sync group areal-ws-0-0 (stage 0, expert rank 0)",
            "weight-sync group areal-ws-0-1 (stage 0, expert rank 1)",
        ]
        for version, state, expected in ((1, weights["b"], expected_b), (2, weights["a"], expected_a)):
            parts = [[(n, t) for n, t in sorted(state.items()) if expert_rank(n) == e] for e in range(2)]
            sends = [threading.Thread(target=s.send, args=(part, 16_000)) for s, part in zip(senders, parts)]
            for th in sends:
                th.start()
            engine.update_weights(receiver, version)
            for th in sends:
                th.join(60)
            assert greedy(engine) == expected, f"version {version}"
        assert not layerwise_calls
    finally:
        engine.close()
        for s in senders:
            s.leave()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.megatron
@pytest.mark.vllm
def test_mpi_ep2_trainers_sync_a_vllm_moe_generator(run_mpi, tmp_path):
    """TP 2 x DP 2 x EP 2 trainers (Megatron, gloo) -> a vLLM tiny MoE generator through
    `trainer.worker.send_weights`: expert rank 1's source is the stage source's TP peer, so it gathers
    the dense tensors with it before sending its experts. After the sync the generator's greedy tokens
    are a fresh engine's on the trainers' model, and it took the buckets in the agreed order."""
    import json

    proc = run_mpi(MPI_PROGRAMS / "expert_sync_world.py", n=7, timeout=900, args=[str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(line.removeprefix("RESULT "))
    sources = {(s, e): (buckets, tensors) for s, e, buckets, tensors in result["sources"]}
    assert sorted(sources) == [(0, 0), (0, 1)]
    assert sources[0, 1][1] == 2 * 2 * 3  # 2 layers x experts 2-3 x gate, up, down
    assert sources[0, 0][1] > 2 * 2 * 3  # the dense tensors and experts 0-1
    assert result["after"] == result["expected"] != result["before"]
    assert _issued(result["issued"]) == agreed_order({k: buckets for k, (buckets, _) in sources.items()})
    assert proc.stdout.count("weight-sync group areal-ws-0-1 (stage 0, expert rank 1)") == 2  # both ends
