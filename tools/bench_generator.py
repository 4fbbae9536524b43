#!/usr/bin/env python
"""Generator benchmark: wrapper overhead against plain vLLM, and the pause of a weight update.

    python tools/bench_generator.py                    # sizes S,M (throughput) and S,M,L (pause)
    python tools/bench_generator.py --sizes S --groups 16

1. Throughput: the same prompts (G groups x n turns, up to --max-new tokens each, temperature 1)
   through `GenerationEngine` (FINAL_ONLY outputs, behaviour logprobs, versions) and through
   plain `LLM.generate` on the same engine, with and without logprobs; best of --repeats interleaved
   runs each (the best run is the one least disturbed by other work on a shared machine).
   Target: the wrapper within 10% of plain vLLM with logprobs.
2. Pause per weight update: with every turn mid-generation (--depth tokens in its context: a prompt of
   its own of random tokens, as the distinct answers in flight have, and 4 sampled), the time from
   the interruption to the first token sampled under the new weights, the weights arriving through a
   real weight-sync group (gloo; the sender is a thread of this process). Median of --repeats updates
   per size, alternating between the engine as it runs (the prefix cache reset with the weights, so
   every turn is prefilled again) and the same engine keeping its prefix cache (not what the system
   does: the KV of the tokens already sampled was computed by the old weights): the difference is
   what keeping the cache would save an update.

Each model size runs in its own process (one in-process vLLM engine per process).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

SIZES = {  # name -> fields over tests.support.shapes.GENERATOR (heads of 32 or 64: vLLM's CPU attention needs >= 32)
    "S": {},  # the generator tests' tiny model itself (with 1,024 positions, as every size)
    "M": dict(hidden_size=256, intermediate_size=1024, num_layers=4, num_attention_heads=8, num_key_value_heads=2),
    "L": dict(hidden_size=1024, intermediate_size=4096, num_layers=8, num_attention_heads=16, num_key_value_heads=4),
}


def child(size: str, args) -> dict:
    import torch
    from vllm import LLM, EngineArgs, SamplingParams

    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.device import resolve_device
    from areal_hpc.generator.engine import GenerationEngine
    from tests.support.shapes import GENERATOR

    m = dataclasses.replace(GENERATOR, max_position_embeddings=1024, **SIZES[size])
    path = build_tiny_model(m, args.root, seed=1)
    n_params = sum(p.numel() for p in _state(path).values())
    eargs = GenerationEngine.engine_args(
        path, device=resolve_device(), max_model_len=1024, max_num_seqs=args.groups * args.n, seed=0
    )
    base = EngineArgs(model=str(path))
    kwargs = {f.name: getattr(eargs, f.name) for f in dataclasses.fields(eargs) if f.name != "model"}
    kwargs = {k: v for k, v in kwargs.items() if v != getattr(base, k)}
    t0 = time.perf_counter()
    llm = LLM(model=str(path), **kwargs)
    start_s = time.perf_counter() - t0
    gen = GenerationEngine(llm.llm_engine, temperature=1.0, top_p=1.0)
    prompts = [[5 + g % 90, 6, 7, 8, 9] for g in range(args.groups)]
    out = {"size": size, "params_M": n_params / 1e6, "engine_start_s": start_s}

    if size in args.throughput_sizes:

        def plain(logprobs):
            # flat logprobs: the cheapest way plain vLLM returns the same per-token logprob
            sp = SamplingParams(
                n=args.n,
                temperature=1.0,
                max_tokens=args.max_new,
                logprobs=logprobs,
                flat_logprobs=logprobs is not None,
                detokenize=False,
            )
            t = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return sum(len(c.token_ids) for r in res for c in r.outputs) / (time.perf_counter() - t)

        def wrapped():
            t = time.perf_counter()
            for g, p in enumerate(prompts):
                for i in range(args.n):
                    gen.submit(f"{g}.{i}", p, args.max_new)
            tokens = 0
            while gen.in_flight:
                tokens += sum(len(turn.sampled.token_ids) for turn in gen.step())
            return tokens / (time.perf_counter() - t)

        plain(None), wrapped()  # warm-up
        runs = {"plain": [], "plain_logprobs": [], "wrapper": []}
        for _ in range(args.repeats):  # interleaved, so drift hits all three alike
            runs["plain"].append(plain(None))
            runs["plain_logprobs"].append(plain(0))
            runs["wrapper"].append(wrapped())
        out.update({f"tok_s_{k}": max(v) for k, v in runs.items()})

    # Pause per weight update through a real (in-process) weight-sync group.
    import numpy as np
    import torch.distributed as dist

    from areal_hpc.weight_sync.broadcast import WeightReceiver, WeightSender
    from areal_hpc.weight_sync.group import GroupSpec

    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    spec = GroupSpec("bench", 0, "127.0.0.1", master.port, 2, "gloo", 120.0)
    sender, receiver = WeightSender(0, True, spec, _master_store=master), WeightReceiver([spec], (1,))
    joining = threading.Thread(target=sender.join, args=(120.0,))
    joining.start()
    gen.join_weight_sync(receiver, 120.0)
    joining.join()
    state = _state(path)
    rng = np.random.default_rng(0)
    pauses, kept, updates = [], [], []
    reset = gen.engine.reset_prefix_cache
    for i in range(2 * args.repeats):
        keep = i % 2 == 1
        gen.engine.reset_prefix_cache = (lambda: True) if keep else reset
        for j in range(args.groups * args.n):
            gen.submit(f"pause{i}.{j}", rng.integers(5, 95, args.depth).tolist(), 512)
        for _ in range(4):
            gen.step()
        version = gen.version + 1
        th = threading.Thread(target=sender.send, args=(sorted(state.items()), 64 << 20))
        t0 = time.perf_counter()
        th.start()
        update_s = gen.update_weights(receiver, version)
        while not any(turn.sampled.versions and turn.sampled.versions[-1] == version for turn in gen.partial()):
            gen.step()
        (kept if keep else pauses).append(time.perf_counter() - t0)
        updates += [] if keep else [update_s]
        th.join()
        gen.interrupt()
    gen.engine.reset_prefix_cache = reset
    out["pause_s"] = statistics.median(pauses)
    out["pause_kept_cache_s"] = statistics.median(kept)
    out["update_s"] = statistics.median(updates)
    out["state_MB"] = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    del torch
    return out


def _state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="S,M,L", help="model sizes for the pause (S, M, L)")
    ap.add_argument("--throughput-sizes", default="S,M", help="model sizes for the throughput comparison")
    ap.add_argument("--groups", type=int, default=32, help="prompt groups")
    ap.add_argument("--n", type=int, default=8, help="turns per prompt")
    ap.add_argument("--max-new", type=int, default=64, help="tokens per turn in the throughput runs")
    ap.add_argument(
        "--depth",
        type=int,
        default=5,
        help="prompt tokens of each turn in flight at a weight update (4 more are sampled first); the prefix "
        "cache only keeps whole blocks, so 'cache kept' means something only with a context of several",
    )
    ap.add_argument("--repeats", type=int, default=5, help="runs per figure (best throughput, median pause)")
    ap.add_argument("--root", default="runs", help="where the models are built (cached)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.throughput_sizes = args.throughput_sizes.split(",")
    if args.depth < 1:
        ap.error(f"--depth must be >= 1 (got {args.depth})")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return
    results = []
    for size in args.sizes.split(","):
        cmd = [sys.executable, __file__, "--child", size, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"size {size} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(line[0][7:]))
        print(f"size {size}: done", file=sys.stderr, flush=True)
    turns = args.groups * args.n
    print(f"\nthroughput: {args.groups} prompts x {args.n} turns = {turns}, up to {args.max_new} tokens each")
    print(f"{'size':<5}{'params':>9}{'plain':>12}{'plain+lp':>12}{'wrapper':>12}{'overhead vs plain+lp':>23}")
    for r in results:
        if "tok_s_wrapper" in r:
            over = 1 - r["tok_s_wrapper"] / r["tok_s_plain_logprobs"]
            print(
                f"{r['size']:<5}{r['params_M']:>8.2f}M{r['tok_s_plain']:>10.0f}/s{r['tok_s_plain_logprobs']:>10.0f}/s"
                f"{r['tok_s_wrapper']:>10.0f}/s{over:>22.1%}"
            )
    print(f"\nweight update with {turns} turns {args.depth} tokens into generation (median of {args.repeats}):")
    print(f"{'size':<5}{'params':>9}{'weights':>10}{'update':>10}{'pause':>10}{'cache kept':>12}{'engine start':>14}")
    for r in results:
        print(
            f"{r['size']:<5}{r['params_M']:>8.2f}M{r['state_MB']:>8.1f}MB{r['update_s']:>9.3f}s{r['pause_s']:>9.3f}s"
            f"{r['pause_kept_cache_s']:>11.3f}s{r['engine_start_s']:>13.1f}s"
        )
    print(
        "update = abort + receive/load + prefix-cache reset + resubmit; pause = abort to first new-version token; "
        "cache kept = the pause had the prefix cache been kept"
    )


if __name__ == "__main__":
    main()
