"""`areal-hpc doctor`'s judgement of its probe job's reports (areal_hpc/launch/doctor_probe.py writes one
per world rank): a `Check` for each of run directory, python, sandbox, memory, mpi, gpus, all-reduce and
weight sync, each from what the ranks wrote. `evaluate` runs them in that order and SKIPs what cannot be known
(no report reached this host; no MPI world, for the checks that need one). Pure: no Slurm, no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import SINGLE_TURN, Config
from areal_hpc.layout import Layout, Role


@dataclass
class Check:
    """One check's outcome, what every check of `areal-hpc doctor` returns (on this host or from the probe)."""

    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.status}  {self.name:<13}  {self.detail}"
        return text + (f"\n      fix: {self.fix}" if self.fix else "")


def evaluate(cfg: Config, layout: Layout, reports: dict, token: str, login: dict, probe_dir: Path) -> list[Check]:
    """The checks from the ranks' reports ({world rank: report})."""
    checks = [check_run_directory(cfg, layout, reports, token, probe_dir)]
    if not reports:
        for name in ("python", "memory", "mpi", "gpus", "all-reduce", "weight sync"):
            checks.append(Check(name, "SKIP", "not known: no rank's report reached this host (see run directory)"))
        return checks
    checks += [check_python(reports, login), check_sandbox(cfg, layout, reports), check_memory(layout, reports)]
    checks.append(check_mpi(layout, reports))
    if len(_in_world(layout, reports)) < layout.world_size:
        for name in ("gpus", "all-reduce", "weight sync"):
            checks.append(Check(name, "SKIP", "not run: the ranks had no MPI world (see mpi)"))
        return checks
    checks += [check_gpus(cfg, layout, reports), check_allreduce(cfg, layout, reports)]
    checks.append(check_weight_sync(cfg, layout, reports))
    return checks


def check_run_directory(cfg: Config, layout: Layout, reports: dict, token: str, probe_dir: Path) -> Check:
    """Every rank left a report, and read the token this host wrote: the run directory is shared."""
    silent = [r for r in range(layout.world_size) if r not in reports]
    blind = [r for r, rep in reports.items() if rep.get("token") != token]
    hosts = sorted({rep["host"] for rep in reports.values()})
    if not silent and not blind:
        return Check("run directory", "PASS", f"{cfg.run_dir}: shared by this host and {', '.join(hosts)}")
    where = [_ranks_text(layout, silent) + " left no report"] if silent else []
    where += [_ranks_text(layout, blind) + " did not see this host's file"] if blind else []
    return Check(
        "run directory", "FAIL", f"{cfg.run_dir} is not shared by every node: {'; '.join(where)} (in {probe_dir})",
        "put experiment.root on a filesystem that this host and every node mount at the same path "
        "(not /tmp or a node's local disk)",
    )  # fmt: skip


def check_python(reports: dict, login: dict) -> Check:
    """Each node's first rank imported the packages in a child process: the versions this host has."""
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
        return Check(
            "python", "FAIL", "; ".join(wrong),
            "the ranks run the interpreter of this host's environment: install the same packages where the "
            "nodes see them (a venv on the shared filesystem), or set cluster.container",
        )  # fmt: skip
    return Check("python", "PASS", f"{', '.join(f'{k} {v}' for k, v in login.items())} on every node")


GPU_TASK_SHARE = 0.5
"""A GPU task that may use less than this share of its node's memory FAILs the memory check: a trainer reads
Hugging Face shards and stages checkpoints in host memory, and shares its node with the others."""


