"""Trainer checkpoints: resuming gives the same weights and optimizer state (the next step is
identical), and a save interrupted before its rename never looks complete."""

from __future__ import annotations

import pytest
import torch

from areal_hpc.config import ModelConfig
from areal_hpc.tiny import build_tiny_model
from areal_hpc.trainer import checkpoint
from areal_hpc.trainer.launch import run_ranks
from tests.test_trainer_step import make_batch

pytestmark = pytest.mark.megatron

MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _optimizer_state(engine) -> list[torch.Tensor]:
    sd = engine.optimizer.state_dict()
    tensors = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.clone())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(sd)
    return tensors


def _save_resume(par, model_dir, step_dir):
    from areal_hpc.trainer.engine import Engine, OptimConfig
    from areal_hpc.trainer.step import StepConfig, ppo_step

    optim = OptimConfig(lr=1e-2)
    batch = make_batch(MODEL.vocab_size)
    engine = Engine(model_dir, par, optim)
    ppo_step(engine, batch, StepConfig())
    if par.rank == 0:  # leftovers of a crashed save: must not survive nor be read
        (step_dir / ".trainer.partial").mkdir(parents=True)
        (step_dir / ".trainer.partial" / "rank00000.pt").write_bytes(b"junk")
    checkpoint.save(engine, step_dir)
    saved_weights = {k: v.clone() for k, v in engine.model.state_dict().items() if isinstance(v, torch.Tensor)}
    saved_optim = _optimizer_state(engine)
    batch2 = make_batch(MODEL.vocab_size, seed=1)
    stats = ppo_step(engine, batch2, StepConfig())
    after = engine.export_full()

    resumed = Engine(model_dir, par, optim)
    checkpoint.load(resumed, step_dir / "trainer")
    same_weights = all(torch.equal(resumed.model.state_dict()[k], v) for k, v in saved_weights.items())
    got_optim = _optimizer_state(resumed)
    same_optim = len(got_optim) == len(saved_optim) and all(torch.equal(a, b) for a, b in zip(got_optim, saved_optim))
    stats2 = ppo_step(resumed, batch2, StepConfig())
    after2 = resumed.export_full()
    if par.rank != 0:
        return {"same_weights": same_weights, "same_optim": same_optim}
    return {
        "same_weights": same_weights,
        "same_optim": same_optim,
        "stats": (stats, stats2),
        "after": (after, after2),
        "partial_left": (step_dir / ".trainer.partial").exists(),
    }


def test_resume_gives_the_same_weights_optimizer_and_next_step(tmp_path):
    model_dir = str(build_tiny_model(MODEL, tmp_path / "model", seed=5))
    step_dir = tmp_path / "checkpoints" / "step_1"
    results = run_ranks(_save_resume, 2, 1, 2, model_dir, step_dir)  # PP=2: tied embedding on both stages
    for r in results.values():
        assert r["same_weights"] and r["same_optim"]
    r = results[0]
    assert not r["partial_left"]
    assert checkpoint.is_complete(step_dir / "trainer")
    assert sorted(p.name for p in (step_dir / "trainer").iterdir()) == ["manifest.json", "rank00000.pt", "rank00001.pt"]
    stats, stats2 = r["stats"]
    assert stats == stats2
    after, after2 = r["after"]
    for k, v in after.items():
        assert torch.equal(v, after2[k]), k


def test_incomplete_checkpoint_is_refused(tmp_path):
    partial = tmp_path / "step_2" / "trainer"
    partial.mkdir(parents=True)
    (partial / "rank00000.pt").write_bytes(b"")
    assert not checkpoint.is_complete(partial)
    with pytest.raises(FileNotFoundError, match="not a complete trainer checkpoint"):
        checkpoint.load(None, partial)
