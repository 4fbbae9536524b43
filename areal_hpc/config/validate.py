"""The rules across a config's fields: `validate(cfg)` raises `ConfigError` naming the fields and the fix.

Which parallel sizes the model and the cluster allow is `areal_hpc.parallel`'s to say; the model's
shape rules are `areal_hpc.arch.model_arch`'s. Validation reads numbers only: it never builds the rank
map or runs the planner (the GPU split of `allocation.gen_share` is resolved when a run is launched).
A setting that would make the run learn nothing (rollout.group_size 1: every advantage 0) is an error.
"""

from __future__ import annotations

from areal_hpc import parallel
from areal_hpc.algo.advantages import ADV_NORMS
from areal_hpc.algo.losses import LOSS_AGGS, POLICY_LOSSES
from areal_hpc.arch import DTYPE_BYTES, model_arch, teacher_arch
from areal_hpc.config.choices import LR_DECAYS, PROX_LOGPS, RECOMPUTES, SYNTHETIC_TASKS, VLLM_LORA_RANKS
from areal_hpc.config.schema import SINGLE_TURN, Config
from areal_hpc.device import CHOICES as DEVICES
from areal_hpc.errors import ConfigError
from areal_hpc.reward import REWARD_KINDS
from areal_hpc.workflow.endpoint import SETTINGS as OPENAI_ENDPOINTS
from areal_hpc.workflow.tool_calls import FORMATS as TOOL_FORMATS

CHOICES = {
    "cluster.device": DEVICES,
    "reward.kind": REWARD_KINDS,
    "ppo.adv_norm": ADV_NORMS,
    "ppo.prox_logp": PROX_LOGPS,
    "ppo.policy_loss": POLICY_LOSSES,
    "ppo.loss_agg": LOSS_AGGS,
    "ppo.recompute": RECOMPUTES,
    "ppo.lr_decay": LR_DECAYS,
    "data.synthetic_task": SYNTHETIC_TASKS,
    "rollout.tool_format": TOOL_FORMATS,
    "rollout.openai_endpoint": OPENAI_ENDPOINTS,
}
"""Fields with a fixed set of values: `validate` refuses any other, `describe_config` lists them."""


def _behav_weight_cap_ok(cap) -> bool:
    """`ppo.behav_weight_cap`: null, a number > 1 or a pair [lo, hi] with 0 <= lo < 1 < hi."""

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if cap is None or number(cap):
        return cap is None or cap > 1
    pair = list(cap) if isinstance(cap, (list, tuple)) else []
    return len(pair) == 2 and all(number(x) for x in pair) and 0 <= pair[0] < 1 < pair[1]


