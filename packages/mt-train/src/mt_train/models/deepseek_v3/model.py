"""The DeepSeek-V3 model (and V2-Lite), assembled from mt_parallel's layers.

Shape suffixes: B batch, T sequence, D width, V vocabulary (``V_l`` this TP rank's slice), K the
MTP depths.

Per block (mt_parallel's pre-norm :class:`~mt_parallel.DecoderBlock`)::

    h = x + MLA(RMSNorm(x))                    mt_parallel.MultiLatentAttention (YaRN, MLA math)
    y = h + FFN(RMSNorm(h))                    SwiGLU MLP for blocks < first_k_dense, else MoE

The MoE is mt_parallel's (router with sigmoid or softmax scores, group-limited selection, the
aux-loss-free bias, shared experts, expert parallelism). Embedding, final norm and the untied
output head are Llama's (:class:`~mt_train.models.moe.MoETransformer` is the model class, only
the block differs), so every transform (TP, CP, EP, FP8, recompute, DP) applies unchanged.

Multi-token prediction (``mtp_depth = D > 0``, DeepSeek-V3 §2.2). With ``h⁰`` the last block's
output (before the final norm) and ``Emb``/``Head`` the main model's embedding and output head::

    h^k_i  = Block_k(W_k · [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)])     k = 1..D
    logits^k_i = Head(RMSNorm_k(h^k_i))                 predicts t_{i+k+1} = targets[i+k]
    loss   = CE + aux + (λ/D)·Σ_k MTP_k                 (training; evaluation: CE alone)

``MTP_k`` is the mean CE over the positions ``i`` with ``i + k < T`` and, under document
masking, ``doc[i] == doc[i+k]`` (the shifted token of another document is ignored), and
``targets[i+k]`` not ignored. The shifted tokens are ``tokens.roll(-k)``; the wrapped last ``k``
positions are masked, and causality keeps them out of every valid position (the "truncate"
formulation of the paper gives the same losses; tested). Each ``MTP_k`` is logged as
``mtp_loss_{k}``. λ may switch once during training (``mtp_loss_weight_switch_step``): the
trainer calls :meth:`DeepSeekV3.set_train_step` before every step, as it does every module's
``set_train_step`` hook. The MTP modules run only in training; ``mt-convert`` imports and
exports them as DeepSeek's checkpoints store them (``export --mtp-depth 0`` drops them). The MTP
blocks are :func:`deepseek_block` s (MoE), so TP/EP/FP8/recompute apply.

Context parallelism. A cp rank holds two chunks of the sequence, so the token ``t_{i+k}`` and
the target ``targets[i+k]`` of its chunks' last ``k`` positions live on another rank. They are
shifted on the whole sequence before the cut: :meth:`DeepSeekV3.sequence_inputs` turns the
micro-batch's tokens, targets and document ids into ``mtp_tokens_BTK`` (``t_{i+k}``) and
``mtp_targets_BTK`` (the masked ``targets[i+k]``), which the trainer cuts like the tokens
(``mt_parallel.shard_sequence``) and passes to :meth:`DeepSeekV3.forward`; no activation
crosses ranks beyond the MTP blocks' own CP attention, which sees the global positions as the
main blocks do. Each rank's ``MTP_k`` is its share ``cp·Σ_local / N_k`` of the whole
sequence's mean (``mt_parallel.sequence_mean_cross_entropy``: the ranks hold different numbers
of valid MTP targets, the masked tail all on the rank of the last chunk), so the mean over the
cp group, which gradient averaging takes, is the one-process ``MTP_k``; the logged
``mtp_loss_{k}`` is the whole sequence's mean on every rank. Called without those inputs (a
one-process caller) the model shifts its own tokens and targets, the same functions on the
same whole sequence; under CP that is refused.

Pipeline parallelism (Megatron-Core's placement). The MTP modules run on the last chunk, after
the last blocks, in :meth:`DeepSeekV3.predict` (the layout's ``head``,
:func:`deepseek_plan`), with the micro-batch's ``mtp_tokens_BTK``/``mtp_targets_BTK`` as the
last chunk's inputs (``last_inputs``: nothing shifted crosses stages). They embed the shifted
tokens with the input embedding, which the first chunk holds: the last chunk's rank keeps a
copy (``last_shared``), started from the first's, whose gradient is summed with the first's
after every step (:class:`mt_parallel.PipelineModule`), so both stay equal; checkpoints store
it once. The cp group of the MTP losses lives on a parameter-free module of the last chunk
(``mt_parallel.SequenceCrossEntropy``), where the CP transform's hook reaches it. The MTP blocks' MoE auxiliary losses are carried with the last chunk's
(:mod:`mt_parallel.moe.carry`), and each ``mtp_loss_{k}`` reaches every pipeline rank's
metrics (:mod:`mt_train.pipeline_step`). Schedules that put the first and last chunks on one
rank (``zbv``, ``dualpipev``) need no copy: both chunks use the one embedding, whose gradient
accumulates from both (under FSDP2 an FSDP2 unit of its own, reduced once per step after both
chunks' backwards: ``mt_parallel.pipeline.shared_fsdp``).

Counts. ``total`` is every parameter (the aux-loss-free biases are buffers, not counted);
``active`` (:func:`active_parameters`) is what one token uses: all but the ``num_experts -
top_k`` routed experts it skips and the input-embedding lookup (which is not a GEMM; the same
``N`` as ``6·N`` in :func:`flops_per_token`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import mt_comm
import mt_parallel
from mt_parallel.moe import MoE
from mt_train.models.deepseek_v3.config import DeepSeekV3Config
from mt_train.models.llama.parallelize import PLAN
from mt_train.models.moe.model import MoETransformer


def deepseek_plan(cfg: DeepSeekV3Config) -> mt_parallel.ParallelizePlan:
    """Llama's plan; with MTP, a pipeline whose last chunk runs :meth:`DeepSeekV3.predict`
    with the MTP modules and a copy of the input embedding (module docstring)."""
    if not cfg.mtp_depth:
        return PLAN
    layout = dataclasses.replace(
        PLAN.pipeline, last_extra=("mtp", "mtp_cross_entropy"), head="predict",
        last_inputs=("mtp_tokens_BTK", "mtp_targets_BTK"), last_shared=("embed",),
    )  # fmt: skip
    return dataclasses.replace(PLAN, pipeline=layout)


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


class MTPModule(nn.Module):
    """One multi-token-prediction depth (module docstring): norms, projection, block, norm."""

    def __init__(self, cfg: DeepSeekV3Config, depth: int) -> None:
        super().__init__()
        self.embed_norm = mt_parallel.RMSNorm(cfg.dim, cfg.norm_eps)
        self.hidden_norm = mt_parallel.RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = mt_parallel.ReplicatedLinear(2 * cfg.dim, cfg.dim, cfg.init_std)
        self.block = deepseek_block(cfg, cfg.n_layers + depth - 1)
        self.norm = mt_parallel.RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self,
        h_BTD: torch.Tensor,
        e_BTD: torch.Tensor,
        positions_S: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None,
    ) -> torch.Tensor:
        x_BTD = self.proj(torch.cat([self.embed_norm(e_BTD), self.hidden_norm(h_BTD)], dim=-1))
        return self.block(x_BTD, positions_S, document_ids_BT)


class DeepSeekV3(MoETransformer):
    """Embedding → blocks of :func:`deepseek_block` → RMSNorm → output head, plus
    ``mtp_depth`` :class:`MTPModule` s; loss CE + MoE losses + weighted MTP losses."""

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__(cfg, deepseek_block)  # type: ignore[arg-type]
        self.mtp = nn.ModuleList(MTPModule(cfg, k + 1) for k in range(cfg.mtp_depth))
        self._mtp_logits: list[torch.Tensor] = []
        self._mtp_targets_BTK: torch.Tensor | None = None
        self._mtp_documents_BT: torch.Tensor | None = None
        self.mtp_weight = cfg.mtp_weight_at(0)
        """λ of the next training step."""
        self.mtp_cross_entropy = mt_parallel.SequenceCrossEntropy()
        """The MTP losses' whole-sequence mean (module docstring), a module so that under pp
        it sits on the last chunk, where the CP transform gives it the cp group."""

    def set_train_step(self, completed_steps: int) -> bool:
        """Set λ for the step after ``completed_steps``; whether it changed (a captured step
        holds the old value as a constant and must be captured again)."""
        weight = self.cfg.mtp_weight_at(completed_steps)
        changed, self.mtp_weight = weight != self.mtp_weight, weight
        return changed

    @property
    def cp_group(self) -> Any:
        """The cp group under context parallelism (None without)."""
        return self.mtp_cross_entropy.cp_group

    def sequence_inputs(
        self,
        tokens_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """The MTP inputs shifted on the whole sequence (module docstring), keyword inputs of
        :meth:`forward` whose dim 1 is the sequence: the trainer calls this on the whole
        micro-batch and cuts the tensors like the tokens. Empty in evaluation or without MTP."""
        if not (self.training and len(self.mtp)):
            return {}
        depths = len(self.mtp)
        return {
            "mtp_tokens_BTK": shifted_tokens(tokens_BT, depths),
            "mtp_targets_BTK": shifted_targets(targets_BT, depths, document_ids_BT),
        }

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BT: torch.Tensor | None = None,
        mtp_tokens_BTK: torch.Tensor | None = None,
        mtp_targets_BTK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Main logits ``(B, T, V_l)``; in training also each MTP depth's, kept for :meth:`loss`.

        ``mtp_tokens_BTK``/``mtp_targets_BTK``: this rank's part of :meth:`sequence_inputs`
        (required under CP); without them the tokens are shifted here and the targets in
        :meth:`loss`, on the sequence this call holds."""
        if not (self.training and len(self.mtp)):
            return super().forward(tokens_BT, positions_S, document_ids_BT)
        if mtp_tokens_BTK is None:
            self._check_whole_sequence()
            mtp_tokens_BTK = shifted_tokens(tokens_BT, len(self.mtp))
        h_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            h_BTD = layer(h_BTD, positions_S, document_ids_BT)
        return self.predict(h_BTD, positions_S, document_ids_BT, mtp_tokens_BTK, mtp_targets_BTK)

    def predict(
        self,
        h_BTD: torch.Tensor,
        positions_S: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None,
        mtp_tokens_BTK: torch.Tensor | None = None,
        mtp_targets_BTK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Main logits from the last block's output ``h⁰``; given the shifted tokens, also each
        MTP depth's, kept for :meth:`loss` (the pipeline's last chunk runs this: module
        docstring)."""
        self._mtp_logits = []
        if mtp_tokens_BTK is None:
            return self.output(self.norm(h_BTD))
        self._mtp_targets_BTK, self._mtp_documents_BT = mtp_targets_BTK, document_ids_BT
        mtp_h_BTD = h_BTD
        for depth, module in enumerate(self.mtp, start=1):
            e_BTD = self.embed(mtp_tokens_BTK[..., depth - 1])
            mtp_h_BTD = module(mtp_h_BTD, e_BTD, positions_S, document_ids_BT)
            self._mtp_logits.append(self.output(module.norm(mtp_h_BTD)))
        return self.output(self.norm(h_BTD))

    def loss(
        self, logits_BTV_l: torch.Tensor, targets_BT: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``CE + aux + λ/D·Σ_k MTP_k`` in training, ``CE`` in evaluation (module docstring);
        under CP each ``MTP_k`` is this rank's share of the whole sequence's mean."""
        total, logged = super().loss(logits_BTV_l, targets_BT)
        outputs, self._mtp_logits = self._mtp_logits, []
        targets_BTK, self._mtp_targets_BTK = self._mtp_targets_BTK, None
        documents_BT, self._mtp_documents_BT = self._mtp_documents_BT, None
        if not self.training or not outputs:
            return total, logged
        if targets_BTK is None:
            targets_BTK = shifted_targets(targets_BT, len(outputs), documents_BT)
        mtp_sum = total.new_zeros(())
        for depth, mtp_logits_BTV_l in enumerate(outputs, start=1):
            result = self.mtp_cross_entropy(
                mtp_logits_BTV_l, targets_BTK[..., depth - 1], self.output.tp_group
            )
            logged[f"mtp_loss_{depth}"] = result.mean
            mtp_sum = mtp_sum + result.loss
        return total + self.mtp_weight / len(outputs) * mtp_sum, logged

    def _check_whole_sequence(self) -> None:
        cp = 1 if self.cp_group is None else mt_comm.group_size(self.cp_group)
        if cp > 1:
            raise ValueError(
                f"DeepSeekV3 with mtp_depth={len(self.mtp)} under context parallelism (cp={cp}) "
                "needs mtp_tokens_BTK and mtp_targets_BTK shifted on the whole sequence: call "
                "sequence_inputs on the whole micro-batch and cut each tensor with "
                "mt_parallel.shard_sequence(x, 1, cp_group), as mt-train's BatchRunner does"
            )


