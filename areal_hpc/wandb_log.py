"""Weights & Biases beside TensorBoard (`logging.wandb`): every metrics.jsonl row at its step, the resolved
config and the run directory, in one W&B run per trial. Only the controller talks to W&B, through
`areal_hpc.metrics.MetricsWriter`; the `wandb` client is imported here only, and only when it is on.

The W&B run's id is kept in `RUN_DIR/wandb_id`: a resumed trial continues the same W&B run
(`resume="allow"`), and `--fresh`, which empties the run directory, starts a new one. Its files go under
`RUN_DIR/wandb/` (`offline-run-<time>-<id>/` with `WANDB_MODE=offline`: `wandb sync RUN_DIR/wandb/offline-run-*`
uploads them later, the files of one run in the order they were written).

Steps trained again. A run resumed from a checkpoint older than its last metrics row trains the steps
after the checkpoint again (metrics.jsonl is cut there: `metrics.drop_rows_after`). W&B's own step,
`_step`, only goes forward, and a row logged at an earlier one is dropped; so each row is logged at W&B's
next `_step`, with the training step as a metric of its own, `step` (the metrics.jsonl key), the x axis of
every chart (`define_metric("*", step_metric="step")`). A step trained again shows twice, its later value
the one metrics.jsonl keeps. W&B's `resume_from` rewind would cut the history instead, but the W&B server
does that, so an offline run could not.

`check_wandb` runs where a run starts (the launchers, before anything else; the controller, before its
first step): a missing client, or online mode without credentials, is a ConfigError naming the fix, not a
W&B prompt or traceback mid-run.

A W&B server the controller cannot reach (compute nodes without a route out, common on clusters) would
keep `wandb.init` retrying and then end the run with an error that names neither W&B nor the fix. So
online, the controller first opens a connection to the server (`server_problem`, at most SERVER_TIMEOUT_S),
and if it cannot, logs offline with a warning naming the server and `wandb sync`: no training run is lost
to the W&B server. (A connection is what W&B's retries wait for; credentials are checked by `check_wandb`.)
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from areal_hpc.config.schema import Config, LoggingConfig
from areal_hpc.errors import ConfigError

ID_FILE = "wandb_id"
"""RUN_DIR/wandb_id: the trial's W&B run id."""
STEP = "step"
"""The training step (the policy version after it): the metrics.jsonl key, and W&B's x axis."""
NO_NETWORK_MODES = ("offline", "dryrun", "disabled")
SERVER_TIMEOUT_S = 10.0
"""How long the controller waits for a connection to the W&B server before it logs offline."""

log = logging.getLogger(__name__)


def check_wandb(cfg: LoggingConfig) -> str:
    """With `logging.wandb`: the client imports, and online it has credentials, else a ConfigError with the
    fix; returns what it found ('W&B 0.31.0, offline'), or '' with `logging.wandb` off."""
    if not cfg.wandb:
        return ""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            f"logging.wandb is true but the W&B client does not import ({e}): install it with `pip install wandb` "
            "(tools/setup.sh does), or set logging.wandb=false"
        ) from None
    from wandb.errors import AuthenticationError
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate_session

    settings = wandb_setup.singleton().settings  # WANDB_* variables and `wandb offline` applied
    found = f"W&B {wandb.__version__}, {settings.mode}"
    if settings.mode in NO_NETWORK_MODES:
        return found
    try:  # what wandb.init would find: WANDB_API_KEY, the netrc entry of `wandb login`; no prompt, no network
        auth = authenticate_session(host=settings.base_url, source="areal-hpc", prompt=False, update_session=False)
    except AuthenticationError as e:
        raise ConfigError(f"logging.wandb: the W&B credentials are not usable: {e}") from None
    if auth is None:
        raise ConfigError(
            f"logging.wandb is true and W&B is online (WANDB_MODE={os.environ.get('WANDB_MODE', 'unset')}) but no "
            f"credentials for {settings.base_url} are set: export WANDB_API_KEY, or run `wandb login` once; "
            "or log offline with WANDB_MODE=offline and upload later with `wandb sync RUN_DIR/wandb/offline-run-*`"
        )
    return f"{found}, credentials for {auth.host}"


def server_problem(base_url: str, timeout_s: float = SERVER_TIMEOUT_S) -> str | None:
    """Why a TCP connection to the W&B server at `base_url` cannot be made from here (None: it can)."""
    url = urlsplit(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class WandbLog:
    """The trial's W&B run, opened (or resumed) on creation; `log(row)` adds one metrics row."""

    def __init__(self, cfg: Config, run_dir: str | Path):
        check_wandb(cfg.logging)
        import wandb
        from omegaconf import OmegaConf
        from wandb.sdk import wandb_setup

        run_dir = Path(run_dir).resolve()
        id_file = run_dir / ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None  # None: W&B makes one
        settings = cfg.logging
        # Where a run hangs at start, the log says whether it is here: wandb.init waits up to W&B's
        # init_timeout (90 s) for its service, and raises then.
        log.info("W&B: %s under %s", f"resuming run {run_id}" if run_id else "starting a run", run_dir / "wandb")
        mode = {}
        found = wandb_setup.singleton().settings
        if found.mode not in NO_NETWORK_MODES and (problem := server_problem(found.base_url)):
            log.warning(
                "W&B: the server %s cannot be reached from host %s (%s): logging offline under %s; upload "
                "later from a machine that reaches it with `wandb sync %s/offline-run-*` (WANDB_MODE=offline "
                "skips this check)",
                found.base_url, socket.gethostname(), problem, run_dir / "wandb", run_dir / "wandb",
            )  # fmt: skip
            mode = {"mode": "offline"}
        t0 = time.monotonic()
        self.run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity or None,
            group=settings.wandb_group or cfg.experiment.name,
            name=f"{cfg.experiment.name}/{cfg.experiment.trial}",
            id=run_id,
            resume="allow" if run_id else None,
            dir=run_dir,
            config={**OmegaConf.to_container(OmegaConf.structured(cfg)), "run_dir": str(run_dir)},
            settings=wandb.Settings(console="off", **mode),  # the rank's output is its log file already
        )
        log.info("W&B run %s open (%s, %.1f s)", self.run.id, self.run.settings.mode, time.monotonic() - t0)
        id_file.write_text(self.run.id + "\n")
        self.run.summary["run_dir"] = str(run_dir)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def log(self, row: dict) -> None:
        """One metrics.jsonl row, its `step` included."""
        self.run.log(row)

    def close(self) -> None:
        import wandb

        t0 = time.monotonic()
        self.run.finish()
        wandb.teardown()  # its service process ends here: a rank leaves without Python's exit hooks
        log.info("W&B run %s finished (%.1f s)", self.run.id, time.monotonic() - t0)
