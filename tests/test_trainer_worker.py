"""The trainer ranks' entry `areal_hpc.trainer.worker.serve` in a real MPI world (mpirun, 6 ranks):
a controller rank drives TrainBatch -> TrainResult, WeightSync (both pipeline stages broadcast their
Hugging Face weights to two generator ranks through the real weight-sync groups), Save -> Saved,
Stop."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.helpers import MPI_PROGRAMS

pytestmark = [pytest.mark.mpi, pytest.mark.megatron]


def test_trainer_ranks_serve_a_controller(run_mpi, tmp_path):
    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.convert import read_hf

    proc = run_mpi(MPI_PROGRAMS / "trainer_world.py", n=6, timeout=300, args=[str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ctrl = json.loads((tmp_path / "controller.json").read_text())
    assert ctrl["version"] == 1
    assert ctrl["saved"] == [4, 5]
    for key in ("ppo/loss", "ppo/clip_frac", "ppo/grad_norm", "ppo/behav_weight_mean", "ppo/logp_mismatch"):
        assert isinstance(ctrl["stats"][key], float)
    assert ctrl["stats"]["ppo/grad_norm"] > 0
    assert trainer_checkpoint.is_complete(tmp_path / "step_1" / "trainer")
    # both generators got every Hugging Face tensor (both stages), trained, identical on both
    initial = read_hf(next((tmp_path / "root" / ".assets").glob("tiny-model-*")))
    got2, got3 = torch.load(tmp_path / "gen2.pt"), torch.load(tmp_path / "gen3.pt")
    assert sorted(got2) == sorted(initial) == sorted(got3)
    for name, w in initial.items():
        assert got2[name].shape == w.shape and torch.equal(got2[name], got3[name])
    assert any(not torch.equal(got2[n], w) for n, w in initial.items())
