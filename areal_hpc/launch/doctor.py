"""`areal-hpc doctor CONFIG --nodes N`: what to check on a new cluster before a long job.

```
 on this host     slurm          Slurm >= 20.02 and heterogeneous jobs allowed (backfill, hetjob steps)
                  pmix           `srun --mpi=list` has pmix
                  partitions     they exist, are up, and hold the nodes, GPUs and CPUs the job asks for
                                 (cluster.cpus_per_node, or for 0 the CPU count sinfo gives the partition)
                  preemption     a preemptible partition's GraceTime covers cluster.grace_s
                  wandb          with logging.wandb: the client imports and, online, has credentials
 one probe job    run directory  every rank reads a file this host wrote there and writes its own back
 (the run's own   python         torch, vllm, megatron.core, mpi4py import on every node, at this host's versions
                  sandbox        a program runs in bubblewrap on the nodes that run programs: the reward
                                 workers' with reward.kind code, the generators' with a rollout.workflow
                                 other than the default (the python tool)
  sbatch script,  mpi            one MPI world across the components (an allreduce); every node has
  components and                 cluster.network_interface, when set
  resources)      gpus           each GPU rank sees its node's GPUs (cuda)
                  all-reduce     torch.distributed across the generator and trainer ranks of every GPU node,
                                 with the run's backend: NCCL on cuda, gloo on cpu
                  weight sync    the run's start-up weight-sync broadcasts, from each group's source to
                                 every generator rank (a group per pipeline stage and, with
                                 allocation.train_ep > 1, expert rank, as a run opens, joins and checks
                                 them); a FAIL names the groups that did not get through
```

Each check is PASS, FAIL (with what to do), or SKIP when it does not apply (GPUs on a CPU config: a
fact, not a pass). The checks on this host are here; the probe is the run's own heterogeneous job
(`render_sbatch` with a stand-in command, `areal_hpc/launch/doctor_probe.py`) under a short time limit, so
it asks for exactly what the run will (areal_hpc/launch/doctor_job.py); its reports go to
RUN_DIR/.doctor/probe/<time>/ (kept when a check fails) and are judged in areal_hpc/launch/doctor_reports.py.
"""

from __future__ import annotations

import re
import subprocess

from areal_hpc.config import Config, ConfigError
from areal_hpc.launch import LaunchError
from areal_hpc.launch.doctor_job import probe
from areal_hpc.launch.doctor_reports import Check
from areal_hpc.launch.slurm import _default_python, check_cluster, describe_request, partitions, resolve_cpus
from areal_hpc.layout import Layout
from areal_hpc.planner import resolve_split
from areal_hpc.wandb_log import check_wandb


def doctor(cfg: Config, python: str | None = None, wait_s: float = 600, say=print) -> list[Check]:
    """Every check, printed as it is known; returns them (on the GPU split a run would be launched on)."""
    cfg, _ = resolve_split(cfg)
    checks = []

    def add(check: Check) -> None:
        checks.append(check)
        say(str(check))

    for check in (check_slurm, check_pmix, check_partitions, check_preemption, check_wandb_client):
        add(check(cfg))
    if any(c.status == "FAIL" for c in checks if c.name in ("slurm", "partitions")):
        for name in ("run directory", "python", "mpi", "gpus", "all-reduce", "weight sync"):
            add(Check(name, "SKIP", "not run: the probe job needs the checks above to pass"))
        return checks
    cfg = resolve_cpus(cfg, partitions())  # the partitions check resolved it
    for check in probe(cfg, python or _default_python(cfg), wait_s, say):
        add(check)
    return checks


# --- on this host --------------------------------------------------------------------------------


def check_slurm(cfg: Config) -> Check:
    version = _output(["sinfo", "--version"])
    if version is None:
        return Check("slurm", "FAIL", "the Slurm commands (sinfo, srun) do not run here", "run doctor on a login node")
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m or (int(m.group(1)), int(m.group(2))) < (20, 2):
        return Check(
            "slurm", "FAIL", f"{version.strip()}: too old", "Slurm 20.02 or later (#SBATCH hetjob, srun --het-group)"
        )
    if len(Layout.from_config(cfg).components) == 1:  # allocation.reward_nodes 0: no heterogeneous job
        return Check("slurm", "PASS", f"Slurm {m.group(0)}; one job of the GPU nodes (allocation.reward_nodes 0)")
    config = _output(["scontrol", "show", "config"]) or ""
    sched = re.search(r"^SchedulerType\s*=\s*(\S+)", config, re.M)
    params = re.search(r"^SchedulerParameters\s*=\s*(\S*)", config, re.M)
    if sched and sched.group(1) != "sched/backfill":
        return Check(
            "slurm", "FAIL", f"SchedulerType={sched.group(1)}: heterogeneous jobs start only under sched/backfill",
            "ask the cluster's admins for SchedulerType=sched/backfill",
        )  # fmt: skip
    if params and re.search(r"disable_het(ero|job)_steps", params.group(1)):
        return Check(
            "slurm", "FAIL", f"SchedulerParameters={params.group(1)} disables steps across the components of a job",
            "ask the cluster's admins to drop disable_hetjob_steps",
        )  # fmt: skip
    return Check(
        "slurm", "PASS", f"Slurm {m.group(0)}; heterogeneous jobs and steps allowed ({sched and sched.group(1)})"
    )


