"""Triton quantize + transpose + amax (contract in :mod:`mt_fp8.ops.quantize_transpose`).

Each program loads one ``TILE × TILE`` tile of ``x``, scales, clamps and casts it, stores it to
``q`` and (bf16 inputs) its transpose (``tl.trans`` of the tile, stored row-major) to ``qᵀ``, and
writes the tile's amax (and int32 health counts: saturated, flushed) to its own slot of a
per-tile partials buffer; one single-program kernel (``_add_stats``) adds their sums and the
element count to the caller's int64 counters. With no
scale given, a first launch of the same kernel with ``WRITE=False`` only produces the amax
partials; then one single-program kernel (``_amax_to_scale``) folds them (max) and computes the
scale exactly as :func:`mt_fp8.quantized.scale_from_amax` does (``max(amax, fmt_max·2^-126) /
fmt_max`` with an IEEE division, at least ``2^-126``, 1 for a zero amax, NaN for a non-finite
one), in one launch instead of a dozen elementwise PyTorch ops. With an amax group the partials
are folded in PyTorch, all-reduced, and :func:`~mt_fp8.quantized.scale_from_amax` runs.

NOTE: per-tile partials rather than atomics on one global accumulator: an 8192×14336 gradient
has 28,672 tiles, and same-address atomics serialize in L2 (profile of the 8-layer Llama3-8B
step on the H200, 2026-12-02: 224 launches took 16.7 ms, about 45% of the copy bandwidth their
bytes need).

NOTE: for inputs other than bf16 the transposed tile is moved as int32 FP8 codes. On the H200
(Triton 3.6.0, 2026-12-02) a transposed store of the FP8 tile itself was wrong for fp32 inputs:
about a quarter of ``qᵀ``'s bytes (whole rows) held garbage, including NaN and inf encodings,
while ``q`` was bit-exact. The compiled IR shows the difference: with fp32 ``x`` Triton moves
the FP8 tile through an 8-bit shared-memory layout conversion (``ttg.convert_layout`` on
``f8E4M3FN``); with bf16 ``x`` it converts the 16-bit input instead, and ``qᵀ`` was bit-exact
for every shape tested. Garbage in the saved ``xᵀ`` and ``wᵀ`` made the gradients of FP8 layers
with fp32 weights or inputs NaN while their outputs stayed right. So for fp32 (and fp16) the
kernel computes the FP8 bit patterns in integer arithmetic (``_fp8_codes``, round to nearest
even as the hardware cast), transposes the int32 tile and narrows it at the store: bit-exact on
the H200 (2026-12-03, 14336×4096 and 4096×14336 fp32, 94.7 µs against 91.7 µs for the wrong
FP8-tile version). It replaced PyTorch's FP8 transpose copy, which ran at 344 GB/s
(341 µs for a 14336×4096 weight; 10.1 ms of the 8-layer Llama3-8B FP8 step, fp32 weights).

Bit-exactness with the PyTorch path (:func:`mt_fp8.quantized.quantize`):

* Values are scaled as ``x · s⁻¹`` with ``s⁻¹ = RN(1 / s)``, the inverse scale (one IEEE
  division per scale; :func:`mt_fp8.quantized.cast_to_fp8` defines it so): the product is
  ``mul.rn.f32`` and the division ``div.rn.f32`` (inline PTX), IEEE round-to-nearest with
  subnormals kept. Triton's ``/`` lowers to ``div.full.f32`` (an approximation within 2 ulp, so
  values next to an FP8 rounding boundary can land on the other side), and ``tl.div_rn`` calls
  libdevice's ``__nv_fdiv_rn``, which Triton links flush-to-zero. Under ``TRITON_INTERPRET=1``
  (numpy) the plain operators are already IEEE. NOTE: a division per element, ``x / s``, held
  the bf16 write pass at 195 µs for an 8192×14336 gradient (2.4 TB/s on the H200, 2026-12-03);
  the approximate division took 130 µs.
* The clamp propagates NaN (``PropagateNan.ALL``) as ``torch.clamp`` does; without it the
  ``min.xorsign.abs`` clamp Triton emits on Hopper turns NaN into ``±fmt.max``.
* The amax counts NaN as ``+inf`` (Triton's float ``max`` and ``atomic_max`` skip NaN), so a NaN
  anywhere makes the scale NaN, as on the PyTorch path.
* The fp32 → FP8 cast is ``cvt.rn.satfinite`` on sm_90, round-to-nearest-even like PyTorch's.
  Under ``TRITON_INTERPRET=1`` it is done in integer arithmetic (``_fp8_codes``): Triton 3.6's
  interpreter rounds FP8 casts half-up without carrying into the exponent (127.0 → 64 in E4M3)
  and flushes FP8 subnormals.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from mt_fp8.formats import FP8Format
from mt_fp8.quantized import MIN_SCALE, reduce_amax_, scale_from_amax

TILE = 64


def fp8_exponent_bias(fmt: FP8Format) -> int:
    """The format's exponent bias (7 for E4M3, 15 for E5M2): min normal = 2^(1 - bias)."""
    return 1 - round(math.log2(fmt.min_normal))


