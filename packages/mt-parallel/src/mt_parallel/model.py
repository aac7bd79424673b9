"""A Llama-style decoder block built from the parallel layers, and a minimal decoder LM.

Shape suffixes: B batch, T tokens this rank holds (``T_seq/cp``, and ``/tp`` between TP regions
under sequence parallel), S tokens inside a TP region (``T_seq/cp``), D model width, H query
heads, K key/value heads (both per TP rank inside the block), d head dim, F FFN width, V vocab.

Block (pre-norm, as Llama)::

    h = x + dropout(o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))))  n = norm(x)
    y = h + dropout(down_proj(silu(gate_proj(m)) · up_proj(m)))                       m = norm(h)

q/k/v and gate/up are column-parallel (heads and FFN columns split over TP), o/down are
row-parallel. Norms and dropout run on whatever the rank holds (the sequence shard under SP);
under SP the norm weight's gradient is summed over TP because each rank saw different tokens.
Attention is causal with GQA; with a cp group it is :func:`context_parallel_attention`.
Modules are built at tp=1 and split by :func:`mt_parallel.apply_tensor_parallel`; the local
head counts are read off the projection shapes, so the forward code is the same at every degree.

mt-fp8's fused RMSNorm / RoPE / SwiGLU are not available yet; :class:`RMSNorm`,
:func:`apply_rope` and :class:`SwiGLU` are the plain-PyTorch versions, each a single place to swap
in the fused op.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_parallel.context_parallel import context_parallel_attention
from mt_parallel.cross_entropy import vocab_parallel_cross_entropy
from mt_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    scaled_init_std,
)
from mt_parallel.mappings import copy_to_group, group_size


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x²) + eps) · w``, computed in at least fp32, on the local tokens."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.tp_group: Any = None
        self.sequence_parallel = False

    def set_sequence_parallel(self, tp_group: Any) -> None:
        """Under SP each TP rank normalises different tokens: sum the weight gradient over TP."""
        self.tp_group, self.sequence_parallel = tp_group, True

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.weight.fill_(1.0)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x_BTD.dtype, torch.float32)
        x = x_BTD.to(compute)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = (
            copy_to_group(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        )
        return (y * weight.to(compute)).to(x_BTD.dtype)


def rope_cos_sin(
    positions_S: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape ``(S, d)`` for rotate-half RoPE (angles in fp64)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions_S.to(torch.float64).unsqueeze(1) * inv_freq.to(positions_S.device)
    angles_Sd = torch.cat([angles, angles], dim=-1)
    return angles_Sd.cos().to(dtype), angles_Sd.sin().to(dtype)


def apply_rope(x_BHSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face Llama layout): ``x·cos + rotate_half(x)·sin``."""
    x1, x2 = x_BHSd.chunk(2, dim=-1)
    return x_BHSd * cos_Sd + torch.cat([-x2, x1], dim=-1) * sin_Sd


