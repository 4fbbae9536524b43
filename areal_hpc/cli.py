"""`areal-hpc`: the command line. Each subcommand parses its arguments, loads the config, and hands
over to the library; a configuration error prints one line and exits with code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from areal_hpc.config import Config, ConfigError, describe_config, load_config
from areal_hpc.launch.errors import LaunchError
from areal_hpc.rundir import RunDirInUse

OVERRIDES_HELP = (
    "Any config field can be overridden as section.field=value (for example rollout.max_staleness=4 "
    "train.total_steps=50); `areal-hpc --config-help` lists every field with its documentation."
)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (configs/tiny-cpu.yaml is the embedded default)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.total_steps=5")


def _add_nodes(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--nodes",
        type=int,
        required=required,
        help="GPU nodes for generation + training (overrides cluster.nodes); the controller and reward workers "
        "run on the first one's CPUs, or on allocation.reward_nodes CPU nodes more (auto: one from 5 GPU nodes on)",
    )


def _add_allow_change(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="FIELD",
        help="on resume, let this training field (e.g. ppo.lr), or every training field of a section (ppo), "
        "change; recorded in RUN_DIR/config_history.jsonl with the step. Repeatable. Operational fields "
        "change without it, identity fields never (`areal-hpc --config-help` gives each field's kind)",
    )


def _config(args) -> Config:
    overrides = list(args.overrides)
    if getattr(args, "nodes", None) is not None:
        overrides.append(f"cluster.nodes={args.nodes}")
    return load_config(args.config, overrides)


def cmd_run(args) -> int:
    from areal_hpc.launch.local import run_local

    return run_local(_config(args), fresh=args.fresh, allow_change=args.allow_change)


def cmd_plan(args) -> int:
    from areal_hpc import planner
    from areal_hpc.layout import Layout

    cfg = _config(args)
    if args.search:
        # Allocation fields given on the command line stay as given; the planner chooses the others.
        fixed = {
            f: getattr(cfg.allocation, f)
            for f in planner.ALLOCATION_FIELDS
            if any(o.replace(" ", "").startswith(f"allocation.{f}=") for o in args.overrides)
        }
        prediction, why = planner.choose(cfg, fixed)
        cfg = planner.with_plan(cfg, prediction.plan)
    else:
        cfg, why = planner.resolve_split(cfg)
        prediction = planner.predict(cfg)
    layout = Layout.from_config(cfg)
    if args.ranks:
        print(layout.rank_table())
        return 0
    print(layout.table(why))
    print()
    print(planner.report(cfg, prediction))
    if not args.search:
        print(planner.search_hint(cfg, prediction))
    return 0


def cmd_submit(args) -> int:
    from areal_hpc.launch import get_launcher

    cfg = _config(args)
    return get_launcher("dry-run" if args.dry_run else "slurm").launch(cfg, allow_change=args.allow_change)


def cmd_render(args) -> int:
    from areal_hpc.launch.record import job_active
    from areal_hpc.launch.slurm import SlurmLauncher, partitions, resolve_cpus
    from areal_hpc.planner import resolve_split
    from areal_hpc.rundir import Holder, lock_run_dir, prepare_run_dir, unlock_run_dir

    cfg, _ = resolve_split(_config(args))  # the run directory's config.yaml records the split
    cfg = resolve_cpus(cfg, partitions())  # and the CPUs of a GPU node
    script = SlurmLauncher().script(cfg)
    holder = Holder.this_process()
    lock_run_dir(cfg.run_dir, holder, job_active)  # not while a run or job uses the directory
    try:
        run_dir = prepare_run_dir(cfg, allow_change=args.allow_change)  # the ranks read RUN_DIR/config.yaml
    finally:
        unlock_run_dir(cfg.run_dir, holder)
    Path(args.output).write_text(script)
    print(f"wrote {args.output} and {run_dir / 'config.yaml'}; submit with: sbatch {args.output}")
    return 0


def cmd_doctor(args) -> int:
    from areal_hpc.launch.doctor import doctor
    from areal_hpc.layout import resolve_reward_nodes

    cfg = _config(args)
    cpu_nodes = resolve_reward_nodes(cfg.allocation.reward_nodes, cfg.cluster.nodes)
    print(
        f"areal-hpc doctor: {args.config} on {cfg.cluster.nodes} GPU node(s)"
        + (f" + {cpu_nodes} CPU" if cpu_nodes else "")
    )
    checks = doctor(cfg, wait_s=args.wait)
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"FAILED: {', '.join(failed)}" if failed else "every check passed (SKIP: does not apply here)")
    return 1 if failed else 0


def cmd_status(args) -> int:
    from areal_hpc.launch.record import status

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"no run directory at {args.run_dir}")
    print(status(Path(args.run_dir)))
    return 0


def cmd_cancel(args) -> int:
    from areal_hpc.launch.slurm import cancel

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"no run directory at {args.run_dir}")
    print(cancel(Path(args.run_dir)))
    return 0


def cmd_eval(args) -> int:
    from areal_hpc.eval.command import run

    if args.steps is not None and args.step is not None:
        raise ConfigError("give --step N (one checkpoint) or --steps A,B,... (several), not both")
    if args.steps is not None and args.output and not args.submit and len(args.steps) > 1:
        raise ConfigError("-o names one report; --steps writes one per step (RUN_DIR/eval/step_N-DATA.json)")
    return run(args)


def cmd_export(args) -> int:
    from areal_hpc.trainer.export import ExportError, export_checkpoint

    try:
        export_checkpoint(args.run_dir, args.step, args.output, args.max_shard_size, args.adapter_only)
    except ExportError as e:
        print(f"areal-hpc export: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal-hpc",
        description="Fully asynchronous RL for large reasoning models: vLLM generators and Megatron trainers "
        "run at the same time, joined by an MPI controller, on one machine or one Slurm job.",
        epilog=OVERRIDES_HELP,
    )
    parser.add_argument("--config-help", action="store_true", help="list every config field with its documentation")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "run",
        help="run the whole system on this machine with mpirun",
        description="Run the whole system on this machine: one mpirun launch with the controller, "
        "reward workers, generators and trainers, each role on its own cores. Writes "
        "the run directory runs/<experiment>/<trial>/ and resumes it if it has a "
        "checkpoint.",
        epilog=OVERRIDES_HELP,
    )
    _add_config_args(p)
    p.add_argument("--fresh", action="store_true", help="start the trial afresh, ignoring its checkpoints")
    _add_allow_change(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "submit",
        help="submit one Slurm job through submitit",
        description="Submit the run as one Slurm job (heterogeneous when its nodes differ: the controller's CPU "
        "nodes, GPU nodes running different task counts) whose single srun step forms one MPI world.",
        epilog=OVERRIDES_HELP,
    )
    _add_config_args(p)
    _add_nodes(p, required=True)
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and submit nothing")
    _add_allow_change(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "render",
        help="write the sbatch script, for running sbatch yourself",
        description="Write the sbatch script of a config, rendered from "
        "areal_hpc/launch/templates/, for users who run sbatch themselves.",
        epilog=OVERRIDES_HELP,
    )
    _add_config_args(p)
    _add_nodes(p, required=True)
    p.add_argument("-o", "--output", required=True, help="file to write the script to")
    _add_allow_change(p)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "doctor",
        help="check a cluster before a long job: Slurm, pmix, partitions, shared run directory, Python on the "
        "nodes, MPI across the components, GPUs, all-reduce",
        description="Check that the cluster can run this config's job, each check PASS or FAIL with the fix (SKIP "
        "where it does not apply): Slurm's version and, for a job of several components, heterogeneous jobs; pmix "
        "in srun --mpi=list; the partitions "
        "exist and hold the nodes and GPUs asked; the preemption grace time; then a short probe job with the run's "
        "own components: the run directory is shared by every node, torch/vllm/megatron.core/mpi4py import on the "
        "nodes at this host's versions, one MPI world across the components, GPUs per node, and an all-reduce "
        "across every generator and trainer rank (NCCL on cuda, gloo on cpu). Exit code 1 on any FAIL.",
        epilog=OVERRIDES_HELP,
    )
    _add_config_args(p)
    _add_nodes(p, required=True)
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for the probe job to start (default 600)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser(
        "status",
        help="state of a run's Slurm job, its last step and metrics",
        description="Show the state of each component of a run's job, the last step and its metrics.",
    )
    p.add_argument("run_dir", help="run directory (runs/<experiment>/<trial>)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "cancel", help="cancel a run's Slurm job", description="Cancel the Slurm job of a run (every component)."
    )
    p.add_argument("run_dir", help="run directory (runs/<experiment>/<trial>)")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser(
        "export",
        help="a Hugging Face model directory from a run's checkpoint",
        description="Write a Hugging Face directory (sharded safetensors and their index, config.json, tokenizer, "
        "generation config) from a trainer checkpoint of a run, written at any TP/PP/DP, on this machine's CPU "
        "from the checkpoint's files alone. transformers and vLLM load it as they load the initial model. A LoRA "
        "run's checkpoint (lora.rank > 0) exports merged, the adapters added to its base model, which must be where "
        "the run found it; with --adapter-only, the adapters alone in PEFT's format.",
    )
    p.add_argument("run_dir", help="run directory (runs/<experiment>/<trial>)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the latest complete one)")
    p.add_argument("-o", "--output", required=True, help="directory to write (must not exist, or be empty)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB (default: 5GB)")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA checkpoint's adapters alone, in PEFT's format (adapter_config.json, adapter_model.safetensors), "
        "which peft.PeftModel.from_pretrained and vLLM's LoRARequest load on the base model",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "plan",
        help="the split of nodes and GPUs between roles, and the predicted steps per hour",
        description="Show how the nodes and GPUs are split between the controller, generators and trainers, and "
        "why, and predict steps per hour and effective tokens/s, synchronous (max_staleness 0) and asynchronous "
        "(the config's rollout.max_staleness), from the cost model in docs/planner.md (GPU speed and memory: "
        "cluster.gpu_tflops, gpu_memory_bandwidth_gbs, gpu_memory_gb, interconnect_gbps). By default the "
        "config's allocation is the plan, and the planner says what --search would choose instead.",
        epilog=OVERRIDES_HELP,
    )
    _add_config_args(p)
    _add_nodes(p, required=False)
    p.add_argument(
        "--search",
        action="store_true",
        help="choose allocation.gen_gpus, gen_tp, train_tp, train_pp and train_ep (MoE) for the highest predicted asynchronous "
        "throughput that fits GPU memory, instead of taking them from the config; any of them given as a "
        "key=value override on the command line (e.g. allocation.train_pp=1) stays fixed",
    )
    p.add_argument(
        "--ranks",
        action="store_true",
        help="instead, one row per world rank: rank, role, component, node (within its component) and gpus "
        "(indices into the GPUs Slurm shows the node's tasks, comma-separated; - for none)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "eval",
        help="pass@1 and pass@k of a model or a run's checkpoint on held-out prompts",
        description="Evaluate a Hugging Face model directory, or a run directory's checkpoint (step 0: its "
        "initial model), on held-out prompts: K episodes per prompt of the run's workflow (rollout.workflow, its "
        "tools and limits) on the generator's vLLM engine (allocation.gen_tp, rollout.temperature), scored as "
        "training scores them (the workflow's own reward, else reward.kind on the final answer); pass@1 averaged "
        "over the K episodes, unbiased pass@k for k = 1, 2, 4, ... K, episode lengths, turns and tool calls. "
        "Prints a table and writes a JSON report. A run directory uses its own config.yaml.",
        epilog=OVERRIDES_HELP,
    )
    p.add_argument("target", metavar="MODEL_DIR|RUN_DIR", help="Hugging Face model directory or run directory")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rollout.temperature=0.6")
    p.add_argument(
        "--step", type=int, help="the run's checkpoint to evaluate (default: the latest; 0: the initial model)"
    )
    p.add_argument(
        "--steps",
        type=lambda s: [int(x) for x in s.split(",")],
        help="checkpoints to evaluate (e.g. 0,100,200): here one after the other on one engine, its weights "
        "loaded for each; with --submit one Slurm array task each",
    )
    p.add_argument("--data", help="held-out prompts, the formats of data.train_path (default: eval.data)")
    p.add_argument("--samples", type=int, help="trajectories per prompt, K (default: eval.samples)")
    p.add_argument("--config", help="config for a model directory (default: the built-in defaults)")
    p.add_argument("-o", "--output", help="JSON report (default: RUN_DIR/eval/step_N-DATA.json, or here)")
    p.add_argument("--submit", action="store_true", help="run as a Slurm job array, one task per step of --steps")
    p.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may also follow the options (`submit CONFIG --nodes 4 key=value`), where argparse
    # has already closed the positional list.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.config_help:
        print(describe_config())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"areal-hpc: config error: {e}", file=sys.stderr)
        return 2
    except (LaunchError, RunDirInUse) as e:
        print(f"areal-hpc: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
