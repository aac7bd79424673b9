"""GPU paths against the emulation reference: torch._scaled_mm, the Triton block GEMM, FP8Linear.

The fused ops' Triton kernels are covered by the ``cuda`` cases of test_fp8_ops.py.
Bounds: fast paths and emulation multiply the same FP8 operands; they differ only by fp32
summation order (K · 2^-24 relative to Σ|ab|) and the rounding of the output (bf16: 2^-8).
"""

from __future__ import annotations

import pytest
import torch

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
    fp8_gemm,
    quantize,
)
from mt_fp8.quantized import QuantizedTensor

pytestmark = pytest.mark.gpu
K = 1024
ROWWISE = ScaleLayout((1, -1))


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
        (ScaleLayout((1, -1)), torch.float32),
    ],
    ids=["tensorwise-fp32", "tensorwise-bf16", "rowwise-bf16", "rowwise-fp32"],
)
@pytest.mark.parametrize("fmt_a", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_scaled_mm_on_cuda(layout, out_dtype, fmt_a):
    qa, qb = operands(layout, layout, fmt_a=fmt_a)
    fast = fp8_gemm(qa, qb, out_dtype, backend="scaled_mm")
    assert fast.dtype == out_dtype
    # A rowwise GEMM on CUDA rounds to bf16 whatever the output dtype (gemm.scaled_mm).
    rounded = torch.bfloat16 if layout.block == (1, -1) else out_dtype
    check(fast, fp8_gemm(qa, qb, backend="emulate"), qa, qb, torch.finfo(rounded).eps)


@pytest.mark.parametrize("layout", [ScaleLayout((-1, -1)), ROWWISE], ids=["tensorwise", "rowwise"])
def test_unaligned_contraction_takes_scaled_mm_on_cuda(layout):
    """A weight gradient over 577 tokens (a ViT-L/14 image with its class token) runs on the
    tensor cores, its contraction zero-padded to 592, instead of falling back to the fp32
    emulation (which made FP8 slower than bf16 in the VLM's vision tower)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(384, 577, generator=generator).cuda()
    b = torch.randn(256, 577, generator=generator).cuda() * 0.05
    qa, qb = quantize(a, FP8Format.E5M2, layout), quantize(b, FP8Format.E4M3, layout)
    assert gemm_module.scaled_mm_reason(qa, qb, torch.bfloat16) is None
    fast = fp8_gemm(qa, qb, torch.bfloat16, backend="fast")
    check(fast, fp8_gemm(qa, qb, backend="emulate"), qa, qb, torch.finfo(torch.bfloat16).eps)


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


@pytest.mark.parametrize("layout", [ScaleLayout((-1, -1)), ROWWISE], ids=lambda g: g.name)
@pytest.mark.parametrize("rows", [200, 363])
def test_scaled_mm_takes_scales_at_any_offset(layout, rows):
    """Scales that are views 4 bytes into a buffer (one expert's slice of a grouped layer's
    stacked scales, a token range of rowwise scales): cuBLAS refuses such pointers, so
    ``scaled_mm`` copies them; the result matches emulation."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, K, generator=generator).cuda()
    b = torch.randn(384, K, generator=generator).cuda() * 0.05
    qa, qb = quantize(a, FP8Format.E4M3, layout), quantize(b, FP8Format.E4M3, layout)
    shifted = []
    for q in (qa, qb):
        buffer = torch.empty(q.scale.numel() + 1, device="cuda")
        buffer[1:] = q.scale.reshape(-1)
        scale = buffer[1:].view(q.scale.shape)
        assert scale.data_ptr() % 16 == 4
        shifted.append(QuantizedTensor(q.data, scale, q.layout, q.fmt))
    fast = gemm_module.scaled_mm(*shifted, torch.bfloat16, None)
    check(fast, fp8_gemm(qa, qb, torch.float32, backend="emulate"), qa, qb, 2**-8)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt_a", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_mx_operands_take_the_exact_bf16_gemm_on_cuda(out_dtype, fmt_a):
    mx = ScaleLayout((1, 32), power_of_two=True)
    qa, qb = operands(mx, mx, fmt_a=fmt_a)
    auto = fp8_gemm(qa, qb, out_dtype)
    assert torch.equal(auto, fp8_gemm(qa, qb, out_dtype, backend="bf16"))
    # fp32 outputs come straight from the fp32 accumulator (torch.mm's out_dtype).
    check(auto, fp8_gemm(qa, qb, backend="emulate"), qa, qb, torch.finfo(out_dtype).eps)


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


# The configuration of mt-parallel's GPU check, which gave a NaN embedding gradient on the H200:
# fp32 parameters, bf16 autocast, fp32 inputs (an RMSNorm's output) and bf16 output gradients,
# 256 tokens, 32-wide k/v projections, backend "fast" (an error rather than emulation).
LLAMA_SHAPES = [(128, 128), (128, 32), (128, 256), (256, 128)]


@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("recipe", [TensorwiseScaling(), DelayedScaling()], ids=lambda r: r.name)
def test_fp32_parameters_under_bf16_autocast_on_cuda(recipe, shape):
    # (Rowwise is left out: its dgrad into an fp32 input needs an fp32 _scaled_mm output, which
    # CUDA's rowwise kernel does not offer, so backend "fast" refuses it.)
    in_features, out_features = shape
    results = {}
    for backend in ("fast", "emulate"):
        torch.manual_seed(0)
        layer = FP8Linear(in_features, out_features, recipe=recipe, backend=backend, device="cuda")
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(256, in_features, generator=generator).cuda().requires_grad_()
        # Small gradients, as a mean cross-entropy over 256 tokens gives; some rows zero.
        dy = (torch.randn(256, out_features, generator=generator) * 1e-4).cuda().bfloat16()
        dy[::5] = 0
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)
        results[backend] = {"y": y.float(), "dx": x.grad, "dw": layer.weight.grad}
    for name, fast in results["fast"].items():
        assert torch.isfinite(fast).all(), f"{name}: {(~torch.isfinite(fast)).sum()} non-finite"
        slow = results["emulate"][name]
        # Same FP8 operands: fp32 summation order plus one bf16 rounding of y (2^-8 relative).
        assert torch.allclose(fast, slow, rtol=2**-7, atol=1e-3 * slow.abs().max().item()), name


