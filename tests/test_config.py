"""Config loading: every kind of user error gets a clear message (and exit code 2 from the CLI)."""

import re
import subprocess
import sys

import pytest

from areal_hpc.config import (
    IDENTITY,
    OPERATIONAL,
    TRAINING,
    Config,
    ConfigError,
    describe_config,
    field_docs,
    kind_of,
    load_config,
    save_config,
)
from areal_hpc.config.kinds import declared_kinds, identity, operational, training
from areal_hpc.config.resume import config_fields
from areal_hpc.config.schema import section_class
from areal_hpc.layout import Layout
from areal_hpc.planner import resolve_split
from areal_hpc.workflow import Workflow, load_workflow
from tests.support.helpers import REPO, TINY

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_name_a_workflow_that_loads(path):
    assert issubclass(load_workflow(load_config(path).rollout.workflow), Workflow)


def test_override_changes_a_field():
    cfg = load_config(TINY, ["rollout.max_staleness=5", "ppo.eps_clip_high=0.28"])
    assert cfg.rollout.max_staleness == 5 and cfg.ppo.eps_clip_high == 0.28
    cfg = load_config(TINY, ["ppo.behav_weight_cap=[0.5,2]", "ppo.policy_loss=gspo", "ppo.loss_agg=seq_mean_token_sum"])
    assert list(cfg.ppo.behav_weight_cap) == [0.5, 2] and cfg.ppo.policy_loss == "gspo"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.max_stalness=3"], "unknown key 'rollout.max_stalness'; did you mean 'rollout.max_staleness'?"),
        (["rolout.max_staleness=3"], "unknown key 'rolout'; did you mean 'rollout'?"),
        (["rollout=3"], "'rollout' is a section"),
        (["rollout.group_size"], "not of the form section.field=value"),
        (["rollout.group_size=many"], "rollout.group_size: wrong type"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0"),
        (["allocation.train_tp=3"], "allocation.train_tp (3) must divide model.num_attention_heads (4)"),
        (
            ["model.num_attention_heads=8", "allocation.train_tp=4"],
            "allocation.train_tp (4) must divide model.num_key_value_heads (2)",
        ),
        (["allocation.train_pp=3"], "allocation.train_pp (3) must divide model.num_layers (2)"),
        (["allocation.gen_gpus=2"], "allocation.gen_gpus (2) must leave each role a GPU: between 1 and"),
        (["cluster.nodes=1"], "(1 x 1) is 1 GPU: this system needs one GPU to generate and one to train"),
        (["allocation.gen_nodes=2"], "allocation.gen_nodes (2) and allocation.gen_gpus (1) disagree"),
        (
            ["cluster.nodes=1", "cluster.gpus_per_node=4", "allocation.gen_gpus=1", "allocation.gen_tp=2"],
            "allocation.gen_gpus (1) must be a multiple of allocation.gen_tp (2)",
        ),
        (["allocation.reward_nodes=some"], "allocation.reward_nodes must be auto or a number >= 0 (got 'some')"),
        (["allocation.gen_tp=2"], "allocation.gen_tp (2) must divide cluster.gpus_per_node (1)"),
        (["model.dtype=float8"], "model.dtype must be float32, bfloat16 or float16"),
        (["model.architecture=llama"], "model.architecture must be one of qwen2, qwen3, qwen3_moe"),
        (["model.num_attention_heads=6"], "(6) must divide model.hidden_size (128), or set model.head_dim"),
        (["ppo.minibatches=9"], "ppo.minibatches (9) must not exceed rollout.prompts_per_step (8)"),
        (["rollout.group_size=1"], "rollout.group_size is 1: every advantage is 0"),
        (["rollout.group_size=0"], "so the run would learn nothing; set rollout.group_size >= 2"),
        (
            ["rollout.max_episode_tokens=400", "ppo.max_tokens_per_mb=256"],
            "ppo.max_tokens_per_mb (256) must hold one whole episode sequence, up to rollout.max_episode_tokens (400)",
        ),
        (
            ["rollout.workflow=areal_hpc.workflow.builtin:CalculatorAgent", "ppo.max_tokens_per_mb=256"],
            "up to the model's context (512: rollout.max_episode_tokens is 0 and rollout.workflow",
        ),
        (["rollout.max_episode_tokens=12"], "rollout.max_episode_tokens (12) must exceed rollout.max_new_tokens (12)"),
        (["lora.rank=600"], "lora.rank must be in [0, 512] (got 600)"),
        (["lora.rank=-1"], "lora.rank must be in [0, 512] (got -1)"),
        (
            ["lora.rank=65", "lora.target_modules=[q_proj,v_proj]"],
            "lora.rank 65 is larger than the smallest dimension of ['v_proj'] (v_proj: 128 -> 64)",
        ),
        (
            ["lora.rank=8", "lora.target_modules=[q_proj,qkv_proj]"],
            "lora.target_modules ['q_proj', 'qkv_proj']: ['qkv_proj'] name no layer of a qwen2 model; its layers: ['q_proj',",
        ),
        (["lora.rank=8", "lora.target_modules=[]"], "lora.target_modules is empty: name at least one of"),
        (["lora.rank=8", "lora.target_modules=[o_proj,o_proj]"], "names a layer twice: name each once"),
        (["lora.rank=8", "lora.alpha=0"], "lora.alpha must be > 0 (got 0.0)"),
        (
            ["model.architecture=qwen3_moe", "ppo.loss_agg=seq_mean_token_mean"],
            "ppo.loss_agg seq_mean_token_mean averages over sequences, but Megatron weights a mixture of experts'",
        ),
        (["ppo.policy_loss=grpo"], "ppo.policy_loss must be decoupled, gspo or cispo (got 'grpo')"),
        (["ppo.loss_agg=sum"], "ppo.loss_agg must be token_mean, seq_mean_token_mean or seq_mean_token_sum"),
        (["ppo.behav_weight_cap=0.9"], "ppo.behav_weight_cap must be a number > 1 or a pair [lo, hi] with 0 <= lo"),
        (["ppo.behav_weight_cap=[2,3]"], "with 0 <= lo < 1 < hi (got [2, 3])"),
        (["ppo.behav_weight_cap=[0.5]"], "with 0 <= lo < 1 < hi (got [0.5])"),
        (
            ["lora.rank=8", "model.architecture=qwen3_moe", "lora.target_modules=[o_proj]"],
            "LoRA (lora.rank) is for dense models (qwen2, qwen3); model.path is a qwen3_moe",
        ),
        (["reward.kind=none"], "reward.kind none scores every episode 0: the run learns only from a teacher"),
        (
            ["distill.teacher.path=/nowhere/qwen"],
            "distill.teacher.path /nowhere/qwen is not a Hugging Face model directory here (no config.json), so the config must give its architecture: set distill.teacher.hidden_size",
        ),
        (["distill.kl_coef=-1"], "distill.kl_coef must be >= 0 (got -1.0)"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value)


def test_a_single_turn_episode_needs_no_more_than_a_turn_per_micro_batch():
    cfg = load_config(TINY, ["ppo.max_tokens_per_mb=256", "rollout.max_turns=8"])
    assert cfg.rollout.max_episode_tokens == 0 and cfg.ppo.max_tokens_per_mb < cfg.model.max_position_embeddings


def test_unknown_key_in_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo:\n  eps_clpi: 0.3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'ppo.eps_clpi'; did you mean 'ppo.eps_clip'\?"):
        load_config(bad)


def test_wrong_type_in_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  total_steps: [1, 2]\n")
    with pytest.raises(ConfigError, match="train.total_steps"):
        load_config(bad)


def test_loading_a_config_runs_no_planner_and_builds_no_layout(monkeypatch):
    """gen_share auto is resolved when a run is launched (planner.resolve_split), not when a config loads:
    loading reads numbers and checks rules, and a layout needs the split as a number."""
    import areal_hpc.layout
    import areal_hpc.planner.search

    def refuse(*args, **kwargs):
        raise AssertionError("loading a config ran the planner or built a layout")

    monkeypatch.setattr(areal_hpc.planner.search, "choose", refuse)
    monkeypatch.setattr(areal_hpc.layout.Layout, "from_config", refuse)
    cfg = load_config(REPO / "configs" / "qwen32b.yaml", ["cluster.nodes=16"])
    assert cfg.allocation.gen_share == "auto" and cfg.allocation.gen_gpus is None
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="allocation.gen_gpus is not set"):
        Layout.from_config(cfg)
    resolved, why = resolve_split(cfg)
    assert resolved.allocation.gen_gpus == 40 and "the planner's fastest split" in why
    assert resolve_split(resolved) == (resolved, "allocation.gen_gpus = 40 (set in the config)")


