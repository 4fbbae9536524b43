"""One training step's data: prompt groups -> advantages -> packed micro-batches per data-parallel rank.

```
 groups (B x n episodes) --group_advantages--> A per episode (lost ones left out), broadcast to its sampled
        |                                      tokens in every sequence of it
        +-- PPO minibatches: the groups split into `ppo.minibatches` contiguous parts (a group's sequences
              stay together: its episodes are scored against each other)
              +-- split_for_dp: each minibatch's sequences over the DP ranks, tokens balanced, the
                    same number of micro-batches on every rank, each under ppo.max_tokens_per_mb
        -> one TrainBatch per DP rank: its sequences concatenated, microbatches[k][j] = local
           indices of micro-batch j of minibatch k
```

A training sequence is one sequence of an episode (`Trajectory.seq_lens` cuts them; most episodes have
one) exactly as the engine saw it. The loss mask is the episode's (1 on sampled tokens); behaviour
logprobs and advantages are 0, versions -1, on context tokens (prompt, tool output, template text). With
routing replay, `TrainBatch.routing` follows the tokens (each episode's `Trajectory.routing`; an episode
without one, e.g. from a checkpoint written before, is unknown throughout: the trainer routes it itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from areal_hpc.algo.advantages import group_advantages
from areal_hpc.controller.rollouts import Group
from areal_hpc.metrics import length_summary
from areal_hpc.packing import split_for_dp
from areal_hpc.protocol import TrainBatch, Trajectory, routing_unknown


@dataclass
class BatchInfo:
    """What the step's metrics need from the data it trains on: its episodes (lost ones left out)."""

    reward_mean: float
    response_tokens: int
    """Sampled tokens (loss mask 1 before `ppo.mask_truncated`)."""
    sequences: int
    truncated: int = 0
    """Episodes cut at a token limit (`finish_reason == "length"`)."""
    turns_mean: float = 0.0
    tool_calls_mean: float = 0.0
    tool_s_mean: float = 0.0
    """Seconds per tool call (0 without calls)."""
    episode_tokens_mean: float = 0.0
    """Tokens of an episode, all its sequences."""
    resumed_tokens: int = 0
    """Sampled tokens carried over from before a checkpoint the run resumed from (areal_hpc.generator.resume)."""
    answer_lengths: list = field(default_factory=list)
    """The tokens sampled in each episode, all its turns (loss mask 1 before `ppo.mask_truncated`): the
    lengths of the answers the policy wrote."""

    @property
    def answer_tokens(self) -> dict:
        """`length_summary` of `answer_lengths` ({} without episodes)."""
        return length_summary(self.answer_lengths) if self.answer_lengths else {}


