"""tools/setup.sh where it may install nothing: a cluster's login node (a user who is not root, no
sudo, the site's MPI and Slurm client on PATH) and a machine whose pip sources lack the CPU build of
torch. Package managers and sudo are replaced by scripts that record their call and fail."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
PACKAGE_TOOLS = ("sudo", "apt-get", "apt", "dpkg", "dpkg-query", "dnf", "yum", "zypper", "rpm")


@pytest.fixture
def box():
    """A folder the unprivileged user can read (pytest's tmp_path is root's alone), with a HOME it owns
    and the recording package tools in fake/."""
    path = Path(tempfile.mkdtemp(prefix="areal-setup-"))
    path.chmod(0o755)
    (path / "home").mkdir()
    (path / "fake").mkdir()
    calls = path / "calls"
    calls.touch(mode=0o666)
    calls.chmod(0o666)
    for name in PACKAGE_TOOLS:
        tool = path / "fake" / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        tool.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(path / "home", NOBODY, NOBODY)
    yield path
    shutil.rmtree(path)


def run_setup(box: Path, venv: Path, path: list[str], **env) -> subprocess.CompletedProcess:
    """tools/setup.sh (CPU) as a user who is not root, with only the given PATH and environment."""
    env = {
        "PATH": ":".join([str(box / "fake"), str(venv / "bin"), *path]),
        "HOME": str(box / "home"),
        "VIRTUAL_ENV": str(venv),
        "AREAL_DEVICE": "cpu",
        "LANG": "C.UTF-8",
        **env,
    }
    # `nobody`, allowed to read and search every folder (CAP_DAC_READ_SEARCH) but to write none of root's:
    # the environment's interpreter here lives under /root, which a cluster user's would not.
    caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *caps] if os.geteuid() == 0 else []
    return subprocess.run(
        [*user, "bash", str(REPO / "tools" / "setup.sh")], env=env, capture_output=True, text=True, timeout=300
    )


def this_venv() -> Path:
    if sys.prefix == sys.base_prefix:
        pytest.fail("the tests run in the virtual environment tools/setup.sh made")
    return Path(sys.prefix)


def test_login_node_uses_the_site_mpi_and_slurm_without_sudo(box):
    mpirun = shutil.which("mpirun")
    assert mpirun and shutil.which("mpicc") and shutil.which("sbatch"), "tools/setup.sh installs them here"
    result = run_setup(box, this_venv(), ["/usr/local/bin", "/usr/bin", "/bin"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert (box / "calls").read_text() == ""
    assert "system pieces: all present" in out
    assert "installed: nothing" in out
    assert f"from this machine: MPI: {mpirun}" in out
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout.split()[
        3
    ]  # "mpirun (Open MPI) 4.1.4"
    uses = next(line for line in out.splitlines() if "mpi4py uses: " in line)
    assert f"Open MPI v{version}" in uses, out


def test_missing_piece_is_named_and_the_python_side_goes_on(box):
    # /usr/bin without bubblewrap: the only sudo call allowed is the question whether it needs a password.
    usr_bin = box / "usr-bin"
    usr_bin.mkdir()
    for entry in os.scandir("/usr/bin"):
        if entry.name != "bwrap":
            (usr_bin / entry.name).symlink_to(entry.path)
    result = run_setup(box, this_venv(), [str(usr_bin)])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert (box / "calls").read_text() == "sudo -n true\n"
    assert "to do: bubblewrap (bwrap), the sandbox of reward.kind: code and of the python tool" in out
    assert "mpi4py uses: Open MPI" in out


def test_cpu_torch_missing_from_every_source_stops_before_any_torch(box):
    venv = box / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # pip's configuration cleared: PyPI only (the CUDA build), and the CPU index out of reach.
    result = run_setup(
        box,
        venv,
        ["/usr/local/bin", "/usr/bin", "/bin"],
        PIP_CONFIG_FILE="/dev/null",
        AREAL_TORCH_INDEX="http://127.0.0.1:9/whl/cpu",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "needs torch==2.13.0+cpu, the CPU build of torch" in out
    assert "PIP_FIND_LINKS=DIR" in out and "AREAL_TORCH_INDEX=URL" in out
    assert "Nothing was installed: no torch." in out
    assert (box / "calls").read_text() == ""
    assert not list((venv / "lib").glob("python3*/site-packages/torch"))
