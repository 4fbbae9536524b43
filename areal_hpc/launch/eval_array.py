"""`areal-hpc eval RUN_DIR --steps 100,200,300 --submit`: one Slurm job array, one task per checkpoint.

```
 #SBATCH --array=0-(n-1)   one node, allocation.gen_tp GPUs and the run's engine's CPUs, the cluster
                           section's partition, account, ...
 steps=(100 200 300); step=${steps[$SLURM_ARRAY_TASK_ID]}
 [srun --container-image=...] python -m areal_hpc.cli eval RUN_DIR --data FILE --samples K [key=value ...] --step $step
```

Each task writes its own report (RUN_DIR/eval/step_N-DATA.json, as `areal-hpc eval` does) and its log to
RUN_DIR/eval/slurm/. The script is one pure function of the config and the arguments (`render_eval_array`),
submitted by the same submitit executor as the run (`areal_hpc.launch.slurm.HetSlurmExecutor`, which submits a
given script text: only its job-state watcher is specific to heterogeneous jobs, and it is not used here).
A task's CPUs are a run's engine's (`areal_hpc.launch.sbatch.cpus_per_task` of the layout's generator nodes:
cluster.cpus_per_node * gen_tp / gpus_per_node), cpus_per_node read from Slurm when 0 as `submit`
reads it (`areal_hpc.launch.slurm.resolve_cpus`); asked for on the allocation and again on the container's srun step, which does not inherit them.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from areal_hpc.config import Config, ConfigError, load_config
from areal_hpc.launch.sbatch import _quote_opt, fill, require_cpus

TEMPLATE = Path(__file__).resolve().parent / "templates" / "eval_array.sbatch"


def render_eval_array(cfg: Config, run_dir: Path, steps: list[int], eval_args: list[str], python: str) -> str:
    """The array script: `eval_args` are the `areal-hpc eval` arguments every task shares (the run
    directory first), `--step` is each task's own. `cfg`'s cluster.cpus_per_node is resolved."""
    c = cfg.cluster
    require_cpus(c)
    cpus = (
        f"--cpus-per-task={c.cpus_per_node * cfg.allocation.gen_tp // c.gpus_per_node}"  # an engine's share of a node
    )
    logs = run_dir / "eval" / "slurm"
    opts = [
        f"--job-name=areal-eval-{cfg.experiment.name}-{cfg.experiment.trial}",
        f"--chdir={Path.cwd()}",
        f"--output={logs}/%A_%a.out",
        f"--error={logs}/%A_%a.out",
        f"--array=0-{len(steps) - 1}",
        f"--time={c.time}",
        "--nodes=1",
        "--ntasks=1",
        cpus,
    ]
    if c.partition:
        opts.append(f"--partition={c.partition}")
    for key in ("account", "qos", "constraint"):
        if getattr(c, key):
            opts.append(f"--{key}={getattr(c, key)}")
    if c.device != "cpu":  # as the run's job: auto asks for GPUs (areal_hpc.device decides on the node)
        opts.append(f"--gpus-per-node={cfg.allocation.gen_tp}")
    opts += list(c.sbatch_args)
    env = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(c.env.items())]
    command = [python, "-u", "-m", "areal_hpc.cli", "eval", *eval_args]
    if c.container:  # in the run's image, as its ranks are (areal_hpc/launch/sbatch.py), the working tree mounted
        workdir = Path.cwd()
        image = [f"--container-image={c.container}", f"--container-mounts={workdir}", f"--container-workdir={workdir}"]
        command = ["srun", "--ntasks=1", cpus, *image, *c.srun_args, *command]
    values = {
        "target": str(run_dir),
        "steps": ",".join(map(str, steps)),
        "steps_list": " ".join(map(str, steps)),
        "directives": "\n".join(f"#SBATCH {_quote_opt(o)}" for o in opts),
        "env": "\n".join(env) if env else "# (cluster.env: none)",
        "command": " ".join(shlex.quote(a) for a in command),
    }
    return fill(TEMPLATE.read_text(), values)


def eval_array_script(args) -> tuple[Path, str]:
    """(run directory, script) of `areal-hpc eval ... --submit`."""
    from areal_hpc.launch.slurm import partitions, resolve_cpus

    run_dir = Path(args.target).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--submit evaluates checkpoints of a run directory; {args.target} has no config.yaml")
    if not args.steps:
        raise ConfigError("--submit needs --steps, the checkpoints to evaluate (e.g. --steps 100,200,300)")
    if args.step is not None or args.output or args.config:
        raise ConfigError(
            "with --submit, name the checkpoints with --steps; each array task writes its own report "
            "(no --step, -o or --config: the run's config.yaml is used)"
        )
    cfg = resolve_cpus(load_config(run_dir / "config.yaml", list(args.overrides)), partitions())
    shared = [str(run_dir)]
    if args.data:
        shared += ["--data", str(Path(args.data).resolve())]
    if args.samples is not None:
        shared += ["--samples", str(args.samples)]
    shared += list(args.overrides)
    python = "python" if cfg.cluster.container else sys.executable
    return run_dir, render_eval_array(cfg, run_dir, args.steps, shared, python)


def submit_eval_array(args) -> int:
    """Submit the array; print its job id and where the reports go."""
    from areal_hpc.launch.slurm import HetSlurmExecutor

    run_dir, script = eval_array_script(args)
    (run_dir / "eval" / "slurm").mkdir(parents=True, exist_ok=True)
    job = HetSlurmExecutor(run_dir / "eval" / "slurm", script).submit_script()
    print(f"submitted job array {job.job_id}: steps {','.join(map(str, args.steps))}")
    print(f"  reports: {run_dir / 'eval'}/step_N-*.json; logs: {run_dir / 'eval' / 'slurm'}")
    return 0
