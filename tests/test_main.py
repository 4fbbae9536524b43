"""The rank entry point and the local launcher: each rank's GPUs, core pinning, the MPMD command
line, naming a dead rank from mpirun's report (pieces that need no running world); then the local
launcher's mpirun starting every rank up to its device (`--placement`)."""

import logging
import os
import socket
import subprocess
import sys

import pytest

from areal_hpc import device
from areal_hpc.config import load_config
from areal_hpc.launch.local import _annotate, _dead_rank, mpirun_command
from areal_hpc.layout import Layout, Role
from areal_hpc.main import PIN_ENV, PLACEMENT_FLAG, SlurmTask, log_cpus, narrow_gpus, own_gpus
from areal_hpc.rundir import log_path, prepare_run_dir
from tests.support.helpers import REPO

CPU_NODE_AND_TWO = [
    "cluster.gpus_per_node=4",
    "allocation.gen_tp=2",
    "allocation.gen_gpus=4",
    "allocation.reward_nodes=1",
]
"""tiny-cpu on a CPU node (controller + reward) and 2 GPU nodes of 4: 2 engines of TP 2 on the first, 4 trainers."""


def layout(*overrides):
    return Layout.from_config(load_config("configs/tiny-cpu.yaml", list(overrides)))


def test_mpirun_command_is_one_mpmd_launch_in_world_rank_order(tmp_path):
    lay = layout("cluster.nodes=3", "allocation.gen_nodes=1", "allocation.reward_workers=2")
    cmd = mpirun_command(lay, tmp_path, python="py")
    contexts = " ".join(cmd).split(" : ")
    assert len(contexts) == 4
    counts = [int(c.split("-n ")[1].split()[0]) for c in contexts]
    assert counts == [1, 2, 1, 2] and sum(counts) == lay.world_size
    assert all(c.endswith(f"py -u -m areal_hpc.main {tmp_path}") for c in contexts)
    assert "--oversubscribe" in cmd and ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)


def test_a_dead_rank_is_named_by_its_role():
    lay = layout()
    killed = "mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 (Killed).\n"
    assert _dead_rank(killed, None) == 2
    assert _annotate(killed, lay).rstrip().endswith("generator 0 (world rank 2)")
    exited = "  Process name: [[11012,1],3]\n"
    assert _dead_rank(exited, None) == 3
    assert "trainer 0 (world rank 3)" in _annotate(exited, lay)
    assert _dead_rank("nothing to see\n", None) is None
    assert _dead_rank(exited, 2) == 2  # the first report wins


def test_a_slurm_task_takes_its_entries_of_the_nodes_gpus():
    # controller + reward (node 0) | 2 engines of TP 2 (node 1) | 4 trainers (node 2); 4 GPUs per node
    lay = layout(*CPU_NODE_AND_TWO, "cluster.device=cuda")
    given = ["4", "5", "6", "7"]  # what Slurm shows every task of the node (a job beside another)
    assert own_gpus(lay, 3, given, SlurmTask("n1", 1, 1)) == ["6", "7"]
    assert own_gpus(lay, 6, given, SlurmTask("n2", 2, 2)) == ["6"]
    uuids = [f"GPU-{c}" for c in "abcd"]
    assert own_gpus(lay, 2, uuids, SlurmTask("n1", 1, 0)) == ["GPU-a", "GPU-b"]
    assert own_gpus(lay, 0, [], SlurmTask("n0", 0, 0)) == []  # the controller: none
    assert own_gpus(lay, 3, [], SlurmTask("n1", 1, 1)) == []  # Slurm gave none: nothing to narrow
    with pytest.raises(RuntimeError, match=r"as task 0 of the job's node 2 \(n2\).*remove --distribution"):
        own_gpus(lay, 3, given, SlurmTask("n2", 2, 0))
    with pytest.raises(RuntimeError, match=r"shows this task 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=5\).*--gpus-per-task"):
        own_gpus(lay, 3, ["5"], SlurmTask("n1", 1, 1))


def test_a_local_run_lays_the_nodes_gpus_end_to_end_and_shares_fewer():
    lay = layout("cluster.gpus_per_node=2")  # ranks: controller, reward, 1 generator, 3 trainers
    eight = [str(i) for i in range(8)]
    assert [own_gpus(lay, r, eight, None) for r in range(6)] == [[], [], ["0"], ["1"], ["2"], ["3"]]
    assert [own_gpus(lay, r, ["7", "9"], None) for r in range(6)] == [[], [], ["7"], ["9"], ["7"], ["9"]]
    assert own_gpus(lay, 2, [], None) == []
    cpu = layout("cluster.device=cpu")
    assert [own_gpus(cpu, r, eight, None) for r in range(4)] == [[], [], [], []]


