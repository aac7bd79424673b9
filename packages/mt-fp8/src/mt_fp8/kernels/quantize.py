"""Triton quantize + transpose + amax (contract in :mod:`mt_fp8.ops.quantize_transpose`).

Each program loads one ``TILE_R × TILE_C`` tile of ``x`` (``WRITE_TILE``, or ``AMAX_TILE`` for
the amax-only launch below; 64 × 64 with 4 warps both), scales, clamps and casts it, stores it to
``q`` and (bf16 inputs) its transpose (``tl.trans`` of the tile, stored row-major) to ``qᵀ``, and
writes the tile's amax (and int32 health counts: saturated, flushed) to its own slot of a
per-tile partials buffer. The launch's last programs fold the partials (below):
``amax = max(partials)`` (partials are >= 0, NaN recorded as ``+inf``), and
``stats += (Σ saturated, Σ flushed, rows · cols)`` into the caller's int64 counters.

Launches per call:

* No scale given (current scaling): 2. The first, ``WRITE=False``, only produces the amax
  partials; its fold also computes the scale exactly as :func:`mt_fp8.quantized.scale_from_amax`
  does (``max(amax, fmt_max·2^-126) / fmt_max`` with an IEEE division, at least ``2^-126``, 1 for
  a zero amax, NaN for a non-finite one). The second writes ``q``, ``qᵀ`` and the health counts.
  With an amax group the first fold writes the amax only; it is all-reduced and
  :func:`~mt_fp8.quantized.scale_from_amax` runs in PyTorch.
* A scale given (delayed scaling): 1. The write launch also records the amax partials; its fold
  writes the amax, adds the health counts and copies the scale into the returned ``(1, 1)``
  tensor (an own allocation, for cuBLAS's scale alignment).
* A stack of B matrices, one given scale each (:func:`quantize_transpose_stack_triton`, the
  grouped path's expert weights): 1. The write launch with a third program axis over the
  matrices (``STACKED``): each program offsets ``x``, ``q`` and ``qᵀ`` to its matrix and loads
  its scale; ``qᵀ`` is (B, C, R), each matrix transposed in place. No amax is recorded; the
  fold adds the health counts of all B matrices.

Why in-kernel folds: host launch overhead. In an FP8 training step the device waited a
noticeable share of the step for the host to issue kernels (docs/benchmarks-log.md); before,
a quantization with health counts launched 4 kernels: the two passes and one-program kernels
that folded the amax into the scale and the counts into ``stats`` (with a given scale: a scale
copy, the pass, a PyTorch ``amax`` and the counts fold).

The fold ("last program finishes"), in two levels. Tiles form groups of ``GROUP`` (256) in
program order. Each program stores its partials, ``tl.debug_barrier()`` (``bar.sync``: every
thread's stores precede the atomic, which one thread issues), then draws a ticket from its
group's counter, ``tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")`` (on sm_90:
``MEMBAR.GPU``, the atomic, ``CCTL.IVALL``). Each increment releases its program's stores and
acquires those released by the increments before it, so the program that draws the group's last
ticket sees the whole group's partials. It folds them into a group partial (stored after the
tile partials), then draws a ticket from the final counter the same way; the program that draws
the last of those sees every group partial and folds them into the outputs. Partials are loaded
with ``.cg`` (from L2, never a stale L1 line), and each last program stores 0 back into the
counter it emptied. Why two levels: with one counter for all 28,672 tiles of an 8192×14336
gradient, 28,672 same-address atomics serialize and one program folds 28,672 partials in a loop
of dependent L2 round trips; groups spread the atomics over 113 addresses (one 128-byte line
each) and keep each fold short. The groups beat both one counter and the four launches they
replaced, in kernel and in host time (docs/benchmarks-log.md).

Counters: zeroed int32s, one set per (device, stream), allocated on first use, grown when a
launch has more groups, and kept: launches on one stream run one after another, so each finds
its counters at 0; launches on two streams may overlap and get separate counters. Under CUDA
graph capture a missing set is allocated for that graph alone (the zero fill is a node of the
graph). Under ``TRITON_INTERPRET=1`` programs run one at a time, so the last of each group is
its highest id. An empty ``x`` runs one fully masked program (amax 0, scale 1, no counts).

NOTE: per-tile partials rather than atomics on one global accumulator: an 8192×14336 gradient
has 28,672 tiles, and same-address atomics serialize in L2; with three of them per tile the
quantizers of a training step ran at less than half the copy bandwidth their bytes need
(docs/benchmarks-log.md).

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
the H200 and about as fast as the wrong FP8-tile version. It replaced PyTorch's FP8 transpose
copy, which ran far below copy bandwidth (docs/benchmarks-log.md).

Bit-exactness with the PyTorch path (:func:`mt_fp8.quantized.quantize`):

* Values are scaled as ``x · s⁻¹`` with ``s⁻¹ = RN(1 / s)``, the inverse scale (one IEEE
  division per scale; :func:`mt_fp8.quantized.cast_to_fp8` defines it so): the product is
  ``mul.rn.f32`` and the division ``div.rn.f32`` (inline PTX), IEEE round-to-nearest with
  subnormals kept. Triton's ``/`` lowers to ``div.full.f32`` (an approximation within 2 ulp, so
  values next to an FP8 rounding boundary can land on the other side), and ``tl.div_rn`` calls
  libdevice's ``__nv_fdiv_rn``, which Triton links flush-to-zero. Under ``TRITON_INTERPRET=1``
  (numpy) the plain operators are already IEEE. NOTE: one division per scale, not per
  element: ``x / s`` per element made the bf16 write pass markedly slower than the
  approximate division (docs/benchmarks-log.md).
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

WRITE_TILE = (64, 64, 4)
"""(rows, columns, warps) of a program of the launch that writes ``q`` and ``qᵀ``."""
AMAX_TILE = (64, 64, 4)
"""(rows, columns, warps) of a program of the amax-only launch (current scaling). Both are
module constants so that ``benchmarks/quantize_transpose.py --sweep`` can time others; rows and
columns must be powers of two (``tl.arange``)."""
GROUP = 256
"""Tiles whose partials one program folds into a group partial (module docstring: the fold)."""
COUNTER_STRIDE = 32
"""int32s between ticket counters: one 128-byte line each, so groups' atomics do not contend."""


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
def _last_of(counter_ptr, count):
    """Whether this program is the last of ``count`` to draw a ticket from ``counter_ptr``
    (module docstring: the fold); that program must store 0 back.

    Call after the program's partial stores: the barrier orders every thread's stores before the
    (one-thread) release of the ticket, whose acquire half makes the stores of the programs that
    drew before visible to the program that draws the last ticket.
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == count - 1


@triton.jit
def _quantize_transpose(
    x_ptr,
    up_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    amax_partial_ptr,
    stats_partial_ptr,
    ticket_ptr,
    amax_ptr,
    scale_out_ptr,
    stats_ptr,
    R,
    C,
    numel,
    fmt_max,
    saturation,
    half_subnormal,
    min_scale,
    WRITE: tl.constexpr,
    WRITE_T: tl.constexpr,
    TRANSPOSE_CODES: tl.constexpr,
    AMAX: tl.constexpr,
    STATS: tl.constexpr,
    SCALE_OUT: tl.constexpr,
    SWIGLU: tl.constexpr,
    STACKED: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    GROUP: tl.constexpr,
    COUNTER_STRIDE: tl.constexpr,
):
    tiles = tl.num_programs(0) * tl.num_programs(1)
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if STACKED:
        # Program axis 2 is the matrix (quantize_transpose_stack_triton): R × C in x and q,
        # C × R in qᵀ, its own scale. A constexpr, so the 2-D launches compile as before.
        matrix = tl.program_id(2)
        matrix_offset = matrix.to(tl.int64) * R * C
        x_ptr += matrix_offset
        q_ptr += matrix_offset
        if WRITE_T:
            qt_ptr += matrix_offset
        scale_ptr += matrix
        tile += matrix * tiles
        tiles *= tl.num_programs(2)
    rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        # x is the gate: the tile of silu(gate)·up as mt_fp8.kernels.swiglu computes it, rounded
        # to the input dtype as that kernel stores it (masked elements stay 0).
        up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    if AMAX:
        magnitude_x = tl.where(x != x, float("inf"), tl.abs(x))
        tl.store(amax_partial_ptr + tile, tl.max(tl.max(magnitude_x, axis=1), axis=0))
    if WRITE:
        inverse_scale = tl.broadcast_to(
            _reciprocal(tl.load(scale_ptr), EXACT_DIV), (TILE_R, TILE_C)
        )
        scaled = _mul_rn(x, inverse_scale, EXACT_DIV)
        if STATS:
            # int32 tile counts (at most TILE_R·TILE_C each); masked-out elements are 0 and count as
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
    if AMAX or STATS:  # at compile time: a launch with nothing to fold draws no ticket
        # Two levels (module docstring): the last program of each group of GROUP tiles folds
        # the group's partials into a group partial (stored after the tile partials), and the
        # last of those folds the group partials. The loads bypass L1 (.cg): partials other
        # programs stored are read from L2, never from a line this SM's L1 may hold.
        groups = tl.cdiv(tiles, GROUP)
        group = tile // GROUP
        pair = tl.arange(0, 2)  # (saturated, flushed)
        offs_group = tl.arange(0, GROUP)
        group_counter = ticket_ptr + COUNTER_STRIDE * (1 + group)
        members = group * GROUP + offs_group
        if _last_of(group_counter, tl.minimum(tiles - group * GROUP, GROUP)):
            tl.store(group_counter, 0)
            if AMAX:
                # Partials are >= 0, with NaN already recorded as +inf: a plain max is exact.
                part = tl.load(
                    amax_partial_ptr + members,
                    mask=members < tiles,
                    other=0.0,
                    cache_modifier=".cg",
                )
                tl.store(amax_partial_ptr + tiles + group, tl.max(part, axis=0))
            if STATS:
                # At most GROUP · TILE_R · TILE_C per count (2^20 at 64 × 64): int32 holds it.
                block = tl.load(
                    stats_partial_ptr + 2 * members[:, None] + pair[None, :],
                    mask=(members < tiles)[:, None],
                    other=0,
                    cache_modifier=".cg",
                )
                tl.store(stats_partial_ptr + 2 * (tiles + group) + pair, tl.sum(block, axis=0))
            if _last_of(ticket_ptr, groups):
                tl.store(ticket_ptr, 0)
                if AMAX:
                    running = tl.zeros([GROUP], dtype=tl.float32)
                    for start in range(0, groups, GROUP):
                        part = tl.load(
                            amax_partial_ptr + tiles + start + offs_group,
                            mask=start + offs_group < groups,
                            other=0.0,
                            cache_modifier=".cg",
                        )
                        running = tl.maximum(running, part)
                    amax = tl.max(running, axis=0)
                    tl.store(amax_ptr, amax)
                    if SCALE_OUT:
                        if WRITE:  # the given scale, into the caller's own (1, 1) allocation
                            tl.store(scale_out_ptr, tl.load(scale_ptr))
                        else:
                            scale = _scale_from_amax(amax, fmt_max, min_scale, EXACT_DIV)
                            tl.store(scale_out_ptr, scale)
                if STATS:
                    counts = tl.zeros([2], dtype=tl.int64)
                    for start in range(0, groups, GROUP):
                        group_ids = tiles + start + offs_group
                        block = tl.load(
                            stats_partial_ptr + 2 * group_ids[:, None] + pair[None, :],
                            mask=(start + offs_group < groups)[:, None],
                            other=0,
                            cache_modifier=".cg",
                        )
                        counts += tl.sum(block.to(tl.int64), axis=0)
                    tl.store(stats_ptr + pair, tl.load(stats_ptr + pair) + counts)
                    tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + numel)


_TICKETS: dict[tuple[str, int | None, int], torch.Tensor] = {}
"""The zeroed int32 ticket counters of each (device type, index, stream); module docstring."""


def _ticket_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed ticket counters for a launch of ``groups`` groups on ``device``'s current stream:
    the final one, then one per group, ``COUNTER_STRIDE`` apart (kept, grown when too few)."""
    # The stream Triton's launcher will use: launches on one stream run one after another and
    # can share counters; launches on two streams can overlap and must not.
    stream = (
        triton.runtime.driver.active.get_current_stream(device.index)
        if device.type == "cuda"
        else 0
    )
    key = (device.type, device.index, stream)
    counters = _TICKETS.get(key)
    size = (1 + groups) * COUNTER_STRIDE
    if counters is None or counters.numel() < size:
        counters = torch.zeros(triton.next_power_of_2(size), device=device, dtype=torch.int32)
        # Under CUDA-graph capture the zero fill is recorded, not run: such counters serve that
        # graph alone (each replay zeroes them first) and are not kept for later launches.
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _TICKETS[key] = counters
    return counters