def shifted_tokens(tokens_BT: torch.Tensor, depths: int) -> torch.Tensor:
    """``t_{i+k}`` at ``[:, i, k-1]`` for ``k = 1..depths`` (wrapped past the end)."""
    return torch.stack([tokens_BT.roll(-k, dims=1) for k in range(1, depths + 1)], dim=-1)


def shifted_targets(
    targets_BT: torch.Tensor, depths: int, document_ids_BT: torch.Tensor | None
) -> torch.Tensor:
    """:func:`mtp_targets` of every depth, stacked on the last dim."""
    return torch.stack(
        [mtp_targets(targets_BT, k, document_ids_BT) for k in range(1, depths + 1)], dim=-1
    )


def mtp_targets(
    targets_BT: torch.Tensor, depth: int, document_ids_BT: torch.Tensor | None
) -> torch.Tensor:
    """``targets[i + depth]`` at ``i``, ``-100`` (ignored) past the end and across documents."""
    shifted_BT = targets_BT.roll(-depth, dims=1).clone()
    shifted_BT[:, targets_BT.shape[1] - depth :] = -100
    if document_ids_BT is not None:
        shifted_BT[document_ids_BT != document_ids_BT.roll(-depth, dims=1)] = -100
    return shifted_BT


def _skipped_expert_params(cfg: DeepSeekV3Config) -> int:
    """Routed-expert parameters one token does not use, over all MoE blocks."""
    one_expert = 3 * cfg.dim * cfg.moe.expert_ffn_dim
    skipped = (cfg.moe.num_experts - cfg.moe.top_k) * one_expert
    return (cfg.n_layers - cfg.first_k_dense) * skipped


