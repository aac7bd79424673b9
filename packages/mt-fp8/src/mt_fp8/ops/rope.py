"""Rotary position embedding applied to q and k (the "rotate-half" layout of Llama / HF).

Shape suffixes: B batch, T positions, H heads (q and k may differ: GQA), D head dim, P = D / 2.
``q_BTHD``, ``k_BTHD``; ``cos_TP``, ``sin_TP`` hold ``cos(t·θ_p)``, ``sin(t·θ_p)``. With the head
split into halves ``x1 = x[..., :P]``, ``x2 = x[..., P:]``::

    out1 = x1 · cos - x2 · sin
    out2 = x2 · cos + x1 · sin

a rotation by ``t·θ_p`` of each pair ``(x1_p, x2_p)``; the backward is the rotation by
``-t·θ_p`` (orthogonal: the transpose is the inverse), i.e. the same formula with ``-sin``.
Computed in fp32 (fp64 for fp64 inputs), stored in the input dtype. CUDA tensors run :mod:`mt_fp8.kernels.rope`.
"""

from __future__ import annotations

from typing import Any

import torch

from mt_fp8.ops.dispatch import compute_dtype, plain_apply, use_triton


def rotate(x_BTHD: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
    """The rotation above, in plain PyTorch."""
    half = x_BTHD.shape[-1] // 2
    work = compute_dtype(x_BTHD)
    x1, x2 = x_BTHD.to(work)[..., :half], x_BTHD.to(work)[..., half:]
    cos, sin = cos_TP.to(work)[:, None, :], sin_TP.to(work)[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BTHD.dtype)


class RotaryFunction(torch.autograd.Function):
    """Plain-PyTorch RoPE on q and k with the explicit (inverse-rotation) backward."""

    @staticmethod
    def forward(ctx: Any, q_BTHD, k_BTHD, cos_TP, sin_TP):  # type: ignore[override]
        ctx.save_for_backward(cos_TP, sin_TP)
        return rotate(q_BTHD, cos_TP, sin_TP), rotate(k_BTHD, cos_TP, sin_TP)

    @staticmethod
    def backward(ctx: Any, dq_BTHD, dk_BTHD):  # type: ignore[override]
        cos_TP, sin_TP = ctx.saved_tensors
        return rotate(dq_BTHD, cos_TP, -sin_TP), rotate(dk_BTHD, cos_TP, -sin_TP), None, None


_plain_rope = plain_apply(RotaryFunction)


def rope_tables(
    positions: int, head_dim: int, base: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos_TP``, ``sin_TP`` (fp32) for ``θ_p = base^(-2p / D)``."""
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    )
    angles = torch.arange(positions, device=device, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rotary(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (B, T, H, D) by the tables ``cos``/``sin`` (T, D/2)."""
    for name, x in (("q", q_BTHD), ("k", k_BTHD)):
        if x.dim() != 4 or x.shape[1] != cos_TP.shape[0] or x.shape[-1] != 2 * cos_TP.shape[1]:
            raise ValueError(
                f"{name} must be (B, T, H, D) with T={cos_TP.shape[0]} and D={2 * cos_TP.shape[1]} "
                f"to match the cos/sin tables, got {tuple(x.shape)}"
            )
    if cos_TP.shape != sin_TP.shape:
        raise ValueError(f"cos {tuple(cos_TP.shape)} and sin {tuple(sin_TP.shape)} shapes differ")
    if use_triton(q_BTHD, k_BTHD, cos_TP):
        from mt_fp8.kernels.rope import TritonRotaryFunction

        apply = TritonRotaryFunction.apply
    else:
        apply = _plain_rope
    return apply(q_BTHD, k_BTHD, cos_TP, sin_TP)
