"""The trainer checks' inputs (their models: tests/support/shapes.py): random TrainBatches with the
fields a PPO step reads, one data-parallel rank's shard of a batch, the probe sequences whose logits
the checks compare, `random_norms`, which makes a built model's norms (and router) tell their
tensors apart, and `revealing_optim`, the optimizer settings under which a step's weights show its gradient.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from areal_hpc.protocol import TrainBatch

VERSION = 3


def revealing_optim(**settings):
    """PPOConfig for the step checks (and `settings`): Adam with eps = 1 makes the update ~ lr x the gradient,
    so the weights after a step show any gradient error."""
    from areal_hpc.config import PPOConfig

    return PPOConfig(lr=1.0, weight_decay=0.0, adam_eps=1.0, grad_clip=1.0, **settings)


MICROBATCHES = [[[0, 1], [2]], [[3], [4, 5]]]
"""Two PPO minibatches of two micro-batches each, over six sequences."""
PROBE_LENGTHS = (7, 13, 4)


def random_batch(vocab: int, n_seqs: int = 6, seed: int = 0, microbatches=MICROBATCHES) -> TrainBatch:
    """Random sequences: prompt tokens (version -1), response tokens of versions VERSION-1 and VERSION,
    random behaviour logprobs and advantages."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(6, 20, n_seqs)
    parts = {k: [] for k in ("tokens", "mask", "behav", "adv", "versions")}
    for n in lens:
        prompt = int(rng.integers(2, 5))
        mask = np.zeros(n, np.uint8)
        mask[prompt:] = 1
        parts["tokens"].append(rng.integers(0, vocab, n))
        parts["mask"].append(mask)
        parts["behav"].append(np.where(mask, -rng.random(n) * 3 - 3, 0))
        parts["adv"].append(np.where(mask, rng.normal(size=n), 0))
        parts["versions"].append(np.where(mask, rng.integers(VERSION - 1, VERSION + 1, n), -1))
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    return TrainBatch(
        VERSION,
        cat["tokens"].astype(np.int32),
        np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        cat["mask"],
        cat["behav"].astype(np.float32),
        cat["adv"].astype(np.float32),
        cat["versions"].astype(np.int32),
        microbatches=microbatches,
    )


def shard(batch: TrainBatch, seqs: list[int], microbatches: list) -> TrainBatch:
    """The TrainBatch of sequences `seqs` (renumbered 0..): what one data-parallel rank receives."""
    cu = batch.cu_seqlens
    take = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seqs])
    lens = [cu[i + 1] - cu[i] for i in seqs]
    new = {old: j for j, old in enumerate(seqs)}
    return TrainBatch(
        batch.version,
        batch.tokens[take],
        np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        batch.loss_mask[take],
        batch.behav_logprobs[take],
        batch.advantages[take],
        batch.versions[take],
        microbatches=[[[new[i] for i in mb] for mb in k] for k in microbatches],
    )


def probe_sequences(vocab: int) -> list[torch.Tensor]:
    """Three token sequences of different lengths, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROBE_LENGTHS]


def random_norms(model_dir: Path, seed: int, router_std: float = 0.0) -> None:
    """Every RMSNorm weight of the model's safetensors 1 + noise: transformers initializes them all to one,
    under which two norms swapped by the conversion (q_norm and k_norm, say) would give the same logits.
    `router_std` > 0: also a MoE router's gate weights drawn with that deviation, far from uniform, so that
    near-equal scores do not make the top-k hang on float rounding."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    for f in Path(model_dir).glob("*.safetensors"):
        state = load_file(f)
        for name, t in state.items():
            if name.endswith("norm.weight"):
                state[name] = t + 0.2 * torch.randn(t.shape, generator=g)
            if router_std and name.endswith("mlp.gate.weight"):
                state[name] = router_std * torch.randn(t.shape, generator=g)
        save_file(state, f, metadata={"format": "pt"})
