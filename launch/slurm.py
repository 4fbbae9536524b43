"""`areal-hpc submit`: one heterogeneous Slurm job through submitit.

submitit 1.5.4 knows only homogeneous jobs, so `HetSlurmExecutor` extends its `SlurmExecutor` in the
three places that differ and keeps the rest (submission file handling, `sbatch` call and its error,
job id parsing, `Job` objects with `cancel()`, `stdout()`, `stderr()`, its log names):

- the submission text is `launch.sbatch.render_sbatch` (three components, one MPMD `srun` step);
- the job state comes from `squeue` over the components `ID+0`, `ID+1`, `ID+2` (`HetSlurmInfoWatcher`):
  submitit asks `sacct`, which reports a heterogeneous job as UNKNOWN (and clusters without
  accounting have no `sacct`);
- the checkpoint/requeue cycle runs in the batch script (SIGUSR2 before the time limit -> controller
  checkpoints and exits -> `scontrol requeue`), since the ranks run `areal_hpc.main`, not submitit's
  pickled function.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

from submitit.core import utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from areal_hpc.config import Config, save_config
from areal_hpc.layout import Layout
from areal_hpc.rundir import prepare_run_dir
from launch import LaunchError
from launch.record import JobRecord, parse_squeue, squeue_command
from launch.sbatch import render_sbatch


class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """Job states from `squeue` (`%i` is `ID+k` for component k); the leader's entry is the job's state,
    the worst of its components."""

    def _make_command(self) -> list[str] | None:
        to_check = sorted({x.split("_")[0] for x in self._registered - self._finished})
        return squeue_command(to_check) if to_check else None

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        return parse_squeue(string.decode() if isinstance(string, bytes) else string)


class HetSlurmJob(SlurmJob):
    watcher = HetSlurmInfoWatcher(delay_s=30)


class HetSlurmExecutor(SlurmExecutor):
    """A submitit Slurm executor whose one job is the rendered heterogeneous script.

    `submit_script()` replaces `submit(fn, ...)`: every rank runs the script's own command
    (`python -m areal_hpc.main RUN_DIR`), so there is no pickled function to ship.
    """

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, script: str) -> None:
        if "%j" in str(folder):
            # ranks of components 1+ fail with "Slurmd could not connect IO" and the step hangs
            raise LaunchError(f"the submitit folder must not contain %j (got {folder})")
        super().__init__(folder)
        self.script = script

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script

    def _num_tasks(self) -> int:
        return 1  # one Job handle for the whole job; rank logs live in the run's logs/

    def submit_script(self) -> HetSlurmJob:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            return self._submit_command("areal_hpc.main")  # type: ignore[return-value]
        except utils.FailedJobError as e:
            raise LaunchError(f"sbatch rejected the job: {str(e).strip()}") from None


def partitions() -> list[str] | None:
    """The cluster's partitions from `sinfo` (None when sinfo cannot answer)."""
    try:
        out = subprocess.run(["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def check_partitions(cfg: Config, available: list[str] | None) -> None:
    """A clear error when the config names a partition the cluster does not have."""
    if available is None:
        return
    for key in ("partition", "cpu_partition"):
        name = getattr(cfg.cluster, key)
        if name and name not in available:
            raise LaunchError(
                f"cluster.{key} '{name}' is not a partition of this cluster (sinfo lists: {', '.join(available)})"
            )


def describe_request(cfg: Config) -> str:
    """What the job asks for, for error messages: 'controller 1 node x 2 tasks, generator ...'."""
    parts = []
    for comp in Layout.from_config(cfg).components:
        gpus = f", {comp.gpus_per_node} GPUs/node" if comp.name != "controller" and cfg.cluster.device == "cuda" else ""
        parts.append(f"{comp.name} {comp.nodes} node(s) x {comp.ntasks // comp.nodes} task(s){gpus}")
    return "; ".join(parts)


class SlurmLauncher:
    """Submits the run as one heterogeneous job and returns at once; `areal-hpc status` follows it."""

    name = "slurm"

    def __init__(self, python: str | None = None, command: list[str] | None = None):
        self.python = python
        """Interpreter of the ranks (default: this one, or `python` inside cluster.container)."""
        self.command = command
        """What every rank runs (default: `python -m areal_hpc.main RUN_DIR`)."""

    def script(self, cfg: Config) -> str:
        return render_sbatch(cfg, workdir=Path.cwd(), python=self.python or _default_python(cfg), command=self.command)

    def launch(self, cfg: Config, fresh: bool = False) -> int:
        job_id = self.submit(cfg, fresh=fresh)
        run_dir = Path.cwd() / cfg.run_dir
        print(f"submitted job {job_id}: {describe_request(cfg)}")
        print(f"  follow it:  areal-hpc status {run_dir}")
        print(f"  cancel it:  areal-hpc cancel {run_dir}")
        return 0

    def submit(self, cfg: Config, fresh: bool = False) -> str:
        """Prepare the run directory, submit the job, write RUN_DIR/job.json; returns the job id."""
        check_partitions(cfg, partitions())
        script = self.script(cfg)  # before touching the run directory: a config error changes nothing
        run_dir = prepare_run_dir(cfg, fresh=fresh).resolve()
        record = JobRecord.load(run_dir)
        if record is not None and record.active():
            raise LaunchError(
                f"job {record.job_id} of this run is still {record.state()}; "
                f"cancel it first (areal-hpc cancel {run_dir}) or pick another experiment.trial"
            )
        executor = HetSlurmExecutor(run_dir / "slurm", script)
        try:
            job = executor.submit_script()
        except LaunchError as e:
            raise LaunchError(f"{e}\n  the job asked for: {describe_request(cfg)}") from None
        save_config(cfg, run_dir / "config.yaml")
        JobRecord(
            job_id=job.job_id,
            submitted_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            script=str(job.paths.submission_file),
            run_dir=str(run_dir),
            components=[c.name for c in Layout.from_config(cfg).components],
        ).save(run_dir)
        return job.job_id


class DryRunLauncher:
    """Prints the sbatch script that `SlurmLauncher` would submit, and submits nothing."""

    name = "dry-run"

    def __init__(self, out=None, **slurm_kwargs):
        self.slurm = SlurmLauncher(**slurm_kwargs)
        self.out = out

    def launch(self, cfg: Config, fresh: bool = False) -> int:
        print(self.slurm.script(cfg), end="", file=self.out or sys.stdout)
        return 0


def _default_python(cfg: Config) -> str:
    # Inside a container the image's python runs the ranks; otherwise this very interpreter (a venv).
    return "python" if cfg.cluster.container else sys.executable


__all__ = [
    "DryRunLauncher",
    "HetSlurmExecutor",
    "HetSlurmJob",
    "SlurmLauncher",
    "check_partitions",
    "partitions",
]
