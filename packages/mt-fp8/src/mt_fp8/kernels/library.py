"""The Triton quantizers as ``torch.library`` custom ops, for use inside ``torch.compile`` graphs.

Under ``torch.compile`` an FP8 layer calls these instead of the Triton launchers directly:
Dynamo records each as one opaque call (its shapes come from the fake implementations below),
and Inductor schedules it between the kernels it generates, so a compiled FP8 layer runs the
same quantization kernels, with the same bytes, as the eager one, instead of Inductor's own
fused version of the plain-PyTorch path. Eager code keeps calling the launchers directly (no
dispatcher overhead).

* ``mt_fp8::quantize_transpose_amax(x, fp8_dtype, scale?, stats?)`` →
  ``(q_RC, q_CR, scale_11, amax)``: :func:`mt_fp8.kernels.quantize.quantize_transpose_amax_triton`
  (tensorwise, no amax group).
* ``mt_fp8::quantize_rows(x, fp8_dtype, stats?)`` → ``(q_RC, scale_R1)``:
  :func:`mt_fp8.kernels.rowwise_quantize.quantize_rows`.

``stats`` (the layer's int64 health counters for one role) is incremented in place, which the
ops declare (``mutates_args``) so that the compiled graph orders and keeps the update. Outputs
never alias inputs or each other, as custom ops require.
"""

from __future__ import annotations

import torch

from mt_fp8.formats import FP8Format
from mt_fp8.kernels.quantize import quantize_transpose_amax_triton
from mt_fp8.kernels.rowwise_quantize import quantize_rows

_FORMATS = {fmt.dtype: fmt for fmt in FP8Format}


def fp8_format(fp8_dtype: torch.dtype) -> FP8Format:
    """The :class:`FP8Format` stored as ``fp8_dtype``."""
    if fp8_dtype not in _FORMATS:
        raise ValueError(f"{fp8_dtype} is no FP8 format; expected one of {list(_FORMATS)}")
    return _FORMATS[fp8_dtype]


@torch.library.custom_op("mt_fp8::quantize_transpose_amax", mutates_args=("stats",))
def quantize_transpose_amax_op(
    x_RC: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    stats: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_RC, q_CR, scale_11, amax)`` of the tensorwise quantize + transpose + amax kernel."""
    return quantize_transpose_amax_triton(x_RC, fp8_format(fp8_dtype), scale, stats)


@quantize_transpose_amax_op.register_fake
def _(x_RC, fp8_dtype, scale, stats):
    rows, cols = x_RC.shape
    return (
        x_RC.new_empty(rows, cols, dtype=fp8_dtype),
        x_RC.new_empty(cols, rows, dtype=fp8_dtype),
        x_RC.new_empty(1, 1, dtype=torch.float32),
        x_RC.new_empty((), dtype=torch.float32),
    )


@torch.library.custom_op("mt_fp8::quantize_rows", mutates_args=("stats",))
def quantize_rows_op(
    x_RC: torch.Tensor, fp8_dtype: torch.dtype, stats: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_RC, scale_R1)`` of the rowwise quantization kernel."""
    quantized = quantize_rows(x_RC, fp8_format(fp8_dtype), stats)
    return quantized.data, quantized.scale


@quantize_rows_op.register_fake
def _(x_RC, fp8_dtype, stats):
    rows, cols = x_RC.shape
    return x_RC.new_empty(rows, cols, dtype=fp8_dtype), x_RC.new_empty(rows, 1, dtype=torch.float32)
