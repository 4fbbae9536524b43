"""`python -m areal_hpc.main RUN_DIR [--placement]`: what every MPI rank runs, on this machine or on Slurm.

```
 every rank:  config.yaml -> cluster.network_interface exists on this node? (before MPI starts)
              -> Layout -> role, log file logs/<role>-<i>.log, its GPUs, signals, cores
              first log line: role, host, GPUs; then its CPUs and OMP_NUM_THREADS (`log_cpus`);
              the areal_hpc it runs (`installation`: a stale install on a node shows here);
              the device, resolved once (areal_hpc.device)
              (--placement: exit barrier here)
              role communicator (collective)
              model dir + latest complete checkpoint (world rank 0 finds or builds them, bcast)
              RankContext -> setup_weight_sync (collective) -> the role's serve (engine, then
                             the weight-sync groups joined and checked, then the loop)
              exit barrier (bounded), exit code
```

A node without `cluster.network_interface` stops its ranks before MPI starts (MPI, gloo and NCCL
are told to use it: their own errors would come first and say less), with one line naming the
interface and the node's interfaces. A rank that fails prints one line naming itself to the
launcher's console, its traceback to its log, and ends the whole run with MPI Abort: nothing hangs,
nothing stays running. A rank that dies outright is mpirun's (srun's) to notice; one that hangs is
the controller's (areal_hpc.controller.liveness).

GPUs: before torch or vLLM is imported, each rank narrows CUDA_VISIBLE_DEVICES to the GPUs the
layout places it on (`Layout.placement`), as entries of the list it was started with: on Slurm the
node's `--gpus-per-node` GPUs, which every task of the node sees (measured; indices or UUIDs); from the
local launcher this machine's GPUs, every node of the layout being this machine
(`Layout.machine_gpus`; with fewer GPUs than that, ranks share them). Under Slurm a rank first checks
that Slurm started it where the layout says (node and task slot), so that no two ranks of a node take
the same GPU. A rank without GPUs sees none.

Signals: only the controller acts on SIGUSR2, SIGTERM and SIGINT (checkpoint, then Stop to everyone,
exit code EXIT_STOPPED of areal_hpc.exit_codes); the other ranks ignore all three and wait for the
controller's Stop. Slurm sends a preemption's SIGTERM to every task at once: a rank that died of it
would end the step before the controller could checkpoint.

mpi4py is imported inside functions only: a generator rank's vLLM must not see MPI initialised at
import time, and a vLLM worker it spawns (gen_tp > 1) imports this module again, as `__mp_main__`, with
the rank's OMPI_* environment, where MPI would start a second time as the same rank (orte_init fails and
the engine never starts).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import NamedTuple, NoReturn

from areal_hpc.checkpoint.files import latest_checkpoint
from areal_hpc.config import ConfigError, load_config
from areal_hpc.device import resolve_device, visible_gpus
from areal_hpc.errors import RankFailure
from areal_hpc.layout import Cores, Layout, Role
from areal_hpc.network import check_interface
from areal_hpc.protocol import arrive
from areal_hpc.rundir import log_path

EXIT_BARRIER_S = 60.0
"""How long a rank that finished waits for the others before leaving anyway."""
PLACEMENT_FLAG = "--placement"
"""Start as usual up to the device (GPUs narrowed, the first log lines, the device resolved), then
leave: where every rank runs, checked in seconds (tests/test_slurm_placement.py)."""
PIN_ENV = "AREAL_PIN_CORES"
"""Set to 1 by the local launcher, which starts every rank on this machine: pin generator and trainer
ranks to disjoint cores of it (on Slurm the scheduler binds ranks), and share its GPUs between them."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or args[1:] not in ([], [PLACEMENT_FLAG]):
        print(f"usage: python -m areal_hpc.main RUN_DIR [{PLACEMENT_FLAG}]", file=sys.stderr)
        return 2
    placement_only = args[1:] == [PLACEMENT_FLAG]
    run_dir = Path(args[0]).resolve()
    cfg = load_config(run_dir / "config.yaml")
    try:
        check_interface(cfg.cluster.network_interface)
    except ConfigError as e:
        print(f"areal-hpc: {e}", file=sys.stderr, flush=True)
        return 1
    layout = Layout.from_config(cfg)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    role = layout.role_of(rank)
    name = layout.describe_rank(rank)
    log_file = log_path(run_dir, role.name.lower(), rank - layout.ranks(role).start)
    console = _redirect_output(log_file)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role.name.lower()} %(levelname)s %(message)s")
    code = 0
    try:
        narrow_gpus(layout, rank)  # before torch or vLLM is imported; logs the first line
    except BaseException as e:  # noqa: BLE001 - the launcher's console names the rank and the fix
        _fail(world, name, e, console, log_file)
    _signals(role)
    pinned = os.environ.get(PIN_ENV) == "1" and _pin(layout.core_plan(sorted(os.sched_getaffinity(0))).get(rank))
    group = [c.name for c in layout.components].index(layout.placement(rank).component)
    log_cpus(name, role, group, pinned)
    logging.info("%s runs %s", name, installation())

    try:
        device = resolve_device(cfg.cluster.device, gpus=bool(layout.placement(rank).gpus))
        logging.info("%s device %s (cluster.device %s)", name, device, cfg.cluster.device)
        if role == Role.TRAINER and device == "cuda":  # before anything allocates on the GPU
            from areal_hpc.trainer.cuda_allocator import expandable_segments

            logging.info("%s %s", name, expandable_segments())
        if placement_only:
            _exit_barrier(world, rank, name, console)
            return 0
        arrive(world)  # each collective of the start-up: asleep while the slowest rank starts
        role_comm = layout.split(world)
        found = None
        if rank == 0:
            from areal_hpc.data.initial_model import check_teacher, initial_model

            model = initial_model(cfg)
            check_teacher(cfg, model)
            found = (str(model), latest_checkpoint(run_dir))
        arrive(world)
        model_path, resume_from = world.bcast(found, root=0)
        from areal_hpc.rank_context import RankContext

        ctx = RankContext(cfg, layout, world, role_comm, run_dir, Path(model_path), resume_from, device)
        from areal_hpc.weight_sync.broadcast import setup_weight_sync

        sync = setup_weight_sync(ctx)
        code = _serve(ctx, sync) or 0
    except BaseException as e:  # noqa: BLE001 - every failure ends the whole run, loudly
        _fail(world, name, e, console, log_file)
    _exit_barrier(world, rank, name, console)
    logging.info("%s exits with code %d", name, code)
    return code


