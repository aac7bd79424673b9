"""A Llama-style decoder block built from the parallel layers and mt-fp8's fused ops.

Shape suffixes: B batch, T tokens this rank holds (``T_seq/cp``, and ``/tp`` between TP regions
under sequence parallel), S tokens inside a TP region (``T_seq/cp``), D model width, H query
heads, K key/value heads (both per TP rank inside the block), d head dim, P = d/2, F FFN width,
V vocab.

Block (pre-norm, as Llama)::

    a = dropout(o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))))   n = norm(x)
    m, h = norm(x + a), x + a                       (one fused RMSNorm + residual add)
    y = h + dropout(down_proj(swiglu(gate_proj(m), up_proj(m))))

q/k/v and gate/up are column-parallel (heads and FFN columns split over TP), o/down are
row-parallel. RMSNorm (with the fused residual add), RoPE (on q and k together) and SwiGLU are
``mt_fp8.ops``: Triton kernels on CUDA, the same math in PyTorch on the CPU, computed in fp32
(fp64 for fp64 inputs, so fp64 references stay exact). The block's second residual add stays
outside: fusing it into the next block's norm would change the block's ``x -> y`` interface.
With FP8 on ``down_proj`` the SwiGLU product is quantized straight from ``gate`` and ``up``
(``RowParallelLinear.forward_swiglu``): it is never stored in high precision, and the ``act``
module (the target of selective ``mlp`` recompute) is not called, as nothing of it is saved.

Norms and dropout run on whatever the rank holds (the sequence shard under SP); under SP the
norm weight's gradient is summed over TP because each rank saw different tokens, and the
residual dropout draws a per-TP-rank mask (:mod:`mt_parallel.rng`). Attention is causal with
GQA, masked to each token's own document when ``document_ids`` are given; with a cp group it is
:func:`context_parallel_attention`. Modules are built at tp=1 and split by
:func:`mt_parallel.apply_tensor_parallel`; the local head counts are read off the projection
shapes, so the forward code is the same at every degree.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from mt_fp8.ops import apply_rotary, rms_norm, swiglu
from mt_parallel.context_parallel import context_parallel_attention
from mt_parallel.cross_entropy import vocab_parallel_cross_entropy
from mt_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    scaled_init_std,
)
from mt_parallel.mappings import copy_to_group, group_size
from mt_parallel.ring_attention import ring_attention
from mt_parallel.rng import Dropout, forks_rng, rng_region


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


def rope_cos_sin(
    positions_S: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``(S, d/2)`` (``mt_fp8.ops.apply_rotary``'s tables), angles in fp64."""
    inv_freq_P = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_SP = positions_S.to(torch.float64).unsqueeze(1) * inv_freq_P.to(positions_S.device)
    return angles_SP.cos().to(dtype), angles_SP.sin().to(dtype)


