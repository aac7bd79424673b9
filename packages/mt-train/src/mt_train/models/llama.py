"""The Llama 3 decoder (plain PyTorch), with the decoder block as one swappable piece.

Shape suffixes: B batch, T sequence, D model width, H query heads, K key/value heads,
E head dim (D / H), F FFN width, V vocabulary.

Math, per block (pre-norm residual)::

    h = x + Wo · Attn(RoPE(Wq·n1(x)), RoPE(Wk·n1(x)), Wv·n1(x))      n1 = RMSNorm
    y = h + W2 · (silu(W1·n2(h)) ⊙ W3·n2(h))                          SwiGLU, n2 = RMSNorm

``RMSNorm(x) = x / sqrt(mean(x²) + eps) · g`` computed in fp32. Attention is causal
grouped-query attention: query head ``h`` reads key/value head ``h // (H/K)``. With a
document mask, a token attends only to earlier tokens of its own document, and positions
restart at 0 at each document start.

RoPE rotates each consecutive pair ``(q_2i, q_2i+1)`` at position ``p`` by ``p · f_i`` with
``f_i = θ^(-2i/E)``, θ = 500000. Llama 3.1 scaling (``rope_scaling``) rewrites the
frequencies: wavelength ``λ = 2π/f``; ``λ < L0/high`` keeps ``f``; ``λ > L0/low`` uses
``f/factor``; in between it interpolates with ``s = (L0/λ - low)/(high - low)`` as
``(1-s)·f/factor + s·f``, where ``L0`` is ``original_max_position``. The frequencies are
computed in float64, then the cos/sin tables in float32.

Embeddings are untied (``output`` is its own matrix). :class:`Llama` takes a
``block_factory(config, layer_id) -> nn.Module`` with the signature of
:class:`TransformerBlock` (``forward(x_BTD, rope, mask)``), so the block can be swapped
for mt_parallel's once it exists; parallelism and FP8 are applied to the built model as
transforms (:mod:`mt_train.models.build`), never by editing this file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mt_train.config.schema import ModelConfig, RopeScalingConfig


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    """Per-pair RoPE frequencies ``f_i`` (float64, shape E/2) with Llama 3.1 scaling."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.factor == 1.0:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < high_wavelen, freqs, scaled)


@dataclass
class Rope:
    """cos/sin tables (T, E/2) for the positions of one forward pass."""

    cos_TE: torch.Tensor
    sin_TE: torch.Tensor


def apply_rope(x_BTHE: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate consecutive pairs of the last axis; tables are (T, E/2) or (B, T, E/2)."""
    cos, sin = rope.cos_TE, rope.sin_TE
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x = x_BTHE.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x_BTHE)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight``, reduced in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE (no biases)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor, rope: Rope, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # NOTE: head counts come from the weights, so a tensor-parallel transform that shards
        # wq/wk/wv column-wise leaves this code valid with H/tp and K/tp local heads.
        q_BTHE = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k_BTKE = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v_BTKE = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        q_BTHE, k_BTKE = apply_rope(q_BTHE, rope), apply_rope(k_BTKE, rope)
        q, k, v = (t.transpose(1, 2) for t in (q_BTHE, k_BTKE, v_BTKE))
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            out_BHTE = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out_BHTE = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out_BHTE.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) ⊙ w3 x)``."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm decoder block (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x_BTD: torch.Tensor, rope: Rope, mask: torch.Tensor | None) -> torch.Tensor:
        h = x_BTD + self.attention(self.attention_norm(x_BTD), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


BlockFactory = Callable[[ModelConfig, int], nn.Module]


class Llama(nn.Module):
    """Token embedding → ``n_layers`` blocks → RMSNorm → untied output projection."""

    def __init__(
        self, cfg: ModelConfig, max_seq_len: int, block_factory: BlockFactory = TransformerBlock
    ) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size must be resolved (from the tokenizer) before building"
            )
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(block_factory(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        freqs = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        angles_TE = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
        self.register_buffer("rope_cos", angles_TE.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles_TE.sin().float(), persistent=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) weights, output projections of blocks scaled by 1/sqrt(2L), unit norms."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                param.normal_(0.0, out_std, generator=generator)
            else:
                param.normal_(0.0, std, generator=generator)

    def rope(self, position_ids_BT: torch.Tensor | None, T: int) -> Rope:
        if self.max_seq_len < T:
            raise ValueError(
                f"sequence length {T} exceeds the model's max_seq_len {self.max_seq_len}"
            )
        if position_ids_BT is None:
            return Rope(self.rope_cos[:T], self.rope_sin[:T])
        return Rope(self.rope_cos[position_ids_BT], self.rope_sin[position_ids_BT])

    def forward(
        self,
        tokens_BT: torch.Tensor,
        position_ids_BT: torch.Tensor | None = None,
        mask_B1TT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V). ``mask_B1TT``: boolean, True where attention is allowed."""
        x = self.tok_embeddings(tokens_BT)
        rope = self.rope(position_ids_BT, tokens_BT.shape[1])
        for layer in self.layers:
            x = layer(x, rope, mask_B1TT)
        return self.output(self.norm(x))


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and isinstance(model, Llama):
        total -= model.tok_embeddings.weight.numel()
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6·N + 12·L·D·T`` (N without the input embedding).

    The attention term counts QKᵀ and AV forward and backward without halving for causality
    (the PaLM / torchtitan convention, so MFU compares across stacks).
    """
    assert cfg.vocab_size is not None
    E = cfg.head_dim
    per_layer = cfg.dim * E * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim
    per_layer += 2 * cfg.dim  # the two RMSNorm gains
    n = cfg.n_layers * per_layer + cfg.dim + cfg.vocab_size * cfg.dim
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq_len
