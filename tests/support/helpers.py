"""Helpers shared by test modules (a test module never imports another): the repository's paths, and
waiting on jobs of the local Slurm cluster (tests/test_slurm.py, tests/test_slurm_e2e.py,
tests/test_slurm_placement.py)."""

import os
import subprocess
import time
from pathlib import Path

from areal_hpc.launch.record import ACTIVE, JobRecord, SqueueError, query_states

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.yaml"
MPI_PROGRAMS = REPO / "tests" / "support" / "mpi"  # what the tests run under mpirun or in a Slurm job


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def components(job_id: str) -> dict[str, dict[str, str]]:
    """The job's components as Slurm lists them; none while squeue cannot answer (a busy controller)."""
    try:
        return {k: v for k, v in (query_states(job_id) or {}).items() if "+" in k}
    except SqueueError:
        return {}


def ended(run_dir: Path) -> str | None:
    """The job's final state once it has ended; None while it is active or squeue cannot answer."""
    try:
        state = JobRecord.load(run_dir).state()
    except SqueueError:
        return None
    return state if state not in ACTIVE else None


def nodes_idle() -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
    return bool(out) and all(state == "idle" for state in out)


class RequeueStarter:
    """Starts a requeued job as soon as that is safe, rather than after Slurm's ~2 min hold.

    Safe means: every component is PENDING, the nodes are idle, the old step's PMIx sockets are gone
    (a new step with the same job and step id fails to bind them), and 2 s have passed since the job
    was first seen pending: slurmd revokes the old attempt's credential with a time in whole seconds,
    and a start within the same second is killed as "Job credential revoked".
    """

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.spool = Path(os.environ["SLURM_CONF"]).parent.parent / "spool"
        self.pending_since: float | None = None

    def __call__(self) -> bool:
        """True once it has asked Slurm to start the job now."""
        comps = components(self.job_id)
        pending = comps and all(c["State"] == "PENDING" for c in comps.values())
        if not pending:
            self.pending_since = None
            return False
        self.pending_since = self.pending_since or time.time()
        if time.time() - self.pending_since < 2 or not nodes_idle():
            return False
        if list(self.spool.glob(f"*/stepd.slurm.pmix.{self.job_id}.*")):
            return False
        subprocess.run(["scontrol", "update", f"JobId={self.job_id}", "StartTime=now"], capture_output=True)
        return True


ONE_REQUEUE = [(0, "start"), (0, "end"), (0, "requeue"), (1, "start"), (1, "end")]
"""(attempt, event) of a job's attempts.jsonl when it was requeued once and then ended."""


def wait_done(run_dir: Path, timeout: float) -> str:
    """The job's final state; on a timeout, the error shows its attempts and the batch script's output."""
    record = JobRecord.load(run_dir)
    try:
        return wait_for(lambda: ended(run_dir), timeout, f"job {record.job_id} to end")
    except AssertionError as e:
        shown = [run_dir / "slurm" / "attempts.jsonl", *sorted((run_dir / "slurm").glob("*_log.*"))]
        tails = [f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:]) for p in shown if p.exists()]
        raise AssertionError("\n".join([str(e), *tails])) from None
