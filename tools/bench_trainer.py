"""The trainer's memory and speed per setting, beside plain transformers + PyTorch on the same model and data.

    python tools/bench_trainer.py                         # this machine's device; CPU: the 100M model below
    python tools/bench_trainer.py --model qwen2.5-1.5b    # on a GPU: the Qwen2.5-1.5B shape, bf16
    python tools/bench_trainer.py --only packing          # packed vs padded micro-batches (tiny model)
    python tools/bench_trainer.py --only export           # weight export and its broadcast, s/GB

Settings (one process each, so that each one's peak is its own): areal-hpc's PPO step with
`ppo.recompute` none, selective and full, exact prox (a no-grad pass first); transformers' model
(SDPA attention; bf16 autocast on a GPU), AdamW (fused on a GPU), the same decoupled PPO loss, with and
without gradient checkpointing. For each: the activation memory (the peak above the weights, gradients
and Adam state: max allocated on a GPU, the resident high-water mark on the CPU, reset before each
step; the last step's) and trained tokens per second (steps after the first). By default a step is
2 sequences of 2,048 tokens on the CPU (16 on a GPU), trained as one micro-batch.

Models: `cpu` (the default without a GPU): hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate
1,408, tied embeddings, Qwen's vocabulary of 151,936 (about 100M parameters, 78M of them the
embedding), fp32; `qwen2.5-1.5b`: hidden 1,536, 28 layers, 12 / 2 heads, intermediate 8,960, tied,
the same vocabulary, bf16. Random weights, random tokens: speed and memory do not depend on them.

The last two lines: `activation memory, full recompute / none: X.XX` and `trainer speed vs transformers:
X.XXx` (areal-hpc's fastest setting over transformers' fastest; both with exact prox).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from areal_hpc.arch import model_arch
from areal_hpc.config import ModelConfig, PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.device import visible_gpus
from areal_hpc.packing import pack_microbatches
from areal_hpc.protocol import TrainBatch
from areal_hpc.trainer.spawn import default_device, run_ranks

MODELS = {
    "cpu": (
        ModelConfig(
            hidden_size=512,
            intermediate_size=1408,
            num_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
        "float32",
    ),
    "qwen2.5-1.5b": (
        ModelConfig(
            hidden_size=1536,
            intermediate_size=8960,
            num_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),
        "bfloat16",
    ),
}
PROMPT = 64
"""Prompt tokens of each sequence (no loss on them)."""


# --- memory, per device -----------------------------------------------------------------------------


def _memory_reset(device: str) -> int:
    """Forget the peak; the bytes in use now (allocated on a GPU, resident on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    return _proc_status("VmRSS")


def _memory_peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _proc_status("VmHWM")


def _measure(step, steps: int, device: str) -> dict:
    """Run `step` `steps` times: the activation memory of the last one (its peak above what was in use
    before it: a first step's one-time allocations, kept for the run, are not a step's) and the fastest
    step time after the first."""
    times = []
    for _ in range(steps):
        base = _memory_reset(device)
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = _memory_peak(device)
    return {"activation_bytes": peak - base, "step_s": min(times[1:] or times), "base_bytes": base}


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# --- the batch ----------------------------------------------------------------------------------------


def make_batch(vocab: int, seqs: int, seq_len: int, mb_tokens: int, seed: int = 0) -> TrainBatch:
    """`seqs` sequences of `seq_len` tokens (PROMPT of them prompt), packed into micro-batches of at
    most `mb_tokens`, one PPO minibatch; behaviour logprobs near the model's, random advantages."""
    rng = np.random.default_rng(seed)
    lens = np.full(seqs, seq_len)
    n = int(lens.sum())
    mask = np.tile(np.r_[np.zeros(PROMPT), np.ones(seq_len - PROMPT)], seqs).astype(np.uint8)
    return TrainBatch(
        0,
        rng.integers(0, vocab, n).astype(np.int32),
        np.r_[0, np.cumsum(lens)].astype(np.int32),
        mask,
        np.where(mask, -np.log(vocab), 0.0).astype(np.float32),
        np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
        np.where(mask, 0, -1).astype(np.int32),
        microbatches=[pack_microbatches(lens, mb_tokens)],
    )


# --- areal-hpc --------------------------------------------------------------------------------------


def prox_pass_step(engine, batch, cfg):
    """`ppo_step` with the prox recompute pass even with one minibatch, where `ppo_step` takes the prox
    logprobs from the training pass itself (the same values): what skipping the pass saves."""
    from areal_hpc.trainer.step import prox_pass, step_microbatches, train_minibatches

    minibatches = step_microbatches(engine, batch)
    prox_pass(engine, minibatches, cfg.temperature)
    return train_minibatches(engine, int(batch.version), minibatches, cfg)


def padded_step(engine, batch, cfg):
    """`ppo_step` on one padded row per sequence instead of a micro-batch's sequences packed into one
    row (a dense model on one rank, as bench_packing runs it): what packing saves."""
    from areal_hpc.trainer.step import make_microbatch, needs_prox_pass, prox_pass, train_minibatches

    minibatches = [
        [make_microbatch(batch, ids, padded=True, device=engine.device) for ids in mb] for mb in batch.microbatches
    ]
    if needs_prox_pass(cfg, minibatches):
        prox_pass(engine, minibatches, cfg.temperature)
    return train_minibatches(engine, int(batch.version), minibatches, cfg)


def _areal_rank(par, model_dir, batch, dtype, recompute, prox_pass, steps, threads):
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    if par.device.type == "cpu":
        torch.set_num_threads(threads)
    device = par.device.type
    engine = Engine(model_dir, par, PPOConfig(lr=1e-6, recompute=recompute), getattr(torch, dtype))
    engine.init_optimizer_state()  # Adam's moments now, so that the baseline holds them
    step = prox_pass_step if prox_pass else ppo_step
    return _measure(lambda: step(engine, batch, StepConfig()), steps, device)


# --- transformers + PyTorch -------------------------------------------------------------------------


def _transformers_proc(model_dir, batch, dtype, checkpointing, steps, threads, device, out):
    """Plain transformers + PyTorch: the same step (exact prox pass under no_grad, then one optimizer
    step over the micro-batches with the decoupled PPO loss), fp32 master weights."""
    from transformers import AutoModelForCausalLM

    from areal_hpc.algo.ppo import decoupled_ppo_loss

    if device == "cpu":
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=device == "cuda")
    for p in model.parameters():  # Adam's state now, so that the baseline holds it
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    cu = batch.cu_seqlens
    fields = [(batch.tokens, np.int64), (batch.loss_mask, bool), (batch.behav_logprobs, np.float32)]
    fields.append((batch.advantages, np.float32))
    mbs = []  # per micro-batch: ids, loss mask, behav logprobs, advantages, each [sequences, seq_len]
    for ids in batch.microbatches[0]:
        take = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in ids])
        mbs.append(
            tuple(torch.from_numpy(np.asarray(x)[take].astype(t)).view(len(ids), -1).to(device) for x, t in fields)
        )
    autocast = torch.autocast(device, dtype=getattr(torch, dtype), enabled=dtype != "float32")

    def logprobs(ids):
        with autocast:
            logits = model(ids).logits[:, :-1].float()  # [b, s - 1, V]
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def step():
        with torch.no_grad():
            prox = [logprobs(ids) for ids, *_ in mbs]
        total = sum(int(m[:, 1:].sum()) for _, m, _, _ in mbs)
        for (ids, mask, behav, adv), p in zip(mbs, prox):
            logp = logprobs(ids)
            loss, _ = decoupled_ppo_loss(logp, p, behav[:, 1:], adv[:, 1:], mask[:, 1:])
            (loss * mask[:, 1:].sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.save(_measure(step, steps, device), out)


def _run_transformers(model_dir, batch, dtype, checkpointing, steps, threads, device):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pt"
        ctx = mp.get_context("spawn")
        env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
        if device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus()[0]
        p = ctx.Process(
            target=_transformers_proc, args=(model_dir, batch, dtype, checkpointing, steps, threads, device, out)
        )
        p.start()
        if device == "cuda":
            if env_before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = env_before
        p.join()
        if p.exitcode != 0 or not out.exists():
            return None  # out of memory, most likely: the setting does not fit
        return torch.load(out)


def bench_settings(args, device: str) -> None:
    model, dtype = MODELS[args.model]
    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_tiny_model(model, root, seed=1))
        batch = make_batch(model_arch(model).vocab_size, args.seqs, args.seq_len, args.mb_tokens)
        tokens = len(batch.tokens)
        mbs = len(batch.microbatches[0])
        print(
            f"\nPPO step with exact prox, {args.model} model ({dtype}) on {device}: {args.seqs} sequences of "
            f"{args.seq_len} tokens = {tokens} tokens in {mbs} micro-batch(es) of <= {args.mb_tokens} tokens; "
            f"{args.steps} steps per setting, one process each"
        )
        print(f"  {'setting':44s} {'activation memory':>18s} {'tokens/s':>10s}")
        results = {}
        # One minibatch: areal-hpc takes the exact prox from the training pass itself; the last row runs
        # the separate no-grad pass anyway, to show what skipping it saves.
        for recompute, prox_pass in (("none", False), ("selective", False), ("full", False), ("none", True)):
            setting = recompute + (", prox pass" if prox_pass else "")
            try:
                args_ = (model_dir, batch, dtype, recompute, prox_pass, args.steps, args.threads)
                r = run_ranks(_areal_rank, 1, 1, 1, *args_, timeout_s=7200)[0]
            except RuntimeError as e:
                r = None
                print(f"  areal-hpc recompute={setting}: failed: {str(e).strip().splitlines()[-1]}")
            results[("areal-hpc", setting)] = r
        for checkpointing in (False, True):
            r = _run_transformers(model_dir, batch, dtype, checkpointing, args.steps, args.threads, device)
            results[("transformers", "gradient checkpointing" if checkpointing else "plain")] = r
        for (system, setting), r in results.items():
            name = f"{system} {'recompute=' + setting if system == 'areal-hpc' else setting}"
            if r is None:
                print(f"  {name:44s} {'does not fit':>18s}")
            else:
                print(f"  {name:44s} {r['activation_bytes'] / 2**30:14.2f} GiB {tokens / r['step_s']:10.0f}")
        areal = {k[1]: v for k, v in results.items() if k[0] == "areal-hpc" and v}
        hf = {k[1]: v for k, v in results.items() if k[0] == "transformers" and v}
        ratio = areal["full"]["activation_bytes"] / areal["none"]["activation_bytes"]
        best_areal = min(areal.items(), key=lambda kv: kv[1]["step_s"])
        best_hf = min(hf.items(), key=lambda kv: kv[1]["step_s"]) if hf else None
        print(
            f"per 1,000 tokens: areal-hpc none {areal['none']['activation_bytes'] / tokens * 1000 / 2**30:.3f} GiB, "
            f"full {areal['full']['activation_bytes'] / tokens * 1000 / 2**30:.3f} GiB"
        )
        if best_hf:
            print(f"fastest: areal-hpc recompute={best_areal[0]}, transformers {best_hf[0]}")
        print(f"activation memory, full recompute / none: {ratio:.2f}")
        if best_hf:
            print(f"trainer speed vs transformers: {best_hf[1]['step_s'] / best_areal[1]['step_s']:.2f}x")
        else:
            print("trainer speed vs transformers: n/a (no transformers setting fits)")


