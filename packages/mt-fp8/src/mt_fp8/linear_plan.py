"""The plan of one FP8 linear call and its quantizer dispatch (:class:`LinearPlan`).

A :class:`LinearPlan` holds everything non-tensor that :mod:`mt_fp8.functional`'s autograd
functions need: recipe, FP8 state, GEMM backend, output dtype, health tracking, the layer's
:class:`~mt_fp8.weight_cache.WeightCache`, the amax group and the GEMMs that run in FP8. Its
methods quantize the operands of the three GEMMs, each along its contraction axis: ``x`` and
``w`` along K, ``dy`` along N, and for the weight gradient ``xᵀ`` and ``dyᵀ`` along M.

Quantizer dispatch. ``quantize`` picks, per tensor, the fused Triton quantizer where one applies
(CUDA tensors with Triton, or ``TRITON_INTERPRET=1``; not under ``torch.compile``), else the
plain-PyTorch :func:`mt_fp8.quantized.quantize`; all give the same bytes:

* tensorwise roles go through one quantize + transpose + amax pass
  (:mod:`mt_fp8.ops.quantize_transpose`);
* block scaling with 1×128 groups (and MX 1×32 groups) and 128×128 weight blocks goes through
  :mod:`mt_fp8.kernels.block_quantize`: ``x`` and ``dy`` are quantized along their last axis
  and, when the wgrad GEMM will need it, their transposes requantized along the tokens
  (zero-padded to a multiple of the group) by a second kernel that stores them transposed; the
  weight's 128×128 blocks in one pass, its transpose exact;
* rowwise scales go through :mod:`mt_fp8.kernels.rowwise_quantize` (``xᵀ``: column amaxes, then
  a kernel that scales ``x``'s columns and stores them transposed).

Inside ``torch.compile`` graphs the plain-PyTorch path runs and Inductor fuses it with its
neighbours. NOTE: the Triton quantizers wrapped as ``torch.library`` custom ops were slower
there: the opaque calls add host time, and rowwise needs separate transpose copies Inductor
otherwise fuses (docs/benchmarks-log.md).

Transposed operands (``quantize_transposed``): the exact transpose of the forward copy for
tensorwise and square-block scales, a requantization otherwise. Row-group layouts (1×g) pad the
token axis with zeros to a multiple of g (:meth:`LinearPlan.row_multiple`); zero columns add
nothing to the wgrad product.

Operand reuse: ``weight_operands`` keeps the FP8 weight across micro-batches
(:mod:`mt_fp8.weight_cache`), ``quantize_input`` shares one input's quantization between the
layers that read it (:mod:`mt_fp8.input_cache`).

Current tensorwise scaling under tensor parallelism: when the plan has an ``amax_group`` (the
layer's ``fp8_meta.amax_group``, set by ``fp8_autocast(amax_group=...)`` or by the caller) and a
role is in ``amax_reduction_roles``, that role's amax is MAX-reduced over the group before its
scale is computed (:func:`mt_fp8.quantized.quantize`), so a tensor sharded over the TP ranks
(a column-parallel weight and output gradient, a row-parallel weight and input) is quantized
with the scale of the whole tensor on every rank: the shards' FP8 values are exactly the slices
of the unsharded layer's. Reducing a replicated tensor is harmless (every rank has the same
amax). Each reduction is an all-reduce every rank of the group must join in the same order.
Other recipes ignore the group here (delayed scaling reduces in ``update_fp8_scales``).

Delayed-scaling scales come from :class:`~mt_fp8.state.FP8Meta`; amaxes of x, w and dy are
recorded there, as are the health counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mt_fp8.formats import TensorRole
from mt_fp8.input_cache import quantize_shared_input
from mt_fp8.ops.dispatch import use_triton
from mt_fp8.ops.quantize_transpose import quantize_transpose_amax, swiglu_quantize_transpose_amax
from mt_fp8.ops.swiglu import swiglu
from mt_fp8.quantized import (
    BLOCKS_128X128,
    ROWWISE,
    TENSORWISE,
    TRITON_GROUP_LAYOUTS,
    QuantizedTensor,
    ScaleLayout,
    quantize,
)
from mt_fp8.recipes import DelayedScaling, Recipe, TensorwiseScaling
from mt_fp8.state import FP8Meta
from mt_fp8.weight_cache import WeightCache, weight_key
from mt_fp8.wgrad import WeightGradSink

FP8_GEMMS = ("forward", "dgrad", "wgrad")
"""The three GEMMs of a linear layer (:mod:`mt_fp8.recipes`), in the names ``fp8_gemms`` takes."""


def parse_fp8_gemms(gemms: Iterable[str]) -> frozenset[str]:
    """``gemms`` as a set of :data:`FP8_GEMMS` names; raises on an unknown name or no name."""
    if isinstance(gemms, str):
        gemms = (gemms,)
    parsed = frozenset(gemms)
    unknown = sorted(parsed - set(FP8_GEMMS))
    if unknown or not parsed:
        what = f"unknown GEMM names {unknown}" if unknown else "no GEMM"
        raise ValueError(
            f"fp8_gemms={sorted(parsed)} names {what}; valid: a non-empty subset of "
            f"{', '.join(FP8_GEMMS)} (a layer with no FP8 GEMM is a plain nn.Linear)"
        )
    return parsed


def dims_multiple(recipe: Recipe) -> int:
    """What both dims of a linear must be divisible by to run ``recipe`` in FP8: 16 (the FP8
    GEMMs) and every block size of its layouts."""
    need = 16
    for role in TensorRole:
        block = recipe.layout(role).block
        need = math.lcm(need, *(b for b in block if b > 0))
    return need


def check_dims(recipe: Recipe, in_features: int, out_features: int) -> str | None:
    """Why a (in, out) layer cannot run ``recipe`` in FP8, or None if it can."""
    need = dims_multiple(recipe)
    if in_features % need or out_features % need:
        return (
            f"in_features={in_features} and out_features={out_features} must both be divisible "
            f"by {need} for FP8 GEMMs with the {recipe.name} recipe"
        )
    return None


@dataclass
class LinearPlan:
    """Everything non-tensor one FP8 linear call needs, and its quantizers (module docstring)."""

    recipe: Recipe
    meta: FP8Meta
    backend: str
    out_dtype: torch.dtype
    track_health: bool
    weight_cache: WeightCache | None
    """The layer's FP8 weight cache, or None to quantize the weight on every call."""
    amax_group: dist.ProcessGroup | None = None
    """Process group for current tensorwise amax reduction (module docstring), or None."""
    amax_reduction_roles: frozenset[TensorRole] = field(default_factory=lambda: frozenset())
    """Roles whose current tensorwise amax is MAX-reduced over ``amax_group``."""
    fp8_gemms: frozenset[str] = frozenset(FP8_GEMMS)
    """The GEMMs that run in FP8; the others run in ``out_dtype`` (module docstring)."""
    wgrad_sink: WeightGradSink | None = None
    """Where the backward queues its weight-gradient GEMM instead of running it (None: runs
    it; :mod:`mt_fp8.wgrad`)."""

    def in_fp8(self, gemm: str, needed: bool = True) -> bool:
        """Whether this call runs ``gemm`` in FP8 (``needed``: whether it runs ``gemm`` at all)."""
        return needed and gemm in self.fp8_gemms

    @property
    def all_fp8(self) -> bool:
        """Whether every GEMM runs in FP8 (the default)."""
        return len(self.fp8_gemms) == len(FP8_GEMMS)

    def reduction_group(self, role: TensorRole) -> dist.ProcessGroup | None:
        """The group to reduce ``role``'s amax over, or None (current tensorwise scaling only)."""
        if (
            self.amax_group is None
            or role not in self.amax_reduction_roles
            or not isinstance(self.recipe, TensorwiseScaling)
        ):
            return None
        return self.amax_group

    def health_stats(self, role: TensorRole, record: bool = True) -> torch.Tensor | None:
        """The health counters a cast of ``role`` adds to, or None (not recorded or tracked)."""
        return self.meta.health[int(role)] if (record and self.track_health) else None

    def delayed_scale(self, role: TensorRole) -> torch.Tensor | None:
        """The delayed-scaling scale of ``role``, or None for current scaling: other recipes,
        and delayed scaling before its first update (:mod:`mt_fp8.state`)."""
        meta = self.meta.meta_for(role)
        if isinstance(self.recipe, DelayedScaling) and meta.scales_ready:
            return meta.scale[int(role)]
        return None

    def quantize(
        self,
        x_RC: torch.Tensor,
        role: TensorRole,
        record: bool,
        transposed: bool = False,
        matrices: int = 1,
    ) -> QuantizedTensor:
        """Quantize along the last axis; ``record`` notes the amax and health counts.

        ``transposed`` says :meth:`quantize_transposed` will be asked for ``xᵀ`` too, so a fused
        1×128 kernel writes it in the same pass (module docstring). For 128×128 blocks, where
        that kernel stores the exact transpose in ``.transposed``, ``matrices`` > 1 reads ``x``
        as that many stacked matrices and stores each one's transpose
        (:func:`mt_fp8.kernels.block_quantize.quantize_square_blocks`); other layouts ignore it.
        """
        delayed = isinstance(self.recipe, DelayedScaling)
        scale = self.delayed_scale(role)
        stats = self.health_stats(role, record)
        fmt = self.recipe.formats.for_role(role)
        layout = self.recipe.layout(role)
        group = self.reduction_group(role)
        if self._fused_block_layout(x_RC, layout) and scale is None and group is None:
            from mt_fp8.kernels.block_quantize import (
                quantize_groups_with_transpose,
                quantize_square_blocks,
            )

            if layout == BLOCKS_128X128:
                return quantize_square_blocks(x_RC, fmt, stats, transposed, matrices)
            q_RC, q_CR = quantize_groups_with_transpose(x_RC, fmt, stats, transposed, layout)
            q_RC.transposed = q_CR
            return q_RC
        if self._fused_tensorwise(x_RC, layout):
            return self._quantize_tensorwise(x_RC, None, role, record)
        if self._fused_rowwise(x_RC, layout):
            from mt_fp8.kernels.rowwise_quantize import quantize_rows

            return quantize_rows(x_RC, fmt, stats)
        if delayed and record:
            self.meta.meta_for(role).record_amax(x_RC, role)
        return quantize(x_RC, fmt, layout, scale=scale, stats=stats, amax_group=group)

    def _fused_tensorwise(self, x_RC: torch.Tensor, layout: ScaleLayout) -> bool:
        """Whether the Triton quantize + transpose + amax kernel takes ``x`` (tensorwise)."""
        return layout == TENSORWISE and use_triton(x_RC) and not torch.compiler.is_compiling()

    def _quantize_tensorwise(
        self, x_RC: torch.Tensor, up_RC: torch.Tensor | None, role: TensorRole, record: bool
    ) -> QuantizedTensor:
        """``x`` (or ``silu(x)·up`` with ``up``) with its transpose, from one fused pass; the
        amax it returns doubles as the delayed-scaling record."""
        stats = self.health_stats(role, record)
        fmt = self.recipe.formats.for_role(role)
        scale, group = self.delayed_scale(role), self.reduction_group(role)
        if up_RC is None:
            q_RC, q_CR, amax = quantize_transpose_amax(x_RC, fmt, scale, stats, group)
        else:
            q_RC, q_CR, amax = swiglu_quantize_transpose_amax(x_RC, up_RC, fmt, scale, stats, group)
        if isinstance(self.recipe, DelayedScaling) and record:
            self.meta.meta_for(role).record_amax_value(amax, role)
        q_RC.transposed = q_CR
        return q_RC

    def quantize_swiglu_input(
        self, gate_MK: torch.Tensor, up_MK: torch.Tensor, transposed: bool
    ) -> tuple[QuantizedTensor, torch.Tensor | None]:
        """The INPUT operand ``silu(gate)·up`` and, where it had to be computed in high
        precision first (every path but the fused tensorwise kernel), that tensor (module
        docstring: SwiGLU into FP8)."""
        role = TensorRole.INPUT
        if self._fused_tensorwise(gate_MK, self.recipe.layout(role)):
            return self._quantize_tensorwise(gate_MK, up_MK, role, record=True), None
        x_MK = swiglu(gate_MK, up_MK)
        return self.quantize(x_MK, role, record=True, transposed=transposed), x_MK

    def quantize_input(self, x_MK: torch.Tensor, transposed: bool) -> QuantizedTensor:
        """The INPUT operand, reused from the previous layer when it read the same tensor
        (:mod:`mt_fp8.input_cache`)."""
        return quantize_shared_input(self, x_MK, transposed)

    def quantize_transposed(
        self, x_RC: torch.Tensor, q_RC: QuantizedTensor | None, role: TensorRole
    ) -> QuantizedTensor:
        """``xᵀ`` quantized along R: exact transpose where the layout allows, else requantized."""
        layout = self.recipe.layout(role)
        br, bc = layout.block
        if q_RC is not None and q_RC.transposed is not None:
            return q_RC.transposed  # from a fused kernel: exact, or requantized and padded
        if q_RC is not None and ((br, bc) == (-1, -1) or br == bc):
            return q_RC.transpose()
        fmt = self.recipe.formats.for_role(role)
        if self._fused_block_layout(x_RC, layout) and role is not TensorRole.WEIGHT:
            from mt_fp8.kernels.block_quantize import quantize_group_columns

            return quantize_group_columns(x_RC, fmt, layout)  # pads R to the group, as below
        if self._fused_rowwise(x_RC, layout):  # rowwise needs no padding (row_multiple 1)
            from mt_fp8.kernels.rowwise_quantize import quantize_columns_transposed

            return quantize_columns_transposed(x_RC, fmt)
        x_CR = x_RC.t()
        if role is not TensorRole.WEIGHT:
            x_CR = _pad_columns(x_CR, self.row_multiple())
        return quantize(x_CR, fmt, layout, scale=self.delayed_scale(role))

    @staticmethod
    def _fused_rowwise(x_RC: torch.Tensor, layout: ScaleLayout) -> bool:
        """Whether the Triton rowwise quantizer takes ``x`` (current rowwise scales)."""
        return (
            layout == ROWWISE
            and x_RC.numel() > 0
            and x_RC.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and use_triton(x_RC)
            and not torch.compiler.is_compiling()
        )

    def _fused_block_layout(self, x_RC: torch.Tensor, layout: ScaleLayout) -> bool:
        """Whether the Triton block quantizer takes ``x`` in ``layout`` (1×128, MX 1×32 or
        128×128)."""
        if layout not in TRITON_GROUP_LAYOUTS or x_RC.dtype == torch.float64:
            return False
        # The kernel's tiles are 128 columns wide; it pads the transposed operand to a multiple
        # of the group length, and the wgrad GEMM's operands must agree on the token count.
        if x_RC.shape[1] % 128:
            return False
        if layout != BLOCKS_128X128 and self.row_multiple() != layout.block[1]:
            return False
        return use_triton(x_RC) and not torch.compiler.is_compiling()

    def row_multiple(self) -> int:
        """Token-count multiple the wgrad GEMM needs (the 1×g group of inputs and gradients)."""
        widths = [
            max(self.recipe.layout(role).block[1], 1)
            for role in (TensorRole.INPUT, TensorRole.GRAD_OUTPUT)
        ]
        return math.lcm(*widths)

    def weight_operands(
        self, weight_NK: torch.Tensor, need_transpose: bool
    ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
        """FP8 ``w`` along K and (if needed) ``wᵀ`` along N, cached across micro-batches
        (:mod:`mt_fp8.weight_cache`)."""
        key = None
        if self.weight_cache is not None and not torch.compiler.is_compiling():
            context = (
                self.recipe,
                self.meta.scale_version,
                self.reduction_group(TensorRole.WEIGHT),
                need_transpose,
            )
            key = weight_key(weight_NK, context)
            cached = self.weight_cache.lookup(key, weight_NK)
            if cached is not None:
                return cached.weight, cached.weight_transposed
        # A fused group quantizer writes wᵀ in the same pass; N must need no padding for it.
        layout = self.recipe.layout(TensorRole.WEIGHT)
        weight_q = self.quantize(
            weight_NK,
            TensorRole.WEIGHT,
            record=True,
            transposed=need_transpose and weight_NK.shape[0] % max(layout.block[1], 1) == 0,
        )
        weight_t_q = (
            self.quantize_transposed(weight_NK, weight_q, TensorRole.WEIGHT)
            if need_transpose
            else None
        )
        if key is not None:
            self.weight_cache.store(key, weight_NK, weight_q, weight_t_q)  # type: ignore[union-attr]
        return weight_q, weight_t_q


def _pad_columns(x_RC: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x_RC.shape[1] % multiple
    return F.pad(x_RC, (0, pad)) if pad else x_RC
