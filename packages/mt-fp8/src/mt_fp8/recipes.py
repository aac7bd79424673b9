"""Scaling recipes: how each tensor of an FP8 GEMM gets its scales.

A linear layer ``y_MN = x_MK · w_NKᵀ`` runs three GEMMs, each contracting over the last axis of
both quantized operands (``a_XZ · b_YZᵀ``):

=========  ===============  ==============  ================
GEMM       left operand     right operand   contraction axis
=========  ===============  ==============  ================
forward    x (M, K)         w (N, K)        K
dgrad      dy (M, N)        wᵀ (K, N)       N
wgrad      dyᵀ (N, M)       xᵀ (K, M)       M
=========  ===============  ==============  ================

so each role is quantized in two orientations (its forward/dgrad use and
its transposed one, with the same layout shape). The recipes, with ``s`` the dequantization scale (``x ≈ q · s``) and
``fmt.max`` the format's largest value (448 for E4M3, 57344 for E5M2):

* **Delayed scaling** (Transformer Engine's default): one scale per tensor, from the past.
  Each step records ``amax_t = max|x|``; the history keeps the last ``amax_history_len``
  values; after the step ``amax = max(history)`` (or the most recent) is reduced with MAX over
  the caller's process group and ``s = amax · 2^margin / fmt.max``. Values above ``fmt.max · s``
  saturate, so the margin trades precision for headroom.
* **Tensorwise (current) scaling**: ``s = max|x| / fmt.max`` of this tensor, now. For a tensor
  sharded over tensor-parallel ranks, the layer can MAX-reduce ``max|x|`` over the caller's
  process group first (as Transformer Engine's current scaling does), so that all ranks share
  the whole tensor's scale; see :mod:`mt_fp8.linear_plan`.
* **Rowwise scaling**: one scale per row of the left operand and per column of the right
  (per output row/column of the GEMM): ``s_r = max_k |x_rk| / fmt.max``.
* **Block scaling** (DeepSeek-V3): activations and gradients in 1×128 groups along the
  contraction axis, weights in 128×128 blocks, fp32 scales ``s_b = max_b |x| / fmt.max``;
  E4M3 for every role by default (DeepSeek-V3's choice; the other recipes default to hybrid).
  The wgrad GEMM contracts over tokens, so it needs x and dy grouped 128×1: they are requantized
  from high precision in that orientation; weights' square blocks transpose exactly.
* **MXFP8** (OCP Microscaling spec v1.0): 1×32 groups along the contraction axis in every GEMM,
  power-of-two scales stored exactly as E8M0 (exponent in [-127, 127]): by default
  ``2^ceil(log2(amax / fmt.max))``, so nothing saturates (as NVIDIA's MXFP8 training recipe
  rounds; it trained closer to bf16 than the spec's rounding, docs/performance.md);
  ``scale_rounding="floor"`` gives the spec's ``2^(floor(log2 amax) - emax_elem)``, where
  elements whose scaled magnitude exceeds ``fmt.max`` saturate.

In every recipe a block of zeros gets ``s = 1``, scales never go below ``2^-126`` (the smallest
normal fp32), and a block holding ``inf`` or NaN gets ``s = NaN`` (its values dequantize to NaN);
see :func:`mt_fp8.quantized.scale_from_amax`. Each recipe is a frozen dataclass validated in
``__post_init__``; ``layout(role)`` gives the :class:`~mt_fp8.quantized.ScaleLayout` to quantize
a role with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mt_fp8.formats import FormatConfig, TensorRole
from mt_fp8.quantized import MX_1X32, MX_1X32_CEIL, ROWWISE, TENSORWISE, ScaleLayout


@dataclass(frozen=True)
class Recipe:
    """Base class: the per-role formats every recipe shares."""

    name: ClassVar[str] = "base"
    formats: FormatConfig = field(default_factory=FormatConfig)
    """FP8 format per tensor role (default hybrid: E4M3 forward, E5M2 gradients)."""

    def __post_init__(self) -> None:
        if not isinstance(self.formats, FormatConfig):
            raise ValueError(
                f"{type(self).__name__}.formats must be a FormatConfig, got {self.formats!r}"
            )

    def layout(self, role: TensorRole) -> ScaleLayout:
        """Scale layout for ``role`` quantized along its contraction axis."""
        raise NotImplementedError

    def min_divisor(self, role: TensorRole) -> tuple[int, int]:
        """(rows, columns) multiples a role's 2-D tensor needs for this recipe's layout."""
        block = self.layout(role).block
        return (max(block[0], 1), max(block[1], 1))


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history (see the module docstring)."""

    name: ClassVar[str] = "delayed"
    amax_history_len: int = 16
    """Number of past steps' amaxes kept per tensor (Transformer Engine defaults to 1024)."""
    amax_compute_algo: str = "max"
    """How the history becomes one amax: ``"max"`` over the window or ``"most_recent"``."""
    margin: int = 0
    """Headroom in powers of two: ``s = amax · 2^margin / fmt.max``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                f"DelayedScaling.amax_history_len must be an int >= 1, got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max' or 'most_recent', "
                f"got {self.amax_compute_algo!r}"
            )
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be an int >= 0, got {self.margin!r}")

    def layout(self, role: TensorRole) -> ScaleLayout:
        return TENSORWISE


@dataclass(frozen=True)
class TensorwiseScaling(Recipe):
    """Current scaling: one scale per tensor from its own amax, now."""

    name: ClassVar[str] = "tensorwise"

    def layout(self, role: TensorRole) -> ScaleLayout:
        return TENSORWISE


@dataclass(frozen=True)
class RowwiseScaling(Recipe):
    """One scale per row of the left operand and per column of the right operand."""

    name: ClassVar[str] = "rowwise"

    def layout(self, role: TensorRole) -> ScaleLayout:
        return ROWWISE


@dataclass(frozen=True)
class BlockScaling(Recipe):
    """DeepSeek-V3 block scaling: 1×``group`` activation/gradient groups, square weight blocks.

    Formats default to E4M3 for every role, as DeepSeek-V3 trains: with a scale per 128 values
    the gradients do not need E5M2's range, and E4M3's extra mantissa bit halves their rounding
    error. (It is also what cuBLAS's blockwise GEMMs take on Hopper.) Pass
    ``formats=FormatConfig()`` for the hybrid E5M2 gradients.
    """

    name: ClassVar[str] = "block"
    formats: FormatConfig = field(default_factory=FormatConfig.all_e4m3)
    group: int = 128
    """Group length along the contraction axis for activations and gradients (1×group)."""
    weight_block: int = 128
    """Side of the square weight blocks (weight_block×weight_block)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for attr in ("group", "weight_block"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 16 or value % 16:
                raise ValueError(
                    f"BlockScaling.{attr} must be a positive multiple of 16 (FP8 GEMM tiles), "
                    f"got {value!r}"
                )

    def layout(self, role: TensorRole) -> ScaleLayout:
        if role is TensorRole.WEIGHT:
            return ScaleLayout((self.weight_block, self.weight_block))
        return ScaleLayout((1, self.group))


@dataclass(frozen=True)
class MXFP8Scaling(Recipe):
    """OCP MXFP8: 1×32 groups with power-of-two (E8M0) scales for every tensor."""

    name: ClassVar[str] = "mxfp8"
    block: int = 32
    """Elements sharing one E8M0 scale; the OCP spec fixes it at 32."""
    scale_rounding: str = "ceil"
    """``"ceil"``: the smallest power of two at least ``amax / fmt.max`` (nothing saturates;
    NVIDIA's MXFP8 training recipe rounds so); ``"floor"``: the OCP spec's
    ``2^(floor(log2 amax) - emax)``, which saturates each block's top values at ``fmt.max``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block != 32:
            raise ValueError(
                f"MXFP8Scaling.block must be 32 (the OCP microscaling spec's block), got {self.block!r}"
            )
        if self.scale_rounding not in ("ceil", "floor"):
            raise ValueError(
                f"MXFP8Scaling.scale_rounding must be 'ceil' or 'floor', got {self.scale_rounding!r}"
            )

    def layout(self, role: TensorRole) -> ScaleLayout:
        return MX_1X32_CEIL if self.scale_rounding == "ceil" else MX_1X32


RECIPES: dict[str, type[Recipe]] = {
    cls.name: cls
    for cls in (DelayedScaling, TensorwiseScaling, RowwiseScaling, BlockScaling, MXFP8Scaling)
}


def recipe_from_name(name: str, **kwargs: object) -> Recipe:
    """Build a recipe by name (``"delayed"``, ``"tensorwise"``, ``"rowwise"``, ``"block"``, ``"mxfp8"``)."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid recipes: {', '.join(RECIPES)}")
    return RECIPES[name](**kwargs)  # type: ignore[arg-type]
