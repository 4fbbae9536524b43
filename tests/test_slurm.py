"""The Slurm launcher against a real Slurm: the local test cluster of tools/local_slurm.sh (fake nodes on
loopback, fake GPUs). tools/test.sh starts it and exports SLURM_CONF; run alone, these tests start it
themselves and stop it afterwards.

The ranks run small stand-in entry points (tests/support/mpi/) instead of `areal_hpc.main`, so what is tested
is the launcher: one heterogeneous job, one MPI world across the fake nodes, cancel, the whole step
ending when one rank fails, and the checkpoint/requeue cycle. tests/test_slurm_e2e.py runs the real
system.
"""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from areal_hpc.cli import main as cli_main
from areal_hpc.config import load_config
from areal_hpc.exit_codes import EXIT_STOPPED
from areal_hpc.launch.record import JobRecord, job_active
from areal_hpc.launch.slurm import HetSlurmJob, SlurmLauncher, partitions, resolve_cpus
from tests.support.helpers import (
    MPI_PROGRAMS,
    ONE_REQUEUE,
    TINY,
    RequeueStarter,
    components,
    ended,
    wait_done,
    wait_for,
)

pytestmark = pytest.mark.slurm


@pytest.fixture
def submit(slurm_cluster, tmp_path, monkeypatch):
    """Submit tiny-cpu on 3 nodes (4 fake nodes with the controller's) with a stand-in entry; returns
    (job id, run dir). Cancels what is left at the end."""
    # only because the fake nodes share one host: OpenMPI's shared-memory segments collide (sbatch passes
    # the submitter's environment on to the ranks)
    monkeypatch.setenv("OMPI_MCA_btl", "self,tcp")
    jobs = []

    def run(entry: Path, args: list[str], overrides=()):
        cfg = load_config(TINY, ["cluster.nodes=3", f"experiment.root={tmp_path / 'runs'}", *overrides])
        cfg = resolve_cpus(cfg, partitions())  # as `launch` does: the fake nodes' 8 CPUs
        run_dir = cfg.run_dir.resolve()
        command = [sys.executable, str(entry), *[a.replace("RUN_DIR", str(run_dir)) for a in args]]
        job_id = SlurmLauncher(command=command).submit(cfg)
        jobs.append(job_id)
        return job_id, run_dir

    yield run
    for job_id in jobs:
        subprocess.run(["scancel", job_id], capture_output=True)


def test_cluster_has_fake_gpu_nodes(slurm_cluster):
    out = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %G"], capture_output=True, text=True, check=True).stdout
    nodes = dict(line.split() for line in out.splitlines())
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    assert all(g.startswith("gpu:4") for g in nodes.values())


def test_hetjob_is_one_mpi_world_across_nodes(submit, tmp_path):
    out = tmp_path / "hello"
    out.mkdir()
    # device cuda, 2 fake GPUs per node: controller + 1 reward | 1 node x 2 generators, 2 nodes x 2 trainers
    job_id, run_dir = submit(
        MPI_PROGRAMS / "hello_world.py",
        [str(out)],
        ["cluster.device=cuda", "cluster.gpus_per_node=2", "allocation.gen_gpus=2", "allocation.reward_nodes=1"],
    )
    assert wait_done(run_dir, 90) == "COMPLETED"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(8)]
    assert all(r["size"] == 8 and r["sum"] == sum(range(8)) for r in ranks)
    assert [int(r["SLURM_PROCID"]) for r in ranks] == list(range(8))  # MPI rank == SLURM_PROCID
    nodes = [r["SLURMD_NODENAME"] for r in ranks]
    assert nodes[0] == nodes[1]  # controller and reward worker share the CPU node
    assert nodes[2] == nodes[3] and nodes[2] != nodes[0]  # generator node
    assert len({nodes[0], nodes[2], *nodes[4:]}) == 4  # trainers on two more nodes
    assert ranks[0]["CUDA_VISIBLE_DEVICES"] is None  # no GPU asked for the controller
    assert all(r["CUDA_VISIBLE_DEVICES"] == "0,1" for r in ranks[2:])
    # each rank's output and exit code in the attempt's log directory
    logs = run_dir / "logs" / f"slurm-{job_id}" / "attempt-0"
    assert sorted(p.name for p in logs.iterdir()) == sorted(f"rank{r}.{x}" for r in range(8) for x in ("log", "exit"))
    assert all((logs / f"rank{r}.exit").read_text() == "0\n" for r in range(8))
    # submitit's Job sees the heterogeneous job through squeue (its sacct watcher would say UNKNOWN)
    job = HetSlurmJob(folder=run_dir / "slurm", job_id=job_id)
    assert job.state == "COMPLETED" and job.done()
    # two components: the CPU node, then the 3 GPU nodes of 2 tasks each (generators and trainers alike)
    assert job.paths.submission_file.read_text().count("#SBATCH hetjob") == 1


