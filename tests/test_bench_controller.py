"""tools/bench_controller.py in CI size: the real Controller on rank 0 of a small MPI world of simulated
generator, reward and trainer ranks, and the checks the benchmark makes on what the trainers got.

What must hold: every trajectory the generator sent for a trained prompt is trained exactly once, in one
step with the rest of its group, `prompts_per_step` prompts a step; no trained token is more than
`max_staleness` versions old (set to 1 here, so the gate and the drop of stale groups are what keep
it); rank 0's bytes per step are counted, a replica's batch sent once and relayed by its first rank; the last line is `controller headroom: X.Xx`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import numpy as np
import pytest

from areal_hpc.protocol import TrainBatch
from tools import bench_controller_sim as sim

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "bench_controller.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_controller", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_controller"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


# --- the checks themselves can fail ------------------------------------------------------------------


def test_check_trained_accepts_each_trajectory_once_per_step():
    generated = {0: [5, 7], 1: [3, 3], 2: [9, 1]}  # prompt 2 generated, never trained: fine
    trained = [(0, 0, 7), (0, 0, 5), (1, 1, 3), (1, 1, 3)]
    assert bench.check_trained(generated, trained, steps=2, prompts_per_step=1, group=2) == []


@pytest.mark.parametrize(
    "trained",
    [
        [(0, 0, 7), (0, 0, 5), (1, 0, 7), (1, 0, 5)],  # prompt 0 trained twice
        [(0, 0, 7), (0, 0, 5), (1, 1, 3)],  # a trajectory of prompt 1 lost
        [(0, 0, 7), (0, 0, 5), (1, 1, 3), (2, 1, 3)],  # a group split over two steps
        [(0, 0, 7), (0, 0, 7), (1, 1, 3), (1, 1, 3)],  # one trajectory of prompt 0 twice, the other never
    ],
)
def test_check_trained_finds_a_wrong_batch(trained):
    generated = {0: [5, 7], 1: [3, 3]}
    assert bench.check_trained(generated, trained, steps=2, prompts_per_step=1, group=2)


def _batch(version: int, response_versions: list[int]) -> TrainBatch:
    """One sequence: prompt 0's ids (version -1, not trained), then a response whose tokens carry
    `response_versions`."""
    n_prompt, n = sim.DIGITS, sim.DIGITS + len(response_versions)
    zeros = np.zeros(n, np.float32)
    tokens = np.full(n, sim.FIRST_ID, np.int32)
    cu_seqlens = np.asarray([0, n], np.int32)
    mask = np.asarray([0] * n_prompt + [1] * len(response_versions), np.uint8)
    versions = np.asarray([-1] * n_prompt + response_versions, np.int32)
    return TrainBatch(version, tokens, cu_seqlens, mask, zeros, zeros, versions)


def test_staleness_check_sees_a_token_too_old():
    errors = []
    assert sim._check_batch(_batch(5, [3, 4]), eta=2, errors=errors) == [(5, 0, 2)]
    assert errors == []  # the prompt's version -1 is not trained: not stale
    sim._check_batch(_batch(5, [3, 4]), eta=1, errors=errors)
    assert len(errors) == 1 and "version 3" in errors[0]


# --- the benchmark on a small world ------------------------------------------------------------------

PROMPTS, GROUP, WARMUP, STEPS = 8, 4, 1, 3


@pytest.mark.mpi
def test_bench_controller_small_world(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(TOOL), "--nodes", "4", "--prompts", str(PROMPTS), "--group", str(GROUP)]
    cmd += ["--mean-tokens", "300"]
    cmd += ["--warmup", str(WARMUP), "--steps", str(STEPS), "--save-every", "2", "--json", str(out), "--tp-pp", "2"]
    cmd += ["rollout.max_staleness=1"]
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp", "TMPDIR": str(tmp_path)}  # its work dir too
    # Its own session: a hung world is killed whole (mpirun and its ranks), not left polling.
    proc = subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the benchmark world hung:\n" + stdout[-3000:] + stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

    r = json.loads(out.read_text())
    assert r["errors"] == []
    assert r["setting"]["max_staleness"] == 1
    assert r["trained_trajectories"] == (WARMUP + STEPS) * PROMPTS * GROUP
    for kind in ("GenerateRequest", "RewardRequest", "TrainBatch"):
        assert r["bytes_per_step"][kind] > 0, kind
    # A step's batches carry at least every trained response token as int32 ids.
    assert r["bytes_per_step"]["TrainBatch"] >= 4 * r["tokens_per_step"] > 0
    # Rank 0 sends each replica's batch once, to its first rank, which passes it on to the other (--tp-pp 2).
    assert r["trainbatch_sends_per_step"] == r["setting"]["train_dp"]
    assert r["relayed_bytes_per_step"] == pytest.approx(r["bytes_per_step"]["TrainBatch"])
    assert r["cpu_s_per_step"] > 0 and r["tokens_s_cpu"] > 0
    per = r["cpu_us_per_trajectory"]  # its parts add up to rank 0's CPU per trajectory
    assert {"receive (Mailbox.poll)", "handle Trajectory", "admit", "train"} <= per.keys() and min(per.values()) >= 0
    assert sum(per.values()) == pytest.approx(1e6 / r["trajectories_s_cpu"])

    last = stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"controller headroom: ([0-9][0-9,]*\.[0-9])x", last)
    assert m, last
    assert float(m.group(1).replace(",", "")) == pytest.approx(r["headroom"], abs=0.06)
    assert r["headroom"] == pytest.approx(r["tokens_s_cpu"] / r["setting"]["cluster_tokens_s"])