def build_train_batches(
    groups: list[Group],
    version: int,
    dp: int,
    minibatches: int,
    max_tokens_per_mb: int,
    adv_norm: str = "group",
    min_mbs: int = 1,
    mask_truncated: bool = False,
) -> tuple[list[TrainBatch], BatchInfo]:
    """`batches[r]` is data-parallel rank r's TrainBatch for the step from policy version `version`
    (step `version + 1`). With `mask_truncated`, an episode cut at a token limit has loss mask 0 on every
    token (`ppo.mask_truncated`). Every group has an episode not lost (Rollouts leaves the others out)."""
    n = groups[0].n
    lost = [x for g in groups for x in g.lost]
    rewards = [float("nan") if x else r for g in groups for r, x in zip(g.rewards, g.lost)]
    adv = group_advantages(rewards, n, adv_norm, lost=lost)  # [B * n]
    routed = _routing_layout(groups)
    seqs = []
    members: list[list[int]] = []  # per group: its sequences' indices
    for gi, g in enumerate(groups):
        members.append([])
        for j, t in enumerate(g.trajectories):
            if t.error:
                continue
            trained = not (mask_truncated and t.finish_reason == "length")
            for seq in _sequences(t, trained, adv[gi * n + j], routed):
                members[-1].append(len(seqs))
                seqs.append(seq)
    lengths = [len(s["tokens"]) for s in seqs]

    # PPO minibatches by whole groups, then each minibatch over the DP ranks.
    group_parts = np.array_split(np.arange(len(groups)), minibatches)
    local: list[list[int]] = [[] for _ in range(dp)]  # global sequence indices held by each DP rank
    mbs: list[list[list[int]]] = [[] for _ in range(dp)]  # [rank][minibatch][micro-batch] -> local idx
    for part in group_parts:
        part_seqs = [i for gi in part for i in members[gi]]
        split = split_for_dp([lengths[i] for i in part_seqs], dp, max_tokens_per_mb, min_mbs)
        for r in range(dp):
            micro = []
            for mb in split[r]:
                micro.append([len(local[r]) + k for k in range(len(mb))])
                local[r].extend(part_seqs[i] for i in mb)
            mbs[r].append(micro)

    batches = []
    for r in range(dp):
        mine = [seqs[i] for i in local[r]]
        cu = np.zeros(len(mine) + 1, np.int32)
        cu[1:] = np.cumsum([len(s["tokens"]) for s in mine])

        def cat(key, dtype, mine=mine):
            return np.concatenate([s[key] for s in mine]).astype(dtype) if mine else np.zeros(0, dtype)

        routing = None
        if routed is not None:
            dtype, shape = routed
            routing = np.concatenate([np.zeros((0, *shape), dtype)] + [s["routing"] for s in mine])

        batches.append(
            TrainBatch(
                version=version,
                tokens=cat("tokens", np.int32),
                cu_seqlens=cu,
                loss_mask=cat("loss_mask", np.uint8),
                behav_logprobs=cat("behav_logprobs", np.float32),
                advantages=cat("advantages", np.float32),
                versions=cat("versions", np.int32),
                microbatches=mbs[r],
                routing=routing,
            )
        )
    return batches, _info([t for g in groups for t in g.trajectories if not t.error], rewards, lost, len(seqs))


def _routing_layout(groups: list[Group]) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The dtype and [L, K] of the episodes' routing; None when none carries routing (no routing replay)."""
    for g in groups:
        for t in g.trajectories:
            if not t.error and t.routing is not None:
                return t.routing.dtype, t.routing.shape[1:]
    return None


def _sequences(t: Trajectory, trained: bool, advantage: float, routed=None) -> list[dict]:
    """The training sequences of episode `t`: its arrays cut at `seq_lens`; the advantage on its sampled
    tokens (kept even where `trained` is False and the loss mask is 0: the episode still counted in its
    group); its routing when the batch has routing (`routed`: `_routing_layout`), unknown if it has none."""
    sampled = t.loss_mask.astype(bool)
    if routed is not None:
        dtype, shape = routed
        routing = (
            t.routing if t.routing is not None else np.full((len(t.tokens), *shape), routing_unknown(dtype), dtype)
        )
    arrays = {
        "tokens": t.tokens.astype(np.int32),
        "loss_mask": (sampled & trained).astype(np.uint8),
        "behav_logprobs": t.behav_logprobs.astype(np.float32),
        "advantages": np.where(sampled, advantage, 0).astype(np.float32),
        "versions": t.versions.astype(np.int32),
        **({"routing": routing} if routed is not None else {}),
    }
    cuts = np.cumsum(t.seq_lens)[:-1]
    return [dict(zip(arrays, parts)) for parts in zip(*(np.split(a, cuts) for a in arrays.values()))]


def _info(episodes: list[Trajectory], rewards: list[float], lost: list[bool], sequences: int) -> BatchInfo:
    def stat(name):
        return np.array([t.stats.get(name, 0) for t in episodes], np.float64)

    calls = stat("tool_calls").sum()
    return BatchInfo(
        reward_mean=float(np.mean([r for r, x in zip(rewards, lost) if not x])),
        response_tokens=int(sum(int(t.loss_mask.sum()) for t in episodes)),
        sequences=sequences,
        truncated=sum(t.finish_reason == "length" for t in episodes),
        turns_mean=float(stat("turns").mean()),
        tool_calls_mean=float(stat("tool_calls").mean()),
        tool_s_mean=float(stat("tool_s").sum() / calls) if calls else 0.0,
        episode_tokens_mean=float(np.mean([len(t.tokens) for t in episodes])),
        resumed_tokens=int(stat("resumed_tokens").sum()),
        answer_lengths=[int(t.loss_mask.sum()) for t in episodes],
    )
