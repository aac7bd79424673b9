"""Routed experts: SwiGLU MLPs whose weights are one ``[experts, out, in]`` tensor per projection.

Shape suffixes: M rows (tokens sorted by local expert), D width, F expert FFN width, L local
experts; ``sizes_L`` rows per expert (summing to M).

Per expert ``e`` (rows ``[o_{e-1}, o_e)``)::

    y_e = (silu(x_e · Wg_eᵀ) ⊙ (x_e · Wu_eᵀ)) · Wd_eᵀ      Wg, Wu: [L, F, D], Wd: [L, D, F]

Each projection is a :class:`GroupedLinear`: one GEMM over all experts with PyTorch's grouped
GEMM ``torch._grouped_mm(x_MK, Wᵀ_LKN, offs)`` where the installed torch runs it for the
device and dtype (:func:`grouped_mm_reason`: CUDA compute capability ≥ 9.0 or the CPU, bf16 /
fp16 / fp32, rows 16-byte aligned), else a loop of one ``F.linear`` per non-empty expert (fp64,
other devices): both compute the same products. On CUDA each group is padded to a multiple of
:data:`CUDA_GROUP_ALIGN` rows first (zero rows, dropped after; in a buffer whose size the host
knows without reading the group sizes, :class:`PaddedLayout`): the CUDA kernels want aligned
group starts (torchtitan pads the same way); the CPU kernel takes any offsets.
:class:`GroupedExperts` pads its input once and runs the whole MLP on the padded rows, dropping
the padding once at the end: a zero row stays zero through each projection and SwiGLU
(``silu(0)·0 = 0``) and gets a zero gradient, and every real row meets the same kernel on the
same padded groups as when each projection pads on its own, so the values are those of three
separately padded projections, without their four extra pad/unpad copies forward and backward.
The input is cast to the autocast dtype once for the three projections too.

With FP8 (:meth:`GroupedLinear.enable_fp8`) each projection runs through
``mt_fp8.FP8GroupedLinear`` sharing the same weight (every mt-fp8 recipe): tensorwise and
rowwise scaling through ``torch._scaled_grouped_mm`` on Hopper, block and MXFP8 scaling through
mt-fp8's grouped Triton kernels on CUDA (``mt_fp8.grouped_block``; under backend ``auto`` for
layers of at least ``mt_fp8.grouped.BLOCK_GROUPED_MIN_EXPERTS`` experts), a per-expert FP8
loop elsewhere. Group sizes: the grouped block and MXFP8 path, and the rowwise path with
every GEMM grouped (the all-E4M3 experts :func:`mt_parallel.parallelize.expert_recipe` gives
rowwise recipes), read ``sizes_L`` on the device (their tables and padded wgrad operands are
built there, in buffers of host-known bounds, as the bf16 path's :class:`PaddedLayout`), so
where all three projections take such a path (``FP8GroupedLinear.reads_sizes_on_device``)
:class:`GroupedExperts` hands them the tensor and the host queues the MLP without waiting for
the router. The other FP8 paths (tensorwise, rowwise with E5M2 gradients and per-expert
backward GEMMs, the per-expert loop) take host ints: there :class:`GroupedExperts` reads
``sizes_L`` once per MLP (one device-to-host read, which waits for the device) and hands the
same list to its three projections.

Sequence parallel (:meth:`GroupedLinear.set_tensor_parallel`): the experts are replicated
over TP (not TP-sharded; Megatron-Core's expert-tensor-parallel size 1) and each TP rank runs
them on the rows of its own S/tp tokens, so every projection's weight gradient is summed over
TP. Split over ep (ep > 1) the sum happens once per step, on the gradients accumulated over
the micro-batches, in every data-parallel mode: the weight carries the TP group as
``expert_sequence_group`` and whoever reduces the experts over their expert-data-parallel
(edp) group adds the TP sum (Megatron-Core's expert-data-parallel group spans TP when the
expert-tensor-parallel size is 1): :func:`mt_parallel.moe.reduce_expert_gradients` under
``ddp`` and ``none`` (edp and TP in one pass) and under ``fsdp`` (FSDP2 has reduce-scattered
over edp; the TP sum runs on this rank's shard), ZeRO-1's
:meth:`~mt_parallel.DistributedOptimizer.reduce_gradients` under ``zero1`` (on its shard,
after the edp reduce-scatter). The TP ranks of one edp rank hold the same experts and shard
them alike, so summing shards element by element is summing the whole gradients, at 1/edp of
the bytes. At ep = 1 the experts are ordinary parameters of DDP, FSDP2 or ZeRO-1 and the sum
happens in the backward instead (:attr:`GroupedLinear.sums_gradient_in_backward`):
``copy_to_group`` on the weight, as the SP norms do (under FP8 the view is what
``FP8GroupedLinear`` multiplies by, and its FP8 weight cache keys on the parameter), an
all-reduce of every expert weight's gradient in each micro-batch's backward. Exactly one of
the two paths runs for a layer, so no gradient is summed twice, and after either sum the
gradient is the same on every TP rank, so the clipping norm counts it once. Both give the
same sum of the same per-rank, per-micro-batch terms, in a different order. FP8: the
delayed-scaling amaxes of the experts are MAX-reduced over TP at the scale update
(``fp8_meta.amax_group``), so every TP rank uses the scales the one-process layer would;
current scaling keeps each rank's own per-expert scales (equal to one process up to FP8
rounding): its per-expert calls depend on which experts got rows on the rank (an empty expert
is skipped, the grouped path needs tokens), so a per-call reduction could pair different
collectives on different ranks.

Deferred weight gradients (``GroupedLinear.wgrad_sink``, as the parallel linears'; set by the
pipeline runtime for the zero-bubble schedules where torch's own split of the backward is wrong
or a chunk uses a sink anyway, :mod:`mt_parallel.pipeline.runtime`): the bf16/fp32 grouped GEMM
then runs through :class:`_DeferredWeightGradExperts`, whose backward returns
``dx = grouped_mm(dy, W, offs)`` and queues ``dW = grouped_mm(dyᵀ, x, offs)`` (the 2d × 2d mode,
groups along the rows) in the sink, cast to the parameter's dtype and accumulated as autograd
would: the formulas autograd uses for ``torch._grouped_mm`` with a row-major ``x`` and a
transposed (column-major) weight, on the same operands, so the gradients equal the plain path's
bit for bit; the per-expert loop likewise (``F.linear``'s ``mm`` backward per expert, the
gradients stacked as ``unbind``'s backward does, zeros for idle experts). The FP8 experts defer
through ``FP8GroupedLinear``'s own sink (the runtime sets it with this layer's) on its grouped
paths, not on its per-expert loop. Under sequence parallelism at ep = 1 a deferring bf16/fp32
layer leaves ``copy_to_group`` out of its forward and the queued work all-reduces ``dW`` over
TP after the cast to the parameter's dtype, where ``copy_to_group``'s backward would have
(the router does the same): the same sum once, at ``W``. Not deferred: the FP8 experts'
weight summed over TP in the backward (``copy_to_group`` wraps the operand FP8GroupedLinear
multiplies by); :attr:`GroupedLinear.defers_weight_gradient` says which applies. From ``I`` to ``W`` the queue
holds each GEMM's ``x`` (saved for the backward anyway) and ``dy``.

Expert parallelism (:meth:`GroupedLinear.shard_experts_`) keeps experts ``[r·L, (r+1)·L)`` of
the full ``E`` on ep rank ``r``; init draws the full ``[E, out, in]`` tensor from the layer's
generator and keeps the local slice, so every ep degree starts from the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mt_fp8.ops import swiglu
from mt_fp8.wgrad import WeightGradSink, accumulate_grad
from mt_parallel.layers import keep_fp8_layer_out_of_state_dict
from mt_parallel.mappings import copy_to_group, group_rank, group_size, sum_gradient_over_group

CUDA_GROUP_ALIGN = 16
"""Rows each group is padded to a multiple of for the CUDA grouped GEMM (bf16 needs 8, FP8 16)."""
GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm_reason(x_MK: torch.Tensor, weight_LNK: torch.Tensor) -> str | None:
    """Why ``torch._grouped_mm`` cannot run this GEMM here, or None when it can."""
    if weight_LNK.dtype != x_MK.dtype:
        return f"dtypes {x_MK.dtype}/{weight_LNK.dtype} (grouped GEMM takes one dtype)"
    return grouped_mm_reason_for(x_MK.dtype, x_MK.device, tuple(weight_LNK.shape[1:]))


def grouped_mm_reason_for(
    dtype: torch.dtype, device: torch.device, weight_dims: tuple[int, ...]
) -> str | None:
    """:func:`grouped_mm_reason` of operands of ``dtype`` on ``device`` and a weight stack of
    per-expert ``weight_dims`` (out, in)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in GROUPED_MM_DTYPES:
        return f"dtype {dtype} (grouped GEMM takes bf16, fp16, fp32)"
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        # The traced (fake-tensor) kernel takes bf16 only, though the CPU one runs fp32 eagerly.
        return f"torch.compile traces grouped GEMMs in bf16 only, got {dtype}"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (9, 0):
            return "CUDA grouped GEMM needs compute capability >= 9.0"
    elif device.type != "cpu":
        return f"no grouped GEMM on {device.type}"
    align = 16 // torch.empty((), dtype=dtype).element_size()
    if any(d % align for d in weight_dims):
        return f"weight dims {weight_dims} not multiples of {align} (16-byte rows)"
    return None


