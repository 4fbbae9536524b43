"""Dynamic micro-batches: pack variable-length sequences under a token budget.

Reasoning-model responses are long-tailed (most short, a tail at the generation limit), so a
fixed number of sequences per micro-batch either overflows memory or wastes most of it on padding.
Packing instead fills each micro-batch up to `max_tokens_per_mb` tokens (packed sequences share a
micro-batch without attending to each other), using as few micro-batches as it can:

    lower bound  LB = #(l > budget) + max(ceil(sum(l <= budget) / budget), #(budget/2 < l <= budget))
    k*           the smallest k >= max(LB, min_mbs) for which a packing into k micro-batches is found,
                 never more than best-fit decreasing (BFD) uses

For each k from the lower bound up, sequences sorted longest first go to the least-loaded
micro-batch (balanced token counts) while they fit; BFD (sorted longest first, each into the
fullest micro-batch it still fits in, a new one if none) is the fallback and the upper bound.
A sequence longer than the budget gets a micro-batch of its own.

`split_for_dp` splits a minibatch across data-parallel ranks: the same number of micro-batches on
every rank (a collective step per micro-batch), tokens balanced across ranks.

Pure Python on ints with heapq/bisect; 8,192 sequences take a few tens of milliseconds
(tools/bench_packing.py).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort

_SHIFT = 32  # heap/bisect keys pack (tokens, bin index) into one int: tokens << _SHIFT | index
_INDEX = (1 << _SHIFT) - 1
_BALANCED_TRIES = 4  # counts k tried below BFD's; beyond a few, the balanced heuristic never wins


def pack_microbatches(lengths, max_tokens_per_mb: int, min_mbs: int = 1) -> list[list[int]]:
    """Indices of the sequences of each micro-batch; every index exactly once.

    No micro-batch holds more than `max_tokens_per_mb` tokens unless it holds one sequence that
    alone is longer. The count is the smallest k >= max(min_mbs, lower bound) for which a packing
    is found, at most what best-fit decreasing uses (when min_mbs asks for more, BFD's micro-
    batches are split). A micro-batch is empty only when there are fewer sequences than min_mbs.
    Micro-batches come heaviest first; within one, indices come longest first.
    """
    lens = _check(lengths, max_tokens_per_mb, min_mbs)
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    return _pack(order, lens, max_tokens_per_mb, min_mbs)


def split_for_dp(lengths, dp: int, max_tokens_per_mb: int, min_mbs: int = 1) -> list[list[list[int]]]:
    """`result[r][j]`: indices (into `lengths`) of micro-batch j of data-parallel rank r.

    Every rank gets the same number m of micro-batches (at least `min_mbs`, e.g. the pipeline
    size), each within the budget as in `pack_microbatches`; m is as small as found and tokens
    are balanced across ranks. Two candidates, the better (smaller m, then smaller largest rank
    load) wins: (a) pack everything, round the count up to a multiple of dp, deal the micro-batches
    heaviest first to the lightest rank with room; (b) deal the sequences longest first to the
    lightest rank, pack each rank, split micro-batches on ranks with fewer than the most.
    """
    if dp < 1:
        raise ValueError(f"dp must be at least 1 (got {dp})")
    lens = _check(lengths, max_tokens_per_mb, min_mbs)
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    candidates = [_split_bins_first(order, lens, dp, max_tokens_per_mb, min_mbs)]
    if dp > 1:
        candidates.append(_split_sequences_first(order, lens, dp, max_tokens_per_mb, min_mbs))

    def cost(split):
        return len(split[0]), max(sum(lens[i] for mb in rank for i in mb) for rank in split)

    return min(candidates, key=cost)


# --- one set of sequences ----------------------------------------------------------------------


def _check(lengths, budget: int, min_mbs: int) -> list[int]:
    if budget < 1:
        raise ValueError(f"max_tokens_per_mb must be at least 1 (got {budget})")
    if min_mbs < 1:
        raise ValueError(f"min_mbs must be at least 1 (got {min_mbs})")
    lens = [int(x) for x in lengths]
    if lens and min(lens) < 0:
        raise ValueError("sequence lengths must be >= 0")
    return lens


def lower_bound(lengths, max_tokens_per_mb: int) -> int:
    """No packing uses fewer micro-batches: sequences over the budget each need their own, the
    rest need ceil(sum / budget), and no two sequences longer than half the budget can share."""
    budget = max_tokens_per_mb
    over = sum(1 for x in lengths if x > budget)
    fit = [x for x in lengths if x <= budget]
    halves = sum(1 for x in fit if 2 * x > budget)
    return over + max(math.ceil(sum(fit) / budget), halves)


def _pack(order: list[int], lens: list[int], budget: int, min_mbs: int) -> list[list[int]]:
    """`order`: indices sorted longest first."""
    bfd = _best_fit_decreasing(order, lens, budget)
    k_lo = max(min_mbs, lower_bound([lens[i] for i in order], budget))
    k_hi = max(k_lo, min(len(bfd), k_lo + _BALANCED_TRIES - 1))
    for k in range(k_lo, k_hi + 1):
        bins = _balanced(order, lens, budget, k)
        if bins is not None:
            return _heaviest_first(bins, lens)
    if len(bfd) >= k_lo:
        return _heaviest_first(bfd, lens)
    return _heaviest_first(_split_to(bfd, k_lo, lens), lens)


def _best_fit_decreasing(order: list[int], lens: list[int], budget: int) -> list[list[int]]:
    """Each sequence, longest first, into the fullest micro-batch it fits in (a new one if none)."""
    bins: list[list[int]] = []
    free: list[int] = []  # sorted keys: remaining tokens << _SHIFT | bin, of bins with room left
    for i in order:
        n = lens[i]
        pos = bisect_left(free, n << _SHIFT) if n <= budget else len(free)
        if pos < len(free):
            key = free.pop(pos)
            b = key & _INDEX
            remaining = (key >> _SHIFT) - n
        else:
            b = len(bins)
            bins.append([])
            remaining = budget - n
        bins[b].append(i)
        if remaining > 0:
            insort(free, remaining << _SHIFT | b)
    return bins


def _balanced(order: list[int], lens: list[int], budget: int, k: int) -> list[list[int]] | None:
    """Longest first into the least-loaded of k micro-batches (of those, the one with the fewest
    sequences: zero-length ones spread too); None if one would overflow."""
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = list(range(k))  # keys: (load << _SHIFT | count) << _SHIFT | bin (all 0: already a heap)
    for i in order:
        key = heap[0]
        load, b = key >> (2 * _SHIFT), key & _INDEX
        n = lens[i]
        if load + n > budget and load > 0:
            return None
        bins[b].append(i)
        heapq.heapreplace(heap, ((load + n) << _SHIFT | len(bins[b])) << _SHIFT | b)
    return bins


def _split_to(bins: list[list[int]], k: int, lens: list[int]) -> list[list[int]]:
    """Split micro-batches (heaviest with >= 2 sequences first, in two balanced halves) until
    there are k; a part of a micro-batch stays within the budget. Empty ones if sequences run out."""
    bins = [list(b) for b in bins]
    heap = [(-sum(lens[i] for i in b), j) for j, b in enumerate(bins) if len(b) >= 2]
    heapq.heapify(heap)
    while len(bins) < k:
        if not heap:
            bins.append([])
            continue
        _, j = heapq.heappop(heap)
        halves: list[list[int]] = [[], []]
        loads = [0, 0]
        for i in sorted(bins[j], key=lens.__getitem__, reverse=True):
            h = 0 if loads[0] <= loads[1] else 1
            halves[h].append(i)
            loads[h] += lens[i]
        bins[j] = halves[0]
        bins.append(halves[1])
        for idx in (j, len(bins) - 1):
            if len(bins[idx]) >= 2:
                heapq.heappush(heap, (-sum(lens[i] for i in bins[idx]), idx))
    return bins


def _exactly(order: list[int], lens: list[int], budget: int, k: int, fewer: list[list[int]]) -> list[list[int]]:
    """Exactly k micro-batches, balanced if possible, else by splitting `fewer` (a packing into <= k)."""
    bins = _balanced(order, lens, budget, k)
    if bins is None:
        bins = _split_to(fewer, k, lens)
    return _heaviest_first(bins, lens)


def _heaviest_first(bins: list[list[int]], lens: list[int]) -> list[list[int]]:
    return sorted(bins, key=lambda b: -sum(lens[i] for i in b))


# --- across data-parallel ranks ----------------------------------------------------------------


def _split_bins_first(order, lens, dp, budget, min_mbs) -> list[list[list[int]]]:
    """Pack all, round up to a multiple of dp, deal micro-batches to the lightest rank with room."""
    packed = _pack(order, lens, budget, dp * min_mbs)
    m = math.ceil(len(packed) / dp)
    bins = packed if len(packed) == dp * m else _exactly(order, lens, budget, dp * m, packed)
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    heap = [(0, r) for r in range(dp)]  # (tokens, rank) of ranks with fewer than m micro-batches
    for b in bins:  # heaviest first
        load, r = heapq.heappop(heap)
        ranks[r].append(b)
        if len(ranks[r]) < m:
            heapq.heappush(heap, (load + sum(lens[i] for i in b), r))
    return ranks


def _split_sequences_first(order, lens, dp, budget, min_mbs) -> list[list[list[int]]]:
    """Deal sequences longest first to the lightest rank, pack each, equalise the counts."""
    members: list[list[int]] = [[] for _ in range(dp)]  # global indices, longest first
    heap = [(0, r) for r in range(dp)]
    for i in order:
        load, r = heap[0]
        members[r].append(i)
        heapq.heapreplace(heap, (load + lens[i], r))
    packed = [_pack(mine, lens, budget, min_mbs) for mine in members]
    m = max(len(p) for p in packed)
    return [p if len(p) == m else _exactly(mine, lens, budget, m, p) for p, mine in zip(packed, members)]
