"""Checkpoints of a LoRA trainer (areal_hpc/trainer/checkpoint.py, trainer/lora.py): the adapters and their
optimizer state only, the base by reference (its path and identity in the manifest). Resumed, the steps
after the save are the uninterrupted run's; written at TP 2, it loads at PP 2 and takes the same steps; a
checkpoint is refused by an engine of another rank, by full training, or on another base, naming why."""

from __future__ import annotations

import pytest
import torch

from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer import checkpoint as trainer_checkpoint
from areal_hpc.trainer.lora import LoraSpec
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import max_diff, pick, resume_problems
from tests.support.shapes import QWEN2
from tests.support.trainer_runs import load_rank, resume_rank

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

OPTIM = PPOConfig(lr=1e-2, weight_decay=0.01)
SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(QWEN2, tmp_path_factory.mktemp("model"), seed=5))


@pytest.fixture(scope="module")
def tp2(model_dir, tmp_path_factory):
    """Two steps at TP 2, a checkpoint, two more; then the same two resumed from it by a fresh engine."""
    step_dir = tmp_path_factory.mktemp("run") / "step_2"
    return step_dir, run_ranks(resume_rank, 2, 2, 1, model_dir, step_dir, [0, 1], [2, 3], OPTIM, torch.float32, SPEC)


def test_resume_equals_uninterrupted_and_the_checkpoint_holds_the_adapters_alone(model_dir, tp2):
    step_dir, results = tp2
    assert resume_problems(results, tol=1e-7) == []
    assert max_diff(pick(results, "weights"), pick(results, "resumed_weights")) < 1e-7
    assert all(".lora_" in k for k in pick(results, "weights"))
    written = trainer_checkpoint.manifest(step_dir / "trainer")
    assert written["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(SPEC.targets)}
    assert written["base"] == trainer_checkpoint.base_identity(model_dir)
    # the adapters, their main weights and Adam moments, nothing of the base
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(step_dir / "trainer")).read_metadata().state_dict_metadata
    assert keys and all("lora.layers." in k for k in keys), sorted(keys)[:5]


def test_a_tensor_parallel_checkpoint_resumes_at_pipeline_parallel(model_dir, tp2):
    """The TP 2 checkpoint loaded at PP 2: the same two steps land where TP 2's uninterrupted ones did (as
    full weights do: float sums in another order, magnified by Adam; see test_trainer_checkpoint)."""
    step_dir, results = tp2
    loaded = run_ranks(load_rank, 2, 1, 2, model_dir, step_dir, [2, 3], OPTIM, SPEC)
    assert max_diff(pick(results, "weights"), pick(loaded, "weights")) <= 1e-4


def _refusals_rank(par, model_dir, other_dir, step_dir):
    from areal_hpc.trainer.engine import Engine

    out = {}
    for name, (path, spec) in {
        "rank": (model_dir, LoraSpec(8, 8.0)),
        "full": (model_dir, None),
        "base": (other_dir, SPEC),
    }.items():
        try:
            trainer_checkpoint.load(Engine(path, par, OPTIM, lora=spec), step_dir / "trainer")
            out[name] = "loaded"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_another_rank_full_training_or_another_base_is_refused(model_dir, tp2, tmp_path):
    step_dir, _ = tp2
    other = str(build_tiny_model(QWEN2, tmp_path / "other", seed=6))
    got = run_ranks(_refusals_rank, 1, 1, 1, model_dir, other, step_dir)[0]
    assert (
        "trains LoRA adapters of rank 4 on" in got["rank"] and "this run trains LoRA adapters of rank 8" in got["rank"]
    )
    assert "this run trains the whole model" in got["full"]
    assert "is another model (the weight files differ)" in got["base"] and other in got["base"], got["base"]
