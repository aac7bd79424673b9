"""FP8 GEMM dispatch: ``out_XY = (a_XZ · s_a) (b_YZ · s_b)ᵀ + bias_Y``.

Both operands are :class:`~mt_fp8.quantized.QuantizedTensor` s quantized along their last axis
``Z`` (the contraction axis), so every recipe's GEMMs have this one "NT" form (see
:mod:`mt_fp8.recipes`). Three implementations, chosen by ``backend``:

``"scaled_mm"``
    ``torch._scaled_mm(a, bᵀ, s_a, s_bᵀ)``: both operands tensorwise (fp32 scalars) or both
    rowwise (``(X, 1)`` and ``(1, Y)``). Runs on CPU and on CUDA with FP8 tensor cores
    (compute capability ≥ 8.9); on CUDA, rowwise needs a bf16 output and both dims ``% 16``,
    and two E5M2 operands are not supported (cuBLAS needs one E4M3 operand).
``"triton"``
    A Triton kernel for block-scaled operands (``a`` in 1×g groups, ``b`` in 1×g groups or g×g
    blocks, g = 32, 64 or 128) on CUDA compute capability ≥ 9.0 (Hopper): each K-tile of g
    elements is multiplied in FP8 and promoted to the fp32 accumulator with its two scales, as
    DeepSeek-V3 does. Imported only when used.
``"emulate"``
    Dequantize both operands to fp32 and multiply: ``(q_a · s_a)(q_b · s_b)ᵀ``. Every layout on
    every device; the reference the fast paths are tested against.

``backend="auto"`` takes the first fast path that applies and otherwise emulates; on a
non-CPU device without FP8 GEMM support it warns once. ``backend="fast"`` raises instead of
emulating, for users who demanded the fast path.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from mt_fp8.formats import FP8Format
from mt_fp8.quantized import QuantizedTensor

BACKENDS = ("auto", "fast", "scaled_mm", "triton", "emulate")

_warned: set[str] = set()


_capability_cache: dict[tuple[str, str, int | None], bool] = {}


def _device_fp8_gemm(device_type: str, index: int | None) -> bool:
    """Whether ``torch._scaled_mm`` has FP8 hardware (or, on CPU, a kernel) on this device."""
    key = ("fp8_gemm", device_type, index)
    if key not in _capability_cache:
        if device_type == "cpu":
            _capability_cache[key] = True
        elif device_type == "cuda":
            _capability_cache[key] = torch.cuda.get_device_capability(index) >= (8, 9)
        else:
            from mt_core import get_device

            _capability_cache[key] = bool(get_device(device_type).capabilities().fp8_gemm)
    return _capability_cache[key]


def _triton_block_gemm_available(index: int | None) -> bool:
    key = ("triton_block_gemm", "cuda", index)
    if key not in _capability_cache:
        _capability_cache[key] = (
            torch.cuda.get_device_capability(index) >= (9, 0)
            and importlib.util.find_spec("triton") is not None
        )
    return _capability_cache[key]


def _kind(q: QuantizedTensor) -> str:
    # NOTE: from the layout first: a rowwise tensor of one row (a single token) has a single
    # scale too, and must still pair with a rowwise operand.
    if q.layout.block == (1, -1):
        return "rowwise"
    if q.layout.block == (-1, -1) or q.scale.numel() == 1:
        return "tensorwise"
    return "block"


def _scaled_mm_reason(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> str | None:
    """Why ``torch._scaled_mm`` cannot run these operands, or None if it can."""
    kinds = (_kind(a), _kind(b))
    if kinds not in (("tensorwise", "tensorwise"), ("rowwise", "rowwise")):
        return f"torch._scaled_mm takes tensorwise or rowwise scales, not {kinds[0]} x {kinds[1]}"
    if a.layout.power_of_two or b.layout.power_of_two:
        return "power-of-two (MX) layouts go through the block path"
    device = a.data.device
    if not _device_fp8_gemm(device.type, device.index):
        return f"device {device} has no FP8 GEMM (needs CUDA compute capability >= 8.9)"
    if device.type == "cuda":
        if kinds[0] == "rowwise" and out_dtype != torch.bfloat16:
            return f"rowwise torch._scaled_mm on CUDA needs a bfloat16 output, not {out_dtype}"
        if a.shape[1] % 16 or b.shape[0] % 16:
            return f"torch._scaled_mm on CUDA needs K and N divisible by 16, got K={a.shape[1]}, N={b.shape[0]}"
        if a.fmt is FP8Format.E5M2 and b.fmt is FP8Format.E5M2:
            return "cuBLAS FP8 GEMMs need at least one E4M3 operand"
    return None


def _triton_reason(a: QuantizedTensor, b: QuantizedTensor) -> str | None:
    device = a.data.device
    if device.type != "cuda" or not _triton_block_gemm_available(device.index):
        return (
            "the Triton block-scaled GEMM needs a CUDA GPU of compute capability >= 9.0 with Triton"
        )
    return _triton_layout_reason(a, b)


def _triton_layout_reason(a: QuantizedTensor, b: QuantizedTensor) -> str | None:
    """Why the Triton block GEMM cannot take these layouts, or None if it can."""
    # NOTE: fixed-size groups only: a rowwise operand has "1xK groups" too, but with g = K the
    # kernel's K-step tiles outgrow shared memory (rowwise FP8Linear with K = 256 asked for
    # 256 KiB on the H200, 2026-12-02) and g need not be a power of two.
    if a.layout.block[1] < 0 or b.layout.block[1] < 0:
        return "the Triton block-scaled GEMM takes fixed-size groups, not whole-row scales"
    ga, gb = a.block, b.block
    if ga[0] != 1 or gb[1] != ga[1] or gb[0] not in (1, gb[1]) or ga[1] not in (32, 64, 128):
        return (
            "the Triton block-scaled GEMM takes 1xg by 1xg or gxg blocks with g in 32, 64, 128, "
            f"got {ga} x {gb}"
        )
    return None


def scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch._scaled_mm`` on tensorwise or rowwise operands (no checks; see the dispatcher)."""
    if _kind(a) == "tensorwise":
        scale_a, scale_b = a.scale.reshape(()), b.scale.reshape(())
    else:
        scale_a, scale_b = a.scale, b.scale.t()  # (X, 1) and (1, Y)
    # cuBLAS fuses a bias only in a 16-bit output dtype matching the bias; otherwise add it after.
    fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    # NOTE: b.data is (Y, Z) row-major, so b.data.t() is the column-major (Z, Y) cuBLAS wants.
    out = torch._scaled_mm(
        a.data, b.data.t(), scale_a, scale_b, bias=bias if fused_bias else None, out_dtype=out_dtype
    )
    if bias is not None and not fused_bias:
        out = out + bias.to(out_dtype)
    return out