def apply_rope(x_BHSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of one tensor with full ``(S, d)`` tables: ``x·cos + rotate_half(x)·sin``.

    For callers that build their own tables; :class:`Attention` rotates q and k together with
    ``mt_fp8.ops.apply_rotary`` and the half tables of :meth:`Attention.rope_tables`.
    """
    x1, x2 = x_BHSd.chunk(2, dim=-1)
    return x_BHSd * cos_Sd + torch.cat([-x2, x1], dim=-1) * sin_Sd


class CoreAttention(nn.Module):
    """Causal softmax attention with GQA, optional document masking; context parallel when
    ``cp_group`` has >1 rank (all-gather K/V, or :func:`ring_attention` when ``cp_ring``).

    Its own module so that selective recompute can wrap exactly this part. The probabilities
    belong to this rank's heads, so their dropout is a sharded region (:mod:`mt_parallel.rng`).
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        self.cp_group: Any = None
        self.cp_ring = False
        self.tp_group: Any = None

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        self.tp_group = tp_group

    def forks_rng(self) -> bool:
        """Whether the next forward draws from the RNG tracker (recompute then replays it)."""
        return forks_rng(self.training, self.dropout, sharded=True)

    def forward(
        self,
        q_BHSd: torch.Tensor,
        k_BKSd: torch.Tensor,
        v_BKSd: torch.Tensor,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.cp_ring and group_size(self.cp_group) > 1:
            if p > 0:
                raise ValueError(
                    "ring attention has no attention dropout: use cp_attention=all_gather"
                )
            return ring_attention(q_BHSd, k_BKSd, v_BKSd, self.cp_group, document_ids_BS)
        region = rng_region(True, self.tp_group, q_BHSd.device) if p > 0 else nullcontext()
        with region:
            return context_parallel_attention(
                q_BHSd, k_BKSd, v_BKSd, self.cp_group, p, document_ids_BS
            )


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

    def shared_input_linears(self) -> tuple[ColumnParallelLinear, ...]:
        """The projections that read one normalised input (:func:`mt_parallel.apply_fp8`
        ties their FP8 input scales)."""
        return (self.q_proj, self.k_proj, self.v_proj)

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` divides the query and the key/value heads."""
        for name, value in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)):
            if value % tp:
                raise ValueError(f"tensor parallel size tp={tp} does not divide {name}={value}")

    def rope_tables(
        self, positions_S: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_SP``, ``sin_SP`` for the tokens' positions; override for other frequencies."""
        return rope_cos_sin(positions_S, self.head_dim, self.rope_theta, dtype)

    def forward(
        self,
        x_BTD: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n_BSD = self.q_proj.prepare_input(x_BTD)
        B, S, _ = n_BSD.shape
        hd = self.head_dim
        q_BSHd = self.q_proj.forward_prepared(n_BSD).view(B, S, -1, hd)
        k_BSKd = self.k_proj.forward_prepared(n_BSD).view(B, S, -1, hd)
        v_BSKd = self.v_proj.forward_prepared(n_BSD).view(B, S, -1, hd)
        if positions_S is None:
            if group_size(self.core.cp_group) > 1:
                raise ValueError("context-parallel attention needs the tokens' global positions")
            positions_S = torch.arange(S, device=x_BTD.device)
        # The tables in the rotation's compute precision (fp64 only for fp64 activations).
        table_dtype = torch.float64 if q_BSHd.dtype == torch.float64 else torch.float32
        cos_SP, sin_SP = self.rope_tables(positions_S, table_dtype)
        q_BSHd, k_BSKd = apply_rotary(q_BSHd, k_BSKd, cos_SP, sin_SP)
        o_BHSd = self.core(
            q_BSHd.transpose(1, 2), k_BSKd.transpose(1, 2), v_BSKd.transpose(1, 2), document_ids_BS
        )
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(B, S, -1))


class SwiGLU(nn.Module):
    """``silu(g)·u`` (``mt_fp8.ops.swiglu``); its own module so selective recompute can wrap it."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


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

    def shared_input_linears(self) -> tuple[ColumnParallelLinear, ...]:
        """The projections that read one normalised input (see :class:`Attention`)."""
        return (self.gate_proj, self.up_proj)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        m_BSD = self.gate_proj.prepare_input(x_BTD)
        gate_BSF = self.gate_proj.forward_prepared(m_BSD)
        up_BSF = self.up_proj.forward_prepared(m_BSD)
        if self.down_proj.fp8_enabled:  # SwiGLU into FP8 (module docstring)
            return self.down_proj.forward_swiglu(gate_BSF, up_BSF)
        return self.down_proj(self.act(gate_BSF, up_BSF))


class DecoderBlock(nn.Module):
    """One Llama decoder layer (module docstring); ``forward(x_BTD, positions_S, document_ids_BS)``."""

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
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n_BTD = self.attention_norm(x_BTD)
        # NOTE: document ids only when given, so attentions with the older (x, positions)
        # signature keep working in blocks that never see packed sequences.
        extra = {} if document_ids_BS is None else {"document_ids_BS": document_ids_BS}
        a_BTD = self.dropout(self.attention(n_BTD, positions_S, **extra))
        # x first: h = x + a keeps the residual stream's dtype (fp32 under bf16 autocast).
        m_BTD, h_BTD = self.ffn_norm(x_BTD, a_BTD)
        return h_BTD + self.dropout(self.mlp(m_BTD))


class DecoderLM(nn.Module):
    """Embedding, ``num_layers`` decoder blocks, final norm, vocab-parallel LM head.

    A minimal model for tests and examples; ``forward`` returns the local vocabulary slice of
    the logits ``(B, S, V/tp)`` and :meth:`loss` the cross-entropy (vocab-parallel under TP,
    mt-fp8's chunked kernel without).
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
        self,
        tokens_BT: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_S, document_ids_BS)
        return self.lm_head(self.norm(x_BTD))

    def loss(self, logits_BSV_l: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens (vocab-parallel over the TP group)."""
        return vocab_parallel_cross_entropy(logits_BSV_l, targets_BS, self.lm_head.tp_group)
