"""Schemas of the ``profiling`` config group and the ``comm`` section (see :mod:`mt_train.profiling`
and :mod:`mt_train.watchdog`).

Steps are 1-based and name the optimizer step being computed, as in the ``fault`` group:
``profiling.steps=[5,6]`` profiles the steps that make the step counter 5 and 6. A window
``[a, b]`` records ``b - a + 1`` steps after ``warmup`` steps whose events are discarded (the
profiler's own start-up cost lands there); with ``every = N > 0`` the window repeats at
``a + k·N`` for k = 0, 1, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mt_train.config.rewind import _check_int

SNAPSHOT_STACKS = ("python", "all")


@dataclass
class ProfilingConfig:
    """torch.profiler traces and CUDA memory snapshots over a window of steps."""

    enabled: bool = False
    """Run ``torch.profiler`` (CPU and, where present, CUDA activities) over the window and write
    one Chrome/Perfetto trace per rank and window to ``<run>/<folder>/``."""
    steps: list[int] = field(default_factory=lambda: [3, 4])
    """First and last step of the window (inclusive, 1-based)."""
    every: int = 0
    """Repeat the window every this many steps (0: once)."""
    warmup: int = 1
    """Steps profiled just before the window whose events are thrown away."""
    record_shapes: bool = False
    """Record every op's input shapes (larger traces)."""
    with_stack: bool = False
    """Record Python stacks of every op (much larger traces)."""
    profile_memory: bool = False
    """Record tensor allocations in the trace (the profiler's memory view)."""
    memory_snapshot: bool = False
    """Record the CUDA allocator's history from the window's first step and write the snapshot
    pickle (for https://pytorch.org/memory_viz) after its last step; recording then continues,
    so an out-of-memory error later in the run writes a snapshot too. CUDA only."""
    memory_snapshot_entries: int = 100_000
    """Allocator events kept in the history (a ring buffer)."""
    memory_snapshot_stacks: str = "python"
    """Stacks recorded with each allocation: ``python`` (cheap) or ``all`` (C++ frames too;
    symbolising them makes writing the snapshot much slower)."""
    folder: str = "profile"
    """Where traces and snapshots go, relative to the run folder."""

    def __post_init__(self) -> None:
        if len(self.steps) != 2:
            raise ValueError(f"profiling.steps must be [first, last], got {list(self.steps)}")
        first, last = self.steps
        _check_int("profiling", "steps[0]", first, 1)
        _check_int("profiling", "steps[1]", last, first)
        _check_int("profiling", "warmup", self.warmup, 0)
        _check_int("profiling", "every", self.every, 0)
        _check_int("profiling", "memory_snapshot_entries", self.memory_snapshot_entries, 1)
        if self.warmup >= first:
            raise ValueError(
                f"profiling.warmup={self.warmup} needs as many steps before the window, which "
                f"starts at step {first}; use profiling.warmup<{first} or a later window"
            )
        length = last - first + 1
        if self.every and self.every < length + self.warmup:
            raise ValueError(
                f"profiling.every={self.every} is shorter than a window of {length} steps plus "
                f"{self.warmup} warm-up steps; use profiling.every>={length + self.warmup} or 0"
            )
        if self.memory_snapshot_stacks not in SNAPSHOT_STACKS:
            raise ValueError(
                f"profiling.memory_snapshot_stacks={self.memory_snapshot_stacks!r} is unknown; "
                f"valid: {', '.join(SNAPSHOT_STACKS)}"
            )
        if not self.folder or self.folder.startswith(("/", "..")):
            raise ValueError(
                f"profiling.folder={self.folder!r} must be a relative path inside the run folder"
            )

    @property
    def active(self) -> bool:
        """Whether anything is recorded at all."""
        return self.enabled or self.memory_snapshot

    def window_of(self, step: int) -> tuple[int, int] | None:
        """The window ``(first, last)`` whose warm-up or recording covers ``step``, or None."""
        first, last = self.steps
        if step < first - self.warmup:
            return None
        if self.every:
            k = (step - first + self.warmup) // self.every
            first, last = first + k * self.every, last + k * self.every
        return (first, last) if step <= last else None


@dataclass
class CommConfig:
    """Collective timeouts and PyTorch's NCCL flight recorder."""

    timeout_s: float = 600.0
    """A collective that waits longer than this fails (``init_process_group(timeout=...)``);
    the trainer reports which rank and which collective in one line."""
    trace_buffer_size: int = 0
    """Collectives kept per rank by PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE`` /
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 0: off). With it on, a timed-out NCCL collective dumps
    every rank's buffer to ``<run>/flight_recorder/rank_<r>``; read them with
    ``torchfrtrace <run>/flight_recorder -p rank_``."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"comm.timeout_s must be > 0 seconds, got {self.timeout_s}")
        _check_int("comm", "trace_buffer_size", self.trace_buffer_size, 0)