# --- packing, export (what this benchmark measured before) -----------------------------------------


def _packing_rank(par, model_dir, batch, padded, repeats, threads):
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    torch.set_num_threads(threads)
    engine = Engine(model_dir, par, PPOConfig(lr=1e-5))
    cfg, step = StepConfig(), padded_step if padded else ppo_step
    step(engine, batch, cfg)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(engine, batch, cfg)
    return (time.perf_counter() - t0) / repeats


def bench_packing(args) -> None:
    """Arithmetic-task-like sequences on the tiny-cpu model: packed rows vs one padded row per sequence."""
    model = ModelConfig()
    rng = np.random.default_rng(0)
    lens = 12 + rng.integers(4, 33, 64)
    n = int(lens.sum())
    mask = np.concatenate([np.r_[np.zeros(12), np.ones(length - 12)] for length in lens]).astype(np.uint8)
    per = np.array_split(np.arange(len(lens)), 2)
    microbatches = [[[int(idx[i]) for i in mb] for mb in pack_microbatches(lens[idx], 1024)] for idx in per]
    batch = TrainBatch(
        0,
        rng.integers(0, model_arch(model).vocab_size, n).astype(np.int32),
        np.r_[0, np.cumsum(lens)].astype(np.int32),
        mask,
        np.where(mask, -1.0, 0.0).astype(np.float32),
        np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
        np.where(mask, 0, -1).astype(np.int32),
        microbatches=microbatches,
    )
    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_tiny_model(model, root, seed=1))
        print(f"\nPPO step, tiny model, 64 sequences, {n} tokens, micro-batches of <= 1024 tokens, 2 minibatches")
        for padded in (False, True):
            s = run_ranks(_packing_rank, 1, 1, 1, model_dir, batch, padded, 3, args.threads)[0]
            name = "padded (row per sequence)" if padded else "packed (one row per micro-batch)"
            print(f"  {name:34s} {s:7.3f} s/step  {n / s:9.0f} tokens/s")