def validate(cfg: Config) -> None:
    """Rules across fields; raises ConfigError naming the fields and the fix."""
    a, r, p, c = cfg.allocation, cfg.rollout, cfg.ppo, cfg.cluster

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    m = model_arch(cfg.model)  # the shape fields' own rules, and their agreement with config.json

    need(
        cfg.model.dtype in DTYPE_BYTES,
        f"model.dtype must be {_one_of(tuple(DTYPE_BYTES))} (got '{cfg.model.dtype}')",
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
        ("allocation.train_ep", a.train_ep),
        ("allocation.reward_workers", a.reward_workers),
        ("rollout.max_concurrent", r.max_concurrent),
        ("rollout.prompts_per_step", r.prompts_per_step),
        ("rollout.max_new_tokens", r.max_new_tokens),
        ("rollout.max_turns", r.max_turns),
        ("rollout.tool_output_chars", r.tool_output_chars),
        ("ppo.max_tokens_per_mb", p.max_tokens_per_mb),
        ("ppo.minibatches", p.minibatches),
        ("train.total_steps", cfg.train.total_steps),
        ("train.save_every", cfg.train.save_every),
        ("train.weight_sync_bucket_mb", cfg.train.weight_sync_bucket_mb),
    ]:
        need(value >= 1, f"{name} must be at least 1 (got {value})")
    for name, value in [
        ("cluster.grace_s", c.grace_s),
        ("cluster.cpus_per_node", c.cpus_per_node),
        ("cluster.controller_cpus", c.controller_cpus),
        ("train.save_interval_min", cfg.train.save_interval_min),
        ("train.keep_checkpoints", cfg.train.keep_checkpoints),
    ]:
        need(value >= 0, f"{name} must be >= 0 (got {value})")
    need(
        c.cpus_per_node == 0 or c.cpus_per_node >= c.gpus_per_node,
        f"cluster.cpus_per_node ({c.cpus_per_node}) must be 0 (read from Slurm) or at least the tasks of a trainer "
        f"node (cluster.gpus_per_node = {c.gpus_per_node}): every task needs a CPU",
    )
    need(
        a.reward_nodes == "auto" or (isinstance(a.reward_nodes, int) and a.reward_nodes >= 0),
        f"allocation.reward_nodes must be auto or a number >= 0 (got {a.reward_nodes!r})",
    )
    need(
        not isinstance(a.reward_nodes, int) or a.reward_nodes <= 1 + a.reward_workers,
        f"allocation.reward_nodes ({a.reward_nodes}) must not exceed the controller and reward worker ranks "
        f"(1 + allocation.reward_workers = {1 + a.reward_workers}): every node gets one",
    )
    need(
        r.group_size >= 2 or cfg.distill.teacher.path,
        f"rollout.group_size is {r.group_size}: every advantage is 0 (each ppo.adv_norm centres a reward on its "
        "group's mean), so the run would learn nothing; set rollout.group_size >= 2",
    )
    need(r.max_staleness >= 0, f"rollout.max_staleness must be >= 0 (got {r.max_staleness}); 0 is synchronous RL")
    need(r.temperature > 0, f"rollout.temperature must be > 0 (got {r.temperature})")
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1] (got {r.top_p})")
    need(p.eps_clip > 0, f"ppo.eps_clip must be > 0 (got {p.eps_clip})")
    need(p.eps_clip_high is None or p.eps_clip_high > 0, f"ppo.eps_clip_high must be > 0 (got {p.eps_clip_high})")
    need(
        _behav_weight_cap_ok(p.behav_weight_cap),
        f"ppo.behav_weight_cap must be a number > 1 or a pair [lo, hi] with 0 <= lo < 1 < hi (got "
        f"{p.behav_weight_cap!r}); null keeps every token",
    )
    need(p.lr > 0, f"ppo.lr must be > 0 (got {p.lr})")
    need(p.kl_coef >= 0, f"ppo.kl_coef must be >= 0 (got {p.kl_coef}); 0 is off")
    need(
        p.minibatches <= r.prompts_per_step,
        f"ppo.minibatches ({p.minibatches}) must not exceed rollout.prompts_per_step ({r.prompts_per_step})",
    )
    need(
        p.max_tokens_per_mb >= r.max_new_tokens,
        f"ppo.max_tokens_per_mb ({p.max_tokens_per_mb}) must hold at least one trajectory of rollout.max_new_tokens ({r.max_new_tokens})",
    )
    # A micro-batch holds whole sequences (a longer one gets a micro-batch of its own, over the memory
    # budget). An episode's sequence is bounded by max_episode_tokens, and without it, once the
    # workflow may run several turns, only by the model's context.
    if r.max_episode_tokens > 0:
        longest, bound = r.max_episode_tokens, f"rollout.max_episode_tokens ({r.max_episode_tokens})"
    elif r.workflow != SINGLE_TURN and r.max_turns > 1:
        longest = m.max_position_embeddings
        bound = (
            f"the model's context ({longest}: rollout.max_episode_tokens is 0 and rollout.workflow "
            f"{r.workflow} may run up to rollout.max_turns ({r.max_turns}) turns)"
        )
    else:
        longest, bound = 0, ""  # a single turn: the rule above
    need(
        p.max_tokens_per_mb >= longest,
        f"ppo.max_tokens_per_mb ({p.max_tokens_per_mb}) must hold one whole episode sequence, up to {bound} tokens: "
        "raise ppo.max_tokens_per_mb or set a smaller rollout.max_episode_tokens",
    )
    need(
        r.max_episode_tokens == 0 or r.max_episode_tokens > r.max_new_tokens,
        f"rollout.max_episode_tokens ({r.max_episode_tokens}) must exceed rollout.max_new_tokens "
        f"({r.max_new_tokens}): an episode holds its prompt and at least one whole turn (0: the model's context)",
    )
    need(
        r.max_new_tokens < m.max_position_embeddings,
        f"rollout.max_new_tokens ({r.max_new_tokens}) must be below model.max_position_embeddings ({m.max_position_embeddings})",
    )
    need(
        0 <= r.max_episode_tokens <= m.max_position_embeddings,
        f"rollout.max_episode_tokens must be in [0, model.max_position_embeddings ({m.max_position_embeddings})] "
        f"(got {r.max_episode_tokens}); 0 is the model's context",
    )
    need(r.tool_timeout_s > 0, f"rollout.tool_timeout_s must be > 0 (got {r.tool_timeout_s})")
    need(r.tool_processes >= 0, f"rollout.tool_processes must be >= 0 (got {r.tool_processes}); 0 is one per CPU")
    d = cfg.data
    need(
        not d.system_prompt or d.chat_template,
        "data.system_prompt needs data.chat_template: true (a system turn exists only in a chat template)",
    )
    need(d.max_prompt_tokens >= 0, f"data.max_prompt_tokens must be >= 0 (got {d.max_prompt_tokens}); 0 is the default")
    # A prompt must leave its episode room for one whole turn: a longer one gets a turn cut short, and one
    # that fills the budget (easily, under a small max_episode_tokens) gets no turn: its episode is lost.
    if r.max_episode_tokens:
        budget, bound = r.max_episode_tokens, "rollout.max_episode_tokens"
    else:
        budget, bound = m.max_position_embeddings, "model.max_position_embeddings"
    need(
        d.max_prompt_tokens + r.max_new_tokens <= budget,
        f"data.max_prompt_tokens ({d.max_prompt_tokens}) + rollout.max_new_tokens ({r.max_new_tokens}) must fit "
        f"{bound} ({budget}): a longer prompt leaves its episode no room for one whole turn; lower "
        "data.max_prompt_tokens (0: the longest that fits)",
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
    need(cfg.distill.kl_coef >= 0, f"distill.kl_coef must be >= 0 (got {cfg.distill.kl_coef})")
    need(
        cfg.reward.kind != "none" or cfg.distill.teacher.path,
        "reward.kind none scores every episode 0: the run learns only from a teacher; set distill.teacher.path",
    )
    need(
        cfg.reward.kind != "none" or not r.filter_uniform_groups,
        "reward.kind none gives every group equal rewards: rollout.filter_uniform_groups would leave every one "
        "out; set it false",
    )
    need(
        cfg.sft.examples <= 0 or cfg.reward.kind == "math" or (cfg.reward.kind == "none" and not cfg.data.train_path),
        "sft.examples > 0 needs math rows (the warm start learns 'prompt -> \\boxed{answer}'); "
        f"reward.kind is {cfg.reward.kind}: set sft.examples=0",
    )
    need(0 <= cfg.sft.unboxed < 1, f"sft.unboxed must be in [0, 1) (got {cfg.sft.unboxed})")
    need(0 <= cfg.sft.tool_share <= 1, f"sft.tool_share must be in [0, 1] (got {cfg.sft.tool_share})")
    need(
        cfg.sft.tool_share == 0 or (not cfg.data.train_path and cfg.data.synthetic_task == "multiplication"),
        "sft.tool_share > 0 needs the synthetic multiplication task (its calculator calls are the problems "
        "themselves): set data.synthetic_task=multiplication with data.train_path empty, or sft.tool_share=0",
    )
    need(
        a.gen_share == "auto" or (not isinstance(a.gen_share, str) and 0 < a.gen_share < 1),
        f"allocation.gen_share must be auto or strictly between 0 and 1 (got {a.gen_share!r})",
    )
    # How nodes, GPUs and parallel sizes fit together (the split too, when allocation.gen_gpus is set).
    parallel.check(m, c.nodes, c.gpus_per_node, a.gen_tp, a.train_tp, a.train_pp, a.gen_gpus, a.train_ep)
    need(
        not p.routing_replay or m.moe,
        f"ppo.routing_replay applies to mixture-of-experts models only; model.path is a dense {m.model_type}: "
        "set ppo.routing_replay=false",
    )
    need(
        p.load_balancing_coef is None or p.load_balancing_coef >= 0,
        f"ppo.load_balancing_coef must be >= 0 or null (got {p.load_balancing_coef})",
    )
    balancing = m.router_aux_loss_coef if p.load_balancing_coef is None else p.load_balancing_coef
    need(
        not m.moe or p.loss_agg == "token_mean" or not balancing,
        f"ppo.loss_agg {p.loss_agg} averages over sequences, but Megatron weights a mixture of experts' "
        "load-balancing loss by tokens: its coefficient would grow by a sequence's tokens. Set "
        "ppo.loss_agg=token_mean or ppo.load_balancing_coef=0",
    )
    teacher = teacher_arch(cfg.distill.teacher)
    if teacher is not None:
        name = f"distill.teacher ({cfg.distill.teacher.path})"
        need(
            cfg.distill.teacher.dtype in ("", *DTYPE_BYTES),
            f"distill.teacher.dtype must be {_one_of(tuple(DTYPE_BYTES))} or empty, the model's "
            f"(got '{cfg.distill.teacher.dtype}')",
        )
        need(
            cfg.distill.kl_coef > 0,
            f"distill.kl_coef is 0 with {name}: the teacher would be loaded and never used; set distill.kl_coef > 0 "
            "or leave distill.teacher.path empty",
        )
        need(
            teacher.vocab_size >= m.vocab_size,
            f"{name} has {teacher.vocab_size} embeddings, fewer than the model's {m.vocab_size}: a token the model "
            "samples past them has no teacher logprob",
        )
        need(not teacher.moe, f"{name} is a mixture of experts: a teacher is dense (qwen2, qwen3) for now")
        need(
            teacher.max_position_embeddings >= m.max_position_embeddings,
            f"{name} reads {teacher.max_position_embeddings} positions, the model's context is "
            f"{m.max_position_embeddings}: set model.max_position_embeddings={teacher.max_position_embeddings} "
            "(a cap on the context the run serves)",
        )
        for problem in (
            parallel.train_tp_problem(teacher, a.train_tp, "distill.teacher"),
            parallel.train_pp_problem(teacher, a.train_pp, "distill.teacher"),
        ):
            need(problem is None, f"{name}, split as the model is: {problem}")

    lora = cfg.lora
    need(
        0 <= lora.rank <= VLLM_LORA_RANKS[-1],
        f"lora.rank must be in [0, {VLLM_LORA_RANKS[-1]}] (got {lora.rank}): 0 is full training; vLLM serves "
        f"adapters of rank up to {VLLM_LORA_RANKS[-1]}",
    )
    if lora.rank:
        need(lora.alpha > 0, f"lora.alpha must be > 0 (got {lora.alpha})")
        problem = m.lora_problem(lora.rank, lora.target_modules)
        need(problem is None, str(problem))


def _one_of(options: tuple[str, ...]) -> str:
    """("a", "b", "c") -> "a, b or c", for error messages."""
    return f"{', '.join(options[:-1])} or {options[-1]}" if len(options) > 1 else options[0]