def quantize_transpose_amax_triton(
    x_RC: torch.Tensor,
    fmt: FP8Format,
    scale: torch.Tensor | None,
    stats: torch.Tensor | None,
    amax_group: dist.ProcessGroup | None = None,
    up_RC: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_RC, q_CR, scale (1, 1) fp32, amax)``.

    With ``up_RC`` (same shape and dtype), ``x_RC`` is a SwiGLU gate and the tensor quantized is
    ``silu(x)·up`` in ``x``'s dtype, computed in each launch's tiles and never stored
    (:func:`mt_fp8.ops.quantize_transpose.swiglu_quantize_transpose_amax`).
    """
    x_RC = x_RC.contiguous()
    up_RC = None if up_RC is None else up_RC.contiguous()
    device = x_RC.device
    rows, cols = x_RC.shape
    _check_tiles()
    write_grid, amax_grid = _grid(rows, cols, WRITE_TILE), _grid(rows, cols, AMAX_TILE)
    tiles = max(write_grid[0] * write_grid[1], amax_grid[0] * amax_grid[1])
    groups = triton.cdiv(tiles, GROUP)
    # Per-tile partials, then per-group partials (sized for the launch with more tiles).
    amax_partial = torch.empty(tiles + groups, device=device, dtype=torch.float32)
    stats_partial = (
        torch.empty(tiles + groups, 2, device=device, dtype=torch.int32)
        if stats is not None
        else None
    )
    amax = torch.empty((), device=device, dtype=torch.float32)
    q_RC = torch.empty(rows, cols, device=device, dtype=fmt.dtype)
    q_CR = torch.empty(cols, rows, device=device, dtype=fmt.dtype)
    common = dict(
        cast_arguments(fmt),
        ticket_ptr=_ticket_counters(device, groups),
        amax_partial_ptr=amax_partial,
        stats_partial_ptr=stats_partial,
        amax_ptr=amax,
        stats_ptr=stats,
        R=rows,
        C=cols,
        numel=rows * cols,
        min_scale=MIN_SCALE,
        GROUP=GROUP,
        COUNTER_STRIDE=COUNTER_STRIDE,
        # See the NOTE in the module docstring: only bf16 tiles were seen transposed right as FP8.
        TRANSPOSE_CODES=x_RC.dtype != torch.bfloat16,
        up_ptr=up_RC,
        SWIGLU=up_RC is not None,
        STACKED=False,
    )
    # The returned scale is an own allocation (cuBLAS scale alignment) that a kernel's last
    # program writes; with an amax group scale_from_amax makes it after the all-reduce.
    reduced = scale is None and amax_group is not None
    scale_11 = None if reduced else torch.empty(1, 1, device=device, dtype=torch.float32)
    if scale is None:
        _quantize_transpose[amax_grid](
            x_RC,
            q_ptr=q_RC,
            qt_ptr=q_CR,
            scale_ptr=None,
            scale_out_ptr=scale_11,
            WRITE=False,
            WRITE_T=False,
            AMAX=True,
            STATS=False,
            SCALE_OUT=not reduced,
            TILE_R=AMAX_TILE[0],
            TILE_C=AMAX_TILE[1],
            num_warps=AMAX_TILE[2],
            **common,
        )
        if reduced:
            reduce_amax_(amax, amax_group)
            scale_11 = scale_from_amax(amax, fmt).reshape(1, 1)
    _quantize_transpose[write_grid](
        x_RC,
        q_ptr=q_RC,
        qt_ptr=q_CR,
        scale_ptr=scale_11 if scale is None else scale.float(),
        scale_out_ptr=scale_11,
        WRITE=True,
        WRITE_T=True,
        AMAX=scale is not None,  # with a computed scale the first launch already has the amax
        STATS=stats is not None,
        SCALE_OUT=scale is not None,
        TILE_R=WRITE_TILE[0],
        TILE_C=WRITE_TILE[1],
        num_warps=WRITE_TILE[2],
        **common,
    )
    return q_RC, q_CR, scale_11, amax


def quantize_transpose_stack_triton(
    x_BRC: torch.Tensor,
    scale_B: torch.Tensor,
    fmt: FP8Format,
    stats: torch.Tensor | None,
    transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(q_BRC, q_BCR)``: each matrix ``x[b]`` quantized with its own given scale ``scale_B[b]``
    (fp32) and, with ``transposed``, its transpose, in one launch of the write pass (module
    docstring) whose program axis 2 is the matrix; ``q_BCR`` is None without ``transposed``.

    Per matrix, the bytes of :func:`mt_fp8.quantized.cast_to_fp8` with that scale (and their
    exact transpose); ``stats`` (int64, 3 elements), if given, is incremented by the counts
    ``cast_to_fp8`` gives the whole stack, folded in the launch. The stacked FP8 expert weights
    of :mod:`mt_fp8.grouped` (``W`` and ``Wᵀ``, one scale per expert), without the eager cast and
    the FP8 transpose copy."""
    if x_BRC.dim() != 3 or x_BRC.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            "quantize_transpose_stack_triton takes a 3-D bfloat16, float16 or float32 tensor, "
            f"got {tuple(x_BRC.shape)} {x_BRC.dtype}"
        )
    matrices, rows, cols = x_BRC.shape
    if scale_B.dtype != torch.float32 or scale_B.shape != (matrices,):
        raise ValueError(
            f"scale_B must be fp32 of shape ({matrices},), one scale per matrix, got "
            f"{tuple(scale_B.shape)} {scale_B.dtype}"
        )
    x_BRC = x_BRC.contiguous()
    device = x_BRC.device
    q_BRC = torch.empty(matrices, rows, cols, device=device, dtype=fmt.dtype)
    q_BCR = (
        torch.empty(matrices, cols, rows, device=device, dtype=fmt.dtype) if transposed else None
    )
    if x_BRC.numel() == 0:  # nothing to cast or count (an empty grid is an error)
        return q_BRC, q_BCR
    _check_tiles()
    grid = (*_grid(rows, cols, WRITE_TILE), matrices)
    tiles = grid[0] * grid[1] * grid[2]
    groups = triton.cdiv(tiles, GROUP)
    stats_partial, tickets = None, None
    if stats is not None:
        stats_partial = torch.empty(tiles + groups, 2, device=device, dtype=torch.int32)
        tickets = _ticket_counters(device, groups)
    # The scales are given and no amax is recorded: no amax or scale outputs.
    _quantize_transpose[grid](
        x_BRC,
        up_ptr=None,
        q_ptr=q_BRC,
        qt_ptr=q_BCR,
        scale_ptr=scale_B.contiguous(),
        amax_partial_ptr=None,
        stats_partial_ptr=stats_partial,
        ticket_ptr=tickets,
        amax_ptr=None,
        scale_out_ptr=None,
        stats_ptr=stats,
        R=rows,
        C=cols,
        numel=matrices * rows * cols,
        min_scale=MIN_SCALE,
        WRITE=True,
        WRITE_T=transposed,
        # See the NOTE in the module docstring: only bf16 tiles were seen transposed right as FP8.
        TRANSPOSE_CODES=x_BRC.dtype != torch.bfloat16,
        AMAX=False,
        STATS=stats is not None,
        SCALE_OUT=False,
        SWIGLU=False,
        STACKED=True,
        TILE_R=WRITE_TILE[0],
        TILE_C=WRITE_TILE[1],
        GROUP=GROUP,
        COUNTER_STRIDE=COUNTER_STRIDE,
        num_warps=WRITE_TILE[2],
        **cast_arguments(fmt),
    )
    return q_BRC, q_BCR


def _grid(rows: int, cols: int, tile: tuple[int, int, int]) -> tuple[int, int]:
    """Programs along rows and columns; at least one, so an empty ``x`` has one fully masked
    tile, whose amax is 0."""
    return max(triton.cdiv(rows, tile[0]), 1), max(triton.cdiv(cols, tile[1]), 1)


def _check_tiles() -> None:
    for name, (tile_r, tile_c, warps) in (("WRITE_TILE", WRITE_TILE), ("AMAX_TILE", AMAX_TILE)):
        if not all(v > 0 and v & (v - 1) == 0 for v in (tile_r, tile_c, warps)):
            raise ValueError(
                f"quantize.{name}={(tile_r, tile_c, warps)}: rows, columns and warps must be "
                "powers of two"
            )
