"""`areal-hpc doctor` (areal_hpc/launch/doctor.py): on the local Slurm cluster every check passes for tiny-cpu on one
node, and each broken setup the tests make is named (a partition that does not exist, a run directory on
a node-local disk, packages missing on the nodes). The checks of a probe's reports on a cuda config,
which this machine cannot run, are tested on reports written out here; the probe's own code, the run's
start-up weight-sync broadcasts included (a group per pipeline stage and expert rank), runs in an MPI world
of stand-in Slurm tasks."""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from areal_hpc.cli import main as cli_main
from areal_hpc.config import load_config
from areal_hpc.launch.doctor import doctor
from areal_hpc.launch.doctor_job import probe_sources, probe_starts
from areal_hpc.launch.doctor_reports import check_sandbox, check_weight_sync, evaluate
from areal_hpc.layout import Layout
from tests.support.helpers import MPI_PROGRAMS, TINY

MOE_EP2 = ["model.architecture=qwen3_moe", "allocation.train_ep=2"]
"""A mixture-of-experts trainer at expert-parallel size 2 (its data-parallel size must be a multiple)."""
CHECKS = [
    "slurm",
    "pmix",
    "partitions",
    "preemption",
    "run directory",
    "python",
    "memory",
    "mpi",
    "gpus",
    "all-reduce",
    "weight sync",
]


