"""GPU and CPU placement on a real Slurm: the local test cluster (tools/local_slurm.sh), whose fake GPUs are
gres backed by character devices, so that Slurm hands them out and sets CUDA_VISIBLE_DEVICES, and torch
finds no GPU behind them.

Every rank runs the real entry point, `python -m areal_hpc.main RUN_DIR --placement`, in the one srun
step of the job: it checks that Slurm put it where the layout says (a node shared by roles included), narrows
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
from areal_hpc.layout import Layout, Role
from areal_hpc.main import PLACEMENT_FLAG
from areal_hpc.rundir import log_path
from tests.support.helpers import TINY, wait_done, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

FIRST_LINE = re.compile(
    r" INFO (?P<name>\w+ \d+ \(world rank \d+\)) on host \S+, Slurm node (?P<node>\S+): "
    r"node (?P<job_node>\d+) \((?P<component>[\w-]+)\), task (?P<slot>\d+), GPUs (?P<gpus>\S+) of (?P<given>\S+) "
    r"\(pid \d+\)$"
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
    # 3 nodes of 2 GPUs, 3 generating: node 0 runs the controller, the reward worker and 2 engines, node 1 the
    # third engine and a trainer rank, node 2 two trainer ranks. Two components (4 tasks a node, then 2):
    # 6 of each node's 8 CPUs (the job beside holds one), 1 for each task of node 0, 3 for the others'
    shape = ["cluster.nodes=3", "cluster.gpus_per_node=2", "allocation.gen_gpus=3", "cluster.exclusive=false"]
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
        assert (first["name"], first["component"], int(first["job_node"]), int(first["slot"])) == (
            layout.describe_rank(rank),
            place.component,
            place.job_node,
            place.slot,
        )
        given, gpus = _gpus(first["given"]), _gpus(first["gpus"])
        if place.gpus:
            assert given == ["2", "3"], "Slurm gave the run the GPUs the other job left"
            assert gpus == [given[i] for i in place.gpus]
        else:
            assert gpus == []  # the controller and the reward worker take none of their node's
        held.setdefault(first["node"], []).extend(gpus)
        assert any(f"{first['name']} device cpu (cluster.device auto)" in line for line in log[1:4]), log[:4]
    assert len(held) == 3  # no CPU node: the controller runs on the first GPU node
    assert sorted(map(sorted, held.values())) == [["2", "3"]] * 3  # no GPU twice, every one used

    # What Slurm gave each task: the share of its node's CPUs that the config asked for (its component's). The
    # local cluster binds no task (TaskPlugin=task/none), so a task may run on every CPU of this machine; on a
    # cluster that binds (task/affinity, task/cgroup) that is what Slurm gave it. OMP_NUM_THREADS: a rank
    # other than a generator takes the fewer; a generator leaves it to vLLM.
    machine = len(os.sched_getaffinity(0))
    assert [cpus_per_task(cfg.cluster, comp) for comp in layout.components] == [1, 3]
    for i, comp in enumerate(layout.components):
        for rank in comp.ranks:
            role = layout.role_of(rank)
            log = log_path(run_dir, role.name.lower(), rank - layout.ranks(role).start).read_text().splitlines()
            cpus = next((m for m in map(CPUS_LINE.search, log[1:4]) if m), None)
            assert cpus and cpus["name"] == layout.describe_rank(rank) and int(cpus["group"]) == i, log[:4]
            given = cpus_per_task(cfg.cluster, comp)
            assert cpus["given"] == str(given) and int(cpus["may"]) == machine
            assert cpus["threads"] == ("unset" if role == Role.GENERATOR else str(min(given, machine))), log[:4]
