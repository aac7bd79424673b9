"""Triton group quantization: DeepSeek-V3 block scaling (1×128 groups + the transposed operand,
128×128 weight blocks) and MXFP8 (1×32 groups with power-of-two scales + the transposed
operand), bit-identical to :func:`mt_fp8.quantized.quantize`.

Shape suffixes: R rows, C columns (C % 128 == 0), g the group length (128 or 32), R' = R rounded
up to a multiple of g, H = C / g, G = R' / g.

:func:`quantize_groups_with_transpose` writes both operands the linear layer needs from ``x_RC``
(see :mod:`mt_fp8.linear_plan`):

* ``q_RC`` in 1×g groups along C, scales ``s_RH``: the forward (or dgrad) operand;
* ``q_CR'``: ``xᵀ`` with R zero-padded to R', in 1×g groups along R', scales ``s_CG``: the
  wgrad operand, which contracts over the tokens R.

    s_RH[r, h] = scale_from_amax(max_{c in group h} |x[r, c]|)    q_RC[r, c]  = sat(rne(x · s_RH⁻¹))
    s_CG[c, k] = scale_from_amax(max_{r in group k} |x[r, c]|)    q_CR'[c, r] = sat(rne(x · s_CG⁻¹))

Two kernels, each one read of ``x``: ``_group_rows`` owns ``ROWS_TILE`` (64 rows × 128 columns,
whole row groups) and ``_group_columns`` owns ``COLUMNS_TILE`` (128 rows × 64 columns, whole
column groups, stored transposed). Rows past R read as zero: padded rows add nothing to a column
amax and quantize to zero, as the PyTorch path's ``F.pad`` of ``xᵀ`` does; rows at or past R'
are not stored. NOTE: one kernel on 128×128 tiles that wrote both operands from one read was
slower than the two: holding the whole tile and both scalings left too few programs per SM to
hide the memory latency (docs/benchmarks-log.md). :func:`quantize_group_columns` launches
``_group_columns`` alone, for a caller that has the rows already (the grouped block GEMM's
wgrad operands, whose tokens are padded per expert first: :mod:`mt_fp8.grouped_block`).

:func:`quantize_square_blocks` owns one 128×128 tile per program with one amax per tile (128×128
weight blocks); a square-block tensor's transpose is exact
(:meth:`mt_fp8.quantized.QuantizedTensor.transpose`), so with ``transpose`` the pass also
stores the tile's bytes transposed into ``q_CR`` and its scale at ``s_HG[c, r]`` (the bytes and
scales ``transpose()`` would copy, without a second pass over the FP8 weight). A stack of
``m`` matrices of ``R/m`` rows each (an MoE layer's ``(E·N, K)`` expert weights) gets each
matrix's own transpose instead, side by side: ``q_CR`` is ``(m·C, R/m)`` with
``q_CR[i·C + c, r] = q[i·R/m + r, c]`` and its scales ``(m·C/128, R/(128·m))`` likewise; with
128 dividing ``R/m`` no tile straddles two matrices (a strided FP8 copy of the stack, the
alternative, moves one byte per element at a fraction of copy bandwidth).

Bit-exactness with :func:`mt_fp8.quantized.scale_from_amax` and :func:`~mt_fp8.quantized.quantize`,
by the means of :mod:`mt_fp8.kernels.quantize` (whose ``_reciprocal``, ``_mul_rn`` and
``_store_fp8`` this reuses):

* ``s = max(amax, fmt.max · 2^-126) / fmt.max`` divides with ``div.rn.f32`` (IEEE), then
  ``max(s, 2^-126)``; ``amax == 0`` gives ``s = 1``; ``amax = inf`` gives ``s = NaN``. MX
  scales ``2^clamp(floor(log2 amax) - emax, -126, 127)`` take ``floor(log2 amax)`` from the
  exponent bits of ``max(amax, 2^-126)`` (exact, as the PyTorch path's ``frexp``). The amax
  counts NaN as ``+inf`` (Triton's ``max`` skips NaN), which is non-finite as NaN is, so a group
  holding NaN gets a NaN scale as on the PyTorch path.
* ``x · s⁻¹`` with ``s⁻¹ = RN(1 / s)`` (one ``div.rn.f32`` per group, ``mul.rn.f32`` per
  element), the clamp propagates NaN, the cast rounds to nearest even (in
  integer arithmetic under ``TRITON_INTERPRET=1``, whose own FP8 cast is wrong).
* Health counts (``stats``) cover ``q_RC`` only, as :func:`~mt_fp8.quantized.cast_to_fp8` does.

NOTE: the transposed store of ``_group_columns`` (``tl.trans`` of the FP8 tile) is used for bf16
inputs only, for the reason in :mod:`mt_fp8.kernels.quantize` (fp32 inputs gave garbage ``qᵀ``
bytes on the H200 there). Other input dtypes store the column-scaled tile untransposed into an
``(R', C)`` buffer, and PyTorch's FP8 transpose copy makes ``q_CR'`` from it. The square-block
transpose transposes int32 FP8 codes instead (as that module's fp32 path does), for any input
dtype: those are the fp32 master weights.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mt_fp8.formats import FP8Format
from mt_fp8.kernels.quantize import (
    _fp8_codes,
    _mul_rn,
    _reciprocal,
    _scale_from_amax,
    _store_fp8,
    cast_arguments,
)
from mt_fp8.quantized import (
    BLOCKS_128X128,
    GROUPS_1X128,
    MIN_SCALE,
    TRITON_GROUP_LAYOUTS,
    QuantizedTensor,
    ScaleLayout,
)

TILE = 128
"""Side of the square weight blocks (one program each) and the tiles' widest side."""

