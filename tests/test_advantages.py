"""GRPO advantages: hand values per mode, equal-reward groups, invariances."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.advantages import group_advantages


def test_group_mode_by_hand():
    # Population std: group [0, 1] has mean 0.5, std 0.5 -> -1, +1 (up to eps).
    adv = group_advantages([0.0, 1.0, 1.0, 0.0, 0.0, 0.0], group_size=2)
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [-1, 1, 1, -1, 0, 0], atol=1e-5)
    # [1, 0, 0, 0]: mean 0.25, std sqrt(3)/4.
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], group_size=4)
    s = np.sqrt(3) / 4
    np.testing.assert_allclose(adv, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rtol=1e-5)


def test_mean_and_batch_modes_by_hand():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5]
    np.testing.assert_allclose(
        group_advantages(rewards, 4, adv_norm="mean"), [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.25, -0.25]
    )
    centred = np.array([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.25, -0.25])
    np.testing.assert_allclose(group_advantages(rewards, 4, adv_norm="batch"), centred / centred.std(), rtol=1e-5)


@pytest.mark.parametrize("adv_norm", ["group", "mean", "batch"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -3.7, 1e6])
def test_equal_rewards_give_exactly_zero(adv_norm, value):
    adv = group_advantages([value] * 6 + [0.0, 1.0, 0.0], group_size=3, adv_norm=adv_norm)
    assert np.all(adv[:6] == 0.0)
    assert np.all(np.isfinite(adv)) and np.any(adv[6:] != 0)
    assert np.all(group_advantages([value] * 8, group_size=4, adv_norm=adv_norm) == 0.0)


def test_accepts_tensors_and_rejects_bad_input():
    np.testing.assert_allclose(group_advantages(torch.tensor([0.0, 1.0]), 2), [-1, 1], atol=1e-5)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="adv_norm"):
        group_advantages([1.0, 2.0], 2, adv_norm="token")
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], 2)


@pytest.mark.parametrize("adv_norm", ["group", "mean", "batch"])
def test_lost_trajectories_drop_out_of_their_groups_statistics(adv_norm):
    """A lost trajectory (NaN reward) gets 0, and its group's others get what they would as a smaller group;
    with nothing lost the result is the same as without `lost`."""
    nan = float("nan")
    rewards = [1.0, nan, 0.0, 0.5, 0.0, 1.0]
    lost = [False, True, False, False, False, False]
    adv = group_advantages(rewards, 3, adv_norm, lost=lost)
    assert adv[1] == 0.0 and np.all(np.isfinite(adv))
    if adv_norm != "batch":  # group by group: the first is the group [1, 0] of two
        np.testing.assert_array_equal(adv[[0, 2]], group_advantages([1.0, 0.0], 2, adv_norm))
        np.testing.assert_array_equal(adv[3:], group_advantages(rewards[3:], 3, adv_norm))
    else:  # the batch's spread is the kept centred values'
        centred = np.array([0.5, -0.5, 0.0, -0.5, 0.5])
        np.testing.assert_allclose(adv[[0, 2, 3, 4, 5]], centred / centred.std(), rtol=1e-5)
    full = [1.0, 0.25, 0.0, 0.5, 0.0, 1.0]
    np.testing.assert_array_equal(
        group_advantages(full, 3, adv_norm, lost=[False] * 6), group_advantages(full, 3, adv_norm)
    )
    with pytest.raises(ValueError, match="every trajectory lost"):
        group_advantages([nan, nan, 1.0, 0.0], 2, adv_norm, lost=[True, True, False, False])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([nan, 1.0], 2, adv_norm, lost=[False, False])


@st.composite
def reward_batches(draw):
    g = draw(st.integers(1, 8))
    n_groups = draw(st.integers(1, 6))
    values = st.sampled_from([0.0, 1.0]) | st.floats(-10, 10)
    return draw(st.lists(values, min_size=g * n_groups, max_size=g * n_groups)), g


@settings(max_examples=150, deadline=None)
@given(batch=reward_batches(), adv_norm=st.sampled_from(["group", "mean", "batch"]))
def test_properties(batch, adv_norm):
    rewards, g = batch
    adv = group_advantages(rewards, g, adv_norm=adv_norm).astype(np.float64).reshape(-1, g)
    assert np.all(np.isfinite(adv))
    # Each group's advantages are centred: the group mean is the baseline in every mode.
    assert np.allclose(adv.sum(axis=1), 0.0, atol=1e-3 * (1 + np.abs(adv).max()))
    # Order within a group follows the rewards.
    r = np.asarray(rewards).reshape(-1, g)
    for rg, ag in zip(r, adv):
        i, j = np.argmax(rg), np.argmin(rg)
        assert ag[i] >= ag[j]
    if adv_norm == "group":
        # Normalised groups have (population) std 1, unless their rewards (nearly) coincide.
        for rg, ag in zip(r, adv):
            if rg.std() > 1e-2:
                assert ag.std() == pytest.approx(1.0, rel=1e-3)
        # Invariant to shifting and positively scaling the rewards of the batch.
        moved = group_advantages(np.asarray(rewards) * 3.0 + 7.0, g).reshape(-1, g)
        for rg, ag, mg in zip(r, adv, moved):
            if rg.std() > 1e-2:
                np.testing.assert_allclose(mg, ag, rtol=1e-3, atol=1e-3)
