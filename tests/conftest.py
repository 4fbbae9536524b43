"""Shared test fixtures, and the fast tier.

Tests are marked by the real component they need (mpi, slurm, vllm, megatron, e2e), and `slow` when they
measured over 3 s here (`pytest --durations=0` on 2 cores; a module-scoped fixture counts for the tests
that use it). In CI every component is installed and every test runs; a developer may deselect with
`-m "not slurm"`. `--fast` (`tools/test.sh --fast`) runs the unit tier: no MPI world, no vLLM engine, no
Slurm, nothing slow; `--heavy` the rest (`tools/test.sh` runs the two tiers one after the other);
`--cpu-time` where their time goes (tests.support.cpu_time).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cpu_time import CpuTime
from tests.support.helpers import REPO
from tests.support.wheel import Installed, install_wheel

FAST_LEAVES_OUT = ("mpi", "slurm", "vllm", "e2e", "slow")
"""The markers whose tests `--fast` leaves out."""


def pytest_addoption(parser):
    parser.addoption(
        "--fast", action="store_true", help=f"the unit tier: leave out tests marked {', '.join(FAST_LEAVES_OUT)}"
    )
    parser.addoption("--heavy", action="store_true", help="the tests --fast leaves out, only")
    parser.addoption("--cpu-time", action="store_true", help="where the time goes (tests.support.cpu_time)")


def pytest_configure(config):
    if config.getoption("--cpu-time") and not hasattr(config, "workerinput"):  # not in a pytest-xdist worker
        config.pluginmanager.register(CpuTime(), "cpu_time")


def pytest_collection_modifyitems(config, items):
    fast, heavy = config.getoption("--fast"), config.getoption("--heavy")
    if fast and heavy:
        raise pytest.UsageError("--fast and --heavy are the two halves of the suite: give one of them")
    if not fast and not heavy:
        return
    kept, left = [], []
    for item in items:
        out = any(item.get_closest_marker(m) for m in FAST_LEAVES_OUT)
        (left if out == fast else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


def mpirun_cmd(n: int) -> list[str]:
    """mpirun for `n` local ranks (as root it needs --allow-run-as-root)."""
    cmd = ["mpirun", "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


@pytest.fixture
def run_mpi():
    """Run a Python file (one of tests/support/mpi/) under mpirun with `n` ranks; returns the CompletedProcess."""

    def run(path: Path, n: int, timeout: float = 120, env: dict | None = None, args: list[str] = ()):
        python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        full_env = {**os.environ, "OMPI_MCA_btl": "self,tcp", "PYTHONPATH": python_path, **(env or {})}
        return subprocess.run(
            [*mpirun_cmd(n), sys.executable, str(path), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=REPO,
        )

    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is not installed (tools/setup.sh installs OpenMPI)")
    return run


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    """The `experiment.root` of the session's whole runs (tests/test_e2e.py, tests/test_slurm_e2e.py), each
    its own trial: the tiny models, their warm starts and the synthetic data are built once, in its
    `.assets`, by whichever run needs them first."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory) -> Installed:
    """A wheel built from the repository, installed with `pip install --target` (tests.support.wheel):
    built once a session, for tests/test_wheel.py and the e2e run that runs from it."""
    return install_wheel(tmp_path_factory.mktemp("wheel"))


def _slurm_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a running cluster: the one tools/test.sh started, or one started here."""
    started = False
    if not (os.environ.get("SLURM_CONF") and _slurm_answers()):
        out = subprocess.run([str(REPO / "tools/local_slurm.sh"), "start"], capture_output=True, text=True)
        assert out.returncode == 0, f"tools/local_slurm.sh start failed:\n{out.stdout}\n{out.stderr}"
        os.environ["SLURM_CONF"] = str(REPO / ".slurm" / "etc" / "slurm.conf")
        started = True
    yield os.environ["SLURM_CONF"]
    if started:
        subprocess.run([str(REPO / "tools/local_slurm.sh"), "stop"], capture_output=True)
