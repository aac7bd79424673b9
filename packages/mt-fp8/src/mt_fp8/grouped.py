"""The grouped FP8 GEMM path of :class:`~mt_fp8.linear.FP8GroupedLinear` (MoE experts).

Two implementations, one per scale layout (:func:`grouped_gemm_reason` says where each runs):

* Current tensorwise and rowwise scaling: PyTorch's ``torch._scaled_grouped_mm`` (CUTLASS,
  Hopper), this module.
* Block scaling (DeepSeek-V3: 1×128 groups, 128×128 weight blocks) and MXFP8 (1×32 groups
  with power-of-two scales for every operand): PyTorch has no grouped GEMM for either, and the
  per-expert loop it would otherwise run is bound by the host's launches at fine-grained MoE
  shapes (docs/architecture.md), so the three GEMMs run in mt-fp8's own Triton kernels, one
  launch each whatever E is, on the loop's FP8 operands (:mod:`mt_fp8.grouped_block`, whose
  docstring states its math, operands and empty experts; the stacked weights come from this
  module's weight cache, :func:`_weight_operands`). It takes any formats (mixed E4M3 × E5M2
  in exact fp16 dots) and needs K, N % 128 == 0 (block scaling) or % 32 (MXFP8).

The rest of this docstring is the ``torch._scaled_grouped_mm`` path, except the weight cache,
which both share.

Shape suffixes: T tokens (all groups, sorted by group), E groups (experts), E' non-empty groups,
K in_features, N out_features. Group ``e`` holds the ``T_e`` tokens ``[o_{e-1}, o_e)`` with
``o_e = T_0 + ... + T_e`` (``offs``: the int32 cumulative *end* offsets).

Math, per group ``e`` (the loop path runs :class:`~mt_fp8.functional.FP8LinearFunction` once per
non-empty group; this path issues one ``torch._scaled_grouped_mm`` per GEMM instead):

=========  ==========================  ========================  =============================
GEMM       per group                   grouped-GEMM mode         operands (a, b) as passed
=========  ==========================  ========================  =============================
forward    ``y_e = x_e W_eᵀ (+ b_e)``  2d × 3d, offs over T      ``x_TK``, ``W_ENK`` as (E,K,N)
dgrad      ``dx_e = dy_e W_e``         2d × 3d, offs over T      ``dy_TN``, ``Wᵀ_EKN`` as (E,N,K)
wgrad      ``dW_e = dy_eᵀ x_e``        2d × 2d, offs over T      ``dyᵀ_NT``, ``xᵀ_KT`` as (T,K)
=========  ==========================  ========================  =============================

``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=bf16)`` wants ``a`` row-major
and ``b`` column-major, so "(E,K,N)" is the transposed view of our row-major FP8 ``W_ENK`` and
"(T,K)" the transposed view of the row-major ``xᵀ_KT``: every operand is an FP8 tensor quantized
along its contraction (last) axis, exactly as :mod:`mt_fp8.gemm`'s ``a_XZ · b_YZᵀ`` form.

Scales. The kernel takes rowwise fp32 *dequantization* scales (``s`` with ``x ≈ q · s``):

* 2d × 3d: ``scale_a`` ``(T,)``, one per token row; ``scale_b`` ``(E, C)``, one per output
  column of each group (C = N forward, K dgrad).
* 2d × 2d: ``scale_a`` ``(E·N,)`` and ``scale_b`` ``(E·K,)``, group-major: group ``g``'s
  rows of ``dyᵀ`` (columns of ``xᵀ``) use entries ``[g·N, (g+1)·N)`` (``[g·K, (g+1)·K)``);
  an empty group's are 1 (empty groups, below).

Both recipes give exactly the loop path's FP8 bytes and scale values:

* Rowwise: ``x`` and ``dy`` per token (quantized whole: rows are independent), ``W`` per
  (expert, output row), ``Wᵀ`` per (expert, input column) requantized from ``W_e``; ``dyᵀ`` and
  ``xᵀ`` requantized per group, so their scales are maxima over that expert's tokens only.
* Tensorwise: one scale per group for each of ``x_e``, ``W_e``, ``dy_e`` (their transposes are
  exact), expanded to the rowwise vectors above: the same values the loop's scalars have.

Operand construction. Each operand is built for all groups at once, in a number of kernels
that does not depend on E (a per-group quantize cost about 0.45 ms per expert on an H200,
2026-12-05, ``benchmarks/grouped_gemm.py`` at 2cc88b0), from the same scale math as the loop's
quantizers (:func:`~mt_fp8.quantized.scale_from_amax`, :func:`~mt_fp8.quantized.cast_to_fp8`,
both elementwise, so a value and its scale give the same bits whatever tensor holds them):

* Rowwise ``x``, ``dy`` and ``W``: one :meth:`~mt_fp8.linear_plan.LinearPlan.quantize` of the
  (T, C) rows, or of the stacked (E·N, K) weight rows (the loop's quantizers, Triton on CUDA).
* Rowwise ``Wᵀ``: one quantize of the (E·K, N) rows of the transposed stack: row ``(e, k)`` is
  column ``k`` of ``W_e``, which the loop quantizes as a row of ``W_eᵀ``.
* Rowwise wgrad operands ``xᵀ`` and ``dyᵀ``: amaxes per (group, column) by one segmented
  reduction over the non-empty groups (``torch.segment_reduce``; NaN counted as ``+inf``, which
  gives the same NaN scale), one ``scale_from_amax`` on those (E', C) amaxes, then one cast of
  ``x`` with each element's group-column scale, stored transposed: where the loop's quantizers
  are Triton kernels, one launch of
  :func:`~mt_fp8.kernels.rowwise_quantize.quantize_group_columns_transposed` (the cast of the
  loop's ``quantize_columns_transposed``, the scale looked up by the row's group), else
  ``cast_to_fp8`` with the scales repeated to (T, C) and one FP8 transpose copy.
* Tensorwise: per-group amaxes by the same segmented reduction (then a max over C), or one
  ∞-norm reduction over each expert's weight; with an amax group, one all-reduce of the (E',) amaxes
  (the loop: one per group); one cast with each row's group scale. The transposes are exact:
  one FP8 transpose copy each of ``x`` and ``dy``. The weights, where the loop's quantizers are
  Triton kernels (and the stack is bf16, fp16 or fp32), take one launch of
  :func:`~mt_fp8.kernels.quantize.quantize_transpose_stack_triton` after the ∞-norm: it reads
  the stack once and writes ``W`` (E, N, K) and ``Wᵀ`` (E, K, N) with each expert's scale,
  folding the health counts in the launch (two reads of the high-precision stack and 1 + 1
  bytes written per element, no eager pass over it); else ``cast_to_fp8`` with the scales
  repeated over the rows and one FP8 transpose copy.

On CUDA the loop quantizes some of these with its Triton kernels, which are bit-identical to
:func:`~mt_fp8.quantized.quantize` (tested in test_fp8_rowwise_fast.py and test_fp8_ops.py);
test_fp8_grouped.py checks the byte and scale identity of every operand against the loop's
quantizers on CPU and (marked ``gpu``) on CUDA, test_fp8_grouped_stack.py that of the stack
kernel's weights against the eager cast (in Triton's interpreter and on CUDA). Health counts
(``track_health``) are the loop's: the casts of ``x``, ``dy`` and ``W`` count them, transposed
operands count nothing. The bias adds in one op; its gradient stays one fp32 sum per group (the
loop's summation order, so the loop's bits).

Where the kernel cannot take a GEMM, that GEMM runs per group through
:func:`~mt_fp8.gemm.fp8_gemm` on the same operands (see :func:`gemm_reason`): it accepts
``float8_e4m3fn`` operands only, so with the default hybrid formats (E5M2 gradients) only the
forward GEMM is grouped and dgrad and wgrad stay per expert; the recipe's formats never change.
The kernel writes bf16, which is what the loop's rowwise GEMMs give on CUDA (other output dtypes
are that bf16 result converted); the loop's tensorwise GEMMs write fp32 directly, so a
tensorwise GEMM with a non-bf16 output stays per expert. Bias is added after the GEMM
(the kernel has none): one more bf16 rounding than cuBLAS's fused bias epilogue.

Empty groups: in 2d × 3d a group of 0 tokens is a 0-row problem (offsets repeat); the wgrad's
2d × 2d mode cannot take one (PyTorch asserts ``delta > 0``), so an empty group gets
:data:`WGRAD_ALIGN` zero FP8 columns in both wgrad operands and scale 1 in both scale vectors:
its ``dW_e`` is a sum of ``0 · 0`` products, zeros written by the GEMM itself. NOTE: before, empty
groups were left out of the GEMM and the gradient was assembled in a zeroed fp32 [E, N, K]
tensor by an index copy of the others: 12 more bytes per weight element in every projection
with an idle expert, which skewed routing (early in training) gives most layers. Its groups must
start at multiples of :data:`WGRAD_ALIGN` tokens (16-byte TMA alignment): where a non-empty
group's count is not a multiple, both wgrad operands get zero FP8 columns after each group up to
the next multiple (one scatter per operand; ``dW_e`` gains ``0 · 0`` products only, the
operands' bytes and scales stay the loop's). Routed MoE groups are almost never multiples of 16:
without this the wgrad ran per expert (a quantize pair and a GEMM per expert and projection, a
cost that grows with E and with skew).

Deferred weight gradients (``plan.wgrad_sink``, :mod:`mt_fp8.wgrad`; zero-bubble pipelines):
the backward quantizes ``dy``, ``dyᵀ`` (and pads the wgrad operands) and runs dgrad as always,
but queues the wgrad GEMM (grouped, or per group) and the bias gradient in the sink instead of
running them; run, they add into ``weight.grad``/``bias.grad``. Same operands, same GEMMs:
the gradients equal the undeferred backward's bit for bit. From ``I`` to ``W`` the queue holds
the FP8 ``xᵀ`` (saved anyway), the FP8 ``dyᵀ`` and, with a bias, ``dy``.

Host syncs: the host reads nothing from the device. Host group sizes (ints) give the small
index tensors (offsets, counts), copied to the device without waiting (:func:`_host_ints`).

Device group sizes: the call also takes an int32/int64 tensor of sizes on the tokens' device
(:func:`fp8_grouped_linear`; mt-parallel's MoE experts pass the router's counts), read there
where every GEMM is grouped under rowwise scaling (:func:`reads_sizes_on_device`), so its
caller need not read them either. The offsets are a cumulative sum on the device; the rowwise
wgrad operands' amaxes cover every group (E, not E'), by a scatter of each row's magnitudes
into its group's row by max (:func:`_scattered_amax`: a max is exact in any order, so the
segmented reduction's bits; an empty group's amax is 0 and its scale 1, the value the host
path gives it); the wgrad padding is computed there too (every token scattered), into
``floor((T + 16·E) / 16) · 16`` columns, the bound of ``Σ`` padded counts (each group gains at
most 16 columns); the columns past the last group are zeros that lie in no group, which the
kernel does not read, as :mod:`mt_parallel.moe.experts`'s bf16 grouped GEMM leaves the rows
past its last group. Operands, scales and outputs are the host path's bits (tested against
it). Everywhere else the tensor is read to the host first, which waits for the device:
per-group GEMMs (E5M2 gradients, tensorwise outputs other than bf16) and tensorwise's
per-group scales are sized from host ints, and so is a bias gradient (one sum per group, the
loop's bits). The block-scaled path reads device sizes on the device in every case but that
bias gradient (:mod:`mt_fp8.grouped_block`).

Weight cache (both implementations): the grouped path keeps one entry per layer with the FP8
weights of all experts stacked (``W_ENK`` and, for dgrad, ``Wᵀ_EKN``), keyed like the
per-expert caches (:mod:`mt_fp8.weight_cache`) on the weight tensor (weak reference), storage
pointer, ``_version``, recipe, scale state and the count of torch optimizer steps; a miss
quantizes all experts at once (above; block scaling: the stacked (E·N, K) rows in 128×128
blocks and each expert's exact transpose; MXFP8: the stacked rows in 1×32 groups along K and,
in the same quantizer call, along E·N for ``Wᵀ``), to the bytes the loop gives each. The loop path's per-expert
caches are separate (a layer that switches path quantizes once more).
:func:`mt_fp8.clear_fp8_weight_caches` clears both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mt_fp8.formats import FP8Format, TensorRole
from mt_fp8.gemm import _triton_block_gemm_available, fp8_gemm
from mt_fp8.linear_plan import LinearPlan
from mt_fp8.quantized import (
    QuantizedTensor,
    ScaleLayout,
    cast_to_fp8,
    reduce_amax_,
    scale_from_amax,
)
from mt_fp8.recipes import BlockScaling, MXFP8Scaling, Recipe, RowwiseScaling, TensorwiseScaling
from mt_fp8.weight_cache import weight_key
from mt_fp8.wgrad import weight_gradients_or_deferred

GroupedGemm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
"""``(a, b, scale_a, scale_b, offs) -> bf16 out`` with ``torch._scaled_grouped_mm``'s layouts."""

