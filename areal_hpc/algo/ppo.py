"""The policy losses of the trainer, each in the decoupled form of the AReaL paper (arXiv 2505.24298,
Eq. 5), and how their token losses are aggregated.

Three policies meet in the loss of one response token:

- the behaviour policy, the generator weights that sampled the token: `behav_logprobs`. With
  asynchronous, interruptible generation it may be up to `max_staleness` versions old, and may even
  change within one response;
- the proximal policy, the trainer's weights at the start of the step: `prox_logprobs`, recomputed
  by the trainer. The trust region is centred here rather than on the stale behaviour policy;
- the policy being optimised: `logprobs`, the only input with a gradient.

    u_t = exp(logp_t - prox_logp_t)                  trust-region ratio
    w_t = exp(prox_logp_t - behav_logp_t)            importance weight, a constant (no gradient)

`ppo.policy_loss` (`POLICY_LOSSES`), with sg() a stop-gradient, i the sequence of token t and |y_i| its
loss-mask tokens:

    decoupled  loss_t = -w_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps_high) * A_t)        (AReaL)
    gspo       s_i    = exp(sum_{t in i} (logp_t - prox_logp_t) / |y_i|)                      (GSPO,
               s_t    = sg(s_i) * exp(logp_t - sg(logp_t))          value s_i, gradient s_i * dlogp_t;
               loss_t = -w_t * min(s_t * A_t, clip(s_t, 1 - eps, 1 + eps_high) * A_t)   arXiv 2507.18071,
                                                                               its GSPO-token form)
    cispo      loss_t = -w_t * sg(clip(u_t, 1 - eps, 1 + eps_high)) * A_t * logp_t            (CISPO,
                                                                       MiniMax-M1, arXiv 2506.13585)

`ppo.behav_weight_cap` (`behav_weight_bounds`): a number c masks tokens with w_t > c; a pair [lo, hi]
masks those with w_t outside [lo, hi] (IcePop's two-sided mask). A masked token's loss is 0 and it stays
in every denominator. When behav == prox (no staleness, no interruption) w = 1 and each loss is its
paper's.

`ppo.loss_agg` (`LOSS_AGGS`; `aggregate`), over the loss-mask tokens, with C = rollout.max_new_tokens:

    token_mean           loss = sum_t loss_t / |mask|                          (every token weighs the same)
    seq_mean_token_mean  loss = mean_i (sum_{t in i} loss_t / |y_i|)           (every sequence the same;
                                                                                GSPO's and GRPO's)
    seq_mean_token_sum   loss = mean_i (sum_{t in i} loss_t / C)               (Dr. GRPO, arXiv 2503.20783)

The means over sequences count the sequences with at least one loss-mask token. GSPO with
seq_mean_token_mean and an advantage constant over each sequence is the paper's sequence-level GSPO
exactly, in value and gradient.

An optional penalty keeps the policy near a frozen reference (the initial policy), added by the
trainer with weight `ppo.kl_coef` (`kl_tokens`; off by default, as in the paper).
"""

from __future__ import annotations

from typing import Literal

import torch

from areal_hpc.algo.losses import LOSS_AGGS, POLICY_LOSSES

Reduction = Literal["mean", "sum"]


def behav_weight_bounds(cap) -> tuple[float, float] | None:
    """`ppo.behav_weight_cap` as (lo, hi), the range of behaviour weights kept: None -> None (all kept),
    c -> (0, c), [lo, hi] -> (lo, hi)."""
    if cap is None:
        return None
    if isinstance(cap, (int, float)):
        return 0.0, float(cap)
    lo, hi = cap
    return float(lo), float(hi)