ROWS_TILE = (64, 128, 4)
"""``_group_rows``: rows, columns and warps per program (the fastest of the tile sweep of
``benchmarks/block_quantize.py --sweep`` on the H200; docs/benchmarks-log.md)."""
COLUMNS_TILE = (128, 64, 4)
"""``_group_columns``: rows, columns and warps per program (the same sweep)."""


FUSED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the kernels take (fp64 inputs stay on the PyTorch path, which divides in fp64)."""

# Transposed-operand modes of the kernels (constexpr TRANSPOSE).
_NO_TRANSPOSE, _FUSED_TRANSPOSE, _BUFFERED_TRANSPOSE = 0, 1, 2


@triton.jit
def _pow2_scale_from_amax(amax, min_scale, EMAX: tl.constexpr, CEIL_MANTISSA: tl.constexpr):
    """:func:`mt_fp8.quantized.scale_from_amax` with ``power_of_two`` elementwise; ``amax`` holds
    no NaN (NaN → inf). ``floor(log2 a)`` of a normal fp32 ``a`` is its biased exponent field
    minus 127, exactly (the PyTorch path takes it from ``torch.frexp``). ``CEIL_MANTISSA`` >= 0
    rounds up: one more when ``a``'s mantissa field exceeds ``fmt.max``'s (that value), the
    PyTorch path's mantissa comparison in integers; -1 keeps the OCP floor."""
    finite = amax < float("inf")
    safe = tl.maximum(tl.where(finite, amax, 1.0), min_scale)
    bits = safe.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127 - EMAX
    if CEIL_MANTISSA >= 0:
        exponent += ((bits & 0x7FFFFF) > CEIL_MANTISSA).to(tl.int32)
    exponent = tl.minimum(tl.maximum(exponent, -126), 127)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, scale, 1.0)
    return tl.where(finite, scale, float("nan"))


