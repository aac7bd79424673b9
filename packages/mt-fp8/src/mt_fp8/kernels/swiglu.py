"""Triton SwiGLU forward and backward (math in :mod:`mt_fp8.ops.swiglu`), flat elementwise."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(
        dg_ptr + offs, (d * u * sig * (1 + g * (1 - sig))).to(dg_ptr.dtype.element_ty), mask=mask
    )
    tl.store(du_ptr + offs, (d * g * sig).to(du_ptr.dtype.element_ty), mask=mask)


class TritonSwiGLUFunction(torch.autograd.Function):
    """Same contract as :class:`mt_fp8.ops.swiglu.SwiGLUFunction`."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return swiglu_backward_triton(dy, gate, up)


def swiglu_backward_triton(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)``; ``gate`` and ``up`` contiguous, ``dy`` of their shape."""
    gate, up = gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _swiglu_bwd[(triton.cdiv(n, BLOCK),)](
        dy.contiguous(), gate, up, dgate, dup, n, BLOCK=BLOCK, num_warps=8
    )
    return dgate, dup