def _serve(ctx, sync) -> int | None:
    role = ctx.role
    if role == Role.CONTROLLER:
        from areal_hpc.controller import serve

        return serve(ctx)
    if role == Role.REWARD:
        from areal_hpc.reward.worker import serve

        return serve(ctx)
    if role == Role.GENERATOR:
        from areal_hpc.generator.worker import serve

        return serve(ctx, sync)
    from areal_hpc.trainer.worker import serve

    return serve(ctx, sync)


# --- GPUs --------------------------------------------------------------------------------------


class SlurmTask(NamedTuple):
    node_name: str  # SLURMD_NODENAME
    node_id: int  # SLURM_NODEID: the node's index among the nodes of the job's one step
    local_id: int  # SLURM_LOCALID: the task's index on its node


def slurm_task() -> SlurmTask | None:
    """Where Slurm started this task (submitit's JobEnvironment reads it); None when the local
    launcher started it."""
    if os.environ.get(PIN_ENV) == "1" or "SLURM_LOCALID" not in os.environ:
        return None
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = SlurmJobEnvironment()
    return SlurmTask(os.environ.get("SLURMD_NODENAME", env.hostname), env.node, env.local_rank)


def narrow_gpus(layout: Layout, rank: int) -> None:
    """Set CUDA_VISIBLE_DEVICES to this rank's GPUs (`own_gpus`) and log where the rank runs: its
    role, host and GPUs (the first line of its log)."""
    task = slurm_task()
    given = visible_gpus()
    gpus = own_gpus(layout, rank, given, task)
    if given:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # empty: a rank without GPUs sees none
    place = layout.placement(rank)
    logging.info(
        "%s on host %s%s: node %d (%s), task %d, GPUs %s of %s (pid %d)",
        layout.describe_rank(rank),
        socket.gethostname(),
        f", Slurm node {task.node_name}" if task else "",
        place.job_node,
        place.component,
        place.slot,
        ",".join(gpus) or "none",
        ",".join(given) or "none",
        os.getpid(),
    )