def pads_groups(device: torch.device) -> bool:
    """Whether the grouped GEMM on ``device`` wants groups padded to :data:`CUDA_GROUP_ALIGN`."""
    return device.type == "cuda"


@dataclass(frozen=True)
class PaddedLayout:
    """Where each row of a grouped GEMM's input goes when groups are padded to ``align`` rows.

    The padded buffer has a size known on the host without reading ``sizes_L``: each group
    gains at most ``align - 1`` rows, so ``M + L·(align - 1)`` rows hold every layout
    (torchtitan sizes its padded permutation the same way). The groups end at ``ends_L[-1]``;
    the rows past it are in no group: the grouped GEMM neither reads them nor writes their
    output (left uninitialized), and :meth:`unpad` never selects them, so no garbage reaches a
    real row, forward or backward. No device-to-host read, so the host queues the whole layer
    without waiting for the router's kernels.
    """

    dest_M: torch.Tensor
    """The padded row of every input row."""
    ends_L: torch.Tensor
    """The padded groups' int32 end offsets (the kernel's ``offs``)."""
    rows: int
    """Rows of the padded buffer: the bound ``M + L·(align - 1)`` (class docstring)."""

    @classmethod
    def of(cls, sizes_L: torch.Tensor, rows: int, align: int = CUDA_GROUP_ALIGN) -> PaddedLayout:
        """The layout of ``rows`` input rows in groups of ``sizes_L`` (summing to ``rows``)."""
        padded_L = (sizes_L + align - 1) // align * align
        ends_L = torch.cumsum(padded_L, 0)
        experts = torch.arange(sizes_L.numel(), device=sizes_L.device)
        expert_M = torch.repeat_interleave(experts, sizes_L, output_size=rows)
        first_L = torch.cumsum(sizes_L, 0) - sizes_L
        index_M = torch.arange(rows, device=sizes_L.device)
        dest_M = (ends_L - padded_L)[expert_M] + index_M - first_L[expert_M]
        return cls(dest_M, ends_L.to(torch.int32), rows + sizes_L.numel() * (align - 1))

    def pad(self, x_MK: torch.Tensor) -> torch.Tensor:
        """``x_MK``'s rows at their padded places, zero rows between the groups and after them."""
        return x_MK.new_zeros(self.rows, x_MK.shape[1]).index_copy(0, self.dest_M, x_MK)

    def unpad(self, y_PN: torch.Tensor) -> torch.Tensor:
        """The rows of the input rows back from padded ``y_PN`` (the padding dropped)."""
        return y_PN.index_select(0, self.dest_M)


