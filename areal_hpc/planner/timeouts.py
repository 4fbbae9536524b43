"""Whether a run's timeouts outlast what the planner predicts its normal work takes (`check_timeouts`): a
normal run must not be ended as hung. Checked where a GPU run is launched, beside `check_fits`; a CPU
run's figures are this machine's, not the planner's GPUs', so it is not checked.

```
 rollout.interruptible false   at a weight update the trainers wait in the broadcast while the generators
                               finish the answers they hold: up to the longest answer decoded at full load
                               -> train.collective_timeout_s and train.rank_timeout_s must outlast it
 every run                     a trainer rank says nothing to the controller during a training step
                               -> train.rank_timeout_s must outlast the predicted step
```

Each with MARGIN, since the planner's figures are predictions (docs/planner.md says how close).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_hpc.errors import ConfigError
from areal_hpc.planner.cost import COST, CostModel, Hardware, Lengths, ModelSize, Plan
from areal_hpc.planner.predict import full_load_step_s, plan_cost, predict

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config

MARGIN = 1.5
"""A timeout must exceed the predicted duration by this factor."""


def drain_s(cfg: Config, cost: CostModel = COST) -> float:
    """The longest a generator takes to finish the answers it holds at full load: the longest answer of a
    step, a token per decode step of an engine running as many trajectories as its KV cache holds."""
    r, plan = cfg.rollout, Plan.of(cfg)
    cost, _ = plan_cost(cfg, plan, cost)
    m, hw, lengths = ModelSize.from_config(cfg), Hardware.from_config(cfg), Lengths.from_config(cfg, cost)
    engines = plan.layout(cfg).generators
    step = full_load_step_s(m, hw, lengths, engines, plan.gen_tp, r.max_concurrent * r.group_size, cost)
    return lengths.longest(r.prompts_per_step * r.group_size) * step


def check_timeouts(cfg: Config, cost: CostModel = COST) -> None:
    """ConfigError naming the timeouts a normal run of `cfg` would exceed, by the planner's figures, and the
    value each needs."""
    t, problems = cfg.train, []
    if not cfg.rollout.interruptible:
        drain = drain_s(cfg, cost)
        for name in ("collective_timeout_s", "rank_timeout_s"):
            if getattr(t, name) < MARGIN * drain:
                problems.append(
                    f"train.{name} ({getattr(t, name):g} s) is below the {drain:,.0f} s a generator may take to "
                    f"finish its answers at a weight update (rollout.interruptible is false: the trainers wait in "
                    f"the broadcast; the longest answer decoded at full load, by the planner): raise it to at "
                    f"least {MARGIN * drain:,.0f}, or set rollout.interruptible=true"
                )
    step = predict(cfg, cost=cost).t_train
    if t.rank_timeout_s < MARGIN * step and not any("rank_timeout_s" in p for p in problems):
        problems.append(
            f"train.rank_timeout_s ({t.rank_timeout_s:g} s) is below the {step:,.0f} s the planner predicts for a "
            f"training step, when a trainer rank says nothing: raise it to at least {MARGIN * step:,.0f}"
        )
    if problems:
        raise ConfigError(f"{cfg.experiment.name}: a normal run would be ended as hung: " + "; ".join(problems))
