"""Routing replay in the trainer's MoE layers: each router replays the experts the generator chose for a
position (`ppo.routing_replay`), and what the step reports about routing.

    targets   [T, K] expert ids per token in the router's order (row s_idx * b + b_idx of the [s, b]
              activations, this TP rank's slice under sequence parallelism), -1: not known
    own       the router's own top-k of the same scores (Megatron's top-k, unchanged)
    used      targets where known, own where -1                      -> the experts the layer runs
    probs     the scores gathered at `used` (Megatron's REPLAY_FORWARD): the gate probabilities keep
              their gradient, so the router still trains, toward the experts actually used
    agreement rows where sorted(own) == sorted(targets), over the known rows of the training forwards

Megatron's `RouterReplay` does the gather; it is driven per router instance here, never through its
class-level list of every router built in the process (`RouterReplay.set_replay_data`): the reference
model and tests that build several models in one process add routers to that list, and its order then
says nothing about which model a router belongs to. So the config's `moe_enable_routing_replay` stays
off and each `ReplayRouter` owns one `_Replay`, taken out of that list.

Full recompute (`ppo.recompute=full`) runs each layer, router included, a second time inside the
backward pass. The targets set for a micro-batch's forward are then long gone (1F1B runs the forwards of
later micro-batches first), so each router keeps the targets of its training forwards in a FIFO and a
router call from inside the autograd engine takes the oldest: backward passes run in micro-batch order,
and each router sees one forward and one recompute per micro-batch (Megatron's own REPLAY_BACKWARD list
is the same idea, switched globally).

The load-balancing loss of the step is read from Megatron's aux-loss tracker, where each router adds
its loss (divided by its coefficient) per layer and micro-batch; Megatron's `track_moe_metrics` would
reduce it, but it allocates on "cuda" (no CPU route), and the step reduces its own stats in one
all-reduce anyway.
"""

from __future__ import annotations

from collections import deque

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class _Replay(RouterReplay):
    """One router's RouterReplay, outside Megatron's global list: REPLAY_FORWARD of `targets`, whose -1
    rows take the router's own top-k; counts the rows where the own top-k is the target's set."""

    def __init__(self, device):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
        self.targets: torch.Tensor | None = None  # [T, K] int64, -1 unknown; None: the router's own top-k
        self.count = False  # whether this call adds to the agreement counts
        self.agree = torch.zeros((), dtype=torch.float64, device=device)
        self.compared = torch.zeros((), dtype=torch.float64, device=device)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.targets is None:
            return own_probs, own
        targets = self.targets.to(scores.device)
        if targets.shape != own.shape:
            raise ValueError(
                f"routing replay: targets of shape {tuple(targets.shape)} for a router with {tuple(own.shape)} "
                "(tokens, top-k): the routing must be in the router's token order (s * b rows, this TP "
                "rank's slice under sequence parallelism)"
            )
        known = targets[:, :1] >= 0  # [T, 1]
        if self.count:
            with torch.no_grad():
                same = (own.sort(dim=1).values == targets.sort(dim=1).values).all(dim=1, keepdim=True)
                self.agree += (same & known).sum()
                self.compared += known.sum()
        self.target_topk_idx = torch.where(known, targets, own)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


