"""The planner's cost model against the AReaL paper's figures, and the plans it chooses."""

import dataclasses
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc import planner
from areal_hpc.arch import PROJECTIONS, model_arch
from areal_hpc.cli import main as cli_main
from areal_hpc.config import ConfigError, load_config
from areal_hpc.layout import Layout
from areal_hpc.planner.cost import Hardware, ModelSize
from areal_hpc.planner.predict import expert_alltoall_s, train_step_s, weight_sync_s
from areal_hpc.planner.timeouts import check_timeouts, drain_s
from tests.support.helpers import REPO

CONFIGS = REPO / "configs"
TOLERANCE = 0.15
"""Largest relative error allowed against a figure the paper reports (docs/planner.md)."""

# AReaL (arXiv 2505.24298), 1.5B math run on 16 nodes x 8 H800: effective training throughput by
# max_staleness, and the end-to-end hours of 1000 steps.
PAPER_TOKENS_PER_S = {0: 128.7e3, 1: 269.3e3, 2: 356.6e3, 4: 356.6e3, 8: 371.7e3, 16: 382.4e3}
PAPER_HOURS = {"synchronous": 41.0, "asynchronous": 14.8}


def cfg_of(name, nodes=16, *overrides):
    """A shipped config on `nodes` nodes, its split resolved as a launcher resolves it."""
    return planner.resolve_split(load_config(CONFIGS / f"{name}.yaml", [f"cluster.nodes={nodes}", *overrides]))[0]


@pytest.fixture(scope="module")
def paper():
    """The paper's configuration: 12 generator nodes (96 GPUs, TP 1), 4 trainer nodes (TP 2), max_staleness 8
    (configs/qwen1.5b.yaml ships the planner's own split, gen_share auto)."""
    cfg = cfg_of("qwen1.5b", 16, "allocation.gen_share=0.75")
    return cfg, planner.predict(cfg)


def test_paper_plan_is_the_papers_split(paper):
    _, p = paper
    assert p.plan == planner.Plan(gen_gpus=96, gen_tp=1, train_tp=2, train_pp=1)
    assert p.trajectories == 512 * 16 and p.fits


@pytest.mark.parametrize("eta", sorted(PAPER_TOKENS_PER_S))
def test_effective_throughput_by_staleness_matches_the_paper(paper, eta):
    _, p = paper
    predicted, reported = p.tokens_per_s(eta), PAPER_TOKENS_PER_S[eta]
    assert abs(predicted / reported - 1) <= TOLERANCE, f"eta {eta}: {predicted:.0f} vs {reported:.0f} tokens/s"


def test_run_hours_match_the_paper(paper):
    cfg, p = paper
    steps = cfg.train.total_steps
    assert steps == 1000
    sync_h, async_h = steps * p.t_sync / 3600, steps * p.t_async() / 3600
    assert abs(sync_h / PAPER_HOURS["synchronous"] - 1) <= TOLERANCE, sync_h
    assert abs(async_h / PAPER_HOURS["asynchronous"] - 1) <= TOLERANCE, async_h


def test_model_sizes_are_the_published_parameter_counts():
    # Hugging Face parameter counts (q/k/v biases, ~0.01%, left out of the model).
    for name, params in [("qwen1.5b", 1.777e9), ("qwen7b", 7.616e9), ("qwen32b", 32.76e9)]:
        assert planner.ModelSize.from_config(cfg_of(name)).params == pytest.approx(params, rel=1e-3)


@pytest.mark.parametrize("name, nodes", [("qwen1.5b", 16), ("qwen7b", 24), ("qwen32b", 16), ("tiny-cpu", 2)])
def test_staleness_zero_is_synchronous_and_more_staleness_never_slower(name, nodes):
    cfg = cfg_of(name, nodes)
    for plan in list(planner.candidates(cfg))[::7]:
        p = planner.predict(cfg, plan)
        assert p.t_async(0) == p.t_sync
        rates = [p.tokens_per_s(eta) for eta in range(0, 33)]
        assert all(b >= a for a, b in zip(rates, rates[1:])), plan
        # never past the pipelined limit, unless a synchronous step is faster (no interruption: a tiny model's
        # re-prefill after each update can cost more than its whole synchronous step)
        assert rates[-1] <= p.tokens / min(p.t_cap, p.t_sync) * (1 + 1e-9)


