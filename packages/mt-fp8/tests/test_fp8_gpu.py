"""GPU paths against the emulation reference: torch._scaled_mm, the Triton block GEMM, FP8Linear.

The fused ops' Triton kernels are covered by the ``cuda`` cases of test_fp8_ops.py.
Bounds: fast paths and emulation multiply the same FP8 operands; they differ only by fp32
summation order (K · 2^-24 relative to Σ|ab|) and the rounding of the output (bf16: 2^-8).
"""

from __future__ import annotations

import pytest
import torch

from mt_fp8 import (
    BlockScaling,
    DelayedScaling,
    FP8Format,
    FP8Linear,
    MXFP8Scaling,
    RowwiseScaling,
    ScaleLayout,
    TensorwiseScaling,
    fp8_gemm,
    quantize,
)

pytestmark = pytest.mark.gpu
K = 1024


def operands(layout_a, layout_b, fmt_a=FP8Format.E4M3, fmt_b=FP8Format.E4M3):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(512, K, generator=generator).cuda()
    b = torch.randn(384, K, generator=generator).cuda() * 0.05
    return quantize(a, fmt_a, layout_a), quantize(b, fmt_b, layout_b)


def check(fast, slow, qa, qb, out_eps):
    magnitude = qa.dequantize().abs() @ qb.dequantize().abs().t()
    assert (
        (fast.float() - slow).abs() <= K * 2**-24 * magnitude + out_eps * slow.abs() + 1e-5
    ).all()


@pytest.mark.parametrize(
    ("layout", "out_dtype"),
    [
        (ScaleLayout((-1, -1)), torch.float32),
        (ScaleLayout((-1, -1)), torch.bfloat16),
        (ScaleLayout((1, -1)), torch.bfloat16),
    ],
    ids=["tensorwise-fp32", "tensorwise-bf16", "rowwise-bf16"],
)
@pytest.mark.parametrize("fmt_a", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_scaled_mm_on_cuda(layout, out_dtype, fmt_a):
    qa, qb = operands(layout, layout, fmt_a=fmt_a)
    fast = fp8_gemm(qa, qb, out_dtype, backend="scaled_mm")
    check(fast, fp8_gemm(qa, qb, backend="emulate"), qa, qb, torch.finfo(out_dtype).eps)


@pytest.mark.parametrize(
    ("layout_b", "fmt_a", "group"),
    [
        ((128, 128), FP8Format.E4M3, 128),
        ((1, 128), FP8Format.E4M3, 128),
        ((1, 128), FP8Format.E5M2, 128),
        ((1, 32), FP8Format.E4M3, 32),
    ],
    ids=["act-x-weight", "act-x-act", "grad-x-act", "mx"],
)
def test_triton_block_gemm(layout_b, fmt_a, group):
    pow2 = group == 32
    qa, qb = operands(ScaleLayout((1, group), pow2), ScaleLayout(layout_b, pow2), fmt_a=fmt_a)
    fast = fp8_gemm(qa, qb, torch.float32, backend="triton")
    check(fast, fp8_gemm(qa, qb, backend="emulate"), qa, qb, 2**-24)


@pytest.mark.parametrize(
    "recipe",
    [DelayedScaling(), TensorwiseScaling(), RowwiseScaling(), BlockScaling(), MXFP8Scaling()],
    ids=lambda r: r.name,
)
def test_fp8_linear_fast_matches_emulation_on_cuda(recipe):
    results = []
    for backend in ("auto", "emulate"):
        torch.manual_seed(0)
        layer = FP8Linear(
            512, 256, recipe=recipe, backend=backend, device="cuda", dtype=torch.bfloat16
        )
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.backward(torch.ones_like(y))
        results.append((y.float(), x.grad.float(), layer.weight.grad.float()))
    for fast, slow in zip(*results, strict=True):
        # bf16 outputs: one bf16 rounding (2^-8) apart at most, plus fp32 summation order.
        assert torch.allclose(fast, slow, rtol=2**-7, atol=1e-2)
