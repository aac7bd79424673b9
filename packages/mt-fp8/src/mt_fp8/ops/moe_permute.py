"""MoE permute and unpermute: tokens to expert-sorted rows and back, with the router weights.

Shape suffixes: T tokens, K top-k, A = T·K assignments (``a = t·K + j``), N kept assignments,
M rows of the permuted layout (``M = N``, or ``E · capacity`` when padded), D hidden.

A routing plan gives ``order_N`` (the flat assignment of each kept assignment, in row order)
and optionally ``rows_N`` (its padded row; None: row ``i`` holds ``order_N[i]``). Then::

    permute:    x_MD[row_i] = x_TD[order_N[i] // K], zero on padding rows
    unpermute:  out_TD[t] = Σ_j w_TK[t, j] · y_MD[row(t, j)], dropped assignments adding 0

Unpermute multiplies and sums in the wider of ``y``'s and the weights' dtypes (fp32 for the
router's fp32 weights), in ``j`` order, and returns ``y``'s dtype. Its gradients:
``dy[row(t, j)] = w[t, j] · dout[t]`` (cast to ``y``'s dtype, zero on padding rows) and
``dw[t, j] = <y[row(t, j)], dout[t]>`` (0 for dropped assignments). Permute's gradient is the
scatter-add ``dx[t] = Σ dout[row]`` over token ``t``'s kept rows, in ascending row order, in
fp32 and rounded once to the gradient's dtype (what ``index_add`` on the CPU computes).

CUDA tensors with fp32 weights and fp32/bf16/fp16 rows run :mod:`mt_fp8.kernels.moe_permute`:
one gather kernel each way instead of the PyTorch path's ``index_select``/``index_copy``
chain and its ``[T·K, D]`` temporary. The kernels read rows through the inverse maps
``rows_TK`` (the row of each assignment, ``-1`` when dropped) and ``source_M`` (the token of
each row, ``-1`` on padding), and sum without fused multiply-adds in the orders the PyTorch
path takes on the CPU, so both give bit-identical permutes, ``dx`` and ``dy``, and
bit-identical unpermutes up to ``K = 4``. Past 4 terms torch's CPU ``sum(1)`` interleaves them
by 4 in some columns (which, depends on the SIMD width), and the kernel's ``j``-ordered sum
can differ from it in the last bit; ``dw`` is a length-D dot product summed in another order.
Both stay within fp32 rounding of the float64 result (``test_fp8_moe_permute.py``). Elsewhere
the PyTorch path runs. On CUDA the kernels run by default (their GPU tests passed on an H100
on 2026-12-05, and docs/performance.md gives their speed); ``MT_FUSED_MOE_PERMUTE=0`` turns
them off, for comparisons.
"""

from __future__ import annotations

import os

import torch

from mt_fp8.ops.dispatch import use_triton

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Row dtypes the Triton kernels take (with fp32 weights)."""


def permute_rows_reference(
    x_TD: torch.Tensor,
    order_N: torch.Tensor,
    rows_N: torch.Tensor | None,
    num_rows: int,
    top_k: int,
) -> torch.Tensor:
    """The permuted rows ``x_MD`` in plain PyTorch (module docstring)."""
    rows_ND = x_TD.index_select(0, order_N // top_k)
    if rows_N is None:
        return rows_ND
    padded = rows_ND.new_zeros(num_rows, x_TD.shape[1])
    return padded.index_copy(0, rows_N, rows_ND)


def unpermute_rows_reference(
    y_MD: torch.Tensor,
    order_N: torch.Tensor,
    rows_N: torch.Tensor | None,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """``out_TD`` in plain PyTorch (module docstring)."""
    tokens, top_k = weights_TK.shape
    if rows_N is not None:
        y_MD = y_MD.index_select(0, rows_N)
    per_assignment_AD = y_MD.new_zeros(tokens * top_k, y_MD.shape[1]).index_copy(0, order_N, y_MD)
    wide = torch.promote_types(y_MD.dtype, weights_TK.dtype)
    weighted_TKD = per_assignment_AD.view(tokens, top_k, -1).to(wide) * weights_TK[..., None]
    return weighted_TKD.sum(1).to(y_MD.dtype)


def _kept_rows(order_N: torch.Tensor, rows_N: torch.Tensor | None) -> torch.Tensor:
    if rows_N is not None:
        return rows_N
    return torch.arange(order_N.numel(), device=order_N.device)


def assignment_rows(
    order_N: torch.Tensor, rows_N: torch.Tensor | None, tokens: int, top_k: int
) -> torch.Tensor:
    """``rows_TK``: the row of each assignment, ``-1`` where it was dropped (int64)."""
    rows_A = torch.full((tokens * top_k,), -1, dtype=torch.int64, device=order_N.device)
    return rows_A.index_copy(0, order_N, _kept_rows(order_N, rows_N)).view(tokens, top_k)


def fused_permute_runs(x: torch.Tensor, weights_TK: torch.Tensor | None = None) -> bool:
    """Whether :func:`permute_rows` / :func:`unpermute_rows` take the Triton kernels for ``x``."""
    if weights_TK is not None and weights_TK.dtype != torch.float32:
        return False
    if x.is_cuda and os.environ.get("MT_FUSED_MOE_PERMUTE") == "0":
        return False
    tensors = (x,) if weights_TK is None else (x, weights_TK)
    return x.dtype in KERNEL_DTYPES and x.dim() == 2 and use_triton(*tensors)


def permute_rows(
    x_TD: torch.Tensor,
    order_N: torch.Tensor,
    rows_N: torch.Tensor | None,
    num_rows: int,
    top_k: int,
) -> torch.Tensor:
    """``x_MD``: each token's row once per kept assignment, in row order (module docstring)."""
    if not fused_permute_runs(x_TD):
        return permute_rows_reference(x_TD, order_N, rows_N, num_rows, top_k)
    from mt_fp8.kernels.moe_permute import TritonPermuteFunction

    source_M = torch.full((num_rows,), -1, dtype=torch.int64, device=x_TD.device)
    source_M = source_M.index_copy(0, _kept_rows(order_N, rows_N), order_N // top_k)
    rows_TK = assignment_rows(order_N, rows_N, x_TD.shape[0], top_k)
    return TritonPermuteFunction.apply(x_TD, source_M, rows_TK.sort(dim=1).values)


def unpermute_rows(
    y_MD: torch.Tensor,
    order_N: torch.Tensor,
    rows_N: torch.Tensor | None,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """``out_t = Σ_j w_tj · y(row of t·K + j)`` over the kept assignments (module docstring)."""
    if not fused_permute_runs(y_MD, weights_TK):
        return unpermute_rows_reference(y_MD, order_N, rows_N, weights_TK)
    from mt_fp8.kernels.moe_permute import TritonUnpermuteFunction

    rows_TK = assignment_rows(order_N, rows_N, *weights_TK.shape)
    # Without padding every row holds a kept assignment, so the backward writes all of dy.
    return TritonUnpermuteFunction.apply(y_MD, weights_TK, rows_TK, rows_N is not None)