def test_a_split_in_nodes_is_read_as_gpus():
    """Configs and run directories from before gen_gpus name the split in whole nodes: gen_nodes x gpus_per_node."""
    cfg = load_config(None, ["cluster.nodes=3", "cluster.gpus_per_node=4", "allocation.gen_nodes=2"])
    assert (cfg.allocation.gen_gpus, cfg.allocation.gen_nodes) == (8, None)
    same = load_config(
        None, ["cluster.nodes=3", "cluster.gpus_per_node=4", "allocation.gen_nodes=2", "allocation.gen_gpus=8"]
    )
    assert same.allocation.gen_gpus == 8


def test_allocation_that_cannot_fit():
    # 3 nodes of 1 device, trainer needs TP 2 x PP 1: 2 generator GPUs leave the trainer one.
    with pytest.raises(ConfigError, match="train_tp x train_pp"):
        load_config(TINY, ["cluster.nodes=3", "allocation.gen_gpus=2", "allocation.train_tp=2"])


def test_cli_config_error_exits_2_without_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "areal_hpc.cli", "plan", str(TINY), "rollout.max_stalness=1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "did you mean 'rollout.max_staleness'" in r.stderr
    assert "Traceback" not in r.stderr


def test_every_field_is_documented():
    import dataclasses

    for section in dataclasses.fields(Config):
        cls = section.default_factory().__class__
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{section.name}: fields without a docstring: {missing}"
    assert "Bound eta on policy staleness" in describe_config()


