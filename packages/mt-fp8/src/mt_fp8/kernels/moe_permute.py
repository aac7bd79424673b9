"""Triton MoE permute and unpermute (math, maps and orders in :mod:`mt_fp8.ops.moe_permute`).

Every kernel reads rows through an index map (``-1``: no row) and masks the missing ones to
zero, so padding and dropped assignments cost no gather of their own. Sums run in a fixed
order (unpermute: ``j``; permute's backward: ascending row), and ``enable_fp_fusion=False``
keeps ``acc + w·y`` a rounded product and a rounded sum (no FMA), which is what makes the
results bit-identical to the PyTorch path where its order is the same.

NOTE: fp32 is rounded to bf16 by hand (:func:`_rounded`, round to nearest even on the bits):
Triton's interpreter truncates in its fp32 -> bf16 cast, which would make the CPU kernel tests
disagree with PyTorch in the last bit; on the GPU the hand rounding equals the hardware's.

NOTE: a row's presence is tested as ``offs * 0 + row >= 0``, a vector: Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU kernel tests) rejects a vector mask combined with a scalar one.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_BLOCK_D = 1024
"""Row block of the row-parallel kernels (a power of two; smaller rows use their own size)."""
MAX_TILE = 8192
"""Elements of the backward's ``[K, BLOCK_D]`` tile (keeps it in registers)."""


def _is_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16


def _block(width: int, limit: int) -> int:
    return min(triton.next_power_of_2(width), limit)


