"""The sbatch script of a run (areal_hpc/launch/sbatch.py): snapshots of the shipped configs, and what each
cluster setting does to the script. Pure functions; no Slurm needed.

Snapshots: tests/snapshots/<config>.sbatch. When a change to the script is intended, re-record them with
    UPDATE_SNAPSHOTS=1 python -m pytest tests/test_render.py
and review the diff in git.
"""

import difflib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from areal_hpc.cli import main as cli_main
from areal_hpc.config import ConfigError, load_config
from areal_hpc.exit_codes import EXIT_STOPPED
from areal_hpc.launch import LaunchError, get_launcher
from areal_hpc.launch.record import JobRecord, parse_squeue, status
from areal_hpc.launch.sbatch import fill, render_sbatch
from areal_hpc.launch.slurm import Partition, check_cluster, describe_request, parse_sinfo, resolve_cpus
from areal_hpc.layout import Layout
from areal_hpc.planner import resolve_split

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Fixed paths, so the text does not depend on where the repository or the venv is.
WORKDIR = "/work/areal-hpc"
PYTHON = "/work/areal-hpc/.venv/bin/python"
SINFO = parse_sinfo("debug*|4|gpu:4|8\n")
"""What sinfo says of the local test cluster's nodes (tools/local_slurm.sh): a config's cpus_per_node 0 reads 8."""


def render(overrides=(), config="tiny-cpu", **kw):
    return render_sbatch(launched(REPO / "configs" / f"{config}.yaml", overrides), workdir=WORKDIR, python=PYTHON, **kw)


def launched(path, overrides=()):
    """A config as a launcher renders it: its node split and CPUs resolved (planner.resolve_split,
    areal_hpc.launch.slurm.resolve_cpus against SINFO)."""
    return resolve_cpus(resolve_split(load_config(path, list(overrides)))[0], SINFO)


def srun_step(script: str) -> str:
    """The `srun` command line, its continuation lines joined."""
    start = script.index("\nsrun ") + 1
    return script[start : script.index(" &\n", start)].replace("\\\n", " ")


def directives(script: str) -> list[list[str]]:
    """#SBATCH options per component (split at the `hetjob` separators)."""
    comps = [[]]
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            opt = line.split(None, 1)[1]
            if opt == "hetjob":
                comps.append([])
            else:
                comps[-1].append(opt)
    return comps


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_snapshot(path):
    text = render_sbatch(launched(path), workdir=WORKDIR, python=PYTHON)
    snap = SNAPSHOTS / f"{path.stem}.sbatch"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        snap.write_text(text)
    assert snap.exists(), f"no recorded script {snap}; record it with UPDATE_SNAPSHOTS=1"
    recorded = snap.read_text()
    if text != recorded:
        diff = "".join(difflib.unified_diff(recorded.splitlines(True), text.splitlines(True), str(snap), "rendered"))
        pytest.fail(f"the rendered script of {path.name} changed (UPDATE_SNAPSHOTS=1 re-records it):\n{diff}")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_script_is_valid_bash(path):
    text = render_sbatch(launched(path), workdir=WORKDIR, python=PYTHON)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_components_follow_the_layout():
    """tiny-cpu on 3 nodes of 1 GPU with a CPU node: the controller + 1 reward worker there, then the
    generator's node and the 2 trainer nodes, one task each: one component of the 3 GPU nodes."""
    text = render(["cluster.nodes=3", "allocation.reward_nodes=1"])
    comps = directives(text)
    assert len(comps) == 2
    assert "--nodes=1" in comps[0] and "--ntasks-per-node=2" in comps[0]
    assert "--nodes=3" in comps[1] and "--ntasks-per-node=1" in comps[1] and "--mem=0" in comps[1]
    assert "#   1 shared     3 node(s) x 1 task(s), 8 CPUs/task, world ranks 2-4: generator + trainer" in text
    assert "#       GPU node 0: world ranks 2: generator 0 on GPU 0\n" in text
    assert "#       GPU node 2: world ranks 4: trainer 1 on GPU 0\n" in text
    # job-wide options sit in the first component
    assert any(o.startswith("--signal=B:USR2@") for o in comps[0])
    assert "--requeue" in comps[0] and "--time=00:30:00" in comps[0]
    step = srun_step(text)
    for flag in ("--mpi=pmix", "--kill-on-bad-exit=1"):
        assert flag in step
    # one step, the components in world-rank order, each running the same wrapped command
    assert [part.split()[0] for part in step.split(" : ")[1:]] == ["--het-group=1"]
    assert step.count('"${rank[@]}"') == 2 and " --het-group=0 " in step
    # the controller's tasks: Slurm's default; a GPU node's one task: its 8 CPUs (SINFO)
    assert "--het-group=0 " in step and "--het-group=0 --cpus" not in step
    assert "--het-group=1 --cpus-per-task=8 " in step
    assert "--cpus-per-task=8" in comps[1] and not any(o.startswith("--cpus-per-task") for o in comps[0])