class _DeferredWeightGradExperts(torch.autograd.Function):
    """The experts' GEMMs ``y[group e] = x[group e]·W_eᵀ``, as one ``torch._grouped_mm`` over
    ``groups`` (the int32 end offsets) or, where ``groups`` is a list of sizes, as
    :func:`looped_mm`, with the backward of autograd for either, except that ``dW`` is queued
    in ``sink`` (module docstring: deferred weight gradients) and summed over ``group`` (the TP
    group under sequence parallelism at ep = 1, else None). ``weight_LNK`` is ``param`` as the
    GEMMs read it (cast to the compute dtype); the gradient goes to ``param`` directly."""

    @staticmethod
    def forward(
        ctx: Any,
        x_MK: torch.Tensor,
        weight_LNK: torch.Tensor,
        groups: torch.Tensor | list[int],
        param: torch.Tensor,
        sink: WeightGradSink,
        group: Any = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x_MK, weight_LNK)
        ctx.groups, ctx.param, ctx.sink, ctx.group = groups, param, sink, group
        if isinstance(groups, list):
            return looped_mm(x_MK, weight_LNK, groups)
        return torch._grouped_mm(x_MK, weight_LNK.transpose(-2, -1), offs=groups)

    @staticmethod
    def backward(ctx: Any, dy_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MK, weight_LNK = ctx.saved_tensors
        groups, param = ctx.groups, ctx.param
        dx = None
        if isinstance(groups, list):  # F.linear's mm backward per expert, unbind's stack
            present = [e for e, size in enumerate(groups) if size > 0]
            dy_e, x_e = dy_MN.split(groups), x_MK.split(groups)
            if ctx.needs_input_grad[0]:
                dx = x_MK.new_zeros(x_MK.shape)
                if present:
                    dx = torch.cat([dy_e[e].mm(weight_LNK[e]) for e in present])

            def weight_gradient() -> torch.Tensor:
                dw = [
                    dy_e[e].t().mm(x_e[e]) if groups[e] > 0 else torch.zeros_like(weight_LNK[e])
                    for e in range(len(groups))
                ]
                return torch.stack(dw)
        else:
            if ctx.needs_input_grad[0]:
                dx = torch._grouped_mm(dy_MN, weight_LNK, offs=groups)

            def weight_gradient() -> torch.Tensor:
                return torch._grouped_mm(dy_MN.transpose(0, 1), x_MK, offs=groups)

        group = ctx.group

        def summed_weight_gradient() -> None:
            accumulate_grad(
                param, sum_gradient_over_group(weight_gradient().to(param.dtype), group)
            )

        if ctx.needs_input_grad[1]:
            ctx.sink.defer(
                summed_weight_gradient,
                # the loop reads weight_LNK (idle experts' zeros), the grouped GEMM the offsets
                holds=(dy_MN, x_MK, weight_LNK if isinstance(groups, list) else groups),
            )
        return dx, None, None, None, None, None


def _offs_mm(
    x_MK: torch.Tensor,
    weight_LNK: torch.Tensor,
    offs: torch.Tensor,
    deferred: tuple[torch.Tensor, WeightGradSink, Any] | None,
) -> torch.Tensor:
    """``torch._grouped_mm(x, Wᵀ, offs)``; with ``deferred = (param, sink, tp_group)`` its
    weight gradient is queued in the sink (module docstring)."""
    if deferred is None:
        return torch._grouped_mm(x_MK, weight_LNK.transpose(-2, -1), offs=offs)
    return _DeferredWeightGradExperts.apply(x_MK, weight_LNK, offs, *deferred)


def grouped_mm(
    x_MK: torch.Tensor,
    weight_LNK: torch.Tensor,
    sizes_L: torch.Tensor,
    deferred: tuple[torch.Tensor, WeightGradSink, Any] | None = None,
) -> torch.Tensor:
    """``y[group e] = x[group e] · W_eᵀ`` through ``torch._grouped_mm`` (module docstring); on
    CUDA the groups are padded here and the padding dropped from the output. ``deferred``: see
    :func:`_offs_mm`."""
    if not pads_groups(x_MK.device):
        offs = torch.cumsum(sizes_L, 0).to(torch.int32)
        return _offs_mm(x_MK, weight_LNK, offs, deferred)
    layout = PaddedLayout.of(sizes_L, x_MK.shape[0])
    return layout.unpad(padded_grouped_mm(layout.pad(x_MK), weight_LNK, layout, deferred))


def padded_grouped_mm(
    x_PK: torch.Tensor,
    weight_LNK: torch.Tensor,
    layout: PaddedLayout,
    deferred: tuple[torch.Tensor, WeightGradSink, Any] | None = None,
) -> torch.Tensor:
    """:func:`grouped_mm` on rows already padded by ``layout``; the output stays padded."""
    return _offs_mm(x_PK, weight_LNK, layout.ends_L, deferred)


def looped_mm(x_MK: torch.Tensor, weight_LNK: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The same products as :func:`grouped_mm`, one ``F.linear`` per non-empty expert."""
    # NOTE: unbind, not ``weight_LNK[e]``: each indexing's backward adds a zero tensor of the
    # whole stack (E² work); unbind's backward stacks the E gradients once.
    weights = weight_LNK.unbind(0)
    outputs = [F.linear(x_e, weights[e]) for e, x_e in enumerate(x_MK.split(sizes)) if sizes[e] > 0]
    if not outputs:
        return x_MK.new_zeros(0, weight_LNK.shape[1])
    return torch.cat(outputs)


class GroupedLinear(nn.Module):
    """``E`` bias-free linears applied to contiguous row groups (module docstring)."""

    wgrad_sink: WeightGradSink | None = None
    """Set: the grouped GEMM's weight gradient is queued here (module docstring: deferred
    weight gradients)."""
    wgrad_sink_optional: ClassVar[bool] = True
    """torch's own split backward separates this weight's gradient too (where it is right):
    the pipeline runtime sets the sink only where it is not, or the chunk has one anyway."""

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, init_std: float
    ) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = (
            num_experts,
            in_features,
            out_features,
        )
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.ep_group: Any = None
        self.sequence_group: Any = None
        """The TP group under sequence parallel (each rank's rows are its own tokens), else None."""
        self._fp8: Any = None
        self.reset_parameters()

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Under SP the weight's gradient is summed over TP (module docstring)."""
        self.sequence_group = tp_group if sequence_parallel else None
        if self.ep_size > 1:
            self.weight.expert_sequence_group = self.sequence_group  # type: ignore[attr-defined]

    @property
    def sums_gradient_in_backward(self) -> bool:
        """Whether the forward sums the weight's gradient over TP: under SP at ep = 1; split
        over ep, the expert reduction sums over TP once per step (module docstring)."""
        return group_size(self.sequence_group) > 1 and self.ep_size == 1

    @property
    def defers_weight_gradient(self) -> bool:
        """Whether a ``wgrad_sink`` set here gets the weight's gradient (module docstring:
        deferred weight gradients): not for FP8 experts whose backward sums it over TP, nor
        where they loop over experts (``mt_fp8.FP8GroupedLinear.defers_weight_gradient``)."""
        if self._fp8 is None:
            return True
        return not self.sums_gradient_in_backward and self._fp8.defers_weight_gradient

    @property
    def ep_size(self) -> int:
        return group_size(self.ep_group)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``[E, out, in]`` weight and keep this ep rank's experts."""
        full = torch.empty(self.num_experts, self.out_features, self.in_features)
        if generator is None:
            full = full.to(self.weight.device)
        full.normal_(0.0, self.init_std, generator=generator)
        local = self.weight.shape[0]
        rank = group_rank(self.ep_group)
        self.weight.copy_(full[rank * local : (rank + 1) * local])

    @torch.no_grad()
    def shard_experts_(self, ep_group: Any, edp_group: Any, dp_cp_size: int) -> None:
        """Keep this ep rank's experts (module docstring) and mark the weight as expert-parallel:
        ``expert_group`` (its norm is summed there), ``expert_data_group`` and
        ``expert_grad_divisor`` (its gradient is summed over edp and divided by dp×cp), and
        ``expert_sequence_group`` (the TP group under SP, else None: summed there too)."""
        ranks, rank = group_size(ep_group), group_rank(ep_group)
        if self.num_experts % ranks:
            raise ValueError(
                f"parallel.ep={ranks} does not divide the {self.num_experts} routed experts"
            )
        if self.ep_size != 1:
            raise RuntimeError(f"experts are already split over ep={self.ep_size}")
        local = self.num_experts // ranks
        data = self.weight.detach()[rank * local : (rank + 1) * local].clone()
        self.weight = nn.Parameter(data)
        self.weight.expert_group = ep_group  # type: ignore[attr-defined]
        self.weight.expert_rank = (rank, ranks, group_rank(edp_group))  # type: ignore[attr-defined]
        self.weight.expert_data_group = edp_group  # type: ignore[attr-defined]
        self.weight.expert_grad_divisor = dp_cp_size  # type: ignore[attr-defined]
        self.weight.expert_sequence_group = self.sequence_group  # type: ignore[attr-defined]
        self.ep_group = ep_group

    def enable_fp8(self, recipe: Any = None, fp8_gemms: Any = None, **fp8_kwargs: Any) -> None:
        """Run the grouped GEMMs through ``mt_fp8.FP8GroupedLinear`` sharing this weight and
        ``fp8_meta``; the state dict keeps this layer's names only
        (:func:`mt_parallel.layers.keep_fp8_layer_out_of_state_dict`)."""
        from mt_fp8 import FP8_GEMMS, FP8GroupedLinear

        if fp8_gemms is not None and tuple(fp8_gemms) != tuple(FP8_GEMMS):
            raise ValueError(
                f"fp8.gemms={list(fp8_gemms)}: MoE experts run all of {list(FP8_GEMMS)} in FP8 "
                "or none (FP8GroupedLinear has no per-GEMM choice)"
            )
        local, out_features, in_features = self.weight.shape
        fp8 = FP8GroupedLinear(
            local, in_features, out_features, bias=False, device=self.weight.device,
            dtype=self.weight.dtype, recipe=recipe, **fp8_kwargs,
        )  # fmt: skip
        del fp8.weight
        fp8.weight = self.weight
        if group_size(self.sequence_group) > 1:  # delayed scaling agrees over TP (module doc)
            fp8.fp8_meta.amax_group = self.sequence_group
        self._fp8 = fp8
        self.fp8_meta = fp8.fp8_meta
        keep_fp8_layer_out_of_state_dict(self)

    @property
    def fp8_enabled(self) -> bool:
        return self._fp8 is not None

    def forward(
        self,
        x_MK: torch.Tensor,
        sizes_L: torch.Tensor,
        layout: PaddedLayout | None = None,
        host_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """``layout``: ``x_MK`` is already padded by it (the CUDA grouped GEMM's padding, shared
        by the projections of one MLP) and the output stays padded; ``host_sizes``: ``sizes_L``
        read to the host once for the projections of one MLP (FP8)."""
        weight = self.weight
        deferred = None
        if self.wgrad_sink is not None and self._fp8 is None:
            # bf16/fp32 experts always defer; the queued work sums the gradient over TP instead
            # of copy_to_group (module doc). FP8 experts defer through FP8GroupedLinear's sink.
            tp_sum = self.sequence_group if self.sums_gradient_in_backward else None
            deferred = (self.weight, self.wgrad_sink, tp_sum)
        elif self.sums_gradient_in_backward:
            weight = copy_to_group(weight, self.sequence_group)
        if self._fp8 is not None:
            if self._fp8.weight is not self.weight:
                self._fp8.weight = self.weight
            return self._fp8(x_MK, sizes_L if host_sizes is None else host_sizes, weight)
        if torch.is_autocast_enabled(x_MK.device.type):
            dtype = torch.get_autocast_dtype(x_MK.device.type)
            x_MK, weight = x_MK.to(dtype), weight.to(dtype)
        else:
            weight = weight.to(x_MK.dtype)
        if layout is not None:
            return padded_grouped_mm(x_MK, weight, layout, deferred)
        if grouped_mm_reason(x_MK, weight) is None:
            return grouped_mm(x_MK, weight, sizes_L, deferred)
        if deferred is not None:
            return _DeferredWeightGradExperts.apply(x_MK, weight, sizes_L.tolist(), *deferred)
        return looped_mm(x_MK, weight, sizes_L.tolist())

    def extra_repr(self) -> str:
        return (
            f"experts={self.weight.shape[0]}/{self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}" + (", fp8" if self._fp8 is not None else "")
        )


class GroupedExperts(nn.Module):
    """The routed SwiGLU experts (module docstring): ``forward(x_MD, sizes_L) -> y_MD``."""

    def __init__(
        self, num_experts: int, dim: int, ffn_dim: int, init_std: float, out_init_std: float
    ) -> None:
        super().__init__()
        self.gate_proj = GroupedLinear(num_experts, dim, ffn_dim, init_std)
        self.up_proj = GroupedLinear(num_experts, dim, ffn_dim, init_std)
        self.down_proj = GroupedLinear(num_experts, ffn_dim, dim, out_init_std)

    def padded_layout(
        self, sizes_L: torch.Tensor, rows: int, dtype: torch.dtype
    ) -> PaddedLayout | None:
        """The padded groups the grouped GEMMs want for ``rows`` input rows of ``dtype`` in
        groups of ``sizes_L`` (on its device), or None where they take the rows as they are
        (FP8, the CPU, the per-expert loop)."""
        device = sizes_L.device
        if self.gate_proj.fp8_enabled or not pads_groups(device):
            return None
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if any(
            grouped_mm_reason_for(dtype, device, tuple(p.weight.shape[1:])) for p in projections
        ):
            return None
        return PaddedLayout.of(sizes_L, rows)

    def forward(
        self, x_MD: torch.Tensor, sizes_L: torch.Tensor, layout: PaddedLayout | None = None
    ) -> torch.Tensor:
        """``layout`` (from :meth:`padded_layout`): ``x_MD`` is already laid out in its padded
        groups (the permutation wrote it so, :func:`~mt_parallel.moe.dispatch_and_combine`)
        and the output stays so; else the rows are padded here and the padding dropped after."""

        def mlp(
            x: torch.Tensor, layout: PaddedLayout | None = None, host_sizes: list[int] | None = None
        ) -> torch.Tensor:
            gate = self.gate_proj(x, sizes_L, layout, host_sizes)
            up = self.up_proj(x, sizes_L, layout, host_sizes)
            return self.down_proj(swiglu(gate, up), sizes_L, layout, host_sizes)

        if self.gate_proj.fp8_enabled:
            projections = (self.gate_proj, self.up_proj, self.down_proj)
            if all(p._fp8.reads_sizes_on_device(x_MD) for p in projections):
                return mlp(x_MD)  # the FP8 grouped paths read sizes_L where it lies
            return mlp(x_MD, host_sizes=sizes_L.tolist())  # the one device-to-host read
        if torch.is_autocast_enabled(x_MD.device.type):
            x_MD = x_MD.to(torch.get_autocast_dtype(x_MD.device.type))  # once for three
        if layout is not None:
            return mlp(x_MD, layout)
        layout = self.padded_layout(sizes_L, x_MD.shape[0], x_MD.dtype)
        if layout is None:
            return mlp(x_MD)
        return layout.unpad(mlp(layout.pad(x_MD), layout))  # module docstring: one padding