def check_memory(layout: Layout, reports: dict) -> Check:
    """The memory each role's tasks may use (`doctor_probe.task_memory`: their cgroup's limit, else their
    node's memory), the least of each; FAIL when a GPU task gets less than GPU_TASK_SHARE of its node's."""
    got: dict[str, list[tuple[int, int]]] = {}  # role -> [(bytes it may use, its node's)]
    for r, rep in sorted(reports.items()):
        m = rep.get("memory")
        if m and m.get("node"):
            got.setdefault(layout.role_of(r).name.lower(), []).append((m["limit"] or m["node"], m["node"]))
    errors = sorted({rep["memory_error"] for rep in reports.values() if rep.get("memory_error")})
    if not got:
        return Check("memory", "SKIP", "not known: " + ("; ".join(errors) or "no rank reported its memory"))
    parts = []
    for role, sizes in got.items():
        least, node = min(sizes)
        parts.append(
            f"{role} {_gib(least)}" + (" (the node's all)" if least == node else f" of the node's {_gib(node)}")
        )
    detail = "the least a task may use: " + ", ".join(parts)
    short = [
        r for r in _gpu_ranks(layout)
        if (m := reports.get(r, {}).get("memory")) and m.get("limit") and m["limit"] < GPU_TASK_SHARE * m["node"]
    ]  # fmt: skip
    if not short:
        return Check("memory", "PASS", detail)
    return Check(
        "memory", "FAIL", f"{_ranks_text(layout, short)} may use less than half their node's memory; {detail}",
        "the job asks for all of a GPU node's memory (--mem=0); the partition caps it (MaxMemPerNode, or memory "
        "per CPU): choose another cluster.partition or ask the admins for the nodes' memory",
    )  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_mpi(layout: Layout, reports: dict) -> Check:
    """One MPI world of every rank (an allreduce), and the interface it is told to use on every node."""
    good = _in_world(layout, reports)
    no_interface = sorted(
        {rep["interface_error"].split(": ", 1)[-1] for rep in reports.values() if "interface_error" in rep}
    )
    if no_interface:
        return Check(
            "mpi", "FAIL", "; ".join(no_interface),
            "MPI, gloo and NCCL are told to use cluster.network_interface (a run's ranks stop at start): set it "
            "to an interface every node has, or leave it empty",
        )  # fmt: skip
    if len(good) == layout.world_size:
        names = [c.name for c in layout.components]
        return Check("mpi", "PASS", f"one world of {layout.world_size} ranks across {', '.join(names)}")
    bad = [r for r in range(layout.world_size) if r not in good]
    errors = {rep["mpi_error"].strip().splitlines()[-1] for rep in reports.values() if rep.get("mpi_error")}
    return Check(
        "mpi", "FAIL", f"{_ranks_text(layout, bad)} not in one world" + (f": {'; '.join(sorted(errors))}" if errors else ""),
        "srun --mpi=pmix must start them together: mpi4py's MPI built with PMIx, and the nodes must reach each "
        "other (cluster.network_interface)",
    )  # fmt: skip


def check_gpus(cfg: Config, layout: Layout, reports: dict) -> Check:
    """Each GPU rank's torch sees cluster.gpus_per_node GPUs (SKIP on a cpu config, or auto with none seen)."""
    errors = _allreduce_errors(layout, reports)
    seen: dict[str, int] = {}  # host -> the fewest GPUs a rank there sees
    for r in _gpu_ranks(layout):
        if "gpus" in reports.get(r, {}):
            n = reports[r]["gpus"].get("torch", 0)
            seen[reports[r]["host"]] = min(n, seen.get(reports[r]["host"], n))
    if cfg.cluster.device == "cpu":
        return Check("gpus", "SKIP", "cluster.device is cpu")
    if cfg.cluster.device == "auto" and not any(seen.values()):
        return Check("gpus", "SKIP", "cluster.device is auto and no rank's torch sees a GPU: the run would train on CPUs "
                     "(cluster.device: cuda makes a missing GPU an error)")  # fmt: skip
    short = {h: n for h, n in seen.items() if n != cfg.cluster.gpus_per_node}
    no_gpu = sorted({e for e in errors.values() if "GPU" in e})  # resolve_device: torch sees no GPU
    if seen and not short and not no_gpu:
        return Check("gpus", "PASS", f"{cfg.cluster.gpus_per_node} GPUs on each of {', '.join(sorted(seen))}")
    what = [f"{h}: torch sees {n}" for h, n in sorted(short.items())] + no_gpu
    return Check("gpus", "FAIL", "; ".join(what) or "no GPU rank reported", f"cluster.gpus_per_node = {cfg.cluster.gpus_per_node}: ask for nodes that have them (cluster.partition, cluster.constraint)")  # fmt: skip


