"""What a resumed run may change: every config field is of one of three kinds on resume, declared with
the field in areal_hpc.config.schema:

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

A section whose fields are all of one kind declares it once, on its field of `Config`
(`cluster: ClusterConfig = operational(factory=ClusterConfig)`): a field added there falls in its kind.
In the other sections each field declares its own (`lr: float = training(2e-5)`), so that a field added
there must be placed: a field of no kind, or of two, fails the import (`declared_kinds`). The resume
rules that read the kinds are `areal_hpc.config.resume`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, field
from typing import Any

OPERATIONAL, TRAINING, IDENTITY = "operational", "training", "identity"
"""The kinds on resume (above)."""


def _of_kind(kind: str, default: Any, factory: Callable[[], Any] | Any) -> Any:
    return field(default=default, default_factory=factory, metadata={"kind": kind})


def operational(default: Any = MISSING, *, factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A field of kind operational, with its default (or `factory`, as `field`'s default_factory); on
    `Config`, a section all of whose fields are."""
    return _of_kind(OPERATIONAL, default, factory)


def training(default: Any = MISSING, *, factory: Callable[[], Any] | Any = MISSING) -> Any:
    """As `operational`, of kind training."""
    return _of_kind(TRAINING, default, factory)


def identity(default: Any = MISSING, *, factory: Callable[[], Any] | Any = MISSING) -> Any:
    """As `operational`, of kind identity."""
    return _of_kind(IDENTITY, default, factory)


def declared_kinds(config: type) -> dict[str, str]:
    """Every field of `config` (a `Config`: sections whose defaults are their classes) as `section.field`,
    with the kind that it or its section declares. A field that declares no kind in a section that
    declares none, or one in a section that declares one, is a TypeError: every field is of exactly one
    kind."""
    kinds = {}
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(section.default_factory):
            name = f"{section.name}.{f.name}"
            declared = [meta["kind"] for meta in (section.metadata, f.metadata) if "kind" in meta]
            if not declared:
                raise TypeError(
                    f"config field {name} declares no kind on resume: give it one, as operational(default), "
                    "training(default) or identity(default) (areal_hpc.config.kinds)"
                )
            if len(declared) > 1:
                raise TypeError(
                    f"config field {name} declares a kind on resume, and so does its section {section.name}: "
                    "a field is of exactly one kind (areal_hpc.config.kinds)"
                )
            (kinds[name],) = declared
    return kinds
