"""The ViT image encoder (CLIP's vision tower), on mt_parallel's column/row-parallel linears.

Shape suffixes: N images, C channels, H/W pixels, p patch size, P patches per image
(``(H/p)·(W/p)``), L tokens per image (``P``, plus one with the class token), D encoder
width, A heads per TP rank, d head dim, F MLP width (per TP rank under TP).

Math::

    e = conv_p(x) (patches, no bias) ;  e = [cls; e] if cls_token ;  e = e + pos   (learned)
    h_0 = LN_pre(e) if pre_norm else e
    h_i = h_{i-1} + o(Attn(LN1(h_{i-1})))             bidirectional softmax(q·kᵀ/√d)·v
    h_i = h_i + fc2(act(fc1(LN2(h_i))))               act: quick_gelu x·σ(1.702x) or gelu
    features = h_k (k = feature_layer), without the class token unless feature_select=all

q/k/v and fc1 are column-parallel (heads and MLP columns split over TP), o and fc2
row-parallel, all with biases (CLIP's). The patch embedding, class token, positions and
LayerNorms are replicated. Blocks after ``feature_layer`` and the post-norm (CLIP's pooled
output, which LLaVA never reads) are held so checkpoints keep their published shapes, frozen
and never run. The attention core is ``torch.nn.functional.scaled_dot_product_attention``
(non-causal, no mask: every token of an image sees every other).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mt_parallel import ColumnParallelLinear, RowParallelLinear
from mt_train.models.vlm.config import VisionConfig

QUICK_GELU_SCALE = 1.702
"""CLIP's quick GELU: ``x·sigmoid(1.702·x)``."""


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(QUICK_GELU_SCALE * x)
    return F.gelu(x)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, initialised to 1 and 0 (replicated under TP)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.weight.fill_(1.0)
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class PatchEmbedding(nn.Module):
    """Patches (a stride-p convolution without bias), optional class token, learned positions."""

    def __init__(self, cfg: VisionConfig, init_std: float) -> None:
        super().__init__()
        self.cfg, self.init_std = cfg, init_std
        p = cfg.patch_size
        self.patch = nn.Parameter(torch.empty(cfg.dim, cfg.channels, p, p))
        self.cls = nn.Parameter(torch.empty(cfg.dim)) if cfg.cls_token else None
        self.positions = nn.Parameter(torch.empty(cfg.num_patches + int(cfg.cls_token), cfg.dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        for param in (self.patch, self.cls, self.positions):
            if param is not None:
                full = torch.empty(param.shape).normal_(0.0, self.init_std, generator=generator)
                param.copy_(full)

    def forward(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if images_NCHW.shape[1:] != (c.channels, c.image_size, c.image_size):
            raise ValueError(
                f"images of shape {tuple(images_NCHW.shape[1:])} given to a vision encoder for "
                f"{c.channels}x{c.image_size}x{c.image_size} (channels x height x width)"
            )
        x = images_NCHW.to(self.patch.dtype)
        e_NDP = F.conv2d(x, self.patch, stride=c.patch_size).flatten(2)
        e_NPD = e_NDP.transpose(1, 2)
        if self.cls is not None:
            e_NPD = torch.cat([self.cls.expand(e_NPD.shape[0], 1, -1), e_NPD], dim=1)
        return e_NPD + self.positions


class VisionCoreAttention(nn.Module):
    """Bidirectional softmax attention of one image's tokens (selective-recompute target)."""

    recompute_target: ClassVar[str] = "attention"

    def forward(self, q_NALd: torch.Tensor, k_NALd: torch.Tensor, v_NALd: torch.Tensor):
        return F.scaled_dot_product_attention(q_NALd, k_NALd, v_NALd)


class VisionAttention(nn.Module):
    """Multi-head self-attention with biased q/k/v (column-parallel) and o (row-parallel)."""

    def __init__(self, cfg: VisionConfig, init_std: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        D = cfg.dim
        self.q_proj = ColumnParallelLinear(D, D, bias=True, init_std=init_std)
        self.k_proj = ColumnParallelLinear(D, D, bias=True, init_std=init_std)
        self.v_proj = ColumnParallelLinear(D, D, bias=True, init_std=init_std)
        self.o_proj = RowParallelLinear(D, D, bias=True, init_std=init_std)
        self.core = VisionCoreAttention()

    def shared_input_linears(self) -> tuple[ColumnParallelLinear, ...]:
        return (self.q_proj, self.k_proj, self.v_proj)

    def check_tp(self, tp: int) -> None:
        if self.n_heads % tp:
            raise ValueError(f"tensor parallel size tp={tp} does not divide n_heads={self.n_heads}")

    def forward(self, x_NLD: torch.Tensor) -> torch.Tensor:
        n_NLD = self.q_proj.prepare_input(x_NLD)
        N, L, _ = n_NLD.shape
        # NOTE: the projections are called here, not from a helper: under torch.compile an FP8
        # linear is a graph break, and code after a break inside a helper becomes a compiled
        # graph of its own (mt_parallel.layers: FP8 under torch.compile).
        q_NLD = self.q_proj.forward_prepared(n_NLD)
        k_NLD = self.k_proj.forward_prepared(n_NLD)
        v_NLD = self.v_proj.forward_prepared(n_NLD)
        q_NALd, k_NALd, v_NALd = (
            t.view(N, L, -1, self.head_dim).transpose(1, 2) for t in (q_NLD, k_NLD, v_NLD)
        )
        o_NALd = self.core(q_NALd, k_NALd, v_NALd)
        return self.o_proj(o_NALd.transpose(1, 2).reshape(N, L, -1))


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``: fc1 column-parallel, fc2 row-parallel, both biased."""

    def __init__(self, cfg: VisionConfig, init_std: float) -> None:
        super().__init__()
        self.act = cfg.act
        self.fc1 = ColumnParallelLinear(cfg.dim, cfg.ffn_dim, bias=True, init_std=init_std)
        self.fc2 = RowParallelLinear(cfg.ffn_dim, cfg.dim, bias=True, init_std=init_std)

    def forward(self, x_NLD: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x_NLD)))


class VisionBlock(nn.Module):
    """Pre-norm encoder block: ``h = x + attn(LN1(x)); y = h + mlp(LN2(h))``."""

    def __init__(self, cfg: VisionConfig, init_std: float) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.dim, cfg.norm_eps)
        self.attention = VisionAttention(cfg, init_std)
        self.norm2 = LayerNorm(cfg.dim, cfg.norm_eps)
        self.mlp = VisionMLP(cfg, init_std)

    def forward(self, x_NLD: torch.Tensor) -> torch.Tensor:
        # Under autocast the norms run in fp32 and the residual stream keeps x's dtype.
        h_NLD = x_NLD + self.attention(self.norm1(x_NLD))
        return h_NLD + self.mlp(self.norm2(h_NLD))


class VisionTransformer(nn.Module):
    """Images ``(N, C, H, W)`` → features ``(N, L, D)`` (module docstring)."""

    def __init__(self, cfg: VisionConfig, init_std: float = 0.02) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = PatchEmbedding(cfg, init_std)
        self.pre_norm = LayerNorm(cfg.dim, cfg.norm_eps) if cfg.pre_norm else None
        self.layers = nn.ModuleList(VisionBlock(cfg, init_std) for _ in range(cfg.n_layers))
        self.post_norm = LayerNorm(cfg.dim, cfg.norm_eps) if cfg.post_norm else None
        for module in [*self.layers[cfg.feature_blocks :], self.post_norm]:
            if module is not None:
                module.requires_grad_(False)

    def forward(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        h_NLD = self.embeddings(images_NCHW)
        if self.pre_norm is not None:
            h_NLD = self.pre_norm(h_NLD)
        for layer in self.layers[: self.cfg.feature_blocks]:
            h_NLD = layer(h_NLD)
        if self.cfg.cls_token and self.cfg.feature_select == "patch":
            h_NLD = h_NLD[:, 1:]
        return h_NLD


def vision_flops_per_image(cfg: VisionConfig) -> float:
    """Training FLOPs of one image through the blocks that run: ``6·N_blocks·L + 12·k·D·L²``
    (``N_blocks`` the run blocks' matrix parameters, the attention term as the decoder's)."""
    L = cfg.num_patches + int(cfg.cls_token)
    per_block = 4 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.ffn_dim
    patch = cfg.channels * cfg.patch_size**2 * cfg.dim
    k = cfg.feature_blocks
    return 6.0 * (k * per_block * L + patch * cfg.num_patches) + 12.0 * k * cfg.dim * L * L
