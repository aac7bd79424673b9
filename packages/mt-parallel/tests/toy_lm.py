"""A small decoder language model built from mt-parallel's layers, for the tests.

mt-parallel ships layers and transforms, not models: this is what a model family's builder looks
like at its smallest. Embedding (vocab-parallel) → ``num_layers`` pre-norm
:class:`~mt_parallel.DecoderBlock` s (GQA :class:`~mt_parallel.Attention` with plain RoPE, SwiGLU
:class:`~mt_parallel.MLP`) → RMSNorm → column-parallel LM head. ``forward`` returns the local
vocabulary slice of the logits ``(B, S, V/tp)`` and :meth:`DecoderLM.loss` the cross-entropy
(vocab-parallel under TP). With ``moe`` the MLPs are :class:`mt_parallel.moe.MoE` layers and the
training loss adds their auxiliary losses (:func:`mt_parallel.moe.collect_aux_losses`), as
mt-train's MoE family does. :data:`PLAN` is its :class:`~mt_parallel.ParallelizePlan`.

:class:`NextTokenLM` adds to the head what DeepSeek-V3's multi-token prediction does there: it
embeds the next input token with the input embedding, ``logits = lm_head(norm(h + Emb(t_{i+1})))``,
so under pipeline parallelism the last stage runs the first stage's embedding
(:data:`SHARED_PLAN`: the layout's ``head``, ``last_inputs`` and ``last_shared``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import mt_parallel as mp


class DecoderLM(nn.Module):
    """Embedding, ``num_layers`` decoder blocks, final norm, vocab-parallel LM head."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        ffn_dim: int,
        dropout: float = 0.0,
        moe: mp.moe.MoEConfig | None = None,
    ) -> None:
        super().__init__()
        self.embed = mp.VocabParallelEmbedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            mp.DecoderBlock(
                mp.Attention(dim, num_heads, num_kv_heads, dropout=dropout, num_layers=num_layers),
                mp.moe.MoE(dim, moe, num_layers) if moe else mp.MLP(dim, ffn_dim, num_layers),
                dim,
                dropout=dropout,
            )
            for _ in range(num_layers)
        )
        self.norm = mp.RMSNorm(dim)
        self.lm_head = mp.ColumnParallelLinear(
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
        """Mean cross-entropy over this rank's tokens (vocab-parallel over the TP group), plus
        the MoE layers' auxiliary losses still held in training."""
        ce = mp.vocab_parallel_cross_entropy(logits_BSV_l, targets_BS, self.lm_head.tp_group)
        aux, _ = mp.moe.collect_aux_losses(self)
        return ce + aux if aux is not None and self.training else ce


PLAN = mp.ParallelizePlan(
    block_types=(mp.DecoderBlock,),
    output_head="lm_head",
    pipeline=mp.PipelineLayout("embed", "layers", ("norm", "lm_head")),
)


class NextTokenLM(DecoderLM):
    """:class:`DecoderLM` whose head also embeds the next input token (module docstring)."""

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        next_tokens_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_S, document_ids_BS)
        assert next_tokens_BT is not None
        return self.head(x_BTD, positions_S, document_ids_BS, next_tokens_BT)

    def head(
        self,
        x_BTD: torch.Tensor,
        positions_S: torch.Tensor | None,
        document_ids_BS: torch.Tensor | None,
        next_tokens_BT: torch.Tensor,
    ) -> torch.Tensor:
        return self.lm_head(self.norm(x_BTD + self.embed(next_tokens_BT)))


SHARED_PLAN = mp.ParallelizePlan(
    block_types=(mp.DecoderBlock,),
    output_head="lm_head",
    pipeline=mp.PipelineLayout(
        "embed", "layers", ("norm", "lm_head"), head="head", last_inputs=("next_tokens_BT",),
        last_shared=("embed",),
    ),
)  # fmt: skip
