"""One PPO training step on a trainer rank: prox logprob recompute, then one optimizer step per PPO
minibatch, each over its packed micro-batches with the decoupled loss.

    prox_logp <- logprobs of every token under the weights at the start of the step (forward only)
    ref_logp  <- logprobs of every token under the initial policy (forward only; ppo.kl_coef > 0)
    teach_logp <- logprobs of every token under the teacher (forward only; distill.teacher)
    A          <- A + distill_coef * (teach_logp - behav_logp)  (on-policy distillation; distill/reverse_kl
                  is the mean of behav_logp - teach_logp over trained tokens)
    for each minibatch k:
        for each micro-batch j of k (Megatron's schedule, 1F1B across pipeline stages):
            logp      = log_softmax(h W^T / T)[next token]                   (T = rollout.temperature)
            entropy   = H(softmax(h W^T / T))                  (no gradient; ppo/entropy, over the mask)
            loss_t    = policy loss (logp, prox_logp, behav_logp, A)   (ppo.policy_loss; algo.ppo)
                      + kl_coef * kl_t(logp, ref_logp)                         (kl_tokens; ppo/kl)
            loss_sum += the micro-batch's aggregate of loss_t, count += its count   (ppo.loss_agg)
        grads /= count of minibatch k over all data-parallel ranks     (Megatron's per-token loss)
        clip grad norm, Adam step

Memory: the prox pass keeps no autograd graph, and token logprobs come from the last stage's hidden
states h and the output weight W a chunk of positions at a time (`logprobs.token_logprobs`): a
micro-batch's logits never exist whole. `ppo.recompute` (Megatron's) trades compute for the layers'
activations.

Weighting: every micro-batch returns the *sum* of its losses and their count (`algo.ppo.aggregate`: its
tokens for token_mean, its sequences for the others); Megatron's schedule adds the counts and
`finalize_model_grads` divides the gradients by the total over the data-parallel ranks. Gradient
accumulation over micro-batches therefore gives the gradient of one big batch, whatever the packing (a
micro-batch holds whole sequences).

Routing replay (`ppo.routing_replay`, MoE models): a micro-batch carries the experts the generator chose
for each of its tokens in each MoE layer of this stage (`MicroBatch.routing`), and every forward pass
(proximal, reference, training) hands them to the stage's routers before it runs (`trainer.moe`).
ppo/routing_agreement is the share of replayed (token, layer) rows of the training passes whose own
top-k is the replayed set; ppo/load_balancing_loss the mean over MoE layers and micro-batches of
Megatron's load-balancing loss without its coefficient (1: balanced).

With one minibatch the recompute pass is skipped: the minibatch's own forward pass runs on the weights
at the start of the step, so prox_logp = logp (detached) exactly, for free.

The cheaper option `prox_logp="loglinear"` skips the recompute pass for every minibatch. It interpolates the proximal
logprob in log space between the behaviour and the current policy by policy version (A-3PO):

    prox_logp = behav_logp + alpha * (logp - behav_logp),  alpha = (v - v_behav) / (v + k/K - v_behav)

with v the step's version, v_behav the token's version and k/K the fraction of the step's minibatches
already applied. For the first minibatch alpha = 1 (prox = logp, exact); a token sampled by v itself
gets alpha = 0 at k > 0 (prox = behav, exact when generator and trainer agree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from areal_hpc.algo.losses import LOSS_AGGS, POLICY_LOSSES
from areal_hpc.algo.ppo import aggregate, kl_tokens, policy_token_losses
from areal_hpc.config.choices import PROX_LOGPS
from areal_hpc.protocol import routing_unknown
from areal_hpc.trainer import moe
from areal_hpc.trainer.logprobs import token_logprobs
from areal_hpc.trainer.packed import PackedRows, pack_rows


@dataclass
class StepConfig:
    """Settings of the PPO step (from the `ppo` and `rollout` config sections)."""

    temperature: float = 1.0
    """Logprobs are log_softmax(logits / temperature), the generator's sampling convention."""
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    behav_weight_cap: float | tuple[float, float] | list[float] | None = None
    """A number c or a pair [lo, hi], as the config gives it: `algo.ppo.behav_weight_bounds` reads both."""
    policy_loss: str = "decoupled"
    loss_agg: str = "token_mean"
    seq_tokens: int | None = None
    """seq_mean_token_sum's constant: rollout.max_new_tokens (`algo.ppo.aggregate` refuses it unset)."""
    prox_logp: str = "recompute"
    """recompute (a forward pass with the step's starting weights; exact) or loglinear (no extra pass)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the engine's reference policy (`ppo.kl_coef`; 0: off)."""
    distill_coef: float = 0.0
    """Weight of the teacher's term in each token's advantage (`distill.kl_coef` with a `distill.teacher`;
    0: off)."""

    def __post_init__(self):
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"ppo.policy_loss must be one of {', '.join(POLICY_LOSSES)} (got {self.policy_loss!r})")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"ppo.loss_agg must be one of {', '.join(LOSS_AGGS)} (got {self.loss_agg!r})")
        if self.prox_logp not in PROX_LOGPS:
            raise ValueError(f"ppo.prox_logp must be one of {', '.join(PROX_LOGPS)} (got {self.prox_logp!r})")
        if self.kl_coef < 0:
            raise ValueError(f"ppo.kl_coef must be >= 0 (got {self.kl_coef})")

    @classmethod
    def from_config(cls, cfg) -> StepConfig:
        p = cfg.ppo
        return cls(
            temperature=cfg.rollout.temperature,
            eps_clip=p.eps_clip,
            eps_clip_high=p.eps_clip_high,
            behav_weight_cap=p.behav_weight_cap,
            policy_loss=p.policy_loss,
            loss_agg=p.loss_agg,
            seq_tokens=cfg.rollout.max_new_tokens,
            prox_logp=p.prox_logp,
            kl_coef=p.kl_coef,
            distill_coef=cfg.distill.kl_coef if cfg.distill.teacher.path else 0.0,
        )


