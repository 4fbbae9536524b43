"""The pieces of the rank entry point and the local launcher that need no running world: core
pinning, the MPMD command line, naming a dead rank from mpirun's report."""

import os

from areal_hpc.config import load_config
from areal_hpc.layout import Layout
from areal_hpc.main import core_plan
from launch.local import _annotate, _dead_rank, mpirun_command


def layout(*overrides):
    return Layout.from_config(load_config("configs/tiny-cpu.yaml", list(overrides)))


def test_generator_and_trainer_get_disjoint_cores_controller_and_reward_float():
    lay = layout()  # ranks: controller 0, reward 1, generator 2, trainer 3
    assert core_plan(lay, [0, 1]) == {2: ([0], 1), 3: ([1], 1)}
    plan = core_plan(lay, list(range(8)))
    assert plan == {2: ([0, 1, 2, 3], 4), 3: ([4, 5, 6, 7], 4)}
    assert 0 not in plan and 1 not in plan
    # fewer cores than generator + trainer ranks: each runs anywhere, with one thread
    assert core_plan(lay, [0]) == {2: ([0], 1), 3: ([0], 1)}


def test_mpirun_command_is_one_mpmd_launch_in_world_rank_order(tmp_path):
    lay = layout("cluster.nodes=3", "allocation.gen_nodes=1", "allocation.reward_workers=2")
    cmd = mpirun_command(lay, tmp_path, python="py")
    contexts = " ".join(cmd).split(" : ")
    assert len(contexts) == 4
    counts = [int(c.split("-n ")[1].split()[0]) for c in contexts]
    assert counts == [1, 2, 1, 2] and sum(counts) == lay.world_size
    assert all(c.endswith(f"py -u -m areal_hpc.main {tmp_path}") for c in contexts)
    assert "--oversubscribe" in cmd and ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)


def test_a_dead_rank_is_named_by_its_role():
    lay = layout()
    killed = "mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 (Killed).\n"
    assert _dead_rank(killed, None) == 2
    assert _annotate(killed, lay).rstrip().endswith("generator 0 (world rank 2)")
    exited = "  Process name: [[11012,1],3]\n"
    assert _dead_rank(exited, None) == 3
    assert "trainer 0 (world rank 3)" in _annotate(exited, lay)
    assert _dead_rank("nothing to see\n", None) is None
    assert _dead_rank(exited, 2) == 2  # the first report wins
