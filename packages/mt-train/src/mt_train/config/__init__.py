"""Config schemas and their registration with Hydra."""

from mt_train.config.rewind import DETECTORS, SKIP_POLICIES, FaultConfig, RewindConfig
from mt_train.config.schema import (
    CheckpointConfig,
    DataConfig,
    FP8Config,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
    TrainerConfig,
)
from mt_train.config.store import compose_config, register_configs, to_train_config

__all__ = [
    "CheckpointConfig",
    "DETECTORS",
    "SKIP_POLICIES",
    "DataConfig",
    "FP8Config",
    "FaultConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RewindConfig",
    "SchedulerConfig",
    "TrainConfig",
    "TrainerConfig",
    "compose_config",
    "register_configs",
    "to_train_config",
]
