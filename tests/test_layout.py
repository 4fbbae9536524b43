"""The rank map: every rank has exactly one role, components cover the world in order, each GPU of a
node belongs to one rank (a node may hold generators and trainers), a split of any GPU count, the trainers' TP x PP x DP grid is Megatron's order, the weight-sync groups'
ranks are distinct, and on one machine generator and trainer ranks get disjoint cores."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import ConfigError, load_config
from areal_hpc.layout import FEW_GPU_NODES, Layout, Role
from areal_hpc.parallel import TrainerCoords, TrainerGrid
from areal_hpc.planner import resolve_split
from tests.support.helpers import TINY


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    nodes=st.integers(1, 40),
    gpus=st.sampled_from([1, 2, 4, 8]),
    rewards=st.integers(1, 8),
    reward_nodes=st.sampled_from(["auto", 0, 1, 2]),
    gen_tp=st.sampled_from([1, 2, 4]),
    train_tp=st.sampled_from([1, 2, 4]),
    train_pp=st.sampled_from([1, 2]),
    share=st.floats(0.1, 0.9),
    device=st.sampled_from(["auto", "cuda", "cpu"]),
)
def test_layout_partitions_the_world(nodes, gpus, rewards, reward_nodes, gen_tp, train_tp, train_pp, share, device):
    overrides = [
        f"cluster.nodes={nodes}",
        f"cluster.gpus_per_node={gpus}",
        f"cluster.device={device}",
        f"allocation.reward_workers={rewards}",
        f"allocation.gen_tp={gen_tp}",
        f"allocation.train_tp={train_tp}",
        f"allocation.train_pp={train_pp}",
        f"allocation.gen_share={share}",
        f"allocation.reward_nodes={reward_nodes}",
        "allocation.gen_gpus=null",
        "model.num_attention_heads=8",
        "model.num_key_value_heads=4",
        "model.hidden_size=64",
    ]
    try:
        layout = Layout.from_config(resolve_split(load_config(TINY, overrides))[0])
    except ConfigError:
        return  # a config that cannot fit is refused; the fitting ones must partition exactly
    roles = [layout.role_of(r) for r in range(layout.world_size)]
    assert roles[0] == Role.CONTROLLER
    assert roles == sorted(roles), "roles occupy contiguous rank ranges in the order of docs/design.md"
    assert sum(len(layout.ranks(role)) for role in Role) == layout.world_size
    comps = layout.components
    assert (comps[0].name == "controller") == bool(layout.reward_nodes)
    assert [c.first_rank for c in comps] == [sum(c.ntasks for c in comps[:i]) for i in range(len(comps))]
    assert sum(c.ntasks for c in comps) == layout.world_size and len({c.name for c in comps}) == len(comps)
    assert sum(c.nodes for c in comps) == nodes + layout.reward_nodes
    assert layout.gen_gpus + layout.trainers == nodes * gpus and layout.gen_gpus == layout.generators * gen_tp
    assert layout.train_dp * train_tp * train_pp == layout.trainers
    assert layout.uses_gpus == (device != "cpu")
    check_placement(layout)
    check_trainer_ranks(layout)
    replicas = [layout.replica_ranks(d) for d in range(layout.train_dp)]
    assert sorted(r for rep in replicas for r in rep) == list(layout.ranks(Role.TRAINER)), "replicas partition"
    assert all(rep == sorted(rep) and len(rep) == train_tp * train_pp for rep in replicas)
    assert all(layout.replica_of(r) == d for d, rep in enumerate(replicas) for r in rep)
    assert {layout.stage_source_rank(s) for s in range(train_pp)} <= set(replicas[0]), "dp 0 sends the weights"


def test_replicas_in_megatrons_rank_order():
    """TP 2 x PP 2 x DP 2: trainer-local rank (pp * DP + dp) * TP + tp."""
    overrides = ["cluster.nodes=2", "cluster.gpus_per_node=8", "allocation.gen_gpus=8", "allocation.gen_tp=1"]
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
    cfg, why = resolve_split(load_config(TINY, ["cluster.nodes=8", "allocation.gen_gpus=null"]))
    layout = Layout.from_config(cfg)
    table = layout.table(why)
    assert "gen_share 0.75 of 8 GPUs = 6" in table and "generation gets 6 of 8 GPUs (75%) on 8 node(s) of 1" in table
    assert layout.gen_gpus == 6
    # one node of 4 GPUs, 3/4 generating: the engines and the trainer share the node, the controller on it too
    cfg, why = resolve_split(
        load_config(TINY, ["cluster.nodes=1", "cluster.gpus_per_node=4", "allocation.gen_gpus=null"])
    )
    lines = Layout.from_config(cfg).table(why).splitlines()
    assert lines[2].split()[:4] == ["controller", "on", "node", "0"]
    assert lines[3].split()[:4] == ["generator", "0", "3", "3"] and lines[4].split()[:4] == ["trainer", "0", "1", "1"]
    assert lines[5].split()[:3] == ["total", "1", "4"]


def test_summary_names_the_split_in_one_line():
    layout = Layout.from_config(
        load_config(TINY, ["cluster.nodes=5", "allocation.gen_gpus=1", "allocation.train_pp=2"])
    )
    assert layout.summary() == "5 node(s) x 1 GPUs: 1 generator(s) at TP 1, 4 trainer rank(s) at TP 1 x PP 2 x DP 2"


def check_placement(layout: Layout) -> None:
    """The placement invariants: ranks fill each component's nodes in order, as many on each (srun's block
    distribution; the controller's CPU nodes may hold one fewer on the last), within a node no two ranks
    share a GPU and every GPU is used, a generator holds gen_tp GPUs and a trainer one, the
    generators hold the job's first gen_gpus GPUs, a tensor-parallel group stays on one node; on one machine
    (`machine_gpus`) no two ranks share a GPU either."""
    places = [layout.placement(r) for r in range(layout.world_size)]
    g = layout.gpus_per_node if layout.uses_gpus else 0
    by_node = {}
    for p in places:
        by_node.setdefault((p.component, p.node), []).append(p)
    assert len({p.job_node for p in places}) == layout.nodes + layout.reward_nodes
    for comp in layout.components:
        nodes = [by_node[(comp.name, n)] for n in range(comp.nodes)]
        assert [p.rank for node in nodes for p in node] == list(comp.ranks)  # block distribution
        for node in nodes:
            if comp.name != "controller":
                assert len(node) == comp.ntasks_per_node
            assert [p.slot for p in node] == list(range(len(node)))
            assert len({p.job_node for p in node}) == 1
            gpus = [gpu for p in node for gpu in p.gpus]
            assert len(gpus) == len(set(gpus)), f"{comp.name}: a GPU is shared within a node"
            assert sorted(gpus) == (list(range(g)) if comp.name != "controller" else [])
    for p in places:
        want = {Role.GENERATOR: layout.gen_tp, Role.TRAINER: 1}.get(p.role, 0) if g else 0
        assert len(p.gpus) == want
    if g:
        generator_gpus = [
            (p.job_node - layout.reward_nodes) * g + i for p in places if p.role == Role.GENERATOR for i in p.gpus
        ]
        assert generator_gpus == list(range(layout.gen_gpus))
    trainers = [places[r] for r in layout.ranks(Role.TRAINER)]
    if layout.gpus_per_node % layout.train_tp == 0:
        for i in range(0, len(trainers), layout.train_tp):
            assert len({p.job_node for p in trainers[i : i + layout.train_tp]}) == 1
    machine = [gpu for r in range(layout.world_size) for gpu in layout.machine_gpus(r)]
    assert sorted(machine) == list(range(layout.nodes * g))


@pytest.mark.parametrize(
    "config,nodes", [("qwen1.5b", 1), ("qwen1.5b", 4), ("qwen7b", 8), ("qwen32b", 16), ("qwen32b", 32), ("tiny-cpu", 3)]
)
def test_shipped_configs_place_disjoint_gpus(config, nodes):
    cfg, _ = resolve_split(load_config(f"configs/{config}.yaml", [f"cluster.nodes={nodes}"]))
    check_placement(Layout.from_config(cfg))


def test_placement_of_a_small_job():
    # one node of 4 GPUs: controller + 1 reward, 1 engine of TP 2 on GPUs 0-1, 2 trainers on GPUs 2-3
    layout = Layout.from_config(
        load_config(
            TINY,
            [
                "cluster.nodes=1",
                "cluster.device=cuda",
                "cluster.gpus_per_node=4",
                "allocation.gen_tp=2",
                "allocation.gen_gpus=2",
            ],
        )
    )
    rows = [(p.component, p.node, p.job_node, p.slot, p.gpus) for p in map(layout.placement, range(5))]
    assert rows == [
        ("shared", 0, 0, 0, ()),
        ("shared", 0, 0, 1, ()),
        ("shared", 0, 0, 2, (0, 1)),
        ("shared", 0, 0, 3, (2,)),
        ("shared", 0, 0, 4, (3,)),
    ]
    [comp] = layout.components
    assert (comp.name, comp.nodes, comp.ntasks, comp.roles) == ("shared", 1, 5, tuple(Role))
    assert [layout.machine_gpus(r) for r in range(5)] == [(), (), (0, 1), (2,), (3,)]
    assert layout.rank_table().splitlines()[4].split() == ["2", "generator", "shared", "0", "0,1"]
    # 2 nodes of 4 GPUs and a CPU node: 3 engines of TP 2 (node 0, then GPUs 0-1 of node 1), 2 trainers after them
    two = Layout.from_config(
        load_config(TINY, ["cluster.nodes=2", "cluster.device=cuda", "cluster.gpus_per_node=4", "allocation.gen_tp=2",
                           "allocation.gen_gpus=6", "allocation.reward_nodes=1"])
    )  # fmt: skip
    rows = [(p.component, p.node, p.job_node, p.slot, p.gpus) for p in map(two.placement, range(two.world_size))]
    assert rows == [
        ("controller", 0, 0, 0, ()),
        ("controller", 0, 0, 1, ()),
        ("generator", 0, 1, 0, (0, 1)),
        ("generator", 0, 1, 1, (2, 3)),
        ("shared", 0, 2, 0, (0, 1)),
        ("shared", 0, 2, 1, (2,)),
        ("shared", 0, 2, 2, (3,)),
    ]
    assert [(c.name, c.nodes, c.ntasks_per_node) for c in two.components] == [
        ("controller", 1, 2), ("generator", 1, 2), ("shared", 1, 3)
    ]  # fmt: skip
    assert [two.machine_gpus(r) for r in range(2, 7)] == [(0, 1), (2, 3), (4, 5), (6,), (7,)]
    spans = {line.split()[0]: line.split()[1] for line in two.table().splitlines()[2:5]}
    assert spans == {"controller": "1", "generator": "0-1", "trainer": "1"}  # GPU nodes
    cpu = Layout.from_config(load_config(TINY, ["cluster.device=cpu"]))
    assert all(not cpu.placement(r).gpus for r in range(cpu.world_size))
    assert [c.gpus_per_node for c in cpu.components] == [0, 0]  # node 0: controller, reward, generator; node 1


def test_reward_nodes_auto_is_none_on_few_gpu_nodes():
    def cpu_nodes(*overrides):
        return Layout.from_config(resolve_split(load_config(TINY, list(overrides)))[0]).reward_nodes

    assert cpu_nodes("cluster.nodes=1", "cluster.gpus_per_node=2") == 0
    assert cpu_nodes(f"cluster.nodes={FEW_GPU_NODES}") == 0
    assert cpu_nodes(f"cluster.nodes={FEW_GPU_NODES + 1}") == 1
    assert cpu_nodes("cluster.nodes=8", "allocation.reward_nodes=0") == 0
    assert cpu_nodes("cluster.nodes=2", "allocation.reward_nodes=1") == 1


def check_trainer_ranks(layout: Layout) -> None:
    """Every trainer world rank has distinct (tp, pp, dp) coordinates; each data-parallel replica holds
    TP x PP ranks (each of which gets that replica's batch); each stage's source is its (tp 0, dp 0) rank;
    a generator's engine workers take distinct weight-sync group ranks 1 .. size - 1."""
    trainers = layout.ranks(Role.TRAINER)
    coords = [layout.trainer_coords(r) for r in trainers]
    assert len(set(coords)) == len(coords) == layout.train_tp * layout.train_pp * layout.train_dp
    for dp in range(layout.train_dp):
        assert sum(c.dp == dp for c in coords) == layout.train_tp * layout.train_pp
    for stage in range(layout.train_pp):
        assert layout.trainer_coords(layout.stage_source_rank(stage)) == (0, stage, 0)
    members = [m for g in layout.ranks(Role.GENERATOR) for m in layout.weight_sync_ranks(g)]
    assert sorted(members) == list(range(1, layout.weight_sync_size))
    assert all(len(layout.weight_sync_ranks(g)) == layout.gen_tp for g in layout.ranks(Role.GENERATOR))


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(1, 8), pp=st.integers(1, 8), dp=st.integers(1, 8))
def test_trainer_grid_is_megatrons_order(tp, pp, dp):
    grid = TrainerGrid.of(tp * pp * dp, tp, pp)
    assert (grid.tp, grid.pp, grid.dp, grid.size) == (tp, pp, dp, tp * pp * dp)
    coords = [grid.coords(r) for r in range(grid.size)]
    for r, c in enumerate(coords):
        assert r == c.tp + tp * (c.dp + dp * c.pp)  # Megatron's default order: tp fastest, then dp, then pp
        assert grid.rank(*c) == r
    # a tensor-parallel group is tp consecutive ranks, a pipeline stage tp * dp consecutive ones
    for r in range(0, grid.size, tp):
        assert len({(c.pp, c.dp) for c in coords[r : r + tp]}) == 1
    for stage in range(pp):
        assert {c.pp for c in coords[stage * tp * dp : (stage + 1) * tp * dp]} == {stage}
        assert coords[grid.stage_source(stage)] == (0, stage, 0)


