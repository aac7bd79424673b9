"""The grouped path's stacked tensorwise expert weights from the Triton stack kernel
(:func:`mt_fp8.kernels.quantize.quantize_transpose_stack_triton`) against the eager path.

The eager path (``MT_FP8_DISABLE_TRITON=1``, and every device without Triton) casts the stacked
(E·N, K) rows with ``cast_to_fp8`` and copies the FP8 bytes transposed. The kernel must give the
same FP8 bytes (where a value is NaN only NaN-ness is compared, as in test_fp8_block_fast.py),
the same scales and the same health counts, both for scales from each expert's own amax
(current tensorwise scaling, :func:`mt_fp8.grouped._quantize_weights`) and for given scales
that are not (delayed scaling's scales come from the amax history: values saturate); and one
grouped forward and backward gives the eager path's outputs, gradients and counts bit for bit.
The CPU cases run the kernel in Triton's interpreter, only under ``TRITON_INTERPRET=1``::

    TRITON_INTERPRET=1 pytest -q packages/mt-fp8/tests/test_fp8_grouped_stack.py
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_block_fast import DEVICES, FORMATS

import mt_fp8.grouped as grouped_module
from mt_fp8 import FormatConfig, FP8Format, FP8GroupedLinear, TensorRole, TensorwiseScaling
from mt_fp8.grouped import emulated_grouped_mm, fp8_grouped_linear
from mt_fp8.quantized import cast_to_fp8, scale_from_amax

# (E, N, K), N and K multiples of 16 as FP8 layers need: (3, 80, 112) partial 64 × 64 tiles
# along both axes; (2, 16, 144) fewer rows than a tile and three column tiles, the last of 16.
SHAPES = [(3, 80, 112), (2, 16, 144)]
DTYPES = [torch.float32, torch.bfloat16]


def stack_kernels():
    from mt_fp8.kernels import quantize

    return quantize


def awkward_stack(experts, rows, cols, dtype, device):
    """Expert weights with different ranges, a row of tiny values (flushed to zero at the
    expert's scale) and, from the third expert on, an all-zero expert (scale 1) and an inf
    (NaN scale, NaN bytes)."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(experts, rows, cols, generator=generator)
    w *= torch.tensor([4.0**e for e in range(experts)])[:, None, None]
    w[0, 1] = torch.logspace(-12, -2, cols)
    if experts > 2:
        w[1] = 0
        w[2, 3, 5] = float("inf")
    return w.to(device, dtype)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def assert_same_fp8(actual, expected):
    """Equal shapes and bytes; where the expected value is NaN, only NaN-ness (the FP8 NaN codes
    of the Triton and PyTorch casts may differ in sign)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = expected.float().isnan()
    assert torch.equal(actual.float().isnan(), nan)
    assert torch.equal(as_bytes(actual)[~nan], as_bytes(expected)[~nan])


def count_kernel_calls(monkeypatch):
    """Record the calls grouped.py makes to the stack kernel (it imports it at the call)."""
    kernels, calls = stack_kernels(), []
    original = kernels.quantize_transpose_stack_triton
    monkeypatch.setattr(
        kernels,
        "quantize_transpose_stack_triton",
        lambda *args, **kwargs: calls.append(tuple(args[0].shape)) or original(*args, **kwargs),
    )
    return calls


def weight_plan(experts, rows, cols, fmt, dtype, device):
    recipe = TensorwiseScaling(formats=FormatConfig(weight=fmt))
    layer = FP8GroupedLinear(experts, cols, rows, recipe=recipe, dtype=dtype, device=device)
    return layer.linear_plan(torch.empty(0, cols, dtype=dtype, device=device), None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_stacked_weights_are_the_eager_paths(shape, dtype, fmt, device, monkeypatch):
    w_ENK = awkward_stack(*shape, dtype, device)
    calls = count_kernel_calls(monkeypatch)
    results = {}
    for path in ("eager", "fused"):
        monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1" if path == "eager" else "0")
        plan = weight_plan(*shape, fmt, dtype, device)
        weight, weight_t = grouped_module._quantize_weights(plan, w_ENK, need_transpose=True)
        results[path] = weight, weight_t, plan.meta.health[int(TensorRole.WEIGHT)]
    assert calls == [shape]  # one launch on the fused path, none on the eager one
    (weight, weight_t, health), (eager, eager_t, eager_health) = results["fused"], results["eager"]
    assert_same_fp8(weight.data, eager.data)
    assert_same_fp8(weight_t.data, eager_t.data)
    torch.testing.assert_close(weight.scale, eager.scale, rtol=0, atol=0, equal_nan=True)
    assert weight_t.scale is weight.scale
    assert torch.equal(health, eager_health) and health[2] == w_ENK.numel()
    if shape[0] > 2:  # the edge cases are there: a flush, scale 1, a NaN scale
        assert health[1] > 0 and (eager.scale == 1).any() and eager.scale.isnan().any()
    # Without the transpose the kernel writes W alone.
    plan = weight_plan(*shape, fmt, dtype, device)
    alone, none = grouped_module._quantize_weights(plan, w_ENK, need_transpose=False)
    assert none is None and calls == [shape, shape]
    assert_same_fp8(alone.data, eager.data)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_given_scales_cast_as_cast_to_fp8(dtype, fmt, device):
    # Delayed scaling's scales come from the amax history, not from these values: a quarter of
    # each expert's own scale saturates its largest values, 64 times it flushes more.
    experts, rows, cols = SHAPES[1]
    w_ENK = awkward_stack(experts, rows, cols, dtype, device)
    amax_E = torch.linalg.vector_norm(w_ENK, ord=float("inf"), dim=(1, 2)).float()
    scale_E = scale_from_amax(amax_E, fmt) * torch.tensor([0.25, 64.0], device=device)
    stats = torch.zeros(3, dtype=torch.int64, device=device)
    q, q_t = stack_kernels().quantize_transpose_stack_triton(w_ENK, scale_E, fmt, stats, True)
    expected_stats = torch.zeros_like(stats)
    scale_rows = scale_E.repeat_interleave(rows)[:, None]
    expected = cast_to_fp8(w_ENK.reshape(-1, cols), scale_rows, fmt, expected_stats)
    expected = expected.view(w_ENK.shape)
    assert_same_fp8(q, expected)
    assert_same_fp8(q_t, expected.transpose(1, 2).contiguous())
    assert torch.equal(stats, expected_stats) and stats[0] > 0 and stats[1] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_stack_kernel_refuses_bad_inputs(device):
    kernel, fmt = stack_kernels().quantize_transpose_stack_triton, FP8Format.E4M3
    scale = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="takes a 3-D bfloat16, float16 or float32 tensor"):
        kernel(torch.ones(2, 4, 8, dtype=torch.float64, device=device), scale, fmt, None, True)
    with pytest.raises(ValueError, match=r"scale_B must be fp32 of shape \(2,\)"):
        kernel(torch.ones(2, 4, 8, device=device), scale[:1], fmt, None, True)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_forward_and_backward_are_the_eager_paths(device, monkeypatch):
    # Same FP8 operands, same emulated grouped GEMM: the same bits, and the same counts.
    experts, in_features, out_features = 3, 48, 80
    sizes = [37, 0, 21]
    recipe = TensorwiseScaling(formats=FormatConfig.all_e4m3())  # every GEMM grouped
    calls = count_kernel_calls(monkeypatch)
    results = {}
    for path in ("eager", "fused"):
        monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1" if path == "eager" else "0")
        torch.manual_seed(0)
        layer = FP8GroupedLinear(
            experts, in_features, out_features, recipe=recipe, dtype=torch.bfloat16, device=device
        )
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(sum(sizes), in_features, generator=generator)
        dy = torch.randn(sum(sizes), out_features, generator=generator)
        x = x.to(device, torch.bfloat16).requires_grad_()
        plan = layer.linear_plan(x, layer.grouped_weight_cache)
        y = fp8_grouped_linear(x, layer.weight, layer.bias, sizes, plan, emulated_grouped_mm)
        y.backward(dy.to(device, torch.bfloat16))
        results[path] = (y, x.grad, layer.weight.grad, layer.bias.grad, layer.fp8_meta.health)
    assert calls == [(experts, out_features, in_features)]  # W and Wᵀ: one launch
    for fused, eager in zip(results["fused"], results["eager"], strict=True):
        assert torch.equal(fused, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stacked_weights_at_scale_on_cuda(dtype, monkeypatch):
    # Many programs per expert and many experts (DeepSeek-V2-Lite's expert width).
    shape = (64, 1408, 2048)
    w_ENK = awkward_stack(*shape, dtype, "cuda")
    results = {}
    for path in ("eager", "fused"):
        monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1" if path == "eager" else "0")
        plan = weight_plan(*shape, FP8Format.E4M3, dtype, "cuda")
        weight, weight_t = grouped_module._quantize_weights(plan, w_ENK, need_transpose=True)
        results[path] = weight, weight_t, plan.meta.health[int(TensorRole.WEIGHT)]
    (weight, weight_t, health), (eager, eager_t, eager_health) = results["fused"], results["eager"]
    assert_same_fp8(weight.data, eager.data)
    assert_same_fp8(weight_t.data, eager_t.data)
    torch.testing.assert_close(weight.scale, eager.scale, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(health, eager_health)