@triton.jit
def _rounded(x, ptr, BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``ptr``'s element dtype, as fp32 (exact to store)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        value = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    else:
        value = x.to(ptr.dtype.element_ty).to(tl.float32)
    return value


@triton.jit
def _permute_fwd(x_ptr, source_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = offs < D
    token = tl.load(source_ptr + row)
    x = tl.load(x_ptr + token * D + offs, mask=in_row & (offs * 0 + token >= 0), other=0.0)
    tl.store(out_ptr + row * D + offs, x, mask=in_row)


@triton.jit
def _permute_bwd(
    dout_ptr, rows_ptr, dx_ptr, D, TOP_K: tl.constexpr, BF16: tl.constexpr, BLOCK_D: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + token * TOP_K + j).to(tl.int64)
        d = tl.load(dout_ptr + row * D + offs, mask=in_row & (offs * 0 + row >= 0), other=0.0)
        acc = acc + d.to(tl.float32)
    dx = _rounded(acc, dx_ptr, BF16).to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + token * D + offs, dx, mask=in_row)


@triton.jit
def _unpermute_fwd(
    y_ptr, w_ptr, rows_ptr, out_ptr, D, TOP_K: tl.constexpr, BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + token * TOP_K + j).to(tl.int64)
        w = tl.load(w_ptr + token * TOP_K + j)
        y = tl.load(y_ptr + row * D + offs, mask=in_row & (offs * 0 + row >= 0), other=0.0)
        acc = acc + w * y.to(tl.float32)
    out = _rounded(acc, out_ptr, BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * D + offs, out, mask=in_row)


@triton.jit
def _unpermute_bwd(
    dout_ptr,
    y_ptr,
    w_ptr,
    rows_ptr,
    dy_ptr,
    dw_ptr,
    D,
    TOP_K: tl.constexpr,
    BF16: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_BLOCK)
    in_k = ks < TOP_K
    rows = tl.load(rows_ptr + token * TOP_K + ks, mask=in_k, other=-1).to(tl.int64)
    w = tl.load(w_ptr + token * TOP_K + ks, mask=in_k, other=0.0)
    kept = rows >= 0
    dw = tl.zeros([K_BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        in_row = offs < D
        d = tl.load(dout_ptr + token * D + offs, mask=in_row, other=0.0).to(tl.float32)
        tile = kept[:, None] & in_row[None, :]
        at = rows[:, None] * D + offs[None, :]
        y = tl.load(y_ptr + at, mask=tile, other=0.0).to(tl.float32)
        dw += tl.sum(y * d[None, :], axis=1)
        dy = _rounded(w[:, None] * d[None, :], dy_ptr, BF16).to(dy_ptr.dtype.element_ty)
        tl.store(dy_ptr + at, dy, mask=tile)
    tl.store(dw_ptr + token * TOP_K + ks, dw, mask=in_k)


def permute_triton(x_TD: torch.Tensor, source_M: torch.Tensor) -> torch.Tensor:
    """``out[m] = x[source[m]]``, zero where ``source[m] = -1``."""
    x_TD = x_TD.contiguous()
    rows, width = source_M.numel(), x_TD.shape[1]
    out = x_TD.new_empty(rows, width)
    block = _block(width, MAX_BLOCK_D)
    if rows:
        _permute_fwd[(rows, triton.cdiv(width, block))](
            x_TD, source_M, out, width, BLOCK_D=block, enable_fp_fusion=False
        )
    return out


def permute_backward_triton(dout_MD: torch.Tensor, sorted_rows_TK: torch.Tensor) -> torch.Tensor:
    """``dx[t] = Σ dout[row]`` over token ``t``'s rows in ascending row order (``-1`` skipped),
    in fp32, stored in ``dout``'s dtype."""
    dout_MD = dout_MD.contiguous()
    tokens, top_k = sorted_rows_TK.shape
    width = dout_MD.shape[1]
    dx = dout_MD.new_empty(tokens, width)
    block = _block(width, MAX_BLOCK_D)
    if tokens:
        _permute_bwd[(tokens, triton.cdiv(width, block))](
            dout_MD,
            sorted_rows_TK,
            dx,
            width,
            TOP_K=top_k,
            BF16=_is_bf16(dx),
            BLOCK_D=block,
            enable_fp_fusion=False,
        )
    return dx


def unpermute_triton(
    y_MD: torch.Tensor, weights_TK: torch.Tensor, rows_TK: torch.Tensor
) -> torch.Tensor:
    """``out[t] = Σ_j w[t,j] · y[rows[t,j]]`` in fp32, in ``j`` order, stored in ``y``'s dtype."""
    tokens, top_k = weights_TK.shape
    width = y_MD.shape[1]
    out = y_MD.new_empty(tokens, width)
    block = _block(width, MAX_BLOCK_D)
    if tokens:
        _unpermute_fwd[(tokens, triton.cdiv(width, block))](
            y_MD, weights_TK, rows_TK, out, width, TOP_K=top_k, BF16=_is_bf16(out), BLOCK_D=block,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


def unpermute_backward_triton(
    dout_TD: torch.Tensor,
    y_MD: torch.Tensor,
    weights_TK: torch.Tensor,
    rows_TK: torch.Tensor,
    padded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy, dw)``: ``dy[rows[t,j]] = w[t,j] · dout[t]`` (zero on rows no assignment reads:
    the padding rows, present only when ``padded``), ``dw[t,j] = <y[rows[t,j]], dout[t]>`` in
    fp32 (0 for dropped assignments)."""
    dout_TD = dout_TD.contiguous()
    tokens, top_k = weights_TK.shape
    width = y_MD.shape[1]
    dy = torch.zeros_like(y_MD) if padded else torch.empty_like(y_MD)
    dw = torch.empty_like(weights_TK)
    k_block = triton.next_power_of_2(top_k)
    block = _block(width, max(MAX_TILE // k_block, 16))
    if tokens:
        _unpermute_bwd[(tokens,)](
            dout_TD, y_MD, weights_TK, rows_TK, dy, dw, width,
            TOP_K=top_k, BF16=_is_bf16(dy), K_BLOCK=k_block, BLOCK_D=block, num_warps=8,
            enable_fp_fusion=False,
        )  # fmt: skip
    return dy, dw


class TritonPermuteFunction(torch.autograd.Function):
    """Same contract as :class:`mt_fp8.ops.moe_permute.PermuteFunction`, on precomputed maps."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x_TD: torch.Tensor, source_M: torch.Tensor, sorted_rows_TK: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(sorted_rows_TK)
        return permute_triton(x_TD, source_M)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        (sorted_rows_TK,) = ctx.saved_tensors
        return permute_backward_triton(dout, sorted_rows_TK), None, None


class TritonUnpermuteFunction(torch.autograd.Function):
    """Same contract as :class:`mt_fp8.ops.moe_permute.UnpermuteFunction`, on the inverse map."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        y_MD: torch.Tensor,
        weights_TK: torch.Tensor,
        rows_TK: torch.Tensor,
        padded: bool,
    ) -> torch.Tensor:
        y_MD, weights_TK = y_MD.contiguous(), weights_TK.contiguous()
        ctx.save_for_backward(y_MD, weights_TK, rows_TK)
        ctx.padded = padded
        return unpermute_triton(y_MD, weights_TK, rows_TK)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        y_MD, weights_TK, rows_TK = ctx.saved_tensors
        dy, dw = unpermute_backward_triton(dout, y_MD, weights_TK, rows_TK, ctx.padded)
        return dy, dw, None, None
