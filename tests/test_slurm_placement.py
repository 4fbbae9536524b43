"""GPU placement on a real Slurm: the local test cluster (tools/local_slurm.sh), whose fake GPUs are gres
backed by character devices, so that Slurm hands them out and sets CUDA_VISIBLE_DEVICES, and torch finds
no GPU behind them.

Every rank runs the real entry point, `python -m areal_hpc.main RUN_DIR --placement`, in the one srun
step of the heterogeneous job: it checks that Slurm put it where the layout says, narrows
CUDA_VISIBLE_DEVICES, logs its role, host and GPUs first, resolves cluster.device auto (cpu here) and
leaves. A job holding GPUs 0,1 of every node beside it makes Slurm give the run GPUs 2,3: each rank
must take its entries of that list, not the indices themselves.
"""

import re
import subprocess
import sys

import pytest

from areal_hpc.config import load_config
from areal_hpc.layout import Layout
from areal_hpc.main import PLACEMENT_FLAG
from areal_hpc.rundir import log_path
from launch.record import JobRecord
from launch.slurm import SlurmLauncher
from tests.helpers import TINY, wait_done, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

FIRST_LINE = re.compile(
    r" INFO (?P<name>\w+ \d+ \(world rank \d+\)) on host \S+, Slurm node (?P<node>\S+): "
    r"(?P<component>\w+) node (?P<cnode>\d+), GPUs (?P<gpus>\S+) of (?P<given>\S+) \(pid \d+\)$"
)


def _gpus(text: str) -> list[str]:
    return [] if text == "none" else text.split(",")


def test_each_rank_logs_and_takes_the_gpus_the_layout_gives_it(slurm_cluster, tmp_path, monkeypatch):
    # only because the fake nodes share one host: OpenMPI's shared-memory segments collide
    monkeypatch.setenv("OMPI_MCA_btl", "self,tcp")
    beside = subprocess.run(
        ["sbatch", "--parsable", "-N4", "--ntasks-per-node=1", "--gpus-per-node=2", "--time=5", "-o", "/dev/null"]
        + ["--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # controller + 1 reward worker | 1 node x 2 generators | 2 nodes x 2 trainers; 2 GPUs per node
    cfg = load_config(
        TINY, ["cluster.nodes=3", "cluster.gpus_per_node=2", "cluster.exclusive=false", f"experiment.root={tmp_path}"]
    )
    assert cfg.cluster.device == "auto"
    run_dir = cfg.run_dir.resolve()
    job_id = None
    try:
        squeue = ["squeue", "-h", "-j", beside, "-o", "%T"]
        wait_for(
            lambda: subprocess.run(squeue, capture_output=True, text=True).stdout.strip() == "RUNNING",
            60,
            "GPUs 0,1 taken",
        )
        command = [sys.executable, "-u", "-m", "areal_hpc.main", str(run_dir), PLACEMENT_FLAG]
        job_id = SlurmLauncher(command=command).submit(cfg)
        state = wait_done(run_dir, 240)
    finally:
        subprocess.run(["scancel", beside, *([job_id] if job_id else [])], capture_output=True)
    attempt = run_dir / "logs" / f"slurm-{JobRecord.load(run_dir).job_id}" / "attempt-0"
    assert state == "COMPLETED", "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in attempt.glob("*.log"))

    layout = Layout.from_config(cfg)
    held = {}  # Slurm node -> the GPUs its ranks took
    for rank in range(layout.world_size):
        role, place = layout.role_of(rank), layout.placement(rank)
        log = log_path(run_dir, role.name.lower(), rank - layout.ranks(role).start).read_text().splitlines()
        first = FIRST_LINE.search(log[0])
        assert first, log[0]
        assert (first["name"], first["component"], int(first["cnode"])) == (
            layout.describe_rank(rank),
            place.component,
            place.node,
        )
        given, gpus = _gpus(first["given"]), _gpus(first["gpus"])
        if place.gpus:
            assert given == ["2", "3"], "Slurm gave the run the GPUs the other job left"
            assert gpus == [given[i] for i in place.gpus]
        else:
            assert given == gpus == []  # the controller's node has no GPU
        held.setdefault(first["node"], []).extend(gpus)
        assert any(f"{first['name']} device cpu (cluster.device auto)" in line for line in log[1:4]), log[:4]
    assert len(held) == 4  # the controller's node, the generators' and the two trainer nodes
    assert sorted(map(sorted, held.values())) == [[], ["2", "3"], ["2", "3"], ["2", "3"]]  # no GPU twice
