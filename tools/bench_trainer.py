"""Benchmark of the Megatron trainer on this machine (CPU, gloo).

1. PPO step throughput (tokens/s, prox recompute + forward/backward + Adam) on the tiny model, with a
   micro-batch's sequences packed into one row versus one padded row per sequence.
2. Weight export (TP gather + Hugging Face renaming) and its broadcast through the weight-sync group
   to one receiver, in seconds per GB, for a larger Qwen2 model.

    python tools/bench_trainer.py                      # both
    python tools/bench_trainer.py --only step --seqs 128
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from areal_hpc.config import ModelConfig
from areal_hpc.packing import pack_microbatches
from areal_hpc.protocol import TrainBatch
from areal_hpc.tiny import build_tiny_model
from areal_hpc.trainer.spawn import free_port, run_ranks


def make_batch(vocab: int, seqs: int, prompt: int, max_new: int, budget: int, minibatches: int, seed: int = 0):
    """Arithmetic-task-like sequences: short prompts, responses of uniform length in [4, max_new]."""
    rng = np.random.default_rng(seed)
    lens = prompt + rng.integers(4, max_new + 1, seqs)
    n = int(lens.sum())
    mask = np.concatenate([np.r_[np.zeros(prompt), np.ones(length - prompt)] for length in lens]).astype(np.uint8)
    per = np.array_split(np.arange(seqs), minibatches)
    microbatches = [[[int(idx[i]) for i in mb] for mb in pack_microbatches(lens[idx], budget)] for idx in per]
    return TrainBatch(
        0,
        rng.integers(0, vocab, n).astype(np.int32),
        np.r_[0, np.cumsum(lens)].astype(np.int32),
        mask,
        np.where(mask, -1.0, 0.0).astype(np.float32),
        np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
        np.where(mask, 0, -1).astype(np.int32),
        microbatches=microbatches,
    )


def _step_rank(par, model_dir, batch, padded, repeats, threads):
    from areal_hpc.trainer.engine import Engine, OptimConfig
    from areal_hpc.trainer.step import StepConfig, ppo_step

    torch.set_num_threads(threads)
    engine = Engine(model_dir, par, OptimConfig(lr=1e-5))
    cfg = StepConfig(padded=padded)
    ppo_step(engine, batch, cfg)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        ppo_step(engine, batch, cfg)
    return (time.perf_counter() - t0) / repeats


def bench_step(args) -> None:
    model = ModelConfig()  # the tiny-cpu model
    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_tiny_model(model, root, seed=1))
        batch = make_batch(model.vocab_size, args.seqs, 12, args.max_new, args.budget, args.minibatches)
        tokens = len(batch.tokens)
        mbs = sum(len(k) for k in batch.microbatches)
        print(
            f"PPO step, tiny model ({model.hidden_size} hidden, {model.num_layers} layers), {args.seqs} sequences, "
            f"{tokens} tokens, {mbs} micro-batches of <= {args.budget} tokens, {args.minibatches} minibatches, "
            f"1 rank x {args.threads} threads"
        )
        for padded in (False, True):
            s = run_ranks(_step_rank, 1, 1, 1, model_dir, batch, padded, args.repeats, args.threads)[0]
            name = "padded (row per sequence)" if padded else "packed (one row per micro-batch)"
            print(f"  {name:34s} {s:7.3f} s/step  {tokens / s:9.0f} tokens/s")


def _export_rank(par, model_dir, port, bucket_mb, repeats):
    from areal_hpc.trainer.engine import Engine, OptimConfig
    from areal_hpc.weight_sync import GroupSpec, WeightSender

    engine = Engine(model_dir, par, OptimConfig())
    times, nbytes = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for _, t in engine.export())
        times.append(time.perf_counter() - t0)
    sent = None
    if par.rank == 0:
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
        sender = WeightSender(0, True, GroupSpec("bench-ws", 0, "127.0.0.1", port, 2, "gloo", 120.0), store)
        for _ in range(2):  # the first send also connects the group: report the second
            sent = sender.send(engine.export(), bucket_mb << 20)
    else:
        for _ in range(2):
            for _ in engine.export():
                pass
    return {"bytes": nbytes, "export_s": min(times), "sent": sent} if par.rank == 0 else None


def _receive(port, out):
    from areal_hpc.weight_sync import GroupSpec, WeightReceiver

    receiver = WeightReceiver([GroupSpec("bench-ws", 0, "127.0.0.1", port, 2, "gloo", 120.0)], 0, 1)
    for _ in range(2):
        n = sum(t.numel() * t.element_size() for bucket in receiver.receive() for _, t in bucket)
    Path(out).write_text(str(n))


def bench_export(args) -> None:
    model = ModelConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=16384,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_tiny_model(model, root, seed=1))
        for tp in (1, 2):
            port = free_port()
            out = Path(root) / f"recv{tp}"
            recv = mp.get_context("spawn").Process(target=_receive, args=(port, str(out)))
            recv.start()
            r = run_ranks(_export_rank, tp, tp, 1, model_dir, port, args.bucket_mb, 3)[0]
            recv.join(120)
            gb = r["bytes"] / 2**30
            assert int(out.read_text()) == r["bytes"], (out.read_text(), r["bytes"])
            print(
                f"export TP={tp}: {r['bytes'] / 2**20:6.1f} MiB  export {r['export_s']:.3f} s "
                f"({r['export_s'] / gb:.2f} s/GB);  export + broadcast to 1 receiver ({args.bucket_mb} MiB buckets) "
                f"{r['sent']['seconds']:.3f} s ({r['sent']['seconds'] / gb:.2f} s/GB)"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["step", "export"])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--budget", type=int, default=1024, help="tokens per micro-batch (ppo.max_tokens_per_mb)")
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=64)
    args = ap.parse_args()
    if args.only in (None, "step"):
        bench_step(args)
    if args.only in (None, "export"):
        bench_export(args)


if __name__ == "__main__":
    main()
