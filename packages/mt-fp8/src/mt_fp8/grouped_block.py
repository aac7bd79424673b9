"""The grouped path of :class:`~mt_fp8.linear.FP8GroupedLinear` under block scaling and MXFP8.

Shape suffixes: T tokens (sorted by expert), E experts, K in_features, N out_features, P padded
tokens (below), g the group length: 128 for DeepSeek-V3 block scaling, 32 for MXFP8. Expert
``e`` holds the ``T_e`` tokens ``[o_e, o_e + T_e)``.

Why our own kernels: PyTorch has no grouped block-scaled GEMM (``torch._scaled_grouped_mm``, which
:mod:`mt_fp8.grouped` runs for tensorwise and rowwise scaling, takes rowwise scales), and the
per-expert loop of :class:`~mt_fp8.functional.FP8LinearFunction` is bound by the host's kernel
launches at fine-grained MoE shapes (docs/architecture.md, docs/performance.md). The three GEMMs
run in :mod:`mt_fp8.kernels.grouped_block_gemm`, one launch each whatever E is, its two kernels
parameterised by the recipe (:class:`_Steps`): the contraction step g (one scale pair per FP8
product) and whether ``b``'s scales are per g×g block or per row:

=========  ==========================  ==========  ==========================================
GEMM       per expert                  mode        operands (a, b) as passed
=========  ==========================  ==========  ==========================================
forward    ``y_e = x_e W_eᵀ (+ b_e)``  2d × 3d     ``x_TK`` 1×g, ``W_ENK`` (block: 128×128)
dgrad      ``dx_e = dy_e W_e``         2d × 3d     ``dy_TN`` 1×g, ``Wᵀ_EKN`` (block: 128×128)
wgrad      ``dW_e = dy_eᵀ x_e``        k-grouped   ``dyᵀ_NP``, ``xᵀ_KP``, 1×g along P
=========  ==========================  ==========  ==========================================

Block scaling quantizes the weights in 128×128 blocks, MXFP8 in 1×32 groups along the
contraction axis like every other operand (``W`` along K, ``Wᵀ`` along N); MX scales are powers
of two stored as fp32 values, which the kernels read as any fp32 scale.

The FP8 operands are the loop's, byte for byte and scale for scale, built in a number of kernels
that does not depend on E, with the loop's quantizers (:meth:`~mt_fp8.linear_plan.LinearPlan.
quantize`: the Triton kernels of :mod:`mt_fp8.kernels.block_quantize` on CUDA):

* ``x`` and ``dy``: one quantization of all T rows in 1×g groups along the contraction axis.
  A group lies inside one token's row, so it is the loop's per-expert quantization.
* ``W``: one quantization of the stacked (E·N, K) rows, in 128×128 blocks (N a multiple of 128,
  required: no block straddles two experts) or in 1×32 groups (each inside one row). Both
  cached in the layer's grouped weight cache (:func:`mt_fp8.grouped._weight_operands`).
* ``Wᵀ``: block scaling, the exact transpose of each expert's square blocks (FP8 bytes and
  scales transposed), as the loop's ``QuantizedTensor.transpose``. MXFP8, a fresh quantization
  along N, as the loop's ``quantize_transposed`` of each ``W_e``: the same quantizer call as
  ``W`` also quantizes the (K, E·N) transpose of the stacked rows in 1×32 groups along E·N
  (N % 32 == 0, required: a group is 32 outputs of one expert), and one FP8 copy regroups it
  as (E, K, N) (:func:`mt_fp8.grouped._quantize_mx_weights`).
* ``xᵀ`` and ``dyᵀ`` (wgrad, quantized along the tokens): the loop quantizes each expert's
  ``x_eᵀ`` zero-padded to ``P_e = ceil(T_e / g) · g`` tokens, in 1×g groups from the expert's
  first token. Here one scatter puts every expert's tokens at the start of its own segment of
  ``P_e`` columns of a zero ``(P, C)`` buffer (``P = Σ P_e``, or its bound with device group
  sizes, below; skipped when every host ``T_e`` is a multiple of g), and one column
  quantization (:meth:`~mt_fp8.linear_plan.LinearPlan.quantize_transposed`) cuts it into 1×g
  groups along P. Every group lies inside one segment and holds the same values as the loop's group plus
  zeros (the loop's padding is zeros too), and zeros change no amax, so scales and bytes are
  the loop's, the last partial group of each expert included; no group is all padding, as the
  kernel's step is the group. An expert with no tokens has an empty segment; its ``dW_e`` is
  written as zeros by the kernel.

Group sizes. The kernels' tables (the 2d × 3d tile table, the wgrad segment starts and each
token's padded column) come from the group sizes in either form the call takes them:

* Host ints: built on the host, exact (P = Σ P_e, no scatter when no expert needs padding),
  and copied to the device without waiting (:func:`mt_fp8.grouped._host_ints`).
* An integer tensor on the tokens' device (mt-parallel's MoE experts pass the router's
  counts): built there, by a number of kernels that depends on neither E nor the counts, in
  buffers whose sizes the host knows without reading the counts.
  The tile table has ``ceil(T / 128) + E`` entries (``Σ ceil(T_e / 128) <= T / 128 + E``,
  :func:`~mt_fp8.kernels.grouped_block_gemm.device_row_tiles`): the experts' tiles in the
  host table's order, then ``(0, 0, 0)`` entries, whose programs run no steps and store
  nothing. The wgrad operands have ``P = floor((T + E·(g - 1)) / g) · g`` padded tokens
  (``Σ P_e <= T + E·(g - 1)``, a multiple of g), every token scattered to its segment and the
  columns past the last segment zeros, which the k-grouped kernel never reads. The segments
  and tiles hold what the host-built ones hold, so bytes, scales and outputs are the same bits.

Either way the host reads nothing from the device, with one exception: a bias gradient with
device sizes, which sums each expert's rows as the loop does (a slice per expert), reads the
sizes to the host once in the backward (mt-parallel's experts have no bias). Health counts (``track_health``): the row casts of ``x``, ``dy`` and the stacked
weight count them, transposed operands nothing, as in the loop (which counts the weights of
experts with tokens only). Output dtypes are the loop's: ``y`` in the plan's output dtype (bias
added in the fp32 epilogue), ``dx`` in the input's dtype, ``dW`` in the weight's, each rounded
once from the fp32 accumulator. The bias gradient is one fp32 sum per expert, as the loop's.

Deferred weight gradients (``plan.wgrad_sink``): as in :mod:`mt_fp8.grouped`, the backward
quantizes ``dy`` and ``dyᵀ`` and runs dgrad, but queues the k-grouped wgrad GEMM and the bias
gradient in the sink instead of running them (the same operands and kernel: the same bits).

The kernel module (and with it its host-side tables) is imported on first use: it imports
Triton, which mt-fp8 does not require (as :mod:`mt_fp8.gemm` imports its Triton GEMM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mt_fp8.formats import TensorRole
from mt_fp8.grouped import (
    GroupSizes,
    _bias_gradient,
    _host_ints,
    _weight_operands,
    check_group_sizes,
    padded_token_columns,
)
from mt_fp8.linear_plan import LinearPlan
from mt_fp8.quantized import QuantizedTensor
from mt_fp8.recipes import BlockScaling, MXFP8Scaling, Recipe
from mt_fp8.wgrad import weight_gradients_or_deferred


@dataclass(frozen=True)
class _Steps:
    """How the kernels step through the contraction for a recipe (module docstring)."""

    group: int
    """g: the 1×g group length of every operand but block scaling's weights, the kernels' step."""
    weight_row_scales: bool
    """Whether ``W`` and ``Wᵀ`` have a scale per row and group (MXFP8) rather than per g×g
    block (block scaling)."""

    @classmethod
    def of(cls, recipe: Recipe) -> _Steps:
        """The steps of ``recipe``; raises for a recipe the kernels do not take."""
        if isinstance(recipe, MXFP8Scaling):
            return cls(recipe.block, True)
        if isinstance(recipe, BlockScaling) and (recipe.group, recipe.weight_block) == (128, 128):
            return cls(128, False)
        raise ValueError(
            "fp8_block_grouped_linear takes BlockScaling with group=128 and weight_block=128, "
            f"or MXFP8Scaling, got {recipe!r}"
        )


@dataclass
class _TokenSegments:
    """Where each expert's tokens go in the g-padded wgrad operands (module docstring)."""

    starts: torch.Tensor
    """E + 1 int32 segment boundaries (multiples of g) on the device."""
    padded_tokens: int
    """P, the padded token count."""
    dest_T: torch.Tensor | None
    """The padded row of each token (int64, on the device); None when no expert needs padding."""

    @classmethod
    def of(cls, sizes: Sequence[int], device: torch.device, group: int) -> _TokenSegments:
        """The segments of host sizes: P exact, no scatter where every size is a multiple of
        g."""
        from mt_fp8.kernels.grouped_block_gemm import padded_starts

        starts = padded_starts(sizes, group)
        dest_T = None
        if starts[-1] != sum(sizes):
            shift_E, shift = [], 0
            for size, start in zip(sizes, starts, strict=False):
                shift_E.append(start - shift)
                shift += size
            shift_E, counts_E = _host_ints([shift_E, list(sizes)], torch.int64, device)
            shift_T = shift_E.repeat_interleave(counts_E, output_size=sum(sizes))
            dest_T = torch.arange(sum(sizes), device=device) + shift_T
        return cls(_host_ints(starts, torch.int32, device), starts[-1], dest_T)

    @classmethod
    def on_device(cls, sizes_E: torch.Tensor, tokens: int, group: int) -> _TokenSegments:
        """The segments of device sizes (summing to ``tokens``), computed there: P is the
        bound :func:`~mt_fp8.kernels.grouped_block_gemm.max_padded_tokens` and every token is
        scattered (module docstring: device group sizes)."""
        from mt_fp8.kernels.grouped_block_gemm import device_padded_starts, max_padded_tokens

        starts = device_padded_starts(sizes_E, group)
        sizes = sizes_E.to(torch.int64)
        dest_T = padded_token_columns(sizes, starts[:-1].to(torch.int64), tokens)
        return cls(starts, max_padded_tokens(tokens, sizes.numel(), group), dest_T)

    def quantize(self, plan: LinearPlan, x_TC: torch.Tensor, role: TensorRole) -> QuantizedTensor:
        """``xᵀ`` (C, P) in 1×g groups along the padded tokens: every expert's ``x_eᵀ`` as
        the loop quantizes it, side by side (module docstring)."""
        padded = x_TC
        if self.dest_T is not None:
            padded = x_TC.new_zeros(self.padded_tokens, x_TC.shape[1])
            padded.index_copy_(0, self.dest_T, x_TC)
        return plan.quantize_transposed(padded, None, role)


