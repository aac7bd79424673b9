"""Metric loggers: the interface, the run's metadata, and the registry behind
``logging.jsonl`` / ``tensorboard`` / ``wandb`` / ``mlflow`` and ``logging.loggers``."""

from mt_train.loggers.base import (
    RUN_RECORD,
    MetricSink,
    RunInfo,
    git_commit,
    run_info,
    write_run_record,
)
from mt_train.loggers.registry import build_sinks, enabled_loggers, logger_factories

__all__ = [
    "RUN_RECORD",
    "MetricSink",
    "RunInfo",
    "build_sinks",
    "enabled_loggers",
    "git_commit",
    "logger_factories",
    "run_info",
    "write_run_record",
]
