"""The Llama 3 model, assembled from mt_parallel's layers.

Shape suffixes: B batch, T/S sequence, D model width, H query heads, K key/value heads,
d head dim (D / H), F FFN width, V vocabulary (``V_l`` the local slice under TP).

Math, per block (mt_parallel's :class:`~mt_parallel.DecoderBlock`, pre-norm; ``drop`` is
dropout with ``model.dropout``, also applied to the attention probabilities)::

    h = x + drop(o_proj(Attn(RoPE(q_proj·n1(x)), RoPE(k_proj·n1(x)), v_proj·n1(x))))   n1 = RMSNorm
    y = h + drop(down_proj(silu(gate_proj·n2(h)) ⊙ up_proj·n2(h)))                     SwiGLU

Attention is causal grouped-query attention (query head ``h`` reads KV head ``h // (H/K)``);
with document ids (packed sequences, ``data.document_masking``) query ``i`` sees key ``j``
only if ``j ≤ i`` and both lie in the same document. RoPE uses the rotate-half layout (the
Hugging Face one): the pair ``(x_i, x_{i+d/2})`` at position ``p`` is rotated by ``p·f_i``,
``f_i = θ^(-2i/d)``, θ = 500000, with Llama 3.1 scaling: wavelength ``λ = 2π/f``;
``λ < L0/high`` keeps ``f``; ``λ > L0/low`` uses ``f/factor``; in between
``(1-s)·f/factor + s·f`` with ``s = (L0/λ - low)/(high - low)`` (``L0`` =
``original_max_position``). Frequencies and angles are float64, then cast.

The only layer this family adds to mt_parallel's is :class:`LlamaAttention`, whose
:meth:`~LlamaAttention.rope_tables` gives those scaled frequencies (mt_parallel's uses plain
θ); everything else (column/row-parallel projections, the fused RoPE rotation, RMSNorm,
SwiGLU, dropout regions, the context-parallel core) is mt_parallel's, so its transforms
(tensor/sequence/context parallel, FP8, recompute, data parallel) apply unchanged. Each block
is built once from its parts (:func:`llama_block`).
Embeddings are untied: ``embed`` (vocab-parallel) and ``output`` (column-parallel, logits
sharded over the vocabulary under TP) are separate matrices. ``block_factory`` is the one
swappable piece: any module with ``forward(x_BTD, positions_S, document_ids_BT)`` works.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

import mt_parallel
from mt_train.models.llama.config import LlamaConfig, RopeScalingConfig


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


class LlamaAttention(mt_parallel.Attention):
    """mt_parallel's GQA attention with Llama 3.1 scaled RoPE frequencies.

    Only the tables change: the projections, the fused rotation of q and k
    (``mt_fp8.ops.apply_rotary``), document masking and the context-parallel core are
    :class:`mt_parallel.Attention`'s.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(
            cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.dropout, cfg.n_layers,
            cfg.init_std,
        )  # fmt: skip
        freqs = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq_P", freqs, persistent=False)

    def rope_tables(
        self, positions_S: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_SP``, ``sin_SP`` (``P = d/2``) of ``p·f_i``, angles in float64, then cast
        (``(B, S, P)`` for per-row positions ``(B, S)``)."""
        inv_freq_P = self.inv_freq_P.to(positions_S.device)
        angles_SP = positions_S.to(torch.float64)[..., None] * inv_freq_P
        return angles_SP.cos().to(dtype), angles_SP.sin().to(dtype)


def llama_block(cfg: LlamaConfig, layer_id: int) -> nn.Module:
    """mt_parallel's pre-norm DecoderBlock around a :class:`LlamaAttention` and a SwiGLU MLP;
    the residual output projections drawn with ``init_std`` unless ``cfg.scaled_residual_init``."""
    attention = LlamaAttention(cfg)
    mlp = mt_parallel.MLP(cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.init_std)
    if not cfg.scaled_residual_init:
        attention.o_proj.init_std = mlp.down_proj.init_std = cfg.init_std
    return mt_parallel.DecoderBlock(attention, mlp, cfg.dim, cfg.norm_eps, cfg.dropout)


BlockFactory = Callable[[LlamaConfig, int], nn.Module]


class Llama(nn.Module):
    """Vocab-parallel embedding → ``n_layers`` blocks → RMSNorm → column-parallel output."""

    def __init__(self, cfg: LlamaConfig, block_factory: BlockFactory = llama_block) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size must be resolved (from the tokenizer) before building"
            )
        self.cfg = cfg
        self.embed = mt_parallel.VocabParallelEmbedding(
            cfg.vocab_size, cfg.dim, init_std=cfg.init_std
        )
        self.layers = nn.ModuleList(block_factory(cfg, i) for i in range(cfg.n_layers))
        self.norm = mt_parallel.RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = mt_parallel.ColumnParallelLinear(
            cfg.dim, cfg.vocab_size, bias=False, init_std=cfg.init_std
        )

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, V_l)``: this rank's vocabulary slice (all of it at tp=1).

        ``positions_S``: the tokens' global positions (needed under CP, where a rank holds
        two separated chunks); ``document_ids_BT``: per-token document ids of packed
        sequences, so attention stays inside each document (sharded like the tokens).
        """
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_S, document_ids_BT)
        return self.output(self.norm(x_BTD))

    def loss(self, logits_BTV_l: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, vocab-parallel over the output's TP group (fp32)."""
        return mt_parallel.vocab_parallel_cross_entropy(
            logits_BTV_l, targets_BT, self.output.tp_group
        )


def embedding_parameters(model: nn.Module) -> int:
    """The input embedding's parameters (a lookup, not a GEMM: excluded from ``6·N``)."""
    return model.embed.weight.numel() if isinstance(model, Llama) else 0


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
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
