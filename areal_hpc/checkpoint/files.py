"""A checkpoint's directory as files: where it is, the record of its files, completion, which one a run
resumes from, and which ones are kept.

```
 RUN_DIR/checkpoints/step_<v>/   whatever the trainer and the controller write, then
                   FILES.json    each file's size and CRC-32 (`record_files`), then
                   COMPLETE      written last (`mark_complete`): only now does the checkpoint count
```

A directory counts once its `COMPLETE` marker exists; a run stopped halfway through a save resumes from
the previous one. `FILES.json` makes the files checkable whatever their format (the trainer's is the
trainer's business): on resume every recorded file must be there at its recorded size, and the small ones
(up to `RESUME_CHECKSUM_BYTES`) must match their CRC-32; a checkpoint that fails is skipped with a warning
naming it and the file, and the previous complete one is used (`latest_checkpoint`). Reading back every
byte of a 32B run's ~600 GB on each resume would take minutes, so the large files' checksums are only
recorded (`checkpoint_damage(path, checksums_up_to=None)` checks them all). CRC-32, not a cryptographic
hash: it catches torn and truncated writes, which is what a checkpoint meets; zlib's runs at about 1.5
GB/s per core here, three times sha256, and releases the GIL, so the controller records it on threads.

Retention (`prune_checkpoints`): the newest `train.keep_checkpoints` complete ones stay, and the one the
run resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
FILES = "FILES.json"
RESUME_CHECKSUM_BYTES = 64 << 20
"""On resume, files up to this size are checked against their CRC-32 (the rest by size)."""
OPTIONAL = "in-flight-"
"""Files a resume can do without, whose damage does not make the checkpoint damaged: the generators' answers
in flight (areal_hpc.checkpoint.in_flight checks each one and leaves a bad one out)."""
_CHUNK = 16 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
    None: all), the OPTIONAL ones aside. A checkpoint from before files were recorded has nothing to check
    against."""
    path = Path(path)
    try:
        record = recorded_files(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        return f"{FILES} is unreadable ({e})"
    for name, want in record.items():
        if not name.startswith(OPTIONAL) and (damage := file_damage(path, name, want, checksums_up_to)):
            return damage
    return None


def recorded_files(path: str | Path) -> dict:
    """FILES.json's record of checkpoint `path`: file name -> {"size", "crc32"}."""
    return json.loads((Path(path) / FILES).read_text())["files"]


def file_damage(path: Path, name: str, want: dict, checksums_up_to: int | None = RESUME_CHECKSUM_BYTES) -> str | None:
    """What is wrong with file `name` of checkpoint `path` against its record `want`, or None."""
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