@dataclass
class MicroBatch:
    """A micro-batch's model inputs and per-token data, tokens in the order of its sequences."""

    rows: PackedRows
    where: tuple[torch.Tensor, torch.Tensor]  # ([n], [n]): (row, column) of the position predicting each token
    targets: torch.Tensor  # [n] the token each of those positions predicts
    loss_mask: torch.Tensor  # [n] bool; never on a sequence's first token (nothing predicts it)
    seq_ids: torch.Tensor  # [n] int64: the sequence of each token, 0, 1, ... in the micro-batch's order
    behav_logprobs: torch.Tensor  # [n]
    advantages: torch.Tensor  # [n]
    versions: torch.Tensor  # [n] int64
    prox_logprobs: torch.Tensor | None = None  # [n], filled on the last stage
    ref_logprobs: torch.Tensor | None = None  # [n] under the reference policy (ppo.kl_coef > 0), last stage
    teacher_logprobs: torch.Tensor | None = None  # [n] under the teacher (distill.teacher), last stage
    routing: torch.Tensor | None = None
    """[L_stage, T, K] int64: the experts each MoE layer of this stage replays (`trainer.moe`), per token in
    the router's order (row s_idx * b + b_idx of the [s, b] rows; this TP rank's s / TP slice under
    sequence parallelism), -1 where the router picks its own (unknown, padding); None: no replay."""

    @property
    def width(self) -> int:
        return self.rows.tokens.shape[1]


def make_microbatch(
    batch,
    seq_ids: list[int],
    padded: bool = False,
    device="cpu",
    multiple: int = 1,
    layers: list[int] | None = None,
    sp_rank: int = 0,
) -> MicroBatch:
    """The micro-batch of sequences `seq_ids` of a TrainBatch, on `device`, rows padded to a multiple of
    `multiple` (the TP size under sequence parallelism). With the batch's routing, its layers `layers`
    (this stage's MoE layers) in the order of slice `sp_rank` of `multiple` (this TP rank's)."""
    cu = np.asarray(batch.cu_seqlens)
    spans = [(int(cu[i]), int(cu[i + 1])) for i in seq_ids]
    take = np.concatenate([np.arange(a, b) for a, b in spans])
    tokens = torch.from_numpy(np.asarray(batch.tokens)[take].astype(np.int64))
    seqs, start = [], 0
    for a, b in spans:
        seqs.append(tokens[start : start + b - a])
        start += b - a
    rows = pack_rows(seqs, padded=padded, multiple=multiple)
    r_idx, c_idx, first = [], [], []
    for r, a, n in rows.seq_slices:
        r_idx.append(torch.full((n,), r))
        # token t of the sequence is predicted by the logits at t - 1 (the first token by none: use t)
        c_idx.append(torch.cat([torch.tensor([a]), torch.arange(a, a + n - 1)]))
        first.append(torch.arange(n) == 0)
    first = torch.cat(first)
    mask = torch.from_numpy(np.asarray(batch.loss_mask)[take].astype(bool)) & ~first

    def arr(x, dtype):
        return torch.from_numpy(np.asarray(x)[take].astype(dtype))

    where = (torch.cat(r_idx), torch.cat(c_idx))
    routing = None
    if batch.routing is not None and layers is not None:
        columns = batch.routing_columns(layers)
        routing = _router_order(np.asarray(batch.routing)[take][:, columns], rows, multiple, sp_rank).to(device)
    return MicroBatch(
        rows.to(device),
        (where[0].to(device), where[1].to(device)),
        torch.roll(rows.tokens, -1, dims=1)[where].to(device),
        mask.to(device),
        torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([b - a for a, b in spans])).to(device),
        arr(batch.behav_logprobs, np.float32).to(device),
        arr(batch.advantages, np.float32).to(device),
        arr(batch.versions, np.int64).to(device),
        routing=routing,
    )


