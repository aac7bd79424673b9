"""The quantized-tensor representation: FP8 data, scales, a block layout and a format.

Math. A 2-D high-precision tensor ``x_RC`` (R rows, C columns; C is always the GEMM contraction
axis) is cut into blocks of ``br × bc`` elements. Each block ``b`` gets one fp32 *dequantization*
scale ``s_b`` and FP8 data ``q = sat(rne(x · s_b⁻¹))`` so that ``x ≈ q · s_b``, where
``s_b⁻¹ = RN(1 / s_b)`` is the fp32 inverse scale (one IEEE division per block, then one
round-to-nearest product per element: the same bytes in the PyTorch path here and every Triton
kernel, which multiply because a division per element held the fused quantizer well below copy
bandwidth (docs/benchmarks-log.md); fp64 inputs divide in fp64, so the FP8 cast
is their only rounding):

    amax_b = max |x| over block b                 (computed in high precision, before the cast)
    s_b    = max(amax_b, fmt.max · 2^-126) / fmt.max
    s_b    = 2^clamp(floor(log2 amax_b) - fmt.emax, -126, 127)   (power-of-two layouts: MXFP8)
    s_b    = 2^clamp(ceil(log2 RN(amax_b / fmt.max)), -126, 127)   (power-of-two, rounded up)

Edge cases of :func:`scale_from_amax`, the one place scales come from (every recipe, the fused
kernel, the delayed-scaling update):

* ``amax_b == 0`` (an all-zero block: padding rows, ignored tokens) → ``s_b = 1`` and ``q = 0``.
* Tiny ``amax_b`` → ``s_b`` never goes below ``2^-126``, the smallest *normal* fp32. A subnormal
  scale is flushed to zero by FTZ arithmetic (Triton links libdevice with flush-to-zero; cuBLAS
  epilogues may too), and ``x / 0`` is ``inf`` or, for ``x = 0``, NaN. With the floor,
  ``|x / s_b| <= amax_b / 2^-126 < fmt.max``: nothing saturates, the block just uses less of
  the format's range. MX scales likewise stop at ``2^-126`` (E8M0 could encode ``2^-127``).
* Huge ``amax_b`` (up to the fp32 maximum) → ``s_b = amax_b / fmt.max``, finite.
* Non-finite ``amax_b`` (the block holds ``inf`` or NaN; fp64 values beyond the fp32 range
  count as ``inf``) → ``s_b = NaN``. Every value of that block dequantizes to NaN, so a
  non-finite input gives non-finite GEMM outputs, as it would in high precision, and anomaly
  checks on the loss or the gradients see it. It is never silently saturated into a finite
  number. (With a *given* scale, as delayed scaling uses, ``±inf`` saturates to ``±fmt.max`` like
  any out-of-range value and is counted as saturated; NaN stays NaN.)

``s_b`` is what ``torch._scaled_mm`` calls ``scale_a`` / ``scale_b`` (it multiplies the FP8
product by them); Transformer Engine calls it ``scale_inv``. Because the scale is taken from the
block's own amax, ``|x / s_b| ≤ fmt.max`` and nothing saturates, except with delayed scaling
(a scale from past amaxes) and MXFP8 (a power-of-two scale rounds the range up to ``[256, 512)``
for E4M3, so the top of the block saturates at 448, as the OCP spec allows).

Layouts, as ``ScaleLayout.block`` (``-1`` = the whole axis); scales are ``s_GH`` with
``G = R / br`` and ``H = C / bc``:

=====================  ============  ================  ==============================
name                   block         scale shape       used for
=====================  ============  ================  ==============================
tensorwise             (-1, -1)      (1, 1)            delayed and current scaling
rowwise                (1, -1)       (R, 1)            rowwise scaling
1×128 groups           (1, 128)      (R, C/128)        block scaling: activations, grads
128×128 blocks         (128, 128)    (R/128, C/128)    block scaling: weights
MX 1×32 (pow2)         (1, 32)       (R, C/32)         MXFP8
=====================  ============  ================  ==============================

Invariants: ``data`` is a contiguous ``(R, C)`` FP8 tensor, ``scale`` a contiguous fp32
``(G, H)`` tensor; block sizes divide their axes (checked, with a message naming both).

Amax reduction (current tensorwise scaling of a tensor sharded over ranks, e.g. by tensor
parallelism): with ``amax_group``, :func:`quantize` MAX-reduces the local amax over that process
group before computing ``s``, so every rank quantizes its shard with the scale of the whole
tensor and the shards' FP8 bytes are exactly the slices of the unsharded quantization. NaN is
sent as ``+inf`` so that a NaN on one rank reaches every rank whatever the backend's MAX does
with NaN. All ranks of the group must quantize the same sequence of tensors (one all-reduce
each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mt_fp8.formats import FP8Format

# Shape suffixes: R rows, C columns (contraction axis), G = R / br, H = C / bc.


@dataclass(frozen=True)
class ScaleLayout:
    """Blocks sharing one scale, as (rows, columns); -1 spans the whole axis."""

    block: tuple[int, int]
    """Block shape (rows, columns); -1 means the whole axis."""
    power_of_two: bool = False
    """Power-of-two scales (MXFP8's E8M0 shared exponents)."""
    round_up: bool = False
    """With ``power_of_two``: the smallest power of two at least ``amax / fmt.max`` (nothing
    saturates, one bit of range may go unused) instead of the OCP spec's
    ``2^(floor(log2 amax) - emax)`` (the block's top values saturate at ``fmt.max``)."""

    def __post_init__(self) -> None:
        if self.round_up and not self.power_of_two:
            raise ValueError("ScaleLayout.round_up applies to power-of-two scales only")
        if len(self.block) != 2 or any(b == 0 or b < -1 for b in self.block):
            raise ValueError(
                f"ScaleLayout.block must be two positive ints or -1 (whole axis), got {self.block!r}"
            )

    @property
    def name(self) -> str:
        br, bc = self.block
        if (br, bc) == (-1, -1):
            return "tensorwise"
        if (br, bc) == (1, -1):
            return "rowwise"
        kind = ("mxceil" if self.round_up else "mx") if self.power_of_two else "block"
        return f"{kind}{br if br > 0 else 'R'}x{bc if bc > 0 else 'C'}"

    def resolve(self, shape_RC: tuple[int, int]) -> tuple[int, int]:
        """The concrete block shape for a tensor of ``shape_RC``; raises if it does not divide."""
        rows, cols = shape_RC
        br = rows if self.block[0] == -1 else self.block[0]
        bc = cols if self.block[1] == -1 else self.block[1]
        if rows % br or cols % bc:
            raise ValueError(
                f"scale layout {self.name} needs blocks of {br}x{bc} to divide the tensor shape "
                f"{rows}x{cols}; pad the tensor or pick a layout whose block divides it"
            )
        return br, bc


TENSORWISE = ScaleLayout((-1, -1))
ROWWISE = ScaleLayout((1, -1))
GROUPS_1X128 = ScaleLayout((1, 128))
"""DeepSeek-V3 activation/gradient groups, the layout cuBLAS and the Triton kernels specialize."""
BLOCKS_128X128 = ScaleLayout((128, 128))
"""DeepSeek-V3 weight blocks."""
MX_1X32 = ScaleLayout((1, 32), power_of_two=True)
"""OCP MXFP8: 1×32 groups with power-of-two (E8M0) scales."""
MX_1X32_CEIL = ScaleLayout((1, 32), power_of_two=True, round_up=True)
"""MXFP8 1×32 groups with power-of-two scales rounded up (no saturation)."""
TRITON_GROUP_LAYOUTS = (GROUPS_1X128, MX_1X32, MX_1X32_CEIL, BLOCKS_128X128)
"""Layouts the Triton block quantizer (:mod:`mt_fp8.kernels.block_quantize`) writes."""


def fmt_mantissa(fmt: FP8Format) -> float:
    """The ``m`` of ``fmt.max = m · 2^e`` with ``m`` in [0.5, 1) (0.875 for E4M3 and E5M2)."""
    return math.frexp(fmt.max)[0]


MIN_SCALE = 2.0**-126
"""Smallest dequantization scale: the smallest normal fp32, so FTZ hardware keeps it nonzero."""


def scale_from_amax(
    amax: torch.Tensor,
    fmt: FP8Format | torch.Tensor,
    power_of_two: bool = False,
    margin: int = 0,
    round_up: bool = False,
) -> torch.Tensor:
    """Dequantization scales (fp32) from amaxes, with the edge cases of the module docstring.

    ``fmt`` is the format, or a tensor of format maxima broadcasting against ``amax`` (one per
    role, for the delayed-scaling update). ``margin`` (delayed scaling) multiplies the scale by
    ``2^margin``; the result is capped at the largest finite fp32 so it cannot overflow to inf.
    ``round_up`` (power-of-two only): ``2^ceil(log2(amax / fmt.max))`` of the exact quotient, see
    :class:`ScaleLayout`.
    """
    amax = amax.float()
    finite = torch.isfinite(amax)
    if power_of_two:
        if not isinstance(fmt, FP8Format):
            raise TypeError("power-of-two scales need an FP8Format")
        # OCP MX spec: shared exponent = floor(log2(amax)) - emax_elem, within E8M0's range but
        # not below 2^-126 (normal fp32; see MIN_SCALE).
        # floor(log2(safe)) exactly: frexp gives safe = m · 2^e with m in [0.5, 1). (A rounded
        # log2 reaches the next integer for values just below a large power of two.)
        safe = torch.where(finite, amax, torch.ones_like(amax)).clamp_min(MIN_SCALE)
        mantissa, exponent_int = torch.frexp(safe)
        exponent = (exponent_int - 1).float() - fmt.emax
        if round_up:
            # With amax = m · 2^e and fmt.max = m_max · 2^emax (m, m_max in [0.5, 1)), the
            # smallest k with 2^k · fmt.max >= amax is e - emax, plus one when m > m_max:
            # exact, without dividing (a quotient below 2^-126 would be subnormal, which GPU
            # kernels flush to zero).
            exponent = exponent + (mantissa > fmt_mantissa(fmt)).float()
        scale = torch.exp2(exponent.clamp(-126.0, 127.0))
    else:
        fmt_max = (
            torch.full_like(amax, fmt.max)
            if isinstance(fmt, FP8Format)
            else fmt.to(amax.device, torch.float32).expand_as(amax)
        )
        # NOTE: divide by a tensor, not a Python number: PyTorch's CUDA division by a scalar
        # multiplies by its rounded reciprocal, which is neither IEEE-exact nor guaranteed to
        # stay >= 2^-126 at the floor. fmt.max * 2^-126 divides to exactly 2^-126.
        scale = amax.clamp_min(fmt_max * MIN_SCALE) / fmt_max
    if margin:
        scale = (scale * 2.0**margin).clamp_max(torch.finfo(torch.float32).max)
    scale = torch.where(amax > 0, scale.clamp_min(MIN_SCALE), torch.ones_like(scale))
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


def reduce_amax_(amax: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """MAX-reduce fp32 ``amax`` in place over ``group``; NaN travels as ``+inf``."""
    amax.copy_(torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax))
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def block_amax(x_RC: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |x| per block, as a ``(G, H)`` fp32 tensor (``block`` already resolved)."""
    rows, cols = x_RC.shape
    br, bc = block
    blocks = x_RC.reshape(rows // br, br, cols // bc, bc)
    return blocks.abs().amax(dim=(1, 3)).float()


def cast_to_fp8(
    x_RC: torch.Tensor, scale_GH: torch.Tensor, fmt: FP8Format, stats: torch.Tensor | None = None
) -> torch.Tensor:
    """``sat(rne(x · RN(1 / s)))`` per block (``x / s`` for fp64 inputs; module docstring): the
    scaled values are clamped before the (saturating) cast.

    ``stats`` (int64, 3 elements), if given, is incremented in place by the counts of values
    clipped at ``fmt.max`` (``>= fmt.saturation_threshold``), nonzero values flushed to zero and all values (numerics health).
    """
    rows, cols = x_RC.shape
    groups, hgroups = scale_GH.shape
    br, bc = rows // groups, cols // hgroups
    # fp64 inputs stay fp64 so that the only rounding is the FP8 cast (no double rounding).
    work = x_RC.double() if x_RC.dtype == torch.float64 else x_RC.float()
    blocks = work.reshape(groups, br, hgroups, bc)
    if work.dtype == torch.float64:
        scaled = blocks / scale_GH[:, None, :, None].double()
    else:
        scaled = blocks * torch.reciprocal(scale_GH.float())[:, None, :, None]
    if stats is not None:
        magnitude = scaled.abs()
        stats[0] += (magnitude >= fmt.saturation_threshold).sum()
        stats[1] += ((magnitude < fmt.min_subnormal / 2) & (magnitude > 0)).sum()
        stats[2] += magnitude.numel()
    return scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(rows, cols)


@dataclass
class QuantizedTensor:
    """FP8 ``data`` (R, C) with fp32 dequantization ``scale`` (G, H): ``x ≈ data · scale``."""

    data: torch.Tensor
    """The FP8 payload, contiguous, shape (R, C)."""
    scale: torch.Tensor
    """fp32 dequantization scales, one per block, shape (R / br, C / bc)."""
    layout: ScaleLayout
    """How blocks tile the tensor."""
    fmt: FP8Format
    """The FP8 format of ``data``."""
    transposed: QuantizedTensor | None = None
    """``xᵀ`` quantized along R for the other GEMM, when a fused kernel produced it alongside.

    For tensorwise scales and square blocks, the exact transpose (returned by ``transpose()``);
    for 1×g groups, ``xᵀ`` requantized in 1×g groups along R with R zero-padded to a multiple
    of g, shape ``(C, R')`` (:mod:`mt_fp8.kernels.block_quantize`).
    """

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def block(self) -> tuple[int, int]:
        rows, cols = self.data.shape
        return rows // self.scale.shape[0], cols // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data · scale`` per block, in fp32 (fp64 if asked: then exact for any scale)."""
        rows, cols = self.data.shape
        groups, hgroups = self.scale.shape
        br, bc = self.block
        work = torch.float64 if dtype == torch.float64 else torch.float32
        scale = self.scale.to(work)[:, None, :, None]
        values = self.data.to(work).reshape(groups, br, hgroups, bc) * scale
        return values.reshape(rows, cols).to(dtype)

    def transpose(self) -> QuantizedTensor:
        """The exact transpose ``(C, R)``, for layouts whose blocks transpose into blocks.

        Tensorwise scales and square blocks (128×128) transpose exactly. Row-oriented layouts
        (rowwise, 1×128, MX 1×32) do not: the transposed tensor needs scales along the other
        axis, so requantize from the high-precision source with :func:`quantize` on ``x.t()``.
        """
        br, bc = self.layout.block
        exact = (br, bc) == (-1, -1) or (br == bc and br > 0)
        if not exact:
            raise ValueError(
                f"layout {self.layout.name} cannot be transposed exactly (its scales run along "
                "one axis only); quantize the high-precision tensor's transpose instead"
            )
        if self.transposed is not None:
            return self.transposed
        # FP8 tensors support no arithmetic, but transpose + contiguous is a plain copy.
        data_CR = self.data.t().contiguous()
        return QuantizedTensor(data_CR, self.scale.t().contiguous(), self.layout, self.fmt)


def quantize(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    layout: ScaleLayout = TENSORWISE,
    scale: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> QuantizedTensor:
    """Quantize a 2-D float tensor along its columns with ``layout``.

    ``scale`` (optional, shape ``(G, H)`` or a scalar) supplies precomputed dequantization
    scales, as delayed scaling does; values beyond ``fmt.max · scale`` then saturate.
    ``stats`` accumulates health counts (see :func:`cast_to_fp8`). ``amax_group`` (tensorwise
    layout, computed scale only) MAX-reduces the amax over that process group first, so that a
    tensor sharded over the group's ranks gets one scale (module docstring).
    """
    if x_RC.dim() != 2:
        raise ValueError(
            f"quantize expects a 2-D (rows, columns) tensor, got shape {tuple(x_RC.shape)}"
        )
    if not x_RC.is_floating_point() or x_RC.element_size() == 1:
        raise ValueError(
            f"quantize expects a float32, float16, bfloat16 or float64 tensor, got {x_RC.dtype}"
        )
    # NOTE: a transposed view would otherwise give column-major FP8 data (elementwise ops keep
    # the input's layout), which cuBLAS rejects; the invariant is row-major data.
    if amax_group is not None and (layout != TENSORWISE or scale is not None):
        raise ValueError(
            "amax_group reduces the amax of current tensorwise scaling; got layout "
            f"{layout.name}{' and a given scale' if scale is not None else ''}"
        )
    x_RC = x_RC.contiguous()
    block = layout.resolve((x_RC.shape[0], x_RC.shape[1]))
    groups, hgroups = x_RC.shape[0] // block[0], x_RC.shape[1] // block[1]
    if scale is None:
        amax_GH = block_amax(x_RC, block)
        if amax_group is not None:
            reduce_amax_(amax_GH, amax_group)
        scale_GH = scale_from_amax(amax_GH, fmt, layout.power_of_two, round_up=layout.round_up)
    else:
        scale_GH = (
            scale.float().reshape(-1, 1).expand(groups, hgroups)
            if scale.numel() == 1
            else scale.float()
        )
        if scale_GH.shape != (groups, hgroups):
            raise ValueError(
                f"scale of shape {tuple(scale.shape)} does not match layout {layout.name} on a "
                f"{x_RC.shape[0]}x{x_RC.shape[1]} tensor (expected {groups}x{hgroups})"
            )
        # A fresh allocation: a view into a buffer (delayed scaling's per-role scales) can sit at
        # an offset cuBLAS refuses for its scale pointers (CUBLAS_STATUS_NOT_SUPPORTED on H200).
        scale_GH = scale_GH.clone(memory_format=torch.contiguous_format)
    return QuantizedTensor(cast_to_fp8(x_RC, scale_GH, fmt, stats), scale_GH, layout, fmt)
