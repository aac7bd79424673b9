"""The FP8 linear autograd functions shared by :class:`FP8Linear` and :class:`FP8GroupedLinear`.

Shape suffixes: M tokens, K input features, N output features; ``a_XZ · b_YZᵀ`` is the GEMM form
of :mod:`mt_fp8.gemm` (contract the last axis of both operands). The operands are quantized by
the call's :class:`~mt_fp8.linear_plan.LinearPlan` (its quantizer dispatch, weight cache and
shared input quantization: :mod:`mt_fp8.linear_plan`).

Forward ``y_MN = x_MK · w_NKᵀ + b_N``:

* ``x`` is quantized along K (INPUT role) and ``w`` along K (WEIGHT role); ``fp8_gemm`` runs.
* For the weight gradient the function keeps ``xᵀ`` quantized along M, **in FP8** (the exact
  transpose of the forward copy for tensorwise scales, a requantization of ``xᵀ`` otherwise); the
  high-precision ``x`` is not saved.

Backward, with ``dy_MN`` quantized along N (GRAD_OUTPUT role):

* ``dx_MK = dy_MN · (wᵀ)_KNᵀ``: ``wᵀ`` is the exact transpose of the FP8 weight for tensorwise
  and square-block scales, a requantization of ``wᵀ`` along N otherwise.
* ``dw_NK = (dyᵀ)_NM · (xᵀ)_KMᵀ``: both operands quantized along M. Row-group layouts (1×g)
  pad M with zeros to a multiple of g; zero columns add nothing to the product.
* ``db_N = Σ_M dy_MN`` in high precision.

The layer's FP8 weight (and its transpose) is reused across the micro-batches of one optimizer
step (:mod:`mt_fp8.weight_cache`); inside :func:`~mt_fp8.weight_cache.final_micro_batch` the
backward drops it. Layers reading one input share its quantization (:mod:`mt_fp8.input_cache`).

SwiGLU into FP8 (:class:`FP8SwiGLULinearFunction`, ``FP8Linear.forward_swiglu``): the down
projection of a SwiGLU MLP, ``y = (silu(g)·u) wᵀ + b``, as one autograd function. Its input
``x = silu(g)·u`` is needed only as a GEMM operand, so with tensorwise scales (current or
delayed) on the fused path the quantizer computes it tile by tile from ``g`` and ``u``
(:func:`mt_fp8.ops.quantize_transpose.swiglu_quantize_transpose_amax`) and ``x`` never exists
in high precision: the SwiGLU write and the quantizer's read of ``x`` (2 + 2 bytes per element
in bf16) are gone. Other layouts compute ``x`` in the forward, quantize it and drop it. The
function saves ``g``, ``u`` (what SwiGLU's backward needs anyway) and the FP8 ``xᵀ``; its
backward is the linear's, then ``dg, du`` from ``dx`` (:func:`mt_fp8.ops.swiglu.swiglu_gradients`).
Same bytes, outputs and gradients as ``fp8_linear(swiglu(g, u))``.

Deferred weight gradients (``LinearPlan.wgrad_sink``, :mod:`mt_fp8.wgrad`): the backward
computes ``dx`` and quantizes ``dy`` (and ``dyᵀ``) as always, then queues the ``dw``/``db``
computation in the sink, which adds them into the parameters' ``.grad`` when run, instead of
returning them to autograd: zero-bubble pipeline schedules run it later as their ``W`` step.

Per-GEMM precision (``LinearPlan.fp8_gemms``, ``FP8Linear(fp8_gemms=...)``): any of the three
GEMMs (``forward``, ``dgrad``, ``wgrad``) can run in high precision instead, in the plan's
``out_dtype`` (the autocast dtype, as ``F.linear`` would) from the high-precision operands:
``forward`` reads ``x`` and ``w``; ``dgrad`` saves ``w`` (the parameter itself, no copy) and
reads ``dy``; ``wgrad`` saves ``x`` in high precision (instead of ``xᵀ`` in FP8) and reads ``dy``.
A role is quantized only where an FP8 GEMM reads it (``dy`` not at all when both backward GEMMs
are high precision). This is torchao's per-GEMM configuration and Megatron's ``--fp8-wgrad``,
meant for the most precision-sensitive layer, the output head; the FP8 GEMMs give the same
bytes as in an all-FP8 layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mt_fp8.formats import TensorRole
from mt_fp8.gemm import fp8_gemm
from mt_fp8.linear_plan import LinearPlan
from mt_fp8.ops.swiglu import swiglu, swiglu_gradients
from mt_fp8.quantized import QuantizedTensor
from mt_fp8.wgrad import weight_gradients_or_deferred


def _pack(q: QuantizedTensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if q is None:
        return (None, None)
    # NOTE: under torch.compile Dynamo refused to save the wᵀ scale of the plain-PyTorch
    # tensorwise path ("aliases an input or output" of the autograd function's subgraph; w and
    # wᵀ share it); saving a copy of each scale (a few bytes) compiles every recipe in one graph.
    return (q.data, q.scale.clone() if torch.compiler.is_compiling() else q.scale)


def _forward_gemm(
    ctx: Any,
    plan: LinearPlan,
    x_MK: torch.Tensor | None,
    x_q: QuantizedTensor | None,
    weight_NK: torch.Tensor,
    bias_N: torch.Tensor | None,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``y = x wᵀ + b`` from the quantized input ``x_q`` (or, with a high-precision forward,
    from ``x_MK``); returns ``y`` and the tensors the backward needs (``xᵀ`` and ``wᵀ`` in FP8
    for FP8 GEMMs, ``x`` and ``w`` for high-precision ones, for :func:`_backward_gemms`), and
    records the rest on ``ctx``. ``x_MK`` (high precision) is read only when ``xᵀ`` must be
    requantized or a GEMM reads it; it may be None when ``x_q.transposed`` holds ``xᵀ``."""
    fp8_forward = plan.in_fp8("forward")
    fp8_dx, fp8_dw = plan.in_fp8("dgrad", need_dx), plan.in_fp8("wgrad", need_dw)
    weight_q = weight_t_q = None
    if fp8_forward or fp8_dx:
        weight_q, weight_t_q = plan.weight_operands(weight_NK, need_transpose=fp8_dx)
    bias = None if bias_N is None else bias_N.to(plan.out_dtype)
    if fp8_forward:
        y_MN = fp8_gemm(x_q, weight_q, plan.out_dtype, bias, plan.backend)  # type: ignore[arg-type]
    else:
        y_MN = F.linear(x_MK.to(plan.out_dtype), weight_NK.to(plan.out_dtype), bias)  # type: ignore[union-attr]
    x_t_q = None
    if fp8_dw:
        x_t_q = plan.quantize_transposed(x_MK, x_q, TensorRole.INPUT)  # type: ignore[arg-type]
        x_q.transposed = x_t_q  # type: ignore[union-attr]  # the next layer reading x reuses it
    ctx.plan = plan
    ctx.params = (weight_NK, bias_N) if plan.wgrad_sink is not None else None
    ctx.layouts = (
        None if x_t_q is None else (x_t_q.layout, x_t_q.fmt),
        None if weight_t_q is None else (weight_t_q.layout, weight_t_q.fmt),
    )
    ctx.dtypes = (weight_NK.dtype, None if bias_N is None else bias_N.dtype)
    x_hp = x_MK if need_dw and not fp8_dw else None
    weight_hp = weight_NK if need_dx and not fp8_dx else None
    return y_MN, [*_pack(x_t_q), *_pack(weight_t_q), x_hp, weight_hp]


