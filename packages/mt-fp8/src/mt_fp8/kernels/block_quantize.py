"""Triton block quantization for the DeepSeek-V3 recipe: 1×128 groups (+ the transposed operand)
and 128×128 weight blocks, bit-identical to :func:`mt_fp8.quantized.quantize`.

Shape suffixes: R rows, C columns (C % 128 == 0), R' = R rounded up to a multiple of 128,
H = C / 128, G = R' / 128.

:func:`quantize_groups_with_transpose` reads ``x_RC`` once and writes both operands the linear
layer needs from it (see :mod:`mt_fp8.functional`):

* ``q_RC`` in 1×128 groups along C, scales ``s_RH``: the forward (or dgrad) operand;
* ``q_CR'``: ``xᵀ`` with R zero-padded to R', in 1×128 groups along R', scales ``s_CG``: the
  wgrad operand, which contracts over the tokens R.

Each program owns one 128×128 tile ``x[r0:r0+128, c0:c0+128]`` (rows past R read as zero). The
tile's 128 row amaxes are the amaxes of 128 forward groups, and its 128 column amaxes are the
amaxes of 128 transposed groups, so both scale sets come from the one load:

    s_RH[r, c0/128]  = scale_from_amax(max_c |x[r, c]|)     q_RC[r, c]  = sat(rne(x[r, c] / s_RH))
    s_CG[c, r0/128]  = scale_from_amax(max_r |x[r, c]|)     q_CR'[c, r] = sat(rne(x[r, c] / s_CG))

Padded rows are zeros, so they add nothing to a column amax and quantize to zero, as the
PyTorch path's ``F.pad`` of ``xᵀ`` does. :func:`quantize_square_blocks` is the same pass with one
amax per tile (128×128 weight blocks); a square-block tensor's transpose is exact
(:meth:`mt_fp8.quantized.QuantizedTensor.transpose`), so it writes ``q_RC`` only.

Bit-exactness with :func:`mt_fp8.quantized.scale_from_amax` and :func:`~mt_fp8.quantized.quantize`,
by the means of :mod:`mt_fp8.kernels.quantize` (whose ``_div_rn`` and ``_store_fp8`` this reuses):

* ``s = max(amax, fmt.max · 2^-126) / fmt.max`` divides with ``div.rn.f32`` (IEEE), then
  ``max(s, 2^-126)``; ``amax == 0`` gives ``s = 1``; ``amax = inf`` gives ``s = NaN``. The amax
  counts NaN as ``+inf`` (Triton's ``max`` skips NaN), which is non-finite as NaN is, so a group
  holding NaN gets a NaN scale as on the PyTorch path.
* ``x / s`` is ``div.rn.f32``, the clamp propagates NaN, the cast rounds to nearest even (in
  integer arithmetic under ``TRITON_INTERPRET=1``, whose own FP8 cast is wrong).
* Health counts (``stats``) cover ``q_RC`` only, as :func:`~mt_fp8.quantized.cast_to_fp8` does.

NOTE: the fused transposed store (``tl.trans`` of the FP8 tile) is used for bf16 inputs only,
for the reason in :mod:`mt_fp8.kernels.quantize` (fp32 inputs gave garbage ``qᵀ`` bytes on the
H200 there). Other input dtypes store the transposed-scaled tile untransposed into an
``(R', C)`` buffer, and PyTorch's FP8 transpose copy makes ``q_CR'`` from it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mt_fp8.formats import FP8Format
from mt_fp8.kernels.quantize import _div_rn, _scale_from_amax, _store_fp8, cast_arguments
from mt_fp8.quantized import BLOCKS_128X128, GROUPS_1X128, MIN_SCALE, QuantizedTensor

GROUP = 128
"""Group length (1×128) and weight block side (128×128); also the kernel's tile side."""

