"""Numerical hazards of scale computation, each reproduced: zero blocks, tiny and huge amaxes,
non-finite inputs, zero gradient rows (padding / ignore_index), the FP8 weight cache, one-row
rowwise GEMMs. ``cuda`` cases (``gpu`` marker) run the Triton quantize kernel and cuBLAS.

The rules under test (:func:`mt_fp8.quantized.scale_from_amax`): a zero block has scale 1; a
scale is never below 2^-126, the smallest normal fp32 (a subnormal one becomes 0 under
flush-to-zero arithmetic, and x / 0 is inf or NaN); a block holding inf or NaN has scale NaN,
so the non-finite value shows up in the GEMM output instead of being saturated away.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from test_fp8_linear import product_bound

import mt_fp8.gemm as gemm_module
from mt_fp8 import (
    BlockScaling,
    DelayedScaling,
    FP8Format,
    FP8Linear,
    MXFP8Scaling,
    RowwiseScaling,
    ScaleLayout,
    TensorwiseScaling,
    clear_fp8_weight_caches,
    quantize,
    scale_from_amax,
    update_fp8_scales,
)
from mt_fp8.ops import quantize_transpose_amax

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FORMATS = [FP8Format.E4M3, FP8Format.E5M2]
LAYOUTS = {
    "tensorwise": ScaleLayout((-1, -1)),
    "rowwise": ScaleLayout((1, -1)),
    "group1x128": ScaleLayout((1, 128)),
    "block128": ScaleLayout((128, 128)),
    "mx1x32": ScaleLayout((1, 32), power_of_two=True),
}
RECIPES = [DelayedScaling(), TensorwiseScaling(), RowwiseScaling(), BlockScaling(), MXFP8Scaling()]
TINY = torch.finfo(torch.float32).tiny  # 2^-126
FP32_MAX = torch.finfo(torch.float32).max


def expand(q) -> torch.Tensor:
    br, bc = q.block
    return q.scale.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_scale_from_amax_edge_values(fmt):
    tiny_amaxes = [2.0**-149, 1e-40, fmt.max * 2.0**-127, fmt.max * 2.0**-126]
    amax = torch.tensor([0.0, *tiny_amaxes, 1.0, FP32_MAX, math.inf, math.nan])
    scale = scale_from_amax(amax, fmt)
    assert scale[0] == 1.0  # zero block
    # Below fmt.max * 2^-126 the scale stops at 2^-126 exactly (normal, nonzero under FTZ).
    assert scale[1:5].tolist() == [TINY] * 4
    assert scale[5] == torch.tensor(1.0) / torch.tensor(fmt.max)
    assert scale[6] == torch.tensor(FP32_MAX) / fmt.max and torch.isfinite(scale[6])
    assert scale[7:].isnan().all()  # inf and NaN blocks
    pow2 = scale_from_amax(amax, fmt, power_of_two=True)
    assert pow2[0] == 1.0 and pow2[1:5].tolist() == [TINY] * 4
    assert pow2[5] == 2.0**-fmt.emax and pow2[7:].isnan().all()
    # Delayed scaling's margin cannot push a scale past the fp32 maximum into inf.
    assert scale_from_amax(torch.tensor(FP32_MAX), fmt, margin=16) == FP32_MAX


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows_and_blocks_keep_unit_scale(layout_name, device):
    layout = LAYOUTS[layout_name]
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(device)
    x[::3] = 0.0  # padding / ignore_index rows
    x[128:, 128:] = 0.0  # a whole 128x128 block
    q = quantize(x, FP8Format.E5M2, layout)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    (groups, hgroups), (br, bc) = q.scale.shape, q.block
    zero_GH = (x == 0).reshape(groups, br, hgroups, bc).all(dim=3).all(dim=1)
    assert zero_GH.any() or layout_name == "tensorwise"
    assert (q.scale[zero_GH] == 1.0).all()
    assert not q.dequantize()[x == 0].any()
    if layout_name == "tensorwise":
        q_fused, q_t, _ = quantize_transpose_amax(x, FP8Format.E5M2)
        assert torch.equal(q_fused.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(q_t.data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
        all_zero = quantize_transpose_amax(torch.zeros(64, 32, device=device), FP8Format.E4M3)
        assert all_zero[0].scale.item() == 1.0 and all_zero[2].item() == 0.0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_tiny_amax_keeps_scales_normal_and_values_accurate(fmt, layout_name, device):
    layout = LAYOUTS[layout_name]
    generator = torch.Generator().manual_seed(1)
    sign = torch.randint(0, 2, (128, 128), generator=generator).double() * 2 - 1
    # Magnitudes from 2^-149 (the smallest fp32 subnormal): up to 2^-118 everywhere, where every
    # block's amax / fmt.max would be subnormal (fmt.max * 2^-126 >= 2^-117.2), then with a
    # bottom half up to 2^-100, around the floor.
    below = torch.randint(-149, -117, (128, 128), generator=generator).double()
    mixed = below.clone()
    mixed[64:] = torch.randint(-149, -99, (64, 128), generator=generator).double()
    for exponent in (below, mixed):
        x = (sign * torch.exp2(exponent)).float().to(device)
        q = quantize(x, fmt, layout)
        assert (q.scale >= TINY).all() and torch.isfinite(q.scale).all()
        x64, scale = x.double(), expand(q)
        assert exponent is mixed or (scale == TINY).all()
        scaled = (x64 / scale).abs()
        assert (scaled[scale == TINY] <= fmt.max).all()  # the floor never makes values saturate
        # The usual bound (test_fp8_quantize): half an ulp relative in the normal range, half a
        # subnormal step absolute below it; MX blocks may saturate at their top, as specified.
        kept = scaled <= fmt.max
        bound = torch.maximum(
            fmt.relative_rounding_error * x64.abs(), scale * fmt.min_subnormal / 2
        )
        error = (q.dequantize(torch.float64) - x64).abs()
        assert (error[kept] <= bound[kept] * (1 + 2**-20)).all()
        assert torch.isfinite(q.dequantize()).all()
        if layout_name == "tensorwise":
            q_fused, q_t, _ = quantize_transpose_amax(x, fmt)
            assert torch.equal(q_fused.scale, q.scale)
            assert torch.equal(q_fused.data.view(torch.uint8), q.data.view(torch.uint8))
            assert torch.equal(
                q_t.data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8)
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_huge_amax_gives_finite_scales(dtype, layout_name, device):
    layout = LAYOUTS[layout_name]
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(2)).to(device)
    x = (x / x.abs().max() * torch.finfo(dtype).max).to(dtype)  # amax = the dtype's maximum
    q = quantize(x, FP8Format.E4M3, layout)
    assert torch.isfinite(q.scale).all()
    deq = q.dequantize(torch.float64)
    assert torch.isfinite(deq).all()
    x64 = x.double()
    normal = (x64 / expand(q)).abs() >= FP8Format.E4M3.min_normal
    # MX rounds the scale down to a power of two: the block top saturates, up to 1/8 relative.
    rel = 1 / 8 if layout.power_of_two else FP8Format.E4M3.relative_rounding_error
    assert ((deq - x64).abs()[normal] <= rel * x64.abs()[normal] * (1 + 2**-20)).all()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_input_makes_its_block_nan(bad, layout_name, device):
    layout = LAYOUTS[layout_name]
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(3)).to(device)
    x[5, 7] = bad
    q = quantize(x, FP8Format.E4M3, layout)
    br, bc = q.block
    bad_block = (5 // br, 7 // bc)
    assert q.scale[bad_block].isnan()
    others = torch.ones_like(q.scale, dtype=torch.bool)
    others[bad_block] = False
    assert torch.isfinite(q.scale[others]).all()
    deq = q.dequantize()
    # The whole block reads as NaN (never a saturated finite value); other blocks are untouched.
    assert deq[5, 7].isnan() and deq[(5 // br) * br, (7 // bc) * bc].isnan()
    assert torch.isfinite(deq).sum() == x.numel() - br * bc
    if layout_name == "tensorwise":
        q_fused, q_t, amax = quantize_transpose_amax(x, FP8Format.E4M3)
        assert amax.item() == math.inf  # NaN is reported as +inf on every path
        assert q_fused.scale.isnan().all() and q_t.scale.isnan().all()


@pytest.mark.parametrize("backend", ["emulate", "scaled_mm"])
@pytest.mark.parametrize(
    "recipe", [TensorwiseScaling(), RowwiseScaling(), BlockScaling()], ids=lambda r: r.name
)
def test_non_finite_input_reaches_the_layer_output(recipe, backend):
    if backend == "scaled_mm" and isinstance(recipe, BlockScaling):
        pytest.skip("torch._scaled_mm takes no block scales")
    rowwise_cpu = (
        isinstance(recipe, RowwiseScaling) and not gemm_module.cpu_scaled_mm_takes_rowwise()
    )
    if backend == "scaled_mm" and rowwise_cpu:
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales")
    torch.manual_seed(0)
    layer = FP8Linear(128, 128, recipe=recipe, backend=backend)
    x = torch.randn(256, 128)
    x[9, 3] = math.inf
    y = layer(x)
    if isinstance(recipe, TensorwiseScaling):
        assert y.isnan().all()
    else:  # row 9's scales are NaN: that row of the output, and no other
        assert y[9].isnan().all()
        assert torch.isfinite(torch.cat([y[:9], y[10:]])).all()


def test_delayed_scaling_saturates_inf_and_ignores_non_finite_history():
    recipe = DelayedScaling(amax_history_len=2)
    torch.manual_seed(0)
    layer = FP8Linear(64, 32, recipe=recipe, bias=False)
    x = torch.randn(16, 64)
    layer(x).sum().backward()
    update_fp8_scales(layer, recipe)
    scale_after_clean_step = layer.fp8_meta.scale.clone()
    bad = x.clone()
    bad[0, 0] = math.inf
    y = layer(bad)
    # With a given scale, inf saturates like any out-of-range value: finite output, counted.
    assert torch.isfinite(y).all()
    assert layer.fp8_meta.amax_history[0, 0] == math.inf  # the record shows what happened
    y.sum().backward()
    update_fp8_scales(layer, recipe)
    # The inf entry is ignored: the input scale comes from the clean step's amax in the window,
    # the same as before (an inf scale would quantize every later input to zero).
    assert torch.equal(layer.fp8_meta.scale, scale_after_clean_step)
    recent = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    layer.fp8_meta.amax_history.zero_()
    layer.fp8_meta.amax_history[0, 0] = math.nan
    update_fp8_scales(layer, recent)
    assert torch.equal(layer.fp8_meta.scale, scale_after_clean_step)  # no finite amax: kept


def test_delayed_scaling_tiny_amax_gives_a_normal_scale():
    recipe = DelayedScaling(amax_history_len=1)
    layer = FP8Linear(64, 32, recipe=recipe)
    layer.fp8_meta.amax_history[0] = torch.tensor([1e-44, 0.0, 1e-40])
    update_fp8_scales(layer, recipe)
    assert layer.fp8_meta.scale.tolist() == [TINY, 1.0, TINY]  # weight amax 0: old scale kept


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("device", DEVICES)
def test_zero_gradient_rows_give_finite_exact_gradients(recipe, device):
    torch.manual_seed(0)
    layer = FP8Linear(128, 256, recipe=recipe, device=device)
    x = torch.randn(200, 128, device=device, requires_grad=True)
    dy = torch.randn(200, 256, device=device)
    dy[::4] = 0.0  # ignore_index / padding tokens get no gradient
    layer(x).backward(dy)
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert torch.equal(x.grad[::4], torch.zeros_like(x.grad[::4]))  # 0 · w is exactly 0
    if not isinstance(recipe, DelayedScaling):  # delayed runs this first step on unit scales
        e4, e5 = FP8Format.E4M3, FP8Format.E5M2
        x64, dy64 = x.detach().double().cpu(), dy.double().cpu()
        mx = isinstance(recipe, MXFP8Scaling)
        # The same per-element bound as test_fp8_linear's float64 comparison.
        bound = product_bound(dy64.t().contiguous(), e5, x64.t().contiguous(), e4, mx)
        assert ((layer.weight.grad.double().cpu() - dy64.t() @ x64).abs() <= bound).all()
    layer.zero_grad()
    x.grad = None
    layer(x).backward(torch.zeros_like(dy))  # a fully masked micro-batch
    assert not x.grad.any() and not layer.weight.grad.any()


def test_weight_cache_is_keyed_on_the_weight_object():
    torch.manual_seed(0)
    layer = FP8Linear(64, 64, recipe=TensorwiseScaling(), bias=False)
    x = torch.randn(8, 64)
    first = layer(x)
    old = layer.weight
    # A new parameter over the same memory with a fresh version counter (what a reallocation
    # at a freed address, FSDP unsharding or load_state_dict(assign=True) can produce), then
    # written through .data, which bumps no version: same data_ptr, same _version as cached.
    alias = torch.empty(0).set_(old.untyped_storage(), 0, old.shape, old.stride())
    with torch.no_grad():
        while alias._version < old._version:
            alias.add_(0.0)  # align the version counters; values unchanged
    layer.weight = torch.nn.Parameter(alias)
    assert layer.weight.data_ptr() == old.data_ptr() and layer.weight._version == old._version
    layer.weight.data.mul_(2.0)
    # Scaling by 2 scales the FP8 weight's scale by 2 exactly and leaves its bytes unchanged.
    assert torch.equal(layer(x), 2 * first)  # requantized, not the stale cached weight
    # A .data write to the same parameter object is the documented blind spot of the cache...
    layer.weight.data.mul_(0.5)
    assert torch.equal(layer(x), 2 * first)
    # ...and clear_fp8_weight_caches is the documented way out.
    clear_fp8_weight_caches(layer)
    assert torch.equal(layer(x), first)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_weight_cache_follows_optimizer_steps(fused):
    # Fused AdamW updates the weights in place without bumping their version counter (torch 2.11
    # and 2.13); a cache keyed on the version alone kept serving the first step's FP8 weights. Any
    # torch optimizer step must invalidate it, while micro-batches between steps still share it.
    torch.manual_seed(0)
    layer = FP8Linear(64, 32, recipe=TensorwiseScaling())
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=fused)
    x = torch.randn(16, 64)
    for _ in range(3):
        layer(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        fresh = FP8Linear.from_linear(layer, recipe=TensorwiseScaling())  # same weights, no cache
        assert torch.equal(layer(x), fresh(x))
    cached = layer.fp8_weight_cache.entry.weight
    layer(x)  # no step since: the same cached FP8 weight object is served
    assert layer.fp8_weight_cache.entry.weight is cached


HOOK_CHECK = """
import torch
import mt_fp8
from mt_fp8.weight_cache import optimizer_steps