def _router_order(routing: np.ndarray, rows: PackedRows, sp_size: int, sp_rank: int) -> torch.Tensor:
    """[n, L, K] experts of a micro-batch's tokens (in the order of its sequences; the dtype's maximum
    unknown) -> [L, T, K] int64 in the router's token order, -1 for unknown and for padding."""
    n, layers, k = routing.shape
    known = torch.from_numpy(np.where(routing == routing_unknown(routing.dtype), -1, routing.astype(np.int64)))
    b, s = rows.tokens.shape
    grid = torch.full((s, b, layers, k), -1, dtype=torch.int64)
    start = 0
    for r, a, length in rows.seq_slices:
        grid[a : a + length, r] = known[start : start + length]
        start += length
    width = s // sp_size  # sequence parallelism: TP rank t holds positions [t * s / TP, (t + 1) * s / TP)
    return grid[sp_rank * width : (sp_rank + 1) * width].permute(2, 0, 1, 3).reshape(layers, -1, k)


def _forward_step(loss_of, replay: bool = True):
    """Megatron's forward_step_func: the next micro-batch's forward, and its loss function, which gets
    the micro-batch, the stage's output weight (last stage) and whether the sequence is TP-split.
    `replay` False: the micro-batch's routing is not the model's (the teacher's pass)."""

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        moe.set_targets(model, mb.routing if replay else None)
        stage = unwrap_model(model)
        weight = stage.output_weight() if stage.post_process else None
        return mb.rows.forward(model), partial(loss_of, mb, weight, stage.config.sequence_parallel)

    return forward_step


def _logprobs(mb: MicroBatch, weight, sequence_parallel: bool, hidden: torch.Tensor, temperature: float, entropy=True):
    """([n] log_softmax(logits / T) of each token of `mb` given the tokens before it in its own sequence,
    [n] the entropy of that next-token distribution without a gradient, or None without `entropy`)."""
    return token_logprobs(hidden, weight, mb.where, mb.targets, temperature, sequence_parallel, entropy)


def _logprob_loss(temperature: float, mb: MicroBatch, weight, sequence_parallel: bool, output: torch.Tensor):
    logp, _ = _logprobs(mb, weight, sequence_parallel, output, temperature, entropy=False)  # no metric here
    return output.sum() * 0.0, torch.zeros((), dtype=torch.int, device=output.device), {"logprobs": logp}


def _ppo_loss(
    cfg: StepConfig, alpha_step: float, version: int, mb: MicroBatch, weight, sequence_parallel, output: torch.Tensor
):
    logp, entropy = _logprobs(mb, weight, sequence_parallel, output, cfg.temperature)
    if cfg.prox_logp == "recompute":
        # no recompute pass (one minibatch): this forward pass ran on the step's starting weights
        prox = mb.prox_logprobs if mb.prox_logprobs is not None else logp.detach()
    else:
        v_behav = mb.versions.to(logp.dtype)
        denom = version + alpha_step - v_behav
        alpha = torch.where(denom > 0, (version - v_behav) / denom.clamp(min=1e-9), torch.ones_like(denom))
        prox = mb.behav_logprobs + alpha * (logp.detach() - mb.behav_logprobs)
    mask = mb.loss_mask
    advantages = mb.advantages
    if cfg.distill_coef > 0:  # minus the reverse KL, per sampled token, from the policy that sampled it
        advantages = advantages + cfg.distill_coef * (mb.teacher_logprobs - mb.behav_logprobs)
    losses, stats = policy_token_losses(
        logp,
        prox,
        mb.behav_logprobs,
        advantages,
        mask,
        mb.seq_ids,
        policy_loss=cfg.policy_loss,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        behav_weight_cap=cfg.behav_weight_cap,
    )
    if cfg.kl_coef > 0:
        kl = kl_tokens(logp, mb.ref_logprobs, mask)
        losses = losses + cfg.kl_coef * kl
    loss_sum, count = aggregate(losses, mask, mb.seq_ids, cfg.loss_agg, cfg.seq_tokens)  # Megatron divides by count
    n = mask.sum()
    with torch.no_grad():
        current = mask & (mb.versions == version)
        if cfg.prox_logp != "recompute" and alpha_step > 0:
            current = torch.zeros_like(current)  # the approximate prox says nothing about the mismatch
        report = {
            "loss_sum": loss_sum.detach().double(),
            "loss_count": count.double(),
            "n": n.double(),
            "clip_sum": (stats["clip_frac"] * n).double(),
            "behav_weight_sum": (stats["behav_weight_mean"] * n).double(),
            "behav_masked_sum": (stats["behav_masked_frac"] * n).double(),
            "mismatch_sum": ((mb.behav_logprobs - prox).abs() * current).sum().double(),
            "mismatch_n": current.sum().double(),
            "entropy_sum": (entropy * mask).sum().double(),
            "kl_sum": (kl * mask).sum().double() if cfg.kl_coef > 0 else torch.zeros_like(n, dtype=torch.float64),
            "reverse_kl_sum": ((mb.behav_logprobs - mb.teacher_logprobs) * mask).sum().double()
            if cfg.distill_coef > 0
            else torch.zeros_like(n, dtype=torch.float64),
        }
    return loss_sum, count.int(), report


