"""The trainer rank: Megatron state up, its weight-sync group joined (a source), then the
controller's messages in order until Stop.

The controller sends each message for a data-parallel replica to the replica's first rank, which
passes it on to the replica's other TP x PP ranks (`protocol.ReplicaRelay`); with routing replay a
batch's routing only for the peer's own pipeline stage's layers (`stage_routing`).

    TrainBatch(v)   -> one PPO step (every rank); trainer-local rank 0 replies TrainResult(v + 1, stats)
    WeightSync(v)   -> every rank iterates its stage's export (the dense tensors' TP gathers); each
                       weight-sync source sends what the export yields on it, HF-named, through the
                       weight-sync handle: a stage's (tp 0, dp 0) rank the dense tensors (and its
                       experts), with expert parallelism the first rank of each expert rank its experts;
                       with LoRA (lora.rank) the stage's adapters only, PEFT-named, from its (tp 0, dp 0)
    Save(v, path)   -> every rank writes its part under path/trainer/ (atomic) and replies Saved(v)
    Stop            -> leave the weight-sync group (a source), flush and exit

Every trainer rank receives the same messages in the same order from the controller (MPI keeps the
order between two ranks, and the relay keeps it), so the collectives inside each handler line up
across ranks. Any error is
reported to the controller as Failure before it propagates.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

import torch

from areal_hpc.arch import model_arch
from areal_hpc.network import world_store
from areal_hpc.protocol import (
    Failure,
    Mailbox,
    ReplicaRelay,
    Save,
    Saved,
    Stop,
    TrainBatch,
    TrainResult,
    WeightSync,
    arrive,
)
from areal_hpc.rank_context import CONTROLLER_RANK
from areal_hpc.trainer import checkpoint as trainer_checkpoint
from areal_hpc.trainer.convert import stage_layers
from areal_hpc.trainer.engine import Engine, init_parallel, shutdown_parallel
from areal_hpc.trainer.lora import LoraSpec
from areal_hpc.trainer.step import StepConfig, ppo_step

log = logging.getLogger("areal_hpc.trainer")


def build_engine(ctx) -> Engine:
    """torch.distributed + Megatron state, the model from ctx.model_path, resumed when asked."""
    cfg = ctx.cfg
    comm = ctx.role_comm
    timeout_s = cfg.train.collective_timeout_s
    store = world_store(comm, cfg.cluster.network_interface, timeout_s)
    a = cfg.allocation
    par = init_parallel(
        comm.Get_rank(), comm.Get_size(), a.train_tp, a.train_pp, store, ctx.device, timeout_s, a.train_ep
    )
    dtype = getattr(torch, cfg.model.dtype)
    engine = Engine(
        ctx.model_path,
        par,
        cfg.ppo,
        dtype,
        cfg.train.total_steps,
        lora=LoraSpec.of(cfg.lora),
        teacher=cfg.distill.teacher.path,
        teacher_dtype=getattr(torch, cfg.distill.teacher.dtype or cfg.model.dtype),
    )
    if ctx.resume_from is not None:
        was = trainer_checkpoint.load(engine, Path(ctx.resume_from) / "trainer")
        now = par.grid
        log.info(
            "trainer rank %d resumed from %s, written at TP %d x PP %d x DP %d, loaded at TP %d x PP %d x DP %d",
            *(par.rank, ctx.resume_from, was["tp"], was["pp"], was["dp"], now.tp, now.pp, now.dp),
        )
    return engine


def send_weights(engine: Engine, sync, bucket_bytes: int) -> dict | None:
    """Iterate this rank's export (collective in TP); a weight-sync source streams what it yields (HF
    names, TP-gathered; with LoRA the adapters only, PEFT's names) into its group, to the generators
    (areal_hpc.weight_sync.broadcast: the order)."""
    stream = engine.export_adapters() if engine.lora else engine.export()
    if sync is not None and sync.is_source:
        return sync.send(stream, bucket_bytes)
    for _ in stream:  # the others take part in the gathers
        pass
    return None


def stage_routing(ctx):
    """The replica relay's `for_peer` with routing replay: a peer gets a batch's routing of its own pipeline
    stage's layers only (a stage replays only its own layers' routers), not all of them; None without."""
    if not ctx.cfg.ppo.routing_replay:
        return None
    layout, arch = ctx.layout, model_arch(ctx.cfg.model)
    peers = sorted(layout.replica_ranks(layout.replica_of(ctx.rank)))  # by replica rank (world-rank order)
    layers = [stage_layers(arch, layout.trainer_coords(rank).pp, layout.train_pp) for rank in peers]

    def for_peer(peer: int, msg):
        return msg.for_layers(*layers[peer]) if isinstance(msg, TrainBatch) else msg

    return for_peer


def serve(ctx, sync) -> None:
    """The trainer rank's loop (see the module docstring)."""
    box = Mailbox(ctx.world)
    try:
        engine = build_engine(ctx)
        if sync is not None and sync.is_source:
            log.info("%s", sync.join())  # the generators join once their engines exist
        arrive(ctx.role_comm)  # asleep while trainer 0 waits for the generators' engines
        replica = ctx.layout.split_replica(ctx.role_comm)
        inbox = ReplicaRelay(box, replica, CONTROLLER_RANK, ctx.cfg.train.collective_timeout_s, stage_routing(ctx))
        step_cfg = StepConfig.from_config(ctx.cfg)
        bucket_bytes = ctx.cfg.train.weight_sync_bucket_mb << 20
        while True:
            envelopes = inbox.poll()
            if not envelopes:
                time.sleep(0.001)
                continue
            for env in envelopes:
                msg = env.msg
                if isinstance(msg, TrainBatch):
                    stats = ppo_step(engine, msg, step_cfg)
                    if engine.par.rank == 0:
                        box.send(CONTROLLER_RANK, TrainResult(int(msg.version) + 1, stats))
                elif isinstance(msg, WeightSync):
                    send_weights(engine, sync, bucket_bytes)
                elif isinstance(msg, Save):
                    trainer_checkpoint.save(engine, msg.path)
                    box.send(CONTROLLER_RANK, Saved(msg.version))
                elif isinstance(msg, Stop):
                    if sync is not None:
                        sync.leave()
                    box.flush()
                    shutdown_parallel()
                    return
                else:
                    raise RuntimeError(f"trainer got an unexpected {type(msg).__name__}")
    except Exception as e:
        box.send(CONTROLLER_RANK, Failure(ctx.rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        box.flush(timeout_s=10)
        raise
