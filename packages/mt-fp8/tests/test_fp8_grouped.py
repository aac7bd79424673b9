"""The grouped FP8 GEMM path of FP8GroupedLinear (mt_fp8.grouped) against the per-expert loop.

On CPU the grouped autograd function runs with ``emulated_grouped_mm`` in place of
``torch._scaled_grouped_mm``; the GPU tests run the real kernel.

Bounds. Grouped and loop multiply the same FP8 operands (checked byte for byte below), so they
differ only by fp32 summation order (at most ``K·2^-24·Σ|a'||b'|`` each, both sides) and by
output roundings: the grouped kernel writes bf16 (``2^-8`` relative), the loop's output may
round once more into bf16 (bf16 parameters), and a bias added after the bf16 GEMM output rounds
once more: ``3·2^-8·|v| <= 2^-6·|v|`` for ``v`` the exact product of the FP8 operands. Against
float64, per element: the FP8 operand bound of test_fp8_linear.py (mantissa bits: 2^-4 for E4M3,
2^-3 for E5M2, plus half the subnormal spacing at the largest scale) plus those roundings.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mt_fp8.grouped as grouped_module
from mt_fp8 import (
    FormatConfig,
    FP8Format,
    FP8GroupedLinear,
    RowwiseScaling,
    TensorRole,
    TensorwiseScaling,
    WeightGradSink,
    clear_fp8_weight_caches,
    final_micro_batch,
    quantize,
)
from mt_fp8.grouped import (
    emulated_grouped_mm,
    fp8_grouped_linear,
    gemm_reason,
    grouped_gemm_reason,
    scaled_grouped_mm,
)
from mt_fp8.recipes import DelayedScaling, recipe_from_name
from mt_fp8.testing import run_without_synchronizing, watch_unheld

E, K, N = 4, 64, 96
ALIGNED = [48, 0, 32, 80]  # every size % 16: the wgrad GEMM is grouped too
UNEVEN = [37, 0, 50, 73]  # wgrad per group; forward/dgrad still grouped
FULL = [48, 16, 32, 80]  # aligned, no expert without tokens
E4M3 = FormatConfig.all_e4m3()
ROUNDING = 2.0**-6


def make_layer(recipe, dtype=torch.float32, device="cpu", backend="auto", seed=0):
    torch.manual_seed(seed)
    layer = FP8GroupedLinear(E, K, N, recipe=recipe, backend=backend, dtype=dtype, device=device)
    return layer


def inputs(sizes, dtype=torch.float32, device="cpu", seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), K, generator=generator).to(device, dtype)
    dy = torch.randn(sum(sizes), N, generator=generator).to(device, dtype)
    return x.requires_grad_(), dy


def run(layer, x, dy, sizes, grouped_gemm=None, autocast=None):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast is not None):
        if grouped_gemm is None:
            y = layer(x, sizes)
        else:
            plan = layer.linear_plan(x, layer.grouped_weight_cache)
            y = fp8_grouped_linear(x, layer.weight, layer.bias, sizes, plan, grouped_gemm)
    y.backward(dy.to(y.dtype))
    return {"y": y, "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}


def element_error(v, fmt):
    amax = v.abs().amax() if v.numel() else v.new_zeros(())
    return fmt.relative_rounding_error * v.abs() + amax * fmt.min_subnormal / (2 * fmt.max)


def product_bound(a, fmt_a, b, fmt_b):
    """Bound on |FP8 product - a·bᵀ| (test_fp8_linear.py's, without MX): see the docstring."""
    e_a, e_b = element_error(a, fmt_a), element_error(b, fmt_b)
    bound = e_a @ b.abs().t() + a.abs() @ e_b.t() + e_a @ e_b.t()
    return bound + a.shape[1] * 2**-24 * ((a.abs() + e_a) @ (b.abs() + e_b).t())


def references(layer, x, dy, sizes, formats):
    """Per-group float64 products and their FP8 bounds for y (without bias), dx, dw."""
    x64, dy64 = x.detach().double(), dy.double()
    w64 = layer.weight.detach().double()
    e_in, e_w, e_g = formats.input, formats.weight, formats.grad_output
    refs = {"y": [], "dx": [], "dw": []}
    start = 0
    for e, size in enumerate(sizes):
        x_e, dy_e, w_e = x64[start : start + size], dy64[start : start + size], w64[e]
        start += size
        refs["y"].append((x_e @ w_e.t(), product_bound(x_e, e_in, w_e, e_w)))
        refs["dx"].append((dy_e @ w_e, product_bound(dy_e, e_g, w_e.t().contiguous(), e_w)))
        dw_bound = product_bound(dy_e.t().contiguous(), e_g, x_e.t().contiguous(), e_in)
        refs["dw"].append((dy_e.t() @ x_e, dw_bound))
    return {
        "y": tuple(torch.cat(parts) for parts in zip(*refs["y"], strict=True)),
        "dx": tuple(torch.cat(parts) for parts in zip(*refs["dx"], strict=True)),
        "dw": tuple(torch.stack(parts) for parts in zip(*refs["dw"], strict=True)),
    }


def magnitude(layer, x, dy, sizes):
    """Σ|a'||b'| per element, with |a'| <= (1 + 2^-3)|a| for any FP8 rounding (normal range)."""
    x64, dy64, w64 = x.detach().double().abs(), dy.double().abs(), layer.weight.detach().double()
    out = {"y": [], "dx": [], "dw": []}
    start = 0
    for e, size in enumerate(sizes):
        x_e, dy_e, w_e = x64[start : start + size], dy64[start : start + size], w64[e].abs()
        start += size
        out["y"].append(x_e @ w_e.t())
        out["dx"].append(dy_e @ w_e)
        out["dw"].append(dy_e.t() @ x_e)
    scale = (1 + 2**-3) ** 2
    return {
        "y": torch.cat(out["y"]) * scale,
        "dx": torch.cat(out["dx"]) * scale,
        "dw": torch.stack(out["dw"]) * scale,
    }


def check_against_loop_and_float64(grouped, loop, layer, x, dy, sizes, formats):
    mags = magnitude(layer, x, dy, sizes)
    refs = references(layer, x, dy, sizes, formats)
    bias_TN = layer.bias.detach().double().repeat_interleave(torch.tensor(sizes), dim=0)
    for name in ("y", "dx", "dw"):
        g, lo = grouped[name].double(), loop[name].double()
        product, fp8_bound = refs[name]
        ref = product + bias_TN if name == "y" else product
        # The GEMM output v (|v| <= |product| + fp8_bound) rounds to bf16, and the result
        # (|ref| + fp8_bound) may round once or twice more (module docstring).
        rounding = ROUNDING * (product.abs() + ref.abs() + 2 * fp8_bound)
        # Same FP8 operands: summation order (both sides) and the roundings.
        bound = 2 * K * 2**-24 * mags[name] + rounding
        assert ((g - lo).abs() <= bound).all(), f"{name}: {((g - lo).abs() - bound).max()}"
        assert ((g - ref).abs() <= fp8_bound + rounding).all(), f"{name} vs float64"
    # Bias gradient: fp32 sums of the same values per group, in the same order.
    assert torch.equal(grouped["db"], loop["db"])


def check_health(grouped_layer, loop_layer, sizes):
    """Input and gradient counts equal; the grouped weight counts cover experts with no tokens."""
    grouped, loop = grouped_layer.fp8_meta.health.cpu(), loop_layer.fp8_meta.health.cpu()
    assert torch.equal(grouped[0], loop[0]) and torch.equal(grouped[2], loop[2])
    assert grouped[1, 2] == E * N * K and loop[1, 2] == sum(s > 0 for s in sizes) * N * K
    assert (grouped[1, :2] >= loop[1, :2]).all()


# ---------------------------------------------------------------------------------------------
# Where the grouped path runs


def test_reasons_keep_the_loop_on_cpu():
    layer = make_layer(TensorwiseScaling())
    x, _ = inputs(ALIGNED)
    reason = grouped_gemm_reason(x, layer.weight, ALIGNED, layer.recipe, "auto", torch.bfloat16)
    assert reason == (
        "torch._scaled_grouped_mm runs on CUDA GPUs of compute capability 9.x, not on cpu"
    )
    reason = grouped_gemm_reason(x, layer.weight, ALIGNED, DelayedScaling(), "auto", x.dtype)
    assert reason == (
        "the grouped FP8 GEMM takes current tensorwise, rowwise, block or MXFP8 scaling, "
        "not the delayed recipe"
    )
    reason = grouped_gemm_reason(x, layer.weight, ALIGNED, layer.recipe, "emulate", x.dtype)
    assert reason is not None and reason.startswith("backend 'emulate' keeps the per-expert loop")


def test_per_gemm_reasons():
    hybrid, e4m3 = RowwiseScaling(), RowwiseScaling(formats=E4M3)
    bf16 = torch.bfloat16
    assert gemm_reason("forward", hybrid, ALIGNED, bf16) is None
    assert gemm_reason("dgrad", hybrid, ALIGNED, bf16) == (
        "torch._scaled_grouped_mm takes float8_e4m3fn operands only; the dgrad GEMM's "
        "grad_output is e5m2"
    )
    assert gemm_reason("wgrad", hybrid, ALIGNED, bf16) is not None
    assert gemm_reason("wgrad", e4m3, ALIGNED, torch.float32) is None
    assert gemm_reason("wgrad", e4m3, UNEVEN, bf16) is None  # groups padded to 16 tokens
    assert gemm_reason("dgrad", e4m3, UNEVEN, torch.float32) is None  # rowwise: bf16 anyway
    assert "writes torch.float32 directly" in gemm_reason(
        "forward", TensorwiseScaling(), ALIGNED, torch.float32
    )


# ---------------------------------------------------------------------------------------------
# Operands and numerics (grouped GEMM emulated on CPU)


class Recorder:
    """An emulated grouped GEMM that keeps the operands it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b, scale_a, scale_b, offs):
        self.calls.append((a, b, scale_a, scale_b, offs.tolist()))
        return emulated_grouped_mm(a, b, scale_a, scale_b, offs)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("recipe", [TensorwiseScaling(formats=E4M3), RowwiseScaling(formats=E4M3)])
def test_grouped_operands_are_the_loops(recipe):
    # Each expert's operands quantized as the loop's FP8LinearFunction does (CPU: quantize()).
    layer = make_layer(recipe, torch.bfloat16)  # tensorwise groups bf16 outputs only
    x, dy = inputs(ALIGNED, torch.bfloat16)
    recorder = Recorder()
    run(layer, x, dy, ALIGNED, recorder)
    (fwd, wgrad, dgrad) = recorder.calls  # backward runs wgrad first
    layout = recipe.layout(TensorRole.INPUT)
    fmt = FP8Format.E4M3
    q = lambda t: quantize(t.contiguous(), fmt, layout)  # noqa: E731
    starts = [0, 48, 48, 80]
    ends = [48, 48, 80, 160]
    assert fwd[4] == ends and dgrad[4] == ends
    # wgrad: the empty group is 16 zero columns with scale 1, so the GEMM writes its zero dW.
    wgrad_starts = [0, 48, 64, 96]
    assert wgrad[4] == [48, 64, 96, 176]
    assert not as_bytes(wgrad[0][:, 48:64]).any() and not as_bytes(wgrad[1][48:64]).any()
    assert (wgrad[2][N : 2 * N] == 1).all() and (wgrad[3][K : 2 * K] == 1).all()
    for e in range(E):
        s, t = starts[e], ends[e]
        w_q, wt_q = q(layer.weight[e].detach()), q(layer.weight[e].detach().t())
        # forward b (E, K, N) / dgrad b (E, N, K): column-major views of W_e and W_eᵀ.
        assert torch.equal(as_bytes(fwd[1][e].t()), as_bytes(w_q.data))
        assert torch.equal(fwd[3][e], w_q.scale.expand(N, 1).reshape(N))
        assert torch.equal(as_bytes(dgrad[1][e].t()), as_bytes(wt_q.data))
        assert torch.equal(dgrad[3][e], wt_q.scale.expand(K, 1).reshape(K))
        if t == s:
            continue
        x_q, dy_q = q(x.detach()[s:t]), q(dy[s:t])
        assert torch.equal(as_bytes(fwd[0][s:t]), as_bytes(x_q.data))
        assert torch.equal(fwd[2][s:t], x_q.scale.expand(t - s, 1).reshape(-1))
        assert torch.equal(as_bytes(dgrad[0][s:t]), as_bytes(dy_q.data))
        assert torch.equal(dgrad[2][s:t], dy_q.scale.expand(t - s, 1).reshape(-1))
        # wgrad: dyᵀ (N, T) and xᵀ as (T, K), scales over this expert's tokens only.
        dyt_q, xt_q = q(dy[s:t].t()), q(x.detach()[s:t].t())
        ws, wt = wgrad_starts[e], wgrad_starts[e] + t - s
        assert torch.equal(as_bytes(wgrad[0][:, ws:wt]), as_bytes(dyt_q.data))
        assert torch.equal(as_bytes(wgrad[1][ws:wt].t()), as_bytes(xt_q.data))
        assert torch.equal(wgrad[2][e * N : (e + 1) * N], dyt_q.scale.expand(N, 1).reshape(N))
        assert torch.equal(wgrad[3][e * K : (e + 1) * K], xt_q.scale.expand(K, 1).reshape(K))


@pytest.mark.parametrize("sizes", [ALIGNED, UNEVEN, FULL], ids=["aligned", "uneven", "full"])
@pytest.mark.parametrize("formats", [FormatConfig(), E4M3], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling])
def test_grouped_matches_loop_and_float64(recipe_cls, dtype, formats, sizes):
    recipe = recipe_cls(formats=formats)
    loop_layer, grouped_layer = make_layer(recipe, dtype), make_layer(recipe, dtype)
    x, dy = inputs(sizes, dtype)
    loop = run(loop_layer, x, dy, sizes)  # CPU: the loop
    recorder = Recorder()
    grouped = run(grouped_layer, x, dy, sizes, recorder)
    expected = sum(
        gemm_reason(gemm, recipe, sizes, dtype) is None for gemm in ("forward", "dgrad", "wgrad")
    )
    assert len(recorder.calls) == expected
    check_against_loop_and_float64(grouped, loop, loop_layer, x, dy, sizes, formats)
    check_health(grouped_layer, loop_layer, sizes)


def test_empty_groups_and_bad_group_sizes():
    recipe = RowwiseScaling(formats=E4M3)
    layer = make_layer(recipe)
    sizes = [0, 0, 96, 0]
    x, dy = inputs(sizes)
    grouped = run(layer, x, dy, sizes, emulated_grouped_mm)
    loop = run(make_layer(recipe), x, dy, sizes)
    check_against_loop_and_float64(grouped, loop, layer, x, dy, sizes, E4M3)
    for e in (0, 1, 3):
        assert torch.equal(grouped["dw"][e], torch.zeros(N, K))
        assert torch.equal(grouped["db"][e], torch.zeros(N))
    plan = layer.linear_plan(x, None)
    with pytest.raises(ValueError, match="must be 4 non-negative ints summing to the 96 tokens"):
        fp8_grouped_linear(x, layer.weight, None, [48, 48, 0], plan, emulated_grouped_mm)
    with pytest.raises(ValueError, match="got \\[100, -4, 0, 0\\]"):
        fp8_grouped_linear(x, layer.weight, None, [100, -4, 0, 0], plan, emulated_grouped_mm)
    with pytest.raises(ValueError, match="at least one token"):
        fp8_grouped_linear(x[:0], layer.weight, None, [0] * E, plan, emulated_grouped_mm)


def test_loop_with_a_weight_gradient_sink_computes_expert_gradients_in_backward():
    """The loop's experts are views of one parameter, which a deferred weight gradient cannot
    reach: with a sink set (as a zero-bubble pipeline stage does) the loop queues nothing and
    its gradients equal the sink-less layer's, bit for bit."""
    recipe = RowwiseScaling(formats=E4M3)
    expected = run(make_layer(recipe), *inputs(UNEVEN), UNEVEN)
    layer = make_layer(recipe)
    layer.wgrad_sink = WeightGradSink()
    got = run(layer, *inputs(UNEVEN), UNEVEN)
    assert len(layer.wgrad_sink) == 0
    for name in ("y", "dx", "dw", "db"):
        assert torch.equal(got[name], expected[name]), name


# (recipe, sizes, parameter dtype, whether the wgrad GEMM runs grouped)
DEFERRED_CASES = {
    "tensorwise-e4m3-bf16-uneven-grouped": (TensorwiseScaling(formats=E4M3), UNEVEN, torch.bfloat16, True),
    "rowwise-e4m3-fp32-aligned-grouped": (RowwiseScaling(formats=E4M3), ALIGNED, torch.float32, True),
    "tensorwise-e4m3-fp32-per-group": (TensorwiseScaling(formats=E4M3), ALIGNED, torch.float32, False),
    "rowwise-hybrid-bf16-uneven-per-group": (RowwiseScaling(), UNEVEN, torch.bfloat16, False),
}  # fmt: skip


@pytest.mark.parametrize("case", DEFERRED_CASES.values(), ids=DEFERRED_CASES.keys())
def test_grouped_weight_gradients_deferred_to_a_sink_equal_the_fused_ones(case):
    """With a ``wgrad_sink`` (zero-bubble pipelines) the grouped backward returns ``dx`` and
    queues the wgrad GEMM and the bias gradient: the parameters have no gradient until the
    queue runs, then the fused backward's bit for bit, accumulated over two micro-batches;
    with the wgrad GEMM grouped (padded groups, an idle expert) and per group (fp32 tensorwise
    output, E5M2 gradients)."""
    recipe, sizes, dtype, grouped_wgrad = case
    assert (gemm_reason("wgrad", recipe, sizes, dtype) is None) == grouped_wgrad

    def step(sink):
        layer = make_layer(recipe, dtype)
        layer.wgrad_sink = sink
        unheld = [] if sink is None else watch_unheld(sink, layer.parameters())
        dxs = []
        for seed in (1, 2):
            x, dy = inputs(sizes, dtype, seed=seed)
            plan = layer.linear_plan(x, layer.grouped_weight_cache)
            y = fp8_grouped_linear(x, layer.weight, layer.bias, sizes, plan, emulated_grouped_mm)
            y.backward(dy.to(y.dtype))
            dxs.append(x.grad)
        if sink is not None:
            assert layer.weight.grad is None and layer.bias.grad is None and len(sink) == 2
            assert unheld == [0, 0]  # every tensor a closure reaches is named in its holds
            sink.take()()
            assert len(sink) == 0
        return [*dxs, layer.weight.grad, layer.bias.grad]

    fused, deferred = step(None), step(WeightGradSink())
    assert fused[2].abs().max() > 0
    for a, b in zip(fused, deferred, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_grouped_layer_defers_only_a_call_on_its_own_weight(monkeypatch):
    """The layer's grouped path (forced on the CPU with the emulated kernel) queues the weight
    gradient of a call on ``self.weight``; a call given a view of it (mt-parallel's
    sequence-parallel experts, whose view sums the gradient over TP) gets its gradient through
    autograd in the backward, as without a sink. ``defers_weight_gradient`` says whether the
    layer's calls take the grouped path (not on the CPU unless forced)."""
    from functools import partial

    import mt_fp8.linear as linear_module

    assert not make_layer(RowwiseScaling(formats=E4M3)).defers_weight_gradient  # CPU: the loop
    monkeypatch.setattr(linear_module, "grouped_gemm_reason", lambda *args: None)
    monkeypatch.setattr(
        linear_module,
        "fp8_grouped_linear",
        partial(fp8_grouped_linear, grouped_gemm=emulated_grouped_mm),
    )
    layer = make_layer(RowwiseScaling(formats=E4M3))
    assert layer.defers_weight_gradient
    layer.wgrad_sink = WeightGradSink()
    x, dy = inputs(ALIGNED)
    layer(x, ALIGNED).backward(dy)
    assert layer.weight.grad is None and len(layer.wgrad_sink) == 1
    layer.wgrad_sink.take()()
    own = layer.weight.grad
    layer.zero_grad()
    x, dy = inputs(ALIGNED)
    layer(x, ALIGNED, layer.weight.view_as(layer.weight)).backward(dy)
    assert len(layer.wgrad_sink) == 0 and torch.equal(layer.weight.grad, own)


def test_grouped_weight_cache():
    layer = make_layer(TensorwiseScaling(formats=E4M3), torch.bfloat16)
    x, dy = inputs(ALIGNED, torch.bfloat16)
    run(layer, x, dy, ALIGNED, emulated_grouped_mm)
    first = layer.grouped_weight_cache.entry
    run(layer, x, dy, ALIGNED, emulated_grouped_mm)
    assert layer.grouped_weight_cache.entry is first  # same micro-step: reused
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    run(layer, x, dy, ALIGNED, emulated_grouped_mm)
    assert layer.grouped_weight_cache.entry.key != first.key  # an optimizer step invalidates
    clear_fp8_weight_caches(layer)
    assert layer.grouped_weight_cache.entry is None
    with final_micro_batch():  # the last micro-batch's backward frees the entry
        run(layer, x, dy, ALIGNED, emulated_grouped_mm)
    assert layer.grouped_weight_cache.entry is None


# ---------------------------------------------------------------------------------------------
# Operands built for all groups at once against the loop's per-group quantizations

SEGMENTS = {
    "uneven": [37, 0, 50, 16, 0, 5, 21],  # empty groups, counts not multiples of 16
    "aligned": [48, 0, 32, 16, 0, 96, 64],  # multiples of 16: amaxes over 16-row blocks first
}
ZERO_GROUP = 3  # an all-zero group: its scales are 1 (mt_fp8.quantized.scale_from_amax)


def segmented_inputs(segments, dtype, device):
    """x (T, K) whose groups have different ranges (so that their scales differ), W (E, N, K)."""
    generator = torch.Generator().manual_seed(2)
    total = sum(segments)
    ranges = torch.tensor([4.0**e for e in range(len(segments))])
    ranges[ZERO_GROUP] = 0.0
    x = torch.randn(total, K, generator=generator)
    x = x * ranges.repeat_interleave(torch.tensor(segments))[:, None]
    x[40, 3] = float("inf")  # NaN scales: its row, its group column, its whole group
    x[1, 5] = float("nan")
    w = torch.randn(len(segments), N, K, generator=generator) * ranges[:, None, None].clamp_min(1)
    return x.to(device, dtype), w.to(device, dtype)


def segmented_plan(segments, recipe, dtype, device):
    layer = FP8GroupedLinear(len(segments), K, N, recipe=recipe, dtype=dtype, device=device)
    return layer.linear_plan(torch.empty(0, K, dtype=dtype, device=device), None)


def assert_quantized_equal(data, scale, expected):
    """Equal bytes and scales; where the expected value is NaN, only NaN-ness (the FP8 NaN
    codes of the Triton and PyTorch casts may differ in sign)."""
    expected_scale = expected.scale.expand(data.shape[0], 1).reshape(-1)
    nan_scale, nan_data = expected_scale.isnan(), expected.data.float().isnan()
    assert torch.equal(scale.isnan(), nan_scale) and torch.equal(data.float().isnan(), nan_data)
    assert torch.equal(scale[~nan_scale], expected_scale[~nan_scale])
    assert torch.equal(as_bytes(data)[~nan_data], as_bytes(expected.data)[~nan_data])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("segments", list(SEGMENTS.values()), ids=list(SEGMENTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling])
def test_all_group_operands_are_the_per_group_quantizations(recipe_cls, dtype, segments, device):
    """Rows, wgrad columns and stacked weights equal, byte for byte and scale for scale, what
    the loop's quantizers give each group (the Triton kernels on CUDA), health counts too."""
    recipe = recipe_cls(formats=E4M3)
    x_TK, w_ENK = segmented_inputs(segments, dtype, device)
    plan = segmented_plan(segments, recipe, dtype, device)
    loop_plan = segmented_plan(segments, recipe, dtype, device)
    role = TensorRole.INPUT
    rows = grouped_module._quantize_rows(plan, x_TK, segments, role)
    data_KT, scales = grouped_module._quantize_columns(plan, x_TK, rows, segments, role)
    per_group = grouped_module._group_columns(plan, x_TK, rows, segments, role)  # per-group wgrad
    weight, weight_t = grouped_module._quantize_weights(plan, w_ENK, need_transpose=True)
    present = 0
    for e, (s, t) in enumerate(grouped_module._bounds(segments)):
        w_q, w_t_q = loop_plan.weight_operands(w_ENK[e], need_transpose=True)
        assert_quantized_equal(weight.data[e], weight.column_scales()[e], w_q)
        assert_quantized_equal(weight_t.data[e], weight_t.column_scales()[e], w_t_q)
        if t == s:
            continue
        q = loop_plan.quantize(x_TK[s:t], role, record=True, transposed=True)
        assert_quantized_equal(rows.data[s:t], rows.scale_T[s:t], q)
        group = rows.group(s, t)
        torch.testing.assert_close(group.scale, q.scale, rtol=0, atol=0, equal_nan=True)
        q_t = loop_plan.quantize_transposed(x_TK[s:t], q, role)
        assert_quantized_equal(data_KT[:, s:t], scales[present * K : (present + 1) * K], q_t)
        assert_quantized_equal(per_group[e].data, per_group[e].scale.expand(K, 1).reshape(-1), q_t)
        assert per_group[e].data.is_contiguous() and per_group[e].scale.shape == q_t.scale.shape
        present += 1
    assert data_KT.shape == (K, sum(segments)) and scales.shape == (present * K,)
    assert (rows.scale_T == 1).any() and rows.scale_T.isnan().any()  # the edge cases
    assert scales.isnan().any() and not scales.isnan().all()
    assert torch.equal(plan.meta.health, loop_plan.meta.health)


def one_op_grouped_mm(a, b, scale_a, scale_b, offs):
    """A stand-in for the grouped kernel that dispatches one op (the operands are what count)."""
    if b.dim() == 3:
        return a.new_zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16)
    return a.new_zeros(len(offs), a.shape[0], b.shape[1], dtype=torch.bfloat16)


class AtenOpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


OP_COUNT_SIZES = {
    "aligned": lambda e: 16 * (e % 3),  # a third of the groups empty
    "unaligned": lambda e: 16 * (e % 3) + e % 5,  # the wgrad pads these groups to 16 tokens
}


def ops_per_call(recipe, experts, size_of=OP_COUNT_SIZES["aligned"], as_tensor=None):
    """Aten ops of one forward + backward with every GEMM grouped (no bias: its gradient is
    one fp32 sum per group, as the loop's, so that its bits stay the loop's); ``as_tensor``
    (a tensor subclass) passes the group sizes as a tensor of that class."""
    layer = FP8GroupedLinear(experts, K, N, recipe=recipe, bias=False, dtype=torch.bfloat16)
    sizes = [size_of(e) for e in range(experts)]
    x = torch.randn(sum(sizes), K, dtype=torch.bfloat16, requires_grad=True)
    group_sizes = sizes if as_tensor is None else torch.tensor(sizes).as_subclass(as_tensor)
    plan = layer.linear_plan(x, None)
    counter = AtenOpCount()
    with counter:
        y = fp8_grouped_linear(x, layer.weight, None, group_sizes, plan, one_op_grouped_mm)
        y.backward(torch.ones_like(y))
    assert x.grad is not None and layer.weight.grad is not None
    return counter.count


@pytest.mark.parametrize("sizes", list(OP_COUNT_SIZES), ids=list(OP_COUNT_SIZES))
@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling])
def test_ops_per_call_do_not_grow_with_the_number_of_experts(recipe_cls, sizes):
    recipe, size_of = recipe_cls(formats=E4M3), OP_COUNT_SIZES[sizes]
    assert ops_per_call(recipe, 4, size_of) == ops_per_call(recipe, 32, size_of)


