"""The rank map: every rank has exactly one role, components cover the world in order, and each
GPU of a node belongs to one rank."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import ConfigError, load_config
from areal_hpc.layout import Layout, Role
from tests.conftest import TINY


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.integers(2, 40),
    gpus=st.sampled_from([1, 2, 4, 8]),
    rewards=st.integers(1, 8),
    gen_tp=st.sampled_from([1, 2, 4]),
    train_tp=st.sampled_from([1, 2, 4]),
    train_pp=st.sampled_from([1, 2]),
    share=st.floats(0.1, 0.9),
    device=st.sampled_from(["auto", "cuda", "cpu"]),
)
def test_layout_partitions_the_world(nodes, gpus, rewards, gen_tp, train_tp, train_pp, share, device):
    overrides = [
        f"cluster.nodes={nodes}",
        f"cluster.gpus_per_node={gpus}",
        f"cluster.device={device}",
        f"allocation.reward_workers={rewards}",
        f"allocation.gen_tp={gen_tp}",
        f"allocation.train_tp={train_tp}",
        f"allocation.train_pp={train_pp}",
        f"allocation.gen_share={share}",
        "model.num_attention_heads=8",
        "model.num_key_value_heads=4",
        "model.hidden_size=64",
    ]
    try:
        layout = Layout.from_config(load_config(TINY, overrides))
    except ConfigError:
        return  # a config that cannot fit is refused; the fitting ones must partition exactly
    roles = [layout.role_of(r) for r in range(layout.world_size)]
    assert roles[0] == Role.CONTROLLER
    assert roles == sorted(roles), "roles occupy contiguous rank ranges in the order of DESIGN.md"
    assert sum(len(layout.ranks(role)) for role in Role) == layout.world_size
    comps = layout.components
    assert [c.first_rank for c in comps] == [0, comps[0].ntasks, comps[0].ntasks + comps[1].ntasks]
    assert sum(c.ntasks for c in comps) == layout.world_size
    assert layout.gen_nodes + layout.train_nodes == nodes
    assert layout.train_dp * train_tp * train_pp == layout.trainers
    assert layout.uses_gpus == (device != "cpu")
    check_placement(layout)
    replicas = [layout.replica_ranks(d) for d in range(layout.train_dp)]
    assert sorted(r for rep in replicas for r in rep) == list(layout.ranks(Role.TRAINER)), "replicas partition"
    assert all(rep == sorted(rep) and len(rep) == train_tp * train_pp for rep in replicas)
    assert all(layout.replica_of(r) == d for d, rep in enumerate(replicas) for r in rep)
    assert {layout.stage_source_rank(s) for s in range(train_pp)} <= set(replicas[0]), "dp 0 sends the weights"


def test_replicas_in_megatrons_rank_order():
    """TP 2 x PP 2 x DP 2: trainer-local rank (pp * DP + dp) * TP + tp."""
    overrides = ["cluster.nodes=2", "cluster.gpus_per_node=8", "allocation.gen_nodes=1", "allocation.gen_tp=1"]
    layout = Layout.from_config(load_config(TINY, [*overrides, "allocation.train_tp=2", "allocation.train_pp=2"]))
    first = layout.ranks(Role.TRAINER).start
    assert layout.train_dp == 2
    assert [[r - first for r in layout.replica_ranks(d)] for d in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="replica 2 outside"):
        layout.replica_ranks(2)
    with pytest.raises(ValueError, match="not a trainer"):
        layout.replica_of(0)


def test_rank_outside_world():
    layout = Layout.from_config(load_config(TINY))
    with pytest.raises(ValueError, match="outside the world"):
        layout.role_of(layout.world_size)
    assert layout.describe_rank(2) == "generator 0 (world rank 2)"


def test_table_explains_the_choice():
    layout = Layout.from_config(load_config(TINY, ["cluster.nodes=8", "allocation.gen_nodes=null"]))
    table = layout.table()
    assert "gen_share 0.75 of 8 nodes = 6" in table
    assert layout.gen_nodes == 6


def check_placement(layout: Layout) -> None:
    """The placement invariants: ranks fill each component's nodes in order (srun's block
    distribution), within a node no two ranks share a GPU and every GPU is used, a generator holds
    gen_tp GPUs and a trainer one, a tensor-parallel group stays on one node; on one machine
    (`machine_gpus`) no two ranks share a GPU either."""
    places = [layout.placement(r) for r in range(layout.world_size)]
    g = layout.gpus_per_node if layout.uses_gpus else 0
    by_node = {}
    for p in places:
        by_node.setdefault((p.component, p.node), []).append(p)
    assert len({p.job_node for p in places}) == layout.nodes + 1
    for comp in layout.components:
        nodes = [by_node[(comp.name, n)] for n in range(comp.nodes)]
        assert [p.rank for node in nodes for p in node] == list(comp.ranks)  # block distribution
        for node in nodes:
            assert [p.slot for p in node] == list(range(comp.ntasks_per_node))
            assert len({p.job_node for p in node}) == 1
            gpus = [gpu for p in node for gpu in p.gpus]
            assert len(gpus) == len(set(gpus)), f"{comp.name}: a GPU is shared within a node"
            assert sorted(gpus) == (list(range(g)) if comp.name != "controller" else [])
    for p in places:
        want = {Role.GENERATOR: layout.gen_tp, Role.TRAINER: 1}.get(p.role, 0) if g else 0
        assert len(p.gpus) == want
    trainers = [places[r] for r in layout.ranks(Role.TRAINER)]
    if layout.train_tp <= layout.gpus_per_node:
        for i in range(0, len(trainers), layout.train_tp):
            assert len({p.node for p in trainers[i : i + layout.train_tp]}) == 1
    machine = [gpu for r in range(layout.world_size) for gpu in layout.machine_gpus(r)]
    assert sorted(machine) == list(range(layout.nodes * g))


@pytest.mark.parametrize(
    "config,nodes", [("qwen1.5b", 4), ("qwen7b", 8), ("qwen32b", 16), ("qwen32b", 32), ("tiny-cpu", 3)]
)
def test_shipped_configs_place_disjoint_gpus(config, nodes):
    layout = Layout.from_config(load_config(f"configs/{config}.yaml", [f"cluster.nodes={nodes}"]))
    check_placement(layout)


def test_placement_of_a_small_job():
    # controller + 1 reward | 1 node x 2 engines of TP 2 | 1 node x 4 trainers, 4 GPUs per node
    layout = Layout.from_config(
        load_config(TINY, ["cluster.device=cuda", "cluster.gpus_per_node=4", "allocation.gen_tp=2"])
    )
    rows = [(p.component, p.node, p.job_node, p.slot, p.gpus) for p in map(layout.placement, range(8))]
    assert rows == [
        ("controller", 0, 0, 0, ()),
        ("controller", 0, 0, 1, ()),
        ("generator", 0, 1, 0, (0, 1)),
        ("generator", 0, 1, 1, (2, 3)),
        *[("trainer", 0, 2, i, (i,)) for i in range(4)],
    ]
    assert [layout.machine_gpus(r) for r in range(8)] == [(), (), (0, 1), (2, 3), (4,), (5,), (6,), (7,)]
    assert layout.rank_table().splitlines()[4].split() == ["2", "generator", "generator", "0", "0,1"]
    cpu = Layout.from_config(load_config(TINY, ["cluster.device=cpu"]))
    assert all(not cpu.placement(r).gpus for r in range(cpu.world_size))
    assert [c.gpus_per_node for c in cpu.components] == [0, 0, 0]
