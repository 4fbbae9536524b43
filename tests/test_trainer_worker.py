"""The trainer ranks' entry `areal_hpc.trainer.worker.serve` in a real MPI world (mpirun, 6 ranks):
a controller rank drives TrainBatch -> TrainResult, WeightSync (both pipeline stages broadcast their
Hugging Face weights to two generator ranks through the real weight-sync groups), Save -> Saved,
Stop."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.megatron]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, os.getcwd())  # the repository (run_mpi runs there): tests.test_trainer_step
    import torch
    from mpi4py import MPI
    from areal_hpc.config import load_config
    from areal_hpc.layout import Layout, Role
    from areal_hpc.protocol import Mailbox, Save, Saved, Stop, TrainResult, WeightSync
    from areal_hpc.runtime import RankContext
    from areal_hpc.tiny import build_tiny_model
    from areal_hpc.weight_sync import setup_weight_sync
    from tests.test_trainer_step import make_batch

    out = Path(sys.argv[1])
    cfg = load_config(None, [
        "cluster.nodes=2", "cluster.gpus_per_node=2", "allocation.gen_share=0.5", "allocation.train_pp=2",
        "model.num_layers=2", "ppo.minibatches=2", "train.collective_timeout_s=60",
    ])
    layout = Layout.from_config(cfg)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    role = layout.role_of(rank)
    role_comm = layout.split(world)
    model_dir = build_tiny_model(cfg.model, out / "root", 1) if rank == 0 else None
    model_dir = world.bcast(model_dir, root=0)
    ctx = RankContext(cfg, layout, world, role_comm, out, Path(model_dir), None)
    sync = setup_weight_sync(ctx)
    box = Mailbox(world)
    trainers, generators = list(layout.ranks(Role.TRAINER)), list(layout.ranks(Role.GENERATOR))

    def wait(kind, source=None):
        env = box.recv(source=source, timeout_s=120)
        assert isinstance(env.msg, kind), env.msg
        return env.msg

    if role == Role.TRAINER:
        from areal_hpc.trainer.worker import serve
        serve(ctx, sync)
    elif role == Role.GENERATOR:
        wait(WeightSync, 0)
        got = {n: t.clone() for bucket in sync.receive() for n, t in bucket}
        torch.save(got, out / f"gen{rank}.pt")
        wait(Stop, 0)
    elif role == Role.REWARD:
        wait(Stop, 0)
    else:
        batch = make_batch(cfg.model.vocab_size)
        batch.version = 0
        for t in trainers:
            box.send(t, batch)
        result = wait(TrainResult, trainers[0])
        for r in trainers + generators:
            box.send(r, WeightSync(result.version))
        for t in trainers:
            box.send(t, Save(result.version, str(out / "step_1")))
        saved = {box.recv(timeout_s=120).source for _ in trainers}
        for r in range(1, world.Get_size()):
            box.send(r, Stop("done"))
        box.flush()
        (out / "controller.json").write_text(json.dumps({"version": result.version, "stats": result.stats,
                                                          "saved": sorted(saved)}))
    world.Barrier()
    """
)


def test_trainer_ranks_serve_a_controller(run_mpi, tmp_path):
    from areal_hpc.trainer import checkpoint
    from areal_hpc.trainer.convert import read_hf

    proc = run_mpi(SCRIPT.replace("sys.argv[1]", repr(str(tmp_path))), n=6, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ctrl = json.loads((tmp_path / "controller.json").read_text())
    assert ctrl["version"] == 1
    assert ctrl["saved"] == [4, 5]
    for key in ("ppo/loss", "ppo/clip_frac", "ppo/grad_norm", "ppo/behav_weight_mean", "ppo/logp_mismatch"):
        assert isinstance(ctrl["stats"][key], float)
    assert ctrl["stats"]["ppo/grad_norm"] > 0
    assert checkpoint.is_complete(tmp_path / "step_1" / "trainer")
    # both generators got every Hugging Face tensor (both stages), trained, identical on both
    initial = read_hf(next((tmp_path / "root" / ".assets").glob("tiny-model-*")))
    got2, got3 = torch.load(tmp_path / "gen2.pt"), torch.load(tmp_path / "gen3.pt")
    assert sorted(got2) == sorted(initial) == sorted(got3)
    for name, w in initial.items():
        assert got2[name].shape == w.shape and torch.equal(got2[name], got3[name])
    assert any(not torch.equal(got2[n], w) for n, w in initial.items())
