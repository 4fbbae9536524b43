"""Trainer checkpoints: every rank's model shard and optimizer state, written atomically.

Layout of `<step dir>/trainer/`:

    manifest.json        parallel sizes, architecture, one file per trainer rank (written last)
    rank00000.pt ...     {"model": stage state_dict, "optimizer": Megatron optimizer state_dict}

Atomicity: all ranks write into `<step dir>/.trainer.partial/`; after a barrier, trainer rank 0
writes the manifest and renames the directory to `trainer/`. A crash before the rename leaves only
the `.partial` directory, which `load` never reads; a `trainer/` directory always has every file.
Resuming needs the same TP x PP x DP split (checked against the manifest).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _fsync_write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save(engine, step_dir: str | Path) -> Path:
    """Write this rank's part of the checkpoint under `step_dir/trainer/` (collective over trainer ranks)."""
    step_dir = Path(step_dir)
    final, partial = step_dir / "trainer", step_dir / ".trainer.partial"
    par = engine.par
    if par.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
        partial.mkdir(parents=True)
    dist.barrier()
    state = {"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()}
    _fsync_write(partial / _rank_file(par.rank), lambda f: torch.save(state, f))
    dist.barrier()
    if par.rank == 0:
        manifest = {
            "tp": par.tp,
            "pp": par.pp,
            "dp": par.dp,
            "world": par.world,
            "arch": asdict(engine.arch),
            "files": [_rank_file(r) for r in range(par.world)],
        }
        _fsync_write(partial / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        if final.exists():  # overwrite a complete checkpoint: move it aside first, drop it after
            old = step_dir / ".trainer.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, final)
        fd = os.open(step_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dist.barrier()
    return final


def is_complete(ckpt_dir: str | Path) -> bool:
    """Whether `ckpt_dir` (a `trainer/` directory) is a complete checkpoint."""
    return (Path(ckpt_dir) / MANIFEST).is_file()


def load(engine, ckpt_dir: str | Path) -> None:
    """Restore this rank's model shard and optimizer state from a `trainer/` directory."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: not a complete trainer checkpoint (no {MANIFEST})")
    manifest = json.loads((ckpt_dir / MANIFEST).read_text())
    par = engine.par
    have = (manifest["tp"], manifest["pp"], manifest["dp"])
    if have != (par.tp, par.pp, par.dp):
        raise ValueError(
            f"{ckpt_dir} was written with TP x PP x DP = {have}; this run has {(par.tp, par.pp, par.dp)}. "
            "Resume with the same allocation.train_tp, train_pp and trainer ranks."
        )
    state = torch.load(ckpt_dir / _rank_file(par.rank), map_location=engine.device, weights_only=False)
    engine.model.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
