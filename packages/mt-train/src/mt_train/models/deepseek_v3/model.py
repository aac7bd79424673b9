"""The DeepSeek-V3 model (and V2-Lite), assembled from mt_parallel's layers.

Shape suffixes: B batch, T sequence, D width, V vocabulary (``V_l`` this TP rank's slice).

Per block (mt_parallel's pre-norm :class:`~mt_parallel.DecoderBlock`)::

    h = x + MLA(RMSNorm(x))                    mt_parallel.MultiLatentAttention (YaRN, MLA math)
    y = h + FFN(RMSNorm(h))                    SwiGLU MLP for blocks < first_k_dense, else MoE

The MoE is mt_parallel's (router with sigmoid or softmax scores, group-limited selection, the
aux-loss-free bias, shared experts, expert parallelism). Embedding, final norm and the untied
output head are Llama's (:class:`~mt_train.models.moe.MoETransformer` is the model class, only
the block differs), so every transform (TP, CP, EP, FP8, recompute, DP) applies unchanged.

Counts. ``total`` is every parameter (the aux-loss-free biases are buffers, not counted);
``active`` (:func:`active_parameters`) is what one token uses: all but the ``num_experts -
top_k`` routed experts it skips and the input-embedding lookup (which is not a GEMM; the same
``N`` as ``6·N`` in :func:`flops_per_token`).
"""

from __future__ import annotations

from torch import nn

import mt_parallel
from mt_parallel.moe import MoE
from mt_train.models.deepseek_v3.config import DeepSeekV3Config
from mt_train.models.moe.model import MoETransformer


def deepseek_block(cfg: DeepSeekV3Config, layer_id: int) -> nn.Module:
    """A DecoderBlock of MLA and a dense MLP (below ``first_k_dense``) or an MoE layer."""
    attention = mt_parallel.MultiLatentAttention(
        cfg.dim, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rope_theta, cfg.yarn, cfg.norm_eps,
        cfg.dropout, cfg.n_layers, cfg.init_std,
    )  # fmt: skip
    if not cfg.scaled_residual_init:
        attention.o_proj.init_std = cfg.init_std
    if layer_id < cfg.first_k_dense:
        mlp: nn.Module = mt_parallel.MLP(cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.init_std)
        if not cfg.scaled_residual_init:
            mlp.down_proj.init_std = cfg.init_std
    else:
        mlp = MoE(cfg.dim, cfg.moe, cfg.n_layers, cfg.init_std, cfg.scaled_residual_init)
    return mt_parallel.DecoderBlock(attention, mlp, cfg.dim, cfg.norm_eps, cfg.dropout)


class DeepSeekV3(MoETransformer):
    """Embedding → blocks of :func:`deepseek_block` → RMSNorm → output head; CE + MoE losses."""

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__(cfg, deepseek_block)  # type: ignore[arg-type]


def _skipped_expert_params(cfg: DeepSeekV3Config) -> int:
    """Routed-expert parameters one token does not use, over all MoE blocks."""
    one_expert = 3 * cfg.dim * cfg.moe.expert_ffn_dim
    skipped = (cfg.moe.num_experts - cfg.moe.top_k) * one_expert
    return (cfg.n_layers - cfg.first_k_dense) * skipped


def active_parameters(model: nn.Module, cfg: DeepSeekV3Config) -> int:
    """Parameters one token uses, without the input-embedding lookup (module docstring)."""
    total = sum(p.numel() for p in model.parameters())
    return total - _skipped_expert_params(cfg) - model.embed.weight.numel()


def attention_parameters(cfg: DeepSeekV3Config) -> int:
    """Parameters of one MLA layer, from the shapes (norm gains included)."""
    H, E = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        query = cfg.dim * H * E
    else:
        query = cfg.dim * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * E
    kv = cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return query + kv + H * cfg.v_head_dim * cfg.dim


def flops_per_token(cfg: DeepSeekV3Config, seq_len: int) -> float:
    """Training FLOPs per token: ``6·N_active + 6·L·T·H·(E + V)`` (``N_active`` without the
    input embedding; E = nope + rope dims, V = value dims: QKᵀ and AV forward and backward, no
    causal halving, as Llama's ``12·L·D·T``)."""
    assert cfg.vocab_size is not None
    m = cfg.moe
    moe_blocks = cfg.n_layers - cfg.first_k_dense
    used_ffn = 3 * cfg.dim * (m.top_k * m.expert_ffn_dim + m.shared_hidden_dim)
    n = cfg.n_layers * (attention_parameters(cfg) + 2 * cfg.dim)
    n += cfg.first_k_dense * 3 * cfg.dim * cfg.ffn_dim
    n += moe_blocks * (used_ffn + cfg.dim * m.num_experts)
    n += cfg.dim + cfg.vocab_size * cfg.dim
    attention = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 6.0 * n + 6.0 * cfg.n_layers * seq_len * attention
