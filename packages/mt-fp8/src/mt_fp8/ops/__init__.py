"""Fused memory-bound operators: Triton kernels on CUDA, the same math in plain PyTorch elsewhere."""

from mt_fp8.ops.cross_entropy import cross_entropy
from mt_fp8.ops.moe_permute import permute_rows, unpermute_rows
from mt_fp8.ops.quantize_transpose import quantize_transpose_amax, swiglu_quantize_transpose_amax
from mt_fp8.ops.rmsnorm import rms_norm
from mt_fp8.ops.rope import apply_rotary
from mt_fp8.ops.swiglu import swiglu

__all__ = [
    "apply_rotary",
    "cross_entropy",
    "permute_rows",
    "quantize_transpose_amax",
    "rms_norm",
    "swiglu",
    "swiglu_quantize_transpose_amax",
    "unpermute_rows",
]