GEMMS = ("forward", "dgrad", "wgrad")
_OPERAND_ROLES = {
    "forward": (TensorRole.INPUT, TensorRole.WEIGHT),
    "dgrad": (TensorRole.GRAD_OUTPUT, TensorRole.WEIGHT),
    "wgrad": (TensorRole.GRAD_OUTPUT, TensorRole.INPUT),
}
GROUPED_BACKENDS = ("auto", "fast")
WGRAD_ALIGN = 16
"""Token multiple each group of the grouped wgrad starts at (16 bytes of FP8)."""
BLOCK_GROUPED_SIDE = 128
"""The group length and weight-block side the grouped block-scaled GEMM takes
(:mod:`mt_fp8.kernels.grouped_block_gemm`)."""
MX_GROUPED_GROUP = 32
"""MXFP8's group length, the grouped block-scaled GEMM's step for it."""
BLOCK_GROUPED_MIN_EXPERTS = 16
"""Under backend ``"auto"``, block and MXFP8 layers with fewer experts than this keep the
per-expert loop: with few, large experts the loop's launches are few and its dense Triton GEMMs
were measured faster than the grouped kernels (docs/performance.md, "Grouped block-scaled and
MXFP8 expert layers against their per-expert loops"); ``"fast"`` groups them all the same."""
MAX_GROUPS = 1023
"""PyTorch's grouped kernel refuses 1024 groups or more ("Can't process more than 1024 groups")."""
_STACK_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Weight dtypes the tensorwise stack kernel takes (fp64 stays eager: ``cast_to_fp8`` divides
fp64 in fp64, the kernel would round to fp32 first)."""


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
) -> torch.Tensor:
    """PyTorch's CUTLASS grouped FP8 GEMM with rowwise scales, bf16 output (no checks)."""
    # NOTE: use_fast_accum=False, as the loop's torch._scaled_mm calls (gemm.scaled_mm).
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False
    )


