"""`areal-hpc run`: the whole system on this machine."""

from __future__ import annotations

import sys

from areal_hpc.config import Config
from areal_hpc.layout import Layout
from areal_hpc.rundir import prepare_run_dir


def run_local(cfg: Config, fresh: bool = False) -> int:
    layout = Layout.from_config(cfg)
    run_dir = prepare_run_dir(cfg, fresh=fresh)
    print(layout.table())
    print(f"run directory: {run_dir}")
    print(
        "areal-hpc: the controller that starts the ranks is not built yet (issue 6); the run directory and "
        "resolved config are written, nothing is trained.",
        file=sys.stderr,
    )
    return 1