def own_gpus(layout: Layout, rank: int, given: list[str], task: SlurmTask | None) -> list[str]:
    """The entries of `given` (the GPUs this task was started with) that are this rank's.

    Slurm (`task`): the layout's node-local indices into the node's GPUs, after checking that Slurm
    put the task where the layout says. Local launcher (`task` None): `Layout.machine_gpus` into this
    machine's GPUs; with fewer of them, rank GPU i takes GPU i mod their number (shared).
    """
    place = layout.placement(rank)
    if task is None:
        return [given[i % len(given)] for i in layout.machine_gpus(rank)] if given else []
    if (task.node_id, task.local_id) != (place.job_node, place.slot):
        raise RuntimeError(
            f"Slurm started {layout.describe_rank(rank)} as task {task.local_id} of the job's node "
            f"{task.node_id} ({task.node_name}); the layout places it as task {place.slot} of node {place.job_node} "
            f"({place.component} node {place.node}), srun's default block distribution: remove --distribution "
            "(-m) from cluster.srun_args"
        )
    if not place.gpus or not given:
        return []
    if len(given) != layout.gpus_per_node:
        raise RuntimeError(
            f"{layout.describe_rank(rank)}: Slurm shows this task {len(given)} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={','.join(given)}), but the layout shares cluster.gpus_per_node "
            f"({layout.gpus_per_node}) GPUs of each node between the node's tasks, so every task must see all "
            "of them: leave --gpus-per-task and --gpu-bind out of cluster.sbatch_args and cluster.srun_args"
        )
    return [given[i] for i in place.gpus]


# --- cores -------------------------------------------------------------------------------------


def _pin(place: Cores | None) -> bool:
    """Run on `place`'s cores with its threads (the local launcher's generator and trainer ranks); whether
    there was a place."""
    if place is None:
        return False
    os.sched_setaffinity(0, place.cores)
    # Before torch or vLLM is imported: the rank's compute threads (the generator engine follows them).
    os.environ["OMP_NUM_THREADS"] = str(place.threads)
    return True


def log_cpus(name: str, role: Role, group: int, pinned: bool) -> None:
    """Log in one line the CPUs Slurm gave this task (its share of the node, areal_hpc.launch.sbatch.cpus_per_task)
    and the ones it may run on (its affinity), and set OMP_NUM_THREADS before torch is imported.

    The CPUs Slurm gave: SLURM_CPUS_PER_TASK_HET_GROUP_<group> in a heterogeneous job (`group`: the
    rank's component), which the script asks for again on the step; SLURM_CPUS_PER_TASK otherwise. In
    a heterogeneous step SLURM_CPUS_PER_TASK is the last component's that sets one, in the tasks of
    component 0 too (Slurm 22.05, measured on the local cluster), while the step gives them their own.

    OMP_NUM_THREADS, when neither the local launcher's pinning (`pinned`) nor the environment
    (cluster.env, the submitting shell) set it: a Slurm task other than a generator gets the CPUs it
    may run on, at most the ones Slurm gave it (a node that binds no task lets every task run on
    all of them), since torch's default is the whole host's cores. A generator leaves it to vLLM, which
    sizes its workers' threads from the same affinity (and cgroup quota) when the variable is unset,
    shares them among its TP workers at gen_tp > 1 and serves with one thread on GPU; set, it would give each
    worker all of them (vllm/v1/executor/multiproc_executor.py, set_multiprocessing_worker_envs)."""
    variable = f"SLURM_CPUS_PER_TASK_HET_GROUP_{group}" if "SLURM_HET_SIZE" in os.environ else "SLURM_CPUS_PER_TASK"
    given = os.environ.get(variable)
    cores = sorted(os.sched_getaffinity(0))
    threads = os.environ.get("OMP_NUM_THREADS")
    if pinned:
        why = "its share of this machine's cores"
    elif threads:
        why = "from the environment"
    elif slurm_task() is None:
        why = "the libraries' default"
    elif role == Role.GENERATOR:
        why = "vLLM sizes its workers' threads"
    else:
        threads = str(min(len(cores), int(given)) if given else len(cores))
        os.environ["OMP_NUM_THREADS"] = threads
        why = "the CPUs it may run on" + (", at most Slurm's" if given else "")
    logging.info(
        "%s CPUs: %s %s, may run on %d (%s), OMP_NUM_THREADS %s (%s)",
        name, variable, given or "unset", len(cores), _spans(cores), threads or "unset", why,
    )  # fmt: skip


