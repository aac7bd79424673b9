"""The ``wandb`` logger: Weights & Biases, offline by default (``logging.wandb=true``).

One W&B run per mt run folder: its id is mt's run id, its files live in ``<run>/wandb``
(``wandb sync <run>/wandb/offline-run-*`` uploads an offline run later), its config is mt's
whole config plus the git commit. Values are logged as ``<kind>/<name>`` against a ``step``
metric of their own rather than W&B's internal step, because a rewind takes the trainer's
step back and W&B drops records whose internal step goes backwards.
"""

from __future__ import annotations

from typing import Any

from mt_train.config.schema import LoggingConfig
from mt_train.loggers.base import RunInfo

STEP_METRIC = "step"


class WandbSink:
    """Numeric values of every record to one W&B run (module docstring)."""

    def __init__(self, cfg: LoggingConfig, run: RunInfo) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "logging.wandb=true needs Weights & Biases: pip install 'mt-train[wandb]'"
            ) from err
        self.run = wandb.init(
            project=cfg.wandb_project,
            mode=cfg.wandb_mode,
            dir=str(run.output_dir),
            name=run.output_dir.name,
            id=run.run_id or None,
            resume="allow",
            config={**run.config, "git_commit": run.git_commit},
        )
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        values = {
            f"{kind}/{key}": value
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        if values:
            self.run.log({STEP_METRIC: step, **values})

    def close(self) -> None:
        self.run.finish()
