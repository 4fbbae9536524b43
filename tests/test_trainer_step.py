"""The PPO step on real Megatron ranks: TP=2, PP=2 and DP=2 give the loss and updated weights of
TP=1, PP=1; gradient accumulation and overlapping the gradient reduce with the backward pass
do not change the result; packed sequences get the logprobs they get alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areal_hpc.arch import model_arch
from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.protocol import TrainBatch
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import assert_same_step
from tests.support.inputs import random_batch, revealing_optim, shard
from tests.support.shapes import QWEN2

VOCAB = model_arch(QWEN2).vocab_size

pytestmark = pytest.mark.megatron


def _train(par, model_dir, variants, logprobs=False):
    """One PPO step per variant (fresh weights each); per variant the stats and the exported weights.

    A variant: (one batch per data-parallel rank, StepConfig fields[, PPOConfig fields])."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    out = {}
    for name, (batches, step_cfg, *ppo) in variants.items():
        engine = Engine(model_dir, par, revealing_optim(**(ppo[0] if ppo else {})))
        batch = batches[par.coords.dp]
        stats = ppo_step(engine, batch, StepConfig(**step_cfg))
        weights = engine.export_full()
        out[name] = {"stats": stats, "weights": weights and {k: v.cpu() for k, v in weights.items()}}
    if logprobs:
        out["logprobs"] = _logprobs(par, model_dir, variants["packed"][0][0])
    return out if par.rank == 0 else None


