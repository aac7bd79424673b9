"""Shared input quantization: layers that read one tensor quantize it once.

Layers that read the same tensor one after the other (the q/k/v projections of one normalised
input, gate/up of the MLP) would each quantize it. With current scaling (every recipe but
delayed) ``q = quantize(x)`` depends only on ``x``, the recipe and the amax group, so the last
input's FP8 operands (``x`` and, when the wgrad GEMM needs it, ``xᵀ``) are kept in one
process-wide entry, keyed like the weight cache (:mod:`mt_fp8.weight_cache`): the same owner
tensor by weak reference, storage pointer, shape, strides, dtype, device and ``_version``, plus
the recipe, amax group and whether ``xᵀ`` is needed. A layer whose input matches reuses them and
then also saves the same FP8 ``xᵀ`` for backward. Health counts are added to each layer's own
counters as if it had quantized ``x`` itself.

Delayed scaling shares only between layers whose INPUT scales are tied
(:func:`mt_fp8.state.tie_input_scales`; the key then also holds the owning meta and its
``scale_version``): untied layers have scales of their own. Compiled graphs always quantize.

The entry is process-wide, not per layer: the readers that share are consecutive calls, and one
entry keeps at most one extra FP8 copy of an activation alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mt_fp8.formats import TensorRole
from mt_fp8.quantized import QuantizedTensor
from mt_fp8.recipes import DelayedScaling

if TYPE_CHECKING:
    from mt_fp8.linear_plan import LinearPlan


@dataclass(frozen=True)
class _SharedInput:
    key: tuple[Hashable, ...]
    owner: weakref.ref
    input_q: QuantizedTensor
    """FP8 ``x``, with ``xᵀ`` in ``input_q.transposed`` once a layer has made it."""
    health_counts: torch.Tensor
    """The health counts quantizing ``x`` added (zeros when health was not tracked)."""


_last: _SharedInput | None = None
"""The last FP8 input operand (module docstring)."""


def _input_key(plan: LinearPlan, x_MK: torch.Tensor, transposed: bool) -> tuple[Hashable, ...]:
    scales: tuple[int, int, bool] | None = None
    if isinstance(plan.recipe, DelayedScaling):
        # Layers share a delayed-scaling operand only through one INPUT meta (tied scales).
        scale_meta = plan.meta.input_meta
        scales = (id(scale_meta), scale_meta.scale_version, scale_meta.scales_ready)
    return (
        x_MK.data_ptr(),
        tuple(x_MK.shape),
        x_MK.stride(),
        x_MK.dtype,
        x_MK.device,
        x_MK._version,
        plan.recipe,
        plan.reduction_group(TensorRole.INPUT),
        transposed,
        scales,
    )


def quantize_shared_input(
    plan: LinearPlan, x_MK: torch.Tensor, transposed: bool
) -> QuantizedTensor:
    """``x`` quantized as ``plan``'s INPUT operand, reused from the previous layer when it read
    the same tensor under the same key (module docstring)."""
    global _last
    role = TensorRole.INPUT
    if torch.compiler.is_compiling():
        return plan.quantize(x_MK, role, record=True, transposed=transposed)
    key = _input_key(plan, x_MK, transposed)
    owner = x_MK._base if x_MK._base is not None else x_MK
    health = plan.health_stats(role)
    last = _last
    if last is not None and last.key == key and last.owner() is owner:
        if health is not None:
            health += last.health_counts
        return last.input_q
    before = None if health is None else health.clone()
    x_q = plan.quantize(x_MK, role, record=True, transposed=transposed)
    counts = torch.zeros_like(plan.meta.health[int(role)]) if health is None else health - before
    _last = _SharedInput(key, weakref.ref(owner), x_q, counts)
    return x_q
