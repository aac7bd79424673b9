"""Triton grouped block-scaled FP8 GEMMs for MoE experts (DeepSeek-V3 block scaling and MXFP8).

PyTorch has no grouped block-scaled GEMM (``torch._scaled_grouped_mm`` takes rowwise scales), and
one :mod:`mt_fp8.kernels.block_gemm` launch per expert is bound by the host's launches at
fine-grained MoE shapes (docs/architecture.md, ``grouped.py``). These two kernels run every
expert's GEMM in one launch each, with the promotion of :mod:`~mt_fp8.kernels.block_gemm`
(its step loop, :func:`~mt_fp8.kernels.block_gemm.block_scaled_steps`): every g-deep step of the contraction is one FP8 tensor-core product, added to the fp32
accumulator with its two scales, ``acc += dot(a_k, b_kᵀ) · s_a[:, k] · s_b[:, k]``.

Shape suffixes: T tokens sorted by expert, E experts, Y rows of ``b`` (output columns), Z the
contraction axis, P padded tokens (below), g the group length: the contraction step per scale,
a constexpr (``BLOCK_Z``) of both kernels, :data:`GROUPS`:

* 128 for block scaling: ``a`` in 1×128 groups, ``b`` in 128×128 blocks (2d × 3d) or 1×128
  groups (k-grouped);
* 32 for MXFP8: every operand in 1×32 groups with power-of-two scales (fp32 values
  ``2^e``, as :mod:`mt_fp8.quantized` stores them; the kernels read them as any fp32 scale).
  The step is the group, as in the dense MX GEMM (:mod:`~mt_fp8.kernels.block_gemm` walks Z in
  32-deep steps with 128×128 output tiles and one pipeline stage fewer): one scale pair per
  FP8 product, so no group is skipped or split.

Rows by experts (2d × 3d; the forward ``y_e = x_e W_eᵀ`` and dgrad ``dx_e = dy_e W_e``):

    out_TY[t] = Σ_k (a_TZ[t, k] · s_a[t, k]) (b_EYZ[e(t), :, k] · s_b[e(t), :, k])ᵀ  (+ bias_EY[e(t)])

``a_TZ`` in 1×g groups along Z (``s_a`` (T, Z/g)), ``b_EYZ`` in g×g blocks (``s_b``
(E, Y/g, Z/g), block scaling) or in 1×g groups along Z (``s_b`` (E, Y, Z/g), MXFP8: the
constexpr ``B_ROW_SCALES``), ``e(t)`` the expert owning token ``t``. The tile table
(:func:`row_tiles`) lists, for every expert with tokens, ``ceil(T_e / ROW_TILE)`` row tiles as
``(expert, row_start, row_end)``: a program owns one such tile and one column tile, so no tile
mixes experts and experts without tokens cost nothing. Grid: ``ceil(Y / BLOCK_Y) · tiles``
programs in block_gemm's grouped order (8 consecutive row tiles sweep the column tiles
together, sharing each tile of ``b`` in L2); columns past Y are masked, so with row scales Y may be any size (with blocks, a multiple of g).

k-grouped (2d × 2d; the wgrad ``dW_e = dy_eᵀ x_e``, contracting over the expert's tokens):

    out_EXY[e] = Σ_{k in e's segment} (a_XP[:, k] · s_a[:, k]) (b_YP[:, k] · s_b[:, k])ᵀ

``a_XP`` and ``b_YP`` are the transposed operands (``dyᵀ``, ``xᵀ``) in 1×g groups along the
padded token axis: each expert's tokens start a segment of ``P_e = ceil(T_e / g) · g`` columns
whose tail is zeros, so no group straddles two experts. ``starts`` (E + 1 int32) holds the
segment boundaries (multiples of g, :func:`padded_starts`); an expert with no tokens has an
empty segment and its programs write zeros. Grid: ``(Y / BLOCK_Y, X / BLOCK_X, E)``.

Mixed E4M3 × E5M2 operands (the hybrid formats' gradients) are multiplied in fp16, which holds
every value of both formats exactly (E5M2 is fp16's top byte; E4M3's range 2^-9..448 lies in
fp16's normal range), so the products are the FP8 products, at Hopper's fp16 tensor-core rate.
NOTE: fp16 rather than :mod:`~mt_fp8.kernels.block_gemm`'s bf16 (also exact) because Triton
3.9's interpreter miscomputes bf16 dots, and the CPU tests run these kernels there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mt_fp8.kernels.block_gemm import block_scaled_steps

GROUP = 128
"""Block scaling's group length (1×128 groups) and weight-block side: the default step."""
MX_GROUP = 32
"""MXFP8's group length (1×32 groups for every operand)."""
GROUPS = (MX_GROUP, GROUP)
"""The contraction steps (group lengths) the kernels take."""
ROW_TILE = 128
"""Rows of ``a`` per program in the 2d × 3d kernel (the tile table is cut in these)."""
COLUMN_TILE = 128
"""Columns of the output per program."""
WGRAD_ROW_TILE = 128
"""Rows of ``a`` (output rows) per program in the k-grouped kernel."""


