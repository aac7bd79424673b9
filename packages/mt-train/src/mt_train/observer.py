"""What the trainer tells the observability tools, in one object: :class:`RunObserver`.

The trainer calls :meth:`RunObserver.begin_step` as each step begins and marks the step's
phases on :attr:`RunObserver.timer`; the observer forwards to

* the step-time breakdown (:mod:`mt_train.step_timer`, ``logging.step_breakdown``),
* the profiler window and memory snapshots (:mod:`mt_train.profiling`, ``profiling.*``),
* the step watchdog (:mod:`mt_train.watchdog`, ``trainer.step_timeout_s``),

and keeps what the end-of-run summary reports (:class:`RunStats`): the best interval's
tokens/s and MFU, the peak memory, and the files the profiler wrote.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mt_train.config.schema import TrainConfig
from mt_train.profiling import Profiler
from mt_train.step_timer import StepTimer
from mt_train.watchdog import StepWatchdog


@dataclass
class RunStats:
    """The run's throughput extremes over log intervals (``Throughput.measure`` records)."""

    best_tokens_per_s: float = 0.0
    best_mfu: float | None = None
    peak_memory_gib: float = 0.0
    traces: list[str] = field(default_factory=list)

    def record(self, measured: dict[str, float]) -> None:
        self.best_tokens_per_s = max(self.best_tokens_per_s, measured.get("tok/s", 0.0))
        if "mfu" in measured:
            self.best_mfu = max(self.best_mfu or 0.0, measured["mfu"])
        self.peak_memory_gib = max(self.peak_memory_gib, measured.get("mem_gib", 0.0))


def _announce_on(rank: int) -> Any:
    def announce(line: str) -> None:
        if rank == 0:
            print(f"mt-train: {line}", file=sys.stderr, flush=True)

    return announce


class RunObserver:
    """The timer, profiler and watchdog of one run (module docstring)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, rank: int, device: Any) -> None:
        self.timer = StepTimer(device, enabled=cfg.logging.step_breakdown)
        self.profiler = Profiler(cfg.profiling, run_dir, rank, device.type, _announce_on(rank))
        timeout = cfg.trainer.step_timeout_s
        self.watchdog = (
            StepWatchdog(timeout, run_dir, rank, flight_recorder=cfg.comm.trace_buffer_size > 0)
            if timeout is not None
            else None
        )
        self.stats = RunStats()

    def begin_step(self, step: int) -> None:
        """Step ``step`` (1-based) begins: its ``data`` phase starts."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
        self.timer.close()  # the previous phase's profiler range ends in the previous step
        self.profiler.begin_step(step)
        self.timer.annotate = self.profiler.recording(step)
        self.timer.start("data")

    def at_log_point(self, measured: dict[str, float], steps: int) -> dict[str, float]:
        """A log point measured ``measured`` over ``steps`` healthy steps: keep the summary's
        extremes and return the step-time breakdown (every rank calls this)."""
        self.stats.record(measured)
        return self.timer.summary(steps)

    def end_run(self) -> None:
        """The loop is over: write what the profiler holds and stop watching steps."""
        self.timer.close()
        self.profiler.stop()
        if self.watchdog is not None:
            self.watchdog.pause()
        self.stats.traces = [str(p) for p in self.profiler.traces + self.profiler.snapshots]

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