def emulated_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
) -> torch.Tensor:
    """:func:`scaled_grouped_mm` by dequantizing to fp32 and one matmul per group (any device)."""
    ends = [int(o) for o in offs.tolist()]
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # 2d x 3d: a (T, Z), b (E, Z, Y) -> (T, Y)
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
        for group, (start, end) in enumerate(zip(starts, ends, strict=True)):
            if end > start:
                a_g = a[start:end].float() * scale_a[start:end, None]
                out[start:end] = a_g @ (b[group].float() * scale_b[group][None, :])
    else:  # 2d x 2d: a (X, T), b (T, Y) -> (G, X, Y)
        rows, cols = a.shape[0], b.shape[1]
        out = torch.zeros(len(ends), rows, cols, dtype=torch.float32, device=a.device)
        for group, (start, end) in enumerate(zip(starts, ends, strict=True)):
            a_g = a[:, start:end].float() * scale_a[group * rows : (group + 1) * rows, None]
            b_g = b[start:end].float() * scale_b[group * cols : (group + 1) * cols][None, :]
            out[group] = a_g @ b_g
    return out.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Where the grouped kernel runs


def gemm_reason(
    gemm: str,
    recipe: Recipe,
    group_sizes: Sequence[int] | torch.Tensor,
    out_dtype: torch.dtype,
    tokens: int | None = None,
) -> str | None:
    """Why ``gemm`` (forward, dgrad or wgrad) runs per group rather than grouped, or None.
    ``tokens``: the sum of the sizes, given where they are a device tensor (not read)."""
    for role in _OPERAND_ROLES[gemm]:
        fmt = recipe.formats.for_role(role)
        if fmt is not FP8Format.E4M3:
            return (
                "torch._scaled_grouped_mm takes float8_e4m3fn operands only; the "
                f"{gemm} GEMM's {role.name.lower()} is {fmt.value}"
            )
    if isinstance(recipe, TensorwiseScaling) and out_dtype != torch.bfloat16:
        return (
            f"the grouped kernel writes bfloat16 and the per-expert tensorwise {gemm} GEMM "
            f"writes {out_dtype} directly"
        )
    tokens = sum(group_sizes) if tokens is None else tokens
    if gemm != "wgrad" and len(group_sizes) == tokens:
        # NOTE: newer PyTorch reads a (T,) scale with T == E as ambiguous (tensorwise per group
        # or rowwise) and refuses it.
        return f"{gemm}: as many tokens as groups ({len(group_sizes)}) make its scales ambiguous"
    return None


def check_group_sizes(
    group_sizes: Sequence[int] | torch.Tensor, groups: int, x_TK: torch.Tensor
) -> list[int] | torch.Tensor:
    """``group_sizes`` checked: host ints as ``groups`` non-negative ints summing to the tokens
    (returned as a list), a tensor as ``groups`` int32 or int64 counts on the tokens' device
    (returned as it is; its values stay unread, as reading them would wait for the device)."""
    tokens = x_TK.shape[0]
    if isinstance(group_sizes, torch.Tensor):
        if (
            tuple(group_sizes.shape) != (groups,)
            or group_sizes.dtype not in (torch.int32, torch.int64)
            or group_sizes.device != x_TK.device
        ):
            raise ValueError(
                f"group_sizes as a tensor must be {groups} int32 or int64 counts on {x_TK.device} "
                f"(the tokens' device), got shape {tuple(group_sizes.shape)} {group_sizes.dtype} "
                f"on {group_sizes.device}"
            )
        return group_sizes
    sizes = [int(s) for s in group_sizes]
    if len(sizes) != groups or sum(sizes) != tokens or any(s < 0 for s in sizes):
        raise ValueError(
            f"group_sizes must be {groups} non-negative ints summing to the {tokens} tokens, "
            f"got {sizes}"
        )
    return sizes


def host_group_sizes(sizes: list[int] | torch.Tensor, groups: int, x_TK: torch.Tensor) -> list[int]:
    """Checked ``sizes`` (:func:`check_group_sizes`) as host ints: a tensor is read, which waits
    for the device (the paths that need host sizes, module docstring)."""
    if isinstance(sizes, torch.Tensor):
        return check_group_sizes(sizes.tolist(), groups, x_TK)  # type: ignore[return-value]
    return sizes


def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return (
            f"torch._scaled_grouped_mm runs on CUDA GPUs of compute capability 9.x, not on {device}"
        )
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return (
            "the grouped FP8 GEMM is taken on compute capability 9.x (measured on Hopper), "
            f"not {capability[0]}.{capability[1]}"
        )
    return None


def grouped_gemm_reason(
    x_TK: torch.Tensor,
    weight_ENK: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    recipe: Recipe,
    backend: str,
    out_dtype: torch.dtype,
) -> str | None:
    """Why :class:`~mt_fp8.linear.FP8GroupedLinear` must loop over experts here, or None.

    None means the grouped path runs: for block scaling and MXFP8
    :func:`~mt_fp8.grouped_block.fp8_block_grouped_linear` (all three GEMMs grouped), else
    :func:`fp8_grouped_linear`, with at least one GEMM grouped (the others per group;
    :func:`gemm_reason`).
    """
    if backend not in GROUPED_BACKENDS:
        return (
            f"backend {backend!r} keeps the per-expert loop (the grouped GEMM is taken with "
            f"{' or '.join(repr(b) for b in GROUPED_BACKENDS)})"
        )
    if isinstance(recipe, (BlockScaling, MXFP8Scaling)):
        return _block_reason(x_TK, weight_ENK, recipe) or (
            block_loop_reason(weight_ENK.shape[0]) if backend == "auto" else None
        )
    if type(recipe) not in (TensorwiseScaling, RowwiseScaling):
        return (
            "the grouped FP8 GEMM takes current tensorwise, rowwise, block or MXFP8 scaling, "
            f"not the {recipe.name} recipe"
        )
    reason = _device_reason(x_TK.device)
    if reason is not None:
        return reason
    num_groups, out_features, in_features = weight_ENK.shape
    if num_groups > MAX_GROUPS:
        return f"torch._scaled_grouped_mm takes at most {MAX_GROUPS} groups, got {num_groups}"
    if in_features % 16 or out_features % 16:
        return (
            f"torch._scaled_grouped_mm needs K and N divisible by 16, got K={in_features}, "
            f"N={out_features}"
        )
    if x_TK.shape[0] == 0:
        return "no tokens: nothing to group"
    dtypes = {"forward": out_dtype, "dgrad": x_TK.dtype, "wgrad": weight_ENK.dtype}
    tokens = x_TK.shape[0]
    reasons = [gemm_reason(gemm, recipe, group_sizes, dtypes[gemm], tokens) for gemm in GEMMS]
    if all(r is not None for r in reasons):
        return "no GEMM can run grouped: " + "; ".join(r for r in reasons if r is not None)
    return None


def block_loop_reason(num_experts: int) -> str | None:
    """Why backend ``"auto"`` keeps a block or MXFP8 layer of ``num_experts`` experts on its
    per-expert loop (:data:`BLOCK_GROUPED_MIN_EXPERTS`), or None."""
    if num_experts < BLOCK_GROUPED_MIN_EXPERTS:
        return (
            f"{num_experts} experts (fewer than {BLOCK_GROUPED_MIN_EXPERTS}) keep the per-expert "
            "loop under backend 'auto', measured faster than the grouped block-scaled GEMM for "
            "few large experts; backend 'fast' groups them"
        )
    return None


