"""The metric-logger interface and what every logger is told about the run.

A logger (a *sink*) receives every record the trainer logs, on rank 0 only::

    sink.log(step, kind, metrics)    # kind: train, eval, anomaly, rewind, event
    sink.close()

``metrics`` maps names to floats, ints or strings (NaNs already dropped); names with a ``/``
(``time/data``) group related values. A sink is built by a factory
``factory(cfg: LoggingConfig, run: RunInfo) -> MetricSink`` registered under a name through
the ``mt_register_loggers`` hook (:mod:`mt_train.loggers.registry`).

:func:`run_info` gathers what a run is: its folder, id, the full config as plain data and the
git commit of the mt source tree it runs from (None outside a git checkout);
:func:`write_run_record` stores it as ``<run>/run.json`` next to the metrics.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

RUN_RECORD = "run.json"


class MetricSink(Protocol):
    """Where logged records go (module docstring)."""

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunInfo:
    """What a logger factory is told about the run."""

    output_dir: Path
    run_id: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    """The whole :class:`~mt_train.config.TrainConfig` as plain data."""
    git_commit: str | None = None
    """``git rev-parse HEAD`` of the mt source tree (with ``-dirty`` for uncommitted edits)."""


def git_commit(folder: Path | None = None) -> str | None:
    """The commit of the git checkout holding ``folder`` (mt's own source by default)."""
    where = folder or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def run_info(cfg: Any, output_dir: Path, run_id: str) -> RunInfo:
    """The :class:`RunInfo` of a run with config dataclass ``cfg``."""
    return RunInfo(output_dir, run_id, dataclasses.asdict(cfg), git_commit())


def write_run_record(run: RunInfo, world_size: int, resumed_at: int) -> Path:
    """Append this launch to ``<run>/run.json`` (one JSON object per line: a resumed run
    keeps the record of every launch)."""
    record = {
        "run_id": run.run_id,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": run.git_commit,
        "torch": torch.__version__,
        "world_size": world_size,
        "resumed_at_step": resumed_at,
        "config": run.config,
    }
    path = run.output_dir / RUN_RECORD
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record, default=str) + "\n")
    return path