# ---------------------------------------------------------------------------------------------
# Group sizes as a device tensor (rowwise scaling, every GEMM grouped)


class Unread(torch.Tensor):
    """Group sizes whose values the host must not read (as reading a CUDA tensor's waits for
    the device); every tensor computed from them is one too."""

    def _read(self, *args, **kwargs):
        raise AssertionError("the group sizes (or a tensor computed from them) were read")

    tolist = item = __iter__ = __int__ = __index__ = __bool__ = __float__ = _read


@pytest.mark.parametrize("sizes", list(OP_COUNT_SIZES), ids=list(OP_COUNT_SIZES))
def test_device_sizes_are_never_read_and_ops_do_not_grow(sizes):
    """Rowwise, all E4M3, no bias: the call given a tensor of group sizes reads none of them
    (nor anything computed from them) on the host, in a number of ops independent of E."""
    recipe, size_of = RowwiseScaling(formats=E4M3), OP_COUNT_SIZES[sizes]
    counts = [ops_per_call(recipe, experts, size_of, as_tensor=Unread) for experts in (4, 32)]
    assert counts[0] == counts[1]


DEVICE_SIZES_CASES = {
    "rowwise-e4m3-uneven": (RowwiseScaling, E4M3, UNEVEN),
    "rowwise-e4m3-aligned": (RowwiseScaling, E4M3, ALIGNED),
    "rowwise-e4m3-full": (RowwiseScaling, E4M3, FULL),
    "rowwise-hybrid": (RowwiseScaling, FormatConfig(), UNEVEN),  # per-group GEMMs: host read
    "tensorwise-e4m3": (TensorwiseScaling, E4M3, UNEVEN),  # per-group scales: host read
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(DEVICE_SIZES_CASES), ids=list(DEVICE_SIZES_CASES))
def test_device_sizes_give_the_host_sizes_bits(case, dtype):
    """The grouped call given a tensor of group sizes (the emulated kernel) returns the
    host-ints call's y, dx, dW and db bit for bit: read on the device where every GEMM is
    grouped under rowwise scaling (wgrad padding in the bound's columns, amaxes over every
    group), read to the host elsewhere; the GEMMs see the same operands either way."""
    recipe_cls, formats, sizes = DEVICE_SIZES_CASES[case]
    recipe = recipe_cls(formats=formats)
    layer = make_layer(recipe, dtype)
    x, dy = inputs(sizes, dtype)
    host_calls, device_calls = Recorder(), Recorder()
    host = run(layer, x, dy, sizes, host_calls)
    on_device = run(layer, x, dy, torch.tensor(sizes), device_calls)
    for name in ("y", "dx", "dw", "db"):
        assert torch.equal(host[name], on_device[name]), name
    assert len(host_calls.calls) == len(device_calls.calls)
    in_bound = 0
    for host_call, device_call in zip(host_calls.calls, device_calls.calls, strict=True):
        a, b, scale_a, scale_b, offs = device_call
        if a.shape != host_call[0].shape:  # the wgrad's operands, in the bound's columns
            columns, in_bound = host_call[4][-1], in_bound + 1
            assert offs == host_call[4] and not as_bytes(a[:, columns:]).any()
            a, b = a[:, :columns], b[:columns]
        assert torch.equal(as_bytes(a), as_bytes(host_call[0]))
        assert torch.equal(as_bytes(b), as_bytes(host_call[1]))
        assert torch.equal(scale_a, host_call[2]) and torch.equal(scale_b, host_call[3])
    if formats is E4M3 and recipe_cls is RowwiseScaling:  # read on the device
        assert len(device_calls.calls) == 3 and in_bound == 1  # the wgrad's in the bound


