"""mt-train: the Hydra trainer (model families as plug-ins, Llama built in; packed data,
checkpoints, rewind, metrics, HF interop)."""

from mt_train.config import TrainConfig, compose_config, to_train_config
from mt_train.summary import TrainSummary
from mt_train.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "TrainConfig",
    "TrainSummary",
    "Trainer",
    "__version__",
    "compose_config",
    "to_train_config",
]
