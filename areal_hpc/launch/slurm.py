"""`areal-hpc submit`: one Slurm job through submitit.

submitit 1.5.4 knows only homogeneous jobs, so `HetSlurmExecutor` extends its `SlurmExecutor` in the
three places that differ and keeps the rest (submission file handling, `sbatch` call and its error,
job id parsing, `Job` objects with `cancel()`, `stdout()`, `stderr()`, its log names):

- the submission text is `areal_hpc.launch.sbatch.render_sbatch` (the layout's components: the controller's
  CPU nodes when allocation.reward_nodes asks for any, then runs of GPU nodes; one MPMD `srun` step);
- the job state comes from `squeue` over the job or its components `ID+0`, `ID+1`, ... (`HetSlurmInfoWatcher`):
  submitit asks `sacct`, which reports a heterogeneous job as UNKNOWN (and clusters without
  accounting have no `sacct`);
- the checkpoint/requeue cycle runs in the batch script (SIGUSR2 before the time limit, or a
  preemption's SIGTERM -> the controller checkpoints if it has the time, and exits -> `scontrol
  requeue`), since the ranks run `areal_hpc.main`, not submitit's pickled function.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from submitit.core import utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from areal_hpc import planner
from areal_hpc.config import Config
from areal_hpc.launch.errors import LaunchError
from areal_hpc.launch.record import ACTIVE, JobRecord, job_active, parse_squeue, squeue_command
from areal_hpc.launch.sbatch import cpus_per_task, render_sbatch, tasks_text
from areal_hpc.layout import Layout
from areal_hpc.rundir import Holder, lock_run_dir, prepare_run_dir, relock_run_dir, unlock_run_dir
from areal_hpc.wandb_log import check_wandb
from areal_hpc.workflow import load_workflow


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
        try:
            super().__init__(folder)
        except RuntimeError as e:  # no srun on this machine
            raise LaunchError(f"{e} (areal-hpc submit needs the Slurm client commands; `--dry-run` does not)") from None
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


@dataclass(frozen=True)
class Partition:
    nodes: int
    gpus_per_node: int
    """Most GPUs (gres gpu) on one of its nodes."""
    default: bool
    cpus_per_node: int
    """Fewest CPUs on one of its nodes: what cluster.cpus_per_node 0 becomes (`resolve_cpus`)."""
    most_cpus: int
    """Most CPUs on one of its nodes: a cluster.cpus_per_node above it fits none."""


def partitions() -> dict[str, Partition] | None:
    """The cluster's partitions from `sinfo` (None when sinfo cannot answer). --exact: one line per node
    configuration, so that nodes of different CPU counts are not summed up as 'FEWEST+'."""
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--exact", "--format=%P|%D|%G|%c"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sinfo(out.stdout) if out.returncode == 0 else None


def parse_sinfo(text: str) -> dict[str, Partition]:
    """`NAME[*]|NODES|GRES|CPUS` lines (one per node configuration) -> {name: Partition}."""
    found: dict[str, Partition] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[1].isdigit():
            continue
        name, nodes, gres, cpus_text = parts
        default = name.endswith("*")
        name = name.rstrip("*")
        gpus = max([int(m) for m in re.findall(r"gpu(?::[\w.-]+)*?:(\d+)", gres)] or [0])
        cpus = int(re.match(r"\d*", cpus_text).group() or 0)  # 'N+' (grouped nodes): at least N
        old = found.get(name)
        if old is None:
            found[name] = Partition(int(nodes), gpus, default, cpus, cpus)
            continue
        found[name] = Partition(
            old.nodes + int(nodes),
            max(old.gpus_per_node, gpus),
            old.default or default,
            min(old.cpus_per_node, cpus),
            max(old.most_cpus, cpus),
        )
    return found


def resolve_cpus(cfg: Config, available: dict[str, Partition] | None) -> Config:
    """`cfg` with `cluster.cpus_per_node` a number: as the config sets it, or for 0 the fewest CPUs of a
    node of the GPU partition (`available`: `partitions()`, sinfo's answer). A launcher
    resolves it once, after the GPU split (`planner.resolve_split`): the script is then a
    function of the config alone, and the run's config.yaml records what was asked."""
    c = cfg.cluster
    if c.cpus_per_node:
        return cfg
    fix = "set cluster.cpus_per_node to the CPUs of a GPU node (on the cluster: sinfo -o %c -p PARTITION)"
    if not available:
        raise LaunchError(f"cluster.cpus_per_node is 0 (read from Slurm), but sinfo cannot answer here: {fix}")
    name = c.partition or next((n for n, p in available.items() if p.default), "")
    found = available.get(name)
    if found is None or not found.cpus_per_node:
        said = f"no partition '{name}'" if found is None else f"no CPU count for partition '{name}'"
        raise LaunchError(
            f"cluster.cpus_per_node is 0 (read from Slurm), but sinfo lists {said} (partitions: "
            f"{', '.join(sorted(available))}): set cluster.partition, or {fix}"
        )
    tasks = Layout.from_config(cfg).busiest_gpu_node
    if found.cpus_per_node < tasks:
        raise LaunchError(
            f"partition '{name}' has nodes of {found.cpus_per_node} CPUs, fewer than the {tasks} tasks of the busiest "
            f"GPU node: every task needs a CPU; use another cluster.partition"
        )
    return dataclasses.replace(cfg, cluster=dataclasses.replace(c, cpus_per_node=found.cpus_per_node))


def check_cluster(cfg: Config, available: dict[str, Partition] | None) -> None:
    """A clear error when the cluster cannot give what the config asks for: a partition it does not have,
    more nodes than a partition holds, more GPUs or CPUs per node than its nodes have. (sbatch accepts a
    heterogeneous job larger than its partition and leaves it pending for ever.)"""
    if not available:
        return
    c = cfg.cluster
    default = next((n for n, p in available.items() if p.default), None)
    for key in ("partition", "cpu_partition"):
        name = getattr(c, key)
        if name and name not in available:
            raise LaunchError(
                f"cluster.{key} '{name}' is not a partition of this cluster (sinfo lists: {', '.join(sorted(available))})"
            )
    layout = Layout.from_config(cfg)
    gpu_part = c.partition or default
    cpu_part = c.cpu_partition or gpu_part
    need = {gpu_part: layout.nodes}
    need[cpu_part] = need.get(cpu_part, 0) + layout.reward_nodes
    for name, nodes in need.items():
        if name in available and nodes > available[name].nodes:
            raise LaunchError(
                f"the job needs {nodes} nodes in partition '{name}' ({describe_request(cfg)}), which has "
                f"{available[name].nodes}; lower --nodes (cluster.nodes = {c.nodes} GPU nodes + "
                f"allocation.reward_nodes = {layout.reward_nodes} CPU node(s))"
            )
    if layout.uses_gpus and gpu_part in available and c.gpus_per_node > available[gpu_part].gpus_per_node:
        raise LaunchError(
            f"cluster.gpus_per_node ({c.gpus_per_node}) exceeds the {available[gpu_part].gpus_per_node} GPUs per node "
            f"of partition '{gpu_part}' (cluster.device {c.device} asks Slurm for GPUs; cluster.device=cpu asks for none)"
        )
    most = available[gpu_part].most_cpus if gpu_part in available else 0
    if most and c.cpus_per_node > most:
        raise LaunchError(
            f"cluster.cpus_per_node ({c.cpus_per_node}) exceeds the {most} CPUs of the largest node of partition "
            f"'{gpu_part}' (sinfo -o %c -p {gpu_part}): set it to at most {most}, or to 0 to read it from Slurm"
        )


def describe_request(cfg: Config) -> str:
    """What the job asks for, for error messages: 'controller 1 node(s) x 2 task(s); gpu ...'."""
    c, parts = cfg.cluster, []
    for comp in Layout.from_config(cfg).components:
        extra = f", {comp.gpus_per_node} GPUs/node" if comp.gpus_per_node else ""
        cpus = cpus_per_task(c, comp)
        extra += f", {cpus} CPUs/task" if cpus else ""
        if not comp.cpu_nodes:
            extra += ", all memory/node"
        elif c.controller_mem:
            extra += f", {c.controller_mem} memory/node"
        parts.append(f"{comp.name} {tasks_text(comp)}{extra}")
    return "; ".join(parts)


class SlurmLauncher:
    """Submits the run as one Slurm job and returns at once; `areal-hpc status` follows it."""

    name = "slurm"

    def __init__(self, python: str | None = None, command: list[str] | None = None):
        self.python = python
        """Interpreter of the ranks (default: this one, or `python` inside cluster.container)."""
        self.command = command
        """What every rank runs (default: `python -m areal_hpc.main RUN_DIR`)."""

    def script(self, cfg: Config) -> str:
        """The job's sbatch script of a config whose node split is resolved (`planner.resolve_split`); a
        config whose generator or trainer does not fit its GPUs is refused first (`planner.check_fits`:
        what to change, by name; a cpu config's nodes are not known here), and so is one whose timeouts a
        normal run would exceed (`planner.check_timeouts`), and so is a `rollout.workflow`
        that cannot be imported here or is not a Workflow (the job's generators would fail on it)."""
        load_workflow(cfg.rollout.workflow)
        if cfg.cluster.device != "cpu":
            planner.check_fits(cfg)
            planner.check_timeouts(cfg)
        return render_sbatch(cfg, workdir=Path.cwd(), python=self.python or _default_python(cfg), command=self.command)

    def launch(self, cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> int:
        cfg, _ = planner.resolve_split(cfg)  # the run directory's config.yaml records the split
        available = partitions()
        check_cluster(cfg, available)
        cfg = resolve_cpus(cfg, available)  # and the CPUs of a GPU node
        job_id = self.submit(cfg, fresh=fresh, allow_change=allow_change)
        run_dir = Path.cwd() / cfg.run_dir
        print(f"submitted job {job_id}: {describe_request(cfg)}")
        print(f"  follow it:  areal-hpc status {run_dir}")
        print(f"  cancel it:  areal-hpc cancel {run_dir}")
        return 0

    def submit(self, cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> str:
        """Prepare the run directory, submit the job, write RUN_DIR/job.json; returns the job id. The
        job holds the run directory's lock from then on (stale once Slurm no longer runs it). `cfg`'s node
        split and CPUs are resolved and checked against the cluster (`launch` does both). A resume's
        changed settings are checked and recorded here, once (`rundir.prepare_run_dir`): a requeued job
        runs the saved config.yaml as it is."""
        script = self.script(cfg)  # before touching the run directory: a config error changes nothing
        check_wandb(cfg.logging)  # sbatch passes this environment (WANDB_*) on to the job
        executor = HetSlurmExecutor(cfg.run_dir.resolve() / "slurm", script)
        holder = Holder.this_process()
        lock_run_dir(cfg.run_dir, holder, job_active)  # two runs must never write one run directory
        try:
            run_dir = prepare_run_dir(cfg, fresh=fresh, allow_change=allow_change).resolve()
            job = executor.submit_script()
        except LaunchError as e:
            unlock_run_dir(cfg.run_dir, holder)
            raise LaunchError(f"{e}\n  the job asked for: {describe_request(cfg)}") from None
        except BaseException:
            unlock_run_dir(cfg.run_dir, holder)
            raise
        relock_run_dir(run_dir, holder.as_job(job.job_id))
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

    def launch(self, cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> int:
        cfg, _ = planner.resolve_split(cfg)
        cfg = resolve_cpus(cfg, partitions())  # off the cluster: the config must set cluster.cpus_per_node
        print(self.slurm.script(cfg), end="", file=self.out or sys.stdout)
        return 0


def _default_python(cfg: Config) -> str:
    # Inside a container the image's python runs the ranks; otherwise this very interpreter (a venv).
    return "python" if cfg.cluster.container else sys.executable


def cancel(run_dir: Path) -> str:
    """Cancel the run's job (every component) and record it; returns what was done."""
    run_dir = Path(run_dir)
    record = JobRecord.load(run_dir)
    if record is None:
        raise LaunchError(f"{run_dir} has no Slurm job record (job.json): nothing to cancel")
    state = record.state()
    if state not in ACTIVE:
        return f"job {record.job_id} is already {state}; nothing to cancel"
    try:
        HetSlurmJob(folder=run_dir / "slurm", job_id=record.job_id).cancel(check=True)
    except subprocess.CalledProcessError as e:
        raise LaunchError(f"scancel {record.job_id} failed (exit code {e.returncode})") from None
    record.cancelled_at = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    record.save(run_dir)
    return f"cancelled job {record.job_id} ({state} before)"


__all__ = [
    "DryRunLauncher",
    "HetSlurmExecutor",
    "HetSlurmJob",
    "SlurmLauncher",
    "cancel",
    "check_cluster",
    "partitions",
    "resolve_cpus",
]
