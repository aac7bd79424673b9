"""A plain-PyTorch DeepSeek-V2/V3 decoder (MLA + MoE): the reference of ``train_throughput.py
--model deepseek_v2_lite``.

Written the way torchtitan writes its DeepSeek-V3 model, with nothing from mt in the compute:
``nn.Linear``, ``nn.RMSNorm``, ``F.scaled_dot_product_attention`` and, for the experts,
``torch._grouped_mm`` over ``[E, out, in]`` weights with groups padded to 16 rows (the CUDA
kernel's alignment), index-add combine. Per block (pre-norm)::

    q            = q_proj(n)   or   q_b(RMSNorm(q_a(n)))          [nope | rope] per head
    c, k_rope    = kv_a(n);   k_nope, v = kv_b(RMSNorm(c))        one rotary key for all heads
    q_rope, k_rope = RoPE(q_rope), RoPE(k_rope)                   YaRN frequencies, rotate-half
    o            = SDPA(q, k, v, causal, scale = m² / sqrt(nope + rope))
    h = x + o_proj(o);   y = h + FFN(RMSNorm(h))                  dense SwiGLU or MoE

MoE: router ``x·Wᵀ``, softmax (or sigmoid) scores, top-k, weights renormalised if the config
says so, times ``routed_scaling_factor``; the Switch auxiliary loss
``α·E·Σ_e f_e·P_e`` (``f_e = n_e/(T·K)``, ``P_e`` the mean probability) summed over the MoE
layers and added to the cross-entropy; shared experts as one SwiGLU of their summed width.
YaRN (DeepSeek's formulas): frequencies ramped between ``f/s`` and ``f`` over the pairs that
turn between ``beta_slow`` and ``beta_fast`` times in the original context, tables scaled by
``m(s, mscale)/m(s, mscale_all_dim)``, softmax scale by ``m(s, mscale_all_dim)²``.

Parameter names are mt-train's (``load_state_dict`` of an mt model's state works, its buffers
aside), so the CPU test holds it to mt's loss from the same weights. What it leaves out:
group-limited routing, the aux-loss-free bias, MTP and capacity, none of which V2-Lite uses.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ALIGN = 16
"""Rows of each expert's group are padded to this multiple (``torch._grouped_mm``'s alignment)."""


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_tables(cfg: Any, seq: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Rotate-half cos/sin tables ``[seq, rope_dim]`` (fp32) and the softmax scale."""
    d, theta, yarn = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    table_scale, softmax_scale = 1.0, (cfg.qk_nope_head_dim + d) ** -0.5
    if yarn.factor > 1:

        def correction_dim(rotations: float) -> float:
            return (
                d
                * math.log(yarn.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(theta))
            )

        low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(correction_dim(yarn.beta_slow)), d - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / yarn.factor * ramp + freqs * (1 - ramp)
        if yarn.mscale and yarn.mscale_all_dim:
            table_scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(
                yarn.factor, yarn.mscale_all_dim
            )
        else:
            table_scale = yarn_mscale(yarn.factor, 1.0)
        if yarn.mscale_all_dim:
            softmax_scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos() * table_scale, angles.sin() * table_scale
    return cos.float(), sin.float(), softmax_scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.h, self.n, self.r, self.v = (
            cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
        )  # fmt: skip
        self.c = cfg.kv_lora_rank
        qk = self.n + self.r
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.dim, self.h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * qk, bias=False)
        self.kv_a_proj = nn.Linear(cfg.dim, self.c + self.r, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.c, eps=cfg.norm_eps)
        self.kv_b_proj = nn.Linear(self.c, self.h * (self.n + self.v), bias=False)
        self.o_proj = nn.Linear(self.h * self.v, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, self.h, self.n + self.r).split([self.n, self.r], -1)
        c, k_rope = self.kv_a_proj(x).split([self.c, self.r], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c)).view(B, T, self.h, self.n + self.v)
        k_nope, v = kv.split([self.n, self.v], dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = torch.cat([q_nope, rotate(q_rope, cos, sin)], dim=-1)
        k_rope = rotate(k_rope[:, :, None, :], cos, sin).expand(B, T, self.h, self.r)
        k = torch.cat([k_nope, k_rope], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.v))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_experts(
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
) -> torch.Tensor:
    """``Σ_k w_tk · SwiGLU_{e_tk}(x_t)``: tokens sorted by expert (stable), each expert's rows
    padded to :data:`ALIGN`, three ``torch._grouped_mm`` calls, index-add combine."""
    experts, top_k = w1_EFD.shape[0], idx_TK.shape[1]
    order = torch.argsort(idx_TK.reshape(-1), stable=True)
    counts = torch.bincount(idx_TK.reshape(-1), minlength=experts)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(experts, device=x_TD.device), counts)
    dest = (ends - padded)[expert_of] + torch.arange(order.numel(), device=x_TD.device)
    dest = dest - first[expert_of]
    rows = x_TD.new_zeros(int(ends[-1]), x_TD.shape[1])
    rows = rows.index_copy(0, dest, x_TD[order // top_k])
    offs = ends.to(torch.int32)
    dtype = rows.dtype  # the autocast dtype when on: the CUDA grouped GEMM takes bf16
    if torch.is_autocast_enabled(x_TD.device.type):
        dtype = torch.get_autocast_dtype(x_TD.device.type)
    rows = rows.to(dtype)
    h = F.silu(torch._grouped_mm(rows, w1_EFD.to(dtype).transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(rows, w3_EFD.to(dtype).transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(h, w2_EDF.to(dtype).transpose(-2, -1), offs=offs)[dest]
    y = y * weights_TK.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x_TD).index_add(0, order // top_k, y.to(x_TD.dtype))


class Experts(nn.Module):
    """The routed experts' weights as mt stores them: one ``[E, out, in]`` tensor each."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate_proj = nn.Module()
        self.up_proj = nn.Module()
        self.down_proj = nn.Module()
        self.gate_proj.weight = nn.Parameter(torch.empty(experts, hidden, dim))
        self.up_proj.weight = nn.Parameter(torch.empty(experts, hidden, dim))
        self.down_proj.weight = nn.Parameter(torch.empty(experts, dim, hidden))


class MoE(nn.Module):
    def __init__(self, dim: int, moe: Any) -> None:
        super().__init__()
        unsupported = moe.n_group > 1 or moe.z_loss_coeff or moe.capacity_factor is not None
        if unsupported or moe.balancing not in ("aux_loss", "none"):
            raise ValueError(
                "plain_deepseek's MoE runs ungrouped routing with balancing aux_loss or none, no "
                f"z-loss and no capacity; got n_group={moe.n_group}, balancing={moe.balancing!r}, "
                f"z_loss_coeff={moe.z_loss_coeff}, capacity_factor={moe.capacity_factor}"
            )
        self.cfg = moe
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(moe.num_experts, dim))
        self.experts = Experts(dim, moe.expert_ffn_dim, moe.num_experts)
        self.shared_experts = MLP(dim, moe.shared_hidden_dim) if moe.n_shared_experts else None

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.cfg
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits = F.linear(x, self.router.weight).float()
        scores = logits.softmax(-1) if m.score_function == "softmax" else logits.sigmoid()
        weights, idx = scores.topk(m.top_k, dim=-1)
        if m.normalize_weights:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * m.routed_scaling_factor
        e = self.experts
        out = grouped_experts(
            x, idx, weights, e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight
        ).view(x_BSD.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_BSD)
        aux = scores.new_zeros(())
        if m.balancing == "aux_loss" and m.aux_loss_coeff > 0:
            probs = scores if m.score_function == "softmax" else scores / scores.sum(-1, True)
            f = torch.bincount(idx.reshape(-1), minlength=m.num_experts) / idx.numel()
            aux = m.aux_loss_coeff * m.num_experts * (f * probs.mean(0)).sum()
        return out, aux


class Block(nn.Module):
    def __init__(self, cfg: Any, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        dense = layer_id < cfg.first_k_dense
        self.mlp = MLP(cfg.dim, cfg.ffn_dim) if dense else MoE(cfg.dim, cfg.moe)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attention(self.attention_norm(x), cos, sin, scale)
        y = self.mlp(self.ffn_norm(h))
        if isinstance(y, tuple):
            return h + y[0], y[1]
        return h + y, h.new_zeros((), dtype=torch.float32)


class PlainDeepSeek(nn.Module):
    """The module docstring's decoder; ``forward(tokens) -> (logits, aux_loss)``."""

    def __init__(self, cfg: Any, seq: int) -> None:
        super().__init__()
        if cfg.mtp_depth:
            raise ValueError(f"plain_deepseek has no MTP modules; got mtp_depth={cfg.mtp_depth}")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin, self.scale = yarn_tables(cfg, seq)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, cfg.init_std)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, layer_aux = layer(x, cos, sin, self.scale)
            aux = aux + layer_aux
        return self.output(self.norm(x)), aux


def loss(model: PlainDeepSeek, tokens_BT1: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (fp32) plus the MoE layers' auxiliary losses."""
    logits, aux = model(tokens_BT1[:, :-1])
    ce = F.cross_entropy(logits.float().flatten(0, 1), tokens_BT1[:, 1:].flatten())
    return ce + aux


def load_mt_state(model: PlainDeepSeek, state: dict[str, torch.Tensor]) -> None:
    """Copy an mt DeepSeek model's weights in (its aux-loss-free bias buffers are ignored)."""
    weights = {k: v for k, v in state.items() if not k.endswith("router.expert_bias")}
    model.load_state_dict(weights, strict=True)
