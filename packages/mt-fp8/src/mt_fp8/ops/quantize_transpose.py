"""Single-pass FP8 quantize + transpose + amax, for tensorwise scales.

FP8 GEMMs need a tensor quantized along both axes (``x`` for one GEMM, ``xᵀ`` for the other).
Given the dequantization scale ``s`` (delayed scaling: from the history), one pass over
``x_RC`` writes ``q_RC = sat(rne(x · s⁻¹))`` (``s⁻¹ = RN(1 / s)``), its transpose ``q_CR`` and ``amax = max|x|`` (for the
next step's scale), reading ``x`` once. With ``scale=None`` (current scaling) the scale must be
known before any cast (FP8 supports no arithmetic afterwards), so an amax reduction pass runs
first, the amax is MAX-reduced over ``amax_group`` if one is given, and
``s = scale_from_amax(amax)`` (:mod:`mt_fp8.quantized`: zero → 1, at least ``2^-126``,
non-finite → NaN). ``stats`` accumulates the health counts of
:func:`mt_fp8.quantized.cast_to_fp8`.

Both paths give the same bytes: ``s⁻¹`` is an IEEE fp32 division and ``x · s⁻¹`` an IEEE
round-to-nearest fp32 product in each (PyTorch's ``reciprocal`` and tensor product;
``div.rn.f32`` and ``mul.rn.f32`` in the kernel), followed by the same clamp and the same
round-to-nearest-even cast. A NaN in ``x`` makes the returned amax ``+inf`` on both paths.

:func:`swiglu_quantize_transpose_amax` quantizes ``x = silu(gate)·up`` (in ``gate``'s dtype,
as :func:`mt_fp8.ops.swiglu.swiglu` returns it) the same way without ever storing ``x``: the
kernel computes each tile of ``x`` from tiles of ``gate`` and ``up`` (in both launches under
current scaling). Same bytes, scale and amax as ``quantize_transpose_amax(swiglu(gate, up))``;
it saves the write and the read of ``x`` (2 bytes each per element for bf16).

Not differentiable: it produces GEMM operands inside FP8 layers' forward and backward, on
tensors whose gradient those layers compute themselves. CUDA tensors run
:mod:`mt_fp8.kernels.quantize`; elsewhere, and inside ``torch.compile`` graphs (where Inductor
fuses it; see :mod:`mt_fp8.linear_plan`), the plain-PyTorch path below.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mt_fp8.formats import FP8Format
from mt_fp8.ops.dispatch import use_triton
from mt_fp8.ops.swiglu import swiglu_values
from mt_fp8.quantized import (
    TENSORWISE,
    QuantizedTensor,
    cast_to_fp8,
    reduce_amax_,
    scale_from_amax,
)


def quantize_transpose_amax(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    scale: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor]:
    """``(q_RC, q_CR, amax)`` with one tensorwise scale; see the module docstring.

    The returned ``amax`` is the one the scale was computed from: reduced over ``amax_group``
    when one is given (current scaling only; with a given ``scale`` the group is refused).
    """
    _check_operand("quantize_transpose_amax", x_RC)
    return _quantize_transpose_amax(x_RC, None, fmt, scale, stats, amax_group)


def swiglu_quantize_transpose_amax(
    gate_RC: torch.Tensor,
    up_RC: torch.Tensor,
    fmt: FP8Format,
    scale: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor]:
    """:func:`quantize_transpose_amax` of ``silu(gate)·up``, which is never stored (module
    docstring); ``gate`` and ``up`` have one shape and dtype."""
    _check_operand("swiglu_quantize_transpose_amax", gate_RC)
    if up_RC.shape != gate_RC.shape or up_RC.dtype != gate_RC.dtype:
        raise ValueError(
            f"swiglu_quantize_transpose_amax needs gate and up of one shape and dtype, got "
            f"{tuple(gate_RC.shape)} {gate_RC.dtype} and {tuple(up_RC.shape)} {up_RC.dtype}"
        )
    return _quantize_transpose_amax(gate_RC, up_RC, fmt, scale, stats, amax_group)


def _check_operand(name: str, x_RC: torch.Tensor) -> None:
    if x_RC.dim() != 2 or not x_RC.is_floating_point() or x_RC.element_size() == 1:
        raise ValueError(
            f"{name} takes a 2-D float32/bfloat16/float16 tensor, got "
            f"{tuple(x_RC.shape)} {x_RC.dtype}"
        )


def _quantize_transpose_amax(
    x_RC: torch.Tensor,
    up_RC: torch.Tensor | None,
    fmt: FP8Format,
    scale: torch.Tensor | None,
    stats: torch.Tensor | None,
    amax_group: dist.ProcessGroup | None,
) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor]:
    """``x_RC`` quantized, or ``silu(x_RC)·up_RC`` when ``up_RC`` is given."""
    if amax_group is not None and scale is not None:
        raise ValueError("amax_group reduces the amax of current scaling; a scale was given")
    if use_triton(x_RC) and not torch.compiler.is_compiling():
        from mt_fp8.kernels.quantize import quantize_transpose_amax_triton

        data_RC, data_CR, scale_11, amax = quantize_transpose_amax_triton(
            x_RC, fmt, scale, stats, amax_group, up_RC
        )
    else:
        if up_RC is not None:
            x_RC = swiglu_values(x_RC, up_RC)
        amax = x_RC.abs().amax().float()
        amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)
        if scale is None:
            if amax_group is not None:
                reduce_amax_(amax, amax_group)
            scale = scale_from_amax(amax, fmt)
        scale_11 = scale.float().reshape(1, 1).clone()
        data_RC = cast_to_fp8(x_RC, scale_11, fmt, stats)
        data_CR = data_RC.t().contiguous()
    return (
        QuantizedTensor(data_RC, scale_11, TENSORWISE, fmt),
        QuantizedTensor(data_CR, scale_11, TENSORWISE, fmt),
        amax,
    )
