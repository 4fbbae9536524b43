"""Turning a config into processes. Three launchers, one interface, so that one config runs alike on
this machine, on Slurm, or only as far as its script:

```
 LocalLauncher    areal-hpc run            one mpirun on this machine (areal_hpc/launch/local.py: run_local)
 SlurmLauncher    areal-hpc submit         one heterogeneous Slurm job through submitit (areal_hpc/launch/slurm.py)
 DryRunLauncher   areal-hpc submit --dry-run   prints the sbatch script, starts nothing
```

Each takes the validated config and returns the command's exit code; tests pick the cheap one with no
special case. What differs (blocking run vs. a queued job) stays behind `launch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from areal_hpc.launch.errors import LaunchError

if TYPE_CHECKING:
    from areal_hpc.config import Config


class Launcher(Protocol):
    name: str

    def launch(self, cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> int:
        """Start the run of `cfg` (afresh when `fresh`; on resume, the training fields `allow_change` names
        may change: `rundir.prepare_run_dir`); return the exit code for the command line."""
        ...


class LocalLauncher:
    """The whole system on this machine: `areal_hpc.launch.local.run_local` (blocks until the run ends)."""

    name = "local"

    def launch(self, cfg: Config, fresh: bool = False, allow_change: Sequence[str] = ()) -> int:
        from areal_hpc.launch.local import run_local

        return run_local(cfg, fresh=fresh, allow_change=allow_change)


def get_launcher(kind: str, **kwargs) -> Launcher:
    """`local`, `slurm` or `dry-run`."""
    from areal_hpc.launch.slurm import DryRunLauncher, SlurmLauncher

    kinds = {"local": LocalLauncher, "slurm": SlurmLauncher, "dry-run": DryRunLauncher}
    if kind not in kinds:
        raise ValueError(f"unknown launcher '{kind}' (one of {', '.join(kinds)})")
    return kinds[kind](**kwargs)


__all__ = ["LaunchError", "Launcher", "LocalLauncher", "get_launcher"]
