"""The FP8 linear autograd function shared by :class:`FP8Linear` and :class:`FP8GroupedLinear`.

Shape suffixes: M tokens, K input features, N output features; ``a_XZ · b_YZᵀ`` is the GEMM form
of :mod:`mt_fp8.gemm` (contract the last axis of both operands).

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

The FP8 weight (and its transpose) is cached by the layer and reused while the weight is the
same tensor object (a weak reference, so a new parameter that happens to reuse freed memory is
not mistaken for the old one), with the same storage pointer and ``_version``, under the same
scale state and amax group, and no ``torch.optim`` optimizer has stepped since: i.e. across the
micro-batches of one optimizer step. The last condition is a counter that a global optimizer
step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``) advances after
every step of every torch optimizer. NOTE: the version counter alone is not enough: fused
optimizer kernels (``torch.optim.AdamW(fused=True)``, the default on GPUs) update parameters in
place without bumping ``_version`` (measured with torch 2.11 and 2.13), and a cache keyed on it
kept serving the first step's FP8 weights. Writes outside a torch optimizer that do not bump
``_version`` either (``p.data.copy_(...)``, a custom fused update) need a call to
:func:`mt_fp8.clear_fp8_weight_caches` afterwards. Under ``torch.compile`` the cache is bypassed
(the weight is quantized inside the graph, where the compiler can fuse it).
Inside :func:`final_micro_batch` (``mt_parallel.accumulate(model, is_last=True)`` enters it) a
layer's backward drops its cache entry once it has run: no later call of this optimizer step
needs it, and the entries would otherwise stay alive until the next step's forward, adding the
FP8 ``w`` and ``wᵀ`` of every layer (2 bytes per weight element) to the memory peak at the end
of backward, where all gradients exist. Under activation recompute the recomputed forward still
finds the entry (it runs just before the layer's backward), so the weight is quantized once
per step either way.
Shared input quantization: layers that read the same tensor one after the other (q/k/v
projections of one normalised input, gate/up of the MLP) quantize it once. With current scaling
(every recipe but delayed) ``q = quantize(x)`` depends only on ``x``, the recipe and the amax
group, so the last input's FP8 operands (``x`` and ``xᵀ``) are kept, keyed like the weight cache
(same owner tensor by weak reference, storage pointer, shape, strides, dtype and ``_version``, plus
recipe, amax group and whether ``xᵀ`` is needed), and reused on a match; the layers then also
save the same FP8 ``xᵀ`` for backward. Health counts are added to each layer's own counters as
if it had quantized ``x`` itself. Delayed scaling shares only between layers whose INPUT scales
are tied (:func:`mt_fp8.state.tie_input_scales`; the key then also holds the owning meta and its
``scale_version``): untied layers have scales of their own. Compiled graphs always quantize.
Delayed-scaling scales come from :class:`~mt_fp8.state.FP8Meta`; amaxes of x, w and dy are
recorded there, as are the health counts.

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

Fused quantization (CUDA tensors with Triton, or ``TRITON_INTERPRET=1``; not under
``torch.compile``): tensorwise roles go through one quantize + transpose + amax pass
(:mod:`mt_fp8.ops.quantize_transpose`). Block scaling with 1×128 groups and 128×128 weight
blocks goes through :mod:`mt_fp8.kernels.block_quantize`: ``x`` and ``dy`` are quantized along
their last axis and, when the wgrad GEMM will need it, their transposes requantized along the
tokens (zero-padded to a multiple of 128) by a second kernel that stores them transposed; the
weight's 128×128 blocks in one pass, its transpose exact. Rowwise scales go through
:mod:`mt_fp8.kernels.rowwise_quantize` (``xᵀ``: column amaxes, then a kernel that scales
``x``'s columns and stores them transposed). All give
the same bytes as the PyTorch path. Inside ``torch.compile`` graphs the plain-PyTorch path runs
and Inductor fuses it with its neighbours. NOTE: the Triton quantizers wrapped as
``torch.library`` custom ops were slower there on the H200 (2026-12-03, fwd+bwd at M = 8192,
4096×14336: tensorwise 3.14 against 2.51 ms, rowwise 4.56 against 2.93 ms; the opaque calls
add host time, and rowwise needs separate transpose copies Inductor otherwise fuses).

Per-GEMM precision (``LinearPlan.fp8_gemms``, ``FP8Linear(fp8_gemms=...)``): any of the three
GEMMs (``forward``, ``dgrad``, ``wgrad``) can run in high precision instead, in the plan's
``out_dtype`` (the autocast dtype, as ``F.linear`` would) from the high-precision operands:
``forward`` reads ``x`` and ``w``; ``dgrad`` saves ``w`` (the parameter itself, no copy) and
reads ``dy``; ``wgrad`` saves ``x`` in high precision (instead of ``xᵀ`` in FP8) and reads ``dy``.
A role is quantized only where an FP8 GEMM reads it (``dy`` not at all when both backward GEMMs
are high precision). This is torchao's per-GEMM configuration and Megatron's ``--fp8-wgrad``,
meant for the most precision-sensitive layer, the output head; the FP8 GEMMs give the same
bytes as in an all-FP8 layer.

Current tensorwise scaling under tensor parallelism: when the plan has an ``amax_group`` (the
layer's ``fp8_meta.amax_group``, set by ``fp8_autocast(amax_group=...)`` or by the caller) and a
role is in ``amax_reduction_roles``, that role's amax is MAX-reduced over the group before its
scale is computed (:func:`mt_fp8.quantized.quantize`), so a tensor sharded over the TP ranks
(a column-parallel weight and output gradient, a row-parallel weight and input) is quantized
with the scale of the whole tensor on every rank: the shards' FP8 values are exactly the slices
of the unsharded layer's. Reducing a replicated tensor is harmless (every rank has the same
amax). Each reduction is an all-reduce every rank of the group must join in the same order.
Other recipes ignore the group here (delayed scaling reduces in ``update_fp8_scales``).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from mt_fp8.formats import TensorRole
from mt_fp8.gemm import fp8_gemm
from mt_fp8.ops.dispatch import use_triton
from mt_fp8.ops.quantize_transpose import quantize_transpose_amax, swiglu_quantize_transpose_amax
from mt_fp8.ops.swiglu import swiglu, swiglu_gradients
from mt_fp8.quantized import (
    BLOCKS_128X128,
    GROUPS_1X128,
    MX_1X32,
    ROWWISE,
    TENSORWISE,
    QuantizedTensor,
    ScaleLayout,
    quantize,
)
from mt_fp8.recipes import DelayedScaling, Recipe, TensorwiseScaling
from mt_fp8.state import FP8Meta

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


@dataclass
class LinearPlan:
    """Everything non-tensor one FP8 linear call needs."""

    recipe: Recipe
    meta: FP8Meta
    backend: str
    out_dtype: torch.dtype
    track_health: bool
    weight_cache: dict[Any, Any] | None
    amax_group: dist.ProcessGroup | None = None
    """Process group for current tensorwise amax reduction (module docstring), or None."""
    amax_reduction_roles: frozenset[TensorRole] = field(default_factory=lambda: frozenset())
    """Roles whose current tensorwise amax is MAX-reduced over ``amax_group``."""
    fp8_gemms: frozenset[str] = frozenset(FP8_GEMMS)
    """The GEMMs that run in FP8; the others run in ``out_dtype`` (module docstring)."""

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

    def delayed_scale(self, role: TensorRole) -> torch.Tensor | None:
        """The delayed-scaling scale of ``role``, or None for current scaling: other recipes,
        and delayed scaling before its first update (:mod:`mt_fp8.state`)."""
        meta = self.meta.meta_for(role)
        if isinstance(self.recipe, DelayedScaling) and meta.scales_ready:
            return meta.scale[int(role)]
        return None

    def quantize(
        self, x_RC: torch.Tensor, role: TensorRole, record: bool, transposed: bool = False
    ) -> QuantizedTensor:
        """Quantize along the last axis; ``record`` notes the amax and health counts.

        ``transposed`` says :meth:`quantize_transposed` will be asked for ``xᵀ`` too, so a fused
        1×128 kernel writes it in the same pass (module docstring).
        """
        delayed = isinstance(self.recipe, DelayedScaling)
        scale = self.delayed_scale(role)
        stats = self.meta.health[int(role)] if (record and self.track_health) else None
        fmt = self.recipe.formats.for_role(role)
        layout = self.recipe.layout(role)
        group = self.reduction_group(role)
        if self._fused_block_layout(x_RC, layout) and scale is None and group is None:
            from mt_fp8.kernels.block_quantize import (
                quantize_groups_with_transpose,
                quantize_square_blocks,
            )

            if layout == BLOCKS_128X128:
                return quantize_square_blocks(x_RC, fmt, stats, transposed)
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
        stats = self.meta.health[int(role)] if (record and self.track_health) else None
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
        (module docstring: shared input quantization)."""
        role = TensorRole.INPUT
        if torch.compiler.is_compiling():
            return self.quantize(x_MK, role, record=True, transposed=transposed)
        scales: tuple[int, int, bool] | None = None
        if isinstance(self.recipe, DelayedScaling):
            # Layers share a delayed-scaling operand only through one INPUT meta (tied scales).
            scale_meta = self.meta.input_meta
            scales = (id(scale_meta), scale_meta.scale_version, scale_meta.scales_ready)
        owner = x_MK._base if x_MK._base is not None else x_MK
        key = (
            x_MK.data_ptr(),
            tuple(x_MK.shape),
            x_MK.stride(),
            x_MK.dtype,
            x_MK.device,
            x_MK._version,
            self.recipe,
            self.reduction_group(role),
            transposed,
            scales,
        )
        health = self.meta.health[int(role)] if self.track_health else None
        cached = _last_input.get("entry")
        if cached is not None and cached[0] == key and cached[1]() is owner:
            if health is not None:
                health += cached[3]
            return cached[2]
        before = None if health is None else health.clone()
        x_q = self.quantize(x_MK, role, record=True, transposed=transposed)
        counts = (
            torch.zeros_like(self.meta.health[int(role)]) if health is None else health - before
        )
        # (key, weak reference to x's owner, FP8 x with its xᵀ, the health counts it added)
        _last_input["entry"] = (key, weakref.ref(owner), x_q, counts)
        return x_q

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
        if layout not in (GROUPS_1X128, MX_1X32, BLOCKS_128X128) or x_RC.dtype == torch.float64:
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
        """FP8 ``w`` along K and (if needed) ``wᵀ`` along N, cached across micro-batches."""
        key = None
        if self.weight_cache is not None and not torch.compiler.is_compiling():
            key = (
                _optimizer_steps[0],
                weight_NK._version,
                weight_NK.data_ptr(),
                weight_NK.device,
                self.recipe,
                self.meta.scale_version,
                self.reduction_group(TensorRole.WEIGHT),
                need_transpose,
            )
            # A view (an expert's slice of a grouped weight) is a new object on every call: its
            # identity is its base's; views share the base's version counter.
            owner = weight_NK._base if weight_NK._base is not None else weight_NK
            cached = self.weight_cache.get("entry")
            if cached is not None and cached[0] == key and cached[1]() is owner:
                return cached[2], cached[3]
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
            # (key, weak reference to the weight's owner, FP8 w, FP8 wᵀ)
            self.weight_cache["entry"] = (key, weakref.ref(owner), weight_q, weight_t_q)
        return weight_q, weight_t_q