def test_staleness_zero_config_predicts_the_same_both_ways():
    p = planner.predict(cfg_of("qwen1.5b", 16, "rollout.max_staleness=0"))
    assert p.t_async() == p.t_sync


def test_longer_tail_slows_synchronous_more_than_asynchronous():
    short = planner.predict(cfg_of("qwen1.5b", 16, "rollout.max_new_tokens=8192"))
    long = planner.predict(cfg_of("qwen1.5b"))
    assert long.t_sync / long.t_async() > short.t_sync / short.t_async()


@pytest.mark.parametrize(
    "name, nodes, gpus",
    [
        ("qwen1.5b", 4, 8),
        ("qwen1.5b", 16, 8),
        ("qwen1.5b", 6, 4),
        ("qwen7b", 24, 8),
        ("qwen32b", 16, 8),
        ("qwen32b", 24, 8),
    ],
)
def test_chosen_plans_fit_memory_and_add_up_to_the_nodes(name, nodes, gpus):
    cfg = cfg_of(name, nodes, f"cluster.gpus_per_node={gpus}")
    best, why = planner.choose(cfg)
    assert best.fits and max(best.gen_memory, best.train_memory) <= cfg.cluster.gpu_memory_gb * 1e9
    layout = Layout.from_config(planner.with_plan(cfg, best.plan))
    assert layout.generators * layout.gen_tp + layout.trainers == nodes * gpus
    assert layout.train_tp * layout.train_pp * layout.train_dp == layout.trainers
    # nothing that fits is predicted faster (every third candidate, to keep the test quick)
    others = [planner.predict(cfg, plan) for plan in list(planner.candidates(cfg))[::3]]
    assert all(o.tokens_per_s() <= best.tokens_per_s() * 1.001 for o in others if o.fits)


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["qwen1.5b", "qwen7b", "qwen32b"]),
    nodes=st.integers(1, 12),
    gpus=st.sampled_from([1, 2, 4, 8]),
    memory=st.sampled_from([24, 40, 80, 141]),
    mb=st.sampled_from([32768, 65536]),
    eta=st.integers(0, 16),
)
def test_any_chosen_plan_fits_and_adds_up(name, nodes, gpus, memory, mb, eta):
    if nodes * gpus < 2:
        return  # a config error: one GPU cannot both generate and train
    start = ["allocation.gen_gpus=1", "allocation.gen_tp=1", "allocation.train_tp=1", "allocation.train_pp=1"]
    cluster = [f"cluster.gpus_per_node={gpus}", f"cluster.gpu_memory_gb={memory}", f"ppo.max_tokens_per_mb={mb}"]
    cfg = cfg_of(name, nodes, *start, *cluster, f"rollout.max_staleness={eta}")
    try:
        best, _ = planner.choose(cfg)
    except ConfigError:  # nothing fits: then truly no candidate does
        assert not any(planner.predict(cfg, plan).fits for plan in planner.candidates(cfg))
        return
    assert best.fits
    layout = Layout.from_config(planner.with_plan(cfg, best.plan))
    assert layout.generators * layout.gen_tp + layout.train_tp * layout.train_pp * layout.train_dp == nodes * gpus
    assert best.tokens_per_s() >= best.tokens / best.t_sync * (1 - 1e-9)  # asynchronous never slower


def test_qwen32b_on_16_nodes_adds_up_and_needs_model_parallel_training():
    cfg = cfg_of("qwen32b", 16)
    best, _ = planner.choose(cfg)
    layout = Layout.from_config(planner.with_plan(cfg, best.plan))
    assert layout.gen_gpus + layout.trainers == 16 * 8 and layout.nodes == 16
    assert best.plan.train_tp * best.plan.train_pp >= 4  # 6 bytes/parameter + sharded Adam of a 32B model: >= 4 GPUs
    unsharded = planner.predict(cfg, planner.Plan(64, 1, 1, 1))
    assert not unsharded.fits and unsharded.train_memory > 3 * unsharded.memory


