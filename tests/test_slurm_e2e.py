"""The whole system as one Slurm job: `areal-hpc submit configs/tiny-cpu.yaml` on the local test cluster (fake
nodes of 4 fake GPUs): a run on 2 nodes whose first node holds the controller, the reward worker, the generator
and a trainer rank, stopped by the time-limit signal, requeued, resumed from the controller's checkpoint, then
preempted by Slurm in its second attempt, requeued and resumed again, repeating no step, to its end;
`areal-hpc status` reads its metrics; the same run resubmitted on one node, every role on it, resumed at another
layout. Each job costs a minute here and more, so one run is checked for what several would show."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_hpc.exit_codes import EXIT_STOPPED
from areal_hpc.launch.record import JobRecord
from tests.support.helpers import ONE_REQUEUE, REPO, RequeueStarter, ended, wait_done, wait_for

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


# OMPI_MCA_btl: only because the fake nodes share one host (sbatch passes the environment on)
ENV = {**os.environ, "OMPI_MCA_btl": "self,tcp"}


def submit(root: Path, trial: str, *overrides: str, nodes: int) -> Path:
    cmd = [sys.executable, "-m", "areal_hpc.cli", "submit", "configs/tiny-cpu.yaml", "--nodes", str(nodes)]
    cmd += [f"experiment.root={root}", f"experiment.trial={trial}", *SMALL, *overrides]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "submitted job" in out.stdout
    return root / "tiny-cpu" / trial


STOPPED_TWICE_STEPS = 24
"""A step of this job takes 0.4 to 5 s here (LONG answers, 2 nodes of 2 GPUs; 3.8 s on average in its third
attempt): a stop must come while steps remain, the preemption seconds after the two steps of the second attempt
it waits for (seen: the first stop at step 2, the second at step 4 of 40)."""
LONG = ["sft.examples=0", "rollout.max_new_tokens=480"]
"""The stopped job's answers: its model, not warm-started, writes up to 480 tokens (its context is 512), one
answer in 50 past 256, so each stop comes in the middle of some (tests/test_e2e.py's Ctrl-C run likewise)."""
STOPPED = [*LONG, "cluster.partition=low", "cluster.grace_s=30"]
"""The stopped job's settings, its resubmission's too, but its steps and GPUs per node."""
TWO_REQUEUES = [*ONE_REQUEUE, (1, "requeue"), (2, "start"), (2, "end")]
"""(attempt, event) of the job stopped by the time-limit signal and then preempted."""


@pytest.fixture(scope="module")
def stopped_twice(slurm_cluster, runs_root, tmp_path_factory) -> SimpleNamespace:
    """One job of the preemptible partition `low` (tools/local_slurm.sh: preempted by `high` with a GraceTime of
    30 s) on 2 nodes of 2 GPUs (a heterogeneous job: the controller, the reward worker, the generator and a
    trainer rank on the first node, two more trainer ranks, DP 3, on the second), stopped twice and requeued
    each time: after two steps by the signal Slurm sends
    cluster.requeue_signal_s before the time limit (SIGUSR2 to the batch script: the controller checkpoints
    and exits, the script requeues), then two steps into its second attempt by Slurm's own preemption for a
    `high` job that needs every node (SIGTERM to every rank: the controller checkpoints within
    cluster.grace_s and exits, the job requeues itself). Each requeued attempt starts as soon as that is safe
    (RequeueStarter). STOPPED_TWICE_STEPS steps, so that each stop comes while steps remain."""
    steps_and_gpus = (f"train.total_steps={STOPPED_TWICE_STEPS}", "cluster.gpus_per_node=2")
    run_dir = submit(runs_root, "stopped-twice", *steps_and_gpus, *STOPPED, nodes=2)
    job_id = JobRecord.load(run_dir).job_id
    metrics = run_dir / "metrics.jsonl"
    high_out = tmp_path_factory.mktemp("high") / "high.out"
    start_requeued = RequeueStarter(job_id)

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def steps_in_attempt_1() -> bool:
        start_requeued()
        return len(JobRecord.load(run_dir).attempts()) >= 4 and steps() >= stopped_at + 2

    def finished():
        start_requeued()
        return ended(run_dir)

    try:
        wait_for(lambda: steps() >= 2, 300, "two steps")
        # what Slurm sends cluster.requeue_signal_s before the time limit
        subprocess.run(["scancel", "--signal=USR2", "--batch", job_id], check=True)
        wait_for(lambda: len(JobRecord.load(run_dir).attempts()) >= 2, 120, "the first attempt to end")
        stopped_at = steps()
        wait_for(steps_in_attempt_1, 300, "two steps of the requeued attempt")
        # a job of the higher partition that needs every node: Slurm preempts the run for it
        cmd = ["sbatch", "--partition=high", "--nodes=4", "--exclusive", f"--output={high_out}"]
        subprocess.run([*cmd, "--wrap", "echo high ran on $SLURM_JOB_NODELIST; sleep 3"], check=True, env=ENV)
        wait_for(lambda: high_out.exists() and "high ran" in high_out.read_text(), 120, "the high job to run")
        state = wait_for(finished, 420, "the requeued run to end", interval=1)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    events = JobRecord.load(run_dir).attempts()
    assert [(e["attempt"], e["event"]) for e in events] == TWO_REQUEUES, events
    assert state == "COMPLETED"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STOPPED_TWICE_STEPS + 1)), "every step once"
    log = (run_dir / "logs" / "controller-0.log").read_text()  # every attempt's, appended
    attempts = log.split("resumed from")  # the log of each attempt, from the resume of the one before
    assert len(attempts) == 3, log
    return SimpleNamespace(run_dir=run_dir, events=events, rows=rows, log=log, attempts=attempts)