def policy_token_losses(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
    *,
    policy_loss: str = "decoupled",
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_weight_cap=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each token's loss (`policy_loss`, the module's formulas), 0 outside the mask and where the
    behaviour weight is out of `behav_weight_cap`'s range.

    The five tensors have the same shape (a packed micro-batch is a flat [N]); `seq_ids` ([N] int64, the
    sequence of each token, numbered from 0, each number below N) is needed by gspo. `prox_logprobs`,
    `behav_logprobs` and `advantages` are constants. Values outside the mask (prompt tokens, padding) are ignored entirely,
    whatever they hold: they are zeroed before any exp, where an overflow would turn into NaN (inf * 0).
    Computed in at least float32 (half-precision logprobs lose too much in exp(difference)).

    Stats (detached 0-dim tensors, no host sync; means over the mask tokens):
    `clip_frac` (decoupled, gspo: tokens whose clipped term is the active one, so no gradient flows;
    cispo: tokens whose weight was clipped), `behav_weight_mean`, `behav_weight_max` (0 for an empty
    mask), `behav_masked_frac` (tokens masked by `behav_weight_cap`), `n_tokens` (|mask|).

    u and w are not clamped: a token whose log-ratio overflows exp gives an infinite loss, which is
    the honest answer (the grad-norm clip or `behav_weight_cap` is where such tokens are handled).
    """
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {', '.join(POLICY_LOSSES)} (got {policy_loss!r})")
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip <= 0 or eps_clip_high <= 0:
        raise ValueError(f"eps_clip ({eps_clip}) and eps_clip_high ({eps_clip_high}) must be > 0")
    shape = logprobs.shape
    for name, t in (
        ("prox_logprobs", prox_logprobs),
        ("behav_logprobs", behav_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    logp = torch.where(mask, logprobs.to(dtype), zero)
    prox = torch.where(mask, prox_logprobs.detach().to(dtype), zero)
    behav = torch.where(mask, behav_logprobs.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    lo, hi = 1.0 - eps_clip, 1.0 + eps_clip_high

    if policy_loss == "gspo":
        log_s = torch.where(mask, _sequence_means(logp.detach() - prox, mask, _seq_ids(seq_ids, shape)), zero)
        ratio = torch.exp(log_s + logp - logp.detach())  # value s_i, gradient s_i * dlogp_t
    else:
        ratio = torch.exp(logp - prox)  # u
    if policy_loss == "cispo":
        objective = torch.clamp(ratio, lo, hi).detach() * adv * logp
        clipped = mask & ((ratio < lo) | (ratio > hi))
    else:
        unclipped = ratio * adv
        bounded = torch.clamp(ratio, lo, hi) * adv
        objective = torch.minimum(unclipped, bounded)
        clipped = mask & (bounded < unclipped)

    behav_weight = torch.exp(prox - behav)  # w, constant
    bounds = behav_weight_bounds(behav_weight_cap)
    if bounds is not None:
        masked = mask & ((behav_weight < bounds[0]) | (behav_weight > bounds[1]))
        weight = torch.where(masked, zero, behav_weight)  # where, not multiply: w may be inf
    else:
        masked = torch.zeros_like(mask)
        weight = behav_weight
    losses = -(weight * objective)  # outside the mask adv = 0, so the term is 0

    n_tokens = mask.sum()
    denom = n_tokens.clamp(min=1).to(dtype)
    with torch.no_grad():
        in_mask = torch.where(mask, behav_weight, zero)
        stats = {
            "clip_frac": clipped.sum().to(dtype) / denom,
            "behav_weight_mean": in_mask.sum() / denom,
            "behav_weight_max": in_mask.max() if behav_weight.numel() else zero.clone(),
            "behav_masked_frac": masked.sum().to(dtype) / denom,
            "n_tokens": n_tokens,
        }
    return losses, stats


def aggregate(
    losses: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
    loss_agg: str = "token_mean",
    seq_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, count) of token `losses` under `loss_agg` (the module's formulas): the loss is total /
    count, and over micro-batches (sum of totals) / (sum of counts), which is how Megatron reduces the
    pairs its loss function returns. count is |mask| for token_mean and the sequences with a mask token
    for the others (int64). `seq_ids` as in `policy_token_losses` (not needed by token_mean);
    `seq_tokens` is seq_mean_token_sum's constant C."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)} (got {loss_agg!r})")
    mask = loss_mask.bool()
    losses = torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
    if loss_agg == "token_mean":
        return losses.sum(), mask.sum()
    ids = _seq_ids(seq_ids, losses.shape)
    count = _per_sequence(mask.to(losses.dtype), ids)
    seqs = (count > 0).sum()
    if loss_agg == "seq_mean_token_sum":
        if not seq_tokens or seq_tokens <= 0:
            raise ValueError(f"seq_mean_token_sum needs its constant seq_tokens > 0 (got {seq_tokens!r})")
        return losses.sum() / seq_tokens, seqs
    return (_per_sequence(losses, ids) / count.clamp(min=1)).sum(), seqs


def _seq_ids(seq_ids: torch.Tensor | None, shape) -> torch.Tensor:
    if seq_ids is None:
        raise ValueError("this policy loss or aggregation works per sequence: it needs seq_ids")
    if seq_ids.shape != shape:
        raise ValueError(f"seq_ids has shape {tuple(seq_ids.shape)}, logprobs has {tuple(shape)}")
    return seq_ids.reshape(-1).long()


def _per_sequence(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N] the sum of `values` over each sequence's tokens, 0 past the last sequence (N tokens hold at most N
    sequences: no host sync to learn how many)."""
    return torch.zeros(ids.numel(), dtype=values.dtype, device=values.device).index_add(0, ids, values.reshape(-1))