def test_trainer_grid_by_hand_and_its_errors():
    grid = TrainerGrid.of(8, 2, 2)  # TP 2 x PP 2 x DP 2
    assert [tuple(grid.coords(r)) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1),  # stage 0: replica 0, then replica 1
        (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1),  # stage 1
    ]  # fmt: skip
    assert [grid.stage_source(s) for s in range(2)] == [0, 4]
    with pytest.raises(ValueError, match="must divide the trainer ranks"):
        TrainerGrid.of(6, 4, 1)
    with pytest.raises(ValueError, match="outside"):
        grid.coords(8)
    with pytest.raises(ValueError, match="outside"):
        grid.rank(0, 2, 0)
    with pytest.raises(ValueError, match="stage 2"):
        grid.stage_source(2)
    # world ranks: controller, reward, 4 engines of TP 2, then 8 trainers (ranks 6..13)
    layout = Layout.from_config(
        load_config(
            TINY,
            ["cluster.gpus_per_node=8", "allocation.gen_gpus=8", "allocation.gen_tp=2", "allocation.train_tp=2"]
            + ["allocation.train_pp=2"]
            + ["model.num_attention_heads=8", "model.num_key_value_heads=4", "model.hidden_size=64"],
        )
    )
    first = layout.ranks(Role.TRAINER).start
    assert layout.trainer_coords(first + 6) == TrainerCoords(tp=0, pp=1, dp=1)
    assert layout.stage_source_rank(1) == first + grid.stage_source(1)
    gens = layout.ranks(Role.GENERATOR)
    assert [layout.weight_sync_ranks(g) for g in gens][:2] == [(1, 2), (3, 4)]
    assert layout.weight_sync_size == 1 + 2 * len(gens)
    with pytest.raises(ValueError, match="generator 0 .* is not a trainer"):
        layout.trainer_coords(gens.start)
    with pytest.raises(ValueError, match="is not a generator"):
        layout.weight_sync_ranks(first)