def test_fixed_fields_are_kept():
    cfg = cfg_of("qwen32b", 16)
    best, why = planner.choose(cfg, {"train_pp": 4, "gen_gpus": 96})
    assert best.plan.train_pp == 4 and best.plan.gen_gpus == 96 and "fixed" in why


def test_nothing_fits_is_a_config_error():
    one_small_gpu = ["cluster.gpus_per_node=1", "cluster.gpu_memory_gb=24", "allocation.gen_tp=1"]
    cfg = cfg_of("qwen32b", 2, *one_small_gpu, "allocation.train_tp=1", "allocation.train_pp=1")
    with pytest.raises(ConfigError, match="fits the model"):
        planner.choose(cfg)


def test_no_split_for_the_parallel_sizes_says_so_not_memory():
    """gen_share auto with sizes no split can hold: the error names the replicas rule, not memory."""
    cfg = load_config(CONFIGS / "qwen32b.yaml", ["cluster.nodes=2", "allocation.train_tp=8", "allocation.train_pp=4"])
    with pytest.raises(ConfigError, match="no split of 2 nodes x 8 GPUs can run these parallel sizes .* replicas"):
        planner.resolve_split(cfg)


def areal(*args):
    return subprocess.run(
        [sys.executable, "-m", "areal_hpc.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_cli_plan_prints_split_and_both_predictions():
    r = areal("plan", str(CONFIGS / "qwen1.5b.yaml"), "--nodes", "16", "allocation.gen_share=0.75")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "16 + 1 CPU" in out and "TP 2 x PP 1 x DP 16" in out  # the config's plan, Layout's table
    assert "synchronous (max_staleness 0)" in out and "asynchronous (max_staleness 8)" in out
    assert "steps/hour" in out and "effective tokens/s" in out and "--search would choose" in out


@pytest.mark.parametrize(
    "name", ["qwen1.5b", "qwen1.5b-1node", "qwen7b", "qwen32b", "qwen32b-lora", "qwen3-30b-a3b", "qwen-distill"]
)
def test_shipped_configs_are_the_split_their_planner_prefers(name):
    cfg, _ = planner.resolve_split(load_config(CONFIGS / f"{name}.yaml"))
    assert cfg.allocation.gen_share == "auto"
    best, _ = planner.choose(cfg)  # the full search: gen_gpus, gen_tp, train_tp, train_pp, train_ep
    shipped = planner.predict(cfg)
    assert shipped.fits and best.tokens_per_s() <= shipped.tokens_per_s() * 1.005  # nothing that fits is faster
    assert "--search would keep this plan" in planner.search_hint(cfg, planner.predict(cfg))


def test_lora_fits_one_node_where_full_training_of_the_same_model_does_not():
    """configs/qwen32b-lora.yaml: the 32B model on one node of 8 GPUs. Its frozen base keeps no gradient and
    no optimizer state, so the trainer fits; the same config trained whole fits no split of that node. A sync
    sends the adapters (0.54 GB in bf16) instead of the model (65.5 GB), and the step trains faster (no
    gradient of the frozen weights)."""
    lora = load_config(CONFIGS / "qwen32b-lora.yaml")
    full = load_config(CONFIGS / "qwen32b-lora.yaml", ["lora.rank=0"])
    cfg = planner.resolve_split(lora)[0]
    assert planner.predict(cfg).fits
    with pytest.raises(ConfigError, match="no split of 1 nodes x 8 GPUs of 80 GB fits the model"):
        planner.choose(full)
    m_lora, m_full = ModelSize.from_config(lora), ModelSize.from_config(full)
    assert m_lora.sync_bytes == model_arch(lora.model).lora_params(32, PROJECTIONS) * 2 < m_full.sync_bytes / 100
    assert planner.predict(cfg).t_train < planner.predict(dataclasses.replace(cfg, lora=full.lora)).t_train
    r = areal("plan", str(CONFIGS / "qwen32b-lora.yaml"))
    assert r.returncode == 0, r.stderr
    assert "LoRA rank 32 (lora.*): 268.4M adapter parameters trained, 0.82% of the model's 32.76B" in r.stdout
    assert "a weight sync sends 536.9 MB instead of 65.53 GB" in r.stdout


def test_gen_share_auto_is_the_planners_split_on_any_node_count():
    for nodes in (8, 24):
        cfg, why = planner.resolve_split(load_config(CONFIGS / "qwen7b.yaml", [f"cluster.nodes={nodes}"]))
        a = cfg.allocation
        best, _ = planner.choose(cfg, {"gen_tp": a.gen_tp, "train_tp": a.train_tp, "train_pp": a.train_pp})
        layout = Layout.from_config(cfg)
        assert layout.gen_gpus == best.plan.gen_gpus
        assert "allocation.gen_share auto: the planner's fastest split" in layout.table(why)
    with pytest.raises(ConfigError, match="gen_share must be auto or strictly between 0 and 1"):
        cfg_of("qwen7b", 16, "allocation.gen_share=half")


def test_cli_search_respects_fields_given_on_the_command_line():
    r = areal("plan", str(CONFIGS / "qwen32b.yaml"), "--nodes", "16", "--search", "allocation.gen_tp=4")
    assert r.returncode == 0, r.stderr
    assert "vLLM engine(s), TP 4" in r.stdout and "gen_tp=4 fixed" in r.stdout
    assert "asynchronous (max_staleness 8)" in r.stdout


def test_a_trainer_that_does_not_fit_is_named_with_the_setting_to_change(tmp_path):
    # 7B at TP 2: 32,768-token micro-batches without recompute need more than 80 GB; full recompute fits
    over = cfg_of("qwen7b", 16, "allocation.train_tp=2")
    p = planner.predict(over)
    assert not p.fits and p.train_memory > p.memory >= p.gen_memory
    advice = planner.memory_advice(over, p)
    assert advice.startswith("the trainer needs") and "set ppo.recompute=full" in advice
    assert planner.predict(cfg_of("qwen7b", 16, "allocation.train_tp=2", "ppo.recompute=full")).fits
    r = areal("plan", str(CONFIGS / "qwen7b.yaml"), "allocation.train_tp=2")
    assert r.returncode == 0 and "DOES NOT FIT: the trainer needs" in r.stdout, r.stdout
    # submit (and its dry run) refuses it with the same advice, before anything is written
    r = areal(
        "submit",
        str(CONFIGS / "qwen7b.yaml"),
        "--nodes",
        "16",
        "--dry-run",
        "allocation.train_tp=2",
        f"experiment.root={tmp_path}",
    )
    assert r.returncode == 2 and "DOES NOT FIT" in r.stderr and "ppo.recompute=full" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())


def test_a_generator_that_does_not_fit_names_gen_tp():
    cfg = cfg_of("qwen32b", 16, "allocation.gen_tp=1")
    p = planner.predict(cfg)
    assert p.gen_memory > p.memory and "raise allocation.gen_tp (to 2)" in planner.memory_advice(cfg, p)


def test_each_memory_setting_moves_the_trainer_figure_the_right_way():
    base = cfg_of("qwen1.5b")
    m = planner.ModelSize.from_config(base)
    parts = planner.train_memory_parts(m, 2, 1, 28, base)
    full = planner.train_memory_parts(m, 2, 1, 28, cfg_of("qwen1.5b", 16, "ppo.recompute=full"))
    assert full["activations"] < parts["activations"] / 4 and full["states"] == parts["states"]
    half = planner.train_memory_parts(
        m, 2, 1, 28, cfg_of("qwen1.5b", 16, "ppo.max_tokens_per_mb=16384", "rollout.max_new_tokens=8192")
    )
    assert half["activations"] == pytest.approx(parts["activations"] / 2)
    more_dp = planner.train_memory_parts(m, 2, 1, 56, base)
    assert more_dp["states"] < parts["states"]  # the distributed optimizer shards master weights and moments
    kl = planner.train_memory_parts(m, 2, 1, 28, cfg_of("qwen1.5b", 16, "ppo.kl_coef=0.01"))
    assert parts["reference"] == 0  # the KL penalty is off by default: no reference policy
    assert kl["reference"] == pytest.approx(m.params / 2 * m.dtype_bytes)  # its weights, sharded like the policy's
    assert {k: v for k, v in kl.items() if k != "reference"} == {k: v for k, v in parts.items() if k != "reference"}
    kl_step = planner.predict(cfg_of("qwen1.5b", 16, "ppo.kl_coef=0.01")).t_train
    assert kl_step > planner.predict(base).t_train  # and its forward pass in every step


def test_a_cpu_run_is_checked_against_the_hosts_memory():
    cfg, _ = planner.resolve_split(load_config(None, ["cluster.device=cpu"]))
    need = sum(planner.host_memory_need(cfg).values())
    assert "memory on this host" in planner.check_host_fits(cfg, available=need * 1.01)
    with pytest.raises(ConfigError, match="ppo.max_tokens_per_mb"):
        planner.check_host_fits(cfg, available=need * 0.99)
    bigger, _ = planner.resolve_split(load_config(None, ["cluster.device=cpu", "ppo.max_tokens_per_mb=65536"]))
    assert planner.host_memory_need(bigger)["trainer"] > planner.host_memory_need(cfg)["trainer"]


# Qwen3-30B-A3B's published sizes: 30.5B parameters, 3.3B activated per token (its model card).
MOE_TOTAL, MOE_ACTIVE = 30.5e9, 3.3e9


def test_moe_counts_are_the_published_total_and_active_parameters():
    m = planner.ModelSize.from_config(cfg_of("qwen3-30b-a3b"))
    assert m.params == pytest.approx(MOE_TOTAL, rel=0.02) and m.active_params == pytest.approx(MOE_ACTIVE, rel=0.02)
    assert m.active_params < m.params / 8
    assert m.expert_params == 48 * 128 * 3 * 2048 * 768 and m.dense_params == m.params - m.expert_params
    dense = planner.ModelSize.from_config(cfg_of("qwen7b"))
    assert dense.active_params == dense.params and dense.expert_params == 0 and not dense.experts


def test_moe_costs_follow_active_parameters_and_memory_all_of_them():
    cfg = cfg_of("qwen3-30b-a3b")
    m = planner.ModelSize.from_config(cfg)
    as_dense = dataclasses.replace(m, active_params=m.params)  # the same model, every expert used by every token
    hw, lengths = Hardware.from_config(cfg), planner.Lengths.from_config(cfg)
    args = (hw, lengths, 48, 2, 12, 8192, cfg)
    assert train_step_s(m, *args) < train_step_s(as_dense, *args) / 4  # FLOPs of 3.35B, not 30.5B, per token
    assert weight_sync_s(m, hw, 12) == weight_sync_s(as_dense, hw, 12)  # every parameter is sent
    # a decode step of one trajectory reads its 8 experts of 128; of hundreds, all of them
    assert m.decode_weight_bytes(1) == pytest.approx((m.dense_params + m.expert_params * 8 / 128) * 2)
    assert m.decode_weight_bytes(1000) == pytest.approx(m.weight_bytes)
    # the trainer's state: dense / (tp pp) + experts / (ep pp), optimizer sharded over the replicas
    one, eight = (planner.train_memory_parts(m, 1, 1, 48, cfg, ep=ep)["states"] for ep in (1, 8))
    dense_share = m.dense_params * (2 + 4 + 12 / 48)
    assert one == pytest.approx(dense_share + m.expert_params * (2 + 4 + 12 / 48))
    assert eight == pytest.approx(dense_share + m.expert_params / 8 * (2 + 4 + 12 / 6))


def test_expert_all_to_all_costs_time_over_nvlink_in_a_node_and_more_across():
    cfg = cfg_of("qwen3-30b-a3b")
    m, hw = planner.ModelSize.from_config(cfg), Hardware.from_config(cfg)
    tokens = 1e6
    assert expert_alltoall_s(m, hw, tokens, 1, 1, 8) == 0  # ep 1: every token's experts are local
    in_node = expert_alltoall_s(m, hw, tokens, 1, 8, 8)
    bytes_ = tokens * 48 * 2 * 2048 * 8 * 2 * 7 / 8  # dispatch + combine, h k bf16, 7/8 leave the GPU
    assert in_node == pytest.approx(bytes_ / (planner.COST.nvlink_gbs * 1e9))
    assert expert_alltoall_s(m, hw, tokens, 1, 16, 8) > 4 * in_node  # 16 ranks span two nodes: the network
    dense = planner.ModelSize.from_config(cfg_of("qwen7b"))
    assert expert_alltoall_s(dense, hw, tokens, 1, 8, 8) == 0


@pytest.fixture(scope="module")
def moe_16_nodes():
    cfg = cfg_of("qwen3-30b-a3b")
    return cfg, planner.predict(cfg)


def test_qwen3_30b_a3b_fits_80gb_on_16_nodes(moe_16_nodes):
    cfg, p = moe_16_nodes
    assert cfg.cluster.nodes == 16 and cfg.cluster.gpu_memory_gb == 80
    assert p.fits and max(p.gen_memory, p.train_memory) <= 80e9


def test_search_chooses_train_ep_dividing_the_experts_and_the_trainer_dp(moe_16_nodes):
    cfg, _ = moe_16_nodes
    plans = list(planner.candidates(cfg, {"gen_tp": 4, "train_tp": 1}))
    assert {p.train_ep for p in plans} == {1, 2, 4, 8, 16, 32, 64}  # divisors of 128 that a DP size here divides
    for plan in plans:
        assert 128 % plan.train_ep == 0 and plan.layout(cfg).train_dp % plan.train_ep == 0
    # without PP to split the experts' memory, only expert parallelism fits them
    best, _ = planner.choose(cfg, {"train_pp": 1, "train_tp": 1})
    ep, dp = best.plan.train_ep, best.plan.layout(cfg).train_dp
    assert ep > 1 and 128 % ep == 0 and dp % ep == 0 and best.fits
    assert not planner.predict(cfg, dataclasses.replace(best.plan, train_ep=1)).fits


def test_a_dense_model_plans_with_ep_1_and_no_expert_terms():
    cfg = cfg_of("qwen7b")
    assert {p.train_ep for p in planner.candidates(cfg)} == {1}
    assert planner.choose(cfg)[0].plan.train_ep == 1 and planner.Plan.of(cfg).train_ep == 1


def test_plan_render_and_submit_dry_run_of_the_moe_config(tmp_path, capsys):
    moe = str(CONFIGS / "qwen3-30b-a3b.yaml")
    assert cli_main(["plan", moe, "--nodes", "16"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and "3.35B of 30.53B parameters per token" in out
    assert "trainer expert parallel EP 1 (allocation.train_ep)" in out
    root = f"experiment.root={tmp_path}"
    assert cli_main(["render", moe, "--nodes", "16", "-o", str(tmp_path / "job.sbatch"), root]) == 0
    written = yaml.safe_load(next(tmp_path.glob("*/*/config.yaml")).read_text())["allocation"]
    assert (written["gen_gpus"], written["train_tp"], written["train_pp"], written["train_ep"]) == (80, 1, 4, 1)
    assert cli_main(["submit", moe, "--nodes", "16", "--dry-run", f"experiment.root={tmp_path / 'dry'}"]) == 0
    out = capsys.readouterr().out
    # 10 nodes of 2 engines, 6 trainer nodes; the controller's node asks for what its trajectories need
    assert "#   1 generator  10 node(s) x 2 task(s), 56 CPUs/task, world ranks 9-28: generator" in out
    assert "#   2 trainer    6 node(s) x 8 task(s), 14 CPUs/task, world ranks 29-76: trainer" in out
    assert out.count("#SBATCH --mem=0") == 2 and "#SBATCH --mem=160G" in out


def test_timeouts_a_normal_run_would_exceed_are_refused_naming_the_fields(tmp_path, capsys):
    """A non-interruptible qwen1.5b run with the shipped timeouts: the trainers would wait in the weight broadcast
    longer than train.collective_timeout_s while the generators finish their longest answers. Refused at
    launch (`submit --dry-run` too) with the value each timeout needs; raised to it, accepted."""
    cfg = cfg_of("qwen1.5b", 16, "rollout.interruptible=false")
    drain = drain_s(cfg)
    assert 300 < drain < 1800  # 27,648 tokens at a full-load decode step of tens of milliseconds
    with pytest.raises(ConfigError) as refused:
        check_timeouts(cfg)
    message = str(refused.value)
    assert f"train.collective_timeout_s (300 s) is below the {drain:,.0f} s a generator may take" in message
    assert f"train.rank_timeout_s (600 s) is below the {drain:,.0f} s" in message
    assert f"raise it to at least {1.5 * drain:,.0f}, or set rollout.interruptible=true" in message
    enough = f"{1.5 * drain + 1:.0f}"
    check_timeouts(cfg_of("qwen1.5b", 16, "rollout.interruptible=false", f"train.collective_timeout_s={enough}",
                          f"train.rank_timeout_s={enough}"))  # fmt: skip
    check_timeouts(cfg_of("qwen1.5b", 16))  # interruptible (shipped): an update waits for no answer
    # a training step longer than rank_timeout_s: qwen32b's predicted step is over 6 minutes
    step = planner.predict(cfg_of("qwen32b", 16)).t_train
    with pytest.raises(ConfigError, match=rf"train.rank_timeout_s \(300 s\) is below the {step:,.0f} s the planner"):
        check_timeouts(cfg_of("qwen32b", 16, "train.rank_timeout_s=300"))
    args = ["submit", str(CONFIGS / "qwen1.5b.yaml"), "--nodes", "16", "--dry-run", f"experiment.root={tmp_path}"]
    assert cli_main([*args, "rollout.interruptible=false"]) == 2  # a config error
    assert "a normal run would be ended as hung: train.collective_timeout_s" in capsys.readouterr().err


def test_a_generator_gpu_counts_what_the_project_adds_after_vllm(moe_16_nodes, capsys):
    """vLLM's share of a generator GPU is what the routing table, the weight-sync communicators and the
    receive buffers leave of vLLM's own default (areal_hpc.generator.memory), and `plan` shows the parts."""
    from areal_hpc.generator.memory import NCCL_COMMUNICATOR_BYTES, RECEIVE_BUFFERS, VLLM_SHARE

    cfg, p = moe_16_nodes
    b, gpu = p.gen_budget, cfg.cluster.gpu_memory_gb * 1e9
    assert b.communicators == 4 * NCCL_COMMUNICATOR_BYTES  # PP 4: a group per stage
    assert b.receive_buffers == RECEIVE_BUFFERS * 151936 * 2048 * 2  # the embedding travels alone
    assert b.routing_per_kv_byte == 48 * 8 / (2 * 48 * 1 * 128 * 2)  # 384 B per slot, 1 of 4 KV heads at TP 4
    assert b.utilization * gpu + sum(b.parts().values()) == pytest.approx(VLLM_SHARE * gpu)
    assert 0.85 < b.utilization < 0.88
    dense = planner.predict(cfg_of("qwen1.5b")).gen_budget
    assert dense.routing_table == 0 and dense.utilization > b.utilization
    assert cli_main(["plan", str(CONFIGS / "qwen3-30b-a3b.yaml"), "--nodes", "16"]) == 0
    out = capsys.readouterr().out
    assert f"vLLM is given {b.utilization:.3f} of it" in out and "routing table 1.1 GB" in out
    assert "weight-sync communicators 1.1 GB, receive buffers 1.9 GB" in out


def test_the_interruption_prefills_in_the_engines_step_budget(paper):
    """The planner's interruption uses the engines' step budget (generator.choices.step_tokens): vLLM's
    fallback of 2,048 tokens a step would cost more steps, each with its fixed cost."""
    from areal_hpc.generator.choices import step_tokens
    from areal_hpc.planner.cost import Lengths, ModelSize
    from areal_hpc.planner.predict import interruption_s

    cfg, _ = paper
    m, hw, lengths = ModelSize.from_config(cfg), Hardware.from_config(cfg), Lengths.from_config(cfg)
    r = cfg.rollout
    ours = step_tokens(r.engine_seqs, cfg.model.max_position_embeddings)
    times = {n: interruption_s(m, hw, lengths, 96, 1, r.max_concurrent * r.group_size, n) for n in (2048, ours)}
    assert ours > 8 * 2048 and times[2048] > times[ours] > 0


def test_routing_replay_decodes_eagerly_and_its_bytes_are_counted(moe_16_nodes, capsys):
    cfg, p = moe_16_nodes
    plain_cfg = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, routing_replay=False))
    plain = planner.predict(plain_cfg, p.plan)
    assert p.t_gen_full > 1.05 * plain.t_gen_full and p.t_gen_sync > plain.t_gen_sync  # no CUDA graphs
    per_token = 48 * 8  # uint8 ids of 8 experts in 48 layers
    assert p.routing_bytes == pytest.approx(8192 * (200 + 2319) * per_token, rel=0.01) and plain.routing_bytes == 0
    assert p.controller_bytes == pytest.approx(10 * 8192 * (200 + 2319) * (per_token + 13), rel=0.01)
    assert cli_main(["plan", str(CONFIGS / "qwen3-30b-a3b.yaml"), "--nodes", "16"]) == 0
    assert "the engines decode eagerly" in capsys.readouterr().out


def test_a_controller_node_that_cannot_hold_its_trajectories_is_refused():
    from areal_hpc.planner.memory import slurm_mem_bytes

    assert (slurm_mem_bytes("64G"), slurm_mem_bytes("500"), slurm_mem_bytes("1t")) == (64 * 2**30, 500 * 2**20, 2**40)
    with pytest.raises(ConfigError, match="cluster.controller_mem '64 GB'"):
        slurm_mem_bytes("64 GB")
    planner.check_fits(cfg_of("qwen3-30b-a3b"))  # as shipped: 160G
    with pytest.raises(ConfigError, match=r"cluster.controller_mem \(64G\).*raise it to at least 153G"):
        planner.check_fits(cfg_of("qwen3-30b-a3b", 16, "cluster.controller_mem=64G"))
    planner.check_fits(cfg_of("qwen3-30b-a3b", 16, "cluster.controller_mem=64G", "rollout.max_staleness=2"))
    planner.check_fits(cfg_of("qwen3-30b-a3b", 16, "cluster.controller_mem=0"))  # --mem=0: all of the node's


def test_a_generator_gpu_the_additions_would_leave_too_little_of_does_not_fit():
    """qwen32b's receive buffers (its 1.56 GB embedding, three at once) and communicator on a 10 GB GPU: vLLM
    would get under half of it, which the planner refuses, as a generator would at start."""
    cfg = load_config(CONFIGS / "qwen32b.yaml", ["cluster.gpu_memory_gb=10"])
    p = planner.predict(cfg, planner.Plan.of(planner.resolve_split(load_config(CONFIGS / "qwen32b.yaml"))[0]))
    assert p.gen_budget.utilization < 0.5 and not p.fits
    assert "vLLM would get 0.43 of the generator GPU's 10.0 GB" in planner.memory_advice(cfg, p)


R1_DISTILL_7B_JSON = {  # DeepSeek-R1-Distill-Qwen-7B's config.json, the fields the planner reads
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def test_a_teacher_costs_the_trainer_its_forward_and_its_weights(tmp_path):
    """distill.teacher (a 7B teacher of the 1.5B model, its config.json alone): each trainer GPU holds its
    share of the teacher's weights and runs its forward every step, so the planner gives the trainers more
    of the 16 nodes' GPUs."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(R1_DISTILL_7B_JSON))
    base, taught = cfg_of("qwen1.5b"), cfg_of("qwen1.5b", 16, f"distill.teacher.path={tmp_path}")
    m = planner.ModelSize.from_config(taught)
    assert m.teacher.params == pytest.approx(7.6e9, rel=0.02) and planner.ModelSize.from_config(base).teacher is None
    parts = planner.train_memory_parts(m, 2, 1, 28, taught)
    assert parts["teacher"] == pytest.approx(m.teacher.params / 2 * 2)  # in the model's bf16, as its dtype is empty
    fp32 = cfg_of("qwen1.5b", 16, f"distill.teacher.path={tmp_path}", "distill.teacher.dtype=float32")
    assert (
        planner.train_memory_parts(planner.ModelSize.from_config(fp32), 2, 1, 28, fp32)["teacher"]
        == 2 * parts["teacher"]
    )
    assert planner.train_memory_parts(planner.ModelSize.from_config(base), 2, 1, 28, base)["teacher"] == 0
    same_split = planner.predict(taught, planner.Plan.of(base))
    assert same_split.t_train > 1.5 * planner.predict(base).t_train  # a 7B forward against a 1.5B step's 4 passes
    assert Layout.from_config(taught).trainers > Layout.from_config(base).trainers