def test_every_field_is_of_exactly_one_kind():
    """Each field declares its kind (or its section does, for all its fields), exactly once: a field of a
    section of mixed kinds that declares none, or a field that declares one in a section that does too,
    fails the schema's import (`declared_kinds`)."""
    import dataclasses

    every = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(section_class(s))]
    assert config_fields() == every and {kind_of(f) for f in every} == {OPERATIONAL, TRAINING, IDENTITY}

    @dataclasses.dataclass
    class Mixed:
        lr: float = training(0.1)
        seed: int = identity(1)

    @dataclasses.dataclass
    class Forgot(Mixed):
        added: int = 0  # declares no kind, in a section of mixed kinds

    @dataclasses.dataclass
    class Uniform:
        time: str = "04:00:00"

    @dataclasses.dataclass
    class Twice(Uniform):
        timeout_s: float = training(1.0)  # declares one, in a section that declares one

    def toy(ppo: type, cluster: type) -> type:  # a Config of two sections: ppo mixed, cluster operational
        sections = [
            ("ppo", ppo, dataclasses.field(default_factory=ppo)),
            ("cluster", cluster, operational(factory=cluster)),
        ]
        return dataclasses.make_dataclass("Toy", sections)

    with pytest.raises(TypeError, match=r"config field ppo\.added declares no kind on resume"):
        declared_kinds(toy(Forgot, Uniform))
    with pytest.raises(TypeError, match=r"cluster\.timeout_s declares a kind on resume, and so does its section"):
        declared_kinds(toy(Mixed, Twice))
    assert declared_kinds(toy(Mixed, Uniform)) == {
        "ppo.lr": TRAINING,
        "ppo.seed": IDENTITY,
        "cluster.time": OPERATIONAL,
    }

    assert (kind_of("cluster.time"), kind_of("ppo.lr"), kind_of("model.path")) == (OPERATIONAL, TRAINING, IDENTITY)
    assert kind_of("cluster.env.NCCL_DEBUG") == OPERATIONAL  # an entry of a mapping field: its field's kind
    assert "  lr = 2e-05  [training]" in describe_config() and "  time = '04:00:00'  [operational]" in describe_config()


def test_qwen32b_plan_adds_up_to_16_nodes_of_8_gpus():
    cfg, _ = resolve_split(load_config(REPO / "configs" / "qwen32b.yaml", ["cluster.nodes=16"]))
    layout = Layout.from_config(cfg)
    assert layout.gen_gpus + layout.trainers == 16 * 8
    assert layout.generators * layout.gen_tp + layout.trainers == 16 * 8
    assert layout.train_tp * layout.train_pp * layout.train_dp == layout.trainers
    assert layout.gen_gpus == 40  # gen_share auto: the planner's split (5 engines of TP 8, generation-bound)


def test_learning_rate_schedule_is_validated():
    for bad, says in [
        ("ppo.lr_decay=step", "ppo.lr_decay must be constant, linear or cosine"),
        ("ppo.lr_warmup_steps=10000", "ppo.lr_warmup_steps (10000) must be at least 0 and below train.total_steps"),
        ("ppo.min_lr=1", "ppo.min_lr (1.0) must be between 0 and ppo.lr"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, [bad])


QWEN15B = REPO / "configs" / "qwen1.5b.yaml"
QWEN15B_JSON = {  # DeepSeek-R1-Distill-Qwen-1.5B's config.json, the fields the trainer reads
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 131072,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}


def _hf_dir(tmp_path, **fields):
    import json

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(QWEN15B_JSON | fields))
    return tmp_path


