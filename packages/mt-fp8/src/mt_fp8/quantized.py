"""The quantized-tensor representation: FP8 data, scales, a block layout and a format.

Math. A 2-D high-precision tensor ``x_RC`` (R rows, C columns; C is always the GEMM contraction
axis) is cut into blocks of ``br × bc`` elements. Each block ``b`` gets one fp32 *dequantization*
scale ``s_b`` and FP8 data ``q = sat(rne(x / s_b))`` so that ``x ≈ q · s_b``:

    amax_b = max |x| over block b                 (computed in high precision, before the cast)
    s_b    = amax_b / fmt.max                     (``amax_b == 0`` → ``s_b = 1``)
    s_b    = 2^(floor(log2 amax_b) - fmt.emax)    (power-of-two layouts: MXFP8's E8M0 scales)

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mt_fp8.formats import FP8Format

# Shape suffixes: R rows, C columns (contraction axis), G = R / br, H = C / bc.


@dataclass(frozen=True)
class ScaleLayout:
    """Blocks sharing one scale, as (rows, columns); -1 spans the whole axis."""

    block: tuple[int, int]
    """Block shape (rows, columns); -1 means the whole axis."""
    power_of_two: bool = False
    """Round scales up to a power of two (MXFP8's E8M0 shared exponents)."""

    def __post_init__(self) -> None:
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
        return f"{'mx' if self.power_of_two else 'block'}{br if br > 0 else 'R'}x{bc if bc > 0 else 'C'}"

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


def _scale_from_amax(amax: torch.Tensor, fmt: FP8Format, power_of_two: bool) -> torch.Tensor:
    """Dequantization scales (fp32) from block amaxes; zero blocks get scale 1."""
    amax = amax.float()
    if power_of_two:
        # OCP MX spec: shared exponent = floor(log2(amax)) - emax_elem, clamped to E8M0's range.
        exponent = torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - fmt.emax
        scale = torch.exp2(exponent.clamp(-127.0, 127.0))
    else:
        scale = amax / fmt.max
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def block_amax(x_RC: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |x| per block, as a ``(G, H)`` fp32 tensor (``block`` already resolved)."""
    rows, cols = x_RC.shape
    br, bc = block
    blocks = x_RC.reshape(rows // br, br, cols // bc, bc)
    return blocks.abs().amax(dim=(1, 3)).float()


def cast_to_fp8(
    x_RC: torch.Tensor, scale_GH: torch.Tensor, fmt: FP8Format, stats: torch.Tensor | None = None
) -> torch.Tensor:
    """``sat(rne(x / s))`` per block: the scaled values are clamped before the (saturating) cast.

    ``stats`` (int64, 3 elements), if given, is incremented in place by the counts of values
    clipped at ``fmt.max`` (``>= fmt.saturation_threshold``), nonzero values flushed to zero and all values (numerics health).
    """
    rows, cols = x_RC.shape
    groups, hgroups = scale_GH.shape
    br, bc = rows // groups, cols // hgroups
    # fp64 inputs stay fp64 so that the only rounding is the FP8 cast (no double rounding).
    work = x_RC.double() if x_RC.dtype == torch.float64 else x_RC.float()
    scaled = work.reshape(groups, br, hgroups, bc) / scale_GH[:, None, :, None].to(work.dtype)
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
    """The transpose, when a fused kernel produced it alongside (returned by ``transpose()``)."""

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
        if self.transposed is not None:
            return self.transposed
        br, bc = self.layout.block
        exact = (br, bc) == (-1, -1) or (br == bc and br > 0)
        if not exact:
            raise ValueError(
                f"layout {self.layout.name} cannot be transposed exactly (its scales run along "
                "one axis only); quantize the high-precision tensor's transpose instead"
            )
        # FP8 tensors support no arithmetic, but transpose + contiguous is a plain copy.
        data_CR = self.data.t().contiguous()
        return QuantizedTensor(data_CR, self.scale.t().contiguous(), self.layout, self.fmt)


def quantize(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    layout: ScaleLayout = TENSORWISE,
    scale: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize a 2-D float tensor along its columns with ``layout``.

    ``scale`` (optional, shape ``(G, H)`` or a scalar) supplies precomputed dequantization
    scales, as delayed scaling does; values beyond ``fmt.max · scale`` then saturate.
    ``stats`` accumulates health counts (see :func:`cast_to_fp8`).
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
    x_RC = x_RC.contiguous()
    block = layout.resolve((x_RC.shape[0], x_RC.shape[1]))
    groups, hgroups = x_RC.shape[0] // block[0], x_RC.shape[1] // block[1]
    if scale is None:
        scale_GH = _scale_from_amax(block_amax(x_RC, block), fmt, layout.power_of_two)
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