class ReplayRouter(TopKRouter):
    """Megatron's TopKRouter that replays given experts per token (`set_targets`); without targets it is
    TopKRouter. The layer spec's router class of every MoE layer (trainer/model.py)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.router_replay is not None:  # the config's switch: not used, and never the global list
            RouterReplay.global_router_replay_instances.remove(self.router_replay)
        self.router_replay = _Replay(self.weight.device)
        self._targets: torch.Tensor | None = None
        self._recompute = deque()  # targets of the training forwards whose backward recomputes the layer
        self._recomputes = config.recompute_granularity == "full"

    def set_targets(self, targets: torch.Tensor | None) -> None:
        """The experts of the next forward passes: [T, K] int64, -1 where the router picks its own; None
        for the router's own top-k everywhere."""
        self._targets = targets

    def routing(self, logits, padding_mask=None):
        replay = self.router_replay
        if torch._C._current_graph_task_id() >= 0:  # recomputed inside the backward pass (ppo.recompute full)
            if not self._recompute:
                raise RuntimeError("routing replay: a router recomputed in a backward pass that had no forward")
            replay.targets = self._recompute.popleft()
            replay.count = False
        else:
            replay.targets = self._targets
            replay.count = self.training
            if self.training and self._recomputes:
                self._recompute.append(self._targets)
        return super().routing(logits, padding_mask=padding_mask)

    def take_agreement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows whose own top-k is the replayed set, rows replayed) since the last take, 0-d float64."""
        replay = self.router_replay
        counts = replay.agree.clone(), replay.compared.clone()
        replay.agree.zero_()
        replay.compared.zero_()
        return counts


def routers(model: torch.nn.Module) -> list[ReplayRouter]:
    """The MoE routers of a model stage, in layer order (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, ReplayRouter)]


def set_targets(model: torch.nn.Module, routing: torch.Tensor | None) -> None:
    """Replay `routing` ([L_stage, T, K] int64, -1 unknown: `MicroBatch.routing`) in the stage's next
    forward passes, layer l of the stage by its l-th router; None: every router routes by itself."""
    rs = routers(model)
    if routing is not None and routing.shape[0] != len(rs):
        raise ValueError(f"routing replay: routing of {routing.shape[0]} layers for a stage of {len(rs)} MoE layers")
    for i, r in enumerate(rs):
        r.set_targets(None if routing is None else routing[i])


def take_agreement(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(agree, compared) summed over the stage's routers since the last take (0-d float64 tensors): the
    replayed rows of the training forwards whose own top-k equals the replayed experts, and all of them."""
    agree = compared = torch.zeros((), dtype=torch.float64)
    for r in routers(model):
        a, c = r.take_agreement()
        agree, compared = agree.to(a.device) + a, compared.to(c.device) + c
    return agree, compared


STAT_KEYS = ("routing_agree", "routing_compared", "load_balancing_sum", "load_balancing_n")
"""The routing figures of a training step, each summed over every trainer rank (`take_stats`):
ppo/routing_agreement = agree / compared, ppo/load_balancing_loss = sum / n (the mean over MoE layers and
micro-batches of the load-balancing loss without its coefficient, 1 when the routing is balanced)."""


def take_stats(model: torch.nn.Module, microbatches: int, sequence_parallel: bool, tp_rank: int) -> torch.Tensor:
    """[4] float64: this rank's part of STAT_KEYS since the last take, over the `microbatches` training
    micro-batches since then; zeros for a dense model. Takes (resets) the counts on every rank.

    Without sequence parallelism every TP rank routes the same tokens: TP rank 0 alone counts. With it each
    TP rank routes its slice, and holds its slice's part of each load-balancing loss (Megatron's loss
    sums over the TP group): every TP rank counts, and TP rank 0 alone counts the losses' number."""
    rs = routers(model)
    counted = float(sequence_parallel or tp_rank == 0)
    agree, compared = take_agreement(model)
    losses = sum(r.is_aux_loss_enabled() for r in rs) * microbatches if tp_rank == 0 else 0
    parts = (agree * counted, compared * counted, _take_load_balancing_loss() * counted, torch.tensor(float(losses)))
    device = rs[0].weight.device if rs else torch.device("cpu")
    return torch.stack([p.to(device, torch.float64) for p in parts])


def _take_load_balancing_loss() -> torch.Tensor:
    """The load-balancing losses (without their coefficient) this rank's routers added to Megatron's
    aux-loss tracker since the last take, summed over layers and micro-batches (0-d float64; 0 when the
    loss is off). Under sequence parallelism each TP rank holds a part of each loss: sum over TP."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    total = torch.zeros((), dtype=torch.float64) if entry is None else entry["values"].sum().double()
    clear_aux_losses_tracker()
    return total
