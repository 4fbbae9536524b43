"""The sbatch script of a run: one pure function of the config, filled into `slurm_templates/hetjob.sbatch`.

```
 #SBATCH <job-wide options: name, output, time, signal, requeue>
 #SBATCH <component 0: controller + reward workers, 1 CPU node>       world ranks 0 .. R
 #SBATCH hetjob
 #SBATCH <component 1: generator nodes, GPUs>                         world ranks R+1 .. R+G
 #SBATCH hetjob
 #SBATCH <component 2: trainer nodes, GPUs>                           world ranks R+G+1 .. end
 srun --het-group=0,1,2 --mpi=pmix --kill-on-bad-exit=1 ... python -m areal_hpc.main RUN_DIR
```

`srun --het-group=0,1,2` numbers the tasks of the three components consecutively, so SLURM_PROCID,
the MPI world rank and `Layout.role_of` agree. Nothing here reads the machine: the same config, work
directory and python give the same text (snapshot-tested against tests/snapshots/*.sbatch).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.layout import Layout

TEMPLATE = Path(__file__).resolve().parent.parent / "slurm_templates" / "hetjob.sbatch"

REQUEUE_EXIT_CODE = 75
"""Exit code of the controller after it saved a checkpoint on SIGUSR2/SIGTERM: "requeue me" (EX_TEMPFAIL)."""


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
    template: template text (default: slurm_templates/hetjob.sbatch).
    """
    layout = Layout.from_config(cfg)
    c = cfg.cluster
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
        opts += [f"--nodes={comp.nodes}", f"--ntasks-per-node={comp.ntasks // comp.nodes}"]
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
        table.append(
            f"#   {i} {comp.name:<10} {comp.nodes} node(s) x {comp.ntasks // comp.nodes} task(s), "
            f"world ranks {ranks.start}-{ranks.stop - 1}: {what}"
        )

    env = dict(c.env)
    if c.network_interface:
        for var in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include", "GLOO_SOCKET_IFNAME"):
            env.setdefault(var, c.network_interface)
        env.setdefault("NCCL_SOCKET_IFNAME", c.network_interface)
    env_lines = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items())]

    srun = ["--het-group=0,1,2", "--mpi=pmix", "--kill-on-bad-exit=1", "--unbuffered"]
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
        "requeue_exit_code": str(REQUEUE_EXIT_CODE),
        "max_requeues": str(c.max_requeues),
        "srun_args": " ".join(shlex.quote(a) for a in srun),
        "command": " ".join(shlex.quote(a) for a in command),
    }
    return fill(TEMPLATE.read_text() if template is None else template, values)


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


__all__ = ["REQUEUE_EXIT_CODE", "TEMPLATE", "render_sbatch"]
