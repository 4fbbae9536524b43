"""The micro-batch packer: validity, count against the bounds, data-parallel split."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.packing import _best_fit_decreasing, lower_bound, pack_microbatches, split_for_dp

SETTINGS = settings(max_examples=150, deadline=None)

lengths_st = st.lists(st.integers(0, 300), min_size=0, max_size=60)


def bfd_count(lengths, budget):
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    return len(_best_fit_decreasing(order, list(lengths), budget))


def assert_valid(mbs, lengths, budget):
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lengths))), "every index exactly once"
    for mb in mbs:
        tokens = sum(lengths[i] for i in mb)
        assert tokens <= budget or len(mb) == 1, f"micro-batch {mb} has {tokens} > {budget} tokens"


def optimum(lengths, budget):
    """Fewest bins, by brute force over assignments (tiny inputs only)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for x, b in zip(lengths, assign):
                loads[b] += x
            if max(loads) <= budget:
                return k
    return 0


def test_hand_cases():
    # The balanced pass fails at k=2 (5+4 | 5+3, the last 3 fits nowhere), best fit finds 5+5 | 4+3+3.
    mbs = pack_microbatches([5, 5, 4, 3, 3], 10)
    assert sorted(sorted(mb) for mb in mbs) == [[0, 1], [2, 3, 4]]
    # A sequence over the budget sits alone; the others pack around it.
    mbs = pack_microbatches([25, 4, 4, 4], 10)
    assert len(mbs) == 3 and [0] in mbs
    assert_valid(mbs, [25, 4, 4, 4], 10)
    # Exactly the budget, and zero-length sequences.
    assert len(pack_microbatches([10, 10, 0, 0], 10)) == 2
    assert pack_microbatches([], 10) == [[]]


def test_long_tail_reaches_the_lower_bound():
    rng = np.random.default_rng(0)
    resp = np.minimum(rng.lognormal(6, 1, 2048).astype(int) + 1, 4096)
    resp[rng.random(2048) < 0.15] = 4096  # the tail cut at the generation limit
    lengths = (resp + rng.integers(50, 300, 2048)).tolist()
    mbs = pack_microbatches(np.array(lengths), 16384)
    assert_valid(mbs, lengths, 16384)
    assert len(mbs) <= lower_bound(lengths, 16384) + 1
    assert len(mbs) <= bfd_count(lengths, 16384)


@SETTINGS
@given(lengths=lengths_st, budget=st.integers(1, 400), min_mbs=st.integers(1, 5))
def test_packing_properties(lengths, budget, min_mbs):
    mbs = pack_microbatches(lengths, budget, min_mbs=min_mbs)
    assert_valid(mbs, lengths, budget)
    assert len(mbs) >= max(min_mbs, lower_bound(lengths, budget))
    assert len(mbs) <= max(min_mbs, bfd_count(lengths, budget))
    if len(lengths) >= min_mbs:
        assert all(mbs), "no empty micro-batch while there are enough sequences"
    if len(lengths) >= 1:
        assert len(mbs) >= 1


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=7), budget=st.integers(10, 14))
def test_close_to_optimum(lengths, budget):
    # Never worse than BFD's worst-case guarantee against the true optimum, 11/9 OPT + 6/9.
    opt = optimum(lengths, budget)
    assert len(pack_microbatches(lengths, budget)) <= (11 * opt + 6) // 9


@SETTINGS
@given(lengths=lengths_st, budget=st.integers(50, 400), dp=st.integers(1, 4), min_mbs=st.integers(1, 3))
def test_split_for_dp_properties(lengths, budget, dp, min_mbs):
    split = split_for_dp(lengths, dp, budget, min_mbs=min_mbs)
    assert len(split) == dp
    m = len(split[0])
    assert all(len(rank) == m for rank in split), "same micro-batch count on every rank"
    assert m >= min_mbs
    assert_valid([mb for rank in split for mb in rank], lengths, budget)
    # Never more micro-batches per rank than packing everything and dealing them out round-robin.
    assert m <= -(-pack_count_at_least(lengths, budget, dp * min_mbs) // dp)
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in split]
    assert max(loads) - min(loads) <= max([budget, *lengths])


def pack_count_at_least(lengths, budget, k):
    return len(pack_microbatches(lengths, budget, min_mbs=k))


def test_split_for_dp_balances_long_tail():
    rng = np.random.default_rng(1)
    resp = np.minimum(rng.lognormal(6, 1, 1024).astype(int) + 1, 4096)
    resp[rng.random(1024) < 0.15] = 4096
    lengths = (resp + rng.integers(50, 300, 1024)).tolist()
    split = split_for_dp(lengths, 4, 16384, min_mbs=2)
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in split]
    assert max(loads) / min(loads) < 1.01
    assert len(split[0]) <= -(-lower_bound(lengths, 16384) // 4) + 1


def test_bad_arguments():
    with pytest.raises(ValueError):
        pack_microbatches([1, 2], 0)
    with pytest.raises(ValueError):
        pack_microbatches([1, -2], 10)
    with pytest.raises(ValueError):
        split_for_dp([1, 2], 0, 10)
