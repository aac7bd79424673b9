"""Triton AdamW update: one pass over a parameter, its gradient and both moments.

For each element, with the step's host-computed scalars ``decay = 1 - lr·λ``,
``step_size = lr / (1 - β₁ᵗ)`` and ``bc2_sqrt = √(1 - β₂ᵗ)``, and the optional device scalar
``grad_scale`` (the gradient is divided by it: the clip coefficient's reciprocal, or a loss
scale)::

    g  = grad / grad_scale
    θ  = θ · decay
    m  = β₁·m + (1 - β₁)·g
    v  = β₂·v + (1 - β₂)·g²
    θ  = θ - step_size · m / (√v / bc2_sqrt + ε)

which is ``torch.optim.AdamW``'s update in the order its fused CUDA kernel applies it
(arithmetic in fp32; parameters and moments stored in their own dtype). The pass reads
θ, g, m, v and writes θ, m, v: 28 bytes per fp32 element, the least an unfused-state AdamW can
move. The gradient is not written back (PyTorch's fused kernel stores the unscaled gradient when
given a scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements and warps per program: the fastest of the sweep of ``benchmarks/adamw.py --sweep``
# on the H200, near copy bandwidth (docs/benchmarks-log.md; current figures: docs/performance.md,
# "AdamW").
# NOTE: one launch for all tensors instead (programs mapped to (tensor, block) by int32 tables,
# tensor addresses and scalars uploaded per step) was slower, both on the device (the dependent
# table loads in every program) and on the host (building the uploads), so it was reverted
# (docs/benchmarks-log.md).
BLOCK = 1024
WARPS = 4


@triton.jit
def _adamw(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    grad_scale_ptr,
    n,
    decay,
    beta1,
    beta2,
    step_size,
    bc2_sqrt,
    eps,
    HAS_GRAD_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    param = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    grad = grad.to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    param = param * decay
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bc2_sqrt + eps
    param = param - step_size * exp_avg / denom
    tl.store(param_ptr + offs, param.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad_scale: torch.Tensor | None,
    *,
    decay: float,
    beta1: float,
    beta2: float,
    step_size: float,
    bc2_sqrt: float,
    eps: float,
) -> None:
    """Update ``param``, ``exp_avg`` and ``exp_avg_sq`` in place (contiguous, same shape)."""
    n = param.numel()
    if n == 0:
        return
    _adamw[(triton.cdiv(n, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        grad_scale if grad_scale is not None else param,
        n,
        decay,
        beta1,
        beta2,
        step_size,
        bc2_sqrt,
        eps,
        HAS_GRAD_SCALE=grad_scale is not None,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