def test_narrow_gpus_sets_the_variable_and_logs_role_host_gpus(monkeypatch, caplog):
    lay = layout(*CPU_NODE_AND_TWO, "cluster.device=auto")
    monkeypatch.delenv(PIN_ENV, raising=False)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "5", "SLURM_NODEID": "2", "SLURM_LOCALID": "1"}
    for key, value in {**slurm, "SLURMD_NODENAME": "gpu-b", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.INFO):
        narrow_gpus(lay, 5)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert "trainer 1 (world rank 5) on host " in caplog.text
    assert "Slurm node gpu-b: node 2 (trainer), task 1, GPUs GPU-b of GPU-a,GPU-b,GPU-c,GPU-d" in caplog.text
    for key, value in {"SLURM_NODEID": "0", "SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}.items():
        monkeypatch.setenv(key, value)
    narrow_gpus(lay, 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # the controller sees no GPU


def test_each_rank_logs_its_cpus_and_omp_num_threads_follows(monkeypatch, caplog):
    cores = sorted(os.sched_getaffinity(0))
    for key in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK", "SLURM_HET_SIZE", "SLURM_LOCALID", PIN_ENV):
        monkeypatch.setenv(key, "")  # recorded first: monkeypatch's undo restores what the suite had,
        monkeypatch.delenv(key)  # not what log_cpus sets below (a later test's jobs would inherit it)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NODEID": "1", "SLURM_LOCALID": "0"}

    def logged(role=Role.TRAINER, pinned=False, **env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            log_cpus("trainer 0 (world rank 3)", role, 2, pinned)
        return caplog.records[-1].getMessage()

    # the local launcher, unpinned (the controller, reward workers): nothing set
    assert logged().startswith(f"trainer 0 (world rank 3) CPUs: SLURM_CPUS_PER_TASK unset, may run on {len(cores)} (")
    assert "OMP_NUM_THREADS" not in os.environ
    # a Slurm task: the CPUs it may run on, at most those Slurm gave it (a node that binds nothing)
    line = logged(**slurm, SLURM_CPUS_PER_TASK="1")
    assert line.endswith("OMP_NUM_THREADS 1 (the CPUs it may run on, at most Slurm's)")
    assert "CPUs: SLURM_CPUS_PER_TASK 1, may run on" in line and os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert logged(SLURM_CPUS_PER_TASK="512").endswith(
        f"OMP_NUM_THREADS {len(cores)} (the CPUs it may run on, at most Slurm's)"
    )
    monkeypatch.delenv("OMP_NUM_THREADS")
    # a heterogeneous job: its own component's count (SLURM_CPUS_PER_TASK is the last component's there)
    line = logged(SLURM_HET_SIZE="3", SLURM_CPUS_PER_TASK_HET_GROUP_2="1")
    assert "CPUs: SLURM_CPUS_PER_TASK_HET_GROUP_2 1, may run on" in line and os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    # a generator leaves it to vLLM (it shares them among its TP workers); cluster.env's value is kept
    assert logged(Role.GENERATOR).endswith("OMP_NUM_THREADS unset (vLLM sizes its workers' threads)")
    assert "OMP_NUM_THREADS" not in os.environ
    assert logged(OMP_NUM_THREADS="6").endswith("OMP_NUM_THREADS 6 (from the environment)")
    assert os.environ["OMP_NUM_THREADS"] == "6"
    # the local launcher's pinning set it already
    assert logged(pinned=True).endswith("OMP_NUM_THREADS 6 (its share of this machine's cores)")


def test_visible_gpus_without_the_variable_come_from_the_driver(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for bus in ("0000:18:00.0", "0000:3b:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(device, "DRIVER_GPUS", str(tmp_path))
    assert device.visible_gpus() == ["0", "1"]
    monkeypatch.setattr(device, "DRIVER_GPUS", str(tmp_path / "none"))
    assert device.visible_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert device.visible_gpus() == []


@pytest.mark.mpi
def test_the_local_launcher_gives_each_rank_its_own_gpu_of_this_machine(tmp_path):
    # tiny-cpu (device auto): controller, reward and the generator on node 0, the trainer on node 1, 1 GPU each,
    # started by the local launcher's mpirun on a machine whose shell shows three (fake) GPUs
    cfg = load_config("configs/tiny-cpu.yaml", [f"experiment.root={tmp_path}"])
    lay, run_dir = Layout.from_config(cfg), prepare_run_dir(cfg).resolve()
    cmd = [a for arg in mpirun_command(lay, run_dir) for a in ([arg, PLACEMENT_FLAG] if arg == str(run_dir) else [arg])]
    env = {**os.environ, PIN_ENV: "1", "OMPI_MCA_btl": "self,tcp", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    firsts = {
        (role, i): log_path(run_dir, role, i).read_text().splitlines()[0]
        for role, i in [("controller", 0), ("reward", 0), ("generator", 0), ("trainer", 0)]
    }
    host = socket.gethostname()
    assert (
        f"generator 0 (world rank 2) on host {host}: node 0 (shared), task 2, GPUs GPU-a of GPU-a,GPU-b,GPU-c (pid"
        in (firsts[("generator", 0)])
    )
    assert (
        f"trainer 0 (world rank 3) on host {host}: node 1 (trainer), task 0, GPUs GPU-b of GPU-a,GPU-b,GPU-c (pid"
        in (firsts[("trainer", 0)])
    )
    for key, task in ((("controller", 0), 0), (("reward", 0), 1)):
        assert f": node 0 (shared), task {task}, GPUs none of GPU-a,GPU-b,GPU-c (pid" in firsts[key]
    # no Slurm node named even if this shell runs inside an allocation: the local launcher's ranks are not its tasks
    assert all("Slurm node" not in line for line in firsts.values())
    # the GPUs are fake: torch finds none behind them and auto resolves to cpu
    assert (
        "generator 0 (world rank 2) device cpu (cluster.device auto)" in log_path(run_dir, "generator", 0).read_text()
    )


def test_the_rank_module_imports_no_mpi4py():
    """A vLLM worker spawned by a generator rank (gen_tp > 1) imports areal_hpc.main again (multiprocessing's
    `__mp_main__`) with the rank's OMPI_* environment: mpi4py imported there would start MPI as a second
    copy of the rank (measured: orte_init fails and the engine's start hangs)."""
    code = "import sys, areal_hpc.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'mpi4py'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
