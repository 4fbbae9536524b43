"""The run directory `runs/<experiment>/<trial>/` (docs/design.md, The run directory and metrics), with
the resolved `config.yaml`, `tensorboard/`, `checkpoints/`, `logs/` (one file per rank), `metrics.jsonl`
and the job record.

```
 RUN_DIR/LOCK                       who uses the directory now: a local run (host, pid) or a Slurm job
 RUN_DIR/config.yaml                the resolved config; what a resume may change: areal_hpc.config.resume
 RUN_DIR/config_history.jsonl       each change a resume made, with the step it took effect after
 RUN_DIR/STOP                       the local launcher asks the controller to checkpoint and stop
 RUN_DIR/logs/<role>-<i>.log        one log per rank
 RUN_DIR/checkpoints/step_<v>/      areal_hpc.checkpoint
 RUN_DIR/wandb/, RUN_DIR/wandb_id   with logging.wandb: areal_hpc.wandb_log
```

Lock. `run` and `submit` take `LOCK` before they touch anything: a second one on a directory in use is
refused with the holder named. A lock whose process is gone (on this host) or whose Slurm job is no
longer active is stale and taken over; a process on another host cannot be checked from here, and the
message says how to clear its lock.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from areal_hpc.checkpoint.files import checkpoint_version, latest_checkpoint
from areal_hpc.config import IDENTITY, TRAINING, Config, ConfigError, allowed_fields, kind_of, load_config, save_config
from areal_hpc.jsonl import read_jsonl
from areal_hpc.layout import Layout

log = logging.getLogger("areal_hpc.rundir")

LOCK = "LOCK"
STOP_FILE = "STOP"
"""A file the local launcher creates in the run directory to ask the controller to checkpoint and stop
(beside the signals, which do the same)."""
HISTORY = "config_history.jsonl"
"""Every setting a resume changed: one line a field, {"step", "time", "field", "kind", "old", "new"}, with
"allowed_by" (the --allow-change argument) for a training field. `step` is the checkpoint the run resumed
from: step + 1 is the first step trained with the new value."""


@dataclass(frozen=True)
class Change:
    """A field whose value differs between the run directory's config.yaml and the one resuming it."""

    field: str
    old: Any
    new: Any

    @property
    def kind(self) -> str:
        return kind_of(self.field)

    def __str__(self) -> str:
        def show(v) -> str:
            return v if isinstance(v, str) else repr(v)

        return f"{self.field}: {show(self.old)} -> {show(self.new)}"


