"""The grouped block-scaled path of FP8GroupedLinear (mt_fp8.grouped_block), under block
scaling (1×128 groups, 128×128 weight blocks) and MXFP8 (1×32 groups everywhere), against the
per-expert loop and against float64.

CPU cases run the Triton kernels (GEMMs and quantizers) in Triton's interpreter, only under
``TRITON_INTERPRET=1`` (otherwise they skip)::

    TRITON_INTERPRET=1 pytest -q packages/mt-fp8/tests/test_fp8_grouped_block.py

The ``gpu`` cases run the real kernels at a DeepSeek-V2-Lite expert shape (64 experts, K 2048,
N 1408 = 11 · 128)::

    pytest -q -m gpu packages/mt-fp8/tests/test_fp8_grouped_block.py

Operands: the grouped path's FP8 bytes and scales equal the loop's quantizers' per expert (the
padded wgrad segments included), so the two differ only in how the GEMMs sum. Bounds, per output
element, against the float64 product ``Σ_k a'_k b'_k`` of the dequantized operands
(``a' = a_q · s_a``; ``M = Σ_k |a'_k||b'_k|``), with ``u = 2^-24``:

* Grouped kernel in the interpreter: each g-step (g = 128 block, 32 MXFP8) sums g exact products
  of FP8 values in fp32 (at most (g - 1)·u·M over the step), its two scale products round twice
  (2u; MX's power-of-two scales not at all), and the fp32 accumulator adds Z/g <= 8 steps (8u):
  under 137·u·M, bounded by 2^-16·M = 256·u·M.
* Grouped kernel on a GPU: FP8 tensor cores keep about 14 bits within a 128-step (DeepSeek-V3
  report, §3.3.2): 2^-12·M, the bound of the dense block GEMM (test_fp8_block_fast.py), which
  a 32-step keeps too; the fp32 promotion adds (Z/g)·u·M, negligible.
* The loop on the CPU (emulated: operands dequantized to fp32, one rounding each, then an fp32
  matmul over Z): (Z + 2)·u·M. On a GPU (backend "triton", the dense Triton block GEMM, 1×g
  steps as the grouped kernel's): 2^-12·M.
* Outputs: one rounding from fp32 into the output dtype, and with the bias one fp32 rounding of
  the sum: eps·(|product| + |reference|) covers both (eps = 2^-23 for fp32, 2^-7 for bf16; each
  rounding is at most eps/2 of its value).

Grouped and loop are each checked against float64 and against each other (the sum of the two
bounds). The bias gradient is one fp32 sum per expert on both paths: equal bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mt_fp8.grouped as grouped_module
from mt_fp8 import (
    BlockScaling,
    FormatConfig,
    FP8GroupedLinear,
    MXFP8Scaling,
    TensorRole,
    TensorwiseScaling,
    WeightGradSink,
    quantize,
)
from mt_fp8.grouped import (
    BLOCK_GROUPED_MIN_EXPERTS,
    block_loop_reason,
    fp8_grouped_linear,
    grouped_gemm_reason,
)
from mt_fp8.grouped_block import _TokenSegments, fp8_block_grouped_linear
from mt_fp8.testing import run_without_synchronizing, watch_unheld

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
E4M3, HYBRID = FormatConfig.all_e4m3(), FormatConfig()
FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(HYBRID, id="hybrid")]

# Uneven experts: fewer than 128 tokens, none (in the middle and last), exactly 128, and 128 plus
# a partial group.
SIZES = [37, 0, 128, 140, 0]
K = N = 256
# MXFP8: fewer than 32 tokens, none (middle and last), 70 and 45 (not multiples of 32), 128. N is
# no multiple of 128 (MXFP8 layers need 32): the kernels' last column tile is partial.
MX_SIZES = [19, 0, 70, 128, 45, 0]
MX_K, MX_N = 128, 96
RECIPES = ("block", "mxfp8")
SHAPES = {"block": (SIZES, K, N), "mxfp8": (MX_SIZES, MX_K, MX_N)}
"""Per recipe: the group sizes, K and N of the CPU cases."""
GPU_E, GPU_K, GPU_N = 64, 2048, 1408  # DeepSeek-V2-Lite's routed experts (1408 = 11 · 128)
U = 2.0**-24


def gpu_sizes() -> list[int]:
    """64 skewed group sizes, seeded, with the edge cases of SIZES among them."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(GPU_E, generator=generator), 0)
    draws = torch.multinomial(probs, 6000, replacement=True, generator=generator)
    sizes = torch.bincount(draws, minlength=GPU_E).tolist()
    sizes[:4] = [0, 5, 128, 256]
    return sizes


def kernels():
    from mt_fp8.kernels import grouped_block_gemm

    return grouped_block_gemm


