"""Cross-entropy over a large vocabulary without fp32 logits for the whole batch.

Shape suffixes: R rows (tokens), V vocabulary. ``logits_RV`` stays in its dtype (bf16); rows are
processed in chunks of ``chunk_rows`` (PyTorch path) or one row per program (Triton), each
upcast to fp32 (fp64 for fp64 logits) only for that chunk. With ``n`` the number of rows whose target is not
``ignore_index``::

    lse_r  = log Σ_v exp(z_rv)                       (max-shifted, fp32)
    loss   = (1/n) Σ_r [target_r valid] (lse_r - z_r,target_r)
    dz_rv  = g/n · (softmax(z_r)_v - [v = target_r])  (0 for ignored rows)

Only ``lse`` (R fp32 values) is saved; the backward recomputes the softmax from the saved
logits and writes the gradient in the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from mt_fp8.ops.dispatch import compute_dtype, plain_apply, use_triton


class CrossEntropyFunction(torch.autograd.Function):
    """Chunked plain-PyTorch cross-entropy (mean over valid rows) with the backward above."""

    @staticmethod
    def forward(ctx: Any, logits_RV, target_R, ignore_index: int, chunk_rows: int):  # type: ignore[override]
        rows = logits_RV.shape[0]
        work = compute_dtype(logits_RV)
        lse_R = torch.empty(rows, device=logits_RV.device, dtype=work)
        losses_R = torch.zeros(rows, device=logits_RV.device, dtype=work)
        valid_R = target_R != ignore_index
        safe_target = torch.where(valid_R, target_R, torch.zeros_like(target_R))
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            z = logits_RV[chunk].to(work)
            lse_R[chunk] = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, safe_target[chunk, None]).squeeze(1)
            losses_R[chunk] = torch.where(valid_R[chunk], lse_R[chunk] - picked, 0.0)
        n_valid = valid_R.sum().clamp_min(1)
        ctx.save_for_backward(logits_RV, target_R, lse_R, n_valid)
        ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows
        return losses_R.sum() / n_valid

    @staticmethod
    def backward(ctx: Any, grad_loss):  # type: ignore[override]
        logits_RV, target_R, lse_R, n_valid = ctx.saved_tensors
        grad_RV = torch.empty_like(logits_RV)
        weight = grad_loss.to(lse_R.dtype) / n_valid
        for start in range(0, logits_RV.shape[0], ctx.chunk_rows):
            chunk = slice(start, start + ctx.chunk_rows)
            target = target_R[chunk]
            valid = target != ctx.ignore_index
            probs = torch.exp(logits_RV[chunk].to(lse_R.dtype) - lse_R[chunk, None])
            rows = torch.arange(probs.shape[0], device=probs.device)[valid]
            probs[rows, target[valid]] -= 1.0
            probs *= torch.where(valid, weight, 0.0)[:, None]
            grad_RV[chunk] = probs.to(logits_RV.dtype)
        return grad_RV, None, None, None


_plain_cross_entropy = plain_apply(CrossEntropyFunction)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (R, V) against ``target`` (R,), skipping ``ignore_index``."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy takes logits (R, V) and target (R,), got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must be int64 or int32 class indices, got {target.dtype}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if use_triton(logits, target):
        from mt_fp8.kernels.cross_entropy import TritonCrossEntropyFunction

        return TritonCrossEntropyFunction.apply(logits, target, ignore_index)
    return _plain_cross_entropy(logits, target.long(), ignore_index, chunk_rows)