@triton.jit
def _rows_by_experts(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    out_ptr,
    tiles_ptr,
    num_tiles,
    Y,
    Z,
    HAS_BIAS: tl.constexpr,
    MIXED: tl.constexpr,
    B_ROW_SCALES: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_Y: tl.constexpr,
    BLOCK_Z: tl.constexpr,
    GROUP_X: tl.constexpr,
):
    # Grouped ordering (block_gemm's): GROUP_X consecutive row tiles of the table run over
    # the same column tiles together, so each tile of b is read from L2 by up to GROUP_X
    # programs instead of from memory once per row tile.
    pid = tl.program_id(0)
    tiles_y = tl.cdiv(Y, BLOCK_Y)
    first = (pid // (GROUP_X * tiles_y)) * GROUP_X
    group_size = tl.minimum(num_tiles - first, GROUP_X)
    tile = first + (pid % (GROUP_X * tiles_y)) % group_size
    tile_y = (pid % (GROUP_X * tiles_y)) // group_size
    expert = tl.load(tiles_ptr + 3 * tile).to(tl.int64)
    row_start = tl.load(tiles_ptr + 3 * tile + 1)
    row_end = tl.load(tiles_ptr + 3 * tile + 2)
    rows = row_start + tl.arange(0, BLOCK_X)
    cols = tile_y * BLOCK_Y + tl.arange(0, BLOCK_Y)
    ks = tl.arange(0, BLOCK_Z)
    row_mask, col_mask = rows < row_end, cols < Y
    # The (0, 0, 0) entries that close a table built on the device own no rows: no steps.
    groups = Z // BLOCK_Z
    steps = tl.where(row_end > row_start, groups, 0)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * Z + ks[None, :]
    b_ptrs = b_ptr + expert * Y * Z + cols.to(tl.int64)[:, None] * Z + ks[None, :]
    sa_ptrs = sa_ptr + rows.to(tl.int64) * groups
    if B_ROW_SCALES:  # one scale per 1 × BLOCK_Z group of b: expert e's row c
        sb_ptrs = sb_ptr + (expert * Y + cols) * groups
    else:  # one per BLOCK_Z × BLOCK_Z block of b: expert e's block row of output column c
        sb_ptrs = sb_ptr + (expert * (Y // BLOCK_Z) + cols // BLOCK_Z) * groups
    acc = block_scaled_steps(
        a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, row_mask, col_mask, steps, MIXED, tl.float16, BLOCK_Z
    )
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * Y + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * Y + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _k_grouped(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    out_ptr,
    starts_ptr,
    X,
    Y,
    P,
    MIXED: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_Y: tl.constexpr,
    BLOCK_Z: tl.constexpr,
):
    tile_y, tile_x = tl.program_id(0), tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    # The segments start at multiples of the group (padded_starts); saying so lets the
    # compiler vectorize the loads along the tokens, which it cannot prove for a loaded offset.
    start = tl.multiple_of(tl.load(starts_ptr + expert), BLOCK_Z)
    end = tl.multiple_of(tl.load(starts_ptr + expert + 1), BLOCK_Z)
    rows = tile_x * BLOCK_X + tl.arange(0, BLOCK_X)
    cols = tile_y * BLOCK_Y + tl.arange(0, BLOCK_Y)
    ks = start + tl.arange(0, BLOCK_Z)
    row_mask, col_mask = rows < X, cols < Y
    groups, steps = P // BLOCK_Z, (end - start) // BLOCK_Z
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * P + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * P + ks[None, :]
    sa_ptrs = sa_ptr + rows.to(tl.int64) * groups + start // BLOCK_Z
    sb_ptrs = sb_ptr + cols.to(tl.int64) * groups + start // BLOCK_Z
    acc = block_scaled_steps(
        a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, row_mask, col_mask, steps, MIXED, tl.float16, BLOCK_Z
    )
    out_ptrs = out_ptr + expert * X * Y + rows.to(tl.int64)[:, None] * Y + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def row_tiles(sizes: Sequence[int]) -> list[int]:
    """The 2d × 3d tile table, flattened: ``(expert, row_start, row_end)`` for every
    :data:`ROW_TILE` rows of every expert's tokens (experts without tokens have none)."""
    table, start = [], 0
    for expert, size in enumerate(sizes):
        for row in range(start, start + size, ROW_TILE):
            table += [expert, row, min(row + ROW_TILE, start + size)]
        start += size
    return table


def padded_starts(sizes: Sequence[int], group: int = GROUP) -> list[int]:
    """The k-grouped segment boundaries: ``E + 1`` offsets, expert ``e`` owning
    ``[starts[e], starts[e + 1])`` of ``ceil(T_e / group) · group`` padded tokens."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // group) * group)
    return starts


def max_row_tiles(tokens: int, experts: int) -> int:
    """The most tiles :func:`row_tiles` gives ``tokens`` tokens over ``experts`` experts
    (``Σ ceil(T_e / ROW_TILE) <= T / ROW_TILE + E``): the length of :func:`device_row_tiles`."""
    return -(-tokens // ROW_TILE) + experts


def device_row_tiles(sizes_E: torch.Tensor, tokens: int) -> torch.Tensor:
    """:func:`row_tiles` computed on ``sizes_E``'s device from the E token counts there
    (summing to ``tokens``), as an int32 tensor of :func:`max_row_tiles` entries: the table's
    tiles in order, then ``(0, 0, 0)`` entries, which own no rows (module docstring)."""
    experts = sizes_E.numel()
    sizes = sizes_E.to(torch.int64)
    tiles_E = (sizes + ROW_TILE - 1) // ROW_TILE
    tile_ends_E = torch.cumsum(tiles_E, 0)
    row_ends_E = torch.cumsum(sizes, 0)
    tile = torch.arange(max_row_tiles(tokens, experts), device=sizes.device)
    # The expert of each tile: the number of experts whose tiles all come before it (experts
    # without tokens end where the one before them ends, so they own no tile); E past the last.
    expert = torch.searchsorted(tile_ends_E, tile, right=True)
    owned = expert < experts
    expert = expert.clamp(max=experts - 1)
    first_tile = tile_ends_E[expert] - tiles_E[expert]
    row_start = row_ends_E[expert] - sizes[expert] + (tile - first_tile) * ROW_TILE
    row_end = torch.minimum(row_start + ROW_TILE, row_ends_E[expert])
    table = torch.stack([expert, row_start, row_end], dim=1) * owned[:, None]
    return table.to(torch.int32).reshape(-1)


def max_padded_tokens(tokens: int, experts: int, group: int = GROUP) -> int:
    """The most padded tokens :func:`padded_starts` gives ``tokens`` tokens over ``experts``
    experts: ``Σ ceil(T_e / g) · g <= T + E·(g - 1)``, a multiple of g, so at most that bound
    rounded down to one."""
    return (tokens + experts * (group - 1)) // group * group


def device_padded_starts(sizes_E: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """:func:`padded_starts` computed on ``sizes_E``'s device, as E + 1 int32 offsets."""
    padded_E = (sizes_E.to(torch.int64) + group - 1) // group * group
    starts = torch.cumsum(padded_E, 0)
    return torch.cat([starts.new_zeros(1), starts]).to(torch.int32)


def _check_group(group: int) -> None:
    if group not in GROUPS:
        raise ValueError(
            f"the grouped block-scaled GEMMs step through the contraction in groups of "
            f"{' or '.join(map(str, GROUPS))}, got group={group}"
        )


def _stages(group: int) -> int:
    """Software-pipeline stages: the dense block GEMM's choice (:mod:`~mt_fp8.kernels.block_gemm`:
    one fewer for 32-deep steps, whose tiles are a quarter the size)."""
    return 4 if group >= GROUP else 3


def _check_fp8(name: str, tensor: torch.Tensor, dim: int) -> None:
    if tensor.dim() != dim or tensor.element_size() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dim}-D FP8 tensor, got {tuple(tensor.shape)} "
            f"{tensor.dtype} (contiguous: {tensor.is_contiguous()})"
        )


def _check_scales(name: str, scale: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(scale.shape) != shape or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous float32 scales of shape {shape}, got "
            f"{tuple(scale.shape)} {scale.dtype}"
        )


def grouped_block_mm(
    a_TZ: torch.Tensor,
    scale_a: torch.Tensor,
    b_EYZ: torch.Tensor,
    scale_b: torch.Tensor,
    tiles: torch.Tensor,
    out_dtype: torch.dtype,
    bias_EY: torch.Tensor | None = None,
    group: int = GROUP,
    b_row_scales: bool = False,
) -> torch.Tensor:
    """The 2d × 3d GEMM (module docstring): ``a_TZ`` (T, Z) FP8 with (T, Z/g) scales,
    ``b_EYZ`` (E, Y, Z) FP8 with (E, Y/g, Z/g) block scales or, with ``b_row_scales``,
    (E, Y, Z/g) group scales, ``tiles`` the :func:`row_tiles` table as an int32 tensor on the
    operands' device; g = ``group`` (:data:`GROUPS`)."""
    _check_group(group)
    _check_fp8("a", a_TZ, 2)
    _check_fp8("b", b_EYZ, 3)
    (tokens, depth), (experts, cols, depth_b) = a_TZ.shape, b_EYZ.shape
    if depth != depth_b or depth % group or (cols % group and not b_row_scales):
        other = "" if b_row_scales else ", like b's other dim (square blocks),"
        raise ValueError(
            f"grouped_block_mm contracts a {tuple(a_TZ.shape)} with b {tuple(b_EYZ.shape)}: "
            f"the last dims must agree and{other} be multiples of {group}"
        )
    _check_scales("scale_a", scale_a, (tokens, depth // group))
    b_scale_rows = cols if b_row_scales else cols // group
    _check_scales("scale_b", scale_b, (experts, b_scale_rows, depth // group))
    if bias_EY is not None and tuple(bias_EY.shape) != (experts, cols):
        raise ValueError(f"bias must be (E, Y) = {(experts, cols)}, got {tuple(bias_EY.shape)}")
    out = torch.empty(tokens, cols, device=a_TZ.device, dtype=out_dtype)
    num_tiles = tiles.numel() // 3
    if num_tiles == 0:
        return out
    _rows_by_experts[(triton.cdiv(cols, COLUMN_TILE) * num_tiles,)](
        a_TZ,
        b_EYZ,
        scale_a,
        scale_b,
        bias_EY.contiguous() if bias_EY is not None else out,
        out,
        tiles,
        num_tiles,
        cols,
        depth,
        HAS_BIAS=bias_EY is not None,
        MIXED=a_TZ.dtype != b_EYZ.dtype,
        B_ROW_SCALES=b_row_scales,
        BLOCK_X=ROW_TILE,
        BLOCK_Y=COLUMN_TILE,
        BLOCK_Z=group,
        GROUP_X=8,
        num_warps=8,
        num_stages=_stages(group),
    )
    return out


def k_grouped_block_mm(
    a_XP: torch.Tensor,
    scale_a: torch.Tensor,
    b_YP: torch.Tensor,
    scale_b: torch.Tensor,
    starts: torch.Tensor,
    out_dtype: torch.dtype,
    group: int = GROUP,
) -> torch.Tensor:
    """The k-grouped GEMM (module docstring): ``(E, X, Y)`` from ``a_XP`` (X, P) and ``b_YP``
    (Y, P) FP8 in 1×g groups along the padded tokens (scales (X, P/g), (Y, P/g)), and
    ``starts`` the :func:`padded_starts` boundaries for ``group`` (E + 1 int32 on the operands'
    device); g = ``group`` (:data:`GROUPS`)."""
    _check_group(group)
    _check_fp8("a", a_XP, 2)
    _check_fp8("b", b_YP, 2)
    (rows, padded), (cols, padded_b) = a_XP.shape, b_YP.shape
    if padded != padded_b or padded % group:
        raise ValueError(
            f"k_grouped_block_mm contracts a {tuple(a_XP.shape)} with b {tuple(b_YP.shape)}: "
            f"the padded token dims must agree and be a multiple of {group}"
        )
    _check_scales("scale_a", scale_a, (rows, padded // group))
    _check_scales("scale_b", scale_b, (cols, padded // group))
    experts = starts.numel() - 1
    out = torch.empty(experts, rows, cols, device=a_XP.device, dtype=out_dtype)
    _k_grouped[(triton.cdiv(cols, COLUMN_TILE), triton.cdiv(rows, WGRAD_ROW_TILE), experts)](
        a_XP,
        b_YP,
        scale_a,
        scale_b,
        out,
        starts,
        rows,
        cols,
        padded,
        MIXED=a_XP.dtype != b_YP.dtype,
        BLOCK_X=WGRAD_ROW_TILE,
        BLOCK_Y=COLUMN_TILE,
        BLOCK_Z=group,
        num_warps=8,
        num_stages=_stages(group),
    )
    return out