def test_chain_of_fp8_layers_backward_is_finite_on_cuda():
    # dx of one FP8 layer is dy of the previous: a gradient chain through E5M2 quantizations.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        FP8Linear(128, 256, backend="fast"),
        torch.nn.SiLU(),
        FP8Linear(256, 128, backend="fast"),
        FP8Linear(128, 32, backend="fast"),
        FP8Linear(32, 128, backend="fast"),
    ).cuda()
    x = torch.randn(256, 128, device="cuda", requires_grad=True)
    target = torch.randint(0, 128, (256,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), target)
    loss.backward()
    assert torch.isfinite(loss)
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name
    assert torch.isfinite(x.grad).all()


def test_amax_reduction_in_the_fused_kernel_on_cuda(tmp_path):
    # One rank (NCCL): the reduction is the identity, so the result must equal no reduction;
    # the multi-rank semantics are tested on gloo in test_fp8_amax_reduction.py.
    import torch.distributed as dist

    from mt_fp8.ops import quantize_transpose_amax

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        x = torch.randn(96, 160, device="cuda")
        reduced = quantize_transpose_amax(x, FP8Format.E4M3, amax_group=dist.group.WORLD)
        plain = quantize_transpose_amax(x, FP8Format.E4M3)
        assert torch.equal(reduced[0].scale, plain[0].scale)
        assert torch.equal(reduced[0].data.view(torch.uint8), plain[0].data.view(torch.uint8))
        assert torch.equal(reduced[1].data.view(torch.uint8), plain[1].data.view(torch.uint8))
    finally:
        dist.destroy_process_group()
