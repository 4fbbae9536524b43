"""The command line: every subcommand has real help, plan prints the split."""

import subprocess
import sys

import pytest

from areal_hpc.config import load_config
from tests.helpers import REPO

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
    a = load_config(REPO / "configs" / "qwen32b.yaml").allocation
    assert "16 + 1 CPU" in r.stdout and f"TP {a.train_tp} x PP {a.train_pp}" in r.stdout


def test_config_help_documents_fields():
    r = areal("--config-help")
    assert "max_staleness" in r.stdout and "synchronous RL" in r.stdout


def test_missing_config_file_is_a_config_error():
    r = areal("plan", "no/such.yaml")
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_plan_ranks_gives_each_gpu_of_a_node_to_one_rank():
    r = areal("plan", str(REPO / "configs" / "qwen32b.yaml"), "--nodes", "16", "--ranks")
    assert r.returncode == 0, r.stderr
    header, rule, *rows = r.stdout.splitlines()
    assert header.split() == ["rank", "role", "component", "node", "gpus"]
    rows = [row.split() for row in rows]
    assert [int(row[0]) for row in rows] == list(range(len(rows)))
    held = {}  # (component, node) -> GPUs held by its ranks
    for _, role, component, node, gpus in rows:
        if role in ("controller", "reward"):
            assert (component, gpus) == ("controller", "-")
            continue
        held.setdefault((component, node), []).extend(int(g) for g in gpus.split(","))
    assert len(held) == 16  # every accelerator node
    for gpus in held.values():
        assert sorted(gpus) == list(range(8))  # each GPU of the node once
    gen_tp = load_config(REPO / "configs" / "qwen32b.yaml").allocation.gen_tp
    generators = [row for row in rows if row[1] == "generator"]
    assert all(len(row[4].split(",")) == gen_tp for row in generators)
