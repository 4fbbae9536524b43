"""The sbatch script of a run: one pure function of the config, filled into `areal_hpc/launch/templates/hetjob.sbatch`.

```
 #SBATCH <job-wide options: name, output, time, signal, requeue>
 #SBATCH <component 0: controller + reward workers, CPU nodes>       world ranks 0 .. R
 #SBATCH hetjob
 #SBATCH <component 1: generator nodes, GPUs>                         world ranks R+1 .. R+G
 #SBATCH hetjob
 #SBATCH <component 2: trainer nodes, GPUs>                           world ranks R+G+1 .. end
 srun --mpi=pmix --kill-on-bad-exit=1 ... --het-group=0 [its CPUs] RANK : --het-group=1 RANK : --het-group=2 RANK
                                                        RANK = python -m areal_hpc.main RUN_DIR, wrapped
```

The one `srun` step numbers the tasks of the components consecutively, so SLURM_PROCID, the MPI world
rank and `Layout.role_of` agree. CPUs (`cpus_per_task`): a generator or trainer node's
`cluster.cpus_per_node` are shared by its tasks, the controller component's tasks have
`cluster.controller_cpus` each. They are asked for on the component's #SBATCH lines (a node that is not
exclusive gives a task one CPU otherwise) and again after its `--het-group` in the step: since Slurm
22.05 srun no longer takes `--cpus-per-task` from the allocation, and a component's srun options carry
over to the next components unless they set their own. Nothing here reads the machine: the same config
(its `cpus_per_node` resolved, `areal_hpc.launch.slurm.resolve_cpus`), work directory and python give the same
text (snapshot-tested against tests/snapshots/*.sbatch).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from areal_hpc.config import ClusterConfig, Config, ConfigError
from areal_hpc.exit_codes import EXIT_STOPPED, STOP_REASON_ENV
from areal_hpc.layout import Component, Layout

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
    require_cpus(c)
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
    table = []
    for i, comp in enumerate(layout.components):
        gpu = comp.name != "controller"
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
        if not gpu and c.controller_mem:
            opts.append(f"--mem={c.controller_mem}")
        if comp.gpus_per_node:  # the layout's: every accelerator node's GPUs unless cluster.device is cpu
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
        "component_table": "\n".join(table),
        "directives": "\n".join(directives),
        "run_dir": shlex.quote(str(run_dir)),
        "env": "\n".join(env_lines) if env_lines else "# (cluster.env: none)",
        "signal_s": str(c.requeue_signal_s),
        "requeue_exit_code": str(EXIT_STOPPED),
        "stop_reason_env": STOP_REASON_ENV,
        "max_requeues": str(c.max_requeues),
        "srun_args": " ".join(shlex.quote(a) for a in srun),
        "srun_components": " \\\n  : ".join(
            f'--het-group={i}{_srun_cpus(cpus_per_task(c, comp))} "${{rank[@]}}"'
            for i, comp in enumerate(layout.components)
        ),
        "command": " ".join(shlex.quote(a) for a in command),
    }
    return fill(TEMPLATE.read_text() if template is None else template, values)


def cpus_per_task(c: ClusterConfig, comp: Component) -> int:
    """CPUs each task of `comp` asks Slurm for (0: none asked). The controller component's tasks:
    `cluster.controller_cpus` each (0: Slurm's default, one). A generator or trainer node's tasks share
    its `cluster.cpus_per_node` (0 until a launcher resolves it). On 8-GPU nodes of 100 CPUs a trainer rank
    gets 12, an engine 12 at gen_tp 1 and 50 at gen_tp 4 (the remainder of an uneven share stays unasked)."""
    if comp.name == "controller":
        return c.controller_cpus
    return c.cpus_per_node // comp.ntasks_per_node


def require_cpus(c: ClusterConfig) -> None:
    """A script asks for CPUs out of `cluster.cpus_per_node`: it must be resolved (not 0) by then."""
    if not c.cpus_per_node:
        raise ConfigError(
            "cluster.cpus_per_node is 0: a launcher reads it from Slurm before the script is rendered "
            "(areal_hpc.launch.slurm.resolve_cpus), or the config sets it"
        )


def _srun_cpus(cpus: int) -> str:
    return f" --cpus-per-task={cpus}" if cpus else ""


def _task_opts(comp) -> list[str]:
    """Tasks per node. The controller component's 1 + R tasks need not divide by its nodes: then at most
    ceil(tasks / nodes) per node, in rank order (block distribution: the controller on the first node)."""
    per_node = -(-comp.ntasks // comp.nodes)
    if comp.ntasks % comp.nodes == 0:
        return [f"--ntasks-per-node={per_node}"]
    return [f"--ntasks={comp.ntasks}", f"--ntasks-per-node={per_node}"]


def tasks_text(comp) -> str:
    """'2 node(s) x 4 task(s)', or '2 node(s), 9 task(s) in all' when they do not divide."""
    if comp.ntasks % comp.nodes == 0:
        return f"{comp.nodes} node(s) x {comp.ntasks // comp.nodes} task(s)"
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
