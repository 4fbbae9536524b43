"""The run directory `runs/<experiment>/<trial>/` (docs/design.md, The run directory and metrics), with
the resolved `config.yaml`, `tensorboard/`, `checkpoints/`, `logs/` (one file per rank), `metrics.jsonl`
and the job record.

```
 RUN_DIR/LOCK                       who uses the directory now: a local run (host, pid) or a Slurm job
 RUN_DIR/config.yaml                the resolved config; resuming with another one is refused, naming the fields
 RUN_DIR/checkpoints/step_<v>/      whatever the trainer and the controller write, then
                         FILES.json   each file's size and CRC-32, then
                         COMPLETE     written last: only now does the checkpoint count
```

Checkpoints. A directory counts once its `COMPLETE` marker exists; a run stopped halfway through a
save resumes from the previous one. `FILES.json` makes the files checkable whatever their format (the
trainer's is the trainer's business): on resume every recorded file must be there at its recorded size,
and the small ones (up to `RESUME_CHECKSUM_BYTES`) must match their CRC-32; a checkpoint that fails is
skipped with a warning naming it and the file, and the previous complete one is used. Reading back every
byte of a 32B run's ~600 GB on each resume would take minutes, so the large files' checksums are only
recorded (`checkpoint_damage(path, checksums_up_to=None)` checks them all). CRC-32, not a cryptographic
hash: it catches torn and truncated writes, which is what a checkpoint meets; zlib's runs at about 1.5
GB/s per core here, three times sha256, and releases the GIL, so the controller records it on threads.

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
import re
import shutil
import socket
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from areal_hpc.config import Config, ConfigError, load_config, save_config

log = logging.getLogger("areal_hpc.rundir")

COMPLETE = "COMPLETE"
FILES = "FILES.json"
LOCK = "LOCK"
STOP_FILE = "STOP"
"""A file the local launcher creates in the run directory to ask the controller to checkpoint and stop
(beside the signals, which do the same)."""
RESUMABLE = ("experiment.resume", "train.total_steps")
"""Fields a resumed run may change (a finished run can be extended)."""
RESUME_CHECKSUM_BYTES = 64 << 20
"""On resume, files up to this size are checked against their CRC-32 (the rest by size)."""
_CHUNK = 16 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")


def prepare_run_dir(cfg: Config, fresh: bool = False) -> Path:
    """Create (or reuse) the run directory and save the resolved config in it.

    Resuming a trial whose saved config differs from this one is refused unless `fresh`, naming each
    changed field with both values: a resumed run must continue the same experiment (the RESUMABLE
    fields may change). `fresh` (or `experiment.resume=false`) removes the trial's previous contents
    first, all but the lock of whoever is preparing it.
    """
    run_dir = cfg.run_dir
    saved = run_dir / "config.yaml"
    if fresh or not cfg.experiment.resume:
        if run_dir.is_dir():
            for p in run_dir.iterdir():
                if p.name != LOCK:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    elif saved.exists():
        changes = config_changes(load_config(saved), cfg)
        if changes:
            raise ConfigError(
                f"{saved} holds a different config for this trial:\n  "
                + "\n  ".join(changes)
                + "\nresume with the same config, pick another experiment.trial, or start afresh with --fresh"
            )
    for sub in ("tensorboard", "checkpoints", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    save_config(cfg, saved)
    return run_dir


def config_changes(previous: Config, cfg: Config) -> list[str]:
    """'ppo.lr: 0.0003 -> 0.1' for every field that differs, but the RESUMABLE ones. The `model.*` shape
    fields count through the architecture they give (`arch.model_arch`): a run directory whose config
    wrote them out (or left them to config.json) resumes while the model is the same. A run directory
    from before launchers recorded the node split (`allocation.gen_nodes` null there) took its split from
    the same `allocation.gen_share`, which is compared."""
    from areal_hpc.arch import SHAPE_FIELDS, model_arch

    old = _flat(OmegaConf.to_container(OmegaConf.structured(previous)))
    new = _flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    if old.get("allocation.gen_nodes") is None:
        old["allocation.gen_nodes"] = new.get("allocation.gen_nodes")
    if model_arch(previous.model) == model_arch(cfg.model):
        for key in (f"model.{f}" for f in SHAPE_FIELDS):
            old.pop(key, None), new.pop(key, None)

    def show(v) -> str:
        return v if isinstance(v, str) else repr(v)

    return [
        f"{key}: {show(old.get(key))} -> {show(new.get(key))}"
        for key in sorted(set(old) | set(new))
        if key not in RESUMABLE and old.get(key) != new.get(key)
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


# --- checkpoints -------------------------------------------------------------------------------


def checkpoint_dir(run_dir: str | Path, version: int) -> Path:
    """Where the checkpoint of policy version `version` goes (the weights after `version` steps)."""
    return Path(run_dir) / "checkpoints" / f"step_{version}"


def checkpoint_version(path: str | Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (step_<version>)")
    return int(m.group(1))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoint directories with COMPLETE, oldest first (damaged or not)."""
    root = Path(run_dir) / "checkpoints"
    found = [d for d in root.iterdir() if _STEP_DIR.match(d.name) and (d / COMPLETE).exists()] if root.is_dir() else []
    return sorted(found, key=checkpoint_version)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint whose files are intact, or None; a damaged one is skipped with a
    warning that names it and what is wrong."""
    for path in reversed(complete_checkpoints(run_dir)):
        damage = checkpoint_damage(path)
        if damage is None:
            return path
        log.warning("checkpoint %s is damaged, skipped: %s", path, damage)
    return None


def record_files(path: str | Path, threads: int = 8) -> dict:
    """Write FILES.json: the size and CRC-32 of every file under the checkpoint directory `path`, read on
    up to `threads` threads (a blocking call: the controller runs it on a thread of its own)."""
    path = Path(path)
    records = {Path(name) for name in (FILES, COMPLETE, f"{FILES}.tmp", f"{COMPLETE}.tmp")}
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.relative_to(path) not in records)
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        sums = list(pool.map(_crc32, files))
    record = {
        "checksum": "crc32",
        "files": {str(p.relative_to(path)): {"size": n, "crc32": crc} for p, (n, crc) in zip(files, sums)},
    }
    _write_atomic(path / FILES, json.dumps(record, indent=1).encode())
    return record


def checkpoint_damage(path: str | Path, checksums_up_to: int | None = RESUME_CHECKSUM_BYTES) -> str | None:
    """What is wrong with the files of checkpoint `path` against its FILES.json, or None: a file missing,
    another size than recorded, or another CRC-32 (checked for files up to `checksums_up_to` bytes;
    None: all). A checkpoint from before files were recorded has nothing to check against."""
    path = Path(path)
    try:
        record = json.loads((path / FILES).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        return f"{FILES} is unreadable ({e})"
    for name, want in record.items():
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} recorded"
        if (checksums_up_to is None or size <= checksums_up_to) and _crc32(path / name)[1] != want["crc32"]:
            return f"{name} does not match its recorded CRC-32"
    return None


def mark_complete(path: str | Path) -> None:
    """COMPLETE, atomically and durably: after it, the checkpoint counts."""
    _write_atomic(Path(path) / COMPLETE, b"")


def clear_complete(path: str | Path) -> None:
    """Before saving again into an existing directory (a damaged checkpoint of the same version):
    COMPLETE first, so that the directory never counts while its files change."""
    for name in (COMPLETE, FILES):
        (Path(path) / name).unlink(missing_ok=True)


def prune_checkpoints(run_dir: str | Path, keep: int, protect: Iterable[Path] = ()) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep` (0: none), and the incomplete ones
    older than the newest complete one (saves that never finished); never those in `protect`. Returns
    what it deleted."""
    complete = complete_checkpoints(run_dir)
    if not complete:
        return []
    newest = checkpoint_version(complete[-1])
    doomed = complete[:-keep] if keep else []
    root = Path(run_dir) / "checkpoints"
    doomed += [
        d
        for d in root.iterdir()
        if _STEP_DIR.match(d.name) and not (d / COMPLETE).exists() and checkpoint_version(d) < newest
    ]
    kept = {Path(p).resolve() for p in protect if p is not None}
    deleted = []
    for d in sorted(doomed, key=checkpoint_version):
        if d.resolve() not in kept:
            (d / COMPLETE).unlink(missing_ok=True)  # it stops counting before its files go
            shutil.rmtree(d, ignore_errors=True)
            deleted.append(d)
    return deleted


def _crc32(p: Path) -> tuple[int, str]:
    crc, n = 0, 0
    with open(p, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc, n = zlib.crc32(chunk, crc), n + len(chunk)
    return n, f"{crc:08x}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def log_path(run_dir: str | Path, role_name: str, index: int) -> Path:
    """`logs/<role>-<i>.log`, e.g. logs/generator-0.log."""
    return Path(run_dir) / "logs" / f"{role_name}-{index}.log"