def mtp_parameters(model: nn.Module) -> int:
    """Parameters of the MTP modules (counted apart from the main model, as the paper does)."""
    return sum(p.numel() for p in model.mtp.parameters()) if hasattr(model, "mtp") else 0


def active_parameters(model: nn.Module, cfg: DeepSeekV3Config) -> int:
    """Parameters of the main model one token uses, without the input-embedding lookup and
    the MTP modules (module docstring)."""
    total = sum(p.numel() for p in model.parameters()) - mtp_parameters(model)
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
    """Training FLOPs per token: ``6·N_active + 6·(L + D_mtp)·T·H·(E + V)`` (``N_active``
    without the input embedding, with what each MTP depth runs, the shared head included; E =
    nope + rope dims, V = value dims: QKᵀ and AV forward and backward, no causal halving, as
    Llama's ``12·L·D·T``)."""
    assert cfg.vocab_size is not None
    m = cfg.moe
    moe_blocks = cfg.n_layers - cfg.first_k_dense
    used_ffn = 3 * cfg.dim * (m.top_k * m.expert_ffn_dim + m.shared_hidden_dim)
    moe_block = attention_parameters(cfg) + 2 * cfg.dim + used_ffn + cfg.dim * m.num_experts
    n = cfg.n_layers * (attention_parameters(cfg) + 2 * cfg.dim)
    n += cfg.first_k_dense * 3 * cfg.dim * cfg.ffn_dim
    n += moe_blocks * (used_ffn + cfg.dim * m.num_experts)
    n += cfg.dim + cfg.vocab_size * cfg.dim
    # Each MTP depth: two norms, the 2D→D projection, one MoE block, its norm and the head.
    n += cfg.mtp_depth * (
        2 * cfg.dim * cfg.dim + 3 * cfg.dim + moe_block + cfg.vocab_size * cfg.dim
    )
    attention = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 6.0 * n + 6.0 * (cfg.n_layers + cfg.mtp_depth) * seq_len * attention
