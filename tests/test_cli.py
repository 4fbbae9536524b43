"""The command line: every subcommand has real help, plan prints the split."""

import subprocess
import sys

import pytest

from tests.test_config import REPO

COMMANDS = ["run", "submit", "render", "status", "cancel", "plan"]


def areal(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "areal_hpc.cli", *args], capture_output=True, text=True, cwd=REPO, **kw
    )


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_is_real(cmd):
    r = areal(cmd, "--help")
    assert r.returncode == 0
    assert f"usage: areal-hpc {cmd}" in r.stdout
    assert len(r.stdout.split()) > 25  # says what the command does, not just its usage line


def test_top_level_help_lists_commands():
    r = areal("--help")
    for cmd in COMMANDS:
        assert cmd in r.stdout


def test_plan_prints_the_split():
    r = areal("plan", str(REPO / "configs" / "qwen32b.yaml"), "--nodes", "16")
    assert r.returncode == 0, r.stderr
    assert "16 + 1 CPU" in r.stdout and "TP 8 x PP 4" in r.stdout


def test_config_help_documents_fields():
    r = areal("--config-help")
    assert "max_staleness" in r.stdout and "synchronous RL" in r.stdout


def test_missing_config_file_is_a_config_error():
    r = areal("plan", "no/such.yaml")
    assert r.returncode == 2 and "config file not found" in r.stderr
