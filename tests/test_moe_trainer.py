"""Qwen3-MoE in the trainer: Hugging Face <-> Megatron at expert-parallel sizes 1 and 2 (logits equal
transformers', export round trip), PPO steps at EP 2 equal to EP 1 (the same data-parallel size), the
load-balancing loss reaching the router, a checkpoint written at EP 2 resumed exactly and loaded at
EP 1 (its export: tests/test_export.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer.convert import read_hf
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import export_problems, logits_problems, max_diff, pick, resume_problems
from tests.support.inputs import random_norms, revealing_optim
from tests.support.shapes import TRAINER_MOE
from tests.support.trainer_runs import hf_logits, logits_and_export_rank

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def build_moe_model(root: Path, norm_topk_prob: bool, seed: int) -> Path:
    """The tiny Qwen3-MoE (4 experts, top 2; per-expert tensor names), untied, with random norms and a
    router far from uniform: norms are all ones at init (a swapped norm would go unseen), and near-equal
    router scores would make the top-k hang on float rounding."""
    m = dataclasses.replace(TRAINER_MOE, norm_topk_prob=norm_topk_prob)
    model_dir = build_tiny_model(m, root, seed=seed)
    random_norms(model_dir, seed, router_std=0.5)
    return model_dir


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {
        "norm": build_moe_model(root, norm_topk_prob=True, seed=3),
        "softmax": build_moe_model(root, norm_topk_prob=False, seed=4),
    }


@functools.cache
def _hf_logits(model_dir: str):
    return hf_logits(model_dir)


def test_checkpoint_has_per_expert_names(moe_models):
    names = set(read_hf(moe_models["norm"]))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert json.loads((moe_models["norm"] / "config.json").read_text())["model_type"] == "qwen3_moe"


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_logits_match_transformers_and_export_round_trips(moe_models, tp, pp, ep):
    """Both routers (Qwen's renormalised top-k and plain softmax top-k), 2 data-parallel ranks split into
    `ep` expert ranks (with TP 2: 4 expert ranks' worth of TP x DP ranks, sequence parallel; with PP 2:
    experts of each stage): logits of transformers (fp32, 1e-5), and the export is the checkpoint."""
    dirs = {k: str(v) for k, v in moe_models.items()}
    results = run_ranks(logits_and_export_rank, 2 * tp * pp, tp, pp, dirs, PPOConfig(), ep=ep)
    last = [r for r, v in results.items() if "norm/logits" in v]
    assert len(last) == 2  # the last stage's TP rank 0 of each data-parallel rank
    for name, model_dir in dirs.items():
        for rank in last:  # each data-parallel rank runs the probes through every expert
            assert logits_problems(results[rank][f"{name}/logits"], _hf_logits(model_dir), tol=1e-5) == [], name
        assert export_problems(pick(results, f"{name}/weights"), read_hf(model_dir)) == [], name


def _ppo_rank(par, model_dir: str, steps: int, coefs: list) -> dict:
    """Per load-balancing coefficient (fresh weights each): `steps` PPO steps (each data-parallel rank its
    own batches), their stats and the weights after them."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step
    from tests.support.inputs import random_batch

    out = {}
    for coef in coefs:
        clear_aux_losses_tracker()
        engine = Engine(model_dir, par, revealing_optim(load_balancing_coef=coef))
        assert len(engine.adams) == 2  # Megatron's chain at every ep: dense and expert parameters
        vocab = engine.arch.vocab_size
        stats, weights = [], []
        for s in range(steps):
            stats.append(ppo_step(engine, random_batch(vocab, seed=100 * s + par.coords.dp), StepConfig()))
            weights.append(engine.export_full())
        if par.rank == 0:
            out[coef] = {"stats": stats, "weights": weights}
    return out or None


@pytest.fixture(scope="module")
def trained(moe_models):
    """3 PPO steps on 2 data-parallel ranks at EP 1 and at EP 2, with config.json's load-balancing
    coefficient (0.001) and with 0 (none); the weights after each step."""
    model_dir = str(moe_models["norm"])
    out = {ep: run_ranks(_ppo_rank, 2, 1, 1, model_dir, 3, [None, 0.0], ep=ep)[0] for ep in (1, 2)}
    return out | {"model_dir": model_dir}


def test_ppo_steps_at_ep2_equal_ep1(trained):
    """The "done" test of expert parallelism: same losses and weights at EP 2 as at EP 1 (same DP)."""
    one, two = trained[1][None], trained[2][None]
    for a, b in zip(one["stats"], two["stats"], strict=True):
        assert a["ppo/loss"] == pytest.approx(b["ppo/loss"], abs=1e-6)
        assert a["ppo/grad_norm"] == pytest.approx(b["ppo/grad_norm"], rel=1e-5)
    assert max_diff(one["weights"], two["weights"]) < 1e-5  # about 1e-7 seen
    # and the steps moved every weight, the experts and routers among them (by 1e-3 or more)
    start = read_hf(trained["model_dir"])
    still = [k for k, v in start.items() if (one["weights"][-1][k] - v).abs().max() <= 1e-4]
    assert still == []


def test_load_balancing_loss_reaches_the_router(trained):
    """The load-balancing loss is reported (> 0 at every step) and changes the router's update."""
    for ep in (1, 2):
        assert all(s["ppo/load_balancing_loss"] > 0 for s in trained[ep][None]["stats"])
        assert all("ppo/load_balancing_loss" not in s for s in trained[ep][0.0]["stats"])  # coefficient 0: none
        # after the first step: the same batch, the same main loss; only the load-balancing loss differs
        with_lb, without = trained[ep][None]["weights"][0], trained[ep][0.0]["weights"][0]
        gates = [k for k in with_lb if k.endswith("mlp.gate.weight")]
        assert gates and all((with_lb[k] - without[k]).abs().max() > 1e-6 for k in gates)


def test_checkpoint_at_ep2_resumes_and_loads_at_ep1(moe_models, tmp_path):
    """Megatron's chain of two optimizers saved and loaded: N steps, save, M steps at EP 2 equals the
    resumed run; the same checkpoint loads at EP 1 with the same logits and the same next step."""
    from tests.support.trainer_runs import load_rank, resume_rank, save_rank

    model_dir, optim = str(moe_models["norm"]), PPOConfig(lr=1e-2, weight_decay=0.01)
    results = run_ranks(resume_rank, 2, 1, 1, model_dir, tmp_path / "resume", [0, 1], [2, 3], optim, ep=2)
    assert resume_problems(results, tol=1e-7) == []
    saved = run_ranks(save_rank, 2, 1, 1, model_dir, tmp_path / "step_2", [0, 1], [2], optim, ep=2)
    loaded = run_ranks(load_rank, 2, 1, 1, model_dir, tmp_path / "step_2", [2], optim, ep=1)
    assert max_diff(saved[0]["logits"], loaded[0]["logits"]) <= 1e-5
    assert max_diff(pick(saved, "weights"), pick(loaded, "weights")) <= 1e-4
