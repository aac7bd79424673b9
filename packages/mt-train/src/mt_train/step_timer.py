"""Where a step's time goes: named phases between boundaries, summed over a log interval.

The trainer calls :meth:`StepTimer.start` with a phase name at fixed points of the loop; each
phase lasts until the next one starts, so the phases partition the time between two log points
exactly::

    data | forward_backward | grad_sync | optimizer | logging | eval | checkpoint | rewind

* ``data``: drawing and collating the step's micro-batches and copying them to the device (on
  an accelerator: the time the device waited for them);
* ``forward_backward``: the micro-batches' forward and backward, with the gradient reduction
  that DDP / FSDP2 overlap with the backward (its exposed tail is inside this phase);
* ``grad_sync``: from the end of the backward to the gradient norm: the flat all-reduce
  (``data_parallel=none``), ZeRO-1's reduce-scatter, and the norm's own all-reduces;
* ``optimizer``: the step's one host read-out, the anomaly judgement and the update;
* ``logging``, ``eval``, ``checkpoint``, ``rewind``: the stalls of writing metrics, of
  validation, of (the synchronous part of) a checkpoint save and of a rewind.

On a device with streams each boundary is an event recorded on the current stream, so a phase
is device time between two points of the stream: nothing synchronises until the log point
(which synchronises anyway to measure throughput); boundaries whose events have completed
(``Event.query()``, no wait) are folded into per-phase totals as new ones arrive, so only the
few in flight are held, whether or not anyone asks for a summary. On the CPU boundaries are
host clock readings. Either way ``sum(phases) = wall time between log points`` up to the launch latency of
the first and last event; :meth:`summary` reports each phase as seconds per healthy step
(``time/<phase>``), ``time/step`` (their sum), the slowest rank's ``time/step`` (one
``all_reduce(MAX)`` of a single number per log point: a straggler shows as
``time/step_max > time/step``) and, on devices with a caching allocator, its reserved memory
(``mem_reserved_gib``).

With a profiler recording (:mod:`mt_train.profiling`) each phase is also a
``torch.profiler.record_function`` range named ``mt.<phase>``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import profiler

import mt_comm
from mt_train import ranks

PHASES = (
    "data",
    "forward_backward",
    "grad_sync",
    "optimizer",
    "logging",
    "eval",
    "checkpoint",
    "rewind",
)


class StepTimer:
    """Phase boundaries of the steps since the last :meth:`summary` (module docstring)."""

    def __init__(self, device: Any, enabled: bool = True) -> None:
        self.device, self.enabled = device, enabled
        self.use_events = enabled and device.has_streams
        self.annotate = False
        """Open a ``record_function`` range per phase (set while a profiler records)."""
        self._range: Any = None
        self._pending: list[tuple[str, Any]] = []
        """Boundaries not yet folded into ``_totals``: (phase that starts there, mark)."""
        self._totals = dict.fromkeys(PHASES, 0.0)

    def _now(self) -> Any:
        if self.use_events:
            event = self.device.event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, phase: str) -> None:
        """End the current phase and start ``phase``."""
        if phase not in PHASES:
            raise ValueError(f"unknown step phase {phase!r}; valid: {', '.join(PHASES)}")
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.annotate:
            self._range = profiler.record_function(f"mt.{phase}")
            self._range.__enter__()
        if not self.enabled:
            return
        self._pending.append((phase, self._now()))
        self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Add every phase whose end mark is reached (all of them with ``wait``) to the totals."""
        pending = self._pending
        done = 0
        while done + 1 < len(pending):
            (phase, begin), (_, end) = pending[done], pending[done + 1]
            if self.use_events and not wait and not end.query():
                break
            self._totals[phase] += self._elapsed(begin, end)
            done += 1
        del pending[:done]

    def _elapsed(self, start: Any, end: Any) -> float:
        if self.use_events:
            return start.elapsed_time(end) / 1e3
        return end - start

    def summary(self, steps: int, world_group: Any = None) -> dict[str, float]:
        """Seconds per step of every phase since the last call, over ``steps`` healthy steps.
        The phase in progress ends here and ``logging`` starts. Call on every rank (one
        collective)."""
        if not self.enabled or not self._pending:
            return {}
        self.start("logging")
        if self.use_events:
            self._pending[-1][1].synchronize()
        self._fold(wait=True)
        totals, self._totals = self._totals, dict.fromkeys(PHASES, 0.0)
        per_step = max(steps, 1)
        out = {f"time/{phase}": total / per_step for phase, total in totals.items()}
        out["time/step"] = sum(totals.values()) / per_step
        slowest = torch.tensor([out["time/step"]], dtype=torch.float64, device=self._home())
        if ranks.active(world_group):
            mt_comm.all_reduce(slowest, op="max", group=world_group)
        out["time/step_max"] = float(slowest[0])
        stats = self.device.memory_stats()
        if "reserved" in stats:  # a caching allocator's (the CPU reports none)
            out["mem_reserved_gib"] = stats["reserved"] / 2**30
        return out

    def _home(self) -> torch.device:
        return self.device.torch_device() if self.device.type != "cpu" else torch.device("cpu")

    def close(self) -> None:
        """Close an open profiler range."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
