"""Profiler traces and CUDA memory snapshots over a window of steps (config group ``profiling``).

:class:`Profiler` is told when each step begins (:meth:`Profiler.begin_step`, 1-based step
numbers as in :mod:`mt_train.config.observability`) and drives two of PyTorch's tools:

* ``torch.profiler.profile`` with CPU and (on CUDA) CUDA activities. Its schedule is a function
  of the step about to run rather than of a call count, so a resumed or rewound run profiles
  the same absolute steps: steps ``first - warmup .. first - 1`` are WARMUP, ``first .. last``
  RECORD, ``last`` RECORD_AND_SAVE. Each window becomes one Chrome trace per rank,
  ``<run>/<folder>/rank<r>_step<first>-<last>.pt.trace.json`` (Perfetto, ``chrome://tracing``
  and TensorBoard's profiler plugin read it). Kernels appear under their own names (FP8 GEMMs,
  Triton kernels, CUDA-graph replays); while a window records, the trainer's step phases are
  ``mt.<phase>`` ranges (:mod:`mt_train.step_timer`).
* ``torch.cuda.memory._record_memory_history``: started at the window's first step; after its
  last step the allocator history is written to ``rank<r>_memory_step<first>-<last>.pickle``
  (https://pytorch.org/memory_viz). Recording continues afterwards (a ring buffer of
  ``memory_snapshot_entries`` events), so an out-of-memory error later writes
  ``rank<r>_oom.pickle`` (:meth:`Profiler.oom_snapshot`, called by ``mt-train`` on
  ``torch.OutOfMemoryError``). The CPU allocator keeps no such history, so on a run without
  CUDA ``profiling.memory_snapshot=true`` is refused at start-up.

The first file written is announced once (one line on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import profiler

from mt_train.config.observability import ProfilingConfig

MEMORY_VIZ = "https://pytorch.org/memory_viz"


def check_memory_snapshot(cfg: ProfilingConfig, device_type: str) -> None:
    """Raise unless ``device_type`` can record memory history when ``cfg`` asks for it."""
    if cfg.memory_snapshot and device_type != "cuda":
        raise ValueError(
            f"profiling.memory_snapshot=true records the CUDA allocator's history, but this run "
            f"is on {device_type!r}; run on a CUDA device or set profiling.memory_snapshot=false "
            "(profiling.profile_memory=true records CPU allocations in the trace)"
        )


class Profiler:
    """The run's profiler window and memory snapshots (module docstring)."""

    def __init__(
        self,
        cfg: ProfilingConfig,
        run_dir: Path,
        rank: int,
        device_type: str,
        announce: Callable[[str], None],
    ) -> None:
        check_memory_snapshot(cfg, device_type)
        self.cfg, self.rank, self.device_type = cfg, rank, device_type
        self.folder = run_dir / cfg.folder
        self.announce = announce
        self.traces: list[Path] = []
        self.snapshots: list[Path] = []
        self._announced = False
        self._prof: Any = None
        self._step = 0
        self._saving: tuple[int, int] | None = None
        self._memory_recording = False
        self._dump_after: tuple[int, int] | None = None

    # ------------------------------------------------------------------ schedule
    def action(self, step: int) -> profiler.ProfilerAction:
        """What the profiler does during step ``step`` (module docstring)."""
        window = self.cfg.window_of(step)
        if window is None:
            return profiler.ProfilerAction.NONE
        first, last = window
        if step < first:
            return profiler.ProfilerAction.WARMUP
        if step < last:
            return profiler.ProfilerAction.RECORD
        self._saving = window
        return profiler.ProfilerAction.RECORD_AND_SAVE

    def recording(self, step: int) -> bool:
        """Whether the trace records (or warms up) during ``step``."""
        return self.cfg.enabled and self.cfg.window_of(step) is not None

    # ------------------------------------------------------------------ steps
    def begin_step(self, step: int) -> None:
        """Step ``step`` is about to run: advance the profiler, start or dump memory history."""
        self._step = step
        if self.cfg.memory_snapshot:
            self._memory(step)
        if not self.cfg.enabled:
            return
        if self._prof is None:
            self._prof = self._new_profiler()
            self._prof.start()  # asks the schedule about self._step
        else:
            self._prof.step()

    def _new_profiler(self) -> Any:
        activities = [profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(profiler.ProfilerActivity.CUDA)
        return profiler.profile(
            activities=activities,
            schedule=lambda _count: self.action(self._step),
            on_trace_ready=self._write_trace,
            record_shapes=self.cfg.record_shapes,
            with_stack=self.cfg.with_stack,
            profile_memory=self.cfg.profile_memory,
        )

    def _write_trace(self, prof: Any) -> None:
        first, last = self._saving or self.cfg.window_of(self._step) or self.cfg.steps
        path = self.folder / f"rank{self.rank}_step{first}-{last}.pt.trace.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        self._announce(
            f"profiler trace: {path} (one per rank and window; open in https://ui.perfetto.dev "
            f"or `tensorboard --logdir {self.folder}`)"
        )

    def _memory(self, step: int) -> None:
        if self._dump_after is not None and step > self._dump_after[1]:
            self._dump(*self._dump_after)
        window = self.cfg.window_of(step)
        if window is not None and step == window[0]:
            if not self._memory_recording:
                torch.cuda.memory._record_memory_history(
                    stacks=self.cfg.memory_snapshot_stacks,
                    max_entries=self.cfg.memory_snapshot_entries,
                )
                self._memory_recording = True
            self._dump_after = window

    def _dump(self, first: int, last: int, name: str | None = None) -> Path:
        name = name or f"memory_step{first}-{last}"
        path = self.folder / f"rank{self.rank}_{name}.pickle"
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        self.snapshots.append(path)
        self._dump_after = None
        self._announce(f"memory snapshot: {path} (drag it into {MEMORY_VIZ})")
        return path

    def _announce(self, line: str) -> None:
        if not self._announced:
            self._announced = True
            self.announce(line)

    def oom_snapshot(self) -> Path | None:
        """Write the memory history now (after an out-of-memory error), if it is recorded."""
        if not self._memory_recording:
            return None
        return self._dump(self._step, self._step, name="oom")

    def stop(self) -> None:
        """End of training: write a window cut short and stop recording."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self._dump_after is not None:
            self._dump(*self._dump_after)
        if self._memory_recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory_recording = False
