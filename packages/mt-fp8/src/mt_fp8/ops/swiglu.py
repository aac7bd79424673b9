"""SwiGLU: ``y = silu(gate) · up`` with ``silu(g) = g · σ(g)``.

Backward, with ``σ = sigmoid(gate)``::

    dgate = dy · up · σ · (1 + gate · (1 - σ))
    dup   = dy · silu(gate)

Computed in fp32 (fp64 for fp64 inputs), stored in the input dtype; only ``gate`` and ``up`` are saved (the
activation is recomputed in the backward, as liger-kernel does). CUDA tensors run
:mod:`mt_fp8.kernels.swiglu` (reads 2, writes 1 in the forward; reads 3, writes 2 backward).
"""

from __future__ import annotations

from typing import Any

import torch

from mt_fp8.ops.dispatch import compute_dtype, plain_apply, use_triton


def swiglu_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The forward value in plain PyTorch (no autograd record)."""
    g = gate.to(compute_dtype(gate))
    return (g * torch.sigmoid(g) * up.to(g.dtype)).to(gate.dtype)


def swiglu_gradients(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` for the output gradient ``dy`` (module docstring); the Triton kernel on
    CUDA tensors. For autograd functions that consume ``silu(gate)·up`` themselves
    (:func:`mt_fp8.functional.fp8_swiglu_linear`)."""
    if use_triton(dy, gate, up):
        from mt_fp8.kernels.swiglu import swiglu_backward_triton

        return swiglu_backward_triton(dy, gate, up)
    return _plain_gradients(dy, gate, up)


def _plain_gradients(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    work = compute_dtype(gate)
    g, u, d = gate.to(work), up.to(work), dy.to(work)
    sig = torch.sigmoid(g)
    dgate = d * u * sig * (1 + g * (1 - sig))
    dup = d * g * sig
    return dgate.to(gate.dtype), dup.to(up.dtype)


class SwiGLUFunction(torch.autograd.Function):
    """Plain-PyTorch SwiGLU with the explicit backward above."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return swiglu_values(gate, up)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return _plain_gradients(dy, gate, up)


_plain_swiglu = plain_apply(SwiGLUFunction)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up``, elementwise; ``gate`` and ``up`` have the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    if use_triton(gate, up):
        from mt_fp8.kernels.swiglu import TritonSwiGLUFunction

        apply = TritonSwiGLUFunction.apply
    else:
        apply = _plain_swiglu
    return apply(gate, up)
