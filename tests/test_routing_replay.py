"""Routing replay in the trainer (`trainer.moe`): a micro-batch's routing in the router's token order; on a
real Megatron MoE model, replayed experts are the ones the layers use (-1 rows: the router's own), the
agreement counts, full recompute replays the same experts in the backward pass, and replay restores the
logprobs of a model whose router was perturbed (its own choices then differ from the recorded ones)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from areal_hpc.arch import model_arch
from areal_hpc.protocol import routing_unknown
from areal_hpc.trainer.spawn import run_ranks
from tests.support.inputs import random_batch
from tests.support.shapes import ROUTER_MOE, TINY_MOE

EXPERTS, TOP_K = ROUTER_MOE.num_experts, ROUTER_MOE.num_experts_per_tok
UNKNOWN = routing_unknown(np.uint8)
NOISE = 0.2
"""Noise on the trainer's router weights, times their standard deviation: its own top-k then differs from
the generator's on about a third of the positions (0.2: 68% agree; 1.0: 33%)."""


def _batch_with_routing(vocab: int, layers: int, seed: int = 0):
    """A TrainBatch whose routing is token t's number in every entry (t % 200; the last token of each
    sequence unknown): each entry tells where it went."""
    batch = random_batch(vocab, n_seqs=4, seed=seed, microbatches=[[[0, 1, 2, 3]]])
    n = len(batch.tokens)
    routing = np.broadcast_to((np.arange(n) % 200)[:, None, None], (n, layers, TOP_K)).astype(np.uint8).copy()
    routing[batch.cu_seqlens[1:] - 1] = UNKNOWN
    batch.routing = routing
    return batch


def test_each_peer_of_a_replica_gets_the_routing_of_its_own_stage():
    """The replica's first rank relays a batch to its TP x PP peers (trainer.worker.stage_routing): each peer
    gets its stage's layers' columns of the routing, which its micro-batches read as the whole batch's."""
    from types import SimpleNamespace

    from areal_hpc.config import load_config
    from areal_hpc.layout import Layout, Role
    from areal_hpc.protocol import WeightSync
    from areal_hpc.trainer.step import make_microbatch
    from areal_hpc.trainer.worker import stage_routing

    overrides = ["model.architecture=qwen3_moe", "model.num_layers=4", "ppo.routing_replay=true"]
    cfg = load_config(None, [*overrides, "cluster.nodes=1", "cluster.gpus_per_node=5", "allocation.gen_gpus=1",
                             "allocation.train_tp=2", "allocation.train_pp=2"])  # fmt: skip
    layout = Layout.from_config(cfg)
    first = layout.ranks(Role.TRAINER).start
    for_peer = stage_routing(SimpleNamespace(cfg=cfg, layout=layout, rank=first))
    batch = _batch_with_routing(1000, 4)
    got = {peer: for_peer(peer, batch) for peer in (1, 2, 3)}  # tp 1 of stage 0, tp 0 and 1 of stage 1
    assert [(got[p].routing_first_layer, got[p].routing.shape[1]) for p in (1, 2, 3)] == [(0, 2), (2, 2), (2, 2)]
    assert np.array_equal(got[2].routing, batch.routing[:, 2:4]) and got[2].tokens is batch.tokens
    whole, own = (make_microbatch(b, [0, 1], layers=[2, 3]).routing for b in (batch, got[2]))
    assert torch.equal(whole, own)
    with pytest.raises(ValueError, match="layers 0-1 are not among the routing's 2-3"):
        got[2].for_layers(0, 2)
    assert for_peer(1, WeightSync(3)) == WeightSync(3)
    assert stage_routing(SimpleNamespace(cfg=load_config(None, overrides[:2]), layout=layout, rank=first)) is None


