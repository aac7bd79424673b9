"""Triton rowwise quantization (one scale per row), bit-identical to
``quantize(x, fmt, ROWWISE)`` (:func:`mt_fp8.quantized.quantize`).

Shape suffixes: R rows, C columns (the contraction axis), P programs.

Each program owns ``ROWS`` consecutive rows and walks them in ``ROWS × BLOCK_C`` tiles twice:

    pass 1:  amax_r = max_c |x[r, c]|         (NaN counted as +inf, as the other kernels do)
             s_r    = scale_from_amax(amax_r)  (the shared ``_scale_from_amax``: IEEE division,
                                                floor 2^-126, 1 for zero rows, NaN if non-finite)
    pass 2:  q[r, c] = sat(rne(x[r, c] · s_r⁻¹)) (s_r⁻¹ = RN(1 / s_r); ``mul.rn.f32``,
                                                NaN-propagating clamp, RNE cast)

The second pass re-reads the program's rows, mostly from L2. Health counts (saturated, flushed,
elements) go to the program's own slot of a ``(P, 3)`` partials buffer and one PyTorch sum adds
them to the caller's counters (no same-address atomics; see :mod:`mt_fp8.kernels.quantize`).

The transposed operand of the rowwise recipe (``xᵀ`` with one scale per column of ``x``, the
wgrad and dgrad GEMMs' operand) is :func:`quantize_columns_transposed`, two kernels on
``COLUMN_TILE`` tiles of ``x`` itself (no high-precision transpose copy):

    _column_amax_partials:  a[p, c] = max_{r in tile row p} |x[r, c]|     (P = ⌈R / 128⌉ partials)
                            amax_c  = max_p a[p, c]                       (one PyTorch amax)
    _quantize_columns:      s_c = scale_from_amax(amax_c),  qᵀ[c, r] = sat(rne(x[r, c] · s_c⁻¹))

:func:`quantize_group_columns_transposed` is the second kernel for rows in groups (the grouped
expert GEMMs' wgrad operands, :mod:`mt_fp8.grouped`): given per-(group, column) scales and each
row's group, ``qᵀ[c, r] = sat(rne(x[r, c] · s_{group(r), c}⁻¹))`` for all groups in one launch.

``qᵀ`` is stored transposed from registers for bf16 and fp16 inputs; fp32 inputs store the
column-scaled tile untransposed into an ``(R, C)`` buffer and PyTorch's FP8 (byte) transpose
copy makes ``qᵀ`` from it, because Triton's transposed FP8 store gave garbage for fp32 inputs on
the H200 (:mod:`mt_fp8.kernels.quantize`). Before, ``xᵀ`` was ``x.t().contiguous()`` and then the
row kernel: those high-precision transpose copies took about a third of a graphed FP8Linear
step (docs/benchmarks-log.md).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from mt_fp8.formats import FP8Format
from mt_fp8.kernels.quantize import (
    _mul_rn,
    _reciprocal,
    _scale_from_amax,
    _store_fp8,
    cast_arguments,
)
from mt_fp8.quantized import MIN_SCALE, ROWWISE, QuantizedTensor

ROWS = 4
"""Rows per program."""
BLOCK_C = 1024
"""Columns per tile of the two passes."""

COLUMN_TILE = (128, 64, 4)
"""Rows, columns and warps per program of the column kernels (the tile of
:mod:`mt_fp8.kernels.block_quantize`'s ``_group_columns``, the fastest of its sweep)."""

FUSED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the kernel takes (fp64 stays on the PyTorch path, which divides in fp64)."""


@triton.jit
def _rowwise_quantize(
    x_ptr,
    q_ptr,
    scale_ptr,
    stats_partial_ptr,
    R,
    C,
    fmt_max,
    min_scale,
    saturation,
    half_subnormal,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    STATS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    in_rows = rows < R
    row_offs = rows.to(tl.int64)[:, None] * C
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = in_rows[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        magnitude = tl.where(x != x, float("inf"), tl.abs(x))
        amax = tl.maximum(amax, tl.max(magnitude, axis=1))
    scale = _scale_from_amax(amax, fmt_max, min_scale, EXACT_DIV)
    tl.store(scale_ptr + rows, scale, mask=in_rows)
    inverse_scale_tile = tl.broadcast_to(_reciprocal(scale, EXACT_DIV)[:, None], (ROWS, BLOCK_C))
    # int32 row counts (at most C each; int64 arithmetic is slower on the GPU).
    saturated = tl.zeros([ROWS], dtype=tl.int32)
    flushed = tl.zeros([ROWS], dtype=tl.int32)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = in_rows[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scaled = _mul_rn(x, inverse_scale_tile, EXACT_DIV)
        if STATS:
            scaled_magnitude = tl.abs(scaled)  # masked elements are zeros: counted in neither
            saturated += tl.sum((scaled_magnitude >= saturation).to(tl.int32), axis=1)
            flushed += tl.sum(
                ((scaled_magnitude < half_subnormal) & (scaled_magnitude > 0)).to(tl.int32), axis=1
            )
        clamped = tl.clamp(scaled, -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL)
        _store_fp8(q_ptr + row_offs + cols[None, :], clamped, mask, MANTISSA, BIAS, SOFTWARE_CAST)
    if STATS:
        elements = tl.sum(in_rows.to(tl.int64), axis=0) * C
        tl.store(stats_partial_ptr + 3 * pid, tl.sum(saturated.to(tl.int64), axis=0))
        tl.store(stats_partial_ptr + 3 * pid + 1, tl.sum(flushed.to(tl.int64), axis=0))
        tl.store(stats_partial_ptr + 3 * pid + 2, elements)


def _check_input(x_RC: torch.Tensor) -> None:
    if x_RC.dim() != 2 or x_RC.dtype not in FUSED_INPUT_DTYPES:
        raise ValueError(
            "the Triton rowwise quantizer takes a 2-D bfloat16, float16 or float32 tensor, got "
            f"{tuple(x_RC.shape)} {x_RC.dtype}"
        )


def quantize_rows(
    x_RC: torch.Tensor, fmt: FP8Format, stats: torch.Tensor | None = None
) -> QuantizedTensor:
    """``x`` with one scale per row; bit-identical to ``quantize(x, fmt, ROWWISE, stats=stats)``.

    ``stats`` (int64, 3 elements), if given, is incremented by the health counts of
    :func:`mt_fp8.quantized.cast_to_fp8`.
    """
    _check_input(x_RC)
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    device = x_RC.device
    q_RC = torch.empty(rows, cols, device=device, dtype=fmt.dtype)
    scale_R1 = torch.empty(rows, 1, device=device, dtype=torch.float32)
    programs = triton.cdiv(rows, ROWS)
    stats_partial = (
        torch.empty(programs, 3, device=device, dtype=torch.int64) if stats is not None else None
    )
    if programs:  # an empty launch grid is an error
        _rowwise_quantize[(programs,)](
            x_RC,
            q_RC,
            scale_R1,
            stats_partial if stats_partial is not None else scale_R1,
            rows,
            cols,
            min_scale=MIN_SCALE,
            STATS=stats is not None,
            **cast_arguments(fmt),
            ROWS=ROWS,
            BLOCK_C=BLOCK_C,
        )
        if stats is not None and stats_partial is not None:
            stats += stats_partial.sum(0)
    return QuantizedTensor(q_RC, scale_R1, ROWWISE, fmt)


@triton.jit
def _column_amax_partials(x_ptr, partial_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``partial[pid_r, c]``: the amax of column ``c`` over this program's BLOCK_R rows (NaN
    counted as +inf)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = cols < C
    mask = (rows < R)[:, None] & in_cols[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    magnitude = tl.where(x != x, float("inf"), tl.abs(x))
    tl.store(partial_ptr + pid_r.to(tl.int64) * C + cols, tl.max(magnitude, axis=0), mask=in_cols)


@triton.jit
def _cast_column_tile(
    x_ptr,
    q_ptr,
    inverse,
    rows,
    cols,
    R,
    C,
    fmt_max,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """The tile ``x[rows, cols]`` times ``inverse`` (its reciprocal scales, tile-shaped),
    clamped and cast to FP8, stored transposed (TRANSPOSE) into ``qᵀ`` (C, R) or untransposed
    into the (R, C) buffer: the cast of both column quantizers."""
    in_rows, in_cols = rows < R, cols < C
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    mask = in_rows[:, None] & in_cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    clamped = tl.clamp(
        _mul_rn(x, inverse, EXACT_DIV), -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL
    )
    if TRANSPOSE:
        offs_t = cols.to(tl.int64)[:, None] * R + rows[None, :]
        mask_t = in_cols[:, None] & in_rows[None, :]
        _store_fp8(q_ptr + offs_t, tl.trans(clamped), mask_t, MANTISSA, BIAS, SOFTWARE_CAST)
    else:
        _store_fp8(q_ptr + offs, clamped, mask, MANTISSA, BIAS, SOFTWARE_CAST)


@triton.jit
def _quantize_columns(
    x_ptr,
    q_ptr,
    amax_ptr,
    scale_ptr,
    R,
    C,
    fmt_max,
    min_scale,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """One BLOCK_R × BLOCK_C tile of ``x`` scaled by its columns' scales, stored transposed
    (TRANSPOSE) into ``qᵀ`` (C, R) or untransposed into the (R, C) buffer; the first row of
    programs stores the scales."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = cols < C
    scale = _scale_from_amax(
        tl.load(amax_ptr + cols, mask=in_cols, other=0.0), fmt_max, min_scale, EXACT_DIV
    )
    if pid_r == 0:
        tl.store(scale_ptr + cols, scale, mask=in_cols)
    inverse = tl.broadcast_to(_reciprocal(scale, EXACT_DIV)[None, :], (BLOCK_R, BLOCK_C))
    _cast_column_tile(
        x_ptr, q_ptr, inverse, rows, cols, R, C, fmt_max,
        MANTISSA, BIAS, EXACT_DIV, SOFTWARE_CAST, TRANSPOSE,
    )  # fmt: skip


def quantize_columns_transposed(x_RC: torch.Tensor, fmt: FP8Format) -> QuantizedTensor:
    """``xᵀ`` (C, R) with one scale per row of ``xᵀ`` (per column of ``x``); bit-identical to
    ``quantize(x.t(), fmt, ROWWISE)`` and to ``quantize_rows(x.t().contiguous(), fmt)``, without
    the high-precision transpose copy (module docstring). No health counts: as for every
    transposed operand, they are counted on ``x``'s own quantization."""
    _check_input(x_RC)
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    device = x_RC.device
    q_CR = torch.empty(cols, rows, device=device, dtype=fmt.dtype)
    scale_C1 = torch.empty(cols, 1, device=device, dtype=torch.float32)
    if rows == 0:  # empty rows of xᵀ: amax 0, scale 1 (as quantize_rows gives them)
        scale_C1.fill_(1.0)
        return QuantizedTensor(q_CR, scale_C1, ROWWISE, fmt)
    if cols == 0:
        return QuantizedTensor(q_CR, scale_C1, ROWWISE, fmt)
    block_r, block_c, _ = COLUMN_TILE
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    partial = torch.empty(grid[0], cols, device=device, dtype=torch.float32)
    _column_amax_partials[grid](x_RC, partial, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c)
    amax_C = partial.amax(dim=0)
    _launch_column_cast(_quantize_columns, x_RC, q_CR, fmt, amax_C, scale_C1, min_scale=MIN_SCALE)
    return QuantizedTensor(q_CR, scale_C1, ROWWISE, fmt)


def _launch_column_cast(
    kernel: Any, x_RC: torch.Tensor, q_CR: torch.Tensor, fmt: FP8Format, *tensors: Any, **extra: Any
) -> None:
    """Run a column-cast kernel (``kernel(x, q, *tensors, R, C, ...)``) over ``COLUMN_TILE``
    tiles of the non-empty ``x_RC`` into ``q_CR``: transposed in the kernel for 16-bit inputs,
    else into an (R, C) buffer copied transposed afterwards (module docstring)."""
    rows, cols = x_RC.shape
    block_r, block_c, warps = COLUMN_TILE
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    fused = x_RC.dtype != torch.float32  # see the module docstring
    target = q_CR if fused else torch.empty(rows, cols, device=x_RC.device, dtype=fmt.dtype)
    arguments = {
        k: v for k, v in cast_arguments(fmt).items() if k not in ("saturation", "half_subnormal")
    }
    kernel[grid](
        x_RC,
        target,
        *tensors,
        rows,
        cols,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        TRANSPOSE=fused,
        num_warps=warps,
        **extra,
        **arguments,
    )
    if not fused:
        q_CR.copy_(target.t())  # FP8 tensors support no arithmetic; a transpose is a copy


@triton.jit
def _quantize_group_columns(
    x_ptr,
    q_ptr,
    scale_ptr,
    group_ptr,
    R,
    C,
    fmt_max,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """``_quantize_columns`` with each row's columns scaled by its group's column scales
    ``scale[group[r], c]`` (given), stored transposed (TRANSPOSE) or untransposed."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows, in_cols = rows < R, cols < C
    mask = in_rows[:, None] & in_cols[None, :]
    group = tl.load(group_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    scale = tl.load(scale_ptr + group[:, None] * C + cols[None, :], mask=mask, other=1.0)
    _cast_column_tile(
        x_ptr, q_ptr, _reciprocal(scale, EXACT_DIV), rows, cols, R, C, fmt_max,
        MANTISSA, BIAS, EXACT_DIV, SOFTWARE_CAST, TRANSPOSE,
    )  # fmt: skip


def quantize_group_columns_transposed(
    x_RC: torch.Tensor, scale_GC: torch.Tensor, group_R: torch.Tensor, fmt: FP8Format
) -> torch.Tensor:
    """``xᵀ`` (C, R) FP8, each row ``r`` of ``x`` scaled by its group's column scales
    ``scale_GC[group_R[r]]`` (fp32, from :func:`~mt_fp8.quantized.scale_from_amax`): for the
    rows of each group, bit-identical to ``quantize(x_g.t(), fmt, ROWWISE).data`` with those
    scales (the cast of :func:`quantize_columns_transposed`). The grouped wgrad operands of
    :mod:`mt_fp8.grouped`, all groups side by side in one launch."""
    _check_input(x_RC)
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    if scale_GC.dtype != torch.float32 or scale_GC.dim() != 2 or scale_GC.shape[1] != cols:
        raise ValueError(
            f"scale_GC must be fp32 of shape (groups, {cols}), got {tuple(scale_GC.shape)} "
            f"{scale_GC.dtype}"
        )
    if group_R.shape != (rows,):
        raise ValueError(f"group_R must hold one group index per row ({rows}), got {group_R.shape}")
    device = x_RC.device
    q_CR = torch.empty(cols, rows, device=device, dtype=fmt.dtype)
    if rows == 0 or cols == 0:
        return q_CR
    _launch_column_cast(
        _quantize_group_columns,
        x_RC,
        q_CR,
        fmt,
        scale_GC.contiguous(),
        group_R.to(torch.int32).contiguous(),
    )
    return q_CR
