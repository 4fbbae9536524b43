"""areal-hpc installed from its wheel, not editable, as a user on a cluster installs it: the wheel built
from the repository holds `areal_hpc` as its only top-level package, every module of it and the sbatch
templates; installed into a folder of its own (tests.support.wheel), it runs from a folder outside the
checkout, with a config copied there, and imports nothing from the checkout.

- `submit --dry-run` and `render` of a shipped config print and write the script recorded in
  tests/snapshots/ (the one the editable install renders, tests/test_render.py), the work directory and
  interpreter being this folder and this venv's;
- `run`: tests/test_e2e.py::test_the_embedded_default_learns runs the embedded default from the install
  (one run, judged there), every rank's log naming the installed package.
"""

import subprocess
import zipfile
from pathlib import Path

import pytest

from areal_hpc.config import load_config
from tests.support.wheel import REPO

pytestmark = pytest.mark.slow

SNAPSHOTS = REPO / "tests" / "snapshots"
WORKDIR = "/work/areal-hpc"  # tests/test_render.py's fixed paths in the snapshots
PYTHON = "/work/areal-hpc/.venv/bin/python"


def test_the_wheel_holds_areal_hpc_alone_with_every_module_and_template(installed_wheel):
    names = installed_wheel.names
    top = {n.split("/")[0] for n in names}
    dist_info = [t for t in top if t.startswith("areal_hpc-") and t.endswith(".dist-info")]
    assert len(dist_info) == 1 and top == {"areal_hpc", *dist_info}, sorted(top)
    package = REPO / "areal_hpc"
    for pattern in ("*.py", "*.sbatch"):
        files = {p.relative_to(REPO).as_posix() for p in package.rglob(pattern) if "__pycache__" not in p.parts}
        assert files and files <= set(names), sorted(files - set(names))
    assert {"areal_hpc/launch/templates/hetjob.sbatch", "areal_hpc/launch/templates/eval_array.sbatch"} <= set(names)
    entry_points = f"{dist_info[0]}/entry_points.txt"
    assert entry_points in names
    assert "areal-hpc = areal_hpc.cli:main" in _read(installed_wheel.wheel, entry_points)


def test_the_install_imports_areal_hpc_from_its_own_folder(installed_wheel, tmp_path):
    where, _ = installed_wheel.imports(tmp_path)
    assert where == installed_wheel.package, f"areal_hpc imported from {where}, not from the install"
    assert not tmp_path.is_relative_to(REPO)
    assert installed_wheel.script.is_file()


@pytest.mark.parametrize("config", ["tiny-cpu", "qwen1.5b"])
def test_submit_dry_run_and_render_from_the_install_give_the_recorded_script(installed_wheel, tmp_path, config):
    user = tmp_path / "user"
    user.mkdir()
    (user / f"{config}.yaml").write_text((REPO / "configs" / f"{config}.yaml").read_text())  # a user copies configs
    cfg = load_config(user / f"{config}.yaml")
    where, python = installed_wheel.imports(user)
    assert where == installed_wheel.package
    args = [f"{config}.yaml", "--nodes", str(cfg.cluster.nodes)]
    # A GPU node's CPUs: tests/test_render.py reads 8 from its sinfo; no sinfo answers here.
    overrides = ["cluster.cpus_per_node=8"] if cfg.cluster.cpus_per_node == 0 else []
    env = installed_wheel.env(PATH=str(tmp_path / "no-slurm"))
    expected = (SNAPSHOTS / f"{config}.sbatch").read_text().replace(PYTHON, python).replace(WORKDIR, str(user))

    def areal_hpc(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(installed_wheel.script), *cmd], cwd=user, env=env, capture_output=True, text=True, timeout=120
        )

    dry = areal_hpc("submit", *args, "--dry-run", *overrides)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout == expected
    assert not (user / "runs").exists()

    rendered = areal_hpc("render", *args, "-o", "job.sbatch", *overrides)
    assert rendered.returncode == 0, rendered.stderr
    assert (user / "job.sbatch").read_text() == expected
    saved = load_config(user / cfg.run_dir / "config.yaml")  # the run root relative to this folder
    assert saved.cluster.nodes == cfg.cluster.nodes
    assert saved.cluster.cpus_per_node == (8 if overrides else cfg.cluster.cpus_per_node)
    assert sorted(p.name for p in user.iterdir()) == sorted([f"{config}.yaml", "job.sbatch", "runs"])


def _read(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name).decode()
