"""The whole system as one heterogeneous Slurm job: `areal-hpc submit configs/tiny-cpu.yaml --nodes 3` on
the local test cluster (controller + reward worker on node1, the generator on node2, two trainers on
node3-4), run to the end, then `areal-hpc status` reads its metrics."""

import json
import os
import subprocess
import sys

import pytest

from launch.record import JobRecord
from tests.test_slurm import REPO, slurm_cluster, wait_done  # noqa: F401 - slurm_cluster is a fixture

pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.mpi, pytest.mark.vllm, pytest.mark.megatron]
pytestmark.append(pytest.mark.slow)

SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_concurrent=8",
    "rollout.max_staleness=1",
    "rollout.max_new_tokens=8",
    "ppo.minibatches=2",
    "train.total_steps=3",
    "train.save_every=100",
]


def test_submit_tiny_cpu_runs_to_the_end(slurm_cluster, tmp_path):  # noqa: F811
    # OMPI_MCA_btl: only because the fake nodes share one host (sbatch passes the environment on)
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp"}
    cmd = [sys.executable, "-m", "areal_hpc.cli", "submit", "configs/tiny-cpu.yaml", "--nodes", "3"]
    cmd += [f"experiment.root={tmp_path}", *SMALL]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "submitted job" in out.stdout
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    record = JobRecord.load(run_dir)
    try:
        state = wait_done(run_dir, 480)
    finally:
        subprocess.run(["scancel", record.job_id], capture_output=True)
    logs = run_dir / "logs" / f"slurm-{record.job_id}" / "attempt-0"
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
    assert state == "COMPLETED", tails
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward/mean" in r and "ppo/loss" in r for r in rows)
    status = subprocess.run(
        [sys.executable, "-m", "areal_hpc.cli", "status", str(run_dir)], capture_output=True, text=True, env=env
    )
    assert "COMPLETED" in status.stdout and "last step: 3" in status.stdout, status.stdout