@triton.jit
def _group_scales(
    amax,
    fmt_max,
    min_scale,
    EXACT_DIV: tl.constexpr,
    POW2: tl.constexpr,
    EMAX: tl.constexpr,
    CEIL_MANTISSA: tl.constexpr,
):
    if POW2:
        return _pow2_scale_from_amax(amax, min_scale, EMAX, CEIL_MANTISSA)
    return _scale_from_amax(amax, fmt_max, min_scale, EXACT_DIV)


@triton.jit
def _health_counts(scaled, stats_ptr, saturation, half_subnormal):
    """Add a tile's saturated and flushed counts to ``stats_ptr[0:2]`` (int32 tile counts, added
    to the int64 counters only when non-zero: saturation and flushes are rare, and same-address
    atomics serialize). Zeros (padded rows) count in neither."""
    magnitude = tl.abs(scaled)
    saturated = tl.sum(tl.sum((magnitude >= saturation).to(tl.int32), axis=1), axis=0)
    flushed = tl.sum(
        tl.sum(((magnitude < half_subnormal) & (magnitude > 0)).to(tl.int32), axis=1), axis=0
    )
    if saturated > 0:
        tl.atomic_add(stats_ptr, saturated.to(tl.int64))
    if flushed > 0:
        tl.atomic_add(stats_ptr + 1, flushed.to(tl.int64))