class WholeStackOutputs(TorchDispatchMode):
    """Counts the aten ops whose output has ``shape`` (the whole [E, N, K] weight stack)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += sum(
            isinstance(t, torch.Tensor) and t.shape == self.shape
            for t in (out if isinstance(out, (tuple, list)) else (out,))
        )
        return out


@pytest.mark.parametrize("recipe_name", ["rowwise", "block"])
def test_loop_backward_builds_the_weight_gradient_once(recipe_name):
    # The per-expert loop (every recipe on CPU, and wherever grouped_gemm_reason gives a
    # reason) once indexed the stacked weight per expert, and each index's backward wrote a
    # zero tensor of the whole stack and added into it: 2E whole-stack tensors per backward
    # (10x slower steps at 64 experts on the GPU). Now: the stacked gradient plus the
    # accumulation into .grad.
    experts, dim = 16, 128
    layer = FP8GroupedLinear(experts, dim, dim, recipe=recipe_from_name(recipe_name), bias=False)
    sizes = [8 * (e % 3) for e in range(experts)]
    x = torch.randn(sum(sizes), dim)
    y = layer(x, sizes)
    counter = WholeStackOutputs(layer.weight.shape)
    with counter:
        y.backward(torch.ones_like(y))
    assert layer.weight.grad is not None
    assert counter.count <= 2, counter.count


class StackSizedBytes(TorchDispatchMode):
    """Bytes written into tensors of at least ``numel`` elements (the whole [E, N, K] stack)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.bytes = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and not func.is_view:
                self.bytes += t.numel() * t.element_size()
        return out


