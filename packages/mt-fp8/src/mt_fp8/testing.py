"""Test support. :func:`run_without_synchronizing`: does a step run on CUDA without waiting
for the device (no device-to-host read)? The rest, for deferred weight gradients: does a caller
of ``WeightGradSink.defer`` name every tensor its closure keeps alive (:mod:`mt_fp8.wgrad`,
"What a queued closure holds")?

What the closure reaches is found by walking it: the contents of its cells, recursively
through nested functions, tuples, lists and :class:`~mt_fp8.quantized.QuantizedTensor`
payloads (``data``, ``scale``, ``transposed``). Other objects (a plan, a segment table) are not
entered, so the walk finds a subset of what the closure holds: a tensor it finds outside
``holds`` is one the caller forgot.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

import torch

from mt_fp8.quantized import QuantizedTensor
from mt_fp8.wgrad import WeightGradSink


def run_without_synchronizing(step: Callable[[], object]) -> None:
    """Run ``step`` once (Triton kernels compile, caches fill), then again with CUDA's sync
    debug mode at ``error``, so that any synchronization of the host with the device in the
    second run raises."""
    step()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def reached_tensors(compute: Callable[[], None]) -> list[torch.Tensor]:
    """The tensors ``compute``'s closure reaches (module docstring)."""
    found: list[torch.Tensor] = []
    pending: list[object] = [compute]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, QuantizedTensor):
            pending += [item.data, item.scale, item.transposed]
        elif isinstance(item, tuple | list):
            pending += item
        elif isinstance(item, types.FunctionType):
            for cell in item.__closure__ or ():
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # a variable the enclosing function never assigned
                    continue
    return found


def watch_unheld(sink: WeightGradSink, exclude: Iterable[torch.Tensor]) -> list[int]:
    """Watch ``sink``: for each computation queued from now on, the number of tensors its
    closure reaches whose storage is neither in its ``holds`` nor in ``exclude`` (the
    parameters) is appended to the returned list."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    counts: list[int] = []

    def observe(compute: Callable[[], None], held: list[torch.Tensor]) -> None:
        named = excluded | {t.untyped_storage().data_ptr() for t in held}
        reached = reached_tensors(compute)
        counts.append(sum(t.untyped_storage().data_ptr() not in named for t in reached))

    sink.observers.append(observe)
    return counts