@triton.jit
def _group_rows(
    x_ptr,
    q_ptr,
    scale_ptr,
    stats_ptr,
    R,
    C,
    fmt_max,
    min_scale,
    saturation,
    half_subnormal,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    STATS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUP_LEN: tl.constexpr,
    POW2: tl.constexpr,
    EMAX: tl.constexpr,
    CEIL_MANTISSA: tl.constexpr,
):
    """``q_RC`` and ``s_RH`` of one BLOCK_R × BLOCK_C tile: its rows' 1×GROUP_LEN groups."""
    GROUPS: tl.constexpr = BLOCK_C // GROUP_LEN  # groups per tile row
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = rows < R
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    magnitude_x = tl.where(x != x, float("inf"), tl.abs(x))
    amax = tl.max(tl.reshape(magnitude_x, (BLOCK_R, GROUPS, GROUP_LEN)), axis=2)
    scale = _group_scales(amax, fmt_max, min_scale, EXACT_DIV, POW2, EMAX, CEIL_MANTISSA)
    group_ids = pid_c * GROUPS + tl.arange(0, GROUPS)
    scale_offs = rows.to(tl.int64)[:, None] * (C // GROUP_LEN) + group_ids[None, :]
    tl.store(scale_ptr + scale_offs, scale, mask=in_rows[:, None])
    inverse = tl.reshape(
        tl.broadcast_to(_reciprocal(scale, EXACT_DIV)[:, :, None], (BLOCK_R, GROUPS, GROUP_LEN)),
        (BLOCK_R, BLOCK_C),
    )
    scaled = _mul_rn(x, inverse, EXACT_DIV)
    if STATS:
        _health_counts(scaled, stats_ptr, saturation, half_subnormal)
    clamped = tl.clamp(scaled, -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL)
    _store_fp8(q_ptr + offs, clamped, in_rows[:, None], MANTISSA, BIAS, SOFTWARE_CAST)


@triton.jit
def _group_columns(
    x_ptr,
    qt_ptr,
    scale_t_ptr,
    R,
    C,
    R_padded,
    fmt_max,
    min_scale,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUP_LEN: tl.constexpr,
    POW2: tl.constexpr,
    EMAX: tl.constexpr,
    CEIL_MANTISSA: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """``q_CR'`` and ``s_CG`` of one BLOCK_R × BLOCK_C tile: its columns' GROUP_LEN×1 groups,
    stored transposed (TRANSPOSE == _FUSED_TRANSPOSE) or into the ``(R', C)`` buffer."""
    GROUPS: tl.constexpr = BLOCK_R // GROUP_LEN  # groups per tile column
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=(rows < R)[:, None], other=0.0).to(tl.float32)
    magnitude_x = tl.where(x != x, float("inf"), tl.abs(x))
    amax = tl.max(tl.reshape(magnitude_x, (GROUPS, GROUP_LEN, BLOCK_C)), axis=1)
    scale = _group_scales(amax, fmt_max, min_scale, EXACT_DIV, POW2, EMAX, CEIL_MANTISSA)
    group_ids = pid_r * GROUPS + tl.arange(0, GROUPS)
    groups_per_column = R_padded // GROUP_LEN
    scale_offs = cols.to(tl.int64)[None, :] * groups_per_column + group_ids[:, None]
    tl.store(scale_t_ptr + scale_offs, scale, mask=(group_ids < groups_per_column)[:, None])
    inverse = tl.reshape(
        tl.broadcast_to(_reciprocal(scale, EXACT_DIV)[:, None, :], (GROUPS, GROUP_LEN, BLOCK_C)),
        (BLOCK_R, BLOCK_C),
    )
    clamped = tl.clamp(
        _mul_rn(x, inverse, EXACT_DIV), -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL
    )
    in_padded = rows < R_padded
    if TRANSPOSE == 1:
        # qᵀ[c, r], stored with its own contiguous axis last; padded rows give zero columns.
        offs_t = cols.to(tl.int64)[:, None] * R_padded + rows[None, :]
        _store_fp8(
            qt_ptr + offs_t, tl.trans(clamped), in_padded[None, :], MANTISSA, BIAS, SOFTWARE_CAST
        )
    else:
        _store_fp8(qt_ptr + offs, clamped, in_padded[:, None], MANTISSA, BIAS, SOFTWARE_CAST)


@triton.jit
def _square_block_quantize(
    x_ptr,
    q_ptr,
    scale_ptr,
    qt_ptr,
    scale_t_ptr,
    stats_ptr,
    R,
    C,
    rows_per_matrix,
    fmt_max,
    min_scale,
    saturation,
    half_subnormal,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    STATS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TILE: tl.constexpr,
):
    """One TILE×TILE block of ``q`` with one scale and, with TRANSPOSE, its exact transpose
    within its matrix of ``rows_per_matrix`` rows (module docstring)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TILE + tl.arange(0, TILE)
    cols = pid_c * TILE + tl.arange(0, TILE)
    in_rows = rows < R
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    magnitude_x = tl.where(x != x, float("inf"), tl.abs(x))
    amax_block = tl.max(tl.max(magnitude_x, axis=1), axis=0)
    scale_rows = _scale_from_amax(
        tl.zeros((TILE,), tl.float32) + amax_block, fmt_max, min_scale, EXACT_DIV
    )
    # Every element of scale_rows is the block's scale; the first one is stored.
    first = tl.arange(0, TILE) == 0
    scale_offs = pid_r * (C // TILE) + pid_c + tl.arange(0, TILE) * 0
    tl.store(scale_ptr + scale_offs, scale_rows, mask=first)
    # The tile's matrix and its first row there (a tile never straddles two matrices).
    matrix = (pid_r * TILE) // rows_per_matrix
    tiles_per_matrix = rows_per_matrix // TILE
    if TRANSPOSE != 0:  # the exact transpose's scale: s_HG[matrix·C/T + pid_c, pid_r mod]
        scale_t_offs = (
            (matrix * (C // TILE) + pid_c) * tiles_per_matrix
            + (pid_r - matrix * tiles_per_matrix)
            + tl.arange(0, TILE) * 0
        )
        tl.store(scale_t_ptr + scale_t_offs, scale_rows, mask=first)
    inverse_full = tl.broadcast_to(_reciprocal(scale_rows, EXACT_DIV)[:, None], (TILE, TILE))
    scaled = _mul_rn(x, inverse_full, EXACT_DIV)
    if STATS:
        _health_counts(scaled, stats_ptr, saturation, half_subnormal)
    clamped = tl.clamp(scaled, -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL)
    _store_fp8(q_ptr + offs, clamped, in_rows[:, None], MANTISSA, BIAS, SOFTWARE_CAST)
    if TRANSPOSE != 0:
        # qᵀ[matrix·C + c, r'] = q[r, c] with r' = r − matrix·rows_per_matrix: int32 codes
        # transposed (module docstring NOTE), then narrowed.
        offs_t = (matrix.to(tl.int64) * C + cols.to(tl.int64))[:, None] * rows_per_matrix + (
            rows - matrix * rows_per_matrix
        )[None, :]
        codes_t = tl.trans(_fp8_codes(clamped, MANTISSA, BIAS))
        tl.store(
            qt_ptr + offs_t,
            codes_t.to(tl.uint8).to(qt_ptr.dtype.element_ty, bitcast=True),
            mask=in_rows[None, :],
        )


def _mantissa_field(value: float) -> int:
    """The 23 mantissa bits of fp32 ``value``."""
    return struct.unpack("<I", struct.pack("<f", value))[0] & 0x7FFFFF


def _check(x_RC: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    if x_RC.dim() != 2 or x_RC.dtype not in FUSED_INPUT_DTYPES:
        raise ValueError(
            "the Triton block quantizer takes a 2-D bfloat16, float16 or float32 tensor, got "
            f"{tuple(x_RC.shape)} {x_RC.dtype}"
        )
    if layout not in TRITON_GROUP_LAYOUTS:
        raise ValueError(
            f"the Triton block quantizer takes the layouts {[g.name for g in TRITON_GROUP_LAYOUTS]}, "
            f"got {layout.name}"
        )
    layout.resolve((x_RC.shape[0], x_RC.shape[1]))  # raises unless the group divides C
    if x_RC.shape[1] % TILE:
        raise ValueError(
            f"the Triton block quantizer needs columns divisible by its {TILE}-wide tile, got a "
            f"{x_RC.shape[0]}x{x_RC.shape[1]} tensor; use mt_fp8.quantize"
        )
    return x_RC.contiguous()


def _check_tiles(rows: int, cols: int, group: int, names: Sequence[str]) -> None:
    """Raise unless the named tiles cover whole groups of a ``rows × cols`` tensor."""
    tiles = {"ROWS_TILE": ROWS_TILE, "COLUMNS_TILE": COLUMNS_TILE}
    for name in names:
        block_r, block_c, _ = tiles[name]
        # The kernels mask rows, not columns, and own whole groups.
        group_side = block_c if name == "ROWS_TILE" else block_r
        if cols % block_c or group_side % group:
            raise ValueError(
                f"{name} = {(block_r, block_c)} does not fit a {rows}x{cols} tensor in 1x{group} "
                f"groups: the columns per tile must divide {cols} and the tile's "
                f"{'columns' if name == 'ROWS_TILE' else 'rows'} must be a multiple of {group}"
            )


def _launch_groups(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    stats: torch.Tensor | None,
    layout: ScaleLayout,
    transpose: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(q_RC, s_RH, q_t, s_CG)`` in 1×g groups; ``q_t`` is ``q_CR'``, or the ``(R', C)``
    buffer under _BUFFERED_TRANSPOSE, or None."""
    rows, cols = x_RC.shape
    group = layout.block[1]
    _check_tiles(rows, cols, group, ("ROWS_TILE", "COLUMNS_TILE"))
    q_RC = torch.empty(rows, cols, device=x_RC.device, dtype=fmt.dtype)
    scale_RH = torch.empty(rows, cols // group, device=x_RC.device, dtype=torch.float32)
    if rows:  # an empty launch grid is an error
        block_r, block_c, warps = ROWS_TILE
        _group_rows[(triton.cdiv(rows, block_r), cols // block_c)](
            x_RC,
            q_RC,
            scale_RH,
            stats if stats is not None else scale_RH,
            rows,
            cols,
            min_scale=MIN_SCALE,
            **cast_arguments(fmt),
            STATS=stats is not None,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            GROUP_LEN=group,
            POW2=layout.power_of_two,
            EMAX=fmt.emax,
            CEIL_MANTISSA=_ceil_mantissa(fmt, layout),
            num_warps=warps,
        )
    if stats is not None:
        stats[2] += x_RC.numel()
    if transpose == _NO_TRANSPOSE:
        return q_RC, scale_RH, None, None
    q_t, scale_CG = _launch_columns(x_RC, fmt, layout, transpose)
    return q_RC, scale_RH, q_t, scale_CG


def _ceil_mantissa(fmt: FP8Format, layout: ScaleLayout) -> int:
    return _mantissa_field(fmt.max) if layout.round_up else -1


def _launch_columns(
    x_RC: torch.Tensor, fmt: FP8Format, layout: ScaleLayout, transpose: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_t, s_CG)``: ``xᵀ`` in 1×g groups along the zero-padded R' (``q_t`` is ``q_CR'``, or
    the ``(R', C)`` buffer under _BUFFERED_TRANSPOSE); no health counts, as for every ``xᵀ``."""
    rows, cols = x_RC.shape
    group = layout.block[1]
    rows_padded = triton.cdiv(rows, group) * group
    shape_t = (cols, rows_padded) if transpose == _FUSED_TRANSPOSE else (rows_padded, cols)
    q_t = torch.empty(shape_t, device=x_RC.device, dtype=fmt.dtype)
    scale_CG = torch.empty(cols, rows_padded // group, device=x_RC.device, dtype=torch.float32)
    if rows:
        block_r, block_c, warps = COLUMNS_TILE
        constants = cast_arguments(fmt)
        del constants["saturation"], constants["half_subnormal"]
        _group_columns[(triton.cdiv(rows_padded, block_r), cols // block_c)](
            x_RC,
            q_t,
            scale_CG,
            rows,
            cols,
            rows_padded,
            min_scale=MIN_SCALE,
            **constants,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            GROUP_LEN=group,
            POW2=layout.power_of_two,
            EMAX=fmt.emax,
            CEIL_MANTISSA=_ceil_mantissa(fmt, layout),
            TRANSPOSE=transpose,
            num_warps=warps,
        )
    return q_t, scale_CG


def _transpose_mode(x_RC: torch.Tensor) -> int:
    # See the NOTE in the module docstring.
    return _FUSED_TRANSPOSE if x_RC.dtype == torch.bfloat16 else _BUFFERED_TRANSPOSE


def quantize_groups_with_transpose(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    stats: torch.Tensor | None = None,
    transpose: bool = True,
    layout: ScaleLayout = GROUPS_1X128,
) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """``(q_RC, q_CR')``: ``x`` in 1×g groups along C (``layout``: 1×128, or MX 1×32 with
    power-of-two scales) and (if ``transpose``) ``xᵀ``, R zero-padded to a multiple of g, in
    1×g groups along R (module docstring).

    Bit-identical to ``quantize(x, fmt, layout, stats=stats)`` and
    ``quantize(F.pad(x.t(), (0, R' - R)), fmt, layout)``.
    """
    if layout == BLOCKS_128X128:
        raise ValueError("128x128 blocks go through quantize_square_blocks")
    x_RC = _check(x_RC, layout)
    mode = _transpose_mode(x_RC) if transpose else _NO_TRANSPOSE
    q_RC, scale_RH, q_t, scale_CG = _launch_groups(x_RC, fmt, stats, layout, transpose=mode)
    forward = QuantizedTensor(q_RC, scale_RH, layout, fmt)
    if q_t is None or scale_CG is None:
        return forward, None
    return forward, _transposed(q_t, scale_CG, layout, fmt, mode)


def quantize_group_columns(
    x_RC: torch.Tensor, fmt: FP8Format, layout: ScaleLayout = GROUPS_1X128
) -> QuantizedTensor:
    """``q_CR'`` alone: the transposed operand of :func:`quantize_groups_with_transpose`
    (bit-identical to ``quantize(F.pad(x.t(), (0, R' - R)), fmt, layout)``) without ``q_RC``,
    for callers that quantize the rows separately (the grouped block GEMM's padded wgrad
    operands, :mod:`mt_fp8.grouped_block`)."""
    if layout == BLOCKS_128X128:
        raise ValueError("128x128 blocks transpose exactly: use quantize_square_blocks")
    x_RC = _check(x_RC, layout)
    _check_tiles(x_RC.shape[0], x_RC.shape[1], layout.block[1], ("COLUMNS_TILE",))
    mode = _transpose_mode(x_RC)
    q_t, scale_CG = _launch_columns(x_RC, fmt, layout, mode)
    return _transposed(q_t, scale_CG, layout, fmt, mode)


def _transposed(
    q_t: torch.Tensor, scale_CG: torch.Tensor, layout: ScaleLayout, fmt: FP8Format, mode: int
) -> QuantizedTensor:
    if mode == _BUFFERED_TRANSPOSE:
        q_t = q_t.t().contiguous()  # FP8 tensors support no arithmetic; a transpose is a copy
    return QuantizedTensor(q_t, scale_CG, layout, fmt)


def quantize_square_blocks(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    stats: torch.Tensor | None = None,
    transpose: bool = False,
    matrices: int = 1,
) -> QuantizedTensor:
    """``x`` in 128×128 blocks; bit-identical to ``quantize(x, fmt, ScaleLayout((128, 128)))``.

    With ``transpose`` the result's ``transposed`` holds ``q.transpose()`` (``xᵀ`` in 128×128
    blocks, the same bytes and scales), written by the same pass; for ``x`` a stack of
    ``matrices`` matrices of ``R/matrices`` rows, each matrix's transpose side by side,
    ``(matrices·C, R/matrices)`` (module docstring).
    """
    x_RC = _check(x_RC, BLOCKS_128X128)
    rows, cols = x_RC.shape
    if matrices < 1 or rows % matrices or (rows // matrices) % TILE:
        raise ValueError(
            f"quantize_square_blocks splits the {rows} rows into {matrices} matrices: it takes "
            f"a count of at least 1 that leaves each a multiple of {TILE} rows"
        )
    device = x_RC.device
    q_RC = torch.empty(rows, cols, device=device, dtype=fmt.dtype)
    scale_GH = torch.empty(rows // TILE, cols // TILE, device=device, dtype=torch.float32)
    q_CR = scale_HG = None
    if transpose:
        per_matrix = rows // matrices
        q_CR = torch.empty(matrices * cols, per_matrix, device=device, dtype=fmt.dtype)
        scale_HG = torch.empty(
            matrices * cols // TILE, per_matrix // TILE, device=device, dtype=torch.float32
        )
    if rows:  # an empty launch grid is an error
        _square_block_quantize[(triton.cdiv(rows, TILE), cols // TILE)](
            x_RC,
            q_RC,
            scale_GH,
            q_CR if q_CR is not None else q_RC,
            scale_HG if scale_HG is not None else scale_GH,
            stats if stats is not None else scale_GH,
            rows,
            cols,
            rows // matrices,
            min_scale=MIN_SCALE,
            TRANSPOSE=_FUSED_TRANSPOSE if transpose else _NO_TRANSPOSE,
            STATS=stats is not None,
            **cast_arguments(fmt),
            TILE=TILE,
            num_warps=8,
        )
    if stats is not None:
        stats[2] += x_RC.numel()
    result = QuantizedTensor(q_RC, scale_GH, BLOCKS_128X128, fmt)
    if q_CR is not None and scale_HG is not None:
        result.transposed = QuantizedTensor(q_CR, scale_HG, BLOCKS_128X128, fmt)
    return result