@pytest.mark.parametrize("sizes", [UNEVEN, [37, 16, 50, 73]], ids=["idle expert", "all busy"])
def test_grouped_weight_gradient_is_written_once_with_an_idle_expert(sizes):
    # The grouped wgrad GEMM writes every expert's bf16 gradient (an idle expert's from zero
    # columns: zeros) and one conversion makes the fp32 .grad: 2 + 4 bytes per weight element.
    # Idle experts were once left out of the GEMM and the gradient assembled in a zeroed fp32
    # stack by an index copy, 8 bytes per element more (the values: test_empty_groups_...).
    layer = FP8GroupedLinear(E, K, N, recipe=RowwiseScaling(formats=E4M3), bias=False)
    x = torch.randn(sum(sizes), K, requires_grad=True)
    plan = layer.linear_plan(x, None)
    y = fp8_grouped_linear(x, layer.weight, None, sizes, plan, one_op_grouped_mm)
    counter = StackSizedBytes(layer.weight.numel())
    with counter:
        y.backward(torch.ones_like(y))
    assert layer.weight.grad.dtype == torch.float32
    assert counter.bytes == (2 + 4) * layer.weight.numel()


class OpsOn(TorchDispatchMode):
    """The aten ops given ``tensor`` itself as their first argument."""

    def __init__(self, tensor):
        super().__init__()
        self.tensor, self.ops = tensor, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and args[0] is self.tensor:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_tensorwise_stacked_weight_amax_reads_the_weight_once():
    # The stacked expert weights are quantized again after every optimizer step; their
    # per-expert amaxes are one ∞-norm reduction of the fp32 stack (abs() once wrote an fp32
    # copy of all of it first). Bytes and scales stay quantize()'s per expert, NaN and inf too.
    recipe = TensorwiseScaling(formats=E4M3)
    layer = make_layer(recipe)
    with torch.no_grad():
        layer.weight[1, 2, 3] = float("nan")
        layer.weight[2, 0, 0] = float("inf")
    plan = layer.linear_plan(torch.zeros(1, K), None)
    counter = OpsOn(layer.weight)
    with counter, torch.no_grad():
        weight, _ = grouped_module._weight_operands(plan, layer.weight, need_transpose=True)
    assert "aten.abs.default" not in counter.ops, counter.ops
    layout = recipe.layout(TensorRole.WEIGHT)
    for e in range(E):
        expected = quantize(layer.weight[e].detach(), FP8Format.E4M3, layout)
        assert torch.equal(as_bytes(weight.data[e]), as_bytes(expected.data))
        scale, expected_scale = weight.scale[e].reshape(()), expected.scale.reshape(())
        torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0, equal_nan=True)
    assert weight.scale[1].isnan().all() and weight.scale[2].isnan().all()
    assert weight.scale[[0, 3]].isfinite().all()


