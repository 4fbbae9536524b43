"""Trainer checkpoints (Megatron dist_checkpointing, distributed optimizer): N steps, save, resume, M
steps equals N + M steps uninterrupted, weights and optimizer state, at (TP, PP, DP) = (1,1,1),
(1,1,2), (2,1,1), (1,2,1), and in bf16 at TP 2; a TP 2 checkpoint resumes at PP 2 with the same logits and the same next
step; a non-finite step stops before any weight changes and names the checkpoint it resumed from; a
save interrupted before its rename never looks complete; a MoE checkpoint is never resumed as a dense model
or the other way round (EP checkpoints: tests/test_moe_trainer.py)."""

from __future__ import annotations

import pytest
import torch

from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer import checkpoint as trainer_checkpoint
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import max_diff, pick, resume_problems
from tests.support.shapes import QWEN2
from tests.support.trainer_runs import load_rank, nonfinite_rank, resume_rank, save_rank

pytestmark = pytest.mark.megatron

OPTIM = PPOConfig(lr=1e-2, weight_decay=0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(QWEN2, tmp_path_factory.mktemp("model"), seed=5))


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,dp,dtype",
    [(1, 1, 1, "float32"), (1, 1, 2, "float32"), (2, 1, 1, "float32"), (1, 2, 1, "float32"), (2, 1, 1, "bfloat16")],
)
def test_resume_equals_uninterrupted(model_dir, tmp_path, tp, pp, dp, dtype):
    """bf16 as on GPUs: Float16Module around the stage, fp32 main weights in the optimizer."""
    step_dir = tmp_path / "step_2"
    if tp * pp * dp == 1:  # leftovers of a crashed save: must not survive nor be read
        (step_dir / ".trainer.partial").mkdir(parents=True)
        (step_dir / ".trainer.partial" / "common.pt").write_bytes(b"junk")
    args = (model_dir, step_dir, [0, 1], [2, 3], OPTIM, getattr(torch, dtype))
    results = run_ranks(resume_rank, tp * pp * dp, tp, pp, *args)
    # the loaded state is the saved one exactly (main weights, both Adam moments, Adam's step), and
    # the steps after it are the uninterrupted run's to float tolerance
    assert resume_problems(results, tol=1e-7) == []
    assert not (step_dir / ".trainer.partial").exists()
    assert trainer_checkpoint.manifest(step_dir / "trainer")["tp"] == tp


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_at_pipeline_parallel(model_dir, tmp_path):
    step_dir = tmp_path / "step_2"
    saved = run_ranks(save_rank, 2, 2, 1, model_dir, step_dir, [0, 1], [2], OPTIM)
    loaded = run_ranks(load_rank, 2, 1, 2, model_dir, step_dir, [2], OPTIM)
    assert max_diff(pick(saved, "logits"), pick(loaded, "logits")) <= 1e-5
    # The optimizer state resharded too: the next step lands where TP 2's did. Measured: 2e-5 (float
    # sums in another order, magnified by Adam where a gradient is near 0); with Adam's step reset
    # to 1 after the load 1.4e-2, with the moments lost 2.7e-2.
    assert max_diff(pick(saved, "weights"), pick(loaded, "weights")) <= 1e-4


@pytest.mark.slow
def test_nonfinite_step_stops_before_any_weight_changes(model_dir, tmp_path):
    step_dir = tmp_path / "step_1"
    r = run_ranks(nonfinite_rank, 1, 1, 1, model_dir, step_dir, OPTIM)[0]
    assert r["message"] is not None, "a NaN loss was trained on"
    assert "training step 4" in r["message"] and "loss is nan" in r["message"]
    assert f"resumed from {step_dir / 'trainer'}" in r["message"]
    assert r["moved"] == 0.0


def test_incomplete_checkpoint_is_refused(tmp_path):
    partial = tmp_path / "step_2" / "trainer"
    partial.mkdir(parents=True)
    (partial / "common.pt").write_bytes(b"")
    assert not trainer_checkpoint.is_complete(partial)
    with pytest.raises(FileNotFoundError, match="not a complete trainer checkpoint"):
        trainer_checkpoint.load(None, partial)


@pytest.mark.parametrize(
    "saved,now,why",
    [
        ({}, {"num_experts": 4}, "is qwen2 but model.path .* is qwen3_moe \\(4 experts\\)"),  # before MoE
        ({"num_experts": 4}, {}, "is qwen3_moe \\(4 experts\\) but model.path .* is qwen2"),
        (
            {"num_experts": 4},
            {"num_experts": 8},
            "is qwen3_moe \\(4 experts\\) but model.path .* is qwen3_moe \\(8 experts\\)",
        ),
    ],
)
def test_resume_refuses_moe_as_dense_and_the_other_way(tmp_path, saved, now, why):
    """A checkpoint of a MoE model resumed as a dense one (or the other way round, or with another expert
    count) is refused before anything loads, naming the model setting to fix."""
    import dataclasses
    import json
    from types import SimpleNamespace

    from areal_hpc.arch import QwenArch

    dense = QwenArch(128, 64, 256, 2, 2, 2, 32, 1e4, 1e-6, True, 512, qkv_bias=True, qk_norm=False)
    ckpt = tmp_path / "trainer"
    ckpt.mkdir()
    arch = dataclasses.asdict(dense)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        arch.pop(field)  # a manifest written before MoE
    (ckpt / trainer_checkpoint.MANIFEST).write_text(json.dumps({"arch": arch | saved}))
    engine = SimpleNamespace(arch=dataclasses.replace(dense, **now), model_dir=tmp_path / "model")
    with pytest.raises(ValueError, match=f"checkpoint {ckpt} {why}: resume with the model .*model.architecture"):
        trainer_checkpoint.load(engine, ckpt)
