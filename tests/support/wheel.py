"""areal-hpc as a user installs it: a wheel built from the repository, installed (not editable) into a
folder of its own, and run from a folder outside the checkout with configs copied there.

    install_wheel   build the wheel of a copy of the repository's files and install it with
                    `pip install --target`; an `Installed`
    Installed       the wheel, its file list, the target folder, its console script, the environment
                    that runs it, and `imports`: where that environment imports areal_hpc from

The copy leaves out what git ignores (build/, *.egg-info, caches, runs): an in-place build would put
the leftovers of an earlier build (build/lib) into the wheel. The environment sets PYTHONPATH to the
target alone: the checkout (PYTHONPATH of the tests) must not be on the path, and the venv's editable
install of areal_hpc (a meta-path finder) comes after every path entry, so the target's package wins;
`imports` says which one did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IGNORED = (".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache")
IGNORED += (".hypothesis", ".slurm")
"""What a copy of the repository leaves out (.gitignore's patterns, and git's own folder)."""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    names: list[str]
    """The wheel's file list."""
    site: Path
    """The `pip install --target` folder."""

    @property
    def script(self) -> Path:
        """The `areal-hpc` console script pip wrote."""
        return self.site / "bin" / "areal-hpc"

    @property
    def package(self) -> Path:
        return self.site / "areal_hpc"

    def env(self, **extra: str) -> dict[str, str]:
        """This environment with PYTHONPATH the target alone (the checkout not on it)."""
        return {**os.environ, "PYTHONPATH": str(self.site), **extra}

    def imports(self, cwd: Path) -> tuple[Path, str]:
        """(the folder areal_hpc is imported from, the interpreter's sys.executable) in `env()` from `cwd`:
        what the console script finds (pip wrote it for this interpreter)."""
        probe = "import sys, areal_hpc; print(areal_hpc.__file__); print(sys.executable)"
        out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=self.env(), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        init, executable = out.stdout.split()
        return Path(init).parent, executable


def install_wheel(work: Path) -> Installed:
    """The wheel of the repository's files, built without build isolation or downloads (setuptools and
    wheel of this environment), installed without its dependencies into `work`/site."""
    src, dist, site = work / "src", work / "dist", work / "site"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*IGNORED))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run(
        [*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout}\n{built.stderr}"
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, f"pip wheel wrote {wheels}"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, f"pip install --target failed:\n{installed.stdout}\n{installed.stderr}"
    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
    return Installed(wheels[0], names, site)