def _export_rank(par, model_dir, port, bucket_mb, repeats):
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.weight_sync.broadcast import WeightSender
    from areal_hpc.weight_sync.group import GroupSpec

    engine = Engine(model_dir, par, PPOConfig())
    times, nbytes = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for _, t in engine.export())
        times.append(time.perf_counter() - t0)
    sent = None
    if par.rank == 0:
        sender = WeightSender(0, True, GroupSpec("bench-ws", 0, "127.0.0.1", port, 2, "gloo", 120.0))
        sender.join(120.0)
        for _ in range(2):  # the second, as every sync after a run's first
            sent = sender.send(engine.export(), bucket_mb << 20)
    else:
        for _ in range(2):
            for _ in engine.export():
                pass
    return {"bytes": nbytes, "export_s": min(times), "sent": sent} if par.rank == 0 else None


def _receive(port, out):
    from areal_hpc.weight_sync.broadcast import WeightReceiver
    from areal_hpc.weight_sync.group import GroupSpec

    receiver = WeightReceiver([GroupSpec("bench-ws", 0, "127.0.0.1", port, 2, "gloo", 120.0)], (1,))
    receiver.join(0, 120.0)
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
    print()
    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_tiny_model(model, root, seed=1))
        for tp in (1, 2):
            store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)  # the group's
            port = store.port
            out = Path(root) / f"recv{tp}"
            recv = mp.get_context("spawn").Process(target=_receive, args=(port, str(out)))
            recv.start()
            r = run_ranks(_export_rank, tp, tp, 1, model_dir, port, args.bucket_mb, 3, device="cpu")[0]
            recv.join(120)
            gb = r["bytes"] / 2**30
            assert int(out.read_text()) == r["bytes"], (out.read_text(), r["bytes"])
            print(
                f"export TP={tp}: {r['bytes'] / 2**20:6.1f} MiB  export {r['export_s']:.3f} s "
                f"({r['export_s'] / gb:.2f} s/GB);  export + broadcast to 1 receiver ({args.bucket_mb} MiB buckets) "
                f"{r['sent']['seconds']:.3f} s ({r['sent']['seconds'] / gb:.2f} s/GB)"
            )


