"""Triton block-scaled FP8 GEMM for Hopper (DeepSeek-V3 style), ``out = (a·s_a)(b·s_b)ᵀ + bias``.

Shape suffixes: X rows of ``a``, Y rows of ``b``, Z the contraction axis, g the group length.
``a_XZ`` is quantized in 1×g groups (``s_a`` is ``(X, Z/g)``), ``b_YZ`` in 1×g groups or g×g
blocks (``s_b`` is ``(Y, Z/g)`` or ``(Y/g, Z/g)``). Each program owns a ``BLOCK_X × BLOCK_Y``
output tile and walks Z in steps of g (``BLOCK_Z = g``): one FP8 tensor-core product per step,
promoted into the fp32 accumulator with the step's scales,
``acc += dot(a_tile, b_tileᵀ) · s_a[:, k] · s_b[:, k]`` — the promotion DeepSeek-V3 uses to keep
FP8 accumulation error from growing with Z. Mixed E5M2 × E4M3 operands go through bf16 (exact:
every FP8 value is a bf16 value).

That walk is :func:`block_scaled_steps`, shared with the grouped kernels
(:mod:`~mt_fp8.kernels.grouped_block_gemm`): each kernel maps its program to a tile, sets up
its pointers and writes its epilogue. Triton inlines the jit function into each kernel before
optimizing, so the kernels' IR and PTX instructions are those of the loop written in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mt_fp8.quantized import QuantizedTensor


@triton.jit
def block_scaled_steps(
    a_ptrs,
    b_ptrs,
    sa_ptrs,
    sb_ptrs,
    row_mask,
    col_mask,
    steps,
    MIXED: tl.constexpr,
    MIXED_DTYPE: tl.constexpr,
    BLOCK_Z: tl.constexpr,
):
    """The fp32 (BLOCK_X, BLOCK_Y) tile ``Σ_k dot(a_k, b_kᵀ) · s_a[:, k] · s_b[:, k]`` over
    ``steps`` steps k of g = ``BLOCK_Z`` along the contraction.

    ``a_ptrs`` (BLOCK_X, g) and ``b_ptrs`` (BLOCK_Y, g) point at the first step's FP8 tiles,
    contiguous along the contraction (each step moves them g on); ``sa_ptrs`` (BLOCK_X,) and
    ``sb_ptrs`` (BLOCK_Y,) at the first step's scales, each step's one further on. The masks
    (BLOCK_X,) and (BLOCK_Y,) give the tile's shape; masked rows and columns load zeros and
    scales of zero, so they add nothing. With ``MIXED`` (E4M3 × E5M2) both tiles are cast to
    ``MIXED_DTYPE`` (bf16 or fp16, each holding every FP8 value exactly) before the dot.
    """
    acc = tl.zeros((row_mask.shape[0], col_mask.shape[0]), dtype=tl.float32)
    for step in range(0, steps):
        a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_mask[:, None], other=0.0)
        if MIXED:
            partial = tl.dot(a.to(MIXED_DTYPE), tl.trans(b.to(MIXED_DTYPE)))
        else:
            partial = tl.dot(a, tl.trans(b))
        scale_a = tl.load(sa_ptrs + step, mask=row_mask, other=0.0)
        scale_b = tl.load(sb_ptrs + step, mask=col_mask, other=0.0)
        acc += partial * scale_a[:, None] * scale_b[None, :]
        a_ptrs += BLOCK_Z
        b_ptrs += BLOCK_Z
    return acc


@triton.jit
def _block_scaled_mm(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    out_ptr,
    X,
    Y,
    Z,
    sb_row_div,
    HAS_BIAS: tl.constexpr,
    MIXED: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_Y: tl.constexpr,
    BLOCK_Z: tl.constexpr,
    GROUP_X: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_x = tl.cdiv(X, BLOCK_X)
    tiles_y = tl.cdiv(Y, BLOCK_Y)
    # Grouped ordering: GROUP_X row-tiles share their b tiles in L2.
    group = pid // (GROUP_X * tiles_y)
    first_x = group * GROUP_X
    group_size = tl.minimum(tiles_x - first_x, GROUP_X)
    tile_x = first_x + (pid % (GROUP_X * tiles_y)) % group_size
    tile_y = (pid % (GROUP_X * tiles_y)) // group_size
    rows = tile_x * BLOCK_X + tl.arange(0, BLOCK_X)
    cols = tile_y * BLOCK_Y + tl.arange(0, BLOCK_Y)
    ks = tl.arange(0, BLOCK_Z)
    row_mask, col_mask = rows < X, cols < Y
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * Z + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * Z + ks[None, :]
    steps = Z // BLOCK_Z
    sa_ptrs = sa_ptr + rows * steps
    sb_ptrs = sb_ptr + (cols // sb_row_div) * steps
    acc = block_scaled_steps(
        a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, row_mask, col_mask, steps, MIXED, tl.bfloat16, BLOCK_Z
    )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * Y + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def block_scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """Run the kernel; the dispatcher (:mod:`mt_fp8.gemm`) has checked the layouts."""
    rows, depth = a.shape
    cols = b.shape[0]
    group = a.block[1]
    out = torch.empty(rows, cols, device=a.data.device, dtype=out_dtype)
    block_x, block_y = 128, 128
    grid = (triton.cdiv(rows, block_x) * triton.cdiv(cols, block_y),)
    _block_scaled_mm[grid](
        a.data,
        b.data,
        a.scale,
        b.scale,
        bias if bias is not None else out,
        out,
        rows,
        cols,
        depth,
        b.block[0],
        HAS_BIAS=bias is not None,
        MIXED=a.data.dtype != b.data.dtype,
        BLOCK_X=block_x,
        BLOCK_Y=block_y,
        BLOCK_Z=group,
        GROUP_X=8,
        num_warps=8,
        num_stages=4 if group >= 128 else 3,
    )
    return out
