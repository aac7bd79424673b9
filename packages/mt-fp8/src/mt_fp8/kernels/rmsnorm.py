"""Triton RMSNorm(+residual) forward and backward (math in :mod:`mt_fp8.ops.rmsnorm`).

One program per ``FWD_ROWS`` rows in the forward (a row fits in one block); the backward runs a
fixed grid of programs that each loop over ``BWD_ROWS`` rows at a time (software-pipelined),
accumulating their share of ``dw`` in registers, so ``dw`` costs one small (programs × D) fp32
partial sum instead of an atomic per row.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from mt_fp8.ops.rmsnorm import (
    incoming_gradients,
    remember_weight_gradient,
    repeated_weight_gradient,
)


@triton.jit
def _rmsnorm_fwd(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    rstd_ptr,
    R,
    D,
    eps,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


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
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for i in tl.range(0, iters, num_stages=STAGES):
        rows = (pid + i * programs) * ROWS + tl.arange(0, ROWS)
        mask = (rows[:, None] < R) & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)
        xhat = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        dxhat = dy * w[None, :]
        mean = tl.sum(dxhat * xhat, axis=1) / D
        dh = rstd[:, None] * (dxhat - xhat * mean[:, None])
        if HAS_DHOUT:
            dh += tl.load(dhout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * D + cols, tl.sum(dw, axis=0), mask=col_mask)


PROGRAMS_PER_SM = 1
"""Backward programs per streaming multiprocessor: each walks rows/programs rows."""

FWD_ROWS = 1
"""Rows per forward program (a ``FWD_ROWS × D`` tile)."""

BWD_ROWS = 2
"""Rows per backward loop iteration (a ``BWD_ROWS × D`` tile)."""

BWD_STAGES = 3
"""Software-pipelining depth of the backward's row loop: the loads of the next rows are issued
while the current ones are reduced."""

# NOTE: the settings above were the fastest tried on the H200, near copy bandwidth: 8 warps per
# row beat 16 in the forward, and the backward's two rows per iteration, one program per SM and
# three stages beat one row, two programs per SM and no pipelining (docs/benchmarks-log.md;
# current figures: docs/performance.md, "Fused ops").


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def backward_stages(dim: int, device: torch.device, bytes_per_column: int) -> int:
    """Pipelining depth the backward can afford for rows of ``dim``, 0 when not even one stage
    fits. Each stage buffers ``BWD_ROWS`` padded rows of every tensor the loop streams (``dy``,
    ``h`` and, with a residual, ``dh_out``: ``bytes_per_column`` is the sum of their element
    sizes) in shared memory, ``BWD_ROWS · next_power_of_2(dim) · bytes_per_column`` bytes, and
    all stages must fit the device's per-block limit. Triton pipelines only when a program walks
    several iterations, so a few rows can run where many cannot: the bound is the many-row one
    (on Hopper, bf16 rows of 8192 with a residual take two stages; 16384 one; 28672 none)."""
    if device.type != "cuda":
        return BWD_STAGES  # Triton's interpreter has no shared-memory limit
    per_stage = BWD_ROWS * triton.next_power_of_2(dim) * bytes_per_column
    return min(BWD_STAGES, _shared_memory_limit(device) // per_stage)


def fits_device(dim: int, device: torch.device, bytes_per_column: int) -> bool:
    """Whether the kernels can run rows of ``dim`` at all (see :func:`backward_stages`)."""
    return backward_stages(dim, device, bytes_per_column) >= 1


@functools.cache
def _shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one block may opt into (read once per device: RMSNorm is on the
    hot path)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


def _warps(tile_elements: int) -> int:
    """About 16 fp32 values per thread per tensor, 1 to 16 warps."""
    return min(max(tile_elements // 512, 1), 16)


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
        _rmsnorm_fwd[(triton.cdiv(rows, FWD_ROWS),)](
            x_RD,
            residual_RD.contiguous() if residual_RD is not None else x_RD,
            weight_D,
            y_RD,
            h_RD,
            rstd_R,
            rows,
            dim,
            eps,
            HAS_RES=residual_RD is not None,
            ROWS=FWD_ROWS,
            BLOCK=block,
            num_warps=_warps(FWD_ROWS * block),
        )
        ctx.save_for_backward(h_RD, weight_D, rstd_R)
        ctx.has_residual = residual_RD is not None
        # Without a residual, h is x itself: return an empty placeholder rather than alias x.
        return y_RD, h_RD if ctx.has_residual else x_RD.new_empty(0)

    @staticmethod
    def backward(ctx: Any, dy_RD, dh_out_RD):  # type: ignore[override]
        repeated = repeated_weight_gradient(ctx, incoming_gradients(ctx, dy_RD, dh_out_RD))
        if repeated is not None:  # torch's split backward asking again (ops.rmsnorm docstring)
            return None, repeated, None, None, None
        h_RD, weight_D, rstd_R = ctx.saved_tensors
        rows, dim = h_RD.shape
        has_dhout = ctx.has_residual and dh_out_RD is not None
        dh_RD = torch.empty_like(h_RD)
        programs = min(_programs(h_RD.device), triton.cdiv(rows, BWD_ROWS))
        dw_part = torch.empty(programs, dim, device=h_RD.device, dtype=torch.float32)
        block = triton.next_power_of_2(dim)
        streamed = dy_RD.element_size() + h_RD.element_size()
        stages = backward_stages(
            dim, h_RD.device, streamed + (dh_out_RD.element_size() if has_dhout else 0)
        )
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
            triton.cdiv(rows, programs * BWD_ROWS),
            HAS_DHOUT=has_dhout,
            ROWS=BWD_ROWS,
            BLOCK=block,
            STAGES=stages,
            num_warps=_warps(BWD_ROWS * block),
        )
        dw = dw_part.sum(0).to(weight_D.dtype)
        remember_weight_gradient(ctx, incoming_gradients(ctx, dy_RD, dh_out_RD), dw)
        return dh_RD, dw, dh_RD if ctx.has_residual else None, None, None