# ---------------------------------------------------------------------------------------------
# GPU: the real kernel


def fp8_operands(rows, depth, cols, groups, fmt=torch.float8_e4m3fn, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, depth, generator=generator) * 100).clamp(-448, 448).to(fmt)
    b = (torch.randn(groups, cols, depth, generator=generator) * 100).clamp(-448, 448).to(fmt)
    return a.cuda(), b.cuda()


@pytest.mark.gpu
def test_scaled_grouped_mm_layouts_on_cuda():
    # Confirms the layouts the module docstring relies on: 2d x 3d with an empty group in the
    # middle, 2d x 2d with group-major scales. Same operands as the emulation: fp32 summation
    # order plus one bf16 rounding on each side (2^-7 relative).
    sizes = [64, 0, 48, 144]
    offs = torch.tensor([64, 64, 112, 256], dtype=torch.int32, device="cuda")
    a, b = fp8_operands(256, 128, 96, len(sizes))
    scale_a = torch.rand(256, device="cuda") + 0.5
    scale_b = torch.rand(len(sizes), 96, device="cuda") + 0.5
    b_EKN = b.transpose(1, 2)
    fast = scaled_grouped_mm(a, b_EKN, scale_a, scale_b, offs).float()
    slow = emulated_grouped_mm(a, b_EKN, scale_a, scale_b, offs).float()
    mag = emulated_grouped_mm(
        a.float().abs().to(a.dtype), b_EKN.float().abs().to(b.dtype), scale_a, scale_b, offs
    ).float()
    assert ((fast - slow).abs() <= 2**-7 * mag + 128 * 2**-23 * mag).all()
    # 2d x 2d: a (X, T) row-major, b (T, Y) column-major, non-empty groups of 16k tokens.
    offs2 = torch.tensor([64, 112, 256], dtype=torch.int32, device="cuda")
    a2 = a[:, :96].t().contiguous()  # (96, 256)
    b2 = a[:, 32:].t().contiguous().t()  # (256, 96), column-major
    scale_a2 = torch.rand(3 * 96, device="cuda") + 0.5
    scale_b2 = torch.rand(3 * 96, device="cuda") + 0.5
    fast2 = scaled_grouped_mm(a2, b2, scale_a2, scale_b2, offs2).float()
    slow2 = emulated_grouped_mm(a2, b2, scale_a2, scale_b2, offs2).float()
    assert fast2.shape == (3, 96, 96)
    mag2 = emulated_grouped_mm(
        a2.float().abs().to(a2.dtype),
        b2.float().abs().to(b2.dtype),
        scale_a2,
        scale_b2,
        offs2,
    ).float()
    assert ((fast2 - slow2).abs() <= 2**-7 * mag2 + 256 * 2**-23 * mag2).all()


