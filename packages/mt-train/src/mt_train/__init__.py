"""mt-train: the Hydra trainer (model families as plug-ins, Llama built in; packed data,
checkpoints, rewind, metrics, HF interop).

The exports below load on first use (PEP 562 ``__getattr__``), so a command that needs only a
light submodule (``mt-prepare-data``: ``mt_train.data.prepare``) starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mt_train.config import TrainConfig, compose_config, to_train_config
    from mt_train.summary import TrainSummary
    from mt_train.trainer import Trainer

__version__ = "0.1.0"

_EXPORTS = {
    "TrainConfig": "mt_train.config",
    "TrainSummary": "mt_train.summary",
    "Trainer": "mt_train.trainer",
    "compose_config": "mt_train.config",
    "to_train_config": "mt_train.config",
}

__all__ = [
    "TrainConfig",
    "TrainSummary",
    "Trainer",
    "__version__",
    "compose_config",
    "to_train_config",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mt_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
