"""Weight sync: bucketed broadcast of named tensors from trainer stage sources to generators.

Ladder: one process with gloo (sender and receivers as threads), then real MPI ranks through
`setup_weight_sync` (two pipeline stages sending in parallel to two generators, every receiver
issuing its collectives in the agreed order), the timeout, and groups whose members disagree on
the device.
"""

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from areal_hpc.config import load_config
from areal_hpc.layout import Layout
from areal_hpc.weight_sync import GroupSpec, WeightReceiver, WeightSender, WeightSyncError, _check_devices, _Group
from tests.helpers import MPI_PROGRAMS


def _local_group(size: int, timeout_s: float = 20.0, name: str = "t"):
    master = dist.TCPStore(
        "127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    spec = GroupSpec(f"areal-ws-{name}", 0, "127.0.0.1", master.port, size, "gloo", timeout_s)
    return WeightSender(0, True, spec, master), spec


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


def test_receiver_times_out_when_sender_is_silent():
    sender, spec = _local_group(2, timeout_s=1.5, name="silent")
    receiver = WeightReceiver([spec], (1,))
    # The source joins the group but never sends: the receiver's first broadcast must time out.
    joined = threading.Thread(target=_Group, args=(spec, 0, torch.device("cpu"), sender._master_store))
    joined.start()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="within 1.5 s"):
        list(receiver.receive())
    assert time.monotonic() - t0 < 20
    joined.join(10)


def test_members_on_different_devices_are_refused_by_name():
    layout = Layout.from_config(
        load_config(None, ["cluster.nodes=2", "cluster.gpus_per_node=2", "allocation.gen_nodes=1"])
    )
    _check_devices("areal-ws-0", [(4, "a", "cuda"), (2, "b", "cuda"), (3, "b", "cuda")], layout)
    # every member gets the same list from the allgather, so every member raises the same error
    with pytest.raises(WeightSyncError) as e:
        _check_devices("areal-ws-0", [(4, "a", "cuda"), (2, "b", "cpu"), (3, "b", "cpu")], layout)
    assert "trainer 0 (world rank 4) on cuda but generator 0 (world rank 2) and 1 more on cpu" in str(e.value)
    assert "cluster.device" in str(e.value)


@pytest.mark.mpi
def test_mpi_two_stages_bit_exact_in_the_agreed_order_then_timeout(run_mpi, tmp_path):
    from transformers import Qwen2ForCausalLM

    from areal_hpc.config import ModelConfig
    from areal_hpc.tiny import hf_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(hf_config(ModelConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)))
    torch.save(model.state_dict(), tmp_path / "state.pt")
    # world: controller, reward, 2 generators, 2 trainers (PP 2: one source per stage)
    proc = run_mpi(
        MPI_PROGRAMS / "weight_sync_world.py",
        n=6,
        timeout=180,
        env={"AREAL_TEST_STATE": str(tmp_path / "state.pt")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RESULT 1" in proc.stdout, proc.stdout[-3000:]
    # both receivers issued (stage, bucket) in the agreed round-robin order, stages of unequal length
    assert "ORDERS" in proc.stdout and "(1, 'end')]" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count("timed out after") == 2, proc.stdout[-3000:]