def main() -> None:
    # Every process below: blocks of 1 MiB or more come from mmap and go back to the system when freed,
    # so that the resident high-water mark on the CPU follows the memory in use (glibc otherwise keeps
    # freed blocks, and raises this threshold as it sees large frees).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["settings", "packing", "export"])
    ap.add_argument("--model", choices=sorted(MODELS), help="default: qwen2.5-1.5b on a GPU, cpu otherwise")
    ap.add_argument("--seqs", type=int, help="sequences per step (default: 2 on the CPU, 16 on a GPU)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument(
        "--mb-tokens", type=int, help="tokens per micro-batch (default: all of the step's, one micro-batch)"
    )
    ap.add_argument(
        "--steps", type=int, default=2, help="steps per setting: memory from the last, time from all but the first"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per process")
    ap.add_argument("--bucket-mb", type=int, default=64)
    args = ap.parse_args()
    device = default_device()
    gpu = device == "cuda"
    args.model = args.model or ("qwen2.5-1.5b" if gpu else "cpu")
    args.seqs = args.seqs or (16 if gpu else 2)
    args.mb_tokens = args.mb_tokens or args.seqs * args.seq_len
    if args.only in (None, "packing"):
        bench_packing(args)
    if args.only in (None, "export"):
        bench_export(args)
    if args.only in (None, "settings"):
        bench_settings(args, device)


if __name__ == "__main__":
    main()