def _row_tiles(sizes: GroupSizes, tokens: int, device: torch.device) -> torch.Tensor:
    from mt_fp8.kernels.grouped_block_gemm import device_row_tiles, row_tiles

    if isinstance(sizes, torch.Tensor):
        return device_row_tiles(sizes, tokens)
    return _host_ints(row_tiles(sizes), torch.int32, device)


def _token_segments(
    sizes: GroupSizes, tokens: int, device: torch.device, group: int
) -> _TokenSegments:
    if isinstance(sizes, torch.Tensor):
        return _TokenSegments.on_device(sizes, tokens, group)
    return _TokenSegments.of(sizes, device, group)


class FP8BlockGroupedLinearFunction(torch.autograd.Function):
    """``y[group e] = x[group e] W_eᵀ + b_e`` with grouped block-scaled (or MXFP8) FP8 GEMMs
    (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x_TK: torch.Tensor,
        weight_ENK: torch.Tensor,
        bias_EN: torch.Tensor | None,
        plan: LinearPlan,
        sizes: GroupSizes,
    ) -> torch.Tensor:
        from mt_fp8.kernels.grouped_block_gemm import grouped_block_mm

        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        steps = _Steps.of(plan.recipe)
        tokens = x_TK.shape[0]
        tiles = _row_tiles(sizes, tokens, x_TK.device)
        x_q = plan.quantize(x_TK, TensorRole.INPUT, record=True)
        weight, weight_t = _weight_operands(plan, weight_ENK, need_transpose=need_dx)
        bias = None if bias_EN is None else bias_EN.to(plan.out_dtype)
        y_TN = grouped_block_mm(
            x_q.data,
            x_q.scale,
            weight.data,
            weight.scale,
            tiles,
            plan.out_dtype,
            bias,
            steps.group,
            steps.weight_row_scales,
        )
        saved = [tiles]
        if need_dw:
            segments = _token_segments(sizes, tokens, x_TK.device, steps.group)
            x_t = segments.quantize(plan, x_TK, TensorRole.INPUT)
            saved += [x_t.data, x_t.scale]
            ctx.segments = segments
        if need_dx:
            assert weight_t is not None
            saved += [weight_t.data, weight_t.scale]
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.sizes, ctx.steps = plan, sizes, steps
        ctx.params = (weight_ENK, bias_EN) if plan.wgrad_sink is not None else None
        ctx.dtypes = (x_TK.dtype, weight_ENK.dtype, None if bias_EN is None else bias_EN.dtype)
        return y_TN

    @staticmethod
    def backward(ctx: Any, dy_TN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from mt_fp8.kernels.grouped_block_gemm import grouped_block_mm, k_grouped_block_mm

        plan: LinearPlan = ctx.plan
        steps: _Steps = ctx.steps
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        saved = list(ctx.saved_tensors)
        tiles, sizes = saved.pop(0), ctx.sizes
        dx = None
        with torch.autocast(dy_TN.device.type, enabled=False):
            dy_TN = dy_TN.contiguous()
            if need_dx or need_dw:  # as the loop: dy's rows quantized (and counted) for either
                dy_q = plan.quantize(dy_TN, TensorRole.GRAD_OUTPUT, record=True)
            if need_dw:  # the operands here, the GEMM in weight_gradients
                x_t_data, x_t_scale = saved.pop(0), saved.pop(0)
                segments: _TokenSegments = ctx.segments
                dy_t = segments.quantize(plan, dy_TN, TensorRole.GRAD_OUTPUT)

            def weight_gradients() -> tuple[torch.Tensor | None, torch.Tensor | None]:
                dw = db = None
                with torch.autocast(dy_TN.device.type, enabled=False):
                    if need_dw:
                        dw = k_grouped_block_mm(
                            dy_t.data,
                            dy_t.scale,
                            x_t_data,
                            x_t_scale,
                            segments.starts,
                            w_dtype,
                            steps.group,
                        )
                    if need_db:  # reads device sizes: the loop's sums (module docstring)
                        db = _bias_gradient(dy_TN, sizes, b_dtype)
                return dw, db

            sink = plan.wgrad_sink if need_dw or need_db else None
            operands = (dy_t.data, dy_t.scale, x_t_data, x_t_scale, segments.starts)
            device_sizes = sizes if need_db and isinstance(sizes, torch.Tensor) else None
            holds = (dy_TN, device_sizes, *(operands if need_dw else ()))
            dw, db = weight_gradients_or_deferred(sink, ctx.params, weight_gradients, holds)
            if need_dx:
                weight_t_data, weight_t_scale = saved.pop(0), saved.pop(0)
                dx = grouped_block_mm(
                    dy_q.data,
                    dy_q.scale,
                    weight_t_data,
                    weight_t_scale,
                    tiles,
                    x_dtype,
                    None,
                    steps.group,
                    steps.weight_row_scales,
                )
        if plan.weight_cache is not None:
            plan.weight_cache.release_after_backward()
        return dx, dw, db, None, None


def fp8_block_grouped_linear(
    x_TK: torch.Tensor,
    weight_ENK: torch.Tensor,
    bias_EN: torch.Tensor | None,
    group_sizes: Sequence[int] | torch.Tensor,
    plan: LinearPlan,
) -> torch.Tensor:
    """``y[group e] = x[group e] W_eᵀ + b_e`` with the grouped block-scaled FP8 GEMMs.

    ``group_sizes``: E host ints, or an integer tensor of E counts on ``x_TK``'s device, read
    there (module docstring: device group sizes; that they are non-negative and sum to T is
    then the caller's to ensure, as checking would read them). ``plan.recipe`` is a
    :class:`~mt_fp8.recipes.BlockScaling` with 128-long groups and blocks or an
    :class:`~mt_fp8.recipes.MXFP8Scaling`, ``plan.weight_cache`` the layer's grouped weight
    cache (or None); the caller checks the device with
    :func:`~mt_fp8.grouped.grouped_gemm_reason`.
    """
    experts, out_features, in_features = weight_ENK.shape
    sizes = check_group_sizes(group_sizes, experts, x_TK)
    steps = _Steps.of(plan.recipe)
    if in_features % steps.group or out_features % steps.group:
        unit = "1x32 groups of W and Wᵀ" if steps.weight_row_scales else "weight blocks per expert"
        raise ValueError(
            f"fp8_block_grouped_linear with the {plan.recipe.name} recipe needs K and N "
            f"divisible by {steps.group} (whole {unit}), got K={in_features}, N={out_features}"
        )
    with torch.autocast(x_TK.device.type, enabled=False):
        return FP8BlockGroupedLinearFunction.apply(x_TK, weight_ENK, bias_EN, plan, sizes)
