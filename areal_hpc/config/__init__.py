"""The run configuration: OmegaConf over dataclasses, one small dataclass per section.

```
 schema.py    the sections and their fields, each documented once by the string under it and declared
              with its kind on resume: operational, training (--allow-change) or identity
 load.py      YAML file + `section.field=value` overrides -> a validated Config; writing one back
 validate.py  the rules across fields (the parallel sizes: areal_hpc.parallel; the model's shape:
              areal_hpc.arch), and the fields with a fixed set of values (CHOICES)
 kinds.py     the three kinds on resume, and how a field declares its own
 resume.py    each field's kind looked up, and what `--allow-change` allows
 help.py      the field docs read from the source: `areal-hpc --config-help`
```

Errors a user can make (unknown keys, wrong types, rules across fields) raise `ConfigError` with a
message that names the key and says what to do; the CLI prints it and exits with code 2. This package
is what the rest of the project imports the configuration from.
"""

from areal_hpc.config.help import describe_config, field_docs
from areal_hpc.config.kinds import IDENTITY, OPERATIONAL, TRAINING
from areal_hpc.config.load import load_config, save_config
from areal_hpc.config.resume import allowed_fields, kind_of
from areal_hpc.config.schema import (
    SINGLE_TURN,
    AllocationConfig,
    ClusterConfig,
    Config,
    DataConfig,
    EvalConfig,
    ExperimentConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)
from areal_hpc.config.validate import CHOICES, validate
from areal_hpc.errors import ConfigError

__all__ = [
    "CHOICES",
    "IDENTITY",
    "OPERATIONAL",
    "SINGLE_TURN",
    "TRAINING",
    "AllocationConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ExperimentConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "PPOConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainConfig",
    "allowed_fields",
    "describe_config",
    "field_docs",
    "kind_of",
    "load_config",
    "save_config",
    "validate",
]