def emulated_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """Dequantize to fp32 and multiply; every layout on every device."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``(a · s_a)(b · s_b)ᵀ + bias`` with ``a`` (X, Z) and ``b`` (Y, Z); see the module docstring."""
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown FP8 GEMM backend {backend!r}; valid backends: {', '.join(BACKENDS)}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"FP8 GEMM contracts the last axis of both operands, got a {tuple(a.shape)} and "
            f"b {tuple(b.shape)}"
        )
    if backend == "emulate":
        return emulated_mm(a, b, out_dtype, bias)
    reasons = []
    if backend in ("auto", "fast", "scaled_mm"):
        reason = _scaled_mm_reason(a, b, out_dtype)
        if reason is None:
            return scaled_mm(a, b, out_dtype, bias)
        reasons.append(reason)
    if backend in ("auto", "fast", "triton"):
        reason = _triton_reason(a, b)
        if reason is None:
            from mt_fp8.kernels.block_gemm import block_scaled_mm

            return block_scaled_mm(a, b, out_dtype, bias)
        reasons.append(reason)
    if backend != "auto":
        raise RuntimeError(f"FP8 GEMM backend {backend!r} cannot run here: {'; '.join(reasons)}")
    device = a.data.device
    if not _device_fp8_gemm(device.type, device.index) and str(device) not in _warned:
        _warned.add(str(device))
        warnings.warn(
            f"device {device} has no FP8 GEMM support; FP8 GEMMs are emulated in fp32 "
            "(numerically FP8, not faster). Pass backend='fast' to make this an error.",
            stacklevel=2,
        )
    return emulated_mm(a, b, out_dtype, bias)
