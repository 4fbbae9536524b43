"""GPU and CPU placement on a real Slurm: the local test cluster (tools/local_slurm.sh), whose fake GPUs are
gres backed by character devices, so that Slurm hands them out and sets CUDA_VISIBLE_DEVICES, and torch
finds no GPU behind them.

Every rank runs the real entry point, `python -m areal_hpc.main RUN_DIR --placement`, in the one srun
step of the heterogeneous job: it checks that Slurm put it where the layout says, narrows
CUDA_VISIBLE_DEVICES, logs its role, host and GPUs first, then its CPUs and OMP_NUM_THREADS, resolves
cluster.device auto (cpu here) and leaves. A job holding GPUs 0,1 and a CPU of every node beside it
makes Slurm give the run GPUs 2,3: each rank must take its entries of that list, not the indices
themselves; and each generator and trainer task gets its share of the node's CPUs the job asked for.
"""

import os
import re
import subprocess
import sys

import pytest

from areal_hpc.config import load_config
from areal_hpc.launch.record import JobRecord
from areal_hpc.launch.sbatch import cpus_per_task
from areal_hpc.launch.slurm import SlurmLauncher, partitions, resolve_cpus
from areal_hpc.layout import Layout
from areal_hpc.main import PLACEMENT_FLAG
from areal_hpc.rundir import log_path
from tests.support.helpers import TINY, wait_done, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

FIRST_LINE = re.compile(
    r" INFO (?P<name>\w+ \d+ \(world rank \d+\)) on host \S+, Slurm node (?P<node>\S+): "
    r"(?P<component>\w+) node (?P<cnode>\d+), GPUs (?P<gpus>\S+) of (?P<given>\S+) \(pid \d+\)$"
)


CPUS_LINE = re.compile(
    r" INFO (?P<name>\w+ \d+ \(world rank \d+\)) CPUs: SLURM_CPUS_PER_TASK_HET_GROUP_(?P<group>\d) (?P<given>\S+), may run on "
    r"(?P<may>\d+) \(\S+\), OMP_NUM_THREADS (?P<threads>\S+) \((?P<why>[^)]*)\)$"
)


def _gpus(text: str) -> list[str]:
    return [] if text == "none" else text.split(",")


def test_each_rank_logs_and_takes_the_gpus_the_layout_gives_it(slurm_cluster, tmp_path, monkeypatch):
    # only because the fake nodes share one host: OpenMPI's shared-memory segments collide
    monkeypatch.setenv("OMPI_MCA_btl", "self,tcp")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the job inherits this shell's environment
    beside = subprocess.run(
        ["sbatch", "--parsable", "-N4", "--ntasks-per-node=1", "--gpus-per-node=2", "--time=5", "-o", "/dev/null"]
        + ["--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # controller + 1 reward worker | 1 node x 1 generator of TP 2 | 2 nodes x 2 trainers; 2 GPUs per node.
    # 6 of each node's 8 CPUs (the job beside holds one): 6 for the engine, 3 for each trainer rank
    shape = ["cluster.nodes=3", "cluster.gpus_per_node=2", "allocation.gen_tp=2", "cluster.exclusive=false"]
    cfg = load_config(TINY, [*shape, "cluster.cpus_per_node=6", f"experiment.root={tmp_path}"])
    assert cfg.cluster.device == "auto"
    assert resolve_cpus(load_config(TINY, shape), partitions()).cluster.cpus_per_node == 8  # 0: sinfo's count
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

    # What Slurm gave each task: for a GPU task the share of its node's CPUs that the config asked for,
    # for the controller's Slurm's default (cluster.controller_cpus 0). The local cluster binds no task
    # (TaskPlugin=task/none), so a task may run on every CPU of this machine; on a cluster that binds
    # (task/affinity, task/cgroup) that is what Slurm gave it. OMP_NUM_THREADS: a trainer takes the
    # fewer; a generator leaves it to vLLM.
    seen = {}
    machine = len(os.sched_getaffinity(0))
    for i, comp in enumerate(layout.components):
        for rank in comp.ranks:
            role = layout.role_of(rank)
            log = log_path(run_dir, role.name.lower(), rank - layout.ranks(role).start).read_text().splitlines()
            cpus = next((m for m in map(CPUS_LINE.search, log[1:4]) if m), None)
            assert cpus and cpus["name"] == layout.describe_rank(rank) and int(cpus["group"]) == i, log[:4]
            assert cpus["given"] == str(cpus_per_task(cfg.cluster, comp) or "unset") and int(cpus["may"]) == machine
            seen[role.name.lower()] = (cpus["given"], cpus["threads"])
    assert seen == {
        "controller": ("unset", str(machine)),
        "reward": ("unset", str(machine)),
        "generator": ("6", "unset"),
        "trainer": ("3", str(min(3, machine))),
    }