def test_nodes_that_run_as_many_tasks_make_one_component():
    """2 nodes of 4 GPUs, 6 generator GPUs at TP 2: node 0 runs the controller, the reward worker and 2 engines
    (4 tasks), node 1 1 engine and 2 trainer ranks (3 tasks): two components, each task a share of its node's
    CPUs and every node's memory."""
    overrides = ["cluster.nodes=2", "cluster.gpus_per_node=4", "allocation.gen_tp=2", "allocation.gen_gpus=6"]
    text = render([*overrides, "cluster.cpus_per_node=12"])
    comps = directives(text)
    sizes = [[o for o in comp if o.startswith(("--nodes", "--ntasks", "--cpus", "--mem"))] for comp in comps]
    assert sizes == [
        ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=3", "--mem=0"],
        ["--nodes=1", "--ntasks-per-node=3", "--cpus-per-task=4", "--mem=0"],
    ]
    assert (
        "#   0 shared     1 node(s) x 4 task(s), 3 CPUs/task, world ranks 0-3: controller + reward + generator" in text
    )
    assert "#       GPU node 0: world ranks 0-3: controller, 1 reward worker(s), generators 0-1 on GPUs 0-3\n" in text
    assert "#   1 shared-2   1 node(s) x 3 task(s), 4 CPUs/task, world ranks 4-6: generator + trainer" in text
    assert "#       GPU node 1: world ranks 4-6: generator 2 on GPUs 0-1, trainers 0-1 on GPUs 2-3\n" in text
    parts = [" ".join(p.split()) for p in srun_step(text).split(" : ")]
    assert parts[0].endswith('--het-group=0 --cpus-per-task=3 "${rank[@]}"')
    assert parts[1] == '--het-group=1 --cpus-per-task=4 "${rank[@]}"'


def test_one_node_is_one_component_with_every_role():
    """One node of 4 GPUs: no CPU node (allocation.reward_nodes auto), no hetjob; the controller and the reward
    worker are the node's first tasks, then 1 engine of TP 2 and 2 trainer ranks, each with its own GPUs and an
    even share of the node's CPUs; the node's memory is asked for."""
    text = render(["cluster.nodes=1", "cluster.gpus_per_node=4", "allocation.gen_tp=2", "allocation.gen_gpus=2"])
    assert "#SBATCH hetjob" not in text and "--het-group" not in srun_step(text)
    [comp] = directives(text)
    assert {"--nodes=1", "--ntasks-per-node=5", "--cpus-per-task=1", "--mem=0", "--gpus-per-node=4"} <= set(comp)
    assert srun_step(text).endswith(' --cpus-per-task=1 "${rank[@]}"')
    assert (
        "#   0 shared     1 node(s) x 5 task(s), 1 CPUs/task, world ranks 0-4: controller + reward + generator + trainer"
        in text
    )
    assert (
        "#       GPU node 0: world ranks 0-4: controller, 1 reward worker(s), generator 0 on GPUs 0-1, trainers 0-1 on GPUs 2-3"
        in text
    )
    assert "one Slurm job, one MPI world of 5 ranks" in text
    # the busiest node's tasks each need a CPU
    with pytest.raises(
        ConfigError, match=r"cluster.cpus_per_node \(4\) is fewer than the 6 tasks of the busiest GPU node"
    ):
        render(["cluster.nodes=1", "cluster.gpus_per_node=4", "allocation.gen_gpus=2", "cluster.cpus_per_node=4"])


