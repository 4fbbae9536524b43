"""One training step's data: prompt groups -> advantages -> packed micro-batches per data-parallel rank.

```
 groups (B x n trajectories) --group_advantages--> A per trajectory, broadcast to its response tokens
        |
        +-- PPO minibatches: the groups split into `ppo.minibatches` contiguous parts
              +-- split_for_dp: each minibatch's sequences over the DP ranks, tokens balanced, the
                    same number of micro-batches on every rank, each under ppo.max_tokens_per_mb
        -> one TrainBatch per DP rank: its sequences concatenated, microbatches[k][j] = local
           indices of micro-batch j of minibatch k
```

A sequence is prompt + response; the loss mask, behaviour logprobs, advantages and versions are 0
(or -1 for versions) on prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from areal_hpc.algo.advantages import group_advantages
from areal_hpc.packing import split_for_dp
from areal_hpc.protocol import TrainBatch
from areal_hpc.rollouts import Group


@dataclass
class BatchInfo:
    """What the step's metrics need from the data it trains on."""

    reward_mean: float
    response_tokens: int
    sequences: int
    truncated: int = 0
    """Trajectories cut at the token limit (`finish_reason == "length"`)."""


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
    (step `version + 1`). With
    `mask_truncated`, a trajectory cut at the token limit has loss mask 0 on every token (`ppo.mask_truncated`)."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = np.array([r for g in groups for r in g.rewards], np.float64)
    adv = group_advantages(rewards, groups[0].n, adv_norm)  # [S]
    seqs = []
    owners = [g for g in groups for _ in range(g.n)]  # the group of each sequence
    for i, (g, t) in enumerate(zip(owners, trajs)):
        prompt_ids = g.example.prompt_ids
        p, r = len(prompt_ids), len(t.output_ids)
        trained = not (mask_truncated and t.finish_reason == "length")
        seqs.append(
            {
                "tokens": np.concatenate([prompt_ids, t.output_ids]).astype(np.int32),
                "loss_mask": np.concatenate([np.zeros(p, np.uint8), np.full(r, trained, np.uint8)]),
                "behav_logprobs": np.concatenate([np.zeros(p, np.float32), t.behav_logprobs.astype(np.float32)]),
                "advantages": np.concatenate([np.zeros(p, np.float32), np.full(r, adv[i], np.float32)]),
                "versions": np.concatenate([np.full(p, -1, np.int32), t.versions.astype(np.int32)]),
            }
        )
    lengths = [len(s["tokens"]) for s in seqs]

    # PPO minibatches by whole groups (a group's trajectories are scored against each other), then each
    # minibatch over the DP ranks.
    group_parts = np.array_split(np.arange(len(groups)), minibatches)
    local: list[list[int]] = [[] for _ in range(dp)]  # global sequence indices held by each DP rank
    mbs: list[list[list[int]]] = [[] for _ in range(dp)]  # [rank][minibatch][micro-batch] -> local idx
    for part in group_parts:
        members = [gi * groups[0].n + j for gi in part for j in range(groups[0].n)]
        split = split_for_dp([lengths[i] for i in members], dp, max_tokens_per_mb, min_mbs)
        for r in range(dp):
            micro = []
            for mb in split[r]:
                micro.append([len(local[r]) + k for k in range(len(mb))])
                local[r].extend(members[i] for i in mb)
            mbs[r].append(micro)

    batches = []
    for r in range(dp):
        mine = [seqs[i] for i in local[r]]
        cu = np.zeros(len(mine) + 1, np.int32)
        cu[1:] = np.cumsum([len(s["tokens"]) for s in mine])

        def cat(key, dtype, mine=mine):
            return np.concatenate([s[key] for s in mine]).astype(dtype) if mine else np.zeros(0, dtype)

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
            )
        )
    info = BatchInfo(
        reward_mean=float(rewards.mean()),
        response_tokens=sum(len(t.output_ids) for t in trajs),
        sequences=len(seqs),
        truncated=sum(t.finish_reason == "length" for t in trajs),
    )
    return batches, info