def test_time_limit_signal_checkpoints_requeues_and_resumes(stopped_twice):
    end = stopped_twice.events[1]  # the first attempt's
    assert end["stop_signal"] == "USR2" and end["controller_stop"] == "SIGUSR2" and end["preempted"] is False
    # the controller checkpointed and exited EXIT_STOPPED; srun's code is 143 when --kill-on-bad-exit had to end the
    # others, 137 when srun outlived its step and the script ended it (seen on the fake cluster)
    assert end["exit_code"] in (EXIT_STOPPED, 143) or (end["exit_code"] == 137 and end["srun_ended_by_script"])
    first = stopped_twice.attempts[0]
    assert "stop requested (SIGUSR2)" in first and "checkpoint of version" in first
    steps = [(int(s), json.loads(p)) for s, p in re.findall(r"step (\d+) trains prompts (\[.*\])", stopped_twice.log)]
    prompts = [i for _, indices in steps for i in indices]
    assert len(prompts) == len(set(prompts)), "no prompt trained twice across the requeues"
    # each resumed attempt goes on with the answers in flight at its checkpoint; their tokens are trained (an answer
    # carried twice counts twice in the logs, once when trained: tests/test_e2e.py's Ctrl-C run checks equality)
    found = [
        re.search(r"running groups \(\d+\): (\d+) answers in flight \((\d+) tokens\)", a)
        for a in stopped_twice.attempts[1:]
    ]
    assert all(found) and sum(int(f[1]) for f in found) > 0, stopped_twice.log
    trained = sum(r["rollout/resumed_tokens"] for r in stopped_twice.rows)
    assert 0 < trained <= sum(int(f[2]) for f in found), (trained, [f[0] for f in found])


def test_preempted_run_requeues_resumes_and_finishes(stopped_twice):
    end, requeue = stopped_twice.events[4], stopped_twice.events[5]  # the second attempt's
    assert end["preempted"] is True and end["controller_stop"] == "SIGTERM" and requeue["reason"] == "preempted"
    assert end["exit_code"] in (EXIT_STOPPED, 143) or (end["exit_code"] == 137 and end["srun_ended_by_script"])
    second = stopped_twice.attempts[1]
    assert "stop requested (SIGTERM): checkpointing at the end of the running step" in second
    assert "checkpoint of version" in second
    assert max(r["staleness/max"] for r in stopped_twice.rows) <= 1  # rollout.max_staleness of SMALL


