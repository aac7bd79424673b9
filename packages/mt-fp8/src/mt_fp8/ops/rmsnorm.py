"""RMSNorm with an optional fused residual add.

Shape suffixes: R rows (all leading dims flattened), D the normalized (last) dimension.

Forward, in fp32 (fp64 for fp64 inputs)::

    h_RD    = x_RD + residual_RD            (or x alone)
    rstd_R  = 1 / sqrt(mean_D(h²) + eps)
    y_RD    = h_RD · rstd_R · w_D

returns ``y`` (in ``out_dtype``, by default the input dtype: under bf16 autocast a caller can have
the fp32 residual stream normalised straight into the bf16 its next GEMM reads, one rounding of
the fp32 result, as the cast autocast would insert gives) and, with a residual, ``h`` (the new
residual stream, in the input dtype). Backward,
with ``ĥ = h · rstd`` and incoming ``dy`` (and ``dh_out`` for the returned ``h``)::

    dĥ  = dy · w
    dh  = rstd · (dĥ - ĥ · mean_D(dĥ · ĥ)) + dh_out      (= dx = dresidual)
    dw  = Σ_R dy · ĥ

Only ``rstd`` (R fp32 values) is saved besides ``h`` and ``w``.

A second call of the backward with the very same gradient tensors returns the first call's
``dw`` (and no ``dh``) instead of running again: torch's split backward
(``torch.distributed.pipelining``'s ``stage_backward_input`` then ``stage_backward_weight``,
the zero-bubble schedules' ``I`` and ``W``) calls this node once for ``dh`` and once more, with
the gradients it kept from the first, for ``w``'s gradient. The first call keeps ``dw`` (D
values) and weak references to its gradients; a call with other gradients (a second loss
backpropagated through a retained graph) computes afresh. CUDA tensors run the Triton
kernels of :mod:`mt_fp8.kernels.rmsnorm` (one read and one write of each tensor per pass) when a
row fits their shared memory (:func:`mt_fp8.kernels.rmsnorm.fits_device`), else this module's
PyTorch path.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from mt_fp8.ops.dispatch import compute_dtype, plain_apply, use_triton


def repeated_weight_gradient(ctx: Any, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The ``dw`` an earlier backward of this node computed from these same gradient tensors
    (module docstring: torch's split backward), or None."""
    seen = getattr(ctx, "seen_grads", None)
    if seen is None or len(seen) != len(grads):
        return None
    same = all(
        (ref is None) == (g is None) and (ref is None or ref() is g)
        for ref, g in zip(seen, grads, strict=True)
    )
    return ctx.weight_grad if same else None


def incoming_gradients(
    ctx: Any, dy_RD: torch.Tensor, dh_out_RD: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """The gradients that identify a backward call: ``dy``, and ``dh_out`` with a residual
    (without one autograd hands the placeholder output a fresh zero tensor at every call)."""
    return (dy_RD, dh_out_RD) if ctx.has_residual else (dy_RD,)


def remember_weight_gradient(
    ctx: Any, grads: Sequence[torch.Tensor | None], dw: torch.Tensor
) -> None:
    """Keep ``dw`` for a second call with the same ``grads`` (:func:`repeated_weight_gradient`)."""
    ctx.seen_grads = tuple(None if g is None else weakref.ref(g) for g in grads)
    ctx.weight_grad = dw


class RMSNormFunction(torch.autograd.Function):
    """Plain-PyTorch RMSNorm(+residual) with the explicit backward above."""

    @staticmethod
    def forward(ctx: Any, x_RD, weight_D, residual_RD, eps: float, out_dtype):  # type: ignore[override]
        h_RD = x_RD if residual_RD is None else x_RD + residual_RD
        work = compute_dtype(x_RD)
        h32 = h_RD.to(work)
        rstd_R = torch.rsqrt(h32.pow(2).mean(-1) + eps)
        y_RD = (h32 * rstd_R[:, None] * weight_D.to(work)).to(out_dtype)
        ctx.save_for_backward(h_RD, weight_D, rstd_R)
        ctx.has_residual = residual_RD is not None
        # Without a residual, h is x itself: return an empty placeholder rather than alias x.
        return y_RD, h_RD if ctx.has_residual else x_RD.new_empty(0)

    @staticmethod
    def backward(ctx: Any, dy_RD, dh_out_RD):  # type: ignore[override]
        repeated = repeated_weight_gradient(ctx, incoming_gradients(ctx, dy_RD, dh_out_RD))
        if repeated is not None:
            return None, repeated, None, None, None
        h_RD, weight_D, rstd_R = ctx.saved_tensors
        work = compute_dtype(h_RD)
        xhat = h_RD.to(work) * rstd_R[:, None]
        dxhat = dy_RD.to(work) * weight_D.to(work)
        dh = rstd_R[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        if ctx.has_residual and dh_out_RD is not None:
            dh = dh + dh_out_RD.to(work)
        dw = (dy_RD.to(work) * xhat).sum(0).to(weight_D.dtype)
        dh = dh.to(h_RD.dtype)
        remember_weight_gradient(ctx, incoming_gradients(ctx, dy_RD, dh_out_RD), dw)
        return dh, dw, dh if ctx.has_residual else None, None, None


_plain_rmsnorm = plain_apply(RMSNormFunction)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(x [+ residual]) · weight`` over the last dim; with a residual returns ``(y, h)``.

    ``y`` is in ``out_dtype`` (default: ``x``'s dtype), ``h`` in ``x``'s dtype.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    x_RD = x.reshape(-1, x.shape[-1])
    residual_RD = None if residual is None else residual.reshape(x_RD.shape)
    apply = _plain_rmsnorm
    if use_triton(x_RD, weight):
        from mt_fp8.kernels.rmsnorm import TritonRMSNormFunction, fits_device

        # The backward streams dy (out_dtype), h and, with a residual, dh_out (x's dtype).
        bytes_per_column = (out_dtype or x.dtype).itemsize + x.dtype.itemsize
        if residual is not None:
            bytes_per_column += x.dtype.itemsize
        if fits_device(x_RD.shape[-1], x_RD.device, bytes_per_column):
            apply = TritonRMSNormFunction.apply
    y_RD, h_RD = apply(x_RD, weight, residual_RD, eps, out_dtype or x.dtype)
    if residual is None:
        return y_RD.reshape(x.shape)
    return y_RD.reshape(x.shape), h_RD.reshape(x.shape)
