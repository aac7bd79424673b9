"""A pre-norm decoder block that takes its attention and feed-forward modules from the caller.

Shape suffixes: B batch, T tokens this rank holds (``T_seq/cp``, and ``/tp`` between TP regions
under sequence parallel), D model width.

Block (pre-norm, as Llama)::

    a = dropout(attention(norm1(x), positions, document_ids))
    m, h = norm2(x + a), x + a                       (one fused RMSNorm + residual add)
    y = h + dropout(mlp(m))

A model family builds each part exactly once and hands it in: :class:`~mt_parallel.Attention`
(or a subclass with its own RoPE tables), :class:`~mt_parallel.MLP`, or any module with the same
call signature (an MoE layer is ``mlp(m) -> y``). The block's second residual add stays outside
the norm: fusing it into the next block's norm would change the block's ``x -> y`` interface.
Norms and dropout run on whatever the rank holds (the sequence shard under SP); the residual
dropout draws a per-TP-rank mask under SP (:mod:`mt_parallel.rng`).
"""

from __future__ import annotations

import torch
from torch import nn

from mt_parallel.norm import RMSNorm
from mt_parallel.rng import Dropout


class DecoderBlock(nn.Module):
    """``forward(x_BTD, positions_S, document_ids_BS)`` of the module docstring.

    ``attention(n_BTD, positions_S, document_ids_BS=...)`` and ``mlp(m_BTD)`` map ``(B, T, D)``
    to ``(B, T, D)``; ``dim`` sizes the two RMSNorms; ``dropout`` is the residual dropout.
    """

    def __init__(
        self,
        attention: nn.Module,
        mlp: nn.Module,
        dim: int,
        norm_eps: float = 1e-5,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.mlp = mlp
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n_BTD = self.attention_norm(x_BTD)
        # Document ids only when given, so attentions with the older (x, positions) signature
        # keep working in blocks that never see packed sequences.
        extra = {} if document_ids_BS is None else {"document_ids_BS": document_ids_BS}
        a_BTD = self.dropout(self.attention(n_BTD, positions_S, **extra))
        # x first: h = x + a keeps the residual stream's dtype (fp32 under bf16 autocast).
        m_BTD, h_BTD = self.ffn_norm(x_BTD, a_BTD)
        return h_BTD + self.dropout(self.mlp(m_BTD))