@pytest.mark.gpu
def test_scaled_grouped_mm_refuses_e5m2_on_cuda():
    # Why hybrid recipes keep dgrad and wgrad per expert (gemm_reason); if this starts to pass,
    # E5M2 may be allowed there.
    a, b = fp8_operands(64, 64, 64, 2, fmt=torch.float8_e5m2)
    offs = torch.tensor([32, 64], dtype=torch.int32, device="cuda")
    ones = torch.ones(64, device="cuda")
    with pytest.raises((RuntimeError, ValueError)):  # TORCH_CHECK_VALUE raises ValueError
        scaled_grouped_mm(a, b.transpose(1, 2), ones, ones.expand(2, 64).contiguous(), offs)
    torch.cuda.synchronize()


GPU_SIZES = {"aligned": [208, 0, 96, 336], "uneven": [200, 0, 77, 363]}


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", list(GPU_SIZES.values()), ids=list(GPU_SIZES))
@pytest.mark.parametrize("formats", [FormatConfig(), E4M3], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize(
    ("dtype", "autocast"),
    [(torch.bfloat16, None), (torch.float32, torch.bfloat16)],
    ids=["bf16", "fp32-autocast"],
)
@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling])
def test_grouped_matches_loop_on_cuda(recipe_cls, dtype, autocast, formats, sizes):
    recipe = recipe_cls(formats=formats)
    grouped_layer = make_layer(recipe, dtype, "cuda")
    # The per-expert loop on cuBLAS GEMMs; with groups cuBLAS cannot contract over (token
    # counts not multiples of 16 in wgrad), on the exact emulation. ("auto" would group.)
    loop_backend = "scaled_mm" if all(size % 16 == 0 for size in sizes) else "emulate"
    loop_layer = make_layer(recipe, dtype, "cuda", backend=loop_backend)
    x, dy = inputs(sizes, dtype, "cuda")
    out_dtype = torch.bfloat16
    reason = grouped_gemm_reason(x, grouped_layer.weight, sizes, recipe, "auto", out_dtype)
    assert reason is None, reason
    grouped = run(grouped_layer, x, dy, sizes, autocast=autocast)
    loop = run(loop_layer, x, dy, sizes, autocast=autocast)
    for result in (grouped, loop):
        for name, value in result.items():
            assert torch.isfinite(value).all(), name
    cpu = {k: v.cpu() for k, v in grouped.items()}
    loop_cpu = {k: v.cpu() for k, v in loop.items()}
    loop_layer.cpu()
    check_against_loop_and_float64(cpu, loop_cpu, loop_layer, x.cpu(), dy.cpu(), sizes, formats)
    check_health(grouped_layer, loop_layer, sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("formats", [FormatConfig(), E4M3], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling])
