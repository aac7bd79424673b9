"""RMSNorm on mt-fp8's fused kernel, with the tensor/sequence-parallel hook.

``y = h / sqrt(mean(h²) + eps) · w`` with ``h = x (+ residual)``, computed in fp32 (fp64 for
fp64 inputs) by ``mt_fp8.ops.rms_norm``: a Triton kernel on CUDA, the same math in PyTorch on
the CPU. Under sequence parallel each TP rank normalises different tokens, so the weight's
gradient is summed over the TP group (``copy_to_group`` on the weight).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mt_fp8.ops import rms_norm
from mt_parallel.mappings import copy_to_group


class RMSNorm(nn.Module):
    """``y = h / sqrt(mean(h²) + eps) · w`` with ``h = x (+ residual)``, via ``mt_fp8.ops``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.tp_group: Any = None
        self.sequence_parallel = False

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Under SP each TP rank normalises different tokens: sum the weight gradient over TP."""
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.weight.fill_(1.0)

    def forward(
        self, x_BTD: torch.Tensor, residual_BTD: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``y``; with ``residual``: ``(y, h)``, ``h = x + residual`` in ``x``'s dtype.

        Under autocast ``y`` comes out in the autocast dtype (the next GEMM's input dtype), so the
        fp32 residual stream is not normalised into fp32 and then cast again by every consumer.
        """
        weight = (
            copy_to_group(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        )
        device_type = x_BTD.device.type
        out_dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else None
        )
        return rms_norm(x_BTD, weight, self.eps, residual=residual_BTD, out_dtype=out_dtype)
