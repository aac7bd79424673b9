"""FP8 GEMM dispatch: ``out_XY = (a_XZ · s_a) (b_YZ · s_b)ᵀ + bias_Y``.

Both operands are :class:`~mt_fp8.quantized.QuantizedTensor` s quantized along their last axis
``Z`` (the contraction axis), so every recipe's GEMMs have this one "NT" form (see
:mod:`mt_fp8.recipes`). Three implementations, chosen by ``backend``:

``"scaled_mm"``
    PyTorch's cuBLAS-backed scaled GEMMs, two entry points:

    * ``torch._scaled_mm(a, bᵀ, s_a, s_bᵀ)``: both operands tensorwise (fp32 scalars) or both
      rowwise (``(X, 1)`` and ``(1, Y)``). Runs on CPU and on CUDA with FP8 tensor cores
      (compute capability ≥ 8.9); on CUDA ``Y`` must be ``% 16`` and a contraction ``Z`` that
      is not is zero-padded to the next multiple of 16 (the weight gradient's token count, e.g.
      577 tokens of a ViT image: zeros add nothing to the dot products, and tensorwise or
      rowwise scales do not depend on ``Z``, so the result is the unpadded one's), two E5M2 operands are not
      supported (cuBLAS needs one E4M3 operand), rowwise GEMMs write bf16 (another output
      dtype is that bf16 result converted), and scale pointers must be 16-byte aligned
      (a scale view at another offset, such as one expert's slice of stacked scales, is
      copied first).
    * ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` for ``a`` (1×128
      groups, ``s_a`` of shape ``(X, Z/128)``) and ``BlockWise1x128`` or ``BlockWise128x128``
      for ``b`` (``s_b`` of shape ``(Y, Z/128)`` or ``(Y/128, Z/128)``): cuBLAS's blockwise
      GEMMs, on CUDA compute capability 9.x with a torch that has ``F.ScalingType``. cuBLAS
      wants the 1×128 scales "outer-dim-major" (strides ``(1, rows)``, a transposed copy of our
      row-major scales) and the 128×128 scales as the ``(Z/128, Y/128)`` view ``s_bᵀ``; fast
      accumulation is not offered in these modes. Taken only where it was seen to run
      correctly on the H200 (torch 2.11, CUDA 13.0): E4M3 operands (E5M2 is refused), a bf16
      or fp32 output (a bias is added afterwards), rows of ``a`` divisible by 8; with 128×128
      ``b`` ``Z`` divisible by 512 (whole groups of four scales), with 1×128 ``b`` its rows by
      16 and ``Z`` by 128; see :func:`blockwise_layout_reason`. Its speed against a tensorwise
      GEMM: docs/performance.md, "FP8 linear layers".
``"triton"``
    A Triton kernel for block-scaled operands (``a`` in 1×g groups, ``b`` in 1×g groups or g×g
    blocks, g = 32, 64 or 128) on CUDA compute capability ≥ 9.0 (Hopper): each K-tile of g
    elements is multiplied in FP8 and promoted to the fp32 accumulator with its two scales, as
    DeepSeek-V3 does. Imported only when used.
``"bf16"``
    For power-of-two (MX) scales on accelerators without MX tensor cores (Hopper has none):
    dequantize both operands to bf16 and run the bf16 GEMM. This is exact, not an
    approximation: an E4M3 or E5M2 value has at most 4 significant bits and a power-of-two
    scale only shifts the exponent, so ``q · 2^e`` is a bf16 value (8 significant bits, fp32's
    exponent range) as long as it stays above bf16's smallest subnormal (``2^-133``; MX
    scales stop at ``2^-126``, so only values below ``2^-7`` times the smallest scale can
    flush). The products of two bf16 values are exact in the GEMM's fp32 accumulator, so the
    result is the MX GEMM's up to summation order, then one rounding into the output dtype
    (fp32 outputs are written directly where ``torch.mm`` has ``out_dtype``, on CUDA).
    Against the Triton 1×32 kernel on the H200: docs/benchmarks-log.md.
``"emulate"``
    Dequantize both operands to fp32 and multiply: ``(q_a · s_a)(q_b · s_b)ᵀ``. Every layout on
    every device; the reference the fast paths are tested against.

Dispatch is a table: :data:`IMPLEMENTATIONS` names each implementation with the function that
says why it cannot run given operands (``None`` when it can) and the function that runs it, and
:data:`BACKEND_IMPLEMENTATIONS` lists, per ``backend`` argument, the implementations tried in
order. ``backend="auto"`` takes the first fast path that applies (in the order above, with
``"bf16"`` before ``"triton"``) and otherwise emulates; on a non-CPU device without FP8 GEMM
support it warns once. On the CPU ``"auto"`` emulates instead of calling ``torch._scaled_mm``:
torch 2.13's CPU kernel gave the emulation's result bit for bit with rowwise scales at the same
speed, and with tensorwise scales (oneDNN) ran hundreds of times slower
(docs/performance.md, "FP8 GEMMs on the CPU"); ``"fast"`` and ``"scaled_mm"`` still call it. ``backend="fast"`` raises instead of emulating, for users
who demanded the fast path; so does a named backend that cannot run the operands, with every
tried implementation's reason.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mt_fp8.formats import FP8Format
from mt_fp8.quantized import BLOCKS_128X128, GROUPS_1X128, QuantizedTensor

warned_devices: set[str] = set()
"""Devices ``backend="auto"`` has already warned about emulating on (the warning is once each)."""

_capability_cache: dict[tuple[str, str, int | None], bool] = {}

_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()
"""Whether ``torch.mm`` takes ``out_dtype`` (fp32 output of bf16 inputs; CUDA, torch >= 2.8)."""


def device_has_fp8_gemm(device_type: str, index: int | None) -> bool:
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


def cpu_scaled_mm_takes_rowwise() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes rowwise scales: a 16×16 probe, once.

    NOTE: torch 2.13's does; torch 2.11's (oneDNN) stops at an internal assert that only
    single-element scales are supported, so there
    rowwise operands on the CPU are emulated.
    """
    key = ("rowwise_scaled_mm", "cpu", None)
    if key not in _capability_cache:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        try:
            torch._scaled_mm(
                a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32
            )
            _capability_cache[key] = True
        except RuntimeError:
            _capability_cache[key] = False
    return _capability_cache[key]