@pytest.mark.parametrize("padded", [False, True])
def test_microbatch_routing_in_router_order(padded):
    """Row s_idx * b + b_idx of the [s, b] rows holds the routing of the token there; padding and unknown
    are -1; only the given layers; under sequence parallelism rank r holds rows [r s / TP, (r + 1) s / TP)."""
    from areal_hpc.trainer.step import make_microbatch

    batch = _batch_with_routing(100, layers=3)
    ids = [0, 1, 2, 3]
    halves = [make_microbatch(batch, ids, padded, multiple=2, layers=[2, 0], sp_rank=r) for r in (0, 1)]
    rows = halves[0].rows
    b, s = rows.tokens.shape
    cu = batch.cu_seqlens
    expected = torch.full((s, b), -1)
    for i, (row, start, length) in zip(ids, rows.seq_slices):
        expected[start : start + length - 1, row] = torch.arange(cu[i], cu[i + 1] - 1) % 200  # last: unknown
    for r, half in enumerate(halves):
        assert half.routing.shape == (2, s // 2 * b, TOP_K) and half.routing.dtype == torch.int64
        want = expected[r * s // 2 : (r + 1) * s // 2].reshape(1, -1, 1).expand(2, -1, TOP_K)
        assert torch.equal(half.routing, want), r
    assert make_microbatch(batch, ids, padded).routing is None  # no layers asked: a dense stage


# --- on a real Megatron MoE model (one rank) ---


def _moe_model(par, recompute="none", like=None):
    """The trainer's stage of ROUTER_MOE (`trainer.model`: routers are ReplayRouters), the weights of `like`."""
    from areal_hpc.trainer.model import build_stage, transformer_config

    arch = model_arch(ROUTER_MOE)
    model = build_stage(
        arch, transformer_config(arch, 1, 1, par.device, recompute=recompute, load_balancing_coef=0.01), par.device
    )
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model


class _Routes:
    """Per router of a model, in its latest forward: the experts it used and its own top-k (of its gate's
    logits), [L, T, K] each, ascending."""

    def __init__(self, model):
        from areal_hpc.trainer.moe import routers

        self.seen = {}
        for i, r in enumerate(routers(model)):
            r.register_forward_hook(
                lambda m, inp, out, i=i: self.seen.__setitem__(i, (_experts(out[1]), _own(m, inp[0])))
            )

    def used(self) -> torch.Tensor:
        return torch.stack([self.seen[i][0] for i in sorted(self.seen)]).cpu()

    def own(self) -> torch.Tensor:
        return torch.stack([self.seen[i][1] for i in sorted(self.seen)]).cpu()


def _own(router, hidden: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [s * b, K] the router's own top-k (of its logits: Qwen's normalised top-k), ascending."""
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t()
    return logits.topk(TOP_K, dim=1).indices.sort(dim=1).values


def _experts(routing_map: torch.Tensor) -> torch.Tensor:
    """[T, E] bool (top-k per row) -> [T, K] expert ids, ascending."""
    return routing_map.nonzero()[:, 1].view(routing_map.shape[0], TOP_K)


def _logprobs(model, mb, routing="mb") -> torch.Tensor:
    """[n] logprobs of the micro-batch's tokens, replaying its routing (or `routing`)."""
    from areal_hpc.trainer import moe
    from areal_hpc.trainer.logprobs import token_logprobs

    moe.set_targets(model, mb.routing if isinstance(routing, str) else routing)
    hidden = mb.rows.forward(model)
    return token_logprobs(hidden, model.output_weight(), mb.where, mb.targets, 1.0, False, False)[0]


def _record(model, batch) -> np.ndarray:
    """[N, L, K] uint8: the experts `model` routes each token of the batch to (the generator's record),
    the last token of each sequence unknown (the generator never computes it)."""
    from areal_hpc.trainer.step import make_microbatch

    routes = _Routes(model)
    mb = make_microbatch(batch, list(range(len(batch.cu_seqlens) - 1)), device=model.output_weight().device)
    with torch.no_grad():
        _logprobs(model.eval(), mb, routing=None)  # one packed row: the rows are in the batch's token order
    routing = routes.used()[:, : len(batch.tokens)].permute(1, 0, 2).numpy().astype(np.uint8)
    routing[batch.cu_seqlens[1:] - 1] = UNKNOWN
    return routing


def _perturb_router(model, scale: float, seed: int) -> None:
    from areal_hpc.trainer.moe import routers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(model):
            r.weight += scale * r.weight.std() * torch.randn(r.weight.shape, generator=g).to(r.weight.device)


def _replay_rank(par, noise: float) -> dict:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from areal_hpc.trainer import moe
    from areal_hpc.trainer.step import make_microbatch

    torch.manual_seed(0)
    generator = _moe_model(par)
    batch = random_batch(model_arch(ROUTER_MOE).vocab_size, n_seqs=6, seed=1, microbatches=[[[0, 1, 2, 3, 4, 5]]])
    batch.routing = _record(generator, batch)
    ids = list(range(6))
    packed = make_microbatch(batch, ids, device=par.device)
    with torch.no_grad():
        reference = _logprobs(generator, packed, routing=None)  # the generator's logprobs

    # the trainer: the same weights but its routers' (perturbed or not), rows padded: another token order
    trainer = _moe_model(par, like=generator)
    _perturb_router(trainer, noise, seed=2)
    mb = make_microbatch(batch, ids, padded=True, device=par.device, layers=[0, 1])
    routes = _Routes(trainer)
    with torch.no_grad():
        own = _logprobs(trainer.eval(), mb, routing=None)
        logp = _logprobs(trainer.train(), mb)  # training mode: the agreement counts
    agree, compared = moe.take_agreement(trainer)
    out = {"agree": agree.item(), "compared": compared.item(), "used": routes.used(), "own": routes.own()}
    out["mb_routing"] = mb.routing.cpu()
    out["mismatch_own"] = (own - reference).abs().mean().item()
    out["mismatch_replay"] = (logp - reference).abs().mean().item()
    out["global_instances"] = len(RouterReplay.global_router_replay_instances)
    return out


def _replay_problems(out) -> list[str]:
    """Where the used experts are not the replayed ones (known rows) or the router's own (-1 rows), and
    where the agreement counts are not those of the own top-k against the replayed rows."""
    routing, used, own = out["mb_routing"].sort(-1).values, out["used"], out["own"]
    known = routing[..., :1] >= 0  # [L, T, 1]
    problems = [
        f"layer {layer}: {int((torch.where(known, routing, own) != used)[layer].any(-1).sum())} tokens not replayed"
        for layer in range(len(used))
        if not torch.equal(torch.where(known, routing, own)[layer], used[layer])
    ]
    agree = int(((own == routing).all(-1, keepdim=True) & known).sum())
    if (out["agree"], out["compared"]) != (agree, int(known.sum())):
        problems.append(f"agreement {out['agree']} / {out['compared']}, expected {agree} / {int(known.sum())}")
    return problems


@pytest.fixture(scope="module")
def replayed():
    """Per noise on the trainer's router weights (x their std): the replay run's figures."""
    return run_ranks(_runs, 1, 1, 1)[0]


def _runs(par):
    return {noise: _replay_rank(par, noise) for noise in (0.0, NOISE)} | {"recompute": _recompute_rank(par)}


@pytest.mark.megatron
@pytest.mark.slow
def test_replay_uses_the_recorded_experts_and_restores_the_logprobs(replayed):
    """Router noise makes the trainer's own top-k differ from the recorded one on >= 20% of the replayed
    positions; replaying the record, the layers use exactly the recorded experts (the router's own on the
    unknown rows) and the logprob mismatch to the generator drops >= 10x. Without noise: agreement 1 and
    the mismatch below 1e-5 (packed vs padded rows only)."""
    noisy, clean = replayed[NOISE], replayed[0.0]
    for out in (noisy, clean):
        assert _replay_problems(out) == []
        assert out["global_instances"] == 0  # never Megatron's class-level list
    assert noisy["agree"] / noisy["compared"] <= 0.8
    assert noisy["mismatch_replay"] * 10 <= noisy["mismatch_own"], (noisy["mismatch_replay"], noisy["mismatch_own"])
    assert clean["agree"] == clean["compared"] > 0
    assert clean["mismatch_replay"] < 1e-5 and clean["mismatch_own"] < 1e-5


def _recompute_rank(par) -> dict:
    """Two micro-batches through a replaying model as 1F1B runs them (forward 0, forward 1, backward 0,
    backward 1) under ppo.recompute none and full: the gradients, the counts and the FIFO's leftovers."""
    from areal_hpc.trainer import moe
    from areal_hpc.trainer.step import make_microbatch

    torch.manual_seed(0)
    generator = _moe_model(par)
    batch = random_batch(model_arch(ROUTER_MOE).vocab_size, n_seqs=4, seed=3, microbatches=[[[0, 1], [2, 3]]])
    batch.routing = _record(generator, batch)
    mbs = [make_microbatch(batch, ids, device=par.device, layers=[0, 1]) for ids in batch.microbatches[0]]
    out = {}
    for recompute in ("none", "full"):
        model = _moe_model(par, recompute, like=generator).train()
        _perturb_router(model, NOISE, seed=4)  # replayed experts differ from the router's own
        losses = [_logprobs(model, mb).sum() for mb in mbs]
        moe.set_targets(model, None)  # the backward passes must not need the targets of the forward
        for loss in losses:
            loss.backward()
        out[recompute] = {
            "grads": {name: p.grad.cpu().clone() for name, p in model.named_parameters()},
            "stats": moe.take_stats(model, len(mbs), False, 0).cpu(),
            "left": sum(len(r._recompute) for r in moe.routers(model)),
        }
    out["known"] = sum(int((mb.routing[..., 0] >= 0).sum()) for mb in mbs)
    return out


@pytest.mark.megatron
@pytest.mark.slow
def test_full_recompute_replays_the_forward_experts(replayed):
    """ppo.recompute=full re-runs each router in the backward pass, after later micro-batches' forwards:
    it replays each micro-batch's own targets (same gradients as without recompute), counts each row once,
    and the load-balancing loss once per layer and micro-batch."""
    out = replayed["recompute"]
    none, full = out["none"], out["full"]
    assert full["left"] == 0
    assert none["grads"].keys() == full["grads"].keys()
    for name, g in none["grads"].items():
        assert torch.allclose(full["grads"][name], g, atol=1e-6, rtol=1e-5), name
    router = [g for name, g in none["grads"].items() if name.endswith("router.weight")]
    assert router and all(g.abs().sum() > 0 for g in router)  # replay keeps the gate's gradient
    agree, compared, lb_sum, lb_n = full["stats"].tolist()
    assert torch.equal(full["stats"], none["stats"])
    assert compared == out["known"] and 0 < agree < compared
    assert lb_n == 2 * 2 and 0.9 < lb_sum / lb_n < 2.0  # 1: balanced over the experts


# --- the PPO step on the engine, at TP 2 (sequence parallel) and PP 2 ---


def _transformers_routing(model_dir, batch) -> np.ndarray:
    """[N, L, K] uint8: the top-k of transformers' router logits for each token of the batch (what the
    generator records for the same weights), the last token of each sequence unknown."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cu, parts = batch.cu_seqlens, []
    for a, b in zip(cu[:-1], cu[1:]):
        with torch.no_grad():
            logits = model(torch.from_numpy(batch.tokens[a:b].astype(np.int64))[None], output_router_logits=True)
        parts.append(torch.stack([x.topk(model.config.num_experts_per_tok).indices for x in logits.router_logits], 1))
    routing = torch.cat(parts).numpy().astype(np.uint8)
    routing[cu[1:] - 1] = UNKNOWN
    return routing


def _step_rank(par, model_dir, batch) -> dict | None:
    """One PPO step from the same weights with and without the batch's routing replayed, with the prox
    pass (replayed too) although the batch is one minibatch. Each rank but the first gets the batch's
    routing of its own stage's layers only, as the replica's first rank relays it (trainer.worker.stage_routing)."""
    from areal_hpc.arch import hf_arch
    from areal_hpc.config import PPOConfig
    from areal_hpc.trainer.convert import stage_layers
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, prox_pass, step_microbatches, train_minibatches

    if par.rank > 0:
        batch = batch.for_layers(*stage_layers(hf_arch(model_dir), par.coords.pp, par.grid.pp))
        assert batch.routing.shape[1] == hf_arch(model_dir).num_layers // par.grid.pp
    out = {}
    for replay in (True, False):
        engine = Engine(model_dir, par, PPOConfig(routing_replay=replay, lr=1e-3))
        step_batch = batch if replay else dataclasses.replace(batch, routing=None)
        minibatches = step_microbatches(engine, step_batch)
        prox_pass(engine, minibatches, StepConfig().temperature)
        out[replay] = train_minibatches(engine, int(step_batch.version), minibatches, StepConfig())
    return out if par.rank == 0 else None


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_ppo_step_replays_the_generators_routing(tmp_path, tp, pp):
    """The routing transformers computes for the tiny MoE, replayed by the PPO step with sequence
    parallelism (each TP rank its slice of the rows) or pipeline stages (each its layers): the trainer's
    own routers agree on every position (the layout is the router's), the step is the one without replay,
    and the load-balancing loss is reported."""
    from areal_hpc.data.tiny import build_tiny_model

    model = TINY_MOE
    model_dir = build_tiny_model(model, tmp_path, seed=3)
    batch = random_batch(model_arch(model).vocab_size, n_seqs=4, microbatches=[[[0, 1], [2, 3]]])
    batch.routing = _transformers_routing(model_dir, batch)
    out = run_ranks(_step_rank, tp * pp, tp, pp, str(model_dir), batch)[0]
    replayed, own = out[True], out[False]
    assert replayed.pop("ppo/routing_agreement") == 1.0 and "ppo/routing_agreement" not in own
    assert replayed == pytest.approx(own, rel=1e-6, abs=1e-7)
    assert 0.9 < replayed["ppo/load_balancing_loss"] < 2.0
