"""The rank map: every rank has exactly one role, components cover the world in order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import ConfigError, load_config
from areal_hpc.layout import Layout, Role
from tests.test_config import TINY


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.integers(2, 40),
    gpus=st.sampled_from([1, 2, 4, 8]),
    rewards=st.integers(1, 8),
    gen_tp=st.sampled_from([1, 2, 4]),
    train_tp=st.sampled_from([1, 2, 4]),
    train_pp=st.sampled_from([1, 2]),
    share=st.floats(0.1, 0.9),
)
def test_layout_partitions_the_world(nodes, gpus, rewards, gen_tp, train_tp, train_pp, share):
    overrides = [
        f"cluster.nodes={nodes}",
        f"cluster.gpus_per_node={gpus}",
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
