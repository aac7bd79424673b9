"""How much communication a profile hides behind computation: interval arithmetic on the device
kernels of a ``torch.profiler`` run.

Kernels whose name contains ``nccl`` are communication, every other device kernel is
computation (memory copies and sets included: they occupy the device too). With ``C`` the union
of the communication intervals and ``K`` that of the computation intervals (over all streams)::

    comm_ms      = |C|          time some collective was running
    compute_ms   = |K|          time some other kernel was running
    overlapped   = |C ∩ K|      collective time hidden behind computation
    exposed_ms   = |C| − |C ∩ K|

``overlap = overlapped / |C|`` (1: every collective ran under computation). Exposed time is an
upper bound on what communication costs the step: an NCCL kernel that waits for a peer is
"running" while it waits, so stragglers and skew count as communication here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty intervals dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two disjoint sorted interval lists (outputs of :func:`union`)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_communication(name: str) -> bool:
    return "nccl" in name.lower()


def summarize(kernels: Iterable[tuple[str, float, float]], steps: int = 1) -> dict[str, Any]:
    """``kernels``: (name, start, end) in microseconds; per-step figures in milliseconds."""
    comm, compute, count = [], [], 0
    for name, start, end in kernels:
        count += 1
        (comm if is_communication(name) else compute).append((start, end))
    c, k = union(comm), union(compute)
    both = length(intersection(c, k))
    per_step = 1e-3 / max(steps, 1)
    return {
        "kernels": count,
        "comm_kernels": len(comm),
        "comm_ms": length(c) * per_step,
        "compute_ms": length(k) * per_step,
        "overlapped_ms": both * per_step,
        "exposed_comm_ms": (length(c) - both) * per_step,
        "overlap": both / length(c) if c else None,
    }


def device_kernels(profiler: Any) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every device kernel a finished ``torch.profiler`` recorded."""
    from torch.autograd import DeviceType

    kernels = []
    for event in profiler.events():
        if event.device_type != DeviceType.CPU and event.time_range.end > event.time_range.start:
            kernels.append((event.name, event.time_range.start, event.time_range.end))
    return kernels
