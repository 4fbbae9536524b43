#!/usr/bin/env python
"""Benchmark the micro-batch packer on reasoning-model length distributions.

    python tools/bench_packing.py                      # the default table
    python tools/bench_packing.py --n 8192 --budget 32768 --limit 16384 --dp 8

Lengths are prompt + response. Responses are long-tailed like a reasoning model's: log-normal
around a fraction of the generation limit, plus a share cut off at the limit (trajectories that ran
out of tokens). For each case it prints the micro-batches used against the lower bound
ceil(sum / budget), what best-fit decreasing alone would use, the data-parallel split, what a
fixed-size batch would need (as many sequences per micro-batch as fit when every one may reach
the limit, each padded to the longest of its micro-batch) and the share of it that is padding,
and the time per call.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from areal_hpc.packing import _best_fit_decreasing, lower_bound, pack_microbatches, split_for_dp

# name: (median response as a share of the limit, log-normal sigma, share truncated at the limit)
DISTRIBUTIONS = {
    "reasoning": (0.15, 1.0, 0.10),
    "heavy-tail": (0.25, 1.2, 0.30),
    "short": (0.05, 0.6, 0.01),
}


def sample_lengths(kind: str, n: int, limit: int, rng: np.random.Generator) -> list[int]:
    median, sigma, cut = DISTRIBUTIONS[kind]
    resp = rng.lognormal(np.log(median * limit), sigma, n).astype(np.int64) + 1
    resp[rng.random(n) < cut] = limit
    resp = np.minimum(resp, limit)
    prompt = rng.integers(64, 512, n)
    return (resp + prompt).tolist()


def timed(fn, args: tuple, repeats: int) -> tuple[object, float]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def fixed_batching(lengths: list[int], budget: int, max_len: int) -> tuple[int, float]:
    """Micro-batches and padding share of fixed-size batches of budget // max_len sequences."""
    per_mb = max(1, budget // max_len)
    n_mbs = math.ceil(len(lengths) / per_mb)
    padded = sum(max(lengths[i : i + per_mb]) * len(lengths[i : i + per_mb]) for i in range(0, len(lengths), per_mb))
    return n_mbs, 1.0 - sum(lengths) / padded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[512, 2048, 8192], help="sequences per call")
    p.add_argument("--budget", type=int, default=65536, help="max_tokens_per_mb")
    p.add_argument("--limit", type=int, default=8192, help="generation limit (max_new_tokens)")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks for split_for_dp")
    p.add_argument("--kinds", nargs="+", default=list(DISTRIBUTIONS), choices=list(DISTRIBUTIONS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    max_len = args.limit + 512  # longest possible sequence: the fixed batch must fit it

    per_mb = max(1, args.budget // max_len)
    print(f"budget {args.budget} tokens/micro-batch, generation limit {args.limit}, dp {args.dp}")
    header = (
        f"{'dist':<11}{'n':>6}{'tokens':>11}{'LB':>6}{'LB2':>6}{'packed':>7}{'BFD':>6}"
        f"{'dp x mbs':>10}{'dp imbal':>9}{'fixed':>7}{'pad%':>6}{'pack ms':>9}{'split ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for kind in args.kinds:
        for n in args.n:
            lengths = sample_lengths(kind, n, args.limit, rng)
            total = sum(lengths)
            lb = math.ceil(total / args.budget)
            mbs, t_pack = timed(pack_microbatches, (lengths, args.budget), args.repeats)
            order = sorted(range(n), key=lengths.__getitem__, reverse=True)
            bfd = len(_best_fit_decreasing(order, lengths, args.budget))
            split, t_split = timed(split_for_dp, (lengths, args.dp, args.budget), args.repeats)
            loads = [sum(lengths[i] for mb in rank for i in mb) for rank in split]
            imbalance = max(loads) / (total / args.dp) - 1
            fixed, pad = fixed_batching(lengths, args.budget, max_len)
            print(
                f"{kind:<11}{n:>6}{total:>11}{lb:>6}{lower_bound(lengths, args.budget):>6}{len(mbs):>7}{bfd:>6}"
                f"{f'{args.dp}x{len(split[0])}':>10}{imbalance:>8.2%} {fixed:>6}{pad:>6.0%}"
                f"{t_pack * 1e3:>9.1f}{t_split * 1e3:>9.1f}"
            )
    print(
        "\nLB = ceil(sum / budget); LB2 = packing.lower_bound (also counts sequences over half the budget); packed = pack_microbatches; BFD = best-fit decreasing alone; "
        "dp x mbs = split_for_dp;\ndp imbal = heaviest rank over the mean; fixed = micro-batches of "
        f"{per_mb} sequences padded to their longest; pad% = its padding share; "
        f"times: median of {args.repeats} calls."
    )


if __name__ == "__main__":
    main()
