"""The Slurm job of a run, as recorded in its run directory, and what `areal-hpc status` shows of it
(`areal-hpc cancel` is `areal_hpc.launch.slurm.cancel`, which cancels through submitit).

```
 RUN_DIR/job.json               written at submission: job id, submit time, script, components; cancel time
 RUN_DIR/slurm/attempts.jsonl   one line per event of the batch script: start / end (exit code) / requeue
 RUN_DIR/slurm/<id>_0_log.out   the batch script's output (submitit's log names); .err beside it
 RUN_DIR/logs/slurm-<id>/attempt-<n>/rank<r>.log   each rank's output, one directory per attempt
 RUN_DIR/logs/slurm-<id>/attempt-<n>/rank<r>.exit  its exit code (when the rank's shell saw it end)
 RUN_DIR/metrics.jsonl          one line per training step (written by the controller)
```

Slurm forgets a finished job after MinJobAge (300 s by default), so the state falls back on the record:
the last attempt's exit code, or the cancel time. A squeue that cannot answer (a busy or restarting
controller) is SqueueError, never read as the job's end.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.jsonl import read_jsonl
from areal_hpc.launch.errors import LaunchError

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}

# The job is as far along as its least advanced component, and failed if any component failed.
_ORDER = ["FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "CANCELLED", "PREEMPTED", "REQUEUED", "PENDING"]
_ORDER += ["CONFIGURING", "RUNNING", "COMPLETING", "COMPLETED"]


def parse_squeue(text: str) -> dict[str, dict[str, str]]:
    """`ID+k|STATE|NODES|REASON` lines -> {"ID+k": {...}, "ID": {"State": the worst component state}}."""
    info: dict[str, dict[str, str]] = {}
    components: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4:
            continue
        jid, state, nodes, reason = parts[:4]
        info[jid] = {"JobID": jid, "State": state, "NodeList": nodes, "Reason": reason}
        if "+" in jid:
            components.setdefault(jid.split("+")[0], []).append(state)
    rank = {s: i for i, s in enumerate(_ORDER)}
    for leader, states in components.items():
        info[leader] = {"JobID": leader, "State": min(states, key=lambda s: rank.get(s, len(_ORDER)))}
    return info


def squeue_command(job_ids: list[str]) -> list[str]:
    return ["squeue", "--noheader", "--states=all", "--format=%i|%T|%N|%r", "--jobs", ",".join(job_ids)]


class SqueueError(LaunchError):
    """squeue is there but could not answer (the controller busy or restarting): the job's state is unknown,
    which is not the same as ended."""


def query_states(job_id: str) -> dict[str, dict[str, str]] | None:
    """Slurm's view of the job and its components, or None when Slurm does not know it (any more) or is not
    installed here (the record then tells); raises SqueueError when squeue could not answer."""
    try:
        return _squeue(job_id)
    except OSError:
        return None


def job_active(job_id: str) -> bool | None:
    """Whether Slurm still has the job pending or running: False once it has ended or been forgotten,
    None when squeue cannot answer (no Slurm here, or its controller did not answer)."""
    try:
        info = _squeue(job_id)
    except (OSError, SqueueError):
        return None
    return info is not None and info[job_id]["State"] in ACTIVE


def _squeue(job_id: str) -> dict[str, dict[str, str]] | None:
    try:
        out = subprocess.run(squeue_command([job_id]), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise SqueueError(f"squeue did not answer within 60 s about job {job_id}; try again") from None
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return None
        message = out.stderr.strip() or f"exit code {out.returncode}"
        raise SqueueError(f"squeue could not answer about job {job_id} ({message}); try again")
    info = parse_squeue(out.stdout)
    return info if job_id in info else None


@dataclass
class JobRecord:
    job_id: str
    submitted_at: str
    script: str
    run_dir: str
    components: list[str] = field(default_factory=list)
    cancelled_at: str | None = None

    @staticmethod
    def path(run_dir: Path) -> Path:
        return Path(run_dir) / "job.json"

    @classmethod
    def load(cls, run_dir: Path) -> JobRecord | None:
        p = cls.path(run_dir)
        if not p.is_file():
            return None
        data = json.loads(p.read_text())
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def save(self, run_dir: Path) -> None:
        p = self.path(run_dir)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        tmp.replace(p)

    def attempts(self) -> list[dict]:
        """This job's events from RUN_DIR/slurm/attempts.jsonl, oldest first."""
        p = Path(self.run_dir) / "slurm" / "attempts.jsonl"
        if not p.is_file():
            return []
        return [e for *_, e in read_jsonl(p, torn_ok=True) if str(e.get("job_id")) == self.job_id]

    def state(self, slurm: dict[str, dict[str, str]] | None = None) -> str:
        """The job's state: Slurm's while it knows the job, else the record's."""
        slurm = query_states(self.job_id) if slurm is None else slurm
        if slurm:
            return slurm[self.job_id]["State"]
        if self.cancelled_at:
            return "CANCELLED"
        events = self.attempts()
        if not events:
            return "UNKNOWN"
        last = events[-1]
        if last["event"] == "end":
            return "COMPLETED" if last.get("exit_code") == 0 else f"FAILED (exit code {last.get('exit_code')})"
        return "UNKNOWN"


