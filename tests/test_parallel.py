"""Which parallel sizes a model and a cluster allow (areal_hpc.parallel): one set of rules that config
validation, the planner's search and the trainer's engine share."""

import pytest

from areal_hpc import parallel
from areal_hpc.arch import model_arch
from areal_hpc.config import ConfigError, load_config, validate
from areal_hpc.parallel import TrainerGrid
from areal_hpc.planner import candidates, resolve_split, with_plan
from tests.support.helpers import REPO, TINY


@pytest.mark.parametrize("name, nodes", [("qwen1.5b", 4), ("qwen32b", 6)])
def test_every_plan_the_search_considers_is_a_config_that_validates(name, nodes):
    cfg, _ = resolve_split(load_config(REPO / "configs" / f"{name}.yaml", [f"cluster.nodes={nodes}"]))
    plans = list(candidates(cfg))
    assert len(plans) > 10
    for plan in plans:
        validate(with_plan(cfg, plan))  # the search's plans break no rule of the config's


def test_a_size_that_splits_the_heads_but_not_the_mlp_is_refused_everywhere():
    shape = ["model.num_attention_heads=8", "model.num_key_value_heads=4", "model.intermediate_size=510"]
    four = ["cluster.gpus_per_node=4", *shape]
    with pytest.raises(ConfigError, match=r"allocation.train_tp \(4\) must divide model.intermediate_size \(510\)"):
        load_config(TINY, [*four, "allocation.train_tp=4"])
    cfg = load_config(TINY, four)
    assert {p.train_tp for p in candidates(cfg)} == {1, 2}, "the search never considers train_tp 4"
    with pytest.raises(ConfigError, match="intermediate_size"):
        parallel.check_trainer(model_arch(cfg.model), 4, 1)
    assert parallel.gen_tp_problem(model_arch(cfg.model), 4, 4) is None  # vLLM splits heads, not the MLP


def test_the_split_rules():
    assert "(1 x 1) is 1 GPU: this system needs one GPU to generate and one to train" in parallel.gpus_problem(1, 1)
    assert parallel.gpus_problem(1, 2) is None and parallel.gpus_problem(2, 1) is None
    assert parallel.split_problem(4, 8, 32, 1, 1, 1).startswith("allocation.gen_gpus (32) must leave each role a GPU")
    assert parallel.split_problem(1, 8, 0, 1, 1, 1).startswith("allocation.gen_gpus (0) must leave each role a GPU")
    assert "(3 x 1 = 3) must divide the trainer GPUs (4 x 8 - 16 = 16)" in parallel.split_problem(4, 8, 16, 1, 3, 1)
    assert "multiple of allocation.gen_tp (2): whole vLLM engines" in parallel.split_problem(1, 8, 3, 2, 1, 1)
    # a TP group within a node: the trainer's GPUs start at a multiple of train_tp (or of the node at train_tp 16)
    assert "multiple of allocation.train_tp (4)" in parallel.split_problem(2, 8, 6, 2, 4, 1)
    assert "multiple of cluster.gpus_per_node (8)" in parallel.split_problem(4, 8, 4, 1, 16, 1)
    assert parallel.split_problem(4, 8, 16, 1, 16, 1) is None
    assert parallel.split_problem(1, 8, 4, 2, 4, 1) is None and parallel.split_problem(4, 8, 16, 1, 4, 2) is None


def test_the_expert_parallel_rules_name_the_field():
    moe = ["model.architecture=qwen3_moe", "model.num_experts=6"]
    with pytest.raises(ConfigError, match=r"allocation.train_ep \(4\) must divide model.num_experts \(6\)"):
        load_config(TINY, [*moe, "allocation.train_ep=4"])
    # 4 nodes x 2 GPUs, 4 generator GPUs: 4 trainer GPUs at tp 2, so data-parallel size 2
    split = ["cluster.nodes=4", "cluster.gpus_per_node=2", "allocation.gen_gpus=4", "allocation.train_tp=2"]
    with pytest.raises(
        ConfigError, match=r"allocation.train_ep \(3\) must divide the trainer's data-parallel size \(2\)"
    ):
        load_config(TINY, [*moe, *split, "allocation.train_ep=3"])
    cfg = load_config(TINY, [*moe, *split, "allocation.train_ep=2"])
    assert cfg.allocation.train_ep == 2
    with pytest.raises(ConfigError, match=r"allocation.train_ep \(2\) applies to mixture-of-experts models only"):
        load_config(TINY, ["allocation.train_ep=2"])
    with pytest.raises(ConfigError, match="ppo.routing_replay applies to mixture-of-experts models only"):
        load_config(TINY, ["ppo.routing_replay=true"])
    with pytest.raises(ConfigError, match=r"model.num_experts apply to model.architecture qwen3_moe only"):
        load_config(TINY, ["model.num_experts=4"])
    with pytest.raises(
        ConfigError, match=r"model.num_experts_per_tok \(5\) must be between 1 and model.num_experts \(4\)"
    ):
        load_config(TINY, ["model.architecture=qwen3_moe", "model.num_experts_per_tok=5"])


def test_the_expert_grid_follows_megatrons_order():
    grid = TrainerGrid.of(8, 2, 1, ep=4)
    assert [grid.expert_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [grid.expert_source(0, e) for e in range(4)] == [0, 1, 2, 3]
    grid = TrainerGrid.of(8, 1, 2, ep=2)
    assert [grid.expert_source(1, e) for e in range(2)] == [4, 5]
    assert grid.expert_source(1, 0) == grid.stage_source(1)
    with pytest.raises(ValueError, match=r"train_ep \(3\) must divide the trainer's data-parallel size \(4\)"):
        TrainerGrid.of(8, 1, 2, ep=3)
