"""A real MPI world for tests/test_trainer_worker.py: the trainer ranks run `areal_hpc.trainer.worker.serve`,
rank 0 drives them as the controller would (through the replica's first rank, which relays to the other),
the generator ranks receive the weight broadcast.

    mpirun -n 6 python tests/support/mpi/trainer_world.py OUT_DIR

MPI is imported inside main(): the trainer's checkpoint writer starts helper processes that import this
file again, and they must not initialise MPI.
"""

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    import torch
    from mpi4py import MPI

    from areal_hpc.arch import model_arch
    from areal_hpc.config import load_config
    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.layout import Layout, Role
    from areal_hpc.protocol import Mailbox, Save, Stop, TrainResult, WeightSync
    from areal_hpc.rank_context import RankContext
    from areal_hpc.weight_sync.broadcast import setup_weight_sync
    from tests.support.inputs import random_batch

    cfg = load_config(
        None,
        [
            "cluster.nodes=2",
            "cluster.gpus_per_node=2",
            "allocation.gen_gpus=2",
            "allocation.train_pp=2",
            "model.num_layers=2",
            "ppo.minibatches=2",
            "train.collective_timeout_s=60",
        ],
    )
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
    first = layout.replica_ranks(0)[0]  # the one replica (TP 1 x PP 2) gets every message through it
    assert layout.train_dp == 1 and layout.replica_ranks(0) == trainers

    def wait(kind, source=None):
        env = box.recv(source=source, timeout_s=120)
        assert isinstance(env.msg, kind), env.msg
        return env.msg

    if role == Role.TRAINER:
        from areal_hpc.trainer.worker import serve

        serve(ctx, sync)
    elif role == Role.GENERATOR:
        sync.join()  # as a generator does once its engine exists
        wait(WeightSync, 0)
        got = {n: t.clone() for bucket in sync.receive() for n, t in bucket}
        torch.save(got, out / f"gen{rank}.pt")
        wait(Stop, 0)
    elif role == Role.REWARD:
        wait(Stop, 0)
    else:
        batch = random_batch(model_arch(cfg.model).vocab_size)
        batch.version = 0
        box.send(first, batch)
        result = wait(TrainResult, trainers[0])
        for r in [first, *generators]:
            box.send(r, WeightSync(result.version))
        box.send(first, Save(result.version, str(out / "step_1")))
        saved = {box.recv(timeout_s=120).source for _ in trainers}  # every rank saves and answers
        for r in range(1, world.Get_size()):
            if r not in trainers or r == first:
                box.send(r, Stop("done"))
        box.flush()
        (out / "controller.json").write_text(
            json.dumps({"version": result.version, "stats": result.stats, "saved": sorted(saved)})
        )
    world.Barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