class CoreAttention(nn.Module):
    """Causal softmax attention with GQA; context parallel when ``cp_group`` has >1 rank.

    Its own module so that selective recompute can wrap exactly this part.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        self.cp_group: Any = None

    def forward(
        self, q_BHSd: torch.Tensor, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return context_parallel_attention(q_BHSd, k_BKSd, v_BKSd, self.cp_group, dropout_p=p)


class Attention(nn.Module):
    """GQA self-attention with RoPE from column/row-parallel projections (module docstring)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        rope_theta: float = 10000.0,
        dropout: float = 0.0,
        num_layers: int = 1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.rope_theta = dim // num_heads, rope_theta
        hd = self.head_dim
        self.q_proj = ColumnParallelLinear(dim, num_heads * hd, bias=False, init_std=init_std)
        self.k_proj = ColumnParallelLinear(dim, num_kv_heads * hd, bias=False, init_std=init_std)
        self.v_proj = ColumnParallelLinear(dim, num_kv_heads * hd, bias=False, init_std=init_std)
        self.o_proj = RowParallelLinear(
            num_heads * hd, dim, bias=False, init_std=scaled_init_std(init_std, num_layers)
        )
        self.core = CoreAttention(dropout)

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` divides the query and the key/value heads."""
        for name, value in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)):
            if value % tp:
                raise ValueError(f"tensor parallel size tp={tp} does not divide {name}={value}")

    def forward(self, x_BTD: torch.Tensor, positions_S: torch.Tensor | None = None) -> torch.Tensor:
        n_BSD = self.q_proj.prepare_input(x_BTD)
        B, S, _ = n_BSD.shape
        hd = self.head_dim
        q_BHSd = self.q_proj.forward_prepared(n_BSD).view(B, S, -1, hd).transpose(1, 2)
        k_BKSd = self.k_proj.forward_prepared(n_BSD).view(B, S, -1, hd).transpose(1, 2)
        v_BKSd = self.v_proj.forward_prepared(n_BSD).view(B, S, -1, hd).transpose(1, 2)
        if positions_S is None:
            if group_size(self.core.cp_group) > 1:
                raise ValueError("context-parallel attention needs the tokens' global positions")
            positions_S = torch.arange(S, device=x_BTD.device)
        cos_Sd, sin_Sd = rope_cos_sin(positions_S, hd, self.rope_theta, q_BHSd.dtype)
        q_BHSd, k_BKSd = apply_rope(q_BHSd, cos_Sd, sin_Sd), apply_rope(k_BKSd, cos_Sd, sin_Sd)
        o_BHSd = self.core(q_BHSd, k_BKSd, v_BKSd)
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(B, S, -1))


class SwiGLU(nn.Module):
    """``silu(g)·u``; its own module so that selective recompute can wrap it."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: gate/up column-parallel, down row-parallel."""

    def __init__(self, dim: int, ffn_dim: int, num_layers: int = 1, init_std: float = 0.02) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, ffn_dim, bias=False, init_std=init_std)
        self.up_proj = ColumnParallelLinear(dim, ffn_dim, bias=False, init_std=init_std)
        self.act = SwiGLU()
        self.down_proj = RowParallelLinear(
            ffn_dim, dim, bias=False, init_std=scaled_init_std(init_std, num_layers)
        )

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        m_BSD = self.gate_proj.prepare_input(x_BTD)
        gate_BSF = self.gate_proj.forward_prepared(m_BSD)
        up_BSF = self.up_proj.forward_prepared(m_BSD)
        return self.down_proj(self.act(gate_BSF, up_BSF))


class DecoderBlock(nn.Module):
    """One Llama decoder layer (module docstring); ``forward(x_BTD, positions_S)``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        ffn_dim: int,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        dropout: float = 0.0,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = Attention(dim, num_heads, num_kv_heads, rope_theta, dropout, num_layers)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.mlp = MLP(dim, ffn_dim, num_layers)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_BTD: torch.Tensor, positions_S: torch.Tensor | None = None) -> torch.Tensor:
        h_BTD = x_BTD + self.dropout(self.attention(self.attention_norm(x_BTD), positions_S))
        return h_BTD + self.dropout(self.mlp(self.ffn_norm(h_BTD)))


class DecoderLM(nn.Module):
    """Embedding, ``num_layers`` decoder blocks, final norm, vocab-parallel LM head.

    A minimal model for tests and examples; ``forward`` returns the local vocabulary slice of
    the logits ``(B, S, V/tp)`` and :meth:`loss` the vocab-parallel cross-entropy.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        ffn_dim: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            DecoderBlock(
                dim, num_heads, num_kv_heads, ffn_dim, dropout=dropout, num_layers=num_layers
            )
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(dim)
        self.lm_head = ColumnParallelLinear(
            dim, vocab_size, bias=False, init_std=1 / math.sqrt(dim)
        )

    def forward(
        self, tokens_BT: torch.Tensor, positions_S: torch.Tensor | None = None
    ) -> torch.Tensor:
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_S)
        return self.lm_head(self.norm(x_BTD))

    def loss(self, logits_BSV_l: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens (vocab-parallel over the TP group)."""
        return vocab_parallel_cross_entropy(logits_BSV_l, targets_BS, self.lm_head.tp_group)