def _triton_block_gemm_available(index: int | None) -> bool:
    key = ("triton_block_gemm", "cuda", index)
    if key not in _capability_cache:
        _capability_cache[key] = (
            torch.cuda.get_device_capability(index) >= (9, 0)
            and importlib.util.find_spec("triton") is not None
        )
    return _capability_cache[key]


def _blockwise_scaled_mm_available(index: int | None) -> bool:
    key = ("blockwise_scaled_mm", "cuda", index)
    if key not in _capability_cache:
        _capability_cache[key] = torch.cuda.get_device_capability(index)[0] == 9 and hasattr(
            F, "ScalingType"
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


def scaled_mm_reason(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> str | None:
    """Why ``torch._scaled_mm`` cannot run these operands, or None if it can."""
    kinds = (_kind(a), _kind(b))
    if kinds not in (("tensorwise", "tensorwise"), ("rowwise", "rowwise")):
        return f"torch._scaled_mm takes tensorwise or rowwise scales, not {kinds[0]} x {kinds[1]}"
    if a.layout.power_of_two or b.layout.power_of_two:
        return "power-of-two (MX) layouts go through the block path"
    device = a.data.device
    if not device_has_fp8_gemm(device.type, device.index):
        return f"device {device} has no FP8 GEMM (needs CUDA compute capability >= 8.9)"
    if device.type == "cpu" and kinds[0] == "rowwise" and not cpu_scaled_mm_takes_rowwise():
        return f"torch {torch.__version__}'s CPU torch._scaled_mm takes tensorwise scales only"
    if device.type == "cuda":
        if b.shape[0] % 16:
            return f"torch._scaled_mm on CUDA needs N divisible by 16, got N={b.shape[0]}"
        if a.fmt is FP8Format.E5M2 and b.fmt is FP8Format.E5M2:
            return "cuBLAS FP8 GEMMs need at least one E4M3 operand"
    return None


def blockwise_reason(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> str | None:
    """Why cuBLAS's blockwise GEMM cannot run these operands here, or None if it can."""
    device = a.data.device
    if device.type != "cuda" or not _blockwise_scaled_mm_available(device.index):
        return (
            "cuBLAS blockwise GEMMs (torch.nn.functional.scaled_mm) need a CUDA GPU of compute "
            "capability 9.x and a torch with torch.nn.functional.ScalingType"
        )
    return blockwise_layout_reason(a, b, out_dtype)


def blockwise_layout_reason(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype
) -> str | None:
    """Why cuBLAS's blockwise GEMM is not taken for these layouts, formats and dims, or None.

    Only what was seen to run correctly on the H200 is taken (module docstring); the gpu
    tests of test_fp8_block_fast.py probe the rest.
    """
    if a.layout != GROUPS_1X128 or b.layout not in (GROUPS_1X128, BLOCKS_128X128):
        return (
            "cuBLAS blockwise GEMMs take a in 1x128 groups and b in 1x128 groups or 128x128 "
            f"blocks, got {a.layout.name} x {b.layout.name}"
        )
    if a.fmt is not FP8Format.E4M3 or b.fmt is not FP8Format.E4M3:
        return (
            "cuBLAS blockwise GEMMs take E4M3 operands only (torch refused E5M2 on the H200), "
            f"got {a.fmt.value} x {b.fmt.value}"
        )
    if out_dtype not in (torch.bfloat16, torch.float32):
        return (
            "cuBLAS blockwise GEMMs are taken for a bfloat16 or float32 output (others are not "
            f"measured), not {out_dtype}"
        )
    (rows_a, depth), rows_b = a.shape, b.shape[0]
    square_b = b.layout == BLOCKS_128X128
    # Seen on the H200: rows of a = 200 ran and 202 did not (CUBLAS_STATUS_NOT_SUPPORTED);
    # 1x128 b with 208 rows and Z = 384 ran; 128x128 b with Z/128 = 3 was refused (torch wants
    # its scales padded to a multiple of 4 K-blocks).
    depth_multiple, rows_b_multiple = (512, 128) if square_b else (128, 16)
    if rows_a % 8 or rows_b % rows_b_multiple or depth % depth_multiple:
        return (
            "cuBLAS blockwise GEMMs are taken for rows of a divisible by 8, rows of b by "
            f"{rows_b_multiple} and a contraction dim divisible by {depth_multiple} with "
            f"{b.layout.name} b (other shapes are refused or not measured), got a "
            f"{rows_a}x{depth} and b {rows_b}x{depth}"
        )
    return None


def triton_reason(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> str | None:
    """Why the Triton block-scaled GEMM cannot run these operands here, or None if it can."""
    device = a.data.device
    if device.type != "cuda" or not _triton_block_gemm_available(device.index):
        return (
            "the Triton block-scaled GEMM needs a CUDA GPU of compute capability >= 9.0 with Triton"
        )
    return triton_layout_reason(a, b)


def triton_layout_reason(a: QuantizedTensor, b: QuantizedTensor) -> str | None:
    """Why the Triton block GEMM cannot take these layouts, or None if it can."""
    # NOTE: fixed-size groups only: a rowwise operand has "1xK groups" too, but with g = K the
    # kernel's K-step tiles outgrow shared memory (a rowwise FP8Linear with K = 256 already
    # asked for more than the H200 has) and g need not be a power of two.
    if a.layout.block[1] < 0 or b.layout.block[1] < 0:
        return "the Triton block-scaled GEMM takes fixed-size groups, not whole-row scales"
    ga, gb = a.block, b.block
    if ga[0] != 1 or gb[1] != ga[1] or gb[0] not in (1, gb[1]) or ga[1] not in (32, 64, 128):
        return (
            "the Triton block-scaled GEMM takes 1xg by 1xg or gxg blocks with g in 32, 64, 128, "
            f"got {ga} x {gb}"
        )
    return None


def bf16_reason(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> str | None:
    """Why the exact bf16 GEMM cannot take these operands, or None if it can."""
    if not (a.layout.power_of_two and b.layout.power_of_two):
        return (
            "the bf16 GEMM is exact for power-of-two (MX) scales only, got "
            f"{a.layout.name} x {b.layout.name}"
        )
    return None


def _aligned_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale``, copied if its first element is not 16-byte aligned: cuBLAS refuses such scale
    pointers (CUBLAS_STATUS_NOT_SUPPORTED on the H200 for one expert's scales sliced from the
    stacked scales of a grouped layer, a view 4 or 8 bytes into its buffer).

    Under ``torch.compile`` neither the address nor the storage offset can be traced (NOTE:
    ``data_ptr()`` there broke the graph at every FP8 GEMM, so compiled FP8 layers ran their
    autograd function eagerly), so the scale is always copied: a few bytes, which the compiler
    may fuse into the kernel that produced them.
    """
    if not torch.compiler.is_compiling() and scale.data_ptr() % 16 == 0:
        return scale
    return scale.clone(memory_format=torch.contiguous_format)


def _pad_contraction(data_XZ: torch.Tensor) -> torch.Tensor:
    """FP8 ``data`` with zero columns appended up to a multiple of 16 columns (cuBLAS's FP8
    GEMMs need 16-byte leading dimensions); unchanged when already aligned."""
    pad = -data_XZ.shape[1] % 16
    if pad == 0:
        return data_XZ
    # NOTE: padded as bytes: F.pad has no float8 kernels; the byte 0 is +0 in both formats.
    padded = F.pad(data_XZ.view(torch.uint8), (0, pad))
    return padded.view(data_XZ.dtype)


def scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch._scaled_mm`` on tensorwise or rowwise operands (no checks; see the dispatcher)."""
    gemm_dtype = out_dtype
    if _kind(a) == "tensorwise":
        scale_a, scale_b = a.scale.reshape(()), b.scale.reshape(())
    else:
        scale_a, scale_b = a.scale, b.scale.t()  # (X, 1) and (1, Y)
        if a.data.is_cuda:
            # cuBLAS's rowwise GEMM writes bf16 only: other outputs (the fp32 weight gradient
            # of fp32 parameters) are its bf16 result converted, one bf16 rounding of the fp32
            # accumulator, as a bf16 autocast GEMM gives.
            gemm_dtype = torch.bfloat16
    scale_a, scale_b = _aligned_scale(scale_a), _aligned_scale(scale_b)
    data_a, data_b = _pad_contraction(a.data), _pad_contraction(b.data)
    # cuBLAS fuses a bias only in a 16-bit output dtype matching the bias; otherwise add it after.
    fused_bias = bias is not None and bias.dtype == gemm_dtype and gemm_dtype != torch.float32
    # NOTE: b.data is (Y, Z) row-major, so b.data.t() is the column-major (Z, Y) cuBLAS wants.
    out = torch._scaled_mm(
        data_a,
        data_b.t(),
        scale_a,
        scale_b,
        bias=bias if fused_bias else None,
        out_dtype=gemm_dtype,
    ).to(out_dtype)
    if bias is not None and not fused_bias:
        out = out + bias.to(out_dtype)
    return out


def blockwise_scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """cuBLAS's blockwise GEMM through ``F.scaled_mm`` (no checks; see the dispatcher)."""
    # 1x128 scales go in outer-dim-major: the (rows, Z/128) shape with strides (1, rows).
    scale_a = a.scale.t().contiguous().t()
    if b.layout.block[0] == 1:
        scale_b, recipe_b = b.scale.t().contiguous().t(), F.ScalingType.BlockWise1x128
    else:
        # The (Z/128, Y/128) view of the row-major (Y/128, Z/128) block scales.
        scale_b, recipe_b = b.scale.t(), F.ScalingType.BlockWise128x128
    out = F.scaled_mm(
        a.data,
        b.data.t(),
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        recipe_b,
        output_dtype=out_dtype,
    )
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def dequantize_bf16(q: QuantizedTensor) -> torch.Tensor:
    """``data · scale`` in bf16 for power-of-two scales (exact; see the module docstring)."""
    rows, cols = q.data.shape
    groups, hgroups = q.scale.shape
    br, bc = q.block
    scale = q.scale.to(torch.bfloat16)[:, None, :, None]
    values = q.data.to(torch.bfloat16).reshape(groups, br, hgroups, bc) * scale
    return values.reshape(rows, cols)


def bf16_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """The exact bf16 GEMM of power-of-two-scaled operands (no checks; see the dispatcher)."""
    a_bf16, b_bf16 = dequantize_bf16(a), dequantize_bf16(b)
    if out_dtype == torch.float32 and a.data.is_cuda and _MM_HAS_OUT_DTYPE:
        out = torch.mm(a_bf16, b_bf16.t(), out_dtype=torch.float32)
    else:
        out = (a_bf16 @ b_bf16.t()).to(out_dtype)
    if bias is not None:
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


def triton_block_scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """The Triton block-scaled GEMM (:mod:`mt_fp8.kernels.block_gemm`, imported on first use)."""
    from mt_fp8.kernels.block_gemm import block_scaled_mm

    return block_scaled_mm(a, b, out_dtype, bias)


def _always_considered(a: QuantizedTensor, backend: str) -> bool:
    return True


def _off_the_cpu_under_auto(a: QuantizedTensor, backend: str) -> bool:
    return backend != "auto" or a.data.device.type != "cpu"


def _off_the_cpu_unless_named(a: QuantizedTensor, backend: str) -> bool:
    return backend not in ("auto", "fast") or a.data.device.type != "cpu"


def _no_reason(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> None:
    return None


@dataclass(frozen=True)
class GemmImplementation:
    """One way to run an FP8 GEMM: a row of the dispatch table (module docstring)."""

    run: Callable[
        [QuantizedTensor, QuantizedTensor, torch.dtype, torch.Tensor | None], torch.Tensor
    ]
    """``run(a, b, out_dtype, bias)``, called only when :attr:`reason` gave None."""
    reason: Callable[[QuantizedTensor, QuantizedTensor, torch.dtype], str | None] = _no_reason
    """``reason(a, b, out_dtype)``: why it cannot run these operands here, or None if it can."""
    considered: Callable[[QuantizedTensor, str], bool] = _always_considered
    """``considered(a, backend)``: whether it is tried at all for ``a`` under the caller's
    ``backend`` argument; one not considered adds no reason."""


IMPLEMENTATIONS: dict[str, GemmImplementation] = {
    # Under "auto" off the CPU only (module docstring).
    "scaled_mm": GemmImplementation(scaled_mm, scaled_mm_reason, _off_the_cpu_under_auto),
    "blockwise_scaled_mm": GemmImplementation(
        blockwise_scaled_mm, blockwise_reason, lambda a, backend: _kind(a) == "block"
    ),
    # Under "auto" and "fast" off the CPU only (module docstring).
    "bf16": GemmImplementation(bf16_mm, bf16_reason, _off_the_cpu_unless_named),
    "triton": GemmImplementation(triton_block_scaled_mm, triton_reason),
    "emulate": GemmImplementation(emulated_mm),
}
"""Every FP8 GEMM implementation by name (module docstring)."""

_FAST_PATHS = ("scaled_mm", "blockwise_scaled_mm", "bf16", "triton")

BACKEND_IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    "auto": _FAST_PATHS,  # then the emulation, with a warning where FP8 hardware is missing
    "fast": _FAST_PATHS,
    "scaled_mm": ("scaled_mm", "blockwise_scaled_mm"),
    "bf16": ("bf16",),
    "triton": ("triton",),
    "emulate": ("emulate",),
}
"""``backend`` argument -> the :data:`IMPLEMENTATIONS` it tries, in order."""

BACKENDS = tuple(BACKEND_IMPLEMENTATIONS)
"""The valid ``backend`` arguments."""


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
    reasons = []
    for name in BACKEND_IMPLEMENTATIONS[backend]:
        implementation = IMPLEMENTATIONS[name]
        if not implementation.considered(a, backend):
            continue
        reason = implementation.reason(a, b, out_dtype)
        if reason is None:
            return implementation.run(a, b, out_dtype, bias)
        reasons.append(reason)
    if backend != "auto":
        raise RuntimeError(f"FP8 GEMM backend {backend!r} cannot run here: {'; '.join(reasons)}")
    device = a.data.device
    if not device_has_fp8_gemm(device.type, device.index) and str(device) not in warned_devices:
        warned_devices.add(str(device))
        warnings.warn(
            f"device {device} has no FP8 GEMM support; FP8 GEMMs are emulated in fp32 "
            "(numerically FP8, not faster). Pass backend='fast' to make this an error.",
            stacklevel=2,
        )
    return emulated_mm(a, b, out_dtype, bias)