FUSED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the kernels take (fp64 inputs stay on the PyTorch path, which divides in fp64)."""

# Transposed-operand modes of the kernel (constexpr TRANSPOSE).
_NO_TRANSPOSE, _FUSED_TRANSPOSE, _BUFFERED_TRANSPOSE = 0, 1, 2


@triton.jit
def _block_quantize(
    x_ptr,
    q_ptr,
    scale_ptr,
    qt_ptr,
    scale_t_ptr,
    stats_ptr,
    R,
    C,
    R_padded,
    fmt_max,
    min_scale,
    saturation,
    half_subnormal,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    SQUARE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    STATS: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TILE: tl.constexpr,
):
    """One TILE×TILE tile: its 1×TILE row groups of ``q`` (one TILE×TILE block if SQUARE) and,
    with TRANSPOSE, the TILE×1 column groups of the transposed operand (module docstring)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TILE + tl.arange(0, TILE)
    cols = pid_c * TILE + tl.arange(0, TILE)
    in_rows = rows < R
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    magnitude_x = tl.where(x != x, float("inf"), tl.abs(x))
    amax_rows = tl.max(magnitude_x, axis=1)
    groups_c = C // TILE
    if SQUARE:
        amax_rows = tl.zeros_like(amax_rows) + tl.max(amax_rows, axis=0)
    scale_rows = _scale_from_amax(amax_rows, fmt_max, min_scale, EXACT_DIV)
    if SQUARE:
        # Every element of scale_rows is the block's scale; the first one is stored.
        first = tl.arange(0, TILE) == 0
        scale_offs = pid_r * groups_c + pid_c + tl.arange(0, TILE) * 0
        tl.store(scale_ptr + scale_offs, scale_rows, mask=first)
    else:
        tl.store(scale_ptr + rows.to(tl.int64) * groups_c + pid_c, scale_rows, mask=in_rows)
    scaled = _div_rn(x, tl.broadcast_to(scale_rows[:, None], (TILE, TILE)), EXACT_DIV)
    if STATS:
        magnitude = tl.abs(scaled)  # padded rows are zeros: counted in neither
        saturated = tl.sum(tl.sum((magnitude >= saturation).to(tl.int64), axis=1), axis=0)
        flushed = tl.sum(
            tl.sum(((magnitude < half_subnormal) & (magnitude > 0)).to(tl.int64), axis=1), axis=0
        )
        tl.atomic_add(stats_ptr, saturated)
        tl.atomic_add(stats_ptr + 1, flushed)
    clamped = tl.clamp(scaled, -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL)
    _store_fp8(q_ptr + offs, clamped, in_rows[:, None], MANTISSA, BIAS, SOFTWARE_CAST)
    if TRANSPOSE != 0:
        scale_cols = _scale_from_amax(tl.max(magnitude_x, axis=0), fmt_max, min_scale, EXACT_DIV)
        tl.store(scale_t_ptr + cols.to(tl.int64) * (R_padded // TILE) + pid_r, scale_cols)
        scaled_t = _div_rn(x, tl.broadcast_to(scale_cols[None, :], (TILE, TILE)), EXACT_DIV)
        clamped_t = tl.clamp(scaled_t, -fmt_max, fmt_max, propagate_nan=tl.PropagateNan.ALL)
        if TRANSPOSE == 1:
            # qᵀ[c, r], stored with its own contiguous axis last; padded rows give zero columns.
            offs_t = cols.to(tl.int64)[:, None] * R_padded + rows[None, :]
            _store_fp8(qt_ptr + offs_t, tl.trans(clamped_t), None, MANTISSA, BIAS, SOFTWARE_CAST)
        else:
            # The (R', C) buffer, transposed by PyTorch afterwards; padded rows are zeros.
            _store_fp8(qt_ptr + offs, clamped_t, None, MANTISSA, BIAS, SOFTWARE_CAST)


def _check(x_RC: torch.Tensor) -> torch.Tensor:
    if x_RC.dim() != 2 or x_RC.dtype not in FUSED_INPUT_DTYPES:
        raise ValueError(
            "the Triton block quantizer takes a 2-D bfloat16, float16 or float32 tensor, got "
            f"{tuple(x_RC.shape)} {x_RC.dtype}"
        )
    GROUPS_1X128.resolve((x_RC.shape[0], x_RC.shape[1]))  # raises unless 128 divides C
    return x_RC.contiguous()


def _launch(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    stats: torch.Tensor | None,
    square: bool,
    transpose: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    rows, cols = x_RC.shape
    rows_padded = triton.cdiv(rows, GROUP) * GROUP
    device = x_RC.device
    q_RC = torch.empty(rows, cols, device=device, dtype=fmt.dtype)
    scale_rows = rows // GROUP if square else rows
    scale = torch.empty(scale_rows, cols // GROUP, device=device, dtype=torch.float32)
    q_t = scale_t = None
    if transpose == _FUSED_TRANSPOSE:
        q_t = torch.empty(cols, rows_padded, device=device, dtype=fmt.dtype)
    elif transpose == _BUFFERED_TRANSPOSE:
        q_t = torch.empty(rows_padded, cols, device=device, dtype=fmt.dtype)
    if transpose != _NO_TRANSPOSE:
        scale_t = torch.empty(cols, rows_padded // GROUP, device=device, dtype=torch.float32)
    grid = (rows_padded // GROUP, cols // GROUP)
    if rows_padded:  # an empty launch grid is an error
        _block_quantize[grid](
            x_RC,
            q_RC,
            scale,
            q_t if q_t is not None else q_RC,
            scale_t if scale_t is not None else scale,
            stats if stats is not None else scale,
            rows,
            cols,
            rows_padded,
            min_scale=MIN_SCALE,
            SQUARE=square,
            TRANSPOSE=transpose,
            STATS=stats is not None,
            **cast_arguments(fmt),
            TILE=GROUP,
            num_warps=8,
        )
    if stats is not None:
        stats[2] += x_RC.numel()
    return q_RC, scale, q_t, scale_t


def quantize_groups_with_transpose(
    x_RC: torch.Tensor, fmt: FP8Format, stats: torch.Tensor | None = None, transpose: bool = True
) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """``(q_RC, q_CR')``: ``x`` in 1×128 groups along C and (if ``transpose``) ``xᵀ``, R
    zero-padded to a multiple of 128, in 1×128 groups along R (module docstring).

    Bit-identical to ``quantize(x, fmt, ScaleLayout((1, 128)), stats=stats)`` and
    ``quantize(F.pad(x.t(), (0, R' - R)), fmt, ScaleLayout((1, 128)))``.
    """
    x_RC = _check(x_RC)
    if not transpose:
        mode = _NO_TRANSPOSE
    elif x_RC.dtype == torch.bfloat16:  # see the NOTE in the module docstring
        mode = _FUSED_TRANSPOSE
    else:
        mode = _BUFFERED_TRANSPOSE
    q_RC, scale_RH, q_t, scale_CG = _launch(x_RC, fmt, stats, square=False, transpose=mode)
    forward = QuantizedTensor(q_RC, scale_RH, GROUPS_1X128, fmt)
    if q_t is None or scale_CG is None:
        return forward, None
    if mode == _BUFFERED_TRANSPOSE:
        q_t = q_t.t().contiguous()  # FP8 tensors support no arithmetic; a transpose is a copy
    return forward, QuantizedTensor(q_t, scale_CG, GROUPS_1X128, fmt)


def quantize_square_blocks(
    x_RC: torch.Tensor, fmt: FP8Format, stats: torch.Tensor | None = None
) -> QuantizedTensor:
    """``x`` in 128×128 blocks; bit-identical to ``quantize(x, fmt, ScaleLayout((128, 128)))``."""
    x_RC = _check(x_RC)
    BLOCKS_128X128.resolve((x_RC.shape[0], x_RC.shape[1]))  # raises unless 128 divides R
    q_RC, scale_GH, _, _ = _launch(x_RC, fmt, stats, square=True, transpose=_NO_TRANSPOSE)
    return QuantizedTensor(q_RC, scale_GH, BLOCKS_128X128, fmt)