def status(run_dir: Path) -> str:
    """What `areal-hpc status RUN_DIR` prints."""
    cmd = [sys.executable, "-m", "areal_hpc.cli", "status", str(run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV).stdout


def test_submit_on_two_nodes_runs_to_the_end_and_resubmitted_on_one_resumes_there(stopped_twice, runs_root):
    """The job stopped twice, of a 4-task and a 2-task component, ran to its end, every step in its metrics, and
    `areal-hpc status` reads them. Then the same run submitted with --nodes 1 of 3 GPUs for 2 more steps: one
    node, one component, every role on it, 2 trainer ranks at DP 2, the checkpoint's state resharded, the
    controller's carried over, every step once; each rank's log names its own GPUs of the node, the generator's
    and the trainers' apart."""
    run_dir, ended_at = stopped_twice.run_dir, STOPPED_TWICE_STEPS
    assert Path(JobRecord.load(run_dir).script).read_text().count("#SBATCH hetjob") == 1
    shown = status(run_dir)
    assert "COMPLETED" in shown and f"last step: {ended_at}" in shown, shown
    assert "no longer listed" not in shown, shown  # a heterogeneous job
    one_node = (f"train.total_steps={ended_at + 2}", "cluster.gpus_per_node=3")
    assert submit(runs_root, "stopped-twice", *one_node, *STOPPED, nodes=1) == run_dir
    record = JobRecord.load(run_dir)
    try:
        state = wait_done(run_dir, 480)
    finally:
        subprocess.run(["scancel", record.job_id], capture_output=True)
    logs = run_dir / "logs" / f"slurm-{record.job_id}" / "attempt-0"
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
    assert state == "COMPLETED", tails
    assert "#SBATCH hetjob" not in Path(record.script).read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, ended_at + 3)), "every step once across the jobs"
    assert all("reward/mean" in r and "ppo/loss" in r for r in rows)
    shown = status(run_dir)
    assert "COMPLETED" in shown and f"last step: {ended_at + 2}" in shown, shown
    assert "no longer listed" not in shown, shown  # a job of one component too
    # where the one-node job's ranks ran (the last "on host" line of each rank's log, which both jobs appended to)
    where = {}
    for role, count in (("controller", 1), ("reward", 1), ("generator", 1), ("trainer", 2)):
        for i in range(count):
            text = (run_dir / "logs" / f"{role}-{i}.log").read_text()
            node, task, gpus, given = re.findall(
                r"Slurm node (\S+): node 0 \(shared\), task (\d+), GPUs (\S+) of (\S+)", text
            )[-1]
            where[(role, i)] = (node, int(task), gpus, given)
    assert len({node for node, _, _, _ in where.values()}) == 1, where  # one node
    assert [task for _, task, _, _ in where.values()] == [0, 1, 2, 3, 4], where  # its tasks in world-rank order
    gpus = {key: found[2] for key, found in where.items()}
    assert gpus[("controller", 0)] == gpus[("reward", 0)] == "none"
    given = where[("generator", 0)][3].split(",")  # the node's 3 GPUs, which Slurm shows every task
    own = [gpus[("generator", 0)], gpus[("trainer", 0)], gpus[("trainer", 1)]]
    assert len(given) == 3 and sorted(own) == sorted(given), where  # each rank its own, every one used
    log = (run_dir / "logs" / "controller-0.log").read_text()
    was = "2 node(s) x 2 GPUs: 1 generator(s) at TP 1, 3 trainer rank(s) at TP 1 x PP 1 x DP 3"
    now = "1 node(s) x 3 GPUs: 1 generator(s) at TP 1, 2 trainer rank(s) at TP 1 x PP 1 x DP 2"
    assert f"step_{ended_at} at version {ended_at}, written on {was}, now on {now}" in log, log
    steps = [(int(s), json.loads(p)) for s, p in re.findall(r"step (\d+) trains prompts (\[.*\])", log)]
    assert [s for s, _ in steps] == list(range(1, ended_at + 3))
    prompts = [i for _, indices in steps for i in indices]
    assert len(prompts) == len(set(prompts)), "no prompt trained twice across the jobs"
