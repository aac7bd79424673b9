"""The ``mlflow`` logger: MLflow tracking (``logging.mlflow=true``).

One MLflow run per launch in experiment ``logging.mlflow_experiment``, at
``logging.mlflow_tracking_uri`` (null: an SQLite store ``<run>/mlflow.db`` with artifacts in
``<run>/mlartifacts``, viewed with ``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db``;
MLflow 3 refuses its old file store by default). The whole config is stored as the run's
``config.json`` artifact (MLflow params are capped in length and number), the run id and git
commit as tags; values are logged as ``<kind>/<name>`` at their step (MLflow keeps every value
of a step, so rewound steps are kept).
"""

from __future__ import annotations

from typing import Any

from mt_train.config.schema import LoggingConfig
from mt_train.loggers.base import RunInfo


class MlflowSink:
    """Numeric values of every record to one MLflow run (module docstring)."""

    def __init__(self, cfg: LoggingConfig, run: RunInfo) -> None:
        try:
            import mlflow
        except ImportError as err:
            raise ImportError(
                "logging.mlflow=true needs MLflow: pip install 'mt-train[mlflow]'"
            ) from err
        self.mlflow = mlflow
        name = cfg.mlflow_experiment
        if cfg.mlflow_tracking_uri is None:
            mlflow.set_tracking_uri(f"sqlite:///{run.output_dir / 'mlflow.db'}")
            if mlflow.get_experiment_by_name(name) is None:
                artifacts = (run.output_dir / "mlartifacts").as_uri()
                mlflow.create_experiment(name, artifact_location=artifacts)
        else:
            mlflow.set_tracking_uri(cfg.mlflow_tracking_uri)
        mlflow.set_experiment(name)
        mlflow.start_run(run_name=run.output_dir.name)
        mlflow.set_tags({"mt.run_id": run.run_id, "mt.git_commit": str(run.git_commit)})
        mlflow.log_dict(run.config, "config.json")

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        values = {
            f"{kind}/{key}": float(value)
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        if values:
            self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