def test_deferred_weight_gradients_equal_the_fused_ones_on_cuda(recipe_cls, formats):
    """The layer's grouped path on ``torch._scaled_grouped_mm`` (wgrad grouped with E4M3, per
    group with E5M2 gradients), uneven groups and an idle expert: with a ``wgrad_sink`` the
    queued weight and bias gradients equal the fused backward's bit for bit."""
    recipe, sizes = recipe_cls(formats=formats), GPU_SIZES["uneven"]

    def step(sink):
        layer = make_layer(recipe, torch.bfloat16, "cuda")
        layer.wgrad_sink = sink
        x, dy = inputs(sizes, torch.bfloat16, "cuda")
        assert grouped_gemm_reason(x, layer.weight, sizes, recipe, "auto", torch.bfloat16) is None
        result = run(layer, x, dy, sizes)
        if sink is not None:
            assert result["dw"] is None and result["db"] is None and len(sink) == 1
            sink.take()()
            result.update(dw=layer.weight.grad, db=layer.bias.grad)
        return result

    fused, deferred = step(None), step(WeightGradSink())
    for name in ("y", "dx", "dw", "db"):
        assert torch.equal(fused[name], deferred[name]), name


def test_block_recipe_loop_matches_float64():
    # DeepSeek-V3 block scaling (1×128 activation/gradient groups, 128×128 weight blocks, E4M3
    # everywhere) runs per expert on every device. Bound per element: the FP8 operand bound of
    # ``product_bound`` with the whole tensor's amax in the subnormal term (each block's amax is
    # at most that, so it is looser than the block's own), plus the fp32 output and bias
    # roundings (2^-23 relative, generous for one rounding of a GEMM result and one of the add).
    recipe = recipe_from_name("block")
    sizes, dim = [40, 0, 88], 128
    torch.manual_seed(0)
    layer = FP8GroupedLinear(len(sizes), dim, dim, recipe=recipe)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), dim, generator=generator).requires_grad_()
    dy = torch.randn(sum(sizes), dim, generator=generator)
    out = run(layer, x, dy, sizes)
    refs = references(layer, x, dy, sizes, recipe.formats)
    bias_TN = layer.bias.detach().double().repeat_interleave(torch.tensor(sizes), dim=0)
    for name in ("y", "dx", "dw"):
        product, fp8_bound = refs[name]
        ref = product + bias_TN if name == "y" else product
        bound = fp8_bound + 2.0**-23 * (ref.abs() + fp8_bound)
        error = (out[name].double() - ref).abs()
        assert (error <= bound).all(), f"{name}: {(error - bound).max()}"
        assert error.max() > 0  # FP8 really ran (the exact product is not FP8-representable)
    assert torch.equal(out["dw"][1], torch.zeros_like(out["dw"][1]))  # the expert with no tokens


