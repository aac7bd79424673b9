"""The SwiGLU feed-forward layer on column/row-parallel linears.

``y = down_proj(silu(gate_proj(m)) · up_proj(m))``: gate/up are column-parallel (the FFN
columns split over TP), down is row-parallel. ``silu(g)·u`` is ``mt_fp8.ops.swiglu`` (Triton on
CUDA, PyTorch on the CPU, in fp32). With FP8 on ``down_proj`` the SwiGLU product is quantized
straight from ``gate`` and ``up`` (``RowParallelLinear.forward_swiglu``): it is never stored in
high precision, and the ``act`` module (the target of selective ``mlp`` recompute) is not
called, as nothing of it is saved.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from mt_fp8.ops import swiglu
from mt_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_init_std


class SwiGLU(nn.Module):
    """``silu(g)·u`` (``mt_fp8.ops.swiglu``); its own module so selective recompute can wrap it."""

    recompute_target: ClassVar[str] = "mlp"
    """The ``parallel.recompute_targets`` entry that recomputes this module (selective)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


class MLP(nn.Module):
    """SwiGLU feed-forward: gate/up column-parallel, down row-parallel (module docstring).

    ``num_layers`` scales the init of the output projection (``init_std / sqrt(2·num_layers)``).
    """

    def __init__(self, dim: int, ffn_dim: int, num_layers: int = 1, init_std: float = 0.02) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, ffn_dim, bias=False, init_std=init_std)
        self.up_proj = ColumnParallelLinear(dim, ffn_dim, bias=False, init_std=init_std)
        self.act = SwiGLU()
        self.down_proj = RowParallelLinear(
            ffn_dim, dim, bias=False, init_std=scaled_init_std(init_std, num_layers)
        )

    def shared_input_linears(self) -> tuple[ColumnParallelLinear, ...]:
        """The projections that read one normalised input (:func:`mt_parallel.apply_fp8`
        ties their FP8 input scales)."""
        return (self.gate_proj, self.up_proj)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        m_BSD = self.gate_proj.prepare_input(x_BTD)
        gate_BSF = self.gate_proj.forward_prepared(m_BSD)
        up_BSF = self.up_proj.forward_prepared(m_BSD)
        if self.down_proj.fp8_enabled:  # SwiGLU into FP8 (module docstring)
            return self.down_proj.forward_swiglu(gate_BSF, up_BSF)
        return self.down_proj(self.act(gate_BSF, up_BSF))
