"""``FusedAdamW`` (:mod:`mt_fp8.optim`): the Triton pass against a float64 AdamW, the fallback
against ``torch.optim.AdamW``, ``grad_scale``, state compatibility and bad input.

The kernel cases run on CUDA (marked ``gpu``) or, on the CPU, in Triton's interpreter under
``TRITON_INTERPRET=1`` (otherwise they skip)::

    TRITON_INTERPRET=1 pytest -q packages/mt-fp8/tests/test_fp8_optim.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mt_fp8 import FP8Linear, FusedAdamW, TensorwiseScaling

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3


def reference_adamw(theta, grads, grad_scale, lr, betas, eps, weight_decay):
    """AdamW in float64 (the module docstring's formulas); returns θ and the largest step."""
    theta = theta.double().clone()
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    beta1, beta2 = betas
    largest = 0.0
    for t, grad in enumerate(grads, start=1):
        g = grad.double() / grad_scale
        theta *= 1 - lr * weight_decay
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = lr / (1 - beta1**t) * m / (v.sqrt() / math.sqrt(1 - beta2**t) + eps)
        largest = max(largest, update.abs().max().item())
        theta -= update
    return theta, largest


def make_param(device, numel=5000, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    # 5000 elements: one full 4096-element program and a partial one.
    theta = torch.randn(numel, generator=generator).to(device, dtype)
    grads = [torch.randn(numel, generator=generator).to(device, dtype) for _ in range(STEPS)]
    return torch.nn.Parameter(theta), grads


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("grad_scale", [None, 2.5])
def test_kernel_matches_float64_adamw(device, grad_scale):
    param, grads = make_param(device)
    initial = param.detach().clone()
    optimizer = FusedAdamW([param], **HYPER)
    assert optimizer.kernel_takes(param.requires_grad_()) is False  # no gradient yet
    if grad_scale is not None:
        optimizer.grad_scale = torch.tensor(grad_scale, device=device)
    for grad in grads:
        param.grad = grad.clone()
        assert optimizer.kernel_takes(param)
        optimizer.step()
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)  # not divided in place
    expected, largest = reference_adamw(initial, grads, grad_scale or 1.0, **HYPER)
    # Per step the fp32 pass rounds θ once (2^-24 relative) and evaluates the update in about
    # ten fp32 operations (moments, sqrt, division: under 2^-20 relative together); over
    # STEPS steps the errors add.
    bound = STEPS * (2**-24 * expected.abs().max().item() + 2**-20 * largest)
    error = (param.detach().double() - expected).abs().max().item()
    assert error <= bound, (error, bound)
    assert optimizer.state[param]["step"].device.type == "cpu"
    assert float(optimizer.state[param]["step"]) == STEPS


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_updates_bf16_parameters_and_moments_in_their_dtype(device):
    param, grads = make_param(device, dtype=torch.bfloat16)
    initial = param.detach().clone()
    optimizer = FusedAdamW([param], **HYPER)
    for grad in grads:
        param.grad = grad
        optimizer.step()
    expected, largest = reference_adamw(initial, grads, 1.0, **HYPER)
    assert optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
    # Each step stores θ and the moments in bf16: at most one bf16 ulp (2^-7 relative), since
    # Triton's interpreter truncates fp32 to bf16 (seen: 2.008 stored as 2.0) where the GPU
    # rounds to nearest (half an ulp). θ's rounding dominates; the moments' rounding moves each
    # update by at most about 3 ulps of itself (m, v and the square root).
    bound = STEPS * (2**-7 * expected.abs().max().item() + 2**-5 * largest)
    error = (param.detach().double() - expected).abs().max().item()
    assert error <= bound, (error, bound)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_one_parameter_the_kernel_cannot_take_sends_the_whole_step_to_pytorch(device):
    # The second gradient is a transposed view (not contiguous): the step must not update the
    # first parameter with the kernel and the second with PyTorch, but both with PyTorch.
    generator = torch.Generator().manual_seed(5)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(device))
        for shape in ((64, 32), (32, 48))
    ]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = FusedAdamW(params, **HYPER), torch.optim.AdamW(twins, **HYPER)
    for _ in range(STEPS):
        grads = [
            torch.randn(64, 32, generator=generator).to(device),
            torch.randn(48, 32, generator=generator).to(device).t(),
        ]
        for param, twin, grad in zip(params, twins, grads, strict=True):
            param.grad, twin.grad = grad, grad.clone()
        assert ours.kernel_takes(params[0]) and not ours.kernel_takes(params[1])
        ours.step()
        theirs.step()
    for param, twin in zip(params, twins, strict=True):
        torch.testing.assert_close(param, twin, rtol=0, atol=0)


@pytest.mark.gpu
def test_kernel_matches_torch_fused_adamw_on_cuda():
    param, grads = make_param("cuda", numel=1 << 20)
    twin = torch.nn.Parameter(param.detach().clone())
    ours, theirs = FusedAdamW([param], **HYPER), torch.optim.AdamW([twin], fused=True, **HYPER)
    scale = torch.tensor(1.7, device="cuda")
    ours.grad_scale, theirs.grad_scale = scale, scale
    for grad in grads:
        param.grad, twin.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    # Same formulas in the same order; the kernels may contract multiply-adds differently
    # (a few fp32 ulps of each update).
    torch.testing.assert_close(param, twin, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.state[param]["exp_avg"], theirs.state[twin]["exp_avg"])


@pytest.mark.skipif(INTERPRET, reason="the fallback runs only without Triton's interpreter")
def test_cpu_falls_back_to_torch_adamw_with_the_grad_scale_applied():
    param, grads = make_param("cpu")
    twin = torch.nn.Parameter(param.detach().clone())
    ours, theirs = FusedAdamW([param], **HYPER), torch.optim.AdamW([twin], **HYPER)
    ours.grad_scale = torch.tensor(4.0)
    for grad in grads:
        param.grad, twin.grad = grad.clone(), grad / 4.0
        assert not ours.kernel_takes(param)
        ours.step()
        theirs.step()
    torch.testing.assert_close(param, twin, rtol=0, atol=0)
    # The state is torch.optim.AdamW's: it loads into one and back.
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert set(ours.state[param]) == {"step", "exp_avg", "exp_avg_sq"}


def test_steps_invalidate_the_fp8_weight_cache():
    # The update does not bump the weight's version; FP8 layers learn of the step from the
    # optimizer step hook, which FusedAdamW's step fires like any torch optimizer's.
    layer = FP8Linear(64, 32, recipe=TensorwiseScaling())
    optimizer = FusedAdamW(layer.parameters(), **HYPER)
    x = torch.randn(8, 64)
    layer(x).sum().backward()
    cached = layer.fp8_weight_cache.entry.key
    optimizer.step()
    layer(x).sum().backward()
    assert layer.fp8_weight_cache.entry.key != cached


def test_bad_arguments_are_refused():
    param, _ = make_param("cpu")
    with pytest.raises(TypeError, match="float learning rate"):
        FusedAdamW([param], lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match="Invalid beta"):
        FusedAdamW([param], betas=(1.5, 0.9))