def test_gpus_only_on_gpu_components_and_never_with_cpu():
    cpu = directives(render(["cluster.nodes=3", "cluster.device=cpu", "allocation.reward_nodes=1"]))
    assert not any("gpu" in o for comp in cpu for o in comp)
    for device in ("cuda", "auto"):  # auto: the job asks for GPUs, whatever the submitting machine has
        gpus = directives(
            render(
                ["cluster.nodes=3", f"cluster.device={device}", "cluster.gpus_per_node=4", "allocation.reward_nodes=1"]
            )
        )
        assert not any("gpu" in o for o in gpus[0])
        assert "--gpus-per-node=4" in gpus[1]


def test_cluster_settings_reach_the_script():
    text = render(
        [
            "cluster.nodes=3",
            "allocation.reward_nodes=1",
            "cluster.partition=gpu",
            "cluster.cpus_per_node=8",
            "cluster.cpu_partition=cpu",
            "cluster.account=proj1",
            "cluster.qos=high",
            "cluster.constraint=a100",
            "cluster.exclusive=false",
            "cluster.time=1-02:00:00",
            "cluster.requeue_signal_s=300",
            "cluster.max_requeues=7",
            "cluster.network_interface=ib0",
            "cluster.container=nvcr.io/nvidia/pytorch:24.05",
            "cluster.sbatch_args=[--tmp=100G]",
            "cluster.srun_args=[--cpu-bind=none]",
            "cluster.env={NCCL_DEBUG: WARN, MY_VAR: 'a b'}",
        ]
    )
    comps = directives(text)
    assert "--partition=cpu" in comps[0] and "--partition=gpu" in comps[1]
    assert all("--account=proj1" in c and "--qos=high" in c and "--tmp=100G" in c for c in comps)
    assert "--constraint=a100" not in comps[0] and "--constraint=a100" in comps[1]
    assert not any("--exclusive" in c for c in comps)
    assert "--time=1-02:00:00" in comps[0] and "--signal=B:USR2@300" in comps[0]
    assert 'if [ "${stops:-0}" -lt 7 ]' in text
    for var in ("OMPI_MCA_btl_tcp_if_include", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert f"export {var}=ib0" in text
    assert "export MY_VAR='a b'" in text and "export NCCL_DEBUG=WARN" in text
    step = srun_step(text)
    assert "--container-image=nvcr.io/nvidia/pytorch:24.05" in step and "--cpu-bind=none" in step
    assert f'if [ "$rc" -eq {EXIT_STOPPED} ]' in text


def test_controller_component_resources_and_reward_nodes():
    text = render(
        [
            "cluster.nodes=3",
            "allocation.reward_workers=8",
            "allocation.reward_nodes=2",
            "cluster.controller_cpus=16",
            "cluster.controller_mem=64G",
        ]
    )
    comps = directives(text)
    # 1 + 8 tasks over 2 CPU nodes: at most 5 per node, the controller on the first (block distribution)
    sizes = [o for o in comps[0] if o.startswith(("--nodes", "--ntasks", "--cpus"))]
    assert sizes == ["--nodes=2", "--ntasks=9", "--ntasks-per-node=5", "--cpus-per-task=16"]
    assert "--mem=64G" in comps[0] and "--mem=0" in comps[1]  # the GPU nodes' memory, all of it
    assert "--cpus-per-task=8" in comps[1]  # a GPU node's (SINFO), not these
    assert "#   0 controller 2 node(s), 9 task(s) in all, 16 CPUs/task, world ranks 0-8: controller + reward" in text
    # srun takes no CPUs from the allocation (Slurm 22.05+): asked again for component 0; the next one asks
    # its own (it would inherit component 0's otherwise)
    parts = srun_step(text).split(" : ")
    assert "--het-group=0 --cpus-per-task=16" in parts[0]
    assert "--cpus-per-task=8 " in parts[1]
    layout_cfg = load_config(REPO / "configs/tiny-cpu.yaml", ["cluster.nodes=3", "allocation.reward_nodes=2"])
    assert "3 + 2 CPU" in Layout.from_config(layout_cfg).table()
    assert "controller 2 node(s) x 1 task(s), 16 CPUs/task" in describe_request(
        load_config(REPO / "configs/tiny-cpu.yaml", ["allocation.reward_nodes=2", "cluster.controller_cpus=16"])
    )
    with pytest.raises(ConfigError, match=r"reward_nodes \(3\) must not exceed .* = 2\)"):
        load_config(REPO / "configs/tiny-cpu.yaml", ["allocation.reward_nodes=3"])


def test_each_gpu_task_asks_for_its_share_of_its_nodes_cpus():
    # 4 GPUs per node, a CPU node: a generator node runs 4 / gen_tp 2 = 2 engines, a trainer node 4 ranks; 10 CPUs each
    overrides = ["cluster.nodes=3", "cluster.gpus_per_node=4", "allocation.gen_tp=2", "allocation.gen_gpus=4"]
    text = render([*overrides, "allocation.reward_nodes=1", "cluster.cpus_per_node=10"])
    comps = directives(text)
    assert "--cpus-per-task=5" in comps[1] and "--cpus-per-task=2" in comps[2]  # the allocation's
    parts = srun_step(text).split(" : ")  # and the step's, which srun does not take from the allocation
    assert "--het-group=1 --cpus-per-task=5 " in parts[1] and "--het-group=2 --cpus-per-task=2 " in parts[2]
    assert "#   1 generator  1 node(s) x 2 task(s), 5 CPUs/task, world ranks 2-3" in text
    assert "#   2 trainer    2 node(s) x 4 task(s), 2 CPUs/task, world ranks 4-11" in text
    cfg = launched(REPO / "configs/tiny-cpu.yaml", [*overrides, "cluster.cpus_per_node=10"])
    # without a CPU node every node runs 4 tasks (node 0: the controller, the reward worker and 2 engines)
    assert describe_request(cfg) == "shared 3 node(s) x 4 task(s), 4 GPUs/node, 2 CPUs/task, all memory/node"
    # a config whose count was never resolved renders nothing rather than one CPU per task
    with pytest.raises(ConfigError, match="cluster.cpus_per_node is 0: a launcher reads it from Slurm"):
        render_sbatch(resolve_split(load_config(REPO / "configs/tiny-cpu.yaml"))[0], workdir=WORKDIR, python=PYTHON)
    # fewer CPUs than a node's GPUs: refused when the config loads
    with pytest.raises(ConfigError, match=r"cluster.cpus_per_node \(3\) must be 0 .* \(cluster.gpus_per_node = 4\)"):
        load_config(REPO / "configs/tiny-cpu.yaml", ["cluster.gpus_per_node=4", "cluster.cpus_per_node=3"])
    with pytest.raises(ConfigError, match=r"cluster.cpus_per_node must be >= 0 \(got -1\)"):
        load_config(REPO / "configs/tiny-cpu.yaml", ["cluster.cpus_per_node=-1"])


@pytest.mark.parametrize("config", ["qwen1.5b", "qwen32b"])
def test_shipped_gpu_configs_ask_several_cpus_for_every_gpu_task_off_the_cluster(config, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # a dry run where sinfo cannot answer
    args = ["submit", str(REPO / f"configs/{config}.yaml"), "--nodes", "16", "--dry-run", f"experiment.root={tmp_path}"]
    assert cli_main(args) == 0
    parts = srun_step(capsys.readouterr().out).split(" : ")
    asked = [int(p.split("--cpus-per-task=")[1].split()[0]) for p in parts[1:]]
    cfg = load_config(REPO / f"configs/{config}.yaml")
    per_task = cfg.cluster.cpus_per_node // cfg.cluster.gpus_per_node
    per_engine = cfg.cluster.cpus_per_node * cfg.allocation.gen_tp // cfg.cluster.gpus_per_node
    assert asked == ([per_task] if per_engine == per_task else [per_engine, per_task]) and min(asked) > 1


def test_cpus_per_node_is_read_from_sinfo_and_checked_against_it():
    tiny = REPO / "configs/tiny-cpu.yaml"
    parts = parse_sinfo("gpu*|2|gpu:8|96\ngpu*|3|gpu:8|128\nsmall|2|gpu:8|4\n")
    # 0: the fewest CPUs of a node of the GPU partition (the default one, or cluster.partition)
    assert resolve_cpus(load_config(tiny), parts).cluster.cpus_per_node == 96
    set_ = load_config(tiny, ["cluster.cpus_per_node=32"])
    assert resolve_cpus(set_, parts) is set_ and resolve_cpus(set_, None) is set_  # as set, sinfo or not
    with pytest.raises(LaunchError, match="sinfo cannot answer here: set cluster.cpus_per_node"):
        resolve_cpus(load_config(tiny), None)
    with pytest.raises(
        LaunchError, match=r"lists no partition 'big' \(partitions: gpu, small\): set cluster.partition"
    ):
        resolve_cpus(load_config(tiny, ["cluster.partition=big"]), parts)
    with pytest.raises(LaunchError, match=r"partition 'small' has nodes of 4 CPUs, fewer than the 10 tasks"):
        resolve_cpus(load_config(tiny, ["cluster.partition=small", "cluster.gpus_per_node=8"]), parts)
    # more than the largest node has: refused at submit (and by doctor's partitions check), naming all three
    check_cluster(load_config(tiny, ["cluster.cpus_per_node=128"]), parts)
    with pytest.raises(
        LaunchError,
        match=r"cluster.cpus_per_node \(200\) exceeds the 128 CPUs of the largest node of partition 'gpu' "
        r"\(sinfo -o %c -p gpu\): set it to at most 128, or to 0",
    ):
        check_cluster(load_config(tiny, ["cluster.cpus_per_node=200"]), parts)


def test_default_command_is_the_agreed_entry_point():
    text = render(["cluster.nodes=3", "experiment.root=/scratch/runs"])
    assert f"{PYTHON} -u -m areal_hpc.main /scratch/runs/tiny-cpu/trial0" in text
    assert "run_dir=/scratch/runs/tiny-cpu/trial0" in text
    # relative run roots resolve against the work directory
    assert f"run_dir={WORKDIR}/runs/tiny-cpu/trial0" in render(["cluster.nodes=3"])
    # the submitit folder must not contain %j (ranks of components 1+ could not connect their IO)
    assert f"--output={WORKDIR}/runs/tiny-cpu/trial0/slurm/%j_0_log.out" in render(["cluster.nodes=3"])


def test_stand_in_command_is_quoted():
    text = render(["cluster.nodes=3"], command=["python3", "-c", "print('hi there')"])
    rank = text[text.index("\nrank=(") :].split(")\n")[0]
    assert shlex.quote("print('hi there')") in rank


def test_requeue_exit_code_is_the_controllers():
    from areal_hpc.exit_codes import STOP_REASON_ENV

    assert f'if [ "$rc" -eq {EXIT_STOPPED} ]' in render(["cluster.nodes=3"])  # requeued on the controller's code
    # the script learns of a preemption (SIGTERM to the tasks only) from the controller's stop reason
    text = render(["cluster.nodes=3"])
    assert f"export {STOP_REASON_ENV}=$log_dir/stop_reason" in text
    assert 'controller_stop=$(cat "$log_dir/stop_reason"' in text


def test_fill_refuses_missing_or_unknown_names():
    assert fill("a {{x}} b", {"x": "1"}) == "a 1 b"
    with pytest.raises(KeyError):
        fill("a {{x}} {{y}}", {"x": "1"})
    with pytest.raises(KeyError):
        fill("a {{x}}", {"x": "1", "z": "2"})


def test_cluster_capacity_errors():
    parts = parse_sinfo("debug*|4|gpu:4|8\ncpu|2|(null)|64\nbig|2|gpu:a100:8(S:0-1)|128\nbig|1|gpu:a100:4|96+\n")
    assert parts["debug"] == Partition(4, 4, True, 8, 8) and parts["big"] == Partition(3, 8, False, 96, 128)
    assert parts["cpu"].gpus_per_node == 0
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", ["cluster.partition=gpu-big"])
    with pytest.raises(LaunchError, match="cluster.partition 'gpu-big' is not a partition.*big, cpu, debug"):
        check_cluster(cfg, parts)
    check_cluster(cfg, None)  # sinfo cannot answer: leave it to sbatch
    check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", ["cluster.nodes=4"]), parts)  # no CPU node: 4 fit
    one_cpu_node = ["cluster.nodes=4", "allocation.reward_nodes=1"]
    with pytest.raises(LaunchError, match="needs 5 nodes in partition 'debug'.*which has 4"):
        check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", one_cpu_node), parts)
    with pytest.raises(LaunchError, match=r"needs 5 nodes .*allocation.reward_nodes = 2 CPU node\(s\)"):
        check_cluster(
            load_config(REPO / "configs/tiny-cpu.yaml", ["cluster.nodes=3", "allocation.reward_nodes=2"]), parts
        )
    # the controller's node from another partition frees one
    check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", [*one_cpu_node, "cluster.cpu_partition=cpu"]), parts)
    cuda = ["cluster.device=cuda", "cluster.gpus_per_node=8", "cluster.nodes=2"]
    with pytest.raises(LaunchError, match=r"gpus_per_node \(8\) exceeds the 4 GPUs per node of partition 'debug'"):
        check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", cuda), parts)
    check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", [*cuda, "cluster.partition=big"]), parts)
    # cluster.device auto asks for GPUs: a partition without any is refused with the fix, cpu fits it
    on_cpus = ["cluster.partition=cpu", "cluster.cpu_partition=debug"]
    with pytest.raises(LaunchError, match=r"exceeds the 0 GPUs per node of partition 'cpu'.*cluster.device=cpu"):
        check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", on_cpus), parts)
    check_cluster(load_config(REPO / "configs/tiny-cpu.yaml", [*on_cpus, "cluster.device=cpu"]), parts)


def test_parse_squeue_gives_each_component_and_the_worst_state():
    info = parse_squeue("12+0|RUNNING|node1|None\n12+1|RUNNING|node2|None\n12+2|PENDING|(null)|Resources\n")
    assert info["12+2"]["Reason"] == "Resources"
    assert info["12"]["State"] == "PENDING"
    assert parse_squeue("13+0|COMPLETED|n1|None\n13+1|FAILED|n2|None\n")["13"]["State"] == "FAILED"


def test_status_reads_the_record_when_slurm_forgot_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no squeue: Slurm cannot answer
    (tmp_path / "slurm").mkdir()
    JobRecord("41", "2026-01-01T00:00:00Z", "s.sh", str(tmp_path), ["controller", "generator", "trainer"]).save(
        tmp_path
    )
    events = [
        {"job_id": "41", "attempt": 0, "event": "start", "log_dir": "L0"},
        {"job_id": "41", "attempt": 0, "event": "end", "exit_code": EXIT_STOPPED},
        {"job_id": "41", "attempt": 0, "event": "requeue"},
        {"job_id": "41", "attempt": 1, "event": "start", "log_dir": "L1"},
        {"job_id": "41", "attempt": 1, "event": "end", "exit_code": 0},
    ]
    (tmp_path / "slurm" / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rows = '{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.25, "ppo/clip_frac": 0.5}\n{"step"'
    (tmp_path / "metrics.jsonl").write_text(rows)  # the last line is being written
    text = status(tmp_path)
    assert "job 41: COMPLETED" in text
    assert "attempts: 2 (1 requeue(s)); current logs: L1" in text
    assert "last step: 2" in text and "metrics: reward/mean=0.25" in text and "clip_frac" not in text


def test_dry_run_prints_the_script_and_touches_nothing(tmp_path, capsys, monkeypatch):
    root = tmp_path / "runs"
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # sinfo cannot answer
    args = ["submit", str(REPO / "configs/tiny-cpu.yaml"), "--nodes", "3", "--dry-run", f"experiment.root={root}"]
    assert cli_main([*args, "cluster.cpus_per_node=8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash")
    assert (
        "#   0 shared     1 node(s) x 3 task(s), 2 CPUs/task, world ranks 0-2: controller + reward + generator" in out
    )
    assert "#   1 trainer    2 node(s) x 1 task(s), 8 CPUs/task, world ranks 3-4: trainer" in out
    assert "#SBATCH hetjob" in out
    assert not root.exists()
    # 0 (tiny-cpu's): read from sinfo, which cannot answer here
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert "cluster.cpus_per_node is 0 (read from Slurm), but sinfo cannot answer here" in err
    assert "set cluster.cpus_per_node" in err and "sinfo -o %c -p PARTITION" in err
    assert get_launcher("dry-run").name == "dry-run" and get_launcher("local").name == "local"


def test_render_writes_the_script_and_the_config(tmp_path):
    out = tmp_path / "job.sbatch"
    root = tmp_path / "runs"
    args = ["render", str(REPO / "configs/tiny-cpu.yaml"), "--nodes", "3", "-o", str(out), f"experiment.root={root}"]
    assert cli_main([*args, "cluster.cpus_per_node=8"]) == 0
    assert "--het-group=0 --cpus-per-task=2 " in srun_step(out.read_text())
    assert load_config(root / "tiny-cpu/trial0/config.yaml").cluster.cpus_per_node == 8


def test_render_records_the_resolved_split_in_the_run_config(tmp_path):
    """gen_share auto is resolved once, when the run is launched, and the run's config.yaml holds the split as
    a number: every rank reads it from there, none runs the planner."""
    root = tmp_path / "runs"
    out = tmp_path / "job.sbatch"
    code = cli_main(
        ["render", str(REPO / "configs/qwen1.5b.yaml"), "--nodes", "16", "-o", str(out), f"experiment.root={root}"]
    )
    assert code == 0
    saved = load_config(root / "qwen1.5b-math/trial0/config.yaml")
    assert saved.allocation.gen_share == "auto" and saved.allocation.gen_gpus == 74
    text = out.read_text()
    assert "#   1 shared     16 node(s) x 8 task(s)" in text
    assert "#       GPU node 9: world ranks 81-88: generators 72-73 on GPUs 0-1, trainers 0-5 on GPUs 2-7" in text


def test_status_and_cancel_without_a_job_say_so(tmp_path, capsys):
    assert cli_main(["status", str(tmp_path)]) == 1
    assert "no Slurm job record" in capsys.readouterr().err
    assert cli_main(["cancel", str(tmp_path)]) == 1
    assert "nothing to cancel" in capsys.readouterr().err


def test_status_says_when_the_requeue_limit_stopped_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    (tmp_path / "slurm").mkdir()
    JobRecord("7", "2026-01-01T00:00:00Z", "s.sh", str(tmp_path), ["controller", "generator", "trainer"]).save(tmp_path)
    events = [
        {"job_id": "7", "attempt": 0, "event": "start"},
        {"job_id": "7", "attempt": 0, "event": "end", "exit_code": EXIT_STOPPED, "stop_signal": "USR2"},
    ]
    (tmp_path / "slurm" / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = status(tmp_path)
    assert f"job 7: FAILED (exit code {EXIT_STOPPED})" in text and "after the last allowed requeue" in text


def test_submit_without_slurm_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    args = ["submit", str(REPO / "configs/tiny-cpu.yaml"), "--nodes", "3", f"experiment.root={tmp_path}"]
    assert cli_main([*args, "cluster.cpus_per_node=8"]) == 1
    assert "needs the Slurm client commands" in capsys.readouterr().err
    assert not (tmp_path / "tiny-cpu").exists()
