"""FP8 GEMM dispatch: emulation against float64, and torch._scaled_mm against emulation.

Bound: with elementwise quantization errors ``|a' - a| <= e_a`` and ``|b' - b| <= e_b`` (the
mantissa bound of test_fp8_quantize), ``|Σ a'b' - Σ ab| <= Σ (e_a|b| + |a|e_b + e_a e_b)``;
the fp32 accumulation over K adds at most ``K · 2^-24 · Σ|a'||b'|`` (standard dot-product
rounding bound, first order).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mt_fp8.gemm as gemm_module
from mt_fp8 import (
    BlockScaling,
    FP8Format,
    MXFP8Scaling,
    RowwiseScaling,
    TensorRole,
    TensorwiseScaling,
    fp8_gemm,
    quantize,
)

RECIPES = [TensorwiseScaling(), RowwiseScaling(), BlockScaling(), MXFP8Scaling()]


def quantized_pair(recipe, m=128, n=256, k=384, fmt_a=FP8Format.E4M3, fmt_b=FP8Format.E4M3):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, dtype=torch.float64, generator=generator)
    b = torch.randn(n, k, dtype=torch.float64, generator=generator) * 0.05
    qa = quantize(a, fmt_a, recipe.layout(TensorRole.INPUT))
    qb = quantize(b, fmt_b, recipe.layout(TensorRole.WEIGHT))
    return a, b, qa, qb


def elementwise_error_bound(x, q):
    br, bc = q.block
    scale = q.scale.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    sat_excess = (x.abs() - q.fmt.max * scale).clamp_min(0)  # MX saturation error
    return (
        torch.maximum(q.fmt.relative_rounding_error * x.abs(), scale * q.fmt.min_subnormal / 2)
        + sat_excess
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("fmt_a", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_emulated_gemm_within_propagated_bound(recipe, fmt_a):
    a, b, qa, qb = quantized_pair(recipe, fmt_a=fmt_a)
    bias = torch.randn(b.shape[0], dtype=torch.float64)
    out = fp8_gemm(qa, qb, torch.float32, bias=bias.float(), backend="emulate").double()
    reference = a @ b.t() + bias
    e_a, e_b = elementwise_error_bound(a, qa), elementwise_error_bound(b, qb)
    bound = e_a @ b.abs().t() + a.abs() @ e_b.t() + e_a @ e_b.t()
    bound += a.shape[1] * 2**-24 * ((a.abs() + e_a) @ (b.abs() + e_b).t() + bias.abs())
    assert ((out - reference).abs() <= bound).all()


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), RowwiseScaling()], ids=lambda r: r.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [384, 201], ids=["k384", "k201-padded"])
def test_scaled_mm_agrees_with_emulation(recipe, out_dtype, k):
    # k=201 is zero-padded to 208 before torch._scaled_mm (gemm._pad_contraction).
    if isinstance(recipe, RowwiseScaling) and not gemm_module.cpu_scaled_mm_takes_rowwise():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales")
    _, _, qa, qb = quantized_pair(recipe, k=k, fmt_a=FP8Format.E5M2)
    bias = torch.randn(qb.shape[0]).to(out_dtype)
    fast = fp8_gemm(qa, qb, out_dtype, bias=bias, backend="scaled_mm").double()
    slow = fp8_gemm(qa, qb, torch.float32, bias=bias, backend="emulate").double()
    # Same exact products; only the summation order and the output rounding differ:
    # fp32 accumulation (K·2^-24 relative to Σ|ab|) plus one rounding into out_dtype.
    magnitude = qa.dequantize(torch.float64).abs() @ qb.dequantize(torch.float64).abs().t()
    out_eps = torch.finfo(out_dtype).eps
    assert (
        (fast - slow).abs() <= qa.shape[1] * 2**-24 * magnitude + out_eps * slow.abs() + 1e-6
    ).all()


def test_contraction_padding_appends_zero_bytes_only():
    data = torch.randn(3, 21).to(torch.float8_e4m3fn)
    padded = gemm_module._pad_contraction(data)
    assert padded.shape == (3, 32) and padded.dtype == torch.float8_e4m3fn
    assert torch.equal(padded[:, :21].view(torch.uint8), data.view(torch.uint8))
    assert (padded[:, 21:].view(torch.uint8) == 0).all()
    aligned = data[:, :16]
    assert gemm_module._pad_contraction(aligned) is aligned


def test_fast_backend_refuses_block_scaling_on_cpu():
    _, _, qa, qb = quantized_pair(BlockScaling())
    with pytest.raises(
        RuntimeError, match=r"cannot run here: torch\._scaled_mm takes tensorwise or rowwise"
    ):
        fp8_gemm(qa, qb, backend="fast")


def test_rowwise_on_a_cpu_without_rowwise_scaled_mm_is_emulated(monkeypatch):
    # torch 2.11's CPU _scaled_mm asserts on rowwise scales (gemm.cpu_scaled_mm_takes_rowwise): auto
    # must emulate there (bit-identical to backend="emulate"), and the fast path must refuse.
    monkeypatch.setattr(gemm_module, "cpu_scaled_mm_takes_rowwise", lambda: False)
    _, _, qa, qb = quantized_pair(RowwiseScaling())
    assert torch.equal(fp8_gemm(qa, qb), fp8_gemm(qa, qb, backend="emulate"))
    with pytest.raises(RuntimeError, match=r"CPU torch\._scaled_mm takes tensorwise scales only"):
        fp8_gemm(qa, qb, backend="fast")


def test_auto_backend_warns_once_without_fp8_hardware(monkeypatch):
    monkeypatch.setattr(gemm_module, "device_has_fp8_gemm", lambda device_type, index: False)
    monkeypatch.setattr(gemm_module, "warned_devices", set())
    _, _, qa, qb = quantized_pair(TensorwiseScaling())
    with pytest.warns(UserWarning, match="no FP8 GEMM support; FP8 GEMMs are emulated"):
        fp8_gemm(qa, qb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        fp8_gemm(qa, qb)
    with pytest.raises(RuntimeError, match="has no FP8 GEMM"):
        fp8_gemm(qa, qb, backend="fast")


def test_gemm_rejects_mismatched_operands():
    _, _, qa, _ = quantized_pair(TensorwiseScaling())
    qb = quantize(torch.randn(64, 128), FP8Format.E4M3)
    with pytest.raises(ValueError, match="contracts the last axis"):
        fp8_gemm(qa, qb)
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend 'cublas'"):
        fp8_gemm(qa, qa, backend="cublas")


def test_triton_block_gemm_takes_fixed_groups_only():
    # Rowwise operands look like "1xK groups", but K-wide steps outgrow shared memory (256 KiB
    # for K = 256 on the H200) and K need not be a power of two: they must not be routed there.
    _, _, qa, qb = quantized_pair(RowwiseScaling())
    assert "fixed-size groups" in gemm_module.triton_layout_reason(qa, qb)
    _, _, qa, qb = quantized_pair(BlockScaling())
    assert gemm_module.triton_layout_reason(qa, qb) is None
    _, _, qa, qb = quantized_pair(MXFP8Scaling())
    assert gemm_module.triton_layout_reason(qa, qb) is None
    _, _, qa, qb = quantized_pair(BlockScaling(group=256, weight_block=256), m=256, k=512)
    assert "g in 32, 64, 128" in gemm_module.triton_layout_reason(qa, qb)


def test_power_of_two_operands_dequantize_exactly_in_bf16():
    # The bf16 backend's premise: q · 2^e is a bf16 value. Spread the groups' magnitudes over
    # 2^-100 .. 2^100 so the scales span most of the exponent range.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, dtype=torch.float64, generator=generator)
    x *= 2.0 ** torch.randint(-100, 101, (64, 8), generator=generator).double().repeat_interleave(
        32, 1
    )
    for fmt in (FP8Format.E4M3, FP8Format.E5M2):
        q = quantize(x, fmt, MXFP8Scaling().layout(TensorRole.INPUT))
        exact = q.dequantize(torch.float64)
        assert torch.equal(gemm_module.dequantize_bf16(q).double(), exact)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt_a", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_bf16_backend_agrees_with_emulation_for_mx(out_dtype, fmt_a):
    _, _, qa, qb = quantized_pair(MXFP8Scaling(), fmt_a=fmt_a)
    bias = torch.randn(qb.shape[0]).to(out_dtype)
    fast = fp8_gemm(qa, qb, out_dtype, bias=bias, backend="bf16")
    assert fast.dtype == out_dtype
    slow = fp8_gemm(qa, qb, torch.float32, bias=bias, backend="emulate").double()
    # Exact operands and products on both paths: fp32 summation order (K·2^-24 relative to
    # Σ|ab|), the bf16 GEMM's output rounding (2^-8 relative; a CPU bf16 GEMM writes bf16 even
    # for an fp32 result) and the bias add's rounding in out_dtype.
    magnitude = qa.dequantize(torch.float64).abs() @ qb.dequantize(torch.float64).abs().t()
    bound = qa.shape[1] * 2**-24 * magnitude + 2 * 2**-8 * (slow.abs() + bias.double().abs())
    assert ((fast.double() - slow).abs() <= bound + 1e-6).all()


def test_bf16_backend_refuses_scales_that_would_round():
    _, _, qa, qb = quantized_pair(BlockScaling())
    with pytest.raises(RuntimeError, match=r"exact for power-of-two \(MX\) scales only"):
        fp8_gemm(qa, qb, backend="bf16")