def _sequence_means(values: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of `values` over the mask tokens (values are 0 outside the mask)."""
    count = _per_sequence(mask.to(values.dtype), ids).clamp(min=1)
    return (_per_sequence(values, ids) / count)[ids].reshape(values.shape)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_weight_cap=None,
    reduction: Reduction = "mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled PPO loss over the tokens of `loss_mask` (`policy_token_losses` with
    policy_loss="decoupled"):

        reduction="mean": loss = sum_{t in mask} loss_t / |mask|          (0 for an empty mask)
        reduction="sum":  loss = sum_{t in mask} loss_t

    Micro-batches and gradient accumulation: a mean per micro-batch would weight the tokens of a
    short micro-batch more. Use `reduction="sum"` and divide by the token count of the whole
    minibatch (over all data-parallel ranks), so every token weighs the same whatever the packing.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (got {reduction!r})")
    losses, stats = policy_token_losses(
        logprobs,
        prox_logprobs,
        behav_logprobs,
        advantages,
        loss_mask,
        eps_clip=eps_clip,
        eps_clip_high=eps_clip_high,
        behav_weight_cap=behav_weight_cap,
    )
    total = losses.sum()
    return (total / stats["n_tokens"].clamp(min=1).to(total.dtype) if reduction == "mean" else total), stats


def kl_tokens(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Each token's k3 estimate of KL(policy || reference) (Schulman's "Approximating KL divergence";
    GRPO, DeepSeekMath Eq. 4), 0 outside the mask:

        d_t  = ref_logp_t - logp_t
        kl_t = exp(d_t) - d_t - 1                     (>= 0; 0 where the policy equals the reference)
        d kl_t / d logp_t = 1 - exp(d_t)

    Tensors of equal shape; `ref_logprobs` is a constant. Values outside the mask are ignored (zeroed
    before the exp, as in `policy_token_losses`). Computed in at least float32.
    """
    if ref_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs {tuple(ref_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must have "
            f"the shape of logprobs {tuple(logprobs.shape)}"
        )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    diff = torch.where(mask, ref_logprobs.detach().to(dtype) - logprobs.to(dtype), zero)  # d
    return torch.exp(diff) - diff - 1.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The mean of `kl_tokens` over the tokens of `loss_mask` (0 for an empty mask)."""
    kl = kl_tokens(logprobs, ref_logprobs, loss_mask)
    return kl.sum() / loss_mask.bool().sum().clamp(min=1).to(kl.dtype)
