"""W&B beside TensorBoard (areal_hpc.wandb_log), against the real `wandb` client in offline mode, its files
read back (tests.support.wandb_files):

- the metrics writer logs every row at its step, the resolved config and the run directory; a second
  writer on the same run directory (a resumed run) continues the same W&B run, and the steps it writes
  again (resumed from an earlier checkpoint) are all there, each row at W&B's next `_step`;
- what stops a run before it starts: `logging.wandb` without the client, and online without
  credentials, each a ConfigError naming the fix; `areal-hpc run` refuses it before the run directory
  is made, and `areal-hpc doctor` names it.

The whole run (`WANDB_MODE=offline areal-hpc run configs/tiny-cpu.yaml logging.wandb=true`, then resumed)
is in tests/test_e2e.py.
"""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.cli import main as cli_main
from areal_hpc.config import ConfigError, LoggingConfig, load_config
from areal_hpc.metrics import MetricsWriter, drop_rows_after
from areal_hpc.wandb_log import ID_FILE, check_wandb, server_problem
from tests.support.wandb_files import offline_runs

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No WANDB_* variable, ~/.netrc or W&B settings of this machine's user reach the test; W&B's own
    settings are read afresh."""
    import wandb

    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # settings are read once a process: forget the previous test's
    yield monkeypatch
    wandb.teardown()


def test_the_writer_logs_every_row_and_a_resumed_run_continues_it(tmp_path, wandb_env):
    import wandb

    wandb_env.setenv("WANDB_MODE", "offline")
    cfg = load_config(TINY, ["logging.wandb=true", "logging.wandb_project=p", f"experiment.root={tmp_path}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = MetricsWriter(run_dir, tensorboard=False, wandb=cfg)
    for step in (1, 2, 3):
        writer.write(step, {"reward/mean": step / 10, "timing/step_s": 0.5})
    writer.close()
    # A resumed run is another process, whose W&B service has ended first. `finish` does not wait for the
    # service to close the run (write its file out, free its id); `teardown` waits for the service to end.
    wandb.teardown()
    # Resumed from checkpoint 1: steps 2 and 3 are trained again, with other figures. An offline W&B run's
    # directory is named by the second it opened: the resumed one opens in the next.
    drop_rows_after(run_dir / "metrics.jsonl", 1)
    time.sleep(1 - time.time() % 1)
    writer = MetricsWriter(run_dir, tensorboard=False, wandb=cfg)
    for step in (2, 3, 4):
        writer.write(step, {"reward/mean": 1 + step / 10, "timing/step_s": 0.5})
    writer.close()
    wandb.teardown()

    first, resumed = offline_runs(run_dir)
    assert first.run_id == resumed.run_id == (run_dir / ID_FILE).read_text().strip()
    assert (first.resumed, resumed.resumed) == (False, True)
    assert [(r["step"], r["reward/mean"], r["_step"]) for r in first.history] == [(1, 0.1, 0), (2, 0.2, 1), (3, 0.3, 2)]
    assert [(r["step"], r["reward/mean"]) for r in resumed.history] == [(2, 1.2), (3, 1.3), (4, 1.4)]
    assert all(r["timing/step_s"] == 0.5 for r in first.history + resumed.history)
    for run in (first, resumed):
        assert run.config["run_dir"] == str(run_dir.resolve()) == run.summary["run_dir"]
        assert run.config["experiment"]["root"] == str(tmp_path) and run.config["logging"]["wandb_project"] == "p"
    # What W&B ends with is what metrics.jsonl holds: the last value logged at each step.
    last = {r["step"]: r["reward/mean"] for run in (first, resumed) for r in run.history}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert last == {r["step"]: r["reward/mean"] for r in rows}
    assert (run_dir / "wandb" / f"{Path(first.path).parent.name}").is_dir()  # under the run directory


def test_a_server_out_of_reach_is_logged_offline_with_a_warning(tmp_path, wandb_env, caplog):
    """Online, with credentials, but no route to the W&B server (here the real client's WANDB_BASE_URL on a
    port nothing listens on): the run logs offline, says so with the fix, and loses no row."""
    import wandb

    wandb_env.setenv("WANDB_API_KEY", "x" * 40)
    wandb_env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert "Connection" in server_problem("http://127.0.0.1:9")
    cfg = load_config(TINY, ["logging.wandb=true", f"experiment.root={tmp_path}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with caplog.at_level("WARNING", logger="areal_hpc.wandb_log"):
        writer = MetricsWriter(run_dir, tensorboard=False, wandb=cfg)
    assert "W&B: the server http://127.0.0.1:9 cannot be reached from host " in caplog.text
    assert f"wandb sync {run_dir.resolve()}/wandb/offline-run-*" in caplog.text
    for step in (1, 2):
        writer.write(step, {"reward/mean": step / 10})
    writer.close()
    wandb.teardown()
    [run] = offline_runs(run_dir)
    assert [(r["step"], r["reward/mean"]) for r in run.history] == [(1, 0.1), (2, 0.2)]


def test_no_client_is_refused_naming_the_fix(wandb_env):
    assert check_wandb(LoggingConfig(wandb=False)) == ""
    wandb_env.setitem(sys.modules, "wandb", None)  # `import wandb` fails as where it is not installed
    with pytest.raises(
        ConfigError, match=r"logging.wandb is true but the W&B client does not import.*pip install wandb"
    ):
        check_wandb(LoggingConfig(wandb=True))


def test_online_without_credentials_is_refused_and_offline_needs_none(wandb_env):
    with pytest.raises(ConfigError) as e:
        check_wandb(LoggingConfig(wandb=True))
    for fix in ("export WANDB_API_KEY", "`wandb login`", "WANDB_MODE=offline", "wandb sync"):
        assert fix in str(e.value)
    wandb_env.setenv("WANDB_API_KEY", "x" * 40)
    assert check_wandb(LoggingConfig(wandb=True)).endswith("online, credentials for " + _base_url())
    wandb_env.setenv("WANDB_MODE", "offline")
    wandb_env.delenv("WANDB_API_KEY")
    __import__("wandb").teardown()
    assert check_wandb(LoggingConfig(wandb=True)).endswith("offline")


def test_run_refuses_online_without_credentials_before_it_starts(tmp_path, wandb_env, capsys):
    code = cli_main(["run", str(TINY), "logging.wandb=true", f"experiment.root={tmp_path}"])
    assert code == 2, capsys.readouterr()
    assert "WANDB_API_KEY" in capsys.readouterr().err
    assert not (tmp_path / "tiny-cpu").exists()


def _base_url() -> str:
    from wandb.sdk import wandb_setup

    return wandb_setup.singleton().settings.base_url


def test_doctor_checks_wandb_on_this_host(wandb_env):
    from areal_hpc.launch.doctor import check_wandb_client

    assert check_wandb_client(load_config(TINY)).status == "SKIP"
    failed = check_wandb_client(load_config(TINY, ["logging.wandb=true"]))
    assert failed.status == "FAIL" and "WANDB_API_KEY" in failed.detail
