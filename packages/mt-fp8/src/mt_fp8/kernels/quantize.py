"""Triton quantize + transpose + amax (contract in :mod:`mt_fp8.ops.quantize_transpose`).

Each program loads one ``TILE × TILE`` tile of ``x``, scales, clamps and casts it, stores it to
``q`` and, transposed, to ``qᵀ``, and folds the tile's amax (and health counts) into global
fp32/int64 accumulators with atomics. With no scale given, a first launch of the same kernel
with ``WRITE=False`` only reduces the amax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mt_fp8.formats import FP8Format

TILE = 64


@triton.jit
def _quantize_transpose(
    x_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    amax_ptr,
    stats_ptr,
    R,
    C,
    fmt_max,
    saturation,
    half_subnormal,
    WRITE: tl.constexpr,
    STATS: tl.constexpr,
    TILE: tl.constexpr,
):
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    if WRITE:
        scaled = x / tl.load(scale_ptr)
        if STATS:
            magnitude = tl.abs(scaled)
            saturated = tl.sum(tl.sum((magnitude >= saturation).to(tl.int64), axis=1), axis=0)
            flushed = tl.sum(
                tl.sum(((magnitude < half_subnormal) & (magnitude > 0)).to(tl.int64), axis=1),
                axis=0,
            )
            tl.atomic_add(stats_ptr, saturated)
            tl.atomic_add(stats_ptr + 1, flushed)
        q = tl.clamp(scaled, -fmt_max, fmt_max).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + offs, q, mask=mask)
        offs_t = cols.to(tl.int64)[None, :] * R + rows[:, None]
        tl.store(qt_ptr + offs_t, q, mask=mask)


def quantize_transpose_amax_triton(
    x_RC: torch.Tensor, fmt: FP8Format, scale: torch.Tensor | None, stats: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_RC, q_CR, scale (1, 1) fp32, amax)``."""
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
    amax = torch.zeros((), device=x_RC.device, dtype=torch.float32)
    q_RC = torch.empty(rows, cols, device=x_RC.device, dtype=fmt.dtype)
    q_CR = torch.empty(cols, rows, device=x_RC.device, dtype=fmt.dtype)
    common = dict(
        fmt_max=fmt.max,
        saturation=fmt.saturation_threshold,
        half_subnormal=fmt.min_subnormal / 2,
        TILE=TILE,
    )
    if scale is None:
        _quantize_transpose[grid](
            x_RC, q_RC, q_CR, amax, amax, amax, rows, cols, WRITE=False, STATS=False, **common
        )
        scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
        amax_out = torch.zeros_like(amax)
    else:
        amax_out = amax
    scale_11 = scale.float().reshape(1, 1).clone()  # own allocation: cuBLAS scale alignment
    counts = stats if stats is not None else amax
    _quantize_transpose[grid](
        x_RC,
        q_RC,
        q_CR,
        scale_11,
        amax_out,
        counts,
        rows,
        cols,
        WRITE=True,
        STATS=stats is not None,
        **common,
    )
    if stats is not None:
        stats[2] += x_RC.numel()
    return q_RC, q_CR, scale_11, amax