def check_allreduce(cfg: Config, layout: Layout, reports: dict) -> Check:
    """torch.distributed across the GPU ranks of every GPU node, with the run's backend."""
    gpu_ranks = _gpu_ranks(layout)
    done = {r: reports[r]["allreduce"] for r in gpu_ranks if "allreduce" in reports.get(r, {})}
    if len(done) == len(gpu_ranks) and all(d["ok"] for d in done.values()):
        kind = next(iter(done.values()))["backend"] if done else "-"
        spread = f"{len(gpu_ranks)} generator and trainer ranks on {layout.nodes} GPU node(s)"
        return Check("all-reduce", "PASS", f"{kind} across {spread}{_nccl_note(cfg)}")
    bad = [r for r in gpu_ranks if not done.get(r, {}).get("ok")]
    errors = _allreduce_errors(layout, reports)
    return Check(
        "all-reduce", "FAIL", f"{_ranks_text(layout, bad)}: " + ("; ".join(sorted(set(errors.values()))) or "no result"),
        "set cluster.network_interface to the nodes' fast interface (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); "
        "cluster.env NCCL_DEBUG=INFO shows why",
    )  # fmt: skip


def check_sandbox(cfg: Config, layout: Layout, reports: dict) -> Check:
    """The code sandbox (bubblewrap) on the nodes that run programs in it: the reward workers', which score
    `reward.kind: code`; the generators', where a workflow's `python` tool runs (any `rollout.workflow` but
    the default, which runs no tool). Each node's first rank tried one."""
    needs = {Role.REWARD: "reward.kind code"} if cfg.reward.kind == "code" else {}
    if cfg.rollout.workflow != SINGLE_TURN:
        needs[Role.GENERATOR] = f"the python tool of rollout.workflow {cfg.rollout.workflow}"
    if not needs:
        return Check("sandbox", "SKIP", f"no program runs in it: reward.kind {cfg.reward.kind}, the default workflow")
    hosts = {rep["host"] for rep in reports.values() if rep.get("role") in needs}
    tried = {  # host -> what its first rank found
        rep["host"]: rep["sandbox"] for rep in reports.values() if "sandbox" in rep and rep["host"] in hosts
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
        return Check(
            "weight sync", "PASS",
            f"{kind} from {_ranks_text(layout, sources)}{which} to {_ranks_text(layout, generators)} at {at}, "
            f"checked by every receiver{_nccl_note(cfg)}",
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


def _in_world(layout: Layout, reports: dict) -> list[int]:
    """The ranks whose MPI allreduce summed the whole world."""
    return [r for r, rep in reports.items() if rep.get("mpi") == {"size": layout.world_size, "sum": layout.world_size}]


def _gpu_ranks(layout: Layout) -> list[int]:
    """The ranks that hold GPUs: the generators and the trainers."""
    return [*layout.ranks(Role.GENERATOR), *layout.ranks(Role.TRAINER)]


def _allreduce_errors(layout: Layout, reports: dict) -> dict[int, str]:
    """{GPU rank: the last line of its all-reduce error}."""
    return {
        r: reports[r]["allreduce_error"].strip().splitlines()[-1]
        for r in _gpu_ranks(layout)
        if reports.get(r, {}).get("allreduce_error")
    }


def _nccl_note(cfg: Config) -> str:
    """What a PASS on a config other than cuda did not check."""
    if cfg.cluster.device == "cuda":
        return ""
    return f" (cluster.device is {cfg.cluster.device}: NCCL is checked on a cuda config)"


def _ranks_text(layout: Layout, ranks: list[int]) -> str:
    """'world ranks 2-4, 7 (generator, trainer)'."""
    roles = [role.name.lower() for role in sorted({layout.role_of(r) for r in ranks})]
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    span = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"world rank{'s' if len(ranks) > 1 else ''} {span} ({', '.join(roles)})"
