"""Choosing between a Triton kernel and the plain-PyTorch path."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

_TRITON = importlib.util.find_spec("triton") is not None


def triton_runs_on(device_type: str) -> bool:
    """Whether Triton kernels run on tensors of ``device_type`` (see :func:`use_triton`)."""
    if not _TRITON or os.environ.get("MT_FP8_DISABLE_TRITON") == "1":
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when all tensors are on CUDA and Triton is installed (found without importing it).

    ``MT_FP8_DISABLE_TRITON=1`` forces the PyTorch path (for comparisons); ``TRITON_INTERPRET=1``
    lets CPU tensors run the Triton kernels in Triton's interpreter (kernel tests without a GPU).
    Inside ``torch.compile`` graphs the Triton-backed autograd functions are traced in as they
    are (Dynamo's user-defined Triton kernel support); see :func:`plain_apply` for the others.
    """
    return all(triton_runs_on(t.device.type) for t in tensors)


def compiler_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)`` that imports ``torch._dynamo`` at its first call, not here.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (1.8 s of CPU) when it decorates, so
    every process that imports mt_fp8 paid for it, eager ones included. torch's own lazy form
    wraps ``fn`` in a function of ``torch._compile``, a module Dynamo skips: inside a compiled
    graph the call breaks the graph and runs ``fn`` with Dynamo disabled, as the eager form does.
    """
    return torch._disable_dynamo(fn)


PLAIN_FUNCTIONS_COMPILE_ON_CPU = TorchVersion(torch.__version__) >= "2.13"
"""Whether the plain autograd functions are traced into ``torch.compile`` graphs on the CPU
(:func:`plain_apply`): only with a torch whose compiled gradients were seen right."""


def plain_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` for a plain-PyTorch autograd function, kept out of ``torch.compile``
    graphs (run eagerly behind a graph break) except on the CPU with torch >= 2.13.

    NOTE: seen with torch 2.11 and Triton 3.6 on the H200: a compiled decoder block whose
    RMSNorm, RoPE and SwiGLU took these plain autograd functions gave weight gradients entirely
    unlike the eager ones (the loss agreed), while the same block with the Triton-backed
    functions traced in matched eager to bf16 rounding. On the CPU with torch 2.13 the plain
    functions compile and match eager exactly (``test_fp8_ops.py``); with torch 2.11 the same
    CPU test's compiled gradient was wrong (forward exact). The cause inside the compiler stack
    was not isolated, so elsewhere they are not compiled.
    """

    # Not ``function.apply`` itself: the lazy disable caches its disabled form as an attribute,
    # which a bound method does not take.
    @compiler_disable
    def eager_apply(*args: Any) -> Any:
        return function.apply(*args)

    def apply(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    if arg.device.type != "cpu" or not PLAIN_FUNCTIONS_COMPILE_ON_CPU:
                        return eager_apply(*args)
                    break
        return function.apply(*args)

    return apply


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16/32-bit inputs, fp64 for fp64 ones (so float64 references can be exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