def status(run_dir: Path) -> str:
    """What `areal-hpc status RUN_DIR` prints: the job, each component's state, attempts, last metrics."""
    run_dir = Path(run_dir)
    record = JobRecord.load(run_dir)
    if record is None:
        raise LaunchError(f"{run_dir} has no Slurm job record (job.json): it was not submitted with areal-hpc submit")
    slurm = query_states(record.job_id)
    lines = [f"run {run_dir}", f"job {record.job_id}: {record.state(slurm)} (submitted {record.submitted_at})"]
    for k, name in enumerate(record.components):  # squeue lists a job of one component by its own id
        comp = (slurm or {}).get(f"{record.job_id}+{k}" if len(record.components) > 1 else record.job_id)
        if comp:
            where = comp["NodeList"] if comp["State"] != "PENDING" else f"reason: {comp['Reason']}"
            lines.append(f"  component {k} {name:<10} {comp['State']:<11} {where}")
        else:
            lines.append(f"  component {k} {name:<10} {'-':<11} (no longer listed by Slurm)")
    events = record.attempts()
    starts = [e for e in events if e["event"] == "start"]
    if starts:
        last = starts[-1]
        requeues = sum(e["event"] == "requeue" for e in events)
        lines.append(f"attempts: {len(starts)} ({requeues} requeue(s)); current logs: {last.get('log_dir', '?')}")
    ends = [e for e in events if e["event"] in ("end", "requeue")]
    if ends and ends[-1]["event"] == "end" and ends[-1].get("stop_signal") and ends[-1].get("exit_code"):
        lines.append(
            "stopped at the time limit after the last allowed requeue (cluster.max_requeues); submit again to "
            "resume from the last checkpoint"
        )
    if record.cancelled_at:
        lines.append(f"cancelled at {record.cancelled_at}")
    lines += _metrics_lines(run_dir / "metrics.jsonl")
    return "\n".join(lines)


def _metrics_lines(path: Path) -> list[str]:
    if not path.is_file():
        return ["metrics: none yet"]
    rows = [row for *_, row in read_jsonl(path, torn_ok=True)]
    if not rows:
        return ["metrics: none yet"]
    last = rows[-1]
    step = last.get("step", len(rows))
    keys = [k for k in SHOWN_METRICS if k in last] or [k for k in last if k != "step"]
    shown = ", ".join(f"{k}={_fmt(last[k])}" for k in keys)
    return [f"last step: {step}", f"metrics: {shown}"]


SHOWN_METRICS = (
    "reward/mean",
    "staleness/max",
    "throughput/effective_tokens_per_s",
    "timing/step_s",
    "ppo/loss",
    "ppo/grad_norm",
)
"""What `status` shows of the last metrics line (all of it when none of these is there)."""


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