def _logprobs(par, model_dir, batch):
    """Logprobs of sequences 0..2 packed in one micro-batch, and each alone."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import compute_logprobs, make_microbatch

    engine = Engine(model_dir, par, revealing_optim())
    packed = compute_logprobs(engine, [make_microbatch(batch, [0, 1, 2], device=par.device)], 0.7)
    alone = compute_logprobs(engine, [make_microbatch(batch, [i], device=par.device) for i in range(3)], 0.7)
    mask = make_microbatch(batch, [0, 1, 2]).loss_mask
    return {"packed": packed[0].cpu(), "alone": torch.cat(alone).cpu(), "mask": mask}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(QWEN2, tmp_path_factory.mktemp("model"), seed=5))


EQUAL = 3
"""Trained tokens of every sequence of the `equal` batch (the shortest answer of `random_batch(VOCAB)`)."""
LOSS_VARIANTS = {
    "gspo": {"policy_loss": "gspo", "loss_agg": "seq_mean_token_mean", "eps_clip": 0.01},
    "cispo": {
        "policy_loss": "cispo",
        "loss_agg": "seq_mean_token_sum",
        "seq_tokens": 16,
        "behav_weight_cap": (0.5, 40),
    },
}
"""Policy losses and aggregations the trainer must run as `algo.ppo` computes them, whatever the packing."""


@pytest.fixture(scope="module")
def reference(model_dir):
    batch = random_batch(VOCAB)
    regrouped = TrainBatch(**{**batch.__dict__, "microbatches": [[[0], [1], [2]], [[3, 4], [5]]]})
    one_minibatch = TrainBatch(**{**batch.__dict__, "microbatches": [[[0, 1], [2], [3], [4, 5]]]})
    variants = {
        "packed": ([batch], {}),
        "regrouped": ([regrouped], {}),
        "recompute-1": ([one_minibatch], {}),
        "loglinear-1": ([one_minibatch], {"prox_logp": "loglinear"}),
        "loglinear": ([batch], {"prox_logp": "loglinear"}),
        "recompute-selective": ([batch], {}, {"recompute": "selective"}),
        "recompute-full": ([batch], {}, {"recompute": "full"}),
    }
    for name, settings in LOSS_VARIANTS.items():
        variants[name] = ([batch], settings)
        variants[f"{name}-regrouped"] = ([regrouped], settings)
    # Every sequence trains EQUAL tokens: a mean over sequences of token means, or of token sums over EQUAL,
    # is the token mean, which pins the count the trainer hands Megatron (sequences) independently.
    cu, mask = batch.cu_seqlens, batch.loss_mask.copy()
    for a, b in zip(cu[:-1], cu[1:]):
        mask[a : b - EQUAL] = 0
    assert [int(mask[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])] == [EQUAL] * (len(cu) - 1)
    equal = TrainBatch(**{**batch.__dict__, "loss_mask": mask})
    variants["equal"] = ([equal], {})
    variants["equal-seq_mean_token_mean"] = ([equal], {"loss_agg": "seq_mean_token_mean"})
    variants["equal-seq_mean_token_sum"] = ([equal], {"loss_agg": "seq_mean_token_sum", "seq_tokens": EQUAL})
    return run_ranks(_train, 1, 1, 1, model_dir, variants, True)[0]


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    untied = dataclasses.replace(QWEN2, tie_word_embeddings=False)
    return str(build_tiny_model(untied, tmp_path_factory.mktemp("untied"), seed=6))


@pytest.mark.slow
def test_step_changes_weights_and_reports_stats(reference, model_dir):
    from areal_hpc.trainer.convert import read_hf

    got = reference["packed"]
    before = read_hf(model_dir)
    assert max((got["weights"][k] - v).abs().max().item() for k, v in before.items()) > 1e-3
    s = got["stats"]
    assert s["ppo/tokens"] > 0 and s["ppo/grad_norm"] > 0 and 0 <= s["ppo/clip_frac"] <= 1
    # behav logprobs are random here: prox (the model's own) differs from them
    assert s["ppo/logp_mismatch"] > 0.1 and s["ppo/behav_weight_mean"] > 1


def test_regrouping_gives_the_same_step(reference):
    """(Padded rows and the prox pass with one minibatch: tools/bench_trainer.py's steps, in test_tools.)"""
    assert_same_step(reference["regrouped"], reference["packed"])


@pytest.mark.parametrize("name", LOSS_VARIANTS)
def test_policy_losses_and_aggregations_do_not_depend_on_the_packing(reference, name):
    """Sequence-level ratios and means over sequences, per micro-batch as Megatron sums them: the step of
    one packing is the step of another; and each variant is a different step from the default."""
    assert_same_step(reference[f"{name}-regrouped"], reference[name])
    got, default = reference[name]["stats"], reference["packed"]["stats"]
    assert got["ppo/loss"] != pytest.approx(default["ppo/loss"], rel=1e-3)
    if "behav_weight_cap" in LOSS_VARIANTS[name]:  # the random behaviour logprobs put some weights out of range
        assert 0 < got["ppo/behav_masked_frac"] < 1
    else:
        assert "ppo/behav_masked_frac" not in got


def test_means_over_sequences_of_equal_answers_are_the_token_mean(reference):
    """With every answer EQUAL tokens long, both per-sequence aggregations are the token mean: the trainer
    divides by the sequences it counts, not by their tokens."""
    assert_same_step(reference["equal-seq_mean_token_mean"], reference["equal"])
    assert_same_step(reference["equal-seq_mean_token_sum"], reference["equal"])


def test_loglinear_prox_is_exact_on_the_first_minibatch_only(reference):
    """With one minibatch the interpolated prox is the recomputed one; with two it is an approximation."""
    assert_same_step(reference["loglinear-1"], reference["recompute-1"])
    approx, exact = reference["loglinear"]["stats"], reference["packed"]["stats"]
    assert approx["ppo/loss"] != pytest.approx(exact["ppo/loss"], rel=1e-6)


def test_activation_recompute_gives_the_same_step(reference):
    """Megatron's selective and full recompute change what is kept for the backward pass, not the result."""
    assert_same_step(reference["recompute-selective"], reference["packed"])
    assert_same_step(reference["recompute-full"], reference["packed"])


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_step_equals_single_rank(reference, model_dir, tp, pp):
    """At TP 2 with and without sequence parallelism (rows padded to even widths), and with full recompute."""
    batch = random_batch(VOCAB)
    variants = {
        "packed": ([batch], {}),
        "no-sequence-parallel": ([batch], {}, {"sequence_parallel": False}),
        "recompute-full": ([batch], {}, {"recompute": "full"}),
    }
    variants |= {name: ([batch], settings) for name, settings in LOSS_VARIANTS.items()}
    got = run_ranks(_train, tp * pp, tp, pp, model_dir, variants)[0]
    for name in variants:
        assert_same_step(got[name], reference[name if name in LOSS_VARIANTS else "packed"])


@pytest.mark.slow
def test_data_parallel_step_equals_single_rank(reference, model_dir):
    """Two DP ranks with half the sequences each: every token still weighs the same."""
    batch = random_batch(VOCAB)
    shards = [shard(batch, [0, 1, 3], [[[0, 1]], [[3]]]), shard(batch, [2, 4, 5], [[[2]], [[4, 5]]])]
    variants = {"packed": (shards, {})} | {name: (shards, settings) for name, settings in LOSS_VARIANTS.items()}
    got = run_ranks(_train, 2, 1, 1, model_dir, variants)[0]
    for name in variants:  # means over sequences too: each rank's count of them is summed with the others'
        assert_same_step(got[name], reference[name])


def _overlap_rank(par, model_dirs):
    """Per model: two PPO steps of two minibatches each, with the data-parallel gradient reduce after the
    backward pass and overlapped with it; the last step's stats, the weights after both, and whether
    every bucket's reduce waited for its gradients in DDP's backward hooks (the overlapped path)."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    out = {}
    for name, model_dir in model_dirs.items():
        for overlap in (False, True):
            engine = Engine(model_dir, par, revealing_optim(), overlap_grad_reduce=overlap)
            batches = [random_batch(VOCAB, seed=10 * s + par.coords.dp) for s in range(2)]
            stats = [ppo_step(engine, batch, StepConfig()) for batch in batches][-1]
            weights = engine.export_full()
            hooked = all(g.golden_per_param_grad_ready_counts for g in engine.model.bucket_groups)
            out[name, overlap] = {"stats": stats, "weights": weights and {k: v.cpu() for k, v in weights.items()}}
            out[name, overlap, "hooked"] = hooked
    return out if par.rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_overlapped_gradient_reduce_gives_the_same_steps(model_dir, untied_model_dir, tp, pp):
    """DP 2 at TP 2 (sequence parallel) and at PP 2 (the last stage's copy of a tied output weight), tied
    and untied: the output weight's gradient, written into Megatron's main_grad by the chunked logprobs,
    reaches the overlapped reduce as every other gradient does."""
    got = run_ranks(_overlap_rank, 2 * tp * pp, tp, pp, {"tied": model_dir, "untied": untied_model_dir})[0]
    for name in ("tied", "untied"):
        assert not got[name, False, "hooked"] and got[name, True, "hooked"], name
        assert_same_step(got[name, True], got[name, False])


def test_packed_sequence_gets_its_logprobs_alone(reference):
    got = reference["logprobs"]
    mask = got["mask"]
    assert (got["packed"][mask] - got["alone"][mask]).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_learning_rate_schedule_is_megatrons_by_step(model_dir):
    """ppo.lr_warmup_steps and ppo.lr_decay through Megatron's OptimizerParamScheduler: linear warmup
    from 0, then cosine to min_lr at the last step; a function of the step alone (a resumed run goes on
    where it was), and the rate Adam steps with."""
    warm = PPOConfig(lr=1e-3, lr_warmup_steps=4, lr_decay="cosine", min_lr=1e-4)
    rates, constant = run_ranks(_schedule_rank, 1, 1, 1, model_dir, [warm, PPOConfig(lr=1e-3)], 20)[0]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # steps 1..4 warm up from 0
    assert all(a > b for a, b in zip(rates[3:], rates[4:]))  # then decay
    assert rates[-1] == pytest.approx(1e-4)  # to min_lr at train.total_steps
    assert constant == [1e-3] * 20


def _schedule_rank(par, model_dir, settings, total):
    from areal_hpc.trainer.engine import Engine

    out = []
    for ppo in settings:
        engine = Engine(model_dir, par, ppo, total_steps=total)
        rates = {v: engine.set_step(v) for v in reversed(range(total))}  # any order: the step decides
        engine.set_step(2)
        (adam,) = engine.adams  # a dense model: one optimizer
        assert {g["lr"] for g in adam.param_groups} == {rates[2]}  # what Adam steps with
        # Megatron's weight decay: none on biases and norms (wd_mult 0), ppo.weight_decay elsewhere
        decays = {(g["wd_mult"], g["weight_decay"]) for g in adam.param_groups}
        assert decays == {(0.0, 0.0), (1.0, ppo.weight_decay)}, decays
        out.append([rates[v] for v in range(total)])
    return out


def _entropy_rank(par, model_dir, temperature):
    """Each token's entropy from the chunked logprob function and from the full logits of the same
    forward pass; and ppo/entropy of a step over the same sequences (one minibatch: its forward passes
    run on these weights)."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, _logprobs, make_microbatch, ppo_step
    from tests.support.trainer_runs import full_logits

    engine = Engine(model_dir, par, revealing_optim())
    sp = engine.config.sequence_parallel
    batch = random_batch(VOCAB, microbatches=[[[0, 1, 2], [3, 4, 5]]])
    mb = make_microbatch(batch, list(range(6)), device=par.device, multiple=par.grid.tp if sp else 1)
    got = {}

    def forward_step(it, model):
        m = next(it)

        def keep(output):
            weight = engine.stage.output_weight()
            got["chunked"] = _logprobs(m, weight, sp, output, temperature)[1]
            got["logits"] = full_logits(output, weight, sp)[m.where]  # [n, V]
            return output.sum() * 0, torch.tensor(0, dtype=torch.int, device=output.device), {}

        return m.rows.forward(model), keep

    engine.forward_backward([mb], forward_step, forward_only=True, seq_length=mb.width)
    stats = ppo_step(engine, batch, StepConfig(temperature=temperature))
    if par.rank != 0:
        return None
    logp = torch.log_softmax(got["logits"].double() / temperature, dim=-1)
    direct = -(logp.exp() * logp).sum(-1)
    return {"chunked": got["chunked"].cpu(), "direct": direct.cpu(), "mask": mb.loss_mask.cpu(), "stats": stats}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_entropy_is_that_of_the_full_logits(model_dir, tp):
    """ppo/entropy: each token's entropy from the chunked (vocabulary-parallel) logprob function equals
    the one from the whole vocabulary's logits, and the step reports its mean over the trained tokens."""
    got = run_ranks(_entropy_rank, tp, tp, 1, model_dir, 0.7)[0]
    torch.testing.assert_close(got["chunked"].double(), got["direct"], rtol=1e-5, atol=1e-5)
    mask = got["mask"]
    want = got["direct"][mask].mean().item()
    assert 0 < want < torch.log(torch.tensor(float(VOCAB))).item()
    assert got["stats"]["ppo/entropy"] == pytest.approx(want, rel=1e-5)


def _tensors(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _kl_rank(par, model_dir, ckpt_dir):
    """Steps with ppo.kl_coef > 0, save, resume: this rank's reference and policy weights on the way."""
    from pathlib import Path

    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    ppo, cfg = PPOConfig(lr=1e-2, kl_coef=0.5), StepConfig(kl_coef=0.5)
    engine = Engine(model_dir, par, ppo)
    assert Engine(model_dir, par, PPOConfig()).reference is None  # off: nothing built
    initial, ref0 = _tensors(engine.stage), _tensors(engine.reference)
    # step 0, one minibatch: its forward passes run on the initial weights, which the reference holds
    stats = [ppo_step(engine, random_batch(VOCAB, microbatches=[[[0, 1, 2], [3, 4, 5]]]), cfg)]
    stats += [ppo_step(engine, random_batch(VOCAB, seed=s), cfg) for s in (1, 2)]
    trainer_checkpoint.save(engine, ckpt_dir)
    resumed = Engine(model_dir, par, ppo)
    trainer_checkpoint.load(resumed, Path(ckpt_dir) / "trainer")
    return {
        "stats": stats,
        "reference_is_initial": _diff(ref0, initial),
        "reference_after_steps": _diff(_tensors(engine.reference), ref0),
        "policy_after_steps": _diff(_tensors(engine.stage), ref0),
        "resumed_reference": _diff(_tensors(resumed.reference), ref0),
        "resumed_policy": _diff(_tensors(resumed.stage), _tensors(engine.stage)),
    }


@pytest.mark.slow
def test_kl_penalty_to_the_initial_policy(model_dir, tmp_path):
    """ppo.kl_coef > 0 at PP 2: the reference is the initial policy (ppo/kl 0 at step 0), stays frozen while
    the policy moves (ppo/kl > 0 after), and a resume rebuilds it from the initial weights, not the
    checkpoint's."""
    got = run_ranks(_kl_rank, 2, 1, 2, model_dir, tmp_path / "step_3")
    for rank in got.values():
        assert rank["reference_is_initial"] == 0.0
        assert rank["reference_after_steps"] == 0.0 and rank["policy_after_steps"] > 1e-3
        assert rank["resumed_reference"] == 0.0 and rank["resumed_policy"] == 0.0
    kl = [s["ppo/kl"] for s in got[0]["stats"]]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)
    assert min(kl[1:]) > 1e-6
