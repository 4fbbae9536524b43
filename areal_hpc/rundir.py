"""The run directory of DESIGN.md: `runs/<experiment>/<trial>/` with the resolved `config.yaml`,
`tensorboard/`, `checkpoints/`, `logs/` (one file per rank), `metrics.jsonl` and the job record."""

from __future__ import annotations

import shutil
from pathlib import Path

from areal_hpc.config import Config, ConfigError, load_config, save_config, to_yaml


def prepare_run_dir(cfg: Config, fresh: bool = False) -> Path:
    """Create (or reuse) the run directory and save the resolved config in it.

    Resuming a trial whose saved config differs from this one is refused unless `fresh`: a resumed
    run must continue the same experiment. `fresh` (or `experiment.resume=false`) removes the trial's
    previous contents first.
    """
    run_dir = cfg.run_dir
    saved = run_dir / "config.yaml"
    if fresh or not cfg.experiment.resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif saved.exists():
        previous = load_config(saved)
        previous.experiment.resume = cfg.experiment.resume
        if to_yaml(previous) != to_yaml(cfg):
            raise ConfigError(
                f"{saved} holds a different config for this trial; resume with the same config, pick another "
                "experiment.trial, or start afresh with --fresh"
            )
    for sub in ("tensorboard", "checkpoints", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    save_config(cfg, saved)
    return run_dir
