"""mt-train's built-in metric loggers, registered through ``mt_register_loggers`` like a
third-party plugin's (the tracker libraries are imported by the factories, on use)."""

from __future__ import annotations

from typing import Any

from mt_core import hookimpl


def _jsonl(cfg: Any, run: Any) -> Any:
    from mt_train.loggers.jsonl import JsonlSink

    return JsonlSink(cfg, run)


def _tensorboard(cfg: Any, run: Any) -> Any:
    from mt_train.loggers.tensorboard import TensorBoardSink

    return TensorBoardSink(cfg, run)


def _wandb(cfg: Any, run: Any) -> Any:
    from mt_train.loggers.wandb import WandbSink

    return WandbSink(cfg, run)


def _mlflow(cfg: Any, run: Any) -> Any:
    from mt_train.loggers.mlflow import MlflowSink

    return MlflowSink(cfg, run)


@hookimpl
def mt_register_loggers(registry: Any) -> None:
    registry.add("jsonl", _jsonl)
    registry.add("tensorboard", _tensorboard)
    registry.add("wandb", _wandb)
    registry.add("mlflow", _mlflow)
