"""The typed config tree: schema, YAML loading with overrides, and cross-field validation."""

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.loader import config_to_dict, load_config, save_config
from mcore_rl.config.schema import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SFTConfig,
    TrainConfig,
)
from mcore_rl.config.validate import DerivedSizes, validate_sft_config
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.config.rl_validate import validate_rl_config

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DerivedSizes",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RLConfig",
    "SFTConfig",
    "TrainConfig",
    "config_to_dict",
    "load_config",
    "save_config",
    "validate_sft_config",
    "validate_rl_config",
]
