"""A real MPI world for tests/test_weight_sync.py: a tiny Qwen3-MoE trained at TP 2 x DP 2 x EP 2 (4
trainer ranks) syncs into one vLLM generator. Stage 0 has two sources: (0, 0), trainer 0, sends the
dense tensors (gathered from its TP peer, trainer 1) and experts 0-1; (0, 1) is that TP peer, trainer
1, and sends experts 2-3 after taking part in the gathers. The generator starts on the tiny model, the
trainers hold a perturbed copy (a random tiny model's greedy tokens barely depend on its weights), and
the generator takes a sync through `trainer.worker.send_weights`. Rank 0 prints `RESULT` and JSON: the
generator's greedy tokens before and after the sync and those of a fresh engine on the trainers' model, the order in which the generator issued its collectives ((stage, expert
rank, bucket or "end")) and each source's bucket count.

    mpirun -n 7 python tests/support/mpi/expert_sync_world.py OUT_DIR

MPI is imported inside main(), as in trainer_world.py. Ranks that are done wait in a sleeping
barrier: a spinning one would take the cores the generator needs.
"""

import json
import sys
from pathlib import Path

PROMPTS = ([5, 6, 7, 8], [9, 3, 30, 41, 2])


def main(out: Path) -> None:
    from mpi4py import MPI

    from areal_hpc.config import load_config
    from areal_hpc.layout import Layout, Role
    from areal_hpc.protocol import arrive
    from areal_hpc.rank_context import RankContext
    from areal_hpc.weight_sync.broadcast import setup_weight_sync
    from areal_hpc.weight_sync.group import SyncGroup

    cfg = load_config(
        None,
        [
            "cluster.nodes=5",
            "cluster.gpus_per_node=1",
            "allocation.gen_gpus=1",
            "allocation.train_tp=2",
            "allocation.train_ep=2",
            "model.architecture=qwen3_moe",
            "model.hidden_size=64",
            "model.num_attention_heads=2",
            "model.num_key_value_heads=2",
            "model.max_position_embeddings=256",
            "train.collective_timeout_s=240",
            "train.startup_timeout_s=400",
        ],
    )
    layout = Layout.from_config(cfg)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    role = layout.role_of(rank)
    first = layout.ranks(Role.TRAINER).start
    assert [(s, e, r - first) for s, e, r in layout.sync_sources()] == [(0, 0, 0), (0, 1, 1)]
    paths = build_models(cfg.model, out) if rank == 0 else None
    initial, trained = world.bcast(paths, root=0)
    ctx = RankContext(cfg, layout, world, layout.split(world), out, Path(trained))

    issued = []  # (stage, expert rank) of each bucket's first broadcast, as the generator issues them
    broadcast = SyncGroup.broadcast

    def traced(group, tensor, what, *rest):
        if what == "bucket sizes" and group.rank != 0:
            issued.append(group.spec.key)
        return broadcast(group, tensor, what, *rest)

    SyncGroup.broadcast = traced
    sync = setup_weight_sync(ctx)
    report = None
    if role == Role.TRAINER:
        from areal_hpc.trainer.engine import shutdown_parallel
        from areal_hpc.trainer.worker import build_engine, send_weights

        engine = build_engine(ctx)
        if sync.is_source:
            print("JOINED", sync.join(), flush=True)
        stats = send_weights(engine, sync, 16 << 10)
        report = [*sync.spec.key, stats["buckets"], stats["tensors"]] if sync.is_source else None
        assert (stats is None) == (not sync.is_source), stats
        shutdown_parallel()
    elif role == Role.GENERATOR:
        report = generate(sync, initial, trained, issued)
    else:
        assert sync is None
    arrive(world)
    reports = world.gather(report)
    if rank == 0:
        sources = [r for r in reports if isinstance(r, list)]
        generator = next(r for r in reports if isinstance(r, dict))
        print("RESULT", json.dumps({"sources": sources, **generator}), flush=True)


def build_models(m, out: Path) -> tuple[str, str]:
    """The tiny MoE (the generator's start) and a perturbed copy (the trainers'), per-expert names."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from areal_hpc.data.tiny import build_tiny_model, build_tokenizer
    from tests.support.generator_runs import perturb

    initial = build_tiny_model(m, out / "root", seed=1)
    trained = out / "trained"
    perturb(Qwen3MoeForCausalLM.from_pretrained(initial, dtype=torch.float32), seed=5).save_pretrained(trained)
    build_tokenizer().save_pretrained(trained)
    return str(initial), str(trained)


def generate(sync, initial: str, trained: str, issued: list) -> dict:
    """The generator's part: greedy tokens on its initial weights, a sync, greedy tokens again; then a
    fresh engine's on the trained model."""
    from areal_hpc.device import resolve_device
    from areal_hpc.generator.engine import GenerationEngine
    from tests.support.generator_runs import drain

    def create(path):
        return GenerationEngine.create(
            path, device=resolve_device(), temperature=0.0, max_model_len=256, max_num_seqs=8, seed=0
        )

    def greedy(engine) -> list[list[int]]:
        for i, prompt in enumerate(PROMPTS):
            engine.submit(f"p{i}", prompt, 16)
        return [t.sampled.token_ids for t in sorted(drain(engine), key=lambda t: t.key)]

    engine = create(initial)
    for line in engine.join_weight_sync(sync, 300):
        print("JOINED", line, flush=True)
    before = greedy(engine)
    engine.update_weights(sync, 1)
    after = greedy(engine)
    engine.leave_weight_sync()
    engine.close()
    fresh = create(trained)
    expected = greedy(fresh)
    fresh.close()
    return {"before": before, "after": after, "expected": expected, "issued": [list(k) for k in issued]}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