def test_generator_and_trainer_get_disjoint_cores_controller_and_reward_float():
    lay = Layout.from_config(load_config(TINY))  # ranks: controller 0, reward 1, generator 2, trainer 3
    assert lay.core_plan([0, 1]) == {2: ([0], 1), 3: ([1], 1)}
    plan = lay.core_plan(list(range(8)))
    assert plan == {2: ([0, 1, 2, 3], 4), 3: ([4, 5, 6, 7], 4)}
    assert 0 not in plan and 1 not in plan
    # fewer cores than generator + trainer ranks: each runs anywhere, with one thread
    assert lay.core_plan([0]) == {2: ([0], 1), 3: ([0], 1)}


@functools.cache
def _tiny_layout(nodes: int, gpus: int) -> Layout:
    return Layout.from_config(load_config(TINY, [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}"]))


@settings(max_examples=100, deadline=None)
@given(nodes=st.integers(2, 6), gpus=st.sampled_from([1, 2, 4]), cores=st.integers(1, 64))
def test_core_plan_shares_are_disjoint_and_equal(nodes, gpus, cores):
    lay = _tiny_layout(nodes, gpus)
    plan = lay.core_plan(list(range(cores)))
    assert set(plan) == {*lay.ranks(Role.GENERATOR), *lay.ranks(Role.TRAINER)}
    if cores < len(plan):
        assert all(p == (list(range(cores)), 1) for p in plan.values())
        return
    taken = [c for p in plan.values() for c in p.cores]
    assert len(taken) == len(set(taken)) and set(taken) <= set(range(cores))
    assert {(len(p.cores), p.threads) for p in plan.values()} == {(cores // len(plan),) * 2}