def test_reward_workers_spread_over_reward_nodes_with_their_cpus(submit, tmp_path):
    out = tmp_path / "resources.json"
    # controller + 2 reward workers over 2 CPU nodes (2 + 1 tasks, 2 CPUs each) | 1 generator node, 1 trainer node
    overrides = ["cluster.nodes=2", "allocation.reward_workers=2", "allocation.reward_nodes=2"]
    resources = ["cluster.controller_cpus=2", "cluster.controller_mem=500M"]
    job_id, run_dir = submit(MPI_PROGRAMS / "step_resources.py", [str(out)], [*overrides, *resources])
    assert wait_done(run_dir, 90) == "COMPLETED"
    seen = json.loads(out.read_text())
    nodes = seen["nodes"]
    assert nodes[0] == nodes[1] and len(set(nodes)) == 4  # the controller's node, then one per GPU node
    assert len(seen["steps"]) == 2  # the CPU nodes, then the GPU nodes: one task each
    assert "CPUs=6 Tasks=3" in seen["steps"][0]  # the step, not only the allocation, has 2 CPUs per task
    # a GPU node's one task: the node's 8 CPUs (cluster.cpus_per_node 0, read from sinfo)
    assert "CPUs=16 Tasks=2" in seen["steps"][1]
    assert "MinMemoryNode=500M" in seen["jobs"][0]
    assert "MinMemoryNode=0" in seen["jobs"][1]  # --mem=0: all of each GPU node's memory


def test_a_controller_that_does_not_answer_is_not_an_ended_job(slurm_cluster, tmp_path, monkeypatch, capsys):
    """squeue failing (here the real client, pointed at a port no slurmctld listens on) leaves the job's state
    unknown: `status` and `cancel` say so, a lock is not taken over, the record is not read as the job's end."""
    conf = re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=1", Path(slurm_cluster).read_text())
    (tmp_path / "slurm.conf").write_text(conf + "MessageTimeout=1\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    JobRecord("41", "2026-01-01T00:00:00Z", "s.sh", str(run_dir), ["controller"]).save(run_dir)
    (run_dir / "slurm" / "attempts.jsonl").write_text('{"job_id": "41", "attempt": 0, "event": "start"}\n')
    assert cli_main(["status", str(run_dir)]) == 1
    assert "squeue could not answer about job 41 (" in capsys.readouterr().err
    assert cli_main(["cancel", str(run_dir)]) == 1
    assert "Unable to contact slurm controller" in capsys.readouterr().err
    assert job_active("41") is None and ended(run_dir) is None


def test_one_failing_rank_ends_the_job(submit):
    job_id, run_dir = submit(MPI_PROGRAMS / "fail_one.py", [])
    state = wait_done(run_dir, 60)  # the others sleep 600 s unless --kill-on-bad-exit ends them
    assert state == "FAILED"
    events = JobRecord.load(run_dir).attempts()
    assert events[-1]["event"] == "end" and events[-1]["exit_code"] != 0


def test_cancel_shows_in_status(submit, capsys):
    job_id, run_dir = submit(MPI_PROGRAMS / "step_counter.py", ["RUN_DIR", "1000", "0.3"])
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 60, "the first step")
    assert cli_main(["status", str(run_dir)]) == 0
    assert f"job {job_id}: RUNNING" in capsys.readouterr().out
    # a second job for the same run directory is refused while the first runs
    overrides = ["--nodes", "3", f"experiment.root={run_dir.parent.parent}"]
    assert cli_main(["submit", str(TINY), *overrides]) == 1
    assert f"is in use by Slurm job {job_id} (submitted from" in capsys.readouterr().err
    assert cli_main(["cancel", str(run_dir)]) == 0
    assert f"cancelled job {job_id}" in capsys.readouterr().out

    def cancelled():
        cli_main(["status", str(run_dir)])
        out = capsys.readouterr().out
        return f"job {job_id}: CANCELLED" in out and out

    out = wait_for(cancelled, 30, "status to show CANCELLED")
    assert "cancelled at" in out and "last step:" in out
    assert cli_main(["cancel", str(run_dir)]) == 0
    assert "nothing to cancel" in capsys.readouterr().out


