"""GRPO advantages: each trajectory is scored against the other trajectories to the same prompt.

With `group_size` trajectories per prompt, laid out group after group (the order the controller builds
its batch in), and r_i the reward of trajectory i in group g:

    adv_norm="group":  A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        GRPO
    adv_norm="mean":   A_i =  r_i - mean_g(r)                             centring only (Dr. GRPO)
    adv_norm="batch":  A_i = (r_i - mean_g(r)) / (std_batch(c) + eps)     c = the centred values

The group mean is the baseline in every mode: it is what makes the method critic-free. "batch"
scales by the spread of the centred values over the whole batch, so a group whose rewards barely
differ is not blown up to unit scale. Every std is the population std (ddof = 0): with two trajectories
scored 0 and 1 the advantages are -1 and +1 (up to eps). A group of equal rewards has advantage
exactly 0 in every mode (it carries no signal), never NaN.

A lost trajectory (an episode whose workflow raised: `lost`) has no reward: the means and stds above
run over the group's other trajectories, and its advantage is 0 (it is not trained).

The advantage of a trajectory applies to every sampled token of its episode, in every sequence of it
(the controller broadcasts it).
"""

from __future__ import annotations

import numpy as np

ADV_NORMS = ("group", "mean", "batch")
"""The values of `ppo.adv_norm`: the three formulas above (the config imports this list)."""


def group_advantages(rewards, group_size: int, adv_norm: str = "group", eps: float = 1e-6, lost=None) -> np.ndarray:
    """Advantages of a batch of trajectories, `group_size` consecutive trajectories per prompt.

        group: A = (r - mean(group)) / (std(group) + eps)
        mean:  A =  r - mean(group)
        batch: A = (r - mean(group)) / (std(all centred values) + eps)

    `rewards`: array-like [n_groups * group_size] (a list, numpy array or CPU tensor). `adv_norm`
    takes the values of the config field `ppo.adv_norm`. `lost`: None, or bools like `rewards`: those
    trajectories' rewards are ignored (they may be NaN) and every statistic runs over the others; each
    group needs one not lost. Returns float32 [n_groups * group_size], 0 where lost.
    std is the population std (ddof = 0). Groups whose rewards are all equal get exactly 0.
    """
    if adv_norm not in ADV_NORMS:
        raise ValueError(f"adv_norm must be one of {', '.join(ADV_NORMS)} (got {adv_norm!r})")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1 (got {group_size})")
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    groups = r.reshape(-1, group_size)  # [n_groups, group_size]
    keep = True if lost is None else ~np.asarray(lost, bool).reshape(groups.shape)  # [n_groups, group_size]
    kept = groups[np.broadcast_to(keep, groups.shape)]
    if not np.all(np.isfinite(kept)):
        raise ValueError(f"rewards must be finite (got {kept[~np.isfinite(kept)][:4].tolist()} ...)")
    if lost is not None and not keep.any(axis=1).all():
        raise ValueError("a group has every trajectory lost: it has no advantages (leave it out)")
    centred = np.where(keep, groups - groups.mean(axis=1, keepdims=True, where=keep), 0.0)
    # mean() of equal floats is not always that float (0.1 * 3 / 3 != 0.1): zero such groups
    # explicitly so they carry exactly no signal instead of a rounding error scaled up by 1/eps.
    uniform = np.where(keep, groups, -np.inf).max(axis=1) == np.where(keep, groups, np.inf).min(axis=1)
    centred[uniform] = 0.0
    if adv_norm == "group":
        adv = centred / (groups.std(axis=1, keepdims=True, where=keep) + eps)
    elif adv_norm == "batch":
        adv = centred / (centred[np.broadcast_to(keep, groups.shape)].std() + eps)
    else:
        adv = centred
    return adv.reshape(-1).astype(np.float32)