def compute_logprobs(engine, mbs: list[MicroBatch], temperature: float, model=None) -> list[torch.Tensor] | None:
    """[n] logprobs of each micro-batch's tokens under the current weights, or those of `model` (the
    engine's reference or teacher; the teacher replays no routing), on the last stage; else None.

    No autograd graph: Megatron's forward-only schedule does not turn gradients off by itself.
    """
    with torch.no_grad():
        out = engine.forward_backward(
            mbs,
            _forward_step(partial(_logprob_loss, temperature), replay=model is None or model is not engine.teacher),
            forward_only=True,
            seq_length=max(mb.width for mb in mbs),
            model=model,
        )
    return [o["logprobs"] for o in out] if engine.is_last_stage else None


_LOSS_KEYS = (
    "loss_sum",
    "loss_count",
    "n",
    "clip_sum",
    "behav_masked_sum",
    "behav_weight_sum",
    "mismatch_sum",
    "mismatch_n",
    "entropy_sum",
    "kl_sum",
    "reverse_kl_sum",
)
_STAT_KEYS = _LOSS_KEYS + moe.STAT_KEYS


def ppo_step(engine, batch, cfg: StepConfig) -> dict[str, float]:
    """Train on one TrainBatch (this data-parallel rank's shard); returns the step's stats on every rank.

    Collective over all trainer ranks (every TP/PP rank of a replica gets the same batch). Before each
    optimizer step every rank learns the minibatch's loss (one all-reduce of the token stats, on the
    engine's device) and the gradient norm: a non-finite one stops the run, weights untouched.
    """
    minibatches = step_microbatches(engine, batch)
    if needs_prox_pass(cfg, minibatches):
        prox_pass(engine, minibatches, cfg.temperature)
    return train_minibatches(engine, int(batch.version), minibatches, cfg)


def step_microbatches(engine, batch) -> list[list[MicroBatch]]:
    """The batch's PPO minibatches of micro-batches, packed, as this rank runs them: rows padded to a
    multiple of the TP size under sequence parallelism, with the routing of this stage's MoE layers."""
    sp, tp_rank = engine.config.sequence_parallel, engine.par.coords.tp
    multiple = engine.par.grid.tp if sp else 1
    layers = [r.layer_number - 1 for r in moe.routers(engine.model)]  # this stage's MoE layers
    sp_rank = tp_rank if sp else 0
    return [
        [
            make_microbatch(batch, ids, device=engine.device, multiple=multiple, layers=layers, sp_rank=sp_rank)
            for ids in mb
        ]
        for mb in batch.microbatches
    ]


def needs_prox_pass(cfg: StepConfig, minibatches: list[list[MicroBatch]]) -> bool:
    """Whether the step recomputes the prox logprobs in a pass of their own: exact prox with more than
    one minibatch (with one, the minibatch's forward pass runs on the step's starting weights)."""
    return cfg.prox_logp == "recompute" and len(minibatches) > 1


def prox_pass(engine, minibatches: list[list[MicroBatch]], temperature: float) -> None:
    """The recompute pass: every micro-batch's prox logprobs under the weights at the start of the step
    (on the last stage; forward only)."""
    _logprob_pass(engine, minibatches, temperature, "prox_logprobs")