def cast_arguments(fmt: FP8Format) -> dict[str, Any]:
    """The format constants and interpreter switches every FP8-casting kernel here takes."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return dict(
        fmt_max=fmt.max,
        saturation=fmt.saturation_threshold,
        half_subnormal=fmt.min_subnormal / 2,
        MANTISSA=fmt.mantissa_bits,
        BIAS=fp8_exponent_bias(fmt),
        EXACT_DIV=not interpreting,
        SOFTWARE_CAST=interpreting,
    )


@triton.jit
def _div_rn(x, y, EXACT_DIV: tl.constexpr):
    """IEEE round-to-nearest ``x / y`` in fp32, subnormals included (module docstring)."""
    if EXACT_DIV:
        return tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;",
            "=f,f,f",
            [x, y],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        return x / y


@triton.jit
def _scale_from_amax(amax, fmt_max, min_scale, EXACT_DIV: tl.constexpr):
    """:func:`mt_fp8.quantized.scale_from_amax` elementwise; ``amax`` holds no NaN (NaN → inf)."""
    # fmt.max · 2^-126 is exact in fp32 (448 and 57344 have 3-bit significands).
    floor = tl.maximum(amax, fmt_max * min_scale)
    scale = tl.maximum(_div_rn(floor, tl.zeros_like(amax) + fmt_max, EXACT_DIV), min_scale)
    scale = tl.where(amax > 0, scale, 1.0)
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _mul_rn(x, y, EXACT_DIV: tl.constexpr):
    """IEEE round-to-nearest ``x · y`` in fp32, subnormals kept (``mul.rn.f32``: never fused
    into an FMA, never flushed to zero), as PyTorch multiplies."""
    if EXACT_DIV:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;",
            "=f,f,f",
            [x, y],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        return x * y


@triton.jit
def _reciprocal(scale, EXACT_DIV: tl.constexpr):
    """``RN(1 / s)``, the inverse scale the quantizers multiply by (one per scale)."""
    return _div_rn(tl.zeros_like(scale) + 1.0, scale, EXACT_DIV)


@triton.jit
def _fp8_codes(clamped, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 bit pattern (int32 in 0..255) of ``clamped`` (|v| <= fmt.max or NaN), rounded to
    nearest even, in integer arithmetic.

    With e the exponent of |v| (at least the format's minimum normal exponent 1 - BIAS),
    ulp = 2^(e - MANTISSA) and n = rne(|v| / ulp) in [0, 2^(MANTISSA+1)]; the code
    ((e + BIAS - 1) << MANTISSA) + n covers normals, subnormals (e + BIAS - 1 = 0) and the carry
    into the next binade. NaN gives 0x7F with its sign.
    """
    bits = clamped.to(tl.int32, bitcast=True)
    magnitude = tl.where(clamped != clamped, 0.0, tl.abs(clamped))
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, 1 - BIAS)
    inverse_ulp = ((127 - exponent + MANTISSA) << 23).to(tl.float32, bitcast=True)
    # NOTE: |v| · 2^-(e - MANTISSA) is exact (a power of two); (t + 2^23) - 2^23 then rounds
    # 0 <= t < 2^23 to an integer, ties to even (IEEE adds).
    units = (magnitude * inverse_ulp + 8388608.0) - 8388608.0
    code = ((exponent + BIAS - 1) << MANTISSA) + units.to(tl.int32)
    return tl.where(clamped != clamped, 0x7F, code) | ((bits >> 24) & 0x80)


