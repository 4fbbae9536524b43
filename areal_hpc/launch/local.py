"""`areal-hpc run`: the whole system on this machine, one mpirun MPMD launch.

```
 run_local:  rollout.workflow imported (a bad one stops here) -> run directory (resume unless --fresh)
             -> model built once (tiny + warm start, cached)
             mpirun (own session) -- controller : reward x R : generator x G : trainer x T
               every rank: python -m areal_hpc.main RUN_DIR (pins generator/trainer ranks to cores)
             while it runs: a progress line per metrics.jsonl row; mpirun's own lines, the dead
             rank named by its role
             Ctrl-C:  STOP file + SIGUSR2 -> the controller checkpoints, stops every rank, exits
                      EXIT_STOPPED (75); a second Ctrl-C ends the job at once
             after:   nothing left running (every process carrying this launch's token is ended)
```

Exit codes: 0 the run finished; 130 stopped by Ctrl-C after a checkpoint (run the same command again
to resume); 75 (areal_hpc.exit_codes.EXIT_STOPPED) stopped by a signal to the controller after a
checkpoint; 1 a rank failed (the message names it).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from areal_hpc import planner
from areal_hpc.checkpoint.controller import read_summary
from areal_hpc.checkpoint.files import latest_checkpoint
from areal_hpc.config import Config
from areal_hpc.device import visible_gpus
from areal_hpc.exit_codes import EXIT_STOPPED
from areal_hpc.jsonl import read_jsonl
from areal_hpc.launch.record import job_active
from areal_hpc.layout import Layout, Role
from areal_hpc.metrics import progress_line
from areal_hpc.network import check_interface
from areal_hpc.rundir import STOP_FILE, Holder, lock_run_dir, prepare_run_dir, unlock_run_dir
from areal_hpc.wandb_log import check_wandb
from areal_hpc.workflow import load_workflow

TOKEN_ENV = "AREAL_RUN_TOKEN"
"""Every process of one launch carries this variable (value unique to the launch): how the launcher
finds what is left after mpirun exits, without touching anything it did not start."""


def mpirun_command(layout: Layout, run_dir: Path, python: str = sys.executable) -> list[str]:
    """One MPMD launch: an app context per role, in world-rank order (the layout's)."""
    base = ["mpirun", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        base.append("--allow-run-as-root")
    cmd = base
    for i, role in enumerate(Role):
        n = len(layout.ranks(role))
        if n == 0:
            continue
        if i:
            cmd.append(":")
        cmd += [
            "-n",
            str(n),
            python,
            "-u",
            "-m",
            "areal_hpc.main",
            str(run_dir),
        ]
    return cmd


def run_local(cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> int:
    """The run, holding the run directory's lock while it lasts (a second run on it is refused).
    Every rank runs on this machine: a cluster.network_interface it lacks is refused before any starts, and
    so is a `logging.wandb` the controller could not open, and a `rollout.workflow` that cannot be imported
    or is not a Workflow (every generator would fail on it). `fresh` and `allow_change`:
    `rundir.prepare_run_dir`'s."""
    check_interface(cfg.cluster.network_interface)
    check_wandb(cfg.logging)
    load_workflow(cfg.rollout.workflow)
    holder = Holder.this_process()
    lock_run_dir(cfg.run_dir, holder, job_active)
    try:
        return _run(cfg, fresh, allow_change)
    finally:
        unlock_run_dir(cfg.run_dir, holder)


def _run(cfg: Config, fresh: bool, allow_change: Sequence[str]) -> int:
    from areal_hpc.data.initial_model import check_teacher, initial_model

    cfg, why = planner.resolve_split(cfg)  # the run directory's config.yaml records the split
    layout = Layout.from_config(cfg)
    on_cpu = cfg.cluster.device == "cpu" or (cfg.cluster.device == "auto" and not visible_gpus())
    # before the run directory changes: a config that cannot fit is refused with the settings to change
    fits = planner.check_host_fits(cfg) if on_cpu else planner.check_fits(cfg)
    if not on_cpu:
        planner.check_timeouts(cfg)
    run_dir = prepare_run_dir(cfg, fresh=fresh, allow_change=allow_change).resolve()
    print(layout.table(why))
    if fits:
        print(fits)
    print(f"run directory: {run_dir}")
    resume = latest_checkpoint(run_dir)
    if resume is None:
        print("starting afresh")
    else:
        written = read_summary(resume)["layout"]
        print(f"resuming from {resume}" + ("" if written == layout.summary() else f", written on {written}"))
    t0 = time.monotonic()
    model = initial_model(cfg)
    check_teacher(cfg, model)
    print(f"initial model: {model} ({time.monotonic() - t0:.1f} s)", flush=True)

    token = uuid.uuid4().hex
    env = {
        **os.environ,
        "OMPI_MCA_btl": os.environ.get("OMPI_MCA_btl", "self,tcp"),
        "OMPI_MCA_mpi_yield_when_idle": "1",  # ranks outnumber cores: waiting ranks give theirs up
        "AREAL_PIN_CORES": "1",
        "PYTHONUNBUFFERED": "1",
        TOKEN_ENV: token,
    }
    cmd = mpirun_command(layout, run_dir)
    # Its own session: a Ctrl-C in the terminal reaches only this launcher, which asks for a clean stop.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    interrupts = []

    def on_signal(signum, frame):
        interrupts.append(signum)
        if len(interrupts) == 1:
            print(
                "\nareal-hpc: stopping: the controller saves a checkpoint, then every rank stops "
                "(Ctrl-C again to end at once)",
                flush=True,
            )
            (run_dir / STOP_FILE).touch()
            _signal(proc, signal.SIGUSR2)
        else:
            _signal(proc, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics = _Tail(run_dir / "metrics.jsonl")
    dead_rank, held = None, []

    def show(line: str) -> None:
        nonlocal dead_rank
        if interrupts:  # after a stop request mpirun reports the controller's EXIT_STOPPED as an error:
            held.append(line)  # keep its lines unless the stop turns out not to be clean
            return
        dead_rank = _dead_rank(line, dead_rank)
        print(_annotate(line, layout), end="", flush=True)

    try:
        while True:
            code = proc.poll()
            for row in metrics.rows():
                if row["step"] % max(1, cfg.logging.progress_every) == 0 or row["step"] == cfg.train.total_steps:
                    print(progress_line(row, cfg.train.total_steps), flush=True)
            while not lines.empty():
                line = lines.get()
                if line is not None:
                    show(line)
            if code is not None:
                break
            time.sleep(0.2)
        while not lines.empty():
            line = lines.get()
            if line is not None:
                show(line)
        if code != EXIT_STOPPED:
            for line in held:
                dead_rank = _dead_rank(line, dead_rank)
                print(_annotate(line, layout), end="", flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        left = _end_leftovers(token)
        if left:
            print(f"areal-hpc: ended {left} process(es) left over from the run", flush=True)
        (run_dir / STOP_FILE).unlink(missing_ok=True)
    return _summary(code, interrupts, dead_rank, layout, run_dir, cfg)


def _summary(code: int, interrupts: list, dead_rank, layout: Layout, run_dir: Path, cfg: Config) -> int:
    ckpt = latest_checkpoint(run_dir)
    if code == 0:
        print(f"areal-hpc: done, {cfg.train.total_steps} steps; checkpoint {ckpt}; metrics {run_dir / 'metrics.jsonl'}")
        return 0
    if code == EXIT_STOPPED:
        print(f"areal-hpc: stopped after a checkpoint ({ckpt}); run the same command again to resume")
        return 130 if interrupts else EXIT_STOPPED
    who = f"{layout.describe_rank(dead_rank)} ended first; " if dead_rank is not None else ""
    logs = run_dir / "logs"
    print(f"areal-hpc: the run failed (mpirun exit code {code}); {who}logs in {logs}", file=sys.stderr)
    return 1


# --- helpers -----------------------------------------------------------------------------------


def _pump(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


_RANK_PATTERNS = (
    re.compile(r"process rank (\d+) with PID"),  # "mpirun noticed that process rank 3 with PID ... exited on signal 9"
    re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]"),  # "...exited with non-zero status ... Process name: [[x,1],3]"
)


def _dead_rank(line: str, known):
    if known is not None:
        return known
    for pattern in _RANK_PATTERNS:
        m = pattern.search(line)
        if m:
            return int(m.group(1))
    return None


def _annotate(line: str, layout: Layout) -> str:
    """mpirun names ranks by number; add the role (`generator 0 (world rank 2)`)."""
    for pattern in _RANK_PATTERNS:
        m = pattern.search(line)
        if m and int(m.group(1)) < layout.world_size:
            return line.rstrip("\n") + f"   <- {layout.describe_rank(int(m.group(1)))}\n"
    return line


class _Tail:
    """New complete lines of a JSONL file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        for _, end, row in read_jsonl(self.path, torn_ok=True, start=self.offset):
            rows.append(row)
            self.offset = end
        return rows


def _end_leftovers(token: str) -> int:
    """SIGKILL every process that carries this launch's token (vLLM helpers, a rank mpirun missed)."""
    mine = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if f"{TOKEN_ENV}={token}".encode() in (d / "environ").read_bytes().split(b"\0"):
                mine.append(int(d.name))
        except OSError:
            continue
    for pid in mine:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(mine)