def check_wandb_client(cfg: Config) -> Check:
    if not cfg.logging.wandb:
        return Check("wandb", "SKIP", "logging.wandb is false")
    try:
        return Check("wandb", "PASS", check_wandb(cfg.logging))
    except ConfigError as e:
        return Check("wandb", "FAIL", str(e))


def check_pmix(cfg: Config) -> Check:
    out = _output(["srun", "--mpi=list"], stderr=True)
    if out is None:
        return Check("pmix", "FAIL", "srun does not run here", "run doctor on a login node")
    kinds = sorted(set(re.findall(r"\bpmix\w*", out)))
    if not kinds:
        return Check(
            "pmix", "FAIL", f"srun --mpi=list has no pmix: {' '.join(out.split())}",
            "the ranks start with srun --mpi=pmix: ask the admins for Slurm's PMIx plugin (mpi/pmix)",
        )  # fmt: skip
    return Check("pmix", "PASS", f"srun --mpi=list: {', '.join(kinds)}")


def check_partitions(cfg: Config) -> Check:
    available = partitions()
    if not available:
        return Check("partitions", "FAIL", "sinfo lists no partition", "run doctor on a login node of the cluster")
    try:
        check_cluster(cfg, available)
        cfg = resolve_cpus(cfg, available)  # cluster.cpus_per_node 0: the fewest CPUs of a node, from sinfo
    except LaunchError as e:
        return Check(
            "partitions",
            "FAIL",
            str(e),
            "set cluster.partition / cluster.cpu_partition, --nodes or cluster.cpus_per_node to fit",
        )
    used = sorted(set(_used_partitions(cfg, available)))
    state = _output(["sinfo", "--noheader", "--format=%R %a", "--partition", ",".join(used)]) or ""
    down = sorted(
        {line.split()[0] for line in state.splitlines() if len(line.split()) == 2 and line.split()[1] != "up"}
    )
    if down:
        return Check("partitions", "FAIL", f"partition(s) {', '.join(down)} not up", "ask the admins, or use another")
    return Check("partitions", "PASS", f"{', '.join(used)} hold(s) the job: {describe_request(cfg)}")


def check_preemption(cfg: Config) -> Check:
    notes = []
    for name in sorted(set(_used_partitions(cfg, partitions() or {}))):
        info = _output(["scontrol", "show", "partition", name, "--oneliner"])
        if info is None:
            continue  # no such partition: the partitions check says so
        mode = re.search(r"PreemptMode=(\S+)", info)
        grace = re.search(r"GraceTime=(\d+)", info)
        if not mode or mode.group(1).upper() == "OFF":
            notes.append(f"{name} is not preemptible")
            continue
        g = int(grace.group(1)) if grace else 0
        if g < cfg.cluster.grace_s:
            return Check(
                "preemption", "FAIL",
                f"partition {name} preempts ({mode.group(1)}) {g} s after its SIGTERM, less than cluster.grace_s "
                f"({cfg.cluster.grace_s}): the controller would start checkpoints that Slurm kills",
                f"set cluster.grace_s={g}",
            )  # fmt: skip
        notes.append(
            f"{name} preempts ({mode.group(1)}) after GraceTime {g} s >= cluster.grace_s {cfg.cluster.grace_s}"
        )
    return Check("preemption", "PASS", "; ".join(notes) or "no partition to check")


def _used_partitions(cfg: Config, available: dict) -> list[str]:
    default = next((n for n, p in available.items() if p.default), "")
    gpu = cfg.cluster.partition or default
    cpu = (cfg.cluster.cpu_partition or gpu) if Layout.from_config(cfg).reward_nodes else gpu
    return [p for p in (gpu, cpu) if p]


def _output(cmd: list[str], stderr: bool = False) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout + (out.stderr if stderr else "")


__all__ = ["Check", "doctor"]
