"""The ``jsonl`` logger: one JSON object per record in ``<run>/metrics.jsonl`` (appended)."""

from __future__ import annotations

import json
from typing import Any

from mt_train import fault_points
from mt_train.config.schema import LoggingConfig
from mt_train.loggers.base import RunInfo

METRICS_FILE = "metrics.jsonl"


class JsonlSink:
    """``{"kind": ..., "step": ..., **metrics}`` per line, flushed at once."""

    def __init__(self, cfg: LoggingConfig, run: RunInfo) -> None:
        self.path = run.output_dir / METRICS_FILE
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        fault_points.disk_write("metrics", self.path)
        self.file.write(json.dumps({"kind": kind, "step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
