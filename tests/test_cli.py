"""The command line: every subcommand has real help, plan prints the split, a bad workflow stops a launch."""

import os
import subprocess
import sys
import textwrap

import pytest

from areal_hpc.config import load_config
from tests.support.helpers import REPO

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


BAD_WORKFLOWS = {
    "no_such_agents.math:Agent": "rollout.workflow: no module named 'no_such_agents'",
    "areal_hpc.workflow.tools:calculator": (
        "rollout.workflow: areal_hpc.workflow.tools:calculator is a function, not a subclass of "
        "areal_hpc.workflow.Workflow"
    ),
}


@pytest.mark.parametrize("workflow", BAD_WORKFLOWS)
@pytest.mark.parametrize("launch", ["run", "submit", "render"])
def test_a_bad_workflow_stops_a_launch_before_anything_starts(launch, workflow, tmp_path):
    slurm = ["--nodes", "2", "cluster.cpus_per_node=4"]
    extra = {"run": [], "submit": slurm, "render": [*slurm, "-o", str(tmp_path / "job.sbatch")]}[launch]
    # No Slurm on the PATH: were the check missing, submit would fail later, never submit a job.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    args = [*extra, f"experiment.root={tmp_path / 'runs'}", f"rollout.workflow={workflow}"]
    r = areal(launch, "configs/tiny-cpu.yaml", *args, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"areal-hpc: config error: {BAD_WORKFLOWS[workflow]}" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no script


def test_a_workflow_file_is_checked_and_passes(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(
            """
            from areal_hpc.workflow import Workflow

            class Agent(Workflow):
                async def arun_episode(self, client, row):
                    return None
            """
        )
    )
    args = ["--nodes", "2", "--dry-run", "cluster.cpus_per_node=4", f"experiment.root={tmp_path / 'runs'}"]
    r = areal("submit", "configs/tiny-cpu.yaml", *args, f"rollout.workflow={agent}:Agent")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash")
    r = areal("submit", "configs/tiny-cpu.yaml", *args, f"rollout.workflow={agent}:Agnet")
    assert r.returncode == 2 and f"{agent} has no attribute 'Agnet' (its Workflow subclasses: Agent)" in r.stderr