def test_requeued_job_resumes_from_its_checkpoint(submit):
    total = 14
    job_id, run_dir = submit(MPI_PROGRAMS / "step_counter.py", ["RUN_DIR", str(total), "0.4"])
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 60, "three steps")
    # What Slurm does cluster.requeue_signal_s before the time limit (--signal=B:USR2@...)
    subprocess.run(["scancel", "--signal=USR2", "--batch", job_id], check=True)

    def restarted():
        comps = components(job_id)
        return comps and all(c["State"] == "RUNNING" for c in comps.values())

    wait_for(RequeueStarter(job_id), 60, "the requeued job to be pending on clean nodes")
    wait_for(restarted, 60, "the requeued job to run again", interval=1)
    assert wait_done(run_dir, 90) == "COMPLETED"

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, total + 1))  # every step once, none repeated
    first = [r for r in rows if r["attempt"] == 0]
    second = [r for r in rows if r["attempt"] == 1]
    assert first and second and second[0]["step"] == first[-1]["step"] + 1
    events = JobRecord.load(run_dir).attempts()
    assert [(e["attempt"], e["event"]) for e in events] == ONE_REQUEUE
    end = events[1]
    assert end["stop_signal"] == "USR2"
    assert stopped_cleanly(run_dir, job_id, end, len(first)), stop_shown(run_dir, job_id, end, len(first))
    assert (run_dir / "logs" / f"slurm-{job_id}" / "attempt-1" / "rank0.log").exists()