def installation() -> str:
    """Where this process imported areal_hpc from, and its interpreter: 'areal_hpc from DIR, python PATH'."""
    import areal_hpc

    return f"areal_hpc from {Path(areal_hpc.__file__).parent}, python {sys.executable}"


def _spans(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for c in cores:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


# --- output, signals, failure, exit ------------------------------------------------------------


def _redirect_output(path: Path):
    """Send this process's stdout and stderr (vLLM's and Megatron's chatter included) to its log; return
    a file on the original stderr for the few lines the launcher's console should show."""
    path.parent.mkdir(parents=True, exist_ok=True)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    return console


def _signals(role: Role) -> None:
    if role == Role.CONTROLLER:
        from areal_hpc.controller import install_stop_signals

        install_stop_signals()
    else:
        # Ignored, not handled: processes it starts (reward scorers, sandboxes) inherit the ignore
        # across exec, so Slurm's SIGTERM to every process of the step leaves them be too; they are
        # ended with SIGKILL.
        for sig in (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _fail(world, name: str, error: BaseException, console, log_file: Path) -> None:
    """Log, tell the console in one line, end every rank of the run."""
    traceback.print_exc()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, RankFailure):  # the controller names the rank at fault
        message = f"areal-hpc: {error}"
    else:
        message = f"areal-hpc: {name} failed: {type(error).__name__}: {first} (traceback in {log_file})"
    print(message, file=sys.stderr, flush=True)
    try:
        print(message, file=console, flush=True)
    except OSError:
        pass
    world.Abort(1)


def _exit_barrier(world, rank: int, name: str, console) -> None:
    """Leave together: MPI_Finalize would wait for ranks that are still busy, and mpirun ends the
    job as soon as one rank exits with an error. The controller ends the run if a rank never comes."""
    if not arrive(world, EXIT_BARRIER_S):
        message = f"areal-hpc: {name}: not every rank stopped within {EXIT_BARRIER_S:.0f} s of the end"
        print(message, file=sys.stderr, flush=True)
        if rank == 0:
            print(message, file=console, flush=True)
            world.Abort(1)


def _leave(code: int) -> NoReturn:
    """End the rank's process without the interpreter's teardown of torch, vLLM and Megatron, which took
    4 to 5 s of every run here: by the time `main` returns every role has closed what it writes (metrics,
    TensorBoard, W&B, checkpoints) and ended what it started (the vLLM engine and its workers, the scorer
    processes), and the launchers start ranks with `python -u`, so no output waits in a buffer. What of the
    teardown matters is done here: multiprocessing's children (Megatron's checkpoint writer queue, idle once
    its saves are complete) killed, the logs flushed, MPI finalised; atexit hooks and finalisers are not run."""
    children = multiprocessing.active_children()
    for child in children:
        child.kill()  # SIGTERM may be blocked in the child, as the rank's threads block it
    for child in children:
        child.join(timeout=5)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:  # not before a usage or config error
        from mpi4py import MPI

        if not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