def _logprob_pass(engine, minibatches: list[list[MicroBatch]], temperature: float, field: str, model=None) -> None:
    """Every micro-batch's logprobs under the current weights or `model` (`compute_logprobs`) into its
    `field`, on the last stage."""
    flat = [mb for k in minibatches for mb in k]
    logprobs = compute_logprobs(engine, flat, temperature, model=model)
    if logprobs is not None:
        for mb, lp in zip(flat, logprobs):
            setattr(mb, field, lp)


def _teacher_pass(engine, minibatches: list[list[MicroBatch]], cfg: StepConfig) -> float:
    """Every micro-batch's logprobs under the teacher (on the last stage); the pass's seconds."""
    if engine.teacher is None:
        raise ValueError("distill.teacher needs an Engine built with it (it keeps the teacher)")
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)  # the passes before it out of its time
    start = time.perf_counter()
    _logprob_pass(engine, minibatches, cfg.temperature, "teacher_logprobs", model=engine.teacher)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start


def train_minibatches(engine, version: int, minibatches: list[list[MicroBatch]], cfg: StepConfig) -> dict[str, float]:
    """The step after any prox pass: the reference pass (ppo.kl_coef > 0), then one optimizer step per
    minibatch; the step's stats (`ppo_step`'s)."""
    lr = engine.set_step(version)
    tp_rank, sp = engine.par.coords.tp, engine.config.sequence_parallel
    if cfg.kl_coef > 0:
        if engine.reference is None:
            raise ValueError("ppo.kl_coef > 0 needs an Engine built with it (it keeps the reference policy)")
        with engine.reference_pass():
            _logprob_pass(engine, minibatches, cfg.temperature, "ref_logprobs", model=engine.reference)
    teacher_s = _teacher_pass(engine, minibatches, cfg) if cfg.distill_coef > 0 else None
    totals = torch.zeros(len(_STAT_KEYS), dtype=torch.float64, device=engine.device)
    grad_norms = []
    K = len(minibatches)
    for k, mbs in enumerate(minibatches):
        what = f"training step {version + 1} (minibatch {k + 1} of {K})"
        loss = partial(_ppo_loss, cfg, k / K, version)
        out = engine.forward_backward(
            mbs,
            _forward_step(loss),
            forward_only=False,
            seq_length=max(mb.width for mb in mbs),
        )
        # Only the last stage's TP rank 0 of each replica holds the token stats: sum them everywhere.
        part = torch.zeros_like(totals)
        if engine.is_last_stage and tp_rank == 0:
            for o in out:
                part[: len(_LOSS_KEYS)] += torch.stack([o[key] for key in _LOSS_KEYS])
        part[len(_LOSS_KEYS) :] = moe.take_stats(engine.model, len(mbs), sp, tp_rank)
        dist.all_reduce(part)
        engine.check_finite(part[0].item() / max(part[1].item(), 1.0), "the loss", what)  # loss_sum / loss_count
        grad_norms.append(engine.optimizer_step(what))
        totals += part
    s = dict(zip(_STAT_KEYS, totals.tolist()))
    n = max(s["n"], 1.0)
    optional = {"ppo/kl": s["kl_sum"] / n} if cfg.kl_coef > 0 else {}
    if teacher_s is not None:
        optional |= {"distill/reverse_kl": s["reverse_kl_sum"] / n, "timing/teacher_s": teacher_s}
    if cfg.behav_weight_cap is not None:
        optional["ppo/behav_masked_frac"] = s["behav_masked_sum"] / n
    if s["routing_compared"] > 0:  # ppo.routing_replay
        optional["ppo/routing_agreement"] = s["routing_agree"] / s["routing_compared"]
    if s["load_balancing_n"] > 0:  # an MoE model with a load-balancing coefficient > 0
        optional["ppo/load_balancing_loss"] = s["load_balancing_sum"] / s["load_balancing_n"]
    if engine.device.type == "cuda":  # a CPU process's max RSS counts everything else it holds: another quantity
        optional["memory/peak_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    return optional | {
        "ppo/loss": s["loss_sum"] / max(s["loss_count"], 1.0),
        "ppo/clip_frac": s["clip_sum"] / n,
        "ppo/grad_norm": sum(grad_norms) / len(grad_norms),
        "ppo/behav_weight_mean": s["behav_weight_sum"] / n,
        "ppo/entropy": s["entropy_sum"] / n,
        "ppo/logp_mismatch": s["mismatch_sum"] / max(s["mismatch_n"], 1.0),
        "ppo/logp_mismatch_tokens": s["mismatch_n"],  # 0: no token of the current version in the batch
        "ppo/tokens": s["n"],
        "ppo/lr": lr,
    }
