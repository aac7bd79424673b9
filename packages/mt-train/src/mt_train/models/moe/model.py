"""The MoE family's model: :class:`~mt_train.models.llama.Llama` with MoE feed-forward layers.

Per block (mt_parallel's pre-norm :class:`~mt_parallel.DecoderBlock`)::

    h = x + o_proj(Attn(n1(x)))                       Llama's GQA attention with RoPE
    y = h + MoE(n2(h))                                mt_parallel.moe.MoE (routed + shared)
    (blocks < first_k_dense: y = h + MLP(n2(h)), dense SwiGLU of ffn_dim)

Loss (training): ``CE + Σ_layers (aux + z)``: the balancing and z-losses each MoE layer kept
from this forward (:func:`mt_parallel.moe.collect_aux_losses`); logged extras: ``ce_loss``,
``moe_aux_loss``, ``moe_z_loss``, ``moe_max_vio`` (the worst layer's max/mean load − 1),
``moe_dropped``. In evaluation (``model.eval()``) the loss is the cross-entropy alone. Under
pipeline parallelism each chunk has already attached its layers' auxiliary losses to its
activations (:mod:`mt_parallel.moe.carry`), so none is left here and the loss is the
cross-entropy; the pipeline step reports the auxiliary values over all stages.

Parameter counts: ``total`` every parameter; ``active`` what one token uses (``top_k`` of the
routed experts, all else): :func:`active_parameters`.
"""

from __future__ import annotations

import torch
from torch import nn

import mt_parallel
from mt_parallel.moe import MoE, collect_aux_losses
from mt_train.models.llama.model import BlockFactory, Llama, LlamaAttention
from mt_train.models.moe.config import MoEModelConfig


def moe_block(cfg: MoEModelConfig, layer_id: int) -> nn.Module:
    """A DecoderBlock around Llama's attention and an MoE layer (a dense MLP below
    ``first_k_dense``)."""
    attention = LlamaAttention(cfg)
    if not cfg.scaled_residual_init:
        attention.o_proj.init_std = cfg.init_std
    if layer_id < cfg.first_k_dense:
        mlp: nn.Module = mt_parallel.MLP(cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.init_std)
        if not cfg.scaled_residual_init:
            mlp.down_proj.init_std = cfg.init_std
    else:
        mlp = MoE(cfg.dim, cfg.moe, cfg.n_layers, cfg.init_std, cfg.scaled_residual_init)
    return mt_parallel.DecoderBlock(attention, mlp, cfg.dim, cfg.norm_eps, cfg.dropout)


class MoETransformer(Llama):
    """Llama's embedding, blocks of :func:`moe_block` (or ``block_factory``'s), norm and head."""

    def __init__(self, cfg: MoEModelConfig, block_factory: BlockFactory = moe_block) -> None:
        super().__init__(cfg, block_factory)

    def loss(
        self, logits_BTV_l: torch.Tensor, targets_BT: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``CE + auxiliary losses`` in training, ``CE`` in evaluation (module docstring)."""
        ce = super().loss(logits_BTV_l, targets_BT)
        aux, logged = collect_aux_losses(self)
        if not self.training:
            return ce, logged
        total = ce if aux is None else ce + aux
        return total, {"ce_loss": ce.detach(), **logged}


def _expert_params_per_layer(cfg: MoEModelConfig) -> tuple[int, int]:
    """(routed expert parameters of one MoE layer, those one token uses)."""
    one_expert = 3 * cfg.dim * cfg.moe.expert_ffn_dim
    return cfg.moe.num_experts * one_expert, cfg.moe.top_k * one_expert


def active_parameters(model: nn.Module, cfg: MoEModelConfig) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to."""
    total = sum(p.numel() for p in model.parameters())
    routed, used = _expert_params_per_layer(cfg)
    return total - (cfg.n_layers - cfg.first_k_dense) * (routed - used)


def flops_per_token(cfg: MoEModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6·N_active + 12·L·D·T`` (N without the input embedding;
    the attention term as :func:`mt_train.models.llama.flops_per_token` counts it)."""
    assert cfg.vocab_size is not None
    head = cfg.head_dim
    attention = cfg.dim * head * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 2 * cfg.dim
    dense_mlp = 3 * cfg.dim * cfg.ffn_dim
    _, used = _expert_params_per_layer(cfg)
    moe_mlp = used + 3 * cfg.dim * cfg.moe.shared_hidden_dim + cfg.dim * cfg.moe.num_experts
    moe_layers = cfg.n_layers - cfg.first_k_dense
    n = cfg.n_layers * attention + cfg.first_k_dense * dense_mlp + moe_layers * moe_mlp
    n += cfg.dim + cfg.vocab_size * cfg.dim
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq_len