def statuses(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        for name in CHECKS:
            if line[6:].startswith(name + " "):
                found[name] = line[:4]
    return found


@pytest.mark.slurm
def test_every_check_passes_on_the_local_cluster(slurm_cluster, tmp_path, capsys):
    """`doctor --nodes 1`: one node of 2 GPUs, the controller, the reward worker, the generator and the trainer on
    it, one job of one component."""
    code = cli_main(["doctor", str(TINY), "--nodes", "1", "cluster.gpus_per_node=2", f"experiment.root={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "areal-hpc doctor: " in out and " on 1 GPU node(s)\n" in out
    assert statuses(out) == {name: "SKIP" if name == "gpus" else "PASS" for name in CHECKS}, out
    assert "one job of the GPU nodes (allocation.reward_nodes 0)" in out
    assert "gpus           cluster.device is auto and no rank's torch sees a GPU" in out  # a fact, not a pass
    assert "gloo across 2 generator and trainer ranks on 1 GPU node(s)" in out
    assert "gloo from world rank 3 (trainer) to world rank 2 (generator) at 127.0.0.1:" in out  # one host
    assert "shared by this host and node1" in out
    assert not (tmp_path / "tiny-cpu/trial0").exists()  # a probe that passed leaves nothing behind


@pytest.mark.slurm
def test_each_broken_setup_is_named(slurm_cluster, tmp_path, capsys):
    # a partition that does not exist: found before any job
    code = cli_main(["doctor", str(TINY), "--nodes", "3", f"experiment.root={tmp_path}", "cluster.partition=gpu-big"])
    out = capsys.readouterr().out
    assert code == 1 and statuses(out)["partitions"] == "FAIL"
    assert (
        "cluster.partition 'gpu-big' is not a partition of this cluster" in out and "fix: set cluster.partition" in out
    )
    # more CPUs per node than the nodes have: found before any job too
    code = cli_main(["doctor", str(TINY), "--nodes", "3", f"experiment.root={tmp_path}", "cluster.cpus_per_node=16"])
    out = capsys.readouterr().out
    assert code == 1 and statuses(out)["partitions"] == "FAIL"
    assert "cluster.cpus_per_node (16) exceeds the 8 CPUs of the largest node of partition 'debug'" in out
    # cluster.cpus_per_node 0, read from sinfo: nodes with fewer CPUs than a trainer node's tasks
    few = ["cluster.device=cpu", "cluster.gpus_per_node=16"]
    code = cli_main(["doctor", str(TINY), "--nodes", "3", f"experiment.root={tmp_path}", *few])
    out = capsys.readouterr().out
    assert code == 1 and statuses(out)["partitions"] == "FAIL", out
    assert "partition 'debug' has nodes of 8 CPUs, fewer than the 18 tasks of the busiest GPU node" in out
    assert statuses(out)["run directory"] == "SKIP", "no probe job"

    # a run directory on the nodes' local disk (tools/local_slurm.sh: a tmpfs of each node's own)
    local = Path(os.environ["SLURM_CONF"]).parent.parent / "local" / tmp_path.name
    code = cli_main(["doctor", str(TINY), "--nodes", "3", f"experiment.root={local}"])
    out = capsys.readouterr().out
    assert code == 1 and statuses(out)["run directory"] == "FAIL", out
    assert "is not shared by every node: world ranks 0-4 (controller, reward, generator, trainer) left no report" in out
    assert "fix: put experiment.root on a filesystem that this host and every node mount" in out

    # packages missing on the nodes: they run an interpreter without them (Debian's own python3)
    python = "/usr/bin/python3"
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0, "needs a bare python3"
    lines = []
    checks = doctor(
        load_config(TINY, ["cluster.nodes=3", f"experiment.root={tmp_path}"]), python=python, say=lines.append
    )
    status = {c.name: c for c in checks}
    assert status["run directory"].status == "PASS"
    assert status["python"].status == "FAIL"
    assert "torch missing: ModuleNotFoundError: No module named 'torch'" in status["python"].detail
    assert "on node1, node2, node3" in status["python"].detail  # the 3 GPU nodes: no CPU node
    assert status["mpi"].status == "FAIL" and "No module named 'mpi4py'" in status["mpi"].detail


def test_gpu_checks_from_reports_on_a_cuda_config(tmp_path):
    two = ["cluster.nodes=2", "cluster.device=cuda", "cluster.gpus_per_node=2", "allocation.gen_gpus=2"]
    cfg = load_config(TINY, [*two, "allocation.reward_nodes=1"])
    layout = Layout.from_config(cfg)  # controller + reward | 2 generators on node2 | 2 trainers on node3
    login = {"torch": "2.13.0", "vllm": "0.32.0", "megatron.core": "0.16.1", "mpi4py": "4.1.2"}
    hosts = ["node1", "node1", "node2", "node2", "node3", "node3"]
    reports = {
        r: {"rank": r, "host": h, "token": "t", "mpi": {"size": 6, "sum": 6}, "versions": dict(login),
            "memory": {"node": 2**40, "limit": 64 * 2**30 if h == "node1" else None}}
        for r, h in enumerate(hosts)
    }  # fmt: skip
    for r in range(2, 6):
        reports[r]["gpus"] = {"CUDA_VISIBLE_DEVICES": "0,1", "torch": 2}
        reports[r]["allreduce"] = {"backend": "nccl", "ranks": 2, "ok": True}
    for r in (2, 3, 4):  # the start-up broadcast: trainer 0 to both generators
        reports[r]["weight_sync"] = {"backend": "nccl", "joined": [[0, "10.0.0.3:4711"]], "ok": True, "lines": []}
    checks = {c.name: c for c in evaluate(cfg, layout, reports, "t", login, tmp_path)}
    assert checks.pop("sandbox").status == "SKIP", "tiny-cpu runs no program in the sandbox"
    assert all(c.status == "PASS" for c in checks.values()), checks
    assert checks["all-reduce"].detail == "nccl across 4 generator and trainer ranks on 2 GPU node(s)"
    assert checks["weight sync"].detail == (
        "nccl from world rank 4 (trainer) to world ranks 2-3 (generator) at 10.0.0.3:4711, checked by every receiver"
    )

    assert checks["memory"].detail == (
        "the least a task may use: controller 64.0 GiB of the node's 1,024.0 GiB, reward 64.0 GiB of the node's "
        "1,024.0 GiB, generator 1,024.0 GiB (the node's all), trainer 1,024.0 GiB (the node's all)"
    )

    reports[5]["memory"]["limit"] = 8 * 2**30  # a partition that caps a task's memory
    reports[4]["gpus"]["torch"] = 1  # a node whose GPU is gone
    reports[5].pop("allreduce")
    reports[5]["allreduce_error"] = "Traceback ...\nRuntimeError: NCCL error: unhandled system error"
    reports[3]["versions"]["torch"] = "2.12.0"
    checks = {c.name: c for c in evaluate(cfg, layout, reports, "t", login, tmp_path)}
    assert checks["gpus"].status == "FAIL" and "node3: torch sees 1" in checks["gpus"].detail
    assert checks["all-reduce"].status == "FAIL" and "NCCL error: unhandled system error" in checks["all-reduce"].detail
    assert "world rank 5 (trainer)" in checks["all-reduce"].detail
    assert checks["python"].detail == "torch 2.12.0 (this host: 2.13.0) on node2"
    assert checks["memory"].status == "FAIL" and checks["memory"].detail.startswith(
        "world rank 5 (trainer) may use less than half their node's memory; "
    )
    assert (
        "trainer 8.0 GiB of the node's 1,024.0 GiB" in checks["memory"].detail
        and "MaxMemPerNode" in checks["memory"].fix
    )

    # a generator that could not reach the trainer's group, and a node without cluster.network_interface
    reports[3].pop("weight_sync")
    reports[3]["weight_sync_error"] = (
        "WeightSyncError: weight-sync group areal-probe (stage 0): world rank 3 (generator) on host node2 (with the "
        "source world rank 4 (trainer) on host node3) could not reach the group's store at 10.0.0.3:4711 within "
        "120 s: DistNetworkError: timed out; the address is cluster.network_interface's, else ..."
    )
    reports[5]["interface_error"] = (
        "ConfigError: cluster.network_interface 'ib0' is not an interface on host node3 (...)"
    )
    checks = {c.name: c for c in evaluate(cfg, layout, reports, "t", login, tmp_path)}
    assert checks["weight sync"].status == "FAIL"
    assert checks["weight sync"].detail.startswith("world rank 3 (generator): WeightSyncError: weight-sync group")
    assert "could not reach the group's store at 10.0.0.3:4711 within 120 s" in checks["weight sync"].detail
    assert "set cluster.network_interface" in checks["weight sync"].fix
    assert checks["mpi"].status == "FAIL"
    assert checks["mpi"].detail == "cluster.network_interface 'ib0' is not an interface on host node3 (...)"


@pytest.mark.parametrize("version", [1, 2])
def test_a_tasks_memory_is_its_cgroups_limit_else_its_nodes(tmp_path, version):
    """`doctor_probe.task_memory` on a /proc and a cgroup tree as Slurm's task/cgroup plugin leaves them."""
    from areal_hpc.launch.doctor_probe import task_memory

    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       1048576 kB\nMemFree:        1000 kB\n")
    job = "/slurm/uid_0/job_7/step_0/task_0"
    if version == 2:
        (proc / "self" / "cgroup").write_text(f"0::{job}\n")
        base, name, none = cgroups, "memory.max", "max"
    else:
        (proc / "self" / "cgroup").write_text(f"5:cpuset:/\n4:memory:{job}\n0::/\n")
        base, name, none = cgroups / "memory", "memory.limit_in_bytes", str(2**63 - 4096)
    (base / job.lstrip("/")).mkdir(parents=True)
    (base / job.lstrip("/") / name).write_text(f"{none}\n")  # the task's own: none; its job's: 256 MiB
    assert task_memory(proc, cgroups) == {"node": 2**30, "limit": None}
    (base / "slurm/uid_0/job_7" / name).write_text(f"{256 * 2**20}\n")
    assert task_memory(proc, cgroups) == {"node": 2**30, "limit": 256 * 2**20}


def test_the_sandbox_is_checked_on_the_nodes_that_run_programs():
    cfg = load_config(TINY, ["cluster.nodes=2", "allocation.reward_nodes=1"])
    layout = Layout.from_config(cfg)  # controller + reward on node1 | the generator on node2 | the trainer on node3
    missing = "error: bwrap (bubblewrap) is not installed"
    reports = {r: {"host": f"node{r if r > 1 else 1}", "role": int(layout.role_of(r))} for r in range(4)}
    for r, found in [(0, missing), (2, "ok"), (3, missing)]:  # each node's first rank tried one
        reports[r]["sandbox"] = found  # the trainer's node runs no program
    check = check_sandbox(cfg, layout, reports)
    assert check.status == "SKIP" and "reward.kind math, the default workflow" in check.detail
    agent = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, workflow="agents.py:Agent"))
    check = check_sandbox(agent, layout, reports)
    assert check.status == "PASS", check
    assert check.detail == "a program ran in bubblewrap on node2 (the python tool of rollout.workflow agents.py:Agent)"
    code = dataclasses.replace(agent, reward=dataclasses.replace(cfg.reward, kind="code"))
    check = check_sandbox(code, layout, reports)
    assert check.status == "FAIL" and check.detail.startswith(f"node1: {missing} (needed for reward.kind code and")
    assert "install bubblewrap" in check.fix
    assert check_sandbox(code, layout, {}).status == "SKIP"


def test_the_weight_sync_check_covers_every_stage_and_names_the_one_that_failed():
    cfg = load_config(
        TINY,
        ["cluster.nodes=2", "cluster.device=cuda", "cluster.gpus_per_node=2", "allocation.gen_gpus=2"]
        + ["allocation.train_pp=2"],
    )
    layout = Layout.from_config(cfg)  # 2 generators on node2 | stage 0's source rank 4, stage 1's rank 5 on node3
    assert probe_sources(layout) == "0:0:4,1:0:5"
    reports = {r: {"rank": r, "host": "node2" if r < 4 else "node3"} for r in range(2, 6)}
    for r, joined in [
        (2, [[0, "a:1"], [1, "a:2"]]),
        (3, [[0, "a:1"], [1, "a:2"]]),
        (4, [[0, "a:1"]]),
        (5, [[1, "a:2"]]),
    ]:
        reports[r]["weight_sync"] = {"backend": "nccl", "joined": joined, "ok": True, "lines": []}
    check = check_weight_sync(cfg, layout, reports)
    assert check.status == "PASS" and check.detail == (
        "nccl from world ranks 4-5 (trainer), the sources of stages 0-1, to world ranks 2-3 (generator) at a:1, a:2, "
        "checked by every receiver"
    )
    # stage 0 connects; stage 1's source is not reached by the generators, who joined stage 0 first
    for r in (2, 3, 5):
        reports[r].pop("weight_sync")
        reports[r]["weight_sync_error"] = (
            f"WeightSyncError: weight-sync group areal-probe-1 (stage 1): world rank {r} ..."
        )
    check = check_weight_sync(cfg, layout, reports)
    assert check.status == "FAIL"
    assert check.detail.startswith(
        "stage 1 of 2 (from world rank 5 (trainer)) not checked; world ranks 2-3, 5 (generator, trainer): "
        "WeightSyncError: weight-sync group areal-probe-1 (stage 1): world rank 2 ..."
    ), check.detail


def test_the_weight_sync_check_covers_every_expert_rank_and_names_the_group_that_failed():
    cfg = load_config(
        TINY,
        [*MOE_EP2, "cluster.nodes=3", "cluster.device=cuda", "cluster.gpus_per_node=2", "allocation.gen_gpus=2"]
        + ["allocation.train_pp=2"],
    )
    layout = Layout.from_config(cfg)  # 2 generators on node2 | 4 trainers: PP 2 x DP 2, expert ranks 0-1
    assert probe_sources(layout) == "0:0:4,0:1:5,1:0:6,1:1:7"
    groups = [["stage 0, expert rank 0", "a:1"], ["stage 0, expert rank 1", "a:2"]]
    groups += [["stage 1, expert rank 0", "a:3"], ["stage 1, expert rank 1", "a:4"]]
    reports = {r: {"rank": r, "host": "node2" if r < 4 else "node3"} for r in range(2, 8)}
    for r, joined in [(2, groups), (3, groups), *((4 + i, [group]) for i, group in enumerate(groups))]:
        reports[r]["weight_sync"] = {"backend": "nccl", "joined": joined, "ok": True, "lines": []}
    check = check_weight_sync(cfg, layout, reports)
    assert check.status == "PASS" and check.detail == (
        "nccl from world ranks 4-7 (trainer), the sources of stages 0-1, expert ranks 0-1 of each, to world ranks "
        "2-3 (generator) at a:1, a:2, a:3, a:4, checked by every receiver"
    )
    # the source of stage 1's experts of expert rank 1 cannot be reached: the other three groups connect
    for r in (2, 3, 7):
        reports[r].pop("weight_sync")
        reports[r]["weight_sync_error"] = (
            f"WeightSyncError: weight-sync group areal-probe-1-1 (stage 1, expert rank 1): world rank {r} ..."
        )
    check = check_weight_sync(cfg, layout, reports)
    assert check.status == "FAIL"
    assert check.detail.startswith(
        "group (stage 1, expert rank 1) of 4 (from world rank 7 (trainer)) not checked; world ranks 2-3, 7 "
        "(generator, trainer): WeightSyncError: weight-sync group areal-probe-1-1 (stage 1, expert rank 1): "
    ), check.detail
    reports[6].pop("weight_sync")  # and stage 1's expert rank 0 too
    assert check_weight_sync(cfg, layout, reports).detail.startswith(
        "groups (stage 1, expert rank 0), (stage 1, expert rank 1) of 4 (from world ranks 6-7 (trainer)) not checked; "
    )


def _probe(run_mpi, tmp_path, interface: str, overrides=("allocation.train_pp=2",)):
    """The probe's own code, each rank where Slurm would start it, for tiny-cpu on 3 nodes (controller +
    reward | generator | 2 trainers), by default at PP 2: the sources of stages 0 and 1. Returns (cfg,
    layout, reports)."""
    cfg = load_config(TINY, ["cluster.nodes=3", *overrides])
    layout = Layout.from_config(cfg)
    (tmp_path / "token").write_text("t")
    args = [str(tmp_path), "cpu", probe_starts(layout), probe_sources(layout), interface]
    proc = run_mpi(MPI_PROGRAMS / "probe_world.py", n=layout.world_size, timeout=240, args=args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cfg, layout, {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(layout.world_size)}


@pytest.mark.mpi
@pytest.mark.slow
def test_the_probe_passes_in_an_mpi_world_with_the_runs_start_up_broadcasts(run_mpi, tmp_path):
    cfg, layout, reports = _probe(run_mpi, tmp_path, "")
    assert layout.sync_sources() == [(0, 0, 3), (1, 0, 4)]
    for source, stage in [(3, 0), (4, 1)]:
        assert reports[source]["weight_sync"]["lines"][0].startswith(
            f"weight-sync group areal-probe-{stage} (stage {stage}): world rank {source} (trainer) on host "
        ), reports[source]
    lines = reports[2]["weight_sync"]["lines"]  # the generator joined both stages' groups, in index order
    assert len(lines) == 2 and all("start-up check passed" in line for line in lines), lines
    assert "(stage 0)" in lines[0] and "(stage 1)" in lines[1], lines
    assert "weight_sync" not in reports[0] and "weight_sync" not in reports[1]  # not members
    login = reports[0]["versions"]  # one host: the login node's are rank 0's
    checks = {c.name: c for c in evaluate(cfg, layout, reports, "t", login, tmp_path)}
    assert {n: c.status for n, c in checks.items()} == {
        "run directory": "PASS", "python": "PASS", "sandbox": "SKIP", "memory": "PASS", "mpi": "PASS", "gpus": "SKIP",
        "all-reduce": "PASS", "weight sync": "PASS",
    }, checks  # fmt: skip
    assert reports[0]["sandbox"] == "ok", "a program ran in bubblewrap on this node"
    assert checks["weight sync"].detail.startswith(
        "gloo from world ranks 3-4 (trainer), the sources of stages 0-1, to world rank 2 (generator) at 127.0.0.1:"
    )


@pytest.mark.mpi
@pytest.mark.slow
def test_the_probe_checks_every_expert_ranks_group_in_an_mpi_world(run_mpi, tmp_path):
    # EP 2 at PP 1: the two trainers (DP 2) hold expert ranks 0 and 1, each the source of its own group
    cfg, layout, reports = _probe(run_mpi, tmp_path, "", MOE_EP2)
    assert layout.sync_sources() == [(0, 0, 3), (0, 1, 4)]
    for source, e in [(3, 0), (4, 1)]:
        assert reports[source]["weight_sync"]["lines"][0].startswith(
            f"weight-sync group areal-probe-0-{e} (stage 0, expert rank {e}): world rank {source} (trainer) on host "
        ), reports[source]
    lines = reports[2]["weight_sync"]["lines"]  # the generator joined both groups, in expert-rank order
    assert len(lines) == 2 and all("start-up check passed" in line for line in lines), lines
    assert "(stage 0, expert rank 0)" in lines[0] and "(stage 0, expert rank 1)" in lines[1], lines
    check = check_weight_sync(cfg, layout, reports)
    assert check.status == "PASS" and check.detail.startswith(
        "gloo from world ranks 3-4 (trainer), the sources of stage 0, expert ranks 0-1, to world rank 2 (generator) "
        "at 127.0.0.1:"
    ), check


@pytest.mark.mpi
@pytest.mark.slow
def test_a_probe_whose_address_cannot_be_picked_reports_it_on_every_rank(run_mpi, tmp_path):
    # The rank that picks each rendezvous's address fails there (no such interface): every other rank of
    # that rendezvous gets its error instead of waiting in the broadcast, and the probe ends with reports.
    cfg, layout, reports = _probe(run_mpi, tmp_path, "nosuch0")
    missing = "ConfigError: cluster.network_interface 'nosuch0' is not an interface on host"
    assert missing in reports[2]["allreduce_error"].strip().splitlines()[-1]  # the GPU ranks' rank 0: a traceback
    offered = "rank 0 of this torch.distributed world, on host "
    for r in (3, 4):
        assert offered in reports[r]["allreduce_error"]
        assert "offered no address to meet at: " + missing in reports[r]["allreduce_error"]
    for r in (3, 4):  # each stage's source: its own error
        assert reports[r]["weight_sync_error"].startswith(missing), reports[r]
    generator = reports[2]["weight_sync_error"]  # stage 0's source's, offered to it
    assert generator.startswith("AddressError: weight-sync group areal-probe-0 (stage 0): its source world rank 3")
    assert "offered no address to meet at: " + missing in generator
    checks = {c.name: c for c in evaluate(cfg, layout, reports, "t", reports[0]["versions"], tmp_path)}
    assert checks["mpi"].status == "FAIL" and "'nosuch0' is not an interface" in checks["mpi"].detail
    assert checks["weight sync"].status == "FAIL"
    assert checks["weight sync"].detail.startswith("stages 0, 1 of 2 (from world ranks 3-4 (trainer)) not checked; ")