def prepare_run_dir(cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> Path:
    """Create (or reuse) the run directory and save the resolved config in it.

    Resuming a trial with a config that differs from its saved one (areal_hpc.config.resume): an
    operational field changes; a training field only if `allow_change` names it or its section; an
    identity field never. A refusal names each refused field with both values and what to do; the
    changes made are logged and appended to RUN_DIR/config_history.jsonl with the step resumed from.
    `fresh` (or `experiment.resume=false`) removes the trial's previous contents first, all but the
    lock of whoever is preparing it.
    """
    Layout.from_config(cfg)  # refuses a config whose node split is unresolved: config.yaml records it as a number
    allowed = allowed_fields(list(allow_change))  # a misspelt permission is refused before anything changes
    run_dir = cfg.run_dir
    saved = run_dir / "config.yaml"
    if fresh or not cfg.experiment.resume:
        if run_dir.is_dir():
            for p in run_dir.iterdir():
                if p.name != LOCK:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    elif saved.exists():
        checkpoint = latest_checkpoint(run_dir)
        step = checkpoint_version(checkpoint) if checkpoint else 0
        changes = config_changes(load_config(saved), cfg)
        refused = [c for c in changes if c.kind == IDENTITY or (c.kind == TRAINING and c.field not in allowed)]
        if refused:
            raise ConfigError(
                f"{saved} holds a different config for this trial:\n  "
                + "\n  ".join(f"{c}  ({_why_refused(c, step)})" for c in refused)
                + "\nresume with the same config, pick another experiment.trial, or start afresh with --fresh"
            )
        if changes:
            _record(run_dir, step, changes, allowed)
        if step >= cfg.train.total_steps:
            log.warning(
                "%s: this run trains nothing: its checkpoint step_%d has reached train.total_steps (%d); "
                "raise train.total_steps to train on",
                run_dir,
                step,
                cfg.train.total_steps,
            )
    for sub in ("tensorboard", "checkpoints", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    save_config(cfg, saved)
    return run_dir


def _why_refused(change: Change, step: int) -> str:
    if change.kind == IDENTITY:
        return "identity: another experiment"
    return f"training: --allow-change {change.field} changes it from step {step + 1} on"


def _record(run_dir: Path, step: int, changes: list[Change], allowed: dict[str, str]) -> None:
    """Append the changes to HISTORY and log them (the launcher's console shows warnings)."""
    time = _now()
    with open(run_dir / HISTORY, "a") as f:
        for c in changes:
            row = {"step": step, "time": time, "field": c.field, "kind": c.kind, "old": c.old, "new": c.new}
            if c.kind == TRAINING:
                row["allowed_by"] = f"--allow-change {allowed[c.field]}"
            f.write(json.dumps(row) + "\n")
    log.warning(
        "%s: resuming from step %d with changed settings (recorded in %s):\n  %s",
        run_dir,
        step,
        HISTORY,
        "\n  ".join(f"{c}  ({c.kind})" for c in changes),
    )


def changes_at(run_dir: str | Path, step: int) -> list[str]:
    """The settings HISTORY says changed when the run resumed from checkpoint `step` (what a resumed
    controller logs): 'cluster.time: 04:00:00 -> 08:00:00 (operational)'."""
    path = Path(run_dir) / HISTORY
    if not path.exists():
        return []
    rows = [row for _, _, row in read_jsonl(path, torn_ok=True) if row["step"] == step]
    return [f"{Change(r['field'], r['old'], r['new'])}  ({r['kind']})" for r in rows]


def config_changes(previous: Config, cfg: Config) -> list[Change]:
    """Every field that differs between two configs. The `model.*` shape fields count through the
    architecture they give (`arch.model_arch`): a run directory whose config wrote them out (or left them
    to config.json) resumes while the model is the same; so do `distill.teacher.*`'s."""
    from areal_hpc.arch import SHAPE_FIELDS, model_arch, teacher_arch

    old = _flat(OmegaConf.to_container(OmegaConf.structured(previous)))
    new = _flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    for section, arch in (
        ("model", lambda c: model_arch(c.model)),
        ("distill.teacher", lambda c: teacher_arch(c.distill.teacher)),
    ):
        if arch(previous) == arch(cfg):  # another path, if any, is a change of its own
            for key in (f"{section}.{f}" for f in SHAPE_FIELDS):
                old.pop(key, None), new.pop(key, None)
    return [
        Change(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)
    ]


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


# --- the lock ----------------------------------------------------------------------------------


class RunDirInUse(RuntimeError):
    """Another run or job holds the run directory; the message names it and says what to do."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: a process on a host, or a Slurm job."""

    host: str
    pid: int | None = None
    pid_start: str = ""
    """The process's start time (/proc/PID/stat), to tell its pid from a later process's."""
    job_id: str | None = None
    since: str = ""

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), _start_time(os.getpid()), since=_now())

    def as_job(self, job_id: str) -> Holder:
        return dataclasses.replace(self, pid=None, pid_start="", job_id=str(job_id), since=_now())

    def describe(self) -> str:
        if self.job_id:
            return f"Slurm job {self.job_id} (submitted from {self.host} at {self.since})"
        return f"process {self.pid} on host {self.host} (since {self.since})"

    def alive(self, job_active: Callable[[str], bool]) -> bool | None:
        """True, False, or None when this host cannot tell (a process on another host)."""
        if self.job_id:
            return job_active(self.job_id)
        if self.host != socket.gethostname():
            return None
        return self.pid is not None and _start_time(self.pid) == self.pid_start != ""


def lock_run_dir(run_dir: Path, holder: Holder, job_active: Callable[[str], bool]) -> None:
    """Take RUN_DIR/LOCK for `holder`, or raise RunDirInUse naming the one that holds it. A stale lock
    (its process gone, its job no longer active) is taken over."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            current = read_lock(run_dir)
            if current is not None and current != holder:
                alive = current.alive(job_active)
                if alive is None:
                    raise RunDirInUse(
                        f"{run_dir} is in use by {current.describe()}, which cannot be checked from this host; "
                        f"if it has ended, delete {path}"
                    ) from None
                if alive:
                    how = (
                        f"cancel it (areal-hpc cancel {run_dir})"
                        if current.job_id
                        else "stop it (Ctrl-C in its terminal: it checkpoints first)"
                    )
                    raise RunDirInUse(
                        f"{run_dir} is in use by {current.describe()}: wait for it to end, {how}, "
                        "or pick another experiment.trial"
                    ) from None
                log.warning("%s: taking over the stale lock of %s", run_dir, current.describe())
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(dataclasses.asdict(holder)) + "\n")
        return
    raise RunDirInUse(f"{run_dir}: another process keeps taking {path}; try again")


def relock_run_dir(run_dir: Path, holder: Holder) -> None:
    """Hand a lock this process holds to `holder` (a submitted job) in one atomic replace."""
    tmp = Path(run_dir) / f"{LOCK}.tmp"
    tmp.write_text(json.dumps(dataclasses.asdict(holder)) + "\n")
    tmp.replace(Path(run_dir) / LOCK)


def unlock_run_dir(run_dir: Path, holder: Holder) -> None:
    """Release the lock if `holder` still holds it."""
    if read_lock(run_dir) == holder:
        (Path(run_dir) / LOCK).unlink(missing_ok=True)


def read_lock(run_dir: Path) -> Holder | None:
    try:
        data = json.loads((Path(run_dir) / LOCK).read_text())
        return Holder(**{f.name: data[f.name] for f in dataclasses.fields(Holder) if f.name in data})
    except (OSError, ValueError, TypeError):
        return None  # absent, or being written


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime (the name may hold spaces)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def log_path(run_dir: str | Path, role_name: str, index: int) -> Path:
    """`logs/<role>-<i>.log`, e.g. logs/generator-0.log."""
    return Path(run_dir) / "logs" / f"{role_name}-{index}.log"