def _block_reason(
    x_TK: torch.Tensor, weight_ENK: torch.Tensor, recipe: BlockScaling | MXFP8Scaling
) -> str | None:
    """Why the grouped block-scaled GEMMs (:mod:`mt_fp8.grouped_block`) cannot run, or None.

    They run where the dense Triton block GEMM would (:func:`~mt_fp8.gemm.triton_reason`):
    CUDA compute capability >= 9.0 with Triton."""
    if isinstance(recipe, BlockScaling):
        side = BLOCK_GROUPED_SIDE
        if (recipe.group, recipe.weight_block) != (side, side):
            return (
                f"the grouped block-scaled GEMM takes 1x{side} groups and {side}x{side} weight "
                f"blocks, got group={recipe.group}, weight_block={recipe.weight_block}"
            )
        multiple, unit = side, "whole weight blocks per expert"
    else:
        multiple, unit = MX_GROUPED_GROUP, "whole 1x32 groups of W and Wᵀ"
    _, out_features, in_features = weight_ENK.shape
    if in_features % multiple or out_features % multiple:
        return (
            f"the grouped {recipe.name} GEMM needs K and N divisible by {multiple} ({unit}), "
            f"got K={in_features}, N={out_features}"
        )
    device = x_TK.device
    if device.type != "cuda" or not _triton_block_gemm_available(device.index):
        return (
            "the grouped block-scaled GEMM is a Triton kernel for CUDA GPUs of compute "
            f"capability >= 9.0 with Triton, not {device}"
        )
    if x_TK.shape[0] == 0:
        return "no tokens: nothing to group"
    return None


# ---------------------------------------------------------------------------------------------
# Operands


@dataclass
class _Rows:
    """A (T, C) operand quantized along C with the loop's per-group scales: ``data`` (T, C) FP8,
    ``scale_T`` (T,) fp32 (tensorwise: each group's scale repeated over its tokens)."""

    data: torch.Tensor
    scale_T: torch.Tensor
    layout: ScaleLayout
    fmt: FP8Format
    group_scales: torch.Tensor | None
    """Tensorwise: the (E',) scales of the non-empty groups, in order; rowwise: None."""

    def group(self, start: int, end: int) -> QuantizedTensor:
        """The group of tokens ``[start, end)`` as the loop quantizes it (a view of ``data``)."""
        if self.group_scales is None:
            scale = self.scale_T[start:end].reshape(-1, 1)
        else:
            # NOTE: a copy, not a view into scale_T: cuBLAS refuses scale pointers at some
            # offsets (mt_fp8.quantized.quantize).
            scale = self.scale_T[start : start + 1].reshape(1, 1).clone()
        return QuantizedTensor(self.data[start:end], scale, self.layout, self.fmt)


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


GroupSizes = list[int] | torch.Tensor
"""Tokens per group: host ints, or an int32/int64 tensor on the tokens' device (module
docstring: device group sizes)."""


def _host_ints(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a host sync: ``torch.tensor(values, device=cuda)`` is a
    blocking copy that waits for every kernel queued before it (see
    :func:`mt_fp8.state.format_maxima_on`); from pinned memory (PyTorch's caching host
    allocator, which keeps the block until the copy is done) the copy is asynchronous."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _bias_gradient(
    dy_TN: torch.Tensor, sizes: GroupSizes, dtype: torch.dtype | None
) -> torch.Tensor:
    """(E, N): each group's ``Σ dy`` in fp32, one sum per group (the loop's order, its bits).
    Device sizes are read to the host for the groups' bounds (module docstring: host syncs)."""
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    return torch.stack(
        [dy_TN[s:t].sum(0, dtype=torch.float32).to(dtype) for s, t in _bounds(sizes)]
    )


def _present(sizes: GroupSizes, device: torch.device) -> torch.Tensor:
    """The token counts of the non-empty groups (host sizes) or of every group (device sizes,
    whose empty groups the host does not know), as an int64 tensor on ``device``."""
    if isinstance(sizes, torch.Tensor):
        return sizes.to(torch.int64)
    return _host_ints([size for size in sizes if size], torch.int64, device)


def _counts(sizes: GroupSizes, device: torch.device) -> torch.Tensor:
    """Every group's token count, as an int64 tensor on ``device``."""
    if isinstance(sizes, torch.Tensor):
        return sizes.to(torch.int64)
    return _host_ints(sizes, torch.int64, device)


def padded_token_columns(
    sizes_E: torch.Tensor, padded_starts_E: torch.Tensor, tokens: int
) -> torch.Tensor:
    """Each of the ``tokens`` tokens' column (int64, on the device) when group ``e``'s tokens,
    in order, start at column ``padded_starts_E[e]`` instead of at their unpadded start (int64
    device sizes: every token moves by its group's padding so far)."""
    shift_E = padded_starts_E - (torch.cumsum(sizes_E, 0) - sizes_E)
    shift_T = shift_E.repeat_interleave(sizes_E, output_size=tokens)
    return torch.arange(tokens, device=sizes_E.device) + shift_T


@dataclass
class _WgradPadding:
    """Where each token's column goes when every non-empty group of the wgrad operands is
    padded to a multiple of :data:`WGRAD_ALIGN` tokens and, with ``empty_groups``, every empty
    group is :data:`WGRAD_ALIGN` zero columns (module docstring)."""

    dest_T: torch.Tensor
    """The padded column of each token (int64, on the device)."""
    counts: list[int] | torch.Tensor
    """The padded token counts of the groups kept: all of them with ``empty_groups`` (and for
    device sizes), else the non-empty ones."""
    columns: int
    """Columns of the padded operands: ``sum(counts)``, or for device sizes its bound."""

    @classmethod
    def of(
        cls, sizes: Sequence[int], device: torch.device, empty_groups: bool = False
    ) -> _WgradPadding | None:
        """None when nothing moves: every kept group is aligned already (and not empty)."""
        kept = list(sizes) if empty_groups else [size for size in sizes if size]
        if all(size and size % WGRAD_ALIGN == 0 for size in kept):
            return None
        counts, shifts, shift = [], [], 0
        for size in kept:
            shifts.append(shift)
            pad = -size % WGRAD_ALIGN if size else WGRAD_ALIGN
            counts.append(size + pad)
            shift += pad
        tokens = sum(kept)
        kept_G, shift_G = _host_ints([kept, shifts], torch.int64, device)
        shift_T = shift_G.repeat_interleave(kept_G, output_size=tokens)
        return cls(torch.arange(tokens, device=device) + shift_T, counts, sum(counts))

    @classmethod
    def on_device(cls, sizes_E: torch.Tensor, tokens: int) -> _WgradPadding:
        """The ``empty_groups`` padding of device sizes (summing to ``tokens``), computed there,
        in ``floor((T + 16·E) / 16) · 16`` columns: each group gains at most 16 and the total
        is a multiple of 16. The columns past the last group are zeros in no group (module
        docstring: device group sizes)."""
        sizes = sizes_E.to(torch.int64)
        aligned = (sizes + WGRAD_ALIGN - 1) // WGRAD_ALIGN * WGRAD_ALIGN
        counts = torch.where(sizes > 0, aligned, WGRAD_ALIGN)
        dest_T = padded_token_columns(sizes, torch.cumsum(counts, 0) - counts, tokens)
        columns = (tokens + WGRAD_ALIGN * sizes.numel()) // WGRAD_ALIGN * WGRAD_ALIGN
        return cls(dest_T, counts, columns)

    def pad(self, data_CT: torch.Tensor) -> torch.Tensor:
        """``data_CT`` (C, T) FP8 with zero columns after each group: (C, columns)."""
        padded = torch.zeros(
            data_CT.shape[0], self.columns, dtype=torch.uint8, device=data_CT.device
        )
        padded.index_copy_(1, self.dest_T, data_CT.view(torch.uint8))
        return padded.view(data_CT.dtype)


