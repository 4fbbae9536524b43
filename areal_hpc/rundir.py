"""The run directory of DESIGN.md: `runs/<experiment>/<trial>/` with the resolved `config.yaml`,
`tensorboard/`, `checkpoints/`, `logs/` (one file per rank), `metrics.jsonl` and the job record.

Checkpoints are `checkpoints/step_<version>/` directories; one counts only once its `COMPLETE`
marker exists (the controller writes it last, after every trainer rank and the controller itself have
written their parts), so a run stopped halfway through a save resumes from the previous one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from areal_hpc.config import Config, ConfigError, load_config, save_config, to_yaml

COMPLETE = "COMPLETE"
STOP_FILE = "STOP"
"""A file the local launcher creates in the run directory to ask the controller to checkpoint and stop
(beside the signals, which do the same)."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


def prepare_run_dir(cfg: Config, fresh: bool = False) -> Path:
    """Create (or reuse) the run directory and save the resolved config in it.

    Resuming a trial whose saved config differs from this one is refused unless `fresh`: a resumed
    run must continue the same experiment (`train.total_steps` may change: a finished run can be
    extended). `fresh` (or `experiment.resume=false`) removes the trial's previous contents first.
    """
    run_dir = cfg.run_dir
    saved = run_dir / "config.yaml"
    if fresh or not cfg.experiment.resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif saved.exists():
        previous = load_config(saved)
        previous.experiment.resume = cfg.experiment.resume
        previous.train.total_steps = cfg.train.total_steps
        if to_yaml(previous) != to_yaml(cfg):
            raise ConfigError(
                f"{saved} holds a different config for this trial; resume with the same config, pick another "
                "experiment.trial, or start afresh with --fresh"
            )
    for sub in ("tensorboard", "checkpoints", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    save_config(cfg, saved)
    return run_dir


def checkpoint_dir(run_dir: str | Path, version: int) -> Path:
    """Where the checkpoint of policy version `version` goes (the weights after `version` steps)."""
    return Path(run_dir) / "checkpoints" / f"step_{version}"


def complete_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """Every complete checkpoint directory by its version, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = {}
    for d in root.iterdir() if root.is_dir() else ():
        m = _STEP_DIR.match(d.name)
        if m and (d / COMPLETE).exists():
            found[int(m.group(1))] = d
    return dict(sorted(found.items()))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = complete_checkpoints(run_dir)
    return found[max(found)] if found else None


def checkpoint_version(path: str | Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (step_<version>)")
    return int(m.group(1))


def mark_complete(path: str | Path) -> None:
    (Path(path) / COMPLETE).write_text("")


def log_path(run_dir: str | Path, role_name: str, index: int) -> Path:
    """`logs/<role>-<i>.log`, e.g. logs/generator-0.log."""
    return Path(run_dir) / "logs" / f"{role_name}-{index}.log"
