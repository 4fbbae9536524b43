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
                  sandbox        a program runs in bubblewrap on the nodes that run programs: the controller
                                 component's with reward.kind code, the generators' with a rollout.workflow
                                 other than the default (the python tool)
  sbatch script,  mpi            one MPI world across the components (an allreduce); every node has
  components and                 cluster.network_interface, when set
  resources)      gpus           each GPU rank sees its node's GPUs (cuda)
                  all-reduce     torch.distributed across the nodes of each GPU component, with the run's
                                 backend: NCCL on cuda, gloo on cpu
                  weight sync    the run's start-up weight-sync broadcasts, from each group's source to
                                 every generator rank (a group per pipeline stage and, with
                                 allocation.train_ep > 1, expert rank, as a run opens, joins and checks
                                 them); a FAIL names the groups that did not get through
```

Each check is PASS, FAIL (with what to do), or SKIP when it does not apply (GPUs on a CPU config: a
fact, not a pass). The probe is the run's own heterogeneous job (`render_sbatch` with a stand-in
command, `areal_hpc/launch/doctor_probe.py`) under a short time limit, so it asks for exactly what the run will;
its reports go to RUN_DIR/.doctor/probe/<time>/ (kept when a check fails).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import SINGLE_TURN, Config, ConfigError
from areal_hpc.launch import LaunchError
from areal_hpc.launch.record import ACTIVE, query_states
from areal_hpc.launch.sbatch import render_sbatch
from areal_hpc.launch.slurm import (
    HetSlurmExecutor,
    _default_python,
    check_cluster,
    describe_request,
    partitions,
    resolve_cpus,
)
from areal_hpc.layout import Layout, Role
from areal_hpc.planner import resolve_split
from areal_hpc.wandb_log import check_wandb

PROBE = Path(__file__).resolve().parent / "doctor_probe.py"
PROBE_TIME = "00:05:00"
"""Time limit of the probe job (it takes about a minute; a hung MPI start ends there)."""


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.status}  {self.name:<13}  {self.detail}"
        return text + (f"\n      fix: {self.fix}" if self.fix else "")


def doctor(cfg: Config, python: str | None = None, wait_s: float = 600, say=print) -> list[Check]:
    """Every check, printed as it is known; returns them (on the node split a run would be launched on)."""
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
    return [p for p in (gpu, cfg.cluster.cpu_partition or gpu) if p]


def _output(cmd: list[str], stderr: bool = False) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout + (out.stderr if stderr else "")


# --- the probe job -------------------------------------------------------------------------------


def probe(cfg: Config, python: str, wait_s: float, say) -> list[Check]:
    """Submit the probe job, wait for it, read what its ranks wrote."""
    layout = Layout.from_config(cfg)
    run_dir = (Path.cwd() / cfg.run_dir).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    experiment = dataclasses.replace(cfg.experiment, root=str(run_dir / ".doctor"), name="probe", trial=stamp)
    cluster = dataclasses.replace(cfg.cluster, time=PROBE_TIME, max_requeues=0)
    pcfg = dataclasses.replace(cfg, experiment=experiment, cluster=cluster)
    reports = pcfg.run_dir / "reports"
    reports.mkdir(parents=True)
    token = uuid.uuid4().hex
    (reports / "token").write_text(token)
    starts = ",".join(str(c.first_rank) for c in layout.components)
    sources = probe_sources(layout)
    interface = cfg.cluster.network_interface
    command = [python, "-u", str(PROBE), str(reports), cfg.cluster.device, starts, sources, interface]
    script = render_sbatch(pcfg, workdir=Path.cwd(), python=python, command=command)
    try:
        job = HetSlurmExecutor(pcfg.run_dir / "slurm", script).submit_script()
    except LaunchError as e:
        return [Check("run directory", "FAIL", f"the probe job was not accepted: {e}", "see the partitions check")]
    say(
        f"      probe job {job.job_id} submitted ({describe_request(cfg)}); waiting for it (up to {wait_s:.0f} s to start)"
    )
    state = _wait(job.job_id, wait_s, say)
    if state == "PENDING":
        subprocess.run(["scancel", job.job_id], capture_output=True)
        return [
            Check(
                "run directory", "FAIL", f"the probe job did not start within {wait_s:.0f} s",
                "wait for free nodes (areal-hpc doctor --wait), or ask for fewer",
            )
        ]  # fmt: skip
    found = {}
    for p in reports.glob("rank*.json"):
        try:
            found[int(p.stem[4:])] = json.loads(p.read_text())
        except (ValueError, OSError):
            continue
    checks = evaluate(cfg, layout, found, token, _login_versions(), pcfg.run_dir)
    if all(c.status != "FAIL" for c in checks):  # nothing to look at: leave no trace (but a run's files)
        shutil.rmtree(pcfg.run_dir, ignore_errors=True)
        for empty in (pcfg.run_dir.parent, run_dir / ".doctor", run_dir):
            try:
                empty.rmdir()
            except OSError:
                break
    return checks


def _wait(job_id: str, wait_s: float, say) -> str:
    """Poll until the job has ended ("ENDED") or is still pending after wait_s ("PENDING")."""
    t0, last_say = time.monotonic(), 0.0
    while True:
        info = query_states(job_id)
        state = info[job_id]["State"] if info else "ENDED"
        if state not in ACTIVE:
            return "ENDED"
        now = time.monotonic() - t0
        if state == "PENDING" and now > wait_s:
            return "PENDING"
        if now - last_say > 30:
            reasons = {v.get("Reason") for k, v in (info or {}).items() if "+" in k} - {None, "None"}
            say(f"      probe job {job_id}: {state}" + (f" ({', '.join(sorted(reasons))})" if reasons else ""))
            last_say = now
        time.sleep(2)


def _login_versions() -> dict[str, str]:
    out = subprocess.run([sys.executable, str(PROBE), "--versions"], capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def evaluate(cfg: Config, layout: Layout, reports: dict, token: str, login: dict, probe_dir: Path) -> list[Check]:
    """The checks from the ranks' reports ({world rank: report})."""
    names = [c.name for c in layout.components]
    ranks = range(layout.world_size)
    silent = [r for r in ranks if r not in reports]
    blind = [r for r, rep in reports.items() if rep.get("token") != token]
    hosts = sorted({rep["host"] for rep in reports.values()})
    checks = []
    if not silent and not blind:
        checks.append(Check("run directory", "PASS", f"{cfg.run_dir}: shared by this host and {', '.join(hosts)}"))
    else:
        where = [_ranks_text(layout, silent) + " left no report"] if silent else []
        where += [_ranks_text(layout, blind) + " did not see this host's file"] if blind else []
        checks.append(
            Check(
                "run directory", "FAIL", f"{cfg.run_dir} is not shared by every node: {'; '.join(where)} (in {probe_dir})",
                "put experiment.root on a filesystem that this host and every node mount at the same path "
                "(not /tmp or a node's local disk)",
            )
        )  # fmt: skip
    if not reports:
        for name in ("python", "mpi", "gpus", "all-reduce", "weight sync"):
            checks.append(Check(name, "SKIP", "not known: no rank's report reached this host (see run directory)"))
        return checks

    # python: each node's first rank imported the packages in a child process
    differ: dict[str, list[str]] = {}  # what a node has -> the nodes that have it
    for rep in sorted(reports.values(), key=lambda r: r["host"]):
        theirs = rep.get("versions")
        if theirs is None:
            continue
        if "error" in theirs:
            error = theirs["error"].strip().splitlines()[-1]
            differ.setdefault(f"the import check failed ({error})", []).append(rep["host"])
            continue
        for pkg, v in theirs.items():
            if v != login.get(pkg):
                differ.setdefault(f"{pkg} {v} (this host: {login.get(pkg, 'missing')})", []).append(rep["host"])
    wrong = [f"{what} on {', '.join(hosts)}" for what, hosts in differ.items()]
    if wrong:
        checks.append(
            Check(
                "python", "FAIL", "; ".join(wrong),
                "the ranks run the interpreter of this host's environment: install the same packages where the "
                "nodes see them (a venv on the shared filesystem), or set cluster.container",
            )
        )  # fmt: skip
    else:
        checks.append(Check("python", "PASS", f"{', '.join(f'{k} {v}' for k, v in login.items())} on every node"))
    checks.append(check_sandbox(cfg, layout, reports))

    # mpi (and the interface it is told to use)
    good = [r for r, rep in reports.items() if rep.get("mpi") == {"size": layout.world_size, "sum": layout.world_size}]
    no_interface = sorted(
        {rep["interface_error"].split(": ", 1)[-1] for rep in reports.values() if "interface_error" in rep}
    )
    if no_interface:
        checks.append(
            Check(
                "mpi", "FAIL", "; ".join(no_interface),
                "MPI, gloo and NCCL are told to use cluster.network_interface (a run's ranks stop at start): set it "
                "to an interface every node has, or leave it empty",
            )
        )  # fmt: skip
    elif len(good) == layout.world_size:
        checks.append(Check("mpi", "PASS", f"one world of {layout.world_size} ranks across {', '.join(names)}"))
    else:
        bad = [r for r in ranks if r not in good]
        errors = {rep["mpi_error"].strip().splitlines()[-1] for rep in reports.values() if rep.get("mpi_error")}
        checks.append(
            Check(
                "mpi", "FAIL", f"{_ranks_text(layout, bad)} not in one world" + (f": {'; '.join(sorted(errors))}" if errors else ""),
                "srun --mpi=pmix must start them together: mpi4py's MPI built with PMIx, and the nodes must reach each "
                "other (cluster.network_interface)",
            )
        )  # fmt: skip

    gpu_ranks = [r for c in layout.components[1:] for r in c.ranks]
    if len(good) < layout.world_size:
        for name in ("gpus", "all-reduce", "weight sync"):
            checks.append(Check(name, "SKIP", "not run: the ranks had no MPI world (see mpi)"))
        return checks
    errors = {
        r: reports[r]["allreduce_error"].strip().splitlines()[-1]
        for r in gpu_ranks
        if reports.get(r, {}).get("allreduce_error")
    }
    seen: dict[str, int] = {}  # host -> the fewest GPUs a rank there sees
    for r in gpu_ranks:
        if "gpus" in reports.get(r, {}):
            n = reports[r]["gpus"].get("torch", 0)
            seen[reports[r]["host"]] = min(n, seen.get(reports[r]["host"], n))
    if cfg.cluster.device == "cpu":
        checks.append(Check("gpus", "SKIP", "cluster.device is cpu"))
    elif cfg.cluster.device == "auto" and not any(seen.values()):
        checks.append(
            Check("gpus", "SKIP", "cluster.device is auto and no rank's torch sees a GPU: the run would train on CPUs "
                  "(cluster.device: cuda makes a missing GPU an error)")
        )  # fmt: skip
    else:
        short = {h: n for h, n in seen.items() if n != cfg.cluster.gpus_per_node}
        no_gpu = sorted({e for e in errors.values() if "GPU" in e})  # resolve_device: torch sees no GPU
        if seen and not short and not no_gpu:
            checks.append(
                Check("gpus", "PASS", f"{cfg.cluster.gpus_per_node} GPUs on each of {', '.join(sorted(seen))}")
            )
        else:
            what = [f"{h}: torch sees {n}" for h, n in sorted(short.items())] + no_gpu
            checks.append(
                Check("gpus", "FAIL", "; ".join(what) or "no GPU rank reported", f"cluster.gpus_per_node = {cfg.cluster.gpus_per_node}: ask for nodes that have them (cluster.partition, cluster.constraint)")
            )  # fmt: skip

    done = {r: reports[r]["allreduce"] for r in gpu_ranks if "allreduce" in reports.get(r, {})}
    if len(done) == len(gpu_ranks) and all(d["ok"] for d in done.values()):
        kind = next(iter(done.values()))["backend"] if done else "-"
        spread = ", ".join(f"{c.name} ({c.nodes} node(s))" for c in layout.components[1:])
        note = (
            ""
            if cfg.cluster.device == "cuda"
            else f" (cluster.device is {cfg.cluster.device}: NCCL is checked on a cuda config)"
        )
        checks.append(Check("all-reduce", "PASS", f"{kind} across the nodes of {spread}{note}"))
    else:
        bad = [r for r in gpu_ranks if not done.get(r, {}).get("ok")]
        checks.append(
            Check(
                "all-reduce", "FAIL", f"{_ranks_text(layout, bad)}: " + ("; ".join(sorted(set(errors.values()))) or "no result"),
                "set cluster.network_interface to the nodes' fast interface (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); "
                "cluster.env NCCL_DEBUG=INFO shows why",
            )
        )  # fmt: skip
    checks.append(check_weight_sync(cfg, layout, reports))
    return checks


def check_sandbox(cfg: Config, layout: Layout, reports: dict) -> Check:
    """The code sandbox (bubblewrap) on the nodes that run programs in it: the controller component's, where
    the reward workers score `reward.kind: code`; the generators', where a workflow's `python` tool runs
    (any `rollout.workflow` but the default, which runs no tool). Each node's first rank tried one."""
    needs = {"controller": "reward.kind code"} if cfg.reward.kind == "code" else {}
    if cfg.rollout.workflow != SINGLE_TURN:
        needs["generator"] = f"the python tool of rollout.workflow {cfg.rollout.workflow}"
    if not needs:
        return Check("sandbox", "SKIP", f"no program runs in it: reward.kind {cfg.reward.kind}, the default workflow")
    names = [c.name for c in layout.components]
    tried = {  # host -> what its first rank found
        rep["host"]: rep["sandbox"] for rep in reports.values() if "sandbox" in rep and names[rep["component"]] in needs
    }
    why = " and ".join(needs.values())
    if not tried:
        return Check("sandbox", "SKIP", f"not known: no node that needs it ({why}) reported")
    bad = {h: what for h, what in sorted(tried.items()) if what != "ok"}
    if bad:
        return Check(
            "sandbox", "FAIL", "; ".join(f"{h}: {what}" for h, what in bad.items()) + f" (needed for {why})",
            "install bubblewrap (the package `bubblewrap`, command bwrap) on those nodes; run as a user, bwrap needs "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 where the kernel has it)",
        )  # fmt: skip
    return Check("sandbox", "PASS", f"a program ran in bubblewrap on {', '.join(sorted(tried))} ({why})")


def check_weight_sync(cfg: Config, layout: Layout, reports: dict) -> Check:
    """The start-up broadcasts from each weight-sync group's source to every generator rank, a group per
    (pipeline stage, expert rank) (`Layout.sync_sources`; areal_hpc/launch/doctor_probe.py `weight_sync_check`):
    PASS when every member joined and checked every group it belongs to; a FAIL names the groups whose
    source did not get through, and every error."""
    groups, generators = layout.sync_sources(), list(layout.ranks(Role.GENERATOR))
    sources = [r for _, _, r in groups]
    members = [*sources, *generators]
    done = {r: reports[r]["weight_sync"] for r in members if "weight_sync" in reports.get(r, {})}
    if len(done) == len(members) and all(d["ok"] for d in done.values()):
        kind = done[sources[0]]["backend"]
        at = ", ".join(at for r in sources for _, at in done[r]["joined"])
        stages = f"stages 0-{layout.train_pp - 1}" if layout.train_pp > 1 else "stage 0"
        which = ""
        if layout.train_ep > 1:
            each = " of each" if layout.train_pp > 1 else ""
            which = f", the sources of {stages}, expert ranks 0-{layout.train_ep - 1}{each},"
        elif layout.train_pp > 1:
            which = f", the sources of {stages},"
        note = (
            ""
            if cfg.cluster.device == "cuda"
            else f" (cluster.device is {cfg.cluster.device}: NCCL is checked on a cuda config)"
        )
        return Check(
            "weight sync", "PASS",
            f"{kind} from {_ranks_text(layout, sources)}{which} to {_ranks_text(layout, generators)} at {at}, "
            f"checked by every receiver{note}",
        )  # fmt: skip
    errors = sorted({reports[r]["weight_sync_error"] for r in members if "weight_sync_error" in reports.get(r, {})})
    bad = [r for r in members if r not in done]
    failed = [(stage, e, r) for stage, e, r in groups if r not in done]
    where = ""
    if failed:
        plural = "s" if len(failed) > 1 else ""
        if layout.train_ep > 1:
            what = f"group{plural} " + ", ".join(f"(stage {stage}, expert rank {e})" for stage, e, _ in failed)
        else:
            what = f"stage{plural} " + ", ".join(str(stage) for stage, _, _ in failed)
        where = f"{what} of {len(groups)} (from {_ranks_text(layout, [r for _, _, r in failed])}) not checked; "
    return Check(
        "weight sync", "FAIL", where + f"{_ranks_text(layout, bad)}: " + ("; ".join(e.split("; the address is")[0] for e in errors) or "no result"),
        "set cluster.network_interface to an interface every node has (the weight-sync address, NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME) and let the nodes reach each other's ports; cluster.env NCCL_DEBUG=INFO shows NCCL's side",
    )  # fmt: skip


def probe_sources(layout: Layout) -> str:
    """The probe's SOURCES: each weight-sync group's source (`Layout.sync_sources`) as stage:expert
    rank:world rank, comma-separated ("0:0:4,0:1:5,1:0:8,1:1:9")."""
    return ",".join(f"{stage}:{e}:{r}" for stage, e, r in layout.sync_sources())


def _ranks_text(layout: Layout, ranks: list[int]) -> str:
    """'world ranks 2-4, 7 (generator, trainer)'."""
    order = [c.name for c in layout.components]
    comps = sorted({c.name for c in layout.components for r in ranks if r in c.ranks}, key=order.index)
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    span = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"world rank{'s' if len(ranks) > 1 else ''} {span} ({', '.join(comps)})"


__all__ = ["Check", "doctor"]
