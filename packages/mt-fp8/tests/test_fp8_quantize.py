"""Quantize -> dequantize against float64 references, for every recipe, role and format.

Error bound used throughout (per element, in float64): round-to-nearest-even into m mantissa bits
errs by at most half an ulp, 2^-(m+1)·|x|, for scaled values in the normal range (2^-4 for E4M3,
2^-3 for E5M2); in the subnormal range the absolute error is at most half the subnormal spacing,
min_subnormal/2 in scaled units, i.e. ``s · min_subnormal / 2`` after dequantization. So
``|dq(x) - x| <= max(2^-(m+1)·|x|, s·min_subnormal/2)`` unless the element saturates.
"""

from __future__ import annotations

import pytest
import torch

from mt_fp8 import (
    BlockScaling,
    DelayedScaling,
    FormatConfig,
    FP8Format,
    MXFP8Scaling,
    RowwiseScaling,
    ScaleLayout,
    TensorRole,
    TensorwiseScaling,
    quantize,
)
from mt_fp8.quantized import MX_1X32, MX_1X32_CEIL

RECIPES = [
    DelayedScaling(),
    TensorwiseScaling(),
    RowwiseScaling(),
    BlockScaling(),
    MXFP8Scaling(),
    MXFP8Scaling(scale_rounding="floor"),
]
FORMATS = [FP8Format.E4M3, FP8Format.E5M2]


def expand_scale(q) -> torch.Tensor:
    br, bc = q.block
    return q.scale.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)


def error_bound(x: torch.Tensor, q) -> torch.Tensor:
    scale = expand_scale(q)
    return torch.maximum(q.fmt.relative_rounding_error * x.abs(), scale * q.fmt.min_subnormal / 2)


def sample(rows: int = 256, cols: int = 256, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Log-uniform magnitudes over 2^-12..2^4 exercise normal and subnormal scaled ranges.
    magnitude = torch.exp2(
        torch.empty(rows, cols, dtype=torch.float64).uniform_(-12, 4, generator=generator)
    )
    sign = torch.randint(0, 2, (rows, cols), generator=generator).double() * 2 - 1
    return magnitude * sign


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("role", list(TensorRole), ids=lambda r: r.name.lower())
def test_roundtrip_error_within_mantissa_bound(recipe, fmt, role):
    x = sample()
    layout = recipe.layout(role)
    q = quantize(x, fmt, layout)
    assert q.data.dtype == fmt.dtype and q.scale.dtype == torch.float32
    assert quantize(x.t(), fmt, layout).data.is_contiguous()  # row-major even from a view
    error = (q.dequantize(torch.float64) - x).abs()
    bound = error_bound(x, q)
    scaled = (x / expand_scale(q)).abs()
    saturated = scaled > fmt.max
    if layout.power_of_two and layout.round_up:
        # Rounded-up power-of-two scales: amax / s in (fmt.max / 2, fmt.max], nothing saturates.
        assert torch.all(torch.log2(q.scale) == torch.round(torch.log2(q.scale)))
        assert not saturated.any()
        amax = (x.abs() / expand_scale(q)).reshape(q.scale.shape[0], q.scale.shape[1], -1)
        assert (amax.amax(-1) > fmt.max / 2).all()
    elif layout.power_of_two:
        # MX scales put the block's amax in [2^emax, 2^(emax+1)); above fmt.max it saturates.
        assert saturated.any() or fmt is FP8Format.E5M2
        deq = q.dequantize(torch.float64)
        assert torch.equal(deq[saturated].abs(), fmt.max * expand_scale(q)[saturated])
        assert torch.all(torch.log2(q.scale) == torch.round(torch.log2(q.scale)))
    else:
        # Amax scaling maps the block max to fmt.max exactly (up to fp32 rounding of s).
        assert not (scaled > fmt.max * (1 + 2**-20)).any()
        saturated = scaled > fmt.max
    ok = error[~saturated] <= bound[~saturated] * (1 + 2**-20)
    assert ok.all(), f"max excess {(error - bound)[~saturated].max().item()}"


def test_transpose_is_exact_for_tensorwise_and_square_blocks():
    x = sample(256, 384)
    for layout in (ScaleLayout((-1, -1)), ScaleLayout((128, 128))):
        q = quantize(x, FP8Format.E4M3, layout)
        qt = q.transpose()
        assert qt.shape == (384, 256)
        assert torch.equal(qt.dequantize(torch.float64), q.dequantize(torch.float64).t())
    with pytest.raises(ValueError, match="cannot be transposed exactly"):
        quantize(x, FP8Format.E4M3, ScaleLayout((1, 128))).transpose()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_saturation_and_underflow_with_a_fixed_scale(fmt):
    scale = torch.tensor(1.0)
    x = torch.tensor([[fmt.max * 4, -fmt.max * 2, fmt.min_subnormal / 4, -fmt.min_subnormal / 3]])
    deq = quantize(x, fmt, scale=scale).dequantize(torch.float64)
    # Saturating cast: beyond the max clamps to +-max; below half the smallest subnormal -> 0.
    assert deq.tolist() == [[fmt.max, -fmt.max, 0.0, -0.0]]


def test_block_scaling_beats_tensorwise_on_outliers():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, dtype=torch.float64, generator=generator)
    rows = torch.randint(0, 256, (4,), generator=generator)
    cols = torch.randint(0, 512, (4,), generator=generator)
    x[rows, cols] = 1e6
    bulk = x.abs() < 1e6
    errors = {}
    for name, layout in (("tensorwise", ScaleLayout((-1, -1))), ("block", ScaleLayout((1, 128)))):
        deq = quantize(x, FP8Format.E4M3, layout).dequantize(torch.float64)
        errors[name] = ((deq - x)[bulk].norm() / x[bulk].norm()).item()
    # The outliers set the tensorwise scale to 1e6/448, so N(0,1) values fall below E4M3's
    # subnormal spacing (2^-9 · 2232 ~ 4.4) and mostly flush to zero: error ~ 100%. Block scales
    # confine that to the <= 4 groups (of 1024) holding an outlier; elsewhere the error is the
    # plain rounding error (RMS ~ 2^-4/sqrt(3) ~ 0.036 at most).
    assert errors["tensorwise"] > 0.5
    assert errors["block"] < 0.1, errors


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_rounded_up_power_of_two_scales_are_the_smallest_that_do_not_saturate(fmt):
    # Exact powers of two times fmt.max, their neighbours, tiny and zero blocks: the boundary
    # cases of ceil(log2(amax / fmt.max)).
    amax = torch.tensor(
        [fmt.max, fmt.max * 2, fmt.max * 2 * (1 + 2**-23), fmt.max * (1 - 2**-23), 1e-3, 1e-40, 0.0]
    )
    x = torch.zeros(len(amax), 32)
    x[:, 0] = amax
    scale = quantize(x, fmt, MX_1X32_CEIL).scale[:, 0].double()
    reference = torch.exp2(torch.ceil(torch.log2(amax.double() / fmt.max))).clamp(2.0**-126)
    reference[amax == 0] = 1.0
    assert torch.equal(scale, reference), (scale, reference)