def test_a_model_directory_gives_the_shape_and_the_config_must_agree(tmp_path):
    from areal_hpc import planner
    from areal_hpc.arch import QwenArch, model_arch

    model = _hf_dir(tmp_path)
    without = load_config(QWEN15B)  # no directory here: the config's fields stand in
    cfg = load_config(QWEN15B, [f"model.path={model}"])  # the same fields, now checked against config.json
    assert model_arch(cfg.model) == QwenArch.from_hf(model) == model_arch(without.model)
    assert planner.ModelSize.from_config(cfg) == planner.ModelSize.from_config(without)

    with pytest.raises(ConfigError) as e:
        load_config(QWEN15B, [f"model.path={model}", "model.hidden_size=1024", "model.num_layers=28"])
    assert f"model.hidden_size is 1024 but {model / 'config.json'} has 1536" in str(e.value)
    assert "num_layers" not in str(e.value)  # agrees
    assert "e.g. model.hidden_size=null)" in str(e.value)

    capped = load_config(QWEN15B, [f"model.path={model}", "model.max_position_embeddings=32768"])
    assert model_arch(capped.model).max_position_embeddings == 32768  # a cap on the context served
    with pytest.raises(ConfigError, match="model.max_position_embeddings is 262144 but"):
        load_config(QWEN15B, [f"model.path={model}", "model.max_position_embeddings=262144"])

    qwen3 = _hf_dir(tmp_path / "qwen3", model_type="qwen3", head_dim=256, max_position_embeddings=4096)
    only_path = tmp_path / "only-path.yaml"  # no shape field: all of it from config.json
    only_path.write_text(f"model:\n  path: {qwen3}\n  dtype: bfloat16\n")
    arch = model_arch(load_config(only_path, ["rollout.max_new_tokens=1024"]).model)
    assert (arch.model_type, arch.head_dim, arch.qk_norm, arch.num_layers) == ("qwen3", 256, True, 28)


def test_a_model_not_here_needs_its_whole_shape_in_the_config(tmp_path):
    with pytest.raises(ConfigError, match=r"no config.json\), so the config must give its architecture: set "):
        load_config(QWEN15B, [f"model.path={tmp_path / 'absent'}", "model.vocab_size=null"])


def test_a_teacher_is_read_from_its_config_json_and_must_fit_the_run(tmp_path):
    """distill.teacher: its config.json is enough to plan (the weights come later), its context must cover
    the model's, and reward.kind none learns from it alone, without leaving uniform groups out."""
    teacher = f"distill.teacher.path={_hf_dir(tmp_path / 'teacher')}"
    cfg = load_config(TINY, [teacher, "reward.kind=none"])
    assert cfg.distill.kl_coef == 1.0
    with pytest.raises(ConfigError, match="rollout.filter_uniform_groups would leave every one out"):
        load_config(TINY, [teacher, "reward.kind=none", "rollout.filter_uniform_groups=true"])
    short = f"distill.teacher.path={_hf_dir(tmp_path / 'short', max_position_embeddings=256)}"
    with pytest.raises(ConfigError, match=r"reads 256 positions, the model's context is 512: set model.max_position"):
        load_config(TINY, [short])
    with pytest.raises(ConfigError, match=r"distill.teacher.hidden_size is 64 but .*config.json has 1536"):
        load_config(TINY, [teacher, "distill.teacher.hidden_size=64"])
    with pytest.raises(ConfigError, match="distill.teacher.path is tiny: a teacher is a trained model's directory"):
        load_config(TINY, ["distill.teacher.path=tiny"])
    with pytest.raises(ConfigError, match="distill.kl_coef is 0 with distill.teacher .* loaded and never used"):
        load_config(TINY, [teacher, "distill.kl_coef=0"])
    small = f"distill.teacher.path={_hf_dir(tmp_path / 'small', vocab_size=100)}"
    with pytest.raises(ConfigError, match="has 100 embeddings, fewer than the model's 128"):
        load_config(TINY, [small])
    assert load_config(TINY, [teacher, "reward.kind=none", "rollout.group_size=1"]).rollout.group_size == 1


def test_a_resume_compares_the_teachers_shape_through_its_architecture(tmp_path):
    """distill.teacher's shape fields written out or left to config.json: the same teacher, no change; another
    path or `--allow-change distill.teacher.path`: an identity change, named as such."""
    from areal_hpc.config.resume import allowed_fields
    from areal_hpc.rundir import config_changes

    teacher = _hf_dir(tmp_path / "teacher")
    plain = load_config(TINY, [f"distill.teacher.path={teacher}"])
    spelled = load_config(TINY, [f"distill.teacher.path={teacher}", "distill.teacher.hidden_size=1536"])
    assert config_changes(plain, spelled) == []
    other = load_config(TINY, [f"distill.teacher.path={_hf_dir(tmp_path / 'other')}"])
    assert [c.field for c in config_changes(plain, other)] == ["distill.teacher.path"]
    with pytest.raises(ConfigError, match="distill.teacher.path is identity"):
        allowed_fields(["distill.teacher.path"])
