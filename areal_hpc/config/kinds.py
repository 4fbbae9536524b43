"""What a resumed run may change: every config field is of one of three kinds, listed once here.

```
 operational  where and how the run executes: the cluster, the node counts and the TP/PP/DP split,
              checkpoint cadence and retention, timeouts, logging, eval, the run's length.
              A resume changes it freely and says so.
 training     the experiment's hyperparameters: the loss, the optimizer, sampling, the batch.
              A resume changes it only when asked (`--allow-change ppo.lr`, or a whole section:
              `--allow-change ppo`); the change is recorded with the step it starts after.
 identity     what makes it another experiment, whose checkpoint and data stream would mean nothing
              for this one: the model (and its warm start), the data, the reward function, the seed,
              the group size and the staleness bound. A resume never changes it.
```

A key is a section (every field of it: a field added to the section falls in its kind) or one dotted
field; a section whose fields differ in kind lists each, so that a field added there must be placed
(tests/test_config.py checks that every field is in exactly one kind).
"""

from __future__ import annotations

import dataclasses

from areal_hpc.config.schema import Config, section_class
from areal_hpc.errors import ConfigError

OPERATIONAL, TRAINING, IDENTITY = "operational", "training", "identity"

KINDS: dict[str, tuple[str, ...]] = {
    OPERATIONAL: (
        "experiment.name",
        "experiment.trial",
        "experiment.root",
        "experiment.resume",
        "cluster",
        "allocation",
        "train",  # total_steps (a finished run is extended), save cadence, retention, timeouts
        "rollout.max_concurrent",
        "rollout.tool_timeout_s",
        "rollout.tool_processes",
        "ppo.max_tokens_per_mb",  # how a step is cut into micro-batches, not what it computes
        "ppo.recompute",
        "ppo.sequence_parallel",
        "reward.timeout_s",
        "reward.processes",
        "eval",
        "logging",
    ),
    TRAINING: (
        "rollout.prompts_per_step",
        "rollout.max_new_tokens",
        "rollout.temperature",
        "rollout.top_p",
        "rollout.interruptible",
        "rollout.filter_uniform_groups",
        "rollout.max_turns",
        "rollout.max_episode_tokens",
        "rollout.tool_output_chars",
        "ppo.eps_clip",
        "ppo.eps_clip_high",
        "ppo.behav_weight_cap",
        "ppo.adv_norm",
        "ppo.lr",
        "ppo.lr_warmup_steps",
        "ppo.lr_decay",
        "ppo.min_lr",
        "ppo.weight_decay",
        "ppo.adam_beta1",
        "ppo.adam_beta2",
        "ppo.adam_eps",
        "ppo.grad_clip",
        "ppo.minibatches",
        "ppo.mask_truncated",
        "ppo.prox_logp",
        "ppo.kl_coef",
        "ppo.routing_replay",
        "ppo.load_balancing_coef",
        "reward.overlong_penalty",
        "reward.overlong_buffer",
    ),
    IDENTITY: (
        "experiment.seed",  # the tiny model, the synthetic data and the prompt order are drawn from it
        "model",
        "sft",  # the warm start is the initial policy (and the KL reference)
        "data",
        "reward.kind",
        "rollout.group_size",
        "rollout.max_staleness",
        "rollout.workflow",  # what an episode is
        "rollout.tool_format",
    ),
}
"""Each kind's keys: a section, or a `section.field`."""


def config_fields() -> list[str]:
    """Every field of `Config` as `section.field`."""
    return [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section_class(section))
    ]


def kinds_of(field: str) -> list[str]:
    """The kinds whose keys cover `field` (`section.field`, or an entry of a mapping field such as
    `cluster.env.NAME`): exactly one for every field of Config."""
    parts = field.split(".")
    covering = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return [kind for kind, keys in KINDS.items() for key in keys if key in covering]


def kind_of(field: str) -> str:
    (kind,) = kinds_of(field)
    return kind


def allowed_fields(allow_change: list[str]) -> dict[str, str]:
    """The training fields that `--allow-change` names (a field, or a section: its training fields), each
    with the argument that named it. A name that is no field or section, or names only identity fields,
    is refused: an identity field never changes on resume."""
    fields = config_fields()
    allowed = {}
    for name in allow_change:
        covered = [f for f in fields if f == name or f.startswith(f"{name}.")]
        if not covered:
            raise ConfigError(f"--allow-change {name}: no such config field or section (see areal-hpc --config-help)")
        if all(kind_of(f) == IDENTITY for f in covered):
            raise ConfigError(
                f"--allow-change {name}: {name} is identity, which a resumed run never changes; "
                "pick another experiment.trial, or start afresh with --fresh"
            )
        allowed.update({f: name for f in covered if kind_of(f) == TRAINING})
    return allowed