def _every_group_scales(scales: torch.Tensor, sizes: GroupSizes, columns: int) -> torch.Tensor:
    """The wgrad scale vector (group-major, ``columns`` per group) of the non-empty groups
    widened to every group: an empty group's columns are zero bytes, so its scale only has to be
    finite (1; module docstring, empty groups). Device sizes: every group's already (an empty
    group's amax is 0, its scale 1)."""
    if isinstance(sizes, torch.Tensor):
        return scales
    present = [e for e, size in enumerate(sizes) if size]
    if len(present) == len(sizes):
        return scales
    every = scales.new_ones(len(sizes), columns)
    every.index_copy_(0, _host_ints(present, torch.int64, scales.device), scales.view(-1, columns))
    return every.reshape(-1)


def _segment_amax(x_TC: torch.Tensor, sizes: GroupSizes, counts_G: torch.Tensor) -> torch.Tensor:
    """(G, C) fp32: ``max |x|`` over the rows of each non-empty group (``counts_G``), per column.
    Device sizes: over the rows of every group, by :func:`_scattered_amax`.

    First a max over blocks of ``b`` rows by PyTorch's ordinary reduction, then
    ``torch.segment_reduce`` over those block maxima (a max of maxima is the max: the bits do
    not depend on ``b``). ``b`` is the gcd of the group sizes where that is
    :data:`WGRAD_ALIGN` or more, else :data:`WGRAD_ALIGN` with each group padded by zero rows
    (:class:`_WgradPadding`; magnitudes are ``>= 0``, so zeros change no maximum).
    NOTE: segment_reduce's CUDA kernel walks each segment serially in one thread per (group,
    column), so the block step shortens those walks ``b``-fold; routed group sizes have a gcd
    near 1, where unpadded walks would be whole groups (the largest one under skewed routing).

    NaN is counted as ``+inf`` (as the Triton quantizers count it): either way the scale is NaN
    (:func:`~mt_fp8.quantized.scale_from_amax`), and no reduction's NaN handling is relied on.
    """
    inf = float("inf")
    magnitude = x_TC.abs().nan_to_num_(nan=inf, posinf=inf)
    if isinstance(sizes, torch.Tensor):
        return _scattered_amax(magnitude, counts_G)
    block = math.gcd(*sizes)
    padding = None if block >= WGRAD_ALIGN else _WgradPadding.of(sizes, x_TC.device)
    if padding is not None:
        block = WGRAD_ALIGN
        padded = magnitude.new_zeros(sum(padding.counts), magnitude.shape[1])
        magnitude = padded.index_copy_(0, padding.dest_T, magnitude)
        counts_G = _host_ints(padding.counts, torch.int64, x_TC.device)
    if block > 1:
        tokens, columns = magnitude.shape
        magnitude = magnitude.reshape(tokens // block, block, columns).amax(dim=1)
    lengths = counts_G // block
    return torch.segment_reduce(magnitude, "max", lengths=lengths, axis=0, unsafe=True).float()


def _scattered_amax(magnitude_TC: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """(E, C) fp32: the largest magnitude of each group's rows per column, each row scattered
    by max into its group's row of a zero (E, C) tensor (``counts_E`` on the device: no
    segment lengths on the host). A maximum is exact in any order, so these are the segmented
    reduction's bits; magnitudes are ``>= 0``, so the zeros change none, and an empty group's
    amax is 0 (scale 1)."""
    tokens, columns = magnitude_TC.shape
    groups = torch.arange(counts_E.numel(), device=counts_E.device)
    group_T = groups.repeat_interleave(counts_E, output_size=tokens)
    amax_EC = magnitude_TC.new_zeros(counts_E.numel(), columns)
    amax_EC.scatter_reduce_(0, group_T[:, None].expand(tokens, columns), magnitude_TC, "amax")
    return amax_EC.float()


def _amax_group_reduced(plan: LinearPlan, amax: torch.Tensor, role: TensorRole) -> torch.Tensor:
    group = plan.reduction_group(role)
    return amax if group is None else reduce_amax_(amax, group)


def _quantize_rows(
    plan: LinearPlan, x_TC: torch.Tensor, sizes: Sequence[int], role: TensorRole
) -> _Rows:
    """``x`` quantized along C with the loop's per-group scales (module docstring), in a
    number of kernels that does not depend on the number of groups."""
    fmt, layout = plan.recipe.formats.for_role(role), plan.recipe.layout(role)
    if isinstance(plan.recipe, RowwiseScaling):
        q = plan.quantize(x_TC, role, record=True)  # rows are independent: as per group
        return _Rows(q.data, q.scale.reshape(-1), layout, fmt, None)
    counts_G = _present(sizes, x_TC.device)
    amax_G = _segment_amax(x_TC, sizes, counts_G).amax(dim=1)
    scale_G = scale_from_amax(_amax_group_reduced(plan, amax_G, role), fmt)
    scale_T = scale_G.repeat_interleave(counts_G, output_size=x_TC.shape[0])
    data = cast_to_fp8(x_TC.contiguous(), scale_T[:, None], fmt, plan.health_stats(role))
    return _Rows(data, scale_T, layout, fmt, scale_G)


def _quantize_columns(
    plan: LinearPlan, x_TC: torch.Tensor, rows: _Rows, sizes: Sequence[int], role: TensorRole
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2d × 2d wgrad operand: each non-empty group's ``x_eᵀ`` (C, T_e) quantized along its
    tokens, as the loop's, side by side in ``data`` (C, T); scales (E'·C,) group-major.

    Tensorwise: the exact transpose of ``rows``. Rowwise: per (group, column) amaxes by one
    segmented reduction, then one cast of ``x`` with each element's group-column scale, stored
    transposed (module docstring); no health counts, as the loop's transposed operands.
    """
    columns = x_TC.shape[1]
    if rows.group_scales is not None:
        return rows.data.t().contiguous(), rows.group_scales.repeat_interleave(columns)
    counts_G = _present(sizes, x_TC.device)
    scale_GC = scale_from_amax(_segment_amax(x_TC, sizes, counts_G), rows.fmt)
    tokens = x_TC.shape[0]
    if plan._fused_rowwise(x_TC, rows.layout):
        from mt_fp8.kernels.rowwise_quantize import quantize_group_columns_transposed

        groups = torch.arange(len(counts_G), device=x_TC.device, dtype=torch.int32)
        group_T = groups.repeat_interleave(counts_G, output_size=tokens)
        data_CT = quantize_group_columns_transposed(x_TC, scale_GC, group_T, rows.fmt)
        return data_CT, scale_GC.reshape(-1)
    scale_TC = scale_GC.repeat_interleave(counts_G, dim=0, output_size=tokens)
    data_TC = cast_to_fp8(x_TC.contiguous(), scale_TC, rows.fmt)
    return data_TC.t().contiguous(), scale_GC.reshape(-1)


def _group_columns(
    plan: LinearPlan, x_TC: torch.Tensor, rows: _Rows, sizes: Sequence[int], role: TensorRole
) -> list[QuantizedTensor | None]:
    """Each group's ``x_eᵀ`` (C, T_e) as the loop's own wgrad operand, for per-group wgrad.

    Tensorwise: each group's exact transpose. Rowwise: the groups of one
    :func:`_quantize_columns` (the loop's bytes and scales in a number of kernels that does not
    depend on E), each copied out contiguous; the per-group GEMMs stay (E5M2 gradients)."""
    if not isinstance(plan.recipe, RowwiseScaling):
        return [
            None if t == s else plan.quantize_transposed(x_TC[s:t], rows.group(s, t), role)
            for s, t in _bounds(sizes)
        ]
    data_CT, scales = _quantize_columns(plan, x_TC, rows, sizes, role)
    scale_GC1 = iter(scales.view(-1, x_TC.shape[1], 1))  # the non-empty groups' (C, 1) scales
    return [
        None
        if t == s
        else QuantizedTensor(data_CT[:, s:t].contiguous(), next(scale_GC1), rows.layout, rows.fmt)
        for s, t in _bounds(sizes)
    ]


@dataclass
class _Stacked:
    """The FP8 weights of all experts: ``data`` (E, R, C), ``scale`` (E, G, H)."""

    data: torch.Tensor
    scale: torch.Tensor
    layout: ScaleLayout
    fmt: FP8Format

    def expert(self, e: int) -> QuantizedTensor:
        return QuantizedTensor(self.data[e], self.scale[e], self.layout, self.fmt)

    def column_scales(self) -> torch.Tensor:
        """(E, R): the rowwise ``scale_b`` of a 3-D grouped operand."""
        experts, rows = self.data.shape[:2]
        # NOTE: contiguous: a tensorwise scale expands with stride 0, and the kernel wants
        # scales contiguous in their last dimension.
        return self.scale.expand(experts, rows, 1).reshape(experts, rows).contiguous()


def _rows_by_experts(
    plan: GroupedPlan,
    gemm: str,
    rows: _Rows,
    weight: _Stacked,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The 2d × 3d GEMM ``out[group e] = rows_e · W_eᵀ (+ bias_e)`` (forward or dgrad): one
    grouped kernel call if ``gemm`` is in ``plan.grouped``, else :func:`fp8_gemm` per expert."""
    lp = plan.linear
    if gemm in plan.grouped:
        out = plan.gemm(
            rows.data, weight.data.transpose(1, 2), rows.scale_T, weight.column_scales(), offs
        ).to(out_dtype)
        if bias is not None:
            counts_E = _counts(plan.sizes, out.device)
            out += bias.repeat_interleave(counts_E, dim=0, output_size=out.shape[0])
        return out
    return torch.cat(
        [
            rows.data.new_empty(0, out_features, dtype=out_dtype)
            if t == s
            else fp8_gemm(
                rows.group(s, t),
                weight.expert(e),
                out_dtype,
                None if bias is None else bias[e],
                lp.backend,
            )
            for e, (s, t) in enumerate(_bounds(plan.sizes))
        ]
    )


def _quantize_weights(
    plan: LinearPlan, weight_ENK: torch.Tensor, need_transpose: bool
) -> tuple[_Stacked, _Stacked | None]:
    """``W`` per (expert, output row), per expert, in square blocks or in 1×32 groups, and
    ``Wᵀ`` per (expert, input column), the exact transpose or in 1×32 groups along N, as the
    loop quantizes each expert, in one quantization each."""
    experts, out_features, in_features = weight_ENK.shape
    role = TensorRole.WEIGHT
    fmt, layout = plan.recipe.formats.for_role(role), plan.recipe.layout(role)
    if isinstance(plan.recipe, MXFP8Scaling):
        return _quantize_mx_weights(plan, weight_ENK, need_transpose, fmt, layout)
    if isinstance(plan.recipe, BlockScaling):
        # (E·N, K) in square blocks: with N % block == 0 no block straddles two experts. The
        # Triton quantizer stores each expert's exact transpose in the same pass; elsewhere
        # the transpose is a copy of the FP8 stack and its scales.
        q = plan.quantize(
            weight_ENK.reshape(-1, in_features),
            role,
            record=True,
            transposed=need_transpose,
            matrices=experts,
        )
        block = layout.block[0]
        scale = q.scale.view(experts, out_features // block, in_features // block)
        weight = _Stacked(q.data.view(weight_ENK.shape), scale, layout, fmt)
        if not need_transpose:
            return weight, None
        if q.transposed is not None:
            each_t = q.transposed
            data_t = each_t.data.view(experts, in_features, out_features)
            scale_t = each_t.scale.view(experts, in_features // block, out_features // block)
        else:
            data_t, scale_t = (t.transpose(1, 2).contiguous() for t in (weight.data, scale))
        return weight, _Stacked(data_t, scale_t, layout, fmt)
    if isinstance(plan.recipe, RowwiseScaling):
        q = plan.quantize(weight_ENK.reshape(-1, in_features), role, record=True)
        weight = _Stacked(
            q.data.view(weight_ENK.shape), q.scale.view(experts, out_features, 1), layout, fmt
        )
        if not need_transpose:
            return weight, None
        data_t, scale_EK = _quantize_weight_columns(plan, weight_ENK, fmt, layout)
        return weight, _Stacked(data_t, scale_EK[:, :, None], layout, fmt)
    # NOTE: the ∞-norm reads the stack once; abs().amax() wrote an fp32 |w| copy of it first,
    # every optimizer step (NaN gives NaN either way: a NaN scale, as the quantizers give it).
    amax_E = torch.linalg.vector_norm(weight_ENK, ord=math.inf, dim=(1, 2)).float()
    scale_E = scale_from_amax(_amax_group_reduced(plan, amax_E, role), fmt)
    stats = plan.health_stats(role)
    if plan._fused_tensorwise(weight_ENK, layout) and weight_ENK.dtype in _STACK_KERNEL_DTYPES:
        from mt_fp8.kernels.quantize import quantize_transpose_stack_triton

        data, data_t = quantize_transpose_stack_triton(
            weight_ENK, scale_E, fmt, stats, need_transpose
        )
    else:
        scale_rows = scale_E.repeat_interleave(out_features)[:, None]
        data = cast_to_fp8(weight_ENK.reshape(-1, in_features), scale_rows, fmt, stats)
        data = data.view(weight_ENK.shape)
        data_t = data.transpose(1, 2).contiguous() if need_transpose else None
    weight = _Stacked(data, scale_E.view(experts, 1, 1), layout, fmt)
    if data_t is None:
        return weight, None
    return weight, _Stacked(data_t, weight.scale, layout, fmt)


def _quantize_mx_weights(
    plan: LinearPlan,
    weight_ENK: torch.Tensor,
    need_transpose: bool,
    fmt: FP8Format,
    layout: ScaleLayout,
) -> tuple[_Stacked, _Stacked | None]:
    """MXFP8 ``W`` (E, N, K) in 1×32 groups along K and ``Wᵀ`` (E, K, N) in 1×32 groups along N.

    One quantization of the stacked (E·N, K) rows gives ``W``: a group lies inside one row, so
    each is the loop's group of ``W_e``. ``Wᵀ`` is that call's transposed operand, the (K, E·N)
    transpose quantized in 1×32 groups along E·N (the fused quantizer writes it in the same
    pass; else :meth:`~mt_fp8.linear_plan.LinearPlan.quantize_transposed`): with N % 32 == 0 a
    group is 32 consecutive ``n`` of one expert's column ``k``, the loop's group of row ``k`` of
    ``W_eᵀ``, so bytes and scales are the loop's. An FP8 copy puts each expert's (K, N) block
    together (no transposed copy of the high-precision weights)."""
    experts, out_features, in_features = weight_ENK.shape
    group = layout.block[1]
    rows = weight_ENK.reshape(-1, in_features)
    q = plan.quantize(rows, TensorRole.WEIGHT, record=True, transposed=need_transpose)
    scale = q.scale.view(experts, out_features, in_features // group)
    weight = _Stacked(q.data.view(weight_ENK.shape), scale, layout, fmt)
    if not need_transpose:
        return weight, None
    q_t = plan.quantize_transposed(rows, q, TensorRole.WEIGHT)  # (K, E·N)
    data_t = q_t.data.view(in_features, experts, out_features).transpose(0, 1)
    scale_t = q_t.scale.view(in_features, experts, out_features // group).transpose(0, 1)
    return weight, _Stacked(data_t.contiguous(), scale_t.contiguous(), layout, fmt)


def _quantize_weight_columns(
    plan: LinearPlan, weight_ENK: torch.Tensor, fmt: FP8Format, layout: ScaleLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise ``Wᵀ``: (E, K, N) FP8 and (E, K) scales, row ``(e, k)`` being column ``k`` of
    ``W_e`` quantized as the loop's ``quantize_transposed`` does (no health counts).

    The (E, K) amaxes come from one reduction over N, then one cast of the stacked (E·N, K)
    rows with ``scale[e, k]`` and FP8 transposes of the bytes: no transposed copy of the
    high-precision weights (an fp32 [E, K, N] copy cost 1.5 ms per DeepSeek-V2-Lite expert
    projection on an H100, docs/benchmarks-log.md 2026-12-07)."""
    experts, out_features, in_features = weight_ENK.shape
    # NOTE: the ∞-norm is max |w| (NaN gives NaN: a NaN scale, as the quantizers give it).
    amax_EK = torch.linalg.vector_norm(weight_ENK, ord=math.inf, dim=1).float()
    scale_EK = scale_from_amax(amax_EK, fmt)
    rows = weight_ENK.reshape(-1, in_features)
    if plan._fused_rowwise(rows, layout):
        from mt_fp8.kernels.rowwise_quantize import quantize_group_columns_transposed

        expert_R = torch.arange(experts, device=rows.device, dtype=torch.int32)
        expert_R = expert_R.repeat_interleave(out_features)
        data_KR = quantize_group_columns_transposed(rows, scale_EK, expert_R, fmt)
        data_EKN = data_KR.view(in_features, experts, out_features).transpose(0, 1)
    else:
        data_EKN = cast_to_fp8(rows, scale_EK, fmt).view(weight_ENK.shape).transpose(1, 2)
    return data_EKN.contiguous(), scale_EK


def _weight_operands(
    plan: LinearPlan, weight_ENK: torch.Tensor, need_transpose: bool
) -> tuple[_Stacked, _Stacked | None]:
    """Stacked FP8 ``W`` and (if needed) ``Wᵀ``, cached (module docstring: weight cache)."""
    cache, key = plan.weight_cache, None
    if cache is not None and not torch.compiler.is_compiling():
        key = weight_key(weight_ENK, (plan.recipe, plan.meta.scale_version, need_transpose))
        cached = cache.lookup(key, weight_ENK)
        if cached is not None:
            return cached.weight, cached.weight_transposed
    weight, weight_t = _quantize_weights(plan, weight_ENK, need_transpose)
    if key is not None:
        cache.store(key, weight_ENK, weight, weight_t)  # type: ignore[union-attr]
    return weight, weight_t


def _wgrad_padding(sizes: GroupSizes, x_TC: torch.Tensor) -> _WgradPadding | None:
    """The wgrad operands' padding, every group kept (module docstring: empty groups)."""
    if isinstance(sizes, torch.Tensor):
        return _WgradPadding.on_device(sizes, x_TC.shape[0])
    return _WgradPadding.of(sizes, x_TC.device, empty_groups=True)


def _offsets(sizes: GroupSizes, device: torch.device) -> torch.Tensor:
    if isinstance(sizes, torch.Tensor):
        return torch.cumsum(sizes, 0).to(torch.int32)
    ends, total = [], 0
    for size in sizes:
        total += size
        ends.append(total)
    return _host_ints(ends, torch.int32, device)


# ---------------------------------------------------------------------------------------------
# The autograd function


@dataclass
class GroupedPlan:
    """Everything non-tensor one grouped call needs."""

    linear: LinearPlan
    """Recipe, state, backend, output dtype, health; ``weight_cache`` is the grouped cache."""
    sizes: GroupSizes
    grouped: frozenset[str]
    """The GEMMs that run grouped (:data:`GEMMS`); the others run per group."""
    gemm: GroupedGemm = scaled_grouped_mm


class FP8GroupedLinearFunction(torch.autograd.Function):
    """``y[group e] = x[group e] W_eᵀ + b_e`` with grouped FP8 GEMMs (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x_TK: torch.Tensor,
        weight_ENK: torch.Tensor,
        bias_EN: torch.Tensor | None,
        plan: GroupedPlan,
    ) -> torch.Tensor:
        lp, sizes = plan.linear, plan.sizes
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        offs = _offsets(sizes, x_TK.device)
        x_rows = _quantize_rows(lp, x_TK, sizes, TensorRole.INPUT)
        weight, weight_t = _weight_operands(lp, weight_ENK, need_transpose=need_dx)
        bias = None if bias_EN is None else bias_EN.to(lp.out_dtype)
        y_TN = _rows_by_experts(
            plan, "forward", x_rows, weight, offs, lp.out_dtype, weight_ENK.shape[1], bias
        )
        saved: list[torch.Tensor | None] = [offs]
        if need_dw:
            if "wgrad" in plan.grouped:
                x_t_data, x_t_scales = _quantize_columns(lp, x_TK, x_rows, sizes, TensorRole.INPUT)
                padding = _wgrad_padding(sizes, x_TK)
                saved += [
                    x_t_data if padding is None else padding.pad(x_t_data),
                    _every_group_scales(x_t_scales, sizes, x_TK.shape[1]),
                ]
            else:
                for q in _group_columns(lp, x_TK, x_rows, sizes, TensorRole.INPUT):
                    saved += [None, None] if q is None else [q.data, q.scale]
            ctx.x_t_format = (lp.recipe.layout(TensorRole.INPUT), lp.recipe.formats.input)
        if need_dx:
            assert weight_t is not None
            saved += [weight_t.data, weight_t.scale]
            ctx.weight_t_format = (weight_t.layout, weight_t.fmt)
        ctx.save_for_backward(*saved)
        ctx.plan = plan
        ctx.params = (weight_ENK, bias_EN) if lp.wgrad_sink is not None else None
        ctx.dtypes = (x_TK.dtype, weight_ENK.dtype, None if bias_EN is None else bias_EN.dtype)
        ctx.shapes = tuple(weight_ENK.shape)
        return y_TN

    @staticmethod
    def backward(ctx: Any, dy_TN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: GroupedPlan = ctx.plan
        lp, sizes = plan.linear, plan.sizes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        _, out_features, in_features = ctx.shapes
        saved = list(ctx.saved_tensors)
        offs = saved.pop(0)
        dx = None
        with torch.autocast(dy_TN.device.type, enabled=False):
            dy_TN = dy_TN.contiguous()
            dy_rows = _quantize_rows(lp, dy_TN, sizes, TensorRole.GRAD_OUTPUT)
            if need_dw:  # the operands here, the GEMMs in weight_gradients (module docstring)
                layout, fmt = ctx.x_t_format
                if "wgrad" in plan.grouped:
                    x_t_data, x_t_scales = saved.pop(0), saved.pop(0)
                    dy_t_data, dy_t_scales = _quantize_columns(
                        lp, dy_TN, dy_rows, sizes, TensorRole.GRAD_OUTPUT
                    )
                    counts = sizes if isinstance(sizes, torch.Tensor) else list(sizes)
                    padding = _wgrad_padding(sizes, dy_TN)
                    if padding is not None:
                        dy_t_data, counts = padding.pad(dy_t_data), padding.counts
                    dy_t_scales = _every_group_scales(dy_t_scales, sizes, out_features)
                    wgrad_offs = _offsets(counts, dy_TN.device)
                else:
                    pairs = []
                    dy_t = _group_columns(lp, dy_TN, dy_rows, sizes, TensorRole.GRAD_OUTPUT)
                    for q_dy in dy_t:
                        data, scale = saved.pop(0), saved.pop(0)
                        q_x = None if q_dy is None else QuantizedTensor(data, scale, layout, fmt)
                        pairs.append((q_dy, q_x))

            def weight_gradients() -> tuple[torch.Tensor | None, torch.Tensor | None]:
                dw = db = None
                with torch.autocast(dy_TN.device.type, enabled=False):
                    if need_dw and "wgrad" in plan.grouped:
                        dw_ENK = plan.gemm(
                            dy_t_data, x_t_data.t(), dy_t_scales, x_t_scales, wgrad_offs
                        )
                        dw = dw_ENK.to(w_dtype)  # experts without tokens: zeros from the GEMM
                    elif need_dw:
                        dw = torch.stack(
                            [
                                dy_TN.new_zeros(out_features, in_features, dtype=w_dtype)
                                if q_dy is None
                                else fp8_gemm(q_dy, q_x, w_dtype, None, lp.backend)
                                for q_dy, q_x in pairs
                            ]
                        )
                    if need_db:
                        db = _bias_gradient(dy_TN, sizes, b_dtype)
                return dw, db

            sink = lp.wgrad_sink if need_dw or need_db else None
            holds: list[torch.Tensor | None] = [dy_TN]
            if need_db and isinstance(sizes, torch.Tensor):
                holds.append(sizes)
            if need_dw and "wgrad" in plan.grouped:
                holds += [dy_t_data, x_t_data, dy_t_scales, x_t_scales, wgrad_offs]
            elif need_dw:
                for q_dy, q_x in pairs:
                    if q_dy is not None:
                        holds += [q_dy.data, q_dy.scale, q_x.data, q_x.scale]
            dw, db = weight_gradients_or_deferred(sink, ctx.params, weight_gradients, holds)
            if need_dx:
                weight_t = _Stacked(saved.pop(0), saved.pop(0), *ctx.weight_t_format)
                dx = _rows_by_experts(
                    plan, "dgrad", dy_rows, weight_t, offs, x_dtype, in_features, None
                )
        if lp.weight_cache is not None:
            lp.weight_cache.release_after_backward()
        return dx, dw, db, None


def fp8_grouped_linear(
    x_TK: torch.Tensor,
    weight_ENK: torch.Tensor,
    bias_EN: torch.Tensor | None,
    group_sizes: Sequence[int] | torch.Tensor,
    plan: LinearPlan,
    grouped_gemm: GroupedGemm = scaled_grouped_mm,
) -> torch.Tensor:
    """``y[group e] = x[group e] W_eᵀ + b_e`` with grouped FP8 GEMMs where :func:`gemm_reason`
    allows, per group otherwise.

    ``group_sizes``: E host ints, or an int32/int64 tensor of them on ``x_TK``'s device, read
    there where :func:`reads_sizes_on_device` (rowwise scaling, every GEMM grouped) and to the
    host otherwise (module docstring: device group sizes). ``plan.weight_cache`` is the layer's
    grouped weight cache (or None). ``grouped_gemm`` replaces the kernel (tests pass
    :func:`emulated_grouped_mm` to run this on CPU); the caller checks the device with
    :func:`grouped_gemm_reason`.
    """
    if isinstance(plan.recipe, (BlockScaling, MXFP8Scaling)):
        raise ValueError(
            f"{plan.recipe.name} scaling runs grouped through "
            "mt_fp8.grouped_block.fp8_block_grouped_linear, not fp8_grouped_linear "
            "(torch._scaled_grouped_mm takes no block scales)"
        )
    num_groups = weight_ENK.shape[0]
    sizes = check_group_sizes(group_sizes, num_groups, x_TK)
    tokens = x_TK.shape[0]
    if tokens == 0:
        raise ValueError("fp8_grouped_linear needs at least one token (the layer loops on none)")
    grouped = _grouped_gemms(plan.recipe, sizes, x_TK, weight_ENK, plan.out_dtype)
    if not _device_sizes_suffice(plan.recipe, grouped):
        sizes = host_group_sizes(sizes, num_groups, x_TK)
    grouped_plan = GroupedPlan(plan, sizes, grouped, grouped_gemm)
    with torch.autocast(x_TK.device.type, enabled=False):
        return FP8GroupedLinearFunction.apply(x_TK, weight_ENK, bias_EN, grouped_plan)


def _grouped_gemms(
    recipe: Recipe,
    sizes: Sequence[int] | torch.Tensor,
    x_TK: torch.Tensor,
    weight_ENK: torch.Tensor,
    out_dtype: torch.dtype,
) -> frozenset[str]:
    """The GEMMs that run grouped for a call on ``x_TK`` (:func:`gemm_reason`)."""
    dtypes = {"forward": out_dtype, "dgrad": x_TK.dtype, "wgrad": weight_ENK.dtype}
    tokens = x_TK.shape[0]
    return frozenset(
        gemm for gemm in GEMMS if gemm_reason(gemm, recipe, sizes, dtypes[gemm], tokens) is None
    )


def _device_sizes_suffice(recipe: Recipe, grouped: frozenset[str]) -> bool:
    """Whether a call runs from device group sizes: rowwise scaling with every GEMM grouped
    (per-group GEMMs and tensorwise's per-group scales need host bounds)."""
    return isinstance(recipe, RowwiseScaling) and grouped == frozenset(GEMMS)


def reads_sizes_on_device(
    x_TK: torch.Tensor, weight_ENK: torch.Tensor, recipe: Recipe, backend: str
) -> bool:
    """Whether :class:`~mt_fp8.linear.FP8GroupedLinear` reads a tensor of group sizes on the
    device for a call on ``x_TK`` (the grouped block-scaled path, or this module's with
    rowwise scaling and every GEMM grouped) rather than reading it to the host first."""
    groups = range(weight_ENK.shape[0])  # only their number is read, with the tokens of x
    if grouped_gemm_reason(x_TK, weight_ENK, groups, recipe, backend, x_TK.dtype) is not None:
        return False
    if isinstance(recipe, (BlockScaling, MXFP8Scaling)):
        return True
    grouped = _grouped_gemms(recipe, groups, x_TK, weight_ENK, x_TK.dtype)
    return _device_sizes_suffice(recipe, grouped)
