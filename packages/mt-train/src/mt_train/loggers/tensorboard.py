"""The ``tensorboard`` logger: scalars ``<kind>/<name>`` in ``<run>/tensorboard``."""

from __future__ import annotations

from typing import Any

from mt_train.config.schema import LoggingConfig
from mt_train.loggers.base import RunInfo


class TensorBoardSink:
    """Every numeric value as a scalar at its step."""

    def __init__(self, cfg: LoggingConfig, run: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "logging.tensorboard=true needs TensorBoard: pip install 'mt-train[tensorboard]'"
            ) from err
        self.writer = SummaryWriter(str(run.output_dir / "tensorboard"))

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()
