"""Triton RMSNorm(+residual) forward and backward (math in :mod:`mt_fp8.ops.rmsnorm`).

One program per row in the forward (the row fits in one block); the backward runs a fixed grid
of programs that each loop over rows, accumulating their share of ``dw`` in registers, so ``dw``
costs one small (programs × D) fp32 partial sum instead of an atomic per row.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    rstd_ptr,
    D,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * D + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (h * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rmsnorm_bwd(
    dy_ptr,
    h_ptr,
    w_ptr,
    rstd_ptr,
    dhout_ptr,
    dh_ptr,
    dw_part_ptr,
    R,
    D,
    programs,
    iters,
    HAS_DHOUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, iters):
        row = pid + i * programs
        row_mask = mask & (row < R)
        offs = row.to(tl.int64) * D + cols
        dy = tl.load(dy_ptr + offs, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < R, other=0.0)
        xhat = tl.load(h_ptr + offs, mask=row_mask, other=0.0).to(tl.float32) * rstd
        dxhat = dy * w
        dh = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / D))
        if HAS_DHOUT:
            dh += tl.load(dhout_ptr + offs, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=row_mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * D + cols, dw, mask=mask)


PROGRAMS_PER_SM = 2
"""Backward programs per streaming multiprocessor: each walks rows/programs rows."""


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class TritonRMSNormFunction(torch.autograd.Function):
    """Same contract as :class:`mt_fp8.ops.rmsnorm.RMSNormFunction`."""

    @staticmethod
    def forward(ctx: Any, x_RD, weight_D, residual_RD, eps: float, out_dtype):  # type: ignore[override]
        rows, dim = x_RD.shape
        x_RD = x_RD.contiguous()
        y_RD = torch.empty_like(x_RD, dtype=out_dtype)
        h_RD = torch.empty_like(x_RD) if residual_RD is not None else x_RD
        rstd_R = torch.empty(rows, device=x_RD.device, dtype=torch.float32)
        block = triton.next_power_of_2(dim)
        _rmsnorm_fwd[(rows,)](
            x_RD,
            residual_RD.contiguous() if residual_RD is not None else x_RD,
            weight_D,
            y_RD,
            h_RD,
            rstd_R,
            dim,
            eps,
            HAS_RES=residual_RD is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
        ctx.save_for_backward(h_RD, weight_D, rstd_R)
        ctx.has_residual = residual_RD is not None
        # Without a residual, h is x itself: return an empty placeholder rather than alias x.
        return y_RD, h_RD if ctx.has_residual else x_RD.new_empty(0)

    @staticmethod
    def backward(ctx: Any, dy_RD, dh_out_RD):  # type: ignore[override]
        h_RD, weight_D, rstd_R = ctx.saved_tensors
        rows, dim = h_RD.shape
        has_dhout = ctx.has_residual and dh_out_RD is not None
        dh_RD = torch.empty_like(h_RD)
        programs = min(_programs(h_RD.device), rows)
        dw_part = torch.empty(programs, dim, device=h_RD.device, dtype=torch.float32)
        block = triton.next_power_of_2(dim)
        _rmsnorm_bwd[(programs,)](
            dy_RD.contiguous(),
            h_RD,
            weight_D,
            rstd_R,
            dh_out_RD.contiguous() if has_dhout else dy_RD,
            dh_RD,
            dw_part,
            rows,
            dim,
            programs,
            triton.cdiv(rows, programs),
            HAS_DHOUT=has_dhout,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
        dw = dw_part.sum(0).to(weight_D.dtype)
        return dh_RD, dw, dh_RD if ctx.has_residual else None, None, None
