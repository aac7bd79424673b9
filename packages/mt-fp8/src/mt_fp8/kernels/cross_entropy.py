"""Triton cross-entropy (math in :mod:`mt_fp8.ops.cross_entropy`): one program per row.

The forward streams the row in blocks of ``BLOCK_V`` with an online max/sum (one read of the
logits); the backward streams it again and writes the gradient (one read, one write).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_V = 8192


@triton.jit
def _ce_fwd(z_ptr, t_ptr, loss_ptr, lse_ptr, V, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(t_ptr + row)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(z - new_max), axis=0
        )
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(lse_ptr + row, lse)
    valid = target != ignore_index
    picked = tl.load(z_ptr + row * V + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))


@triton.jit
def _ce_bwd(z_ptr, t_ptr, lse_ptr, weight_ptr, dz_ptr, V, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(t_ptr + row)
    lse = tl.load(lse_ptr + row)
    weight = tl.where(target != ignore_index, tl.load(weight_ptr), 0.0)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(z_ptr + row * V + cols, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * weight
        tl.store(dz_ptr + row * V + cols, grad.to(dz_ptr.dtype.element_ty), mask=mask)


class TritonCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy over valid rows; same contract as the PyTorch path."""

    @staticmethod
    def forward(ctx: Any, logits_RV, target_R, ignore_index: int):  # type: ignore[override]
        logits_RV = logits_RV.contiguous()
        rows, vocab = logits_RV.shape
        losses_R = torch.empty(rows, device=logits_RV.device, dtype=torch.float32)
        lse_R = torch.empty_like(losses_R)
        _ce_fwd[(rows,)](
            logits_RV,
            target_R,
            losses_R,
            lse_R,
            vocab,
            ignore_index,
            BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
            num_warps=16,
        )
        n_valid = (target_R != ignore_index).sum().clamp_min(1)
        ctx.save_for_backward(logits_RV, target_R, lse_R, n_valid)
        ctx.ignore_index = ignore_index
        return losses_R.sum() / n_valid

    @staticmethod
    def backward(ctx: Any, grad_loss):  # type: ignore[override]
        logits_RV, target_R, lse_R, n_valid = ctx.saved_tensors
        rows, vocab = logits_RV.shape
        grad_RV = torch.empty_like(logits_RV)
        weight = (grad_loss.float() / n_valid).reshape(1)
        _ce_bwd[(rows,)](
            logits_RV,
            target_R,
            lse_R,
            weight,
            grad_RV,
            vocab,
            ctx.ignore_index,
            BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
            num_warps=16,
        )
        return grad_RV, None, None
