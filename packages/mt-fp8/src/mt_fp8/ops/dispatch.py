"""Choosing between a Triton kernel and the plain-PyTorch path."""

from __future__ import annotations

import importlib.util
import os

import torch

_TRITON = importlib.util.find_spec("triton") is not None


def triton_runs_on(device_type: str) -> bool:
    """Whether Triton kernels run on tensors of ``device_type`` (see :func:`use_triton`)."""
    if not _TRITON or os.environ.get("MT_FP8_DISABLE_TRITON") == "1":
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when all tensors are on CUDA, Triton is installed (found without importing it) and
    no ``torch.compile`` graph is being traced.

    ``MT_FP8_DISABLE_TRITON=1`` forces the PyTorch path (for comparisons); ``TRITON_INTERPRET=1``
    lets CPU tensors run the Triton kernels in Triton's interpreter (kernel tests without a GPU).
    Inside compiled graphs every op takes its plain-PyTorch path, which Inductor fuses.
    NOTE: with the Triton-backed autograd functions traced into compiled decoder blocks, the FP8
    trainer did not learn on the H200 (torch 2.11, 2026-12-03: no attention, RoPE or SwiGLU
    backward kernels ran; ``docs/benchmarks.md``, session 7), while the PyTorch paths compile
    and learn like eager on the CPU. The cause was not isolated; this keeps user Triton kernels
    out of compiled graphs, as the quantizers already were (slower there, measured).
    """
    if torch.compiler.is_compiling():
        return False
    return all(triton_runs_on(t.device.type) for t in tensors)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16/32-bit inputs, fp64 for fp64 ones (so float64 references can be exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
