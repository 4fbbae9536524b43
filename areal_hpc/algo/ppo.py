"""The decoupled PPO objective (AReaL paper, arXiv 2505.24298, Eq. 5).

Three policies meet in the loss of one response token:

- the behaviour policy, the generator weights that sampled the token: `behav_logprobs`. With
  asynchronous, interruptible generation it may be up to `max_staleness` versions old, and may even
  change within one response;
- the proximal policy, the trainer's weights at the start of the step: `prox_logprobs`, recomputed
  by the trainer. PPO's trust region is centred here rather than on the stale behaviour policy;
- the policy being optimised: `logprobs`, the only input with a gradient.

    u_t    = exp(logp_t - prox_logp_t)              trust-region ratio
    w_t    = exp(prox_logp_t - behav_logp_t)        importance weight, a constant (no gradient)
    loss_t = -w_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps_high) * A_t)
    loss   = sum_{t in mask} loss_t / |mask|

With `behav_weight_cap` c, tokens with w_t > c contribute 0 and the denominator stays |mask|.
When behav == prox (eta = 0, no interrupted generation) w = 1 and this is standard clipped PPO.

An optional penalty keeps the policy near a frozen reference (the initial policy), added by the
trainer with weight `ppo.kl_coef` (`kl_penalty`; off by default, as in the paper).
"""

from __future__ import annotations

from typing import Literal

import torch

Reduction = Literal["mean", "sum"]


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_weight_cap: float | None = None,
    reduction: Reduction = "mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO loss over the tokens of `loss_mask`.

        u_t    = exp(logp_t - prox_logp_t)
        w_t    = exp(prox_logp_t - behav_logp_t)                        (detached)
        loss_t = -w_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps_high) * A_t)
                 and loss_t = 0 where w_t > behav_weight_cap (when a cap is set)
        reduction="mean": loss = sum_{t in mask} loss_t / |mask|          (0 for an empty mask)
        reduction="sum":  loss = sum_{t in mask} loss_t

    All five tensors have the same shape (any shape; a packed micro-batch is a flat [N]).
    `prox_logprobs`, `behav_logprobs` and `advantages` are treated as constants. Values outside the
    mask (prompt tokens, padding) are ignored entirely, whatever they hold.

    Micro-batches and gradient accumulation: a mean per micro-batch would weight the tokens of a
    short micro-batch more. Use `reduction="sum"` and divide by the token count of the whole
    minibatch, so every token weighs the same whatever the packing:

        n_total = sum(int(mb.loss_mask.sum()) for mb in minibatch)   # tokens of this optimizer step
        for mb in minibatch:
            loss_sum, stats = decoupled_ppo_loss(..., reduction="sum")
            (loss_sum / n_total).backward()

    With data parallelism, take n_total over all DP ranks (all-reduce) and, when the DP gradient
    reduction averages over ranks (Megatron's default), divide by n_total / dp instead.

    Stats (detached 0-dim tensors, no host sync; means over the mask tokens of this call):
    `clip_frac` (tokens where the clipped term is the active one, so no gradient flows),
    `behav_weight_mean`, `behav_weight_max` (0 for an empty mask), `capped_frac` (tokens zeroed by
    the cap), `n_tokens` (|mask|).

    Note: u and w are not clamped; a token whose log-ratio overflows exp gives an infinite loss,
    which is the honest answer (the grad-norm clip or the cap is where such tokens are handled).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip <= 0 or eps_clip_high <= 0:
        raise ValueError(f"eps_clip ({eps_clip}) and eps_clip_high ({eps_clip_high}) must be > 0")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (got {reduction!r})")
    shape = logprobs.shape
    for name, t in (
        ("prox_logprobs", prox_logprobs),
        ("behav_logprobs", behav_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}")

    # Half-precision logprobs lose too much in exp(difference); compute in at least float32.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Zero every input outside the mask before any exp: prompt and padding positions may hold
    # anything, and an overflowing exp there would turn into NaN (inf * 0) in the loss or gradient.
    logp = torch.where(mask, logprobs.to(dtype), zero)
    prox = torch.where(mask, prox_logprobs.detach().to(dtype), zero)
    behav = torch.where(mask, behav_logprobs.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)

    ratio = torch.exp(logp - prox)  # u
    behav_weight = torch.exp(prox - behav)  # w, constant
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    objective = torch.minimum(unclipped, clipped)

    if behav_weight_cap is not None:
        capped = mask & (behav_weight > behav_weight_cap)
        weight = torch.where(capped, zero, behav_weight)  # where, not multiply: w may be inf
    else:
        capped = torch.zeros_like(mask)
        weight = behav_weight
    loss_sum = -(weight * objective).sum()  # outside the mask adv = 0, so the term is 0

    n_tokens = mask.sum()
    denom = n_tokens.clamp(min=1).to(dtype)
    loss = loss_sum / denom if reduction == "mean" else loss_sum

    with torch.no_grad():
        stats = {
            "clip_frac": (mask & (clipped < unclipped)).sum().to(dtype) / denom,
            "behav_weight_mean": torch.where(mask, behav_weight, zero).sum() / denom,
            "behav_weight_max": torch.where(mask, behav_weight, zero).max() if behav_weight.numel() else zero.clone(),
            "capped_frac": capped.sum().to(dtype) / denom,
            "n_tokens": n_tokens,
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of `loss_mask` of the k3 estimator of KL(policy || reference) (Schulman's
    "Approximating KL divergence"; GRPO, DeepSeekMath Eq. 4):

        d_t  = ref_logp_t - logp_t
        kl_t = exp(d_t) - d_t - 1                     (>= 0; 0 where the policy equals the reference)
        kl   = sum_{t in mask} kl_t / |mask|          (0 for an empty mask)
        d kl_t / d logp_t = 1 - exp(d_t)

    Tensors of equal shape; `ref_logprobs` is a constant. Values outside the mask are ignored (zeroed
    before the exp, as in `decoupled_ppo_loss`). Computed in at least float32.
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
    kl = torch.exp(diff) - diff - 1.0  # 0 outside the mask
    return kl.sum() / mask.sum().clamp(min=1).to(dtype)
