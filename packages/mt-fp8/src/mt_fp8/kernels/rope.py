"""Triton RoPE (math in :mod:`mt_fp8.ops.rope`): one program per block of (b, t, h) rows."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

ROWS = 16


@triton.jit
def _rope(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    n_rows,
    T,
    H,
    P,
    SIGN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_P)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < P)
    t = (rows // H) % T
    base = rows.to(tl.int64)[:, None] * (2 * P) + cols[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + P, mask=mask, other=0.0).to(tl.float32)
    table = t[:, None] * P + cols[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0) * SIGN
    tl.store(y_ptr + base, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + P, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=mask)


def _rotate(x_BTHD: torch.Tensor, cos_TP, sin_TP, sign: float) -> torch.Tensor:
    x_BTHD = x_BTHD.contiguous()
    batch, positions, heads, dim = x_BTHD.shape
    y = torch.empty_like(x_BTHD)
    n_rows = batch * positions * heads
    _rope[(triton.cdiv(n_rows, ROWS),)](
        x_BTHD,
        cos_TP.contiguous(),
        sin_TP.contiguous(),
        y,
        n_rows,
        positions,
        heads,
        dim // 2,
        SIGN=sign,
        ROWS=ROWS,
        BLOCK_P=triton.next_power_of_2(dim // 2),
        num_warps=4,
    )
    return y


class TritonRotaryFunction(torch.autograd.Function):
    """Same contract as :class:`mt_fp8.ops.rope.RotaryFunction`."""

    @staticmethod
    def forward(ctx: Any, q_BTHD, k_BTHD, cos_TP, sin_TP):  # type: ignore[override]
        ctx.save_for_backward(cos_TP, sin_TP)
        return _rotate(q_BTHD, cos_TP, sin_TP, 1.0), _rotate(k_BTHD, cos_TP, sin_TP, 1.0)

    @staticmethod
    def backward(ctx: Any, dq_BTHD, dk_BTHD):  # type: ignore[override]
        cos_TP, sin_TP = ctx.saved_tensors
        return (
            _rotate(dq_BTHD, cos_TP, sin_TP, -1.0),
            _rotate(dk_BTHD, cos_TP, sin_TP, -1.0),
            None,
            None,
        )
