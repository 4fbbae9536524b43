"""What every rank receives at start: the config, the rank map, its communicators and paths.

`areal_hpc.main` builds one `RankContext` per rank and hands it to the role's `serve(ctx)`; nothing
else creates communicators or reads the rank map's globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_hpc.config import Config
from areal_hpc.layout import Layout, Role

CONTROLLER_RANK = 0


@dataclass
class RankContext:
    cfg: Config
    layout: Layout
    world: Any
    """MPI.COMM_WORLD."""
    role_comm: Any
    """The ranks of this rank's role (`layout.split(world)`), ordered by world rank."""
    run_dir: Path
    model_path: Path
    """Hugging Face directory of the initial weights (the built tiny model, or `model.path`)."""
    resume_from: Path | None = None
    """The latest complete checkpoint directory to resume from, or None for a fresh start."""
    device: str = "cpu"
    """This rank's compute device, 'cpu' or 'cuda', resolved once at start (`device.resolve_device`,
    after CUDA_VISIBLE_DEVICES was narrowed to the rank's GPUs); everything the role builds takes it."""

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def role(self) -> Role:
        return self.layout.role_of(self.rank)
