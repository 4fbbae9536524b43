"""A real MPI world for tests/test_generator_worker.py: controller (scripted here), reward (idle), a
generator running `generator.worker.serve` with a real vLLM engine, and a stand-in trainer that sends
the weights saved at $WEIGHTS_B through the real weight-sync sender on a WeightSync. The generator runs the default workflow (SingleTurn). The controller
pickles what came back to $OUT. $OVERRIDES: the config overrides, $MODEL: the model directory.

    mpirun -n 4 python tests/support/mpi/generator_world.py
"""

import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from areal_hpc.config import load_config
from areal_hpc.layout import Layout, Role
from areal_hpc.protocol import (
    EvalTrajectory,
    Failure,
    GenerateRequest,
    Mailbox,
    Stop,
    Trajectory,
    WeightSync,
)
from areal_hpc.rank_context import RankContext
from areal_hpc.weight_sync.broadcast import setup_weight_sync

cfg = load_config(None, os.environ["OVERRIDES"].split())
layout, world = Layout.from_config(cfg), MPI.COMM_WORLD
ctx = RankContext(cfg, layout, world, layout.split(world), Path("."), Path(os.environ["MODEL"]))
sync = setup_weight_sync(ctx)
role, gen, trainer = layout.role_of(world.Get_rank()), layout.ranks(Role.GENERATOR)[0], layout.ranks(Role.TRAINER)[0]
mb = Mailbox(world)
ROW = {"prompt": "", "target": "", "kind": "math"}


def expect(n_traj, n_eval=0, done=False):
    trajs, evals, syncs = [], [], []
    while len(trajs) < n_traj or len(evals) < n_eval or (done and not syncs):
        msg = mb.recv(timeout_s=240).msg
        if isinstance(msg, Failure):
            raise RuntimeError(msg.error)
        {Trajectory: trajs, EvalTrajectory: evals}.get(type(msg), syncs).append(msg)
    return trajs, evals, syncs


if role == Role.GENERATOR:
    from areal_hpc.generator.worker import serve

    serve(ctx, sync)
elif role == Role.TRAINER:
    sync.join()  # as the trainer's serve does once its engine is built
    state = torch.load(os.environ["WEIGHTS_B"])
    while not isinstance(msg := mb.recv(source=0, timeout_s=300).msg, Stop):
        assert isinstance(msg, WeightSync)
        sync.send(sorted(state.items()), bucket_bytes=32_000)
elif role == Role.CONTROLLER:
    mb.send(gen, GenerateRequest(0, np.array([5, 6, 7], np.int32), ROW, 4))  # group g's prompt: [5 + g, 6, 7]
    mb.send(
        gen, GenerateRequest(0, np.array([5, 6, 7], np.int32), ROW, 2, eval=True)
    )  # eval prompt 0: the same prompt, 2 more
    first, evals, _ = expect(4, n_eval=2)  # the engine is up and serving
    for g in (1, 2):
        mb.send(gen, GenerateRequest(g, np.array([5 + g, 6, 7], np.int32), ROW, 4))
    time.sleep(0.05)
    for v in (1, 2):  # two syncs back to back, the second during the first's drain (rollout.interruptible false)
        mb.send(trainer, WeightSync(v))
        mb.send(gen, WeightSync(v))
    mb.send(gen, GenerateRequest(3, np.array([8, 6, 7], np.int32), ROW, 4))  # after the syncs: on version 2
    rest, _, syncs = expect(12, done=True)
    while len(syncs) < 2:
        syncs += expect(0, done=True)[2]
    # A Stop right after a WeightSync, with answers in flight: the sync still completes (with
    # rollout.interruptible false the drain ends at the Stop), so the trainer's broadcast returns.
    mb.send(gen, GenerateRequest(4, np.array([9, 6, 7], np.int32), ROW, 4))
    time.sleep(0.05)
    mb.send(trainer, WeightSync(3))
    mb.send(gen, WeightSync(3))
    for r in (gen, trainer):
        mb.send(r, Stop("done"))
    syncs += expect(0, done=True)[2]
    mb.flush()
    with open(os.environ["OUT"], "wb") as f:
        pickle.dump({"first": first, "evals": evals, "rest": rest, "syncs": syncs}, f)
world.Barrier()