@triton.jit
def _store_fp8(
    ptr, clamped, mask, MANTISSA: tl.constexpr, BIAS: tl.constexpr, SOFTWARE_CAST: tl.constexpr
):
    """Store ``clamped`` (|v| <= fmt.max or NaN) rounded to nearest even into FP8 ``ptr``."""
    if SOFTWARE_CAST:
        # Triton's interpreter rounds FP8 casts wrongly (module docstring): RNE by hand.
        code = _fp8_codes(clamped, MANTISSA, BIAS)
        tl.store(ptr, code.to(tl.uint8).to(ptr.dtype.element_ty, bitcast=True), mask=mask)
    else:
        tl.store(ptr, clamped.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_transpose(
    x_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    amax_partial_ptr,
    stats_partial_ptr,
    R,
    C,
    fmt_max,
    saturation,
    half_subnormal,
    WRITE: tl.constexpr,
    WRITE_T: tl.constexpr,
    TRANSPOSE_CODES: tl.constexpr,
    AMAX: tl.constexpr,
    STATS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TILE: tl.constexpr,
):
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        magnitude_x = tl.where(x != x, float("inf"), tl.abs(x))
        tl.store(amax_partial_ptr + tile, tl.max(tl.max(magnitude_x, axis=1), axis=0))
    if WRITE:
        inverse_scale = tl.broadcast_to(_reciprocal(tl.load(scale_ptr), EXACT_DIV), (TILE, TILE))
        scaled = _mul_rn(x, inverse_scale, EXACT_DIV)
        if STATS:
            # int32 tile counts (at most TILE² each); masked-out elements are 0 and count as
            # neither. The element count is the caller's (rows · cols).
            magnitude = tl.abs(scaled)
            saturated = tl.sum(tl.sum((magnitude >= saturation).to(tl.int32), axis=1), axis=0)
            flushed = tl.sum(
                tl.sum(((magnitude < half_subnormal) & (magnitude > 0)).to(tl.int32), axis=1),
                axis=0,
            )
            tl.store(stats_partial_ptr + 2 * tile, saturated)
            tl.store(stats_partial_ptr + 2 * tile + 1, flushed)
        clamped = tl.clamp(scaled, -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL)
        _store_fp8(q_ptr + offs, clamped, mask, MANTISSA, BIAS, SOFTWARE_CAST)
        if WRITE_T:
            # The transposed tile, stored with its own contiguous axis last: qᵀ[c, r] = q[r, c].
            offs_t = cols.to(tl.int64)[:, None] * R + rows[None, :]
            mask_t = (cols[:, None] < C) & (rows[None, :] < R)
            if TRANSPOSE_CODES:
                # int32 codes transposed (see the NOTE in the module docstring), then narrowed.
                codes_t = tl.trans(_fp8_codes(clamped, MANTISSA, BIAS))
                tl.store(
                    qt_ptr + offs_t,
                    codes_t.to(tl.uint8).to(qt_ptr.dtype.element_ty, bitcast=True),
                    mask=mask_t,
                )
            else:
                _store_fp8(
                    qt_ptr + offs_t, tl.trans(clamped), mask_t, MANTISSA, BIAS, SOFTWARE_CAST
                )


@triton.jit
def _amax_to_scale(
    amax_partial_ptr,
    tiles,
    amax_ptr,
    scale_ptr,
    fmt_max,
    min_scale,
    EXACT_DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: ``amax = max(partials)`` and its scale (module docstring)."""
    offs = tl.arange(0, BLOCK)
    running = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, tiles, BLOCK):
        # Partials are >= 0, with NaN already recorded as +inf: a plain max is exact.
        part = tl.load(amax_partial_ptr + start + offs, mask=start + offs < tiles, other=0.0)
        running = tl.maximum(running, part)
    amax = tl.max(running, axis=0)
    tl.store(amax_ptr, amax)
    tl.store(scale_ptr, _scale_from_amax(amax, fmt_max, min_scale, EXACT_DIV))


@triton.jit
def _add_stats(stats_partial_ptr, tiles, stats_ptr, numel, BLOCK: tl.constexpr):
    """One program: ``stats += (Σ saturated, Σ flushed, numel)`` over the per-tile partials."""
    offs = tl.arange(0, BLOCK)
    saturated = tl.zeros([BLOCK], dtype=tl.int64)
    flushed = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, tiles, BLOCK):
        mask = start + offs < tiles
        saturated += tl.load(stats_partial_ptr + 2 * (start + offs), mask=mask, other=0)
        flushed += tl.load(stats_partial_ptr + 2 * (start + offs) + 1, mask=mask, other=0)
    tl.store(stats_ptr, tl.load(stats_ptr) + tl.sum(saturated, axis=0))
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + tl.sum(flushed, axis=0))
    tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + numel)


def quantize_transpose_amax_triton(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    scale: torch.Tensor | None,
    stats: torch.Tensor | None,
    amax_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_RC, q_CR, scale (1, 1) fp32, amax)``."""
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
    tiles = grid[0] * grid[1]
    # An empty x has no tiles: one zero partial makes its amax 0.
    amax_partial = (torch.empty if tiles else torch.zeros)(
        max(tiles, 1), device=x_RC.device, dtype=torch.float32
    )
    q_RC = torch.empty(rows, cols, device=x_RC.device, dtype=fmt.dtype)
    q_CR = torch.empty(cols, rows, device=x_RC.device, dtype=fmt.dtype)
    # See the NOTE in the module docstring: only bf16 tiles were seen transposed right as FP8.
    common = dict(cast_arguments(fmt), TILE=TILE, TRANSPOSE_CODES=x_RC.dtype != torch.bfloat16)
    given_scale = scale is not None
    if not given_scale:
        _quantize_transpose[grid](
            x_RC,
            q_RC,
            q_CR,
            amax_partial,
            amax_partial,
            amax_partial,
            rows,
            cols,
            WRITE=False,
            WRITE_T=False,
            AMAX=True,
            STATS=False,
            **common,
        )
        if amax_group is not None:
            amax = amax_partial.amax()
            reduce_amax_(amax, amax_group)
            scale_11 = scale_from_amax(amax, fmt).reshape(1, 1)
        else:
            amax = torch.empty((), device=x_RC.device, dtype=torch.float32)
            scale_11 = torch.empty(1, 1, device=x_RC.device, dtype=torch.float32)
            _amax_to_scale[(1,)](
                amax_partial,
                tiles,
                amax,
                scale_11,
                fmt.max,
                MIN_SCALE,
                EXACT_DIV=common["EXACT_DIV"],
                BLOCK=1024,
            )
    else:
        scale_11 = scale.float().reshape(1, 1).clone()  # own allocation: cuBLAS scale alignment
    stats_partial = (
        torch.empty(tiles, 2, device=x_RC.device, dtype=torch.int32)
        if stats is not None
        else amax_partial
    )
    _quantize_transpose[grid](
        x_RC,
        q_RC,
        q_CR,
        scale_11,
        amax_partial,
        stats_partial,
        rows,
        cols,
        WRITE=True,
        WRITE_T=True,
        AMAX=given_scale,  # with a computed scale the first launch already has the amax
        STATS=stats is not None,
        **common,
    )
    if given_scale:
        amax = amax_partial.amax()
    if stats is not None and tiles:
        _add_stats[(1,)](stats_partial, tiles, stats, rows * cols, BLOCK=1024)
    return q_RC, q_CR, scale_11, amax