param = torch.nn.Parameter(torch.ones(16, 16))
param.grad = torch.ones(16, 16)
optimizer = torch.optim.SGD([param], lr=0.1)
optimizer.step()
after_import = optimizer_steps()
mt_fp8.FP8Linear(16, 16)
mt_fp8.FP8Linear(16, 16)  # a second layer must not register a second hook
optimizer.step()
print(after_import, optimizer_steps())
"""


def test_optimizer_step_hook_is_installed_by_the_first_layer_not_by_import():
    # A fresh interpreter: importing mt_fp8 must register no global hook; creating FP8 layers
    # installs exactly one, which counts every step of any torch optimizer.
    result = subprocess.run(
        [sys.executable, "-c", HOOK_CHECK], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["0", "1"]


def test_rowwise_single_token_runs_the_fast_path():
    if not gemm_module.cpu_scaled_mm_takes_rowwise():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales")
    torch.manual_seed(0)
    layer = FP8Linear(64, 32, recipe=RowwiseScaling(), backend="fast")
    x = torch.randn(1, 64)
    # One row means one scale, but the layout is rowwise: it must pair with the rowwise weight.
    y = layer(x)
    layer.backend = "emulate"
    assert torch.allclose(y, layer(x), rtol=1e-5, atol=1e-6)