class _TwiceGradient(torch.autograd.Function):
    """A view of its input whose backward doubles the gradient (as a TP sum over two equal
    ranks would)."""

    @staticmethod
    def forward(ctx, weight):
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def check_weight_view(device: str) -> None:
    """``forward(x, sizes, weight=view)`` against ``forward(x, sizes)``: on the CPU the
    per-expert loop, on CUDA the grouped kernel."""
    recipe = TensorwiseScaling(formats=E4M3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = make_layer(recipe, dtype, device)
    x, dy = inputs(ALIGNED, dtype, device)
    if device == "cuda":
        assert grouped_gemm_reason(x, layer.weight, ALIGNED, recipe, "auto", dtype) is None

    def cache_entry():
        cache = layer.grouped_weight_cache if device == "cuda" else layer.expert_weight_caches[0]
        return cache.entry

    plain = run(layer, x, dy, ALIGNED)
    cached = cache_entry()
    assert cached is not None
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    y = layer(x, ALIGNED, _TwiceGradient.apply(layer.weight))
    y.backward(dy.to(y.dtype))
    # The same FP8 operands (the cached FP8 weight is found through the view's base, no new
    # quantization), and the gradient reaches the parameter through the view's backward.
    assert torch.equal(y, plain["y"]) and torch.equal(x.grad, plain["dx"])
    assert torch.equal(layer.weight.grad, 2 * plain["dw"])
    assert cache_entry() is cached


def test_weight_view_is_multiplied_and_differentiated_like_the_weight():
    check_weight_view("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", list(GPU_SIZES.values()), ids=list(GPU_SIZES))
def test_device_sizes_give_the_host_sizes_bits_on_cuda(sizes):
    """Rowwise, all E4M3, on ``torch._scaled_grouped_mm``: a CUDA tensor of group sizes gives
    the host ints' y, dx and dW bit for bit (the wgrad's zero columns past its last group, in
    the bound's buffer, belong to no group and change nothing)."""
    layer = make_layer(RowwiseScaling(formats=E4M3), torch.bfloat16, "cuda")
    layer.bias = None
    x, dy = inputs(sizes, torch.bfloat16, "cuda")
    assert layer.reads_sizes_on_device(x)
    results = []
    for group_sizes in (sizes, torch.tensor(sizes, device="cuda")):
        x_leaf = x.detach().clone().requires_grad_()
        layer.zero_grad()
        layer(x_leaf, group_sizes).backward(dy)
        results.append((x_leaf.grad, layer.weight.grad))
    (dx, dw), (dx_device, dw_device) = results
    assert torch.equal(dx, dx_device) and torch.equal(dw, dw_device)


@pytest.mark.gpu
def test_weight_view_on_the_grouped_cuda_path():
    check_weight_view("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("recipe_cls", "device_sizes"),
    [(TensorwiseScaling, False), (RowwiseScaling, False), (RowwiseScaling, True)],
    ids=["tensorwise", "rowwise", "rowwise-device-sizes"],
)
def test_grouped_call_does_not_synchronize_on_cuda(recipe_cls, device_sizes):
    # Group sizes given as host ints, or (rowwise, every GEMM grouped) as a CUDA tensor read on
    # the device: a forward + backward with unaligned groups (the padded wgrad) and an empty
    # one waits for the device nowhere; CUDA's sync debug mode raises on a blocking copy,
    # .item(), .tolist() or nonzero.
    recipe = recipe_cls(formats=E4M3)
    layer = make_layer(recipe, torch.bfloat16, "cuda")
    layer.bias = None  # MoE experts have none (its gradient is one sum per group)
    sizes = GPU_SIZES["uneven"]
    x, dy = inputs(sizes, torch.bfloat16, "cuda")
    group_sizes = torch.tensor(sizes, device="cuda") if device_sizes else sizes
    assert layer.reads_sizes_on_device(x) == (recipe_cls is RowwiseScaling)
    step = lambda: layer(x, group_sizes).backward(dy)  # noqa: E731
    run_without_synchronizing(step)
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
