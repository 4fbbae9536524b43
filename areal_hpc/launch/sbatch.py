"""The sbatch script of a run: one pure function of the config, filled into `areal_hpc/launch/templates/hetjob.sbatch`.

```
 #SBATCH <job-wide options: name, output, time, signal, requeue>
 #SBATCH <component 0: controller + reward workers, CPU nodes>     world ranks 0 .. R   (allocation.reward_nodes >= 1)
 #SBATCH hetjob
 #SBATCH <component 1: GPU nodes of k tasks each, their memory>    the next ranks, node after node
 #SBATCH hetjob
 #SBATCH <component 2: the next GPU nodes of k' tasks each>        ...
 srun --mpi=pmix --kill-on-bad-exit=1 ... --het-group=0 [its CPUs] RANK : --het-group=1 [its CPUs] RANK : ...
                                          RANK = python -m areal_hpc.main RUN_DIR, wrapped
```

The components are the layout's (`Layout.components`): the controller's CPU nodes when there are any, then
the GPU nodes in runs of nodes that run as many tasks each. A node may hold engines and trainer ranks, and
with allocation.reward_nodes 0 the first GPU node also the controller and the reward workers; a job of
nodes that all run as many tasks is one component, not a heterogeneous job (no `hetjob`, no `--het-group`).
(Tried on the local Slurm cluster: the components of a step cannot share a node, "Requested nodelist
overlaps with excluded", so roles that share a node share a component.)

The one `srun` step numbers the tasks of the components consecutively, so SLURM_PROCID, the MPI world
rank and `Layout.role_of` agree. CPUs (`cpus_per_task`): a GPU node's tasks share `cluster.cpus_per_node`
evenly, the controller component's tasks have `cluster.controller_cpus` each. They are asked for on the
component's #SBATCH lines (a node that is not exclusive gives a task one CPU otherwise) and again after its
`--het-group` in the step: since Slurm 22.05 srun no longer takes `--cpus-per-task` from the allocation,
and a component's srun options carry over to the next components unless they set their own. Memory: each
GPU node's, all of it (`--mem=0`; `--exclusive` alone gives a task only the partition's default per CPU);
the controller component's `cluster.controller_mem`. Nothing here reads the machine: the same config (its
`cpus_per_node` resolved, `areal_hpc.launch.slurm.resolve_cpus`), work directory and python give the same
text (snapshot-tested against tests/snapshots/*.sbatch).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from areal_hpc.config import ClusterConfig, Config, ConfigError
from areal_hpc.exit_codes import EXIT_STOPPED, STOP_REASON_ENV
from areal_hpc.layout import Component, Layout, Role, span

TEMPLATE = Path(__file__).resolve().parent / "templates" / "hetjob.sbatch"


def render_sbatch(
    cfg: Config,
    *,
    workdir: str | Path,
    python: str,
    command: list[str] | None = None,
    template: str | None = None,
) -> str:
    """The heterogeneous sbatch script of `cfg`.

    workdir: absolute directory the job runs in (`cfg.run_dir` is relative to it).
    python: the interpreter every rank runs (a venv's python, or `python` inside a container).
    command: what each rank runs (default: `python -m areal_hpc.main RUN_DIR`; tests pass a stand-in).
    template: template text (default: areal_hpc/launch/templates/hetjob.sbatch).
    """
    layout = Layout.from_config(cfg)
    c = cfg.cluster
    require_cpus(c, layout.busiest_gpu_node)
    workdir = Path(workdir)
    run_dir = workdir / cfg.run_dir
    slurm_dir = run_dir / "slurm"
    if command is None:
        command = [python, "-u", "-m", "areal_hpc.main", str(run_dir)]

    # Job-wide options go in the first component (sbatch reads them from there).
    job = [
        f"--job-name=areal-{cfg.experiment.name}-{cfg.experiment.trial}",
        f"--chdir={workdir}",
        # submitit's log names (JobPaths): %j_0_log.out in the submitit folder RUN_DIR/slurm
        f"--output={slurm_dir}/%j_0_log.out",
        f"--error={slurm_dir}/%j_0_log.err",
        "--open-mode=append",
        f"--time={c.time}",
        f"--signal=B:USR2@{c.requeue_signal_s}",
        "--requeue",
    ]
    directives = [f"#SBATCH {opt}" for opt in job]
    table, texts = [], node_texts(layout)
    for i, comp in enumerate(layout.components):
        gpu = not comp.cpu_nodes
        opts = []
        partition = c.partition if gpu else (c.cpu_partition or c.partition)
        if partition:
            opts.append(f"--partition={partition}")
        if c.account:
            opts.append(f"--account={c.account}")
        if c.qos:
            opts.append(f"--qos={c.qos}")
        cpus = cpus_per_task(c, comp)
        opts += [f"--nodes={comp.nodes}", *_task_opts(comp)]
        if cpus:
            opts.append(f"--cpus-per-task={cpus}")
        if gpu:
            opts.append("--mem=0")
        elif c.controller_mem:
            opts.append(f"--mem={c.controller_mem}")
        if comp.gpus_per_node:  # the layout's: every GPU node's GPUs unless cluster.device is cpu
            opts.append(f"--gpus-per-node={comp.gpus_per_node}")
        if gpu and c.constraint:
            opts.append(f"--constraint={c.constraint}")
        if gpu and c.exclusive:
            opts.append("--exclusive")
        opts += list(c.sbatch_args)
        if i:
            directives.append("#SBATCH hetjob")
        directives.append(f"# component {i}: {comp.name}")
        directives += [f"#SBATCH {_quote_opt(o)}" for o in opts]
        ranks = comp.ranks
        what = " + ".join(r.name.lower() for r in comp.roles)
        asked = f", {cpus} CPUs/task" if cpus else ""
        table.append(
            f"#   {i} {comp.name:<10} {tasks_text(comp)}{asked}, world ranks {ranks.start}-{ranks.stop - 1}: {what}"
        )
        if len(comp.roles) > 1 and gpu:  # what each of its nodes runs
            first = layout.placement(comp.first_rank).job_node - layout.reward_nodes
            table += [f"#       GPU node {n}: {texts[n]}" for n in range(first, first + comp.nodes)]

    env = dict(c.env)
    if c.network_interface:
        for var in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include", "GLOO_SOCKET_IFNAME"):
            env.setdefault(var, c.network_interface)
        env.setdefault("NCCL_SOCKET_IFNAME", c.network_interface)
    env_lines = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items())]

    srun = ["--mpi=pmix", "--kill-on-bad-exit=1", "--unbuffered"]
    if c.container:
        srun += [f"--container-image={c.container}", f"--container-mounts={workdir}", f"--container-workdir={workdir}"]
    srun += list(c.srun_args)

    values = {
        "experiment": cfg.experiment.name,
        "trial": cfg.experiment.trial,
        "world_size": str(layout.world_size),
        "job_kind": "heterogeneous Slurm job" if len(layout.components) > 1 else "Slurm job",
        "component_table": "\n".join(table),
        "directives": "\n".join(directives),
        "run_dir": shlex.quote(str(run_dir)),
        "env": "\n".join(env_lines) if env_lines else "# (cluster.env: none)",
        "signal_s": str(c.requeue_signal_s),
        "requeue_exit_code": str(EXIT_STOPPED),
        "stop_reason_env": STOP_REASON_ENV,
        "max_requeues": str(c.max_requeues),
        "srun_args": " ".join(shlex.quote(a) for a in srun),
        "srun_components": " \\\n  : ".join(_srun_component(c, layout, i) for i in range(len(layout.components))),
        "command": " ".join(shlex.quote(a) for a in command),
    }
    return fill(TEMPLATE.read_text() if template is None else template, values)


def cpus_per_task(c: ClusterConfig, comp: Component) -> int:
    """CPUs each task of `comp` asks Slurm for (0: none asked). The controller component's tasks:
    `cluster.controller_cpus` each (0: Slurm's default, one). A GPU node's tasks share its `cluster.cpus_per_node`
    (0 until a launcher resolves it). On 8-GPU nodes of 100 CPUs a trainer rank gets 12, an engine 12 at
    gen_tp 1 and 50 at gen_tp 4, a task of the node that also runs the controller and a reward worker 10 (the
    remainder of an uneven share stays unasked)."""
    if comp.cpu_nodes:
        return c.controller_cpus
    return c.cpus_per_node // comp.ntasks_per_node


def node_texts(layout: Layout) -> list[str]:
    """What runs on each GPU node, in node order: 'world ranks 0-4: controller, 1 reward worker(s), generator 0
    on GPU 0, trainers 0-1 on GPUs 1-2'."""
    by_node: dict[int, list[int]] = {}
    for r in range(layout.world_size):
        p = layout.placement(r)
        if p.role in (Role.GENERATOR, Role.TRAINER) or not layout.reward_nodes:
            by_node.setdefault(p.job_node - layout.reward_nodes, []).append(r)
    texts = []
    for node in range(layout.nodes):
        ranks, parts = by_node.get(node, []), []
        for role in Role:
            mine = [r for r in ranks if layout.role_of(r) == role]
            if not mine:
                continue
            if role == Role.CONTROLLER:
                parts.append("controller")
                continue
            if role == Role.REWARD:
                parts.append(f"{len(mine)} reward worker(s)")
                continue
            gpus = sorted(g for r in mine for g in layout.placement(r).gpus)
            label = role.name.lower() + ("s" if len(mine) > 1 else "")
            where = f" on GPU{'s' if len(gpus) > 1 else ''} {span(gpus)}" if gpus else ""
            parts.append(f"{label} {span([r - layout.ranks(role).start for r in mine])}{where}")
        texts.append(f"world ranks {span(ranks)}: {', '.join(parts)}")
    return texts


def require_cpus(c: ClusterConfig, tasks: int = 1) -> None:
    """A script asks for CPUs out of `cluster.cpus_per_node`: it must be resolved (not 0) by then, and give each
    of the `tasks` of a node one."""
    if not c.cpus_per_node:
        raise ConfigError(
            "cluster.cpus_per_node is 0: a launcher reads it from Slurm before the script is rendered "
            "(areal_hpc.launch.slurm.resolve_cpus), or the config sets it"
        )
    if c.cpus_per_node < tasks:
        raise ConfigError(
            f"cluster.cpus_per_node ({c.cpus_per_node}) is fewer than the {tasks} tasks of the busiest GPU node "
            "(its engines and trainer ranks, and with allocation.reward_nodes 0 the controller and the reward "
            "workers): every task needs a CPU"
        )


def _srun_component(c: ClusterConfig, layout: Layout, i: int) -> str:
    """Component i's part of the srun step: its het group (in a heterogeneous job) and its CPUs."""
    parts = [f"--het-group={i}"] if len(layout.components) > 1 else []
    if cpus := cpus_per_task(c, layout.components[i]):
        parts.append(f"--cpus-per-task={cpus}")
    return " ".join([*parts, '"${rank[@]}"'])


def _task_opts(comp: Component) -> list[str]:
    """Tasks per node. The controller component's 1 + R tasks need not divide by its nodes: then at most
    ceil(tasks / nodes) per node, in rank order (block distribution: the controller on the first node)."""
    if comp.ntasks % comp.nodes == 0:
        return [f"--ntasks-per-node={comp.ntasks_per_node}"]
    return [f"--ntasks={comp.ntasks}", f"--ntasks-per-node={comp.ntasks_per_node}"]


def tasks_text(comp: Component) -> str:
    """'2 node(s) x 4 task(s)', or '2 node(s), 9 task(s) in all' when they do not divide."""
    if comp.ntasks % comp.nodes == 0:
        return f"{comp.nodes} node(s) x {comp.ntasks_per_node} task(s)"
    return f"{comp.nodes} node(s), {comp.ntasks} task(s) in all"


def fill(template: str, values: dict[str, str]) -> str:
    """Replace every `{{name}}`; a name without a value (or a value without a name) is an error."""
    names = set(re.findall(r"\{\{(\w+)\}\}", template))
    if names != set(values):
        raise KeyError(f"template names {sorted(names)} do not match the values {sorted(values)}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)


def _quote_opt(opt: str) -> str:
    """`--key=value` with the value quoted for sbatch's shell-like parsing of #SBATCH lines."""
    key, sep, value = opt.partition("=")
    return f"{key}={shlex.quote(value)}" if sep else opt


__all__ = ["TEMPLATE", "cpus_per_task", "render_sbatch", "require_cpus", "tasks_text"]
