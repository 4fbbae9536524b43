"""gen_tp = 2: the engine's two tensor-parallel workers are separate processes, and each joins the
weight-sync group with its own rank (at start, with the start-up check) and loads its shard of every
bucket as it arrives (the path a
GPU generator with gen_tp > 1 takes; here over gloo, with vLLM's CPU tensor parallelism).

The sender is a thread of the test process; the reference logprobs come from transformers.
"""

import datetime
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.device import resolve_device
from areal_hpc.weight_sync.broadcast import WeightReceiver, WeightSender
from areal_hpc.weight_sync.group import GroupSpec
from tests.support.shapes import GENERATOR_TP

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8


def test_tp2_workers_receive_and_load_their_shards(tmp_path):
    from transformers import Qwen2ForCausalLM

    from areal_hpc.generator.engine import GenerationEngine

    # 4 query / 2 key-value heads of size 32: both split over 2 workers
    path = build_tiny_model(GENERATOR_TP, tmp_path, 1)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    engine = GenerationEngine.create(
        path,
        device=resolve_device(),
        temperature=TEMPERATURE,
        max_model_len=256,
        max_num_seqs=16,
        tp=2,
    )
    try:
        settings = engine.settings()  # read from TP worker 0, a process of its own
        assert settings["worker_start_method"] == "spawn" and settings["tensor_parallel_size"] == "2"
        assert settings["model_runner"] == "V1" and settings["async_scheduling"] == "off"
        master = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        spec = GroupSpec("areal-ws-tp", 0, "127.0.0.1", master.port, 3, "gloo", 60.0)
        sender = WeightSender(0, True, spec, _master_store=master)
        receiver = WeightReceiver([spec], (1, 2))  # group ranks of TP workers 0 and 1
        th = threading.Thread(target=sender.join, args=(60,))
        th.start()
        joined = engine.join_weight_sync(receiver, 60)  # as at start: each worker joins with its own rank
        th.join(60)
        assert len(joined) == 2 and all("start-up check passed" in line for line in joined), joined
        assert any("group rank 2 joined" in line for line in joined), joined
        state = sorted(model.state_dict().items())
        for version in (1, 2):  # the second sync reuses each worker's connected group
            th = threading.Thread(target=sender.send, args=(state, 16_000))
            th.start()
            engine.update_weights(receiver, version)
            th.join(60)
        prompt = [5, 6, 7]
        for i in range(4):
            engine.submit(f"t{i}", prompt, 16)
        turns = []
        while engine.in_flight:
            turns += engine.step()
        assert len(turns) == 4
        for t in turns:
            assert set(t.sampled.versions) == {2}
            ids = torch.tensor([prompt + list(t.sampled.token_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0] / TEMPERATURE, -1)[len(prompt) - 1 : -1]
            ref = logp.gather(-1, torch.as_tensor(t.sampled.token_ids, dtype=torch.long)[:, None])[:, 0].numpy()
            np.testing.assert_allclose(t.sampled.behav_logprobs, ref, atol=1e-3, rtol=0)
    finally:
        engine.close()