def _backward_gemms(
    ctx: Any,
    dy_MN: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    x_dtype: torch.dtype,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dw, db)`` from ``dy`` and what :func:`_forward_gemm` saved; with a
    ``plan.wgrad_sink``, ``dw`` and ``db`` are queued there instead (returned as None)."""
    plan: LinearPlan = ctx.plan
    x_t_data, x_t_scale, w_t_data, w_t_scale, x_MK, weight_NK = saved
    w_dtype, b_dtype = ctx.dtypes
    fp8_dx, fp8_dw = plan.in_fp8("dgrad", need_dx), plan.in_fp8("wgrad", need_dw)
    with torch.autocast(dy_MN.device.type, enabled=False):
        dy_MN = dy_MN.contiguous()
        dy_q = None
        if fp8_dx or fp8_dw:
            dy_q = plan.quantize(dy_MN, TensorRole.GRAD_OUTPUT, record=True, transposed=fp8_dw)
        dx = dw = db = None
        if fp8_dx:
            layout, fmt = ctx.layouts[1]
            weight_t_q = QuantizedTensor(w_t_data, w_t_scale, layout, fmt)
            dx = fp8_gemm(dy_q, weight_t_q, x_dtype, None, plan.backend)  # type: ignore[arg-type]
        elif need_dx:
            dx = (dy_MN.to(plan.out_dtype) @ weight_NK.to(plan.out_dtype)).to(x_dtype)
        dy_t_q = None
        if fp8_dw:
            layout, fmt = ctx.layouts[0]
            x_t_q = QuantizedTensor(x_t_data, x_t_scale, layout, fmt)
            dy_t_q = plan.quantize_transposed(dy_MN, dy_q, TensorRole.GRAD_OUTPUT)

        def weight_gradients() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            dw = db = None
            with torch.autocast(dy_MN.device.type, enabled=False):
                if fp8_dw:
                    dw = fp8_gemm(dy_t_q, x_t_q, w_dtype, None, plan.backend)  # type: ignore[arg-type]
                elif need_dw:
                    dw = (dy_MN.to(plan.out_dtype).t() @ x_MK.to(plan.out_dtype)).to(w_dtype)
                if need_db:
                    db = dy_MN.sum(0, dtype=torch.float32).to(b_dtype)
            return dw, db

        sink = plan.wgrad_sink if need_dw or need_db else None
        quantized = (dy_t_q.data, dy_t_q.scale, x_t_q.data, x_t_q.scale) if fp8_dw else ()
        holds = (dy_MN, x_MK, *quantized)
        dw, db = weight_gradients_or_deferred(sink, ctx.params, weight_gradients, holds)
    if plan.weight_cache is not None:
        plan.weight_cache.release_after_backward()
    return dx, dw, db


class FP8LinearFunction(torch.autograd.Function):
    """``y = x wᵀ + b`` with FP8 GEMMs in forward and backward (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x_MK: torch.Tensor,
        weight_NK: torch.Tensor,
        bias_N: torch.Tensor | None,
        plan: LinearPlan,
    ) -> torch.Tensor:
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_dw = plan.in_fp8("wgrad", need_dw)
        x_q = None
        if plan.in_fp8("forward") or fp8_dw:
            x_q = plan.quantize_input(x_MK, transposed=fp8_dw)
        y_MN, saved = _forward_gemm(ctx, plan, x_MK, x_q, weight_NK, bias_N, need_dx, need_dw)
        ctx.save_for_backward(*saved)
        ctx.x_dtype = x_MK.dtype
        return y_MN

    @staticmethod
    def backward(ctx: Any, dy_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dx, dw, db = _backward_gemms(
            ctx, dy_MN, ctx.saved_tensors, ctx.x_dtype, *ctx.needs_input_grad[:3]
        )
        return dx, dw, db, None


class FP8SwiGLULinearFunction(torch.autograd.Function):
    """``y = swiglu(gate, up) wᵀ + b`` with FP8 GEMMs; ``swiglu(gate, up)`` exists only in FP8
    (module docstring: SwiGLU into FP8)."""

    @staticmethod
    def forward(
        ctx: Any,
        gate_MK: torch.Tensor,
        up_MK: torch.Tensor,
        weight_NK: torch.Tensor,
        bias_N: torch.Tensor | None,
        plan: LinearPlan,
    ) -> torch.Tensor:
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = ctx.needs_input_grad[2]
        x_q, x_MK = plan.quantize_swiglu_input(gate_MK, up_MK, transposed=need_dw)
        y_MN, saved = _forward_gemm(ctx, plan, x_MK, x_q, weight_NK, bias_N, need_dx, need_dw)
        ctx.save_for_backward(*saved, gate_MK, up_MK)
        return y_MN

    @staticmethod
    def backward(ctx: Any, dy_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, gate_MK, up_MK = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw, need_db = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dx, dw, db = _backward_gemms(
            ctx, dy_MN, tuple(saved), gate_MK.dtype, need_dx, need_dw, need_db
        )
        dgate = dup = None
        if dx is not None:
            dgate, dup = swiglu_gradients(dx, gate_MK, up_MK)
        return dgate, dup, dw, db, None


def fp8_linear(
    x: torch.Tensor,
    weight_NK: torch.Tensor,
    bias_N: torch.Tensor | None,
    plan: LinearPlan,
) -> torch.Tensor:
    """``x wᵀ + b`` over the last axis of ``x`` (any leading shape) with FP8 GEMMs."""
    in_features = weight_NK.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(
            f"input's last dimension is {x.shape[-1]}, the layer expects {in_features} features"
        )
    x_MK = x.reshape(-1, in_features)
    with torch.autocast(x.device.type, enabled=False):
        y_MN = FP8LinearFunction.apply(x_MK, weight_NK, bias_N, plan)
    return y_MN.reshape(*x.shape[:-1], weight_NK.shape[0])


def fp8_swiglu_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight_NK: torch.Tensor,
    bias_N: torch.Tensor | None,
    plan: LinearPlan,
) -> torch.Tensor:
    """``fp8_linear(swiglu(gate, up), weight, bias, plan)`` without storing ``swiglu(gate, up)``
    in high precision where the fused quantizer applies (module docstring)."""
    in_features = weight_NK.shape[1]
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.shape[-1] != in_features:
        raise ValueError(
            f"fp8_swiglu_linear needs gate and up of one shape and dtype with {in_features} "
            f"features last, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    if not plan.all_fp8:  # the fused SwiGLU quantizer feeds FP8 GEMMs only
        return fp8_linear(swiglu(gate, up), weight_NK, bias_N, plan)
    gate_MK, up_MK = gate.reshape(-1, in_features), up.reshape(-1, in_features)
    with torch.autocast(gate.device.type, enabled=False):
        y_MN = FP8SwiGLULinearFunction.apply(gate_MK, up_MK, weight_NK, bias_N, plan)
    return y_MN.reshape(*gate.shape[:-1], weight_NK.shape[0])
