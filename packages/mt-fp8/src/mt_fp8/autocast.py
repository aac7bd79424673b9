"""``fp8_autocast``: turn FP8 on or off, or override the recipe, for a region of code.

FP8 layers run with their own recipe outside any ``fp8_autocast``. Inside one, the innermost
context decides: ``enabled=False`` runs them as plain high-precision ``F.linear``; a ``recipe``
overrides theirs; an ``amax_group`` (a ``torch.distributed`` ProcessGroup, typically the TP
group the caller built) is recorded on each layer that runs (``fp8_meta.amax_group``). Delayed
scaling: :func:`~mt_fp8.state.update_fp8_scales` then MAX-reduces the step's amaxes over it.
Current tensorwise scaling: each quantization of a role in the layer's
``amax_reduction_roles`` MAX-reduces its amax over it before computing the scale, so every rank
of a tensor-parallel layer uses the scale of the whole (unsharded) tensor
(:mod:`mt_fp8.linear_plan`).
The state is thread-local, like ``torch.autocast``'s.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from mt_fp8.recipes import Recipe


@dataclass(frozen=True)
class FP8AutocastState:
    """One ``fp8_autocast`` region's settings."""

    enabled: bool
    """Run FP8 layers in FP8 (True) or as plain high-precision linears (False)."""
    recipe: Recipe | None
    """Recipe overriding each layer's own, or None to keep theirs."""
    amax_group: dist.ProcessGroup | None
    """Process group over which amaxes are reduced (delayed and current tensorwise scaling)."""


_local = threading.local()


def _stack() -> list[FP8AutocastState]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_fp8_state() -> FP8AutocastState | None:
    """The innermost active ``fp8_autocast`` settings, or None outside any."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> Iterator[FP8AutocastState]:
    """Region in which FP8 layers use these settings (see the module docstring)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"fp8_autocast(recipe=...) takes an mt_fp8 Recipe, got {recipe!r}")
    state = FP8AutocastState(bool(enabled), recipe, amax_group)
    _stack().append(state)
    try:
        yield state
    finally:
        _stack().pop()