def test_zero_tensor_quantizes_to_zero_with_unit_scale():
    q = quantize(torch.zeros(4, 64), FP8Format.E4M3, ScaleLayout((1, 32), power_of_two=True))
    assert torch.equal(q.scale, torch.ones(4, 2))
    assert torch.equal(q.dequantize(), torch.zeros(4, 64))


def test_bad_inputs_have_clear_messages():
    with pytest.raises(ValueError, match="blocks of 1x128 to divide the tensor shape 4x100"):
        quantize(torch.randn(4, 100), FP8Format.E4M3, ScaleLayout((1, 128)))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 4), FP8Format.E4M3)
    with pytest.raises(ValueError, match=r"got torch\.int64"):
        quantize(torch.ones(4, 4, dtype=torch.int64), FP8Format.E4M3)
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
        FormatConfig(input="e3m4")
    with pytest.raises(
        ValueError, match="amax_compute_algo must be 'max' or 'most_recent', got 'mean'"
    ):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="multiple of 16"):
        BlockScaling(group=100)
    with pytest.raises(ValueError, match="must be 32"):
        MXFP8Scaling(block=64)
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1, got 0"):
        DelayedScaling(amax_history_len=0)


def test_mxfp8_scale_rounding_picks_the_layout_and_rejects_other_values():
    assert MXFP8Scaling().layout(TensorRole.GRAD_OUTPUT) == MX_1X32_CEIL
    assert MXFP8Scaling(scale_rounding="floor").layout(TensorRole.INPUT) == MX_1X32
    with pytest.raises(ValueError, match="scale_rounding must be 'ceil' or 'floor', got 'up'"):
        MXFP8Scaling(scale_rounding="up")
    with pytest.raises(ValueError, match="round_up applies to power-of-two scales only"):
        ScaleLayout((1, 32), round_up=True)