def test_sbatch_rejection_is_shown(slurm_cluster, tmp_path, capsys):
    code = cli_main(
        [
            "submit",
            str(TINY),
            "--nodes",
            "3",
            "cluster.sbatch_args=[--constraint=nosuchfeature]",
            f"experiment.root={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "sbatch rejected the job" in err and "Invalid feature specification" in err
    assert "the job asked for: shared 1 node(s) x 3 task(s), 1 GPUs/node, 2 CPUs/task, all memory/node; trainer" in err
    assert not (tmp_path / "tiny-cpu/trial0/job.json").exists()


def test_too_big_for_the_cluster_is_refused_before_sbatch(slurm_cluster, tmp_path, capsys):
    # 4 GPU nodes + a CPU node for the controller: sbatch would accept it and leave it pending for ever
    code = cli_main(["submit", str(TINY), "--nodes", "4", "allocation.reward_nodes=1", f"experiment.root={tmp_path}"])
    assert code == 1
    assert "the job needs 5 nodes in partition 'debug'" in capsys.readouterr().err
    code = cli_main(["submit", str(TINY), "--nodes", "3", "cluster.partition=gpu-big", f"experiment.root={tmp_path}"])
    assert code == 1
    assert (
        "cluster.partition 'gpu-big' is not a partition of this cluster (sinfo lists: debug, high, low)"
        in capsys.readouterr().err
    )
    # more CPUs than the fake nodes' 8
    code = cli_main(["submit", str(TINY), "--nodes", "3", "cluster.cpus_per_node=16", f"experiment.root={tmp_path}"])
    assert code == 1
    assert (
        "cluster.cpus_per_node (16) exceeds the 8 CPUs of the largest node of partition 'debug'"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "tiny-cpu").exists()


def test_time_limit_signal_checkpoints_and_requeues(submit):
    """The real thing: Slurm itself sends SIGUSR2 cluster.requeue_signal_s before the 1-minute limit
    (it checks time limits about every 30 s, so each attempt gets it within ~30 s), and every attempt
    resumes where the last one stopped. 40 s of work: at least one signal must come."""
    total = 80
    job_id, run_dir = submit(
        MPI_PROGRAMS / "step_counter.py",
        ["RUN_DIR", str(total), "0.5"],
        ["cluster.time=00:01:00", "cluster.requeue_signal_s=55", "cluster.max_requeues=10"],
    )
    start_requeued = RequeueStarter(job_id)

    def finished():
        start_requeued()
        return ended(run_dir)

    assert wait_for(finished, 240, "the job to end", interval=1) == "COMPLETED"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    events = JobRecord.load(run_dir).attempts()
    stops = [e for e in events if e["event"] == "end" and e["stop_signal"] == "USR2"]
    steps_in = Counter(r["attempt"] for r in rows)

    unclean = [e for e in stops if not stopped_cleanly(run_dir, job_id, e, steps_in[e["attempt"]])]
    assert not unclean, [stop_shown(run_dir, job_id, e, steps_in[e["attempt"]]) for e in unclean]
    # every requeue started one more attempt; the work spread over several, each going on from the last
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == len([e for e in events if e["event"] == "requeue"]) + 1
    attempts = [r["attempt"] for r in rows]
    assert len(set(attempts)) >= 2 and attempts == sorted(attempts)


def stopped_cleanly(run_dir: Path, job_id: str, stop: dict, steps: int) -> bool:
    """Whether an attempt that got a stop signal ended as the program decided: srun's code EXIT_STOPPED, or
    rank 0's (its shell's rank0.exit) when srun's is another rank's: one still in MPI_Finalize when rank 0
    exited was ended by --kill-on-bad-exit (143 or 137, seen under load), or srun outlived its step and
    the script ended it. 0: the program had finished when the signal came (the script does not requeue
    a finished run). An attempt that finished no step may end any way: the signal can come before the
    program has its handler (Slurm signals within ~30 s of the start), and the recorded signal still
    requeues the job."""
    log_dir = run_dir / "logs" / f"slurm-{job_id}" / f"attempt-{stop['attempt']}"
    rank0 = (log_dir / "rank0.exit").read_text().strip() if (log_dir / "rank0.exit").exists() else ""
    return stop["exit_code"] in (0, EXIT_STOPPED) or rank0 == str(EXIT_STOPPED) or not steps


def stop_shown(run_dir: Path, job_id: str, stop: dict, steps: int) -> str:
    """An attempt's end as the failure shows it: its codes, its steps and every rank's exit code and log tail."""
    log_dir = run_dir / "logs" / f"slurm-{job_id}" / f"attempt-{stop['attempt']}"
    ranks = {f.name: f.read_text().strip() for f in sorted(log_dir.glob("rank*.exit"))}
    tail = (log_dir / "rank0.log").read_text()[-600:] if (log_dir / "rank0.log").exists() else "(no rank0.log)"
    return f"attempt {stop['attempt']}: exit {stop['exit_code']}, {steps} steps, {stop}, ranks {ranks}, rank 0: {tail}"