_release_in_backward = [0]
"""Open :func:`final_micro_batch` contexts. A plain global, not thread-local: the autograd
engine runs CUDA backward functions on its own device threads."""


@contextlib.contextmanager
def final_micro_batch() -> Iterator[None]:
    """Run the last micro-batch of an optimizer step: each FP8 layer's backward inside drops
    the layer's cached FP8 weight after using it (module docstring: weight cache)."""
    _release_in_backward[0] += 1
    try:
        yield
    finally:
        _release_in_backward[0] -= 1


def release_weight_cache(cache: dict | None) -> None:
    """Called by FP8 layers' backward: drop ``cache``'s entry inside :func:`final_micro_batch`."""
    if cache is not None and _release_in_backward[0]:
        cache.pop("entry", None)


_last_input: dict[str, Any] = {}
"""The last FP8 input operand, for :meth:`LinearPlan.quantize_input` (one entry)."""

_optimizer_steps = [0]
"""Steps taken by any torch optimizer in this process (part of the weight-cache key)."""


def _count_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _optimizer_steps[0] += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def _pad_columns(x_RC: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x_RC.shape[1] % multiple
    return F.pad(x_RC, (0, pad)) if pad else x_RC


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
    """``(dx, dw, db)`` from ``dy`` and what :func:`_forward_gemm` saved."""
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
        if fp8_dw:
            layout, fmt = ctx.layouts[0]
            x_t_q = QuantizedTensor(x_t_data, x_t_scale, layout, fmt)
            dy_t_q = plan.quantize_transposed(dy_MN, dy_q, TensorRole.GRAD_OUTPUT)
            dw = fp8_gemm(dy_t_q, x_t_q, w_dtype, None, plan.backend)
        elif need_dw:
            dw = (dy_MN.to(plan.out_dtype).t() @ x_MK.to(plan.out_dtype)).to(w_dtype)
        if need_db:
            db = dy_MN.sum(0, dtype=torch.float32).to(b_dtype)
    release_weight_cache(plan.weight_cache)
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


def check_dims(recipe: Recipe, in_features: int, out_features: int) -> str | None:
    """Why a (in, out) layer cannot run ``recipe`` in FP8, or None if it can."""
    need = 16
    for role in TensorRole:
        block = recipe.layout(role).block
        need = math.lcm(need, *(b for b in block if b > 0))
    if in_features % need or out_features % need:
        return (
            f"in_features={in_features} and out_features={out_features} must both be divisible "
            f"by {need} for FP8 GEMMs with the {recipe.name} recipe"
        )
    return None