def make_recipe(name, formats):
    return BlockScaling(formats=formats) if name == "block" else MXFP8Scaling(formats=formats)


def group_of(recipe):
    return recipe.layout(TensorRole.INPUT).block[1]


def make_layer(experts, k, n, formats, dtype, device, backend="auto", bias=True, recipe="block"):
    torch.manual_seed(0)
    layer = FP8GroupedLinear(
        experts,
        k,
        n,
        bias=bias,
        recipe=make_recipe(recipe, formats),
        backend=backend,
        dtype=dtype,
        device=device,
    )
    with torch.no_grad():  # experts of different ranges, so that their block scales differ
        layer.weight.mul_(torch.logspace(-1, 1, experts, device=device)[:, None, None].to(dtype))
    return layer


def make_inputs(sizes, k, n, dtype, device):
    generator = torch.Generator().manual_seed(1)
    scale_T = torch.logspace(-2, 2, len(sizes)).repeat_interleave(torch.tensor(sizes))[:, None]
    x = torch.randn(sum(sizes), k, generator=generator) * scale_T
    dy = torch.randn(sum(sizes), n, generator=generator)
    return x.to(device, dtype), dy.to(device, dtype)


def run(layer, x, dy, sizes, through, autocast=False):
    """y, dx, dW, db of one forward + backward ``through`` "function" (the grouped block path
    called directly: on the CPU the layer loops) or "layer" (the path grouped_gemm_reason
    picks)."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        if through == "function":
            plan = layer.linear_plan(x, layer.grouped_weight_cache)
            y = fp8_block_grouped_linear(x, layer.weight, layer.bias, sizes, plan)
        else:
            y = layer(x, sizes)
    y.backward(dy.to(y.dtype))
    db = None if layer.bias is None else layer.bias.grad
    return {"y": y, "dx": x.grad, "dw": layer.weight.grad, "db": db}


def dequantized(x, fmt, layout):
    return quantize(x, fmt, layout).dequantize(torch.float64)


def references(layer, x, dy, sizes):
    """Per expert: the float64 products of the loop's dequantized FP8 operands, their
    magnitudes ``Σ|a'||b'|`` and contraction lengths, for y (with bias), dx and dW."""
    formats, recipe = layer.recipe.formats, layer.recipe
    group, weight_layout = group_of(recipe), recipe.layout(TensorRole.WEIGHT)
    layouts = {role: recipe.layout(role) for role in (TensorRole.INPUT, TensorRole.GRAD_OUTPUT)}
    weight = layer.weight.detach()
    y_e = torch.zeros(0, weight.shape[1], dtype=torch.float64, device=x.device)
    dx_e = torch.zeros(0, weight.shape[2], dtype=torch.float64, device=x.device)
    out = {name: ([], [], []) for name in ("y", "dx", "dw")}
    start = 0
    for e, size in enumerate(sizes):
        x_e, dy_e = x[start : start + size], dy[start : start + size]
        start += size
        if size == 0:  # no rows of y and dx; dW_e = 0 exactly
            zeros = torch.zeros(weight.shape[1:], dtype=torch.float64, device=x.device)
            for name, part in (("y", y_e), ("dx", dx_e), ("dw", zeros)):
                for i in range(3):
                    out[name][i].append(part)
            continue
        w = dequantized(weight[e], formats.weight, weight_layout)
        # Wᵀ: square blocks transpose exactly; MXFP8 quantizes W_eᵀ afresh along N.
        square = weight_layout.block[0] == weight_layout.block[1]
        w_t = w.t() if square else dequantized(weight[e].t(), formats.weight, weight_layout)
        pad = -size % group
        x_q = dequantized(x_e, formats.input, layouts[TensorRole.INPUT])
        dy_q = dequantized(dy_e, formats.grad_output, layouts[TensorRole.GRAD_OUTPUT])
        # The loop's wgrad operands: x_eᵀ and dy_eᵀ padded with zeros to whole groups.
        x_t = dequantized(F.pad(x_e.t(), (0, pad)), formats.input, layouts[TensorRole.INPUT])
        dy_t = dequantized(
            F.pad(dy_e.t(), (0, pad)), formats.grad_output, layouts[TensorRole.GRAD_OUTPUT]
        )
        bias = layer.bias.detach()[e].double()
        for name, a, b, extra in (
            ("y", x_q, w, bias),
            ("dx", dy_q, w_t, None),
            ("dw", dy_t, x_t, None),
        ):
            product = a @ b.t()
            out[name][0].append(product if extra is None else product + extra)
            out[name][1].append(a.abs() @ b.abs().t())
            out[name][2].append(product)
    join = {"y": torch.cat, "dx": torch.cat, "dw": torch.stack}
    return {name: tuple(join[name](parts) for parts in out[name]) for name in out}


def check_against_float64_and_loop(grouped, loop, refs, depths, grouped_acc, loop_acc, eps):
    """``depths``: contraction length per GEMM; ``*_acc``: M's factor in each path's bound."""
    for name in ("y", "dx", "dw"):
        reference, magnitude, product = refs[name]
        rounding = eps * (product.abs() + reference.abs())
        g, lo = grouped[name].double(), loop[name].double()
        grouped_bound = grouped_acc(depths[name]) * magnitude + rounding
        loop_bound = loop_acc(depths[name]) * magnitude + rounding
        for label, value, bound in (
            ("grouped", g, grouped_bound),
            ("loop", lo, loop_bound),
        ):
            error = (value - reference).abs()
            assert (error <= bound).all(), f"{name} {label}: {(error - bound).max()}"
        assert ((g - lo).abs() <= grouped_bound + loop_bound).all(), f"{name} grouped vs loop"
    assert torch.equal(grouped["db"], loop["db"])


# ---------------------------------------------------------------------------------------------
# Where the grouped block path runs (plain Python)


def test_reasons_for_block_scaling():
    layer = make_layer(len(SIZES), K, N, E4M3, torch.float32, "cpu")
    x, _ = make_inputs(SIZES, K, N, torch.float32, "cpu")
    reason = grouped_gemm_reason(x, layer.weight, SIZES, layer.recipe, "auto", torch.float32)
    assert reason == (
        "the grouped block-scaled GEMM is a Triton kernel for CUDA GPUs of compute capability "
        ">= 9.0 with Triton, not cpu"
    )
    small = BlockScaling(group=64, weight_block=64)
    reason = grouped_gemm_reason(x, layer.weight, SIZES, small, "auto", torch.float32)
    assert reason == (
        "the grouped block-scaled GEMM takes 1x128 groups and 128x128 weight blocks, got "
        "group=64, weight_block=64"
    )
    narrow = torch.empty(len(SIZES), 192, K)
    reason = grouped_gemm_reason(x, narrow, SIZES, layer.recipe, "auto", torch.float32)
    assert reason is not None and "got K=256, N=192" in reason
    reason = grouped_gemm_reason(x, layer.weight, SIZES, layer.recipe, "triton", torch.float32)
    assert reason is not None and reason.startswith("backend 'triton' keeps the per-expert loop")


def test_few_large_experts_keep_the_loop_under_auto():
    # Measured faster than the grouped kernels for Mixtral's 8 experts, slower for DeepSeek's 64.
    reason = block_loop_reason(8)
    assert reason is not None and reason.startswith("8 experts (fewer than 16) keep the per-expert")
    assert block_loop_reason(BLOCK_GROUPED_MIN_EXPERTS) is None and block_loop_reason(64) is None


def test_reasons_for_mxfp8():
    layer = make_layer(len(MX_SIZES), MX_K, MX_N, HYBRID, torch.float32, "cpu", recipe="mxfp8")
    x, _ = make_inputs(MX_SIZES, MX_K, MX_N, torch.float32, "cpu")
    reason = grouped_gemm_reason(x, layer.weight, MX_SIZES, layer.recipe, "auto", torch.float32)
    assert reason == (
        "the grouped block-scaled GEMM is a Triton kernel for CUDA GPUs of compute capability "
        ">= 9.0 with Triton, not cpu"
    )
    narrow = torch.empty(len(MX_SIZES), 48, MX_K)
    reason = grouped_gemm_reason(x, narrow, MX_SIZES, layer.recipe, "auto", torch.float32)
    assert reason == (
        "the grouped mxfp8 GEMM needs K and N divisible by 32 (whole 1x32 groups of W and Wᵀ), "
        "got K=128, N=48"
    )
    reason = grouped_gemm_reason(x, layer.weight, MX_SIZES, layer.recipe, "bf16", torch.float32)
    assert reason is not None and reason.startswith("backend 'bf16' keeps the per-expert loop")


def test_bad_calls_are_refused():
    layer = make_layer(len(SIZES), K, N, E4M3, torch.float32, "cpu")
    x, _ = make_inputs(SIZES, K, N, torch.float32, "cpu")
    plan = layer.linear_plan(x, None)
    with pytest.raises(ValueError, match="block scaling runs grouped through"):
        fp8_grouped_linear(x, layer.weight, None, SIZES, plan)
    with pytest.raises(ValueError, match="must be 5 non-negative ints summing to the 305 tokens"):
        fp8_block_grouped_linear(x, layer.weight, None, SIZES[:-1], plan)
    for sizes, got in (
        (torch.tensor(SIZES[:-1]), r"got shape \(4,\) torch.int64 on cpu"),
        (torch.tensor(SIZES, dtype=torch.float32), r"got shape \(5,\) torch.float32 on cpu"),
        (torch.tensor(SIZES, device="meta"), r"got shape \(5,\) torch.int64 on meta"),
    ):
        with pytest.raises(ValueError, match=r"must be 5 int32 or int64 counts on cpu .*" + got):
            fp8_block_grouped_linear(x, layer.weight, None, sizes, plan)
    narrow = torch.empty(len(SIZES), 192, K)
    with pytest.raises(ValueError, match=r"K and N divisible by 128.*N=192"):
        fp8_block_grouped_linear(x, narrow, None, SIZES, plan)
    mx_layer = make_layer(len(SIZES), K, N, HYBRID, torch.float32, "cpu", recipe="mxfp8")
    mx_plan = mx_layer.linear_plan(x, None)
    with pytest.raises(ValueError, match="mxfp8 scaling runs grouped through"):
        fp8_grouped_linear(x, mx_layer.weight, None, SIZES, mx_plan)
    with pytest.raises(ValueError, match=r"K and N divisible by 32 \(whole 1x32 groups.*N=48"):
        fp8_block_grouped_linear(x, torch.empty(len(SIZES), 48, K), None, SIZES, mx_plan)
    tensorwise = FP8GroupedLinear(len(SIZES), K, N, recipe=TensorwiseScaling())
    with pytest.raises(ValueError, match=r"group=128 and weight_block=128, or MXFP8Scaling, got"):
        fp8_block_grouped_linear(x, layer.weight, None, SIZES, tensorwise.linear_plan(x, None))


def test_tables_from_the_host_sizes():
    pytest.importorskip("triton")
    assert kernels().row_tiles([37, 0, 128, 140, 0]) == [
        *(0, 0, 37),
        *(2, 37, 165),
        *(3, 165, 293),
        *(3, 293, 305),
    ]


# Edge cases of the device-built tables: the module's, one expert with every token, experts
# one past a group (the padded-token bound is then reached exactly), all aligned, none at all.
TABLE_SIZES = [SIZES, MX_SIZES, [0, 0, 300, 0], [129, 1, 257, 33], [128, 0, 256], [0, 0]]


@pytest.mark.parametrize("sizes", TABLE_SIZES, ids=lambda sizes: "-".join(map(str, sizes)))
@pytest.mark.parametrize("group", [128, 32])
def test_tables_on_the_device_are_the_host_tables(sizes, group):
    """The tile table, segment starts and token columns built from a tensor of sizes hold the
    host-built ones, in buffers of the host-known bounds (grouped_block: device group sizes)."""
    pytest.importorskip("triton")
    k = kernels()
    tokens, experts = sum(sizes), len(sizes)
    sizes_E = torch.tensor(sizes)
    tiles = k.device_row_tiles(sizes_E, tokens)
    host_tiles = k.row_tiles(sizes)
    assert tiles.dtype == torch.int32 and tiles.numel() == 3 * k.max_row_tiles(tokens, experts)
    assert tiles[: len(host_tiles)].tolist() == host_tiles
    assert not tiles[len(host_tiles) :].any()  # the closing entries own no rows
    starts = k.device_padded_starts(sizes_E, group)
    assert starts.dtype == torch.int32 and starts.tolist() == k.padded_starts(sizes, group)
    bound = k.max_padded_tokens(tokens, experts, group)
    assert bound % group == 0 and starts[-1] <= bound
    if all(size % group == 1 for size in sizes):
        assert starts[-1] == bound  # the bound is tight
    host = _TokenSegments.of(sizes, torch.device("cpu"), group)
    on_device = _TokenSegments.on_device(sizes_E, tokens, group)
    assert torch.equal(on_device.starts, host.starts) and on_device.padded_tokens == bound
    expected = torch.arange(tokens) if host.dest_T is None else host.dest_T
    assert torch.equal(on_device.dest_T, expected)
    assert kernels().padded_starts([37, 0, 128, 140, 0]) == [0, 128, 128, 256, 512, 512]
    assert kernels().padded_starts(MX_SIZES, 32) == [0, 32, 32, 128, 256, 320, 320]


def test_kernels_refuse_what_they_cannot_take():
    pytest.importorskip("triton")

    def fp8(*shape):
        return torch.zeros(*shape, dtype=torch.float8_e4m3fn)

    a, b = fp8(8, 256), fp8(2, 128, 256)
    scale_a, scale_b = torch.ones(8, 2), torch.ones(2, 1, 2)
    tiles = torch.tensor([0, 0, 8], dtype=torch.int32)
    mm = kernels().grouped_block_mm
    with pytest.raises(ValueError, match=r"a must be a contiguous 2-D FP8 tensor, got \(8, 256\) "):
        mm(a.float(), scale_a, b, scale_b, tiles, torch.float32)
    with pytest.raises(ValueError, match=r"last dims must agree"):
        mm(fp8(8, 128), scale_a, b, scale_b, tiles, torch.float32)
    with pytest.raises(ValueError, match=r"scale_b must be contiguous float32 scales of shape"):
        mm(a, scale_a, b, torch.ones(2, 1, 1), tiles, torch.float32)
    with pytest.raises(ValueError, match=r"bias must be \(E, Y\) = \(2, 128\)"):
        mm(a, scale_a, b, scale_b, tiles, torch.float32, torch.zeros(128))
    starts = torch.tensor([0, 128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"padded token dims must agree and be a multiple of 128"):
        kernels().k_grouped_block_mm(
            fp8(64, 256), torch.ones(64, 2), fp8(64, 200), torch.ones(64, 2), starts, torch.float32
        )
    # MXFP8's steps: 1x32 scales for a and for each row of b, whose rows need no multiple.
    with pytest.raises(ValueError, match=r"in groups of 32 or 128, got group=64"):
        mm(a, torch.ones(8, 4), b, torch.ones(2, 2, 4), tiles, torch.float32, group=64)
    with pytest.raises(
        ValueError, match=r"scale_b must be .* of shape \(2, 100, 8\), got \(2, 4, 8\)"
    ):
        mm(
            a,
            torch.ones(8, 8),
            fp8(2, 100, 256),
            torch.ones(2, 4, 8),
            tiles,
            torch.float32,
            group=32,
            b_row_scales=True,
        )
    with pytest.raises(ValueError, match=r"the last dims must agree and be multiples of 32"):
        mm(
            fp8(8, 48),
            torch.ones(8, 1),
            fp8(2, 100, 48),
            torch.ones(2, 100, 1),
            tiles,
            torch.float32,
            group=32,
            b_row_scales=True,
        )
    with pytest.raises(ValueError, match=r"padded token dims must agree and be a multiple of 32"):
        kernels().k_grouped_block_mm(
            fp8(64, 48),
            torch.ones(64, 1),
            fp8(64, 48),
            torch.ones(64, 1),
            starts,
            torch.float32,
            group=32,
        )


# ---------------------------------------------------------------------------------------------
# Operands: the loop's bytes and scales


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def assert_same(data, scale, expected_data, expected_scale):
    """Equal bytes and scales; where the expected value is NaN, NaN-ness only (the FP8 NaN
    codes of the Triton and PyTorch casts may differ in sign)."""
    nan_scale, nan_data = expected_scale.isnan(), expected_data.float().isnan()
    assert torch.equal(scale.isnan(), nan_scale) and torch.equal(data.float().isnan(), nan_data)
    assert torch.equal(scale[~nan_scale], expected_scale[~nan_scale])
    assert torch.equal(as_bytes(data)[~nan_data], as_bytes(expected_data)[~nan_data])


# FP8 formats with the input dtype they run on: all E4M3 in fp32, and E4M3/E5M2 in bf16.
FORMATS_AND_DTYPES = pytest.mark.parametrize(
    ("formats", "dtype"),
    [(E4M3, torch.float32), (HYBRID, torch.bfloat16)],
    ids=["e4m3-fp32", "hybrid-bf16"],
)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
@FORMATS_AND_DTYPES
def test_grouped_operands_are_the_loops(device, formats, dtype, recipe):
    """The stacked W and Wᵀ and the padded wgrad segments of xᵀ and dyᵀ, expert by expert,
    against what the loop's quantizers (the Triton kernels here) give each expert."""
    sizes, k, n = SHAPES[recipe]
    layer = make_layer(len(sizes), k, n, formats, dtype, device, recipe=recipe)
    group = group_of(layer.recipe)
    x, dy = make_inputs(sizes, k, n, dtype, device)
    # Token 40 is expert 2's 4th (block) or 22nd (MXFP8) token: a NaN scale in its segment's
    # first column group, the second group of the padded tokens.
    x[40, 3] = float("inf")
    x[: sizes[0]] = 0  # expert 0's tokens are zeros: scale 1
    plan, loop_plan = layer.linear_plan(x, None), layer.linear_plan(x, None)
    weight, weight_t = grouped_module._quantize_weights(plan, layer.weight.detach(), True)
    segments = _TokenSegments.of(sizes, x.device, group)
    starts = kernels().padded_starts(sizes, group)
    assert segments.padded_tokens == starts[-1] and segments.dest_T is not None
    assert torch.equal(segments.starts.cpu(), torch.tensor(starts, dtype=torch.int32))
    # Device group sizes: the same segments in the bound's columns, built on the device.
    sizes_E = torch.tensor(sizes, device=device)
    device_segments = _TokenSegments.on_device(sizes_E, sum(sizes), group)
    bound = kernels().max_padded_tokens(sum(sizes), len(sizes), group)
    for role, values in ((TensorRole.INPUT, x), (TensorRole.GRAD_OUTPUT, dy)):
        columns = segments.quantize(plan, values, role)
        assert columns.data.shape == (values.shape[1], starts[-1])
        device_columns = device_segments.quantize(plan, values, role)
        assert device_columns.data.shape == (values.shape[1], bound) and bound > starts[-1]
        assert_same(
            device_columns.data[:, : starts[-1]],
            device_columns.scale[:, : starts[-1] // group],
            columns.data,
            columns.scale,
        )
        start = 0
        for e, size in enumerate(sizes):
            begin, end = starts[e], starts[e + 1]
            group_begin, group_end = begin // group, end // group
            if size:
                part = values[start : start + size]
                q = loop_plan.quantize(part, role, record=False, transposed=True)
                q_t = loop_plan.quantize_transposed(part, q, role)
                assert_same(
                    columns.data[:, begin:end],
                    columns.scale[:, group_begin:group_end],
                    q_t.data,
                    q_t.scale,
                )
            assert end - begin == -(-size // group) * group
            start += size
        if role is TensorRole.INPUT:  # the edge cases are really there
            assert (columns.scale[:, 0] == 1).all() and columns.scale[3, 1].isnan()
    for e in range(len(sizes)):
        w_q, w_t_q = loop_plan.weight_operands(layer.weight.detach()[e], need_transpose=True)
        assert_same(weight.data[e], weight.scale[e], w_q.data, w_q.scale)
        assert_same(weight_t.data[e], weight_t.scale[e], w_t_q.data, w_t_q.scale)
    if recipe == "mxfp8":  # power-of-two scales, and Wᵀ is no transpose of W's scales
        assert torch.equal(torch.frexp(weight_t.scale)[0], torch.full_like(weight_t.scale, 0.5))
        assert weight_t.scale.shape == (len(sizes), k, n // 32)
    # Experts of whole groups need no scatter: the operand is the plain column quantization.
    aligned = _TokenSegments.of([group, 0, 2 * group], x.device, group)
    assert aligned.dest_T is None and aligned.padded_tokens == 3 * group


# ---------------------------------------------------------------------------------------------
# Layer outputs and gradients


def interpreter_accumulation(depth):
    return 2.0**-16


def emulated_loop_accumulation(depth):
    return (depth + 2) * U


# (recipe, formats, dtype, whether the quantizers run as Triton kernels too)
EQUIVALENCE_CASES = {
    "e4m3-fp32": ("block", E4M3, torch.float32, False),
    "e4m3-bf16": ("block", E4M3, torch.bfloat16, False),
    "hybrid-fp32": ("block", HYBRID, torch.float32, False),
    "hybrid-bf16-triton-quantizers": ("block", HYBRID, torch.bfloat16, True),
    "mxfp8-hybrid-fp32": ("mxfp8", HYBRID, torch.float32, False),
    "mxfp8-e4m3-bf16": ("mxfp8", E4M3, torch.bfloat16, False),
    "mxfp8-hybrid-bf16-triton-quantizers": ("mxfp8", HYBRID, torch.bfloat16, True),
}


@interpreted
@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_grouped_matches_loop_and_float64(case, monkeypatch):
    recipe, formats, dtype, triton_quantizers = EQUIVALENCE_CASES[case]
    if not triton_quantizers:
        # The plain-PyTorch quantizers, bit-identical to the Triton ones (test_fp8_block_fast.py
        # and the operand test above), interpret in seconds less; the GEMMs stay Triton.
        monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1")
    sizes, k, n = SHAPES[recipe]
    layer = make_layer(len(sizes), k, n, formats, dtype, "cpu", recipe=recipe)
    x, dy = make_inputs(sizes, k, n, dtype, "cpu")
    grouped = run(layer, x, dy, sizes, "function")
    loop = run(layer, x, dy, sizes, "layer")  # on the CPU the layer loops
    refs = references(layer, x, dy, sizes)
    # dw: the loop contracts over each expert's padded segment, the longest here.
    group = group_of(layer.recipe)
    depths = {"y": k, "dx": n, "dw": -(-max(sizes) // group) * group}
    eps = torch.finfo(dtype).eps
    check_against_float64_and_loop(
        grouped, loop, refs, depths, interpreter_accumulation, emulated_loop_accumulation, eps
    )
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(grouped["dw"][e], torch.zeros(n, k, dtype=dtype))


class Unread(torch.Tensor):
    """Group sizes whose values the host must not read (as reading a CUDA tensor's waits for
    the device); every tensor computed from them is one too."""

    def _read(self, *args, **kwargs):
        raise AssertionError("the group sizes (or a tensor computed from them) were read")

    tolist = item = __iter__ = __int__ = __index__ = __bool__ = __float__ = _read


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
@FORMATS_AND_DTYPES
def test_device_group_sizes_give_the_host_sizes_bits(device, formats, dtype, recipe, monkeypatch):
    """The grouped call given its group sizes as a tensor on the tokens' device (tables built
    there, in buffers of host-known bounds) never reads them and returns the host-sizes call's
    y, dx and dW bit for bit, the idle experts' zero dW included; with a bias too (whose
    gradient reads the sizes: grouped_block, device group sizes)."""
    if device == "cpu":
        monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1")  # as above; the GEMMs stay Triton
    sizes, k, n = SHAPES[recipe]
    for bias in (False, True):
        layer = make_layer(len(sizes), k, n, formats, dtype, device, bias=bias, recipe=recipe)
        x, dy = make_inputs(sizes, k, n, dtype, device)
        sizes_E = torch.tensor(sizes, device=device)
        host = run(layer, x, dy, sizes, "function")
        on_device = run(layer, x, dy, sizes_E if bias else sizes_E.as_subclass(Unread), "function")
        assert host.keys() == on_device.keys()
        for name, value in host.items():
            assert value is None or torch.equal(value, on_device[name]), name
        assert not host["dw"][1].any()


@interpreted
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_health_counts_are_the_loops(recipe, monkeypatch):
    monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1")  # as in the test above
    sizes, k, n = SHAPES[recipe]
    counts = {}
    for path in ("grouped", "loop"):
        layer = make_layer(len(sizes), k, n, E4M3, torch.float32, "cpu", recipe=recipe)
        x, dy = make_inputs(sizes, k, n, torch.float32, "cpu")
        x[4, 0], x[4, 1] = 1e4, 1e-6  # the second flushes to zero at the first one's scale
        run(layer, x, dy, sizes, "function" if path == "grouped" else "layer")
        counts[path] = layer.fp8_meta.health.clone()
    grouped, loop = counts["grouped"], counts["loop"]
    assert torch.equal(grouped[0], loop[0]) and torch.equal(grouped[2], loop[2])
    assert grouped[0, 1] > 0  # the flush really counted
    # The loop counts the weights of experts with tokens, the grouped path all of them.
    present = sum(size > 0 for size in sizes)
    assert grouped[1, 2] == len(sizes) * n * k and loop[1, 2] == present * n * k


class AtenOpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_call(experts, recipe, device_sizes):
    """Aten ops of one forward + backward (no bias: its gradient is one sum per expert), the
    group sizes given as host ints or as a tensor."""
    sizes = [16 * (e % 3) + e % 5 for e in range(experts)]  # some empty, most partial groups
    layer = make_layer(experts, 128, 128, HYBRID, torch.bfloat16, "cpu", bias=False, recipe=recipe)
    x, dy = make_inputs(sizes, 128, 128, torch.bfloat16, "cpu")
    x.requires_grad_()
    plan = layer.linear_plan(x, None)
    group_sizes = torch.tensor(sizes) if device_sizes else sizes
    counter = AtenOpCount()
    with counter:
        y = fp8_block_grouped_linear(x, layer.weight, None, group_sizes, plan)
        y.backward(dy)
    assert x.grad is not None and layer.weight.grad is not None
    return counter.count


@interpreted
@pytest.mark.parametrize("device_sizes", [False, True], ids=["host-sizes", "device-sizes"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_ops_per_call_do_not_grow_with_the_number_of_experts(recipe, device_sizes, monkeypatch):
    monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1")  # as above; the GEMMs stay Triton
    assert ops_per_call(4, recipe, device_sizes) == ops_per_call(24, recipe, device_sizes)


@pytest.mark.parametrize("device_sizes", [False, True], ids=["host-sizes", "device-sizes"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
@FORMATS_AND_DTYPES
def test_weight_gradients_deferred_to_a_sink_equal_the_fused_ones(
    device, formats, dtype, recipe, device_sizes, monkeypatch
):
    """With a ``wgrad_sink`` (zero-bubble pipelines) the grouped block backward returns ``dx``
    and queues the k-grouped wgrad GEMM and the bias gradient: nothing on the parameters until
    the queue runs, then the fused backward's bit for bit (the same operands and kernel),
    accumulated over two micro-batches, idle experts included; the group sizes as host ints or
    as a tensor on the device (which the queued bias gradient then holds)."""
    if device == "cpu":
        monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1")  # as above; the GEMMs stay Triton
    sizes, k, n = SHAPES[recipe]

    def step(sink):
        layer = make_layer(len(sizes), k, n, formats, dtype, device, recipe=recipe)
        layer.wgrad_sink = sink
        unheld = [] if sink is None else watch_unheld(sink, layer.parameters())
        dxs = []
        for scale in (1.0, -0.5):  # two micro-batches
            x, dy = make_inputs(sizes, k, n, dtype, device)
            x = (x * scale).requires_grad_()
            plan = layer.linear_plan(x, layer.grouped_weight_cache)
            group_sizes = torch.tensor(sizes, device=device) if device_sizes else sizes
            fp8_block_grouped_linear(x, layer.weight, layer.bias, group_sizes, plan).backward(dy)
            dxs.append(x.grad)
        if sink is not None:
            assert layer.weight.grad is None and layer.bias.grad is None and len(sink) == 2
            assert unheld == [0, 0]  # every tensor a closure reaches is named in its holds
            sink.take()()
        return [*dxs, layer.weight.grad, layer.bias.grad]

    fused, deferred = step(None), step(WeightGradSink())
    assert fused[2].abs().max() > 0
    for a, b in zip(fused, deferred, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels at DeepSeek-V2-Lite's expert shape


def hardware_accumulation(depth):
    return 2.0**-12


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize(
    ("dtype", "autocast"),
    [(torch.bfloat16, False), (torch.float32, True)],
    ids=["bf16", "fp32-autocast"],
)
def test_grouped_matches_loop_on_cuda(formats, dtype, autocast, recipe):
    sizes = gpu_sizes()
    grouped_layer = make_layer(GPU_E, GPU_K, GPU_N, formats, dtype, "cuda", recipe=recipe)
    # The loop on the dense Triton block GEMM per expert ("auto" would group; for MXFP8 it
    # would run the loop's exact bf16 GEMMs).
    loop_layer = make_layer(
        GPU_E, GPU_K, GPU_N, formats, dtype, "cuda", backend="triton", recipe=recipe
    )
    x, dy = make_inputs(sizes, GPU_K, GPU_N, torch.bfloat16, "cuda")
    x, dy = x.to(dtype), dy.to(dtype)
    out_dtype = torch.bfloat16
    recipe = grouped_layer.recipe
    assert grouped_gemm_reason(x, grouped_layer.weight, sizes, recipe, "auto", out_dtype) is None
    grouped = run(grouped_layer, x, dy, sizes, "layer", autocast)
    loop = run(loop_layer, x, dy, sizes, "layer", autocast)
    for result in (grouped, loop):
        for name, value in result.items():
            assert torch.isfinite(value).all(), name
    # Under autocast y is bf16 (the GEMMs' output dtype); dx and dW are in the fp32 dtypes.
    eps = torch.finfo(torch.bfloat16).eps
    refs = references(loop_layer, x.float(), dy.to(grouped["y"].dtype).float(), sizes)
    depths = {"y": GPU_K, "dx": GPU_N, "dw": max(sizes)}
    check_against_float64_and_loop(
        grouped, loop, refs, depths, hardware_accumulation, hardware_accumulation, eps
    )
    assert grouped["dw"][0].abs().max() == 0  # the expert with no tokens


@pytest.mark.gpu
@pytest.mark.parametrize("device_sizes", [False, True], ids=["host-sizes", "device-sizes"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_call_does_not_synchronize_on_cuda(recipe, device_sizes):
    # Group sizes as host ints or as a CUDA tensor (read on the device): a forward + backward
    # waits for the device nowhere (CUDA's sync debug mode raises on a blocking copy, .item(),
    # .tolist() or nonzero).
    sizes = gpu_sizes()
    layer = make_layer(
        GPU_E, GPU_K, GPU_N, HYBRID, torch.bfloat16, "cuda", bias=False, recipe=recipe
    )
    x, dy = make_inputs(sizes, GPU_K, GPU_N, torch.bfloat16, "cuda")
    x.requires_grad_()
    group_sizes = torch.tensor(sizes, device="cuda") if device_sizes else sizes
    step = lambda: layer(x, group_sizes).backward(dy)  # noqa: E731
    run_without_synchronizing(step)
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_device_group_sizes_give_the_host_sizes_bits_on_cuda(recipe):
    """At DeepSeek-V2-Lite's expert shape, through the layer: a CUDA tensor of group sizes
    gives the host ints' y, dx and dW bit for bit (the tables hold the same tiles and segments)."""
    sizes = gpu_sizes()
    layer = make_layer(
        GPU_E, GPU_K, GPU_N, HYBRID, torch.bfloat16, "cuda", bias=False, recipe=recipe
    )
    x, dy = make_inputs(sizes, GPU_K, GPU_N, torch.bfloat16, "cuda")
    host = run(layer, x, dy, sizes, "layer")
    on_device = run(layer, x, dy, torch.tensor(sizes, device="cuda"), "layer")
    for name in ("y", "dx", "dw"):
        assert torch.equal(host[name], on_device[name]), name
