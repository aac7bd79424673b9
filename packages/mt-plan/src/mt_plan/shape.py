"""A model as the planner sees it: shapes only, pure Python (no torch, no mt_train import).

:func:`mt_plan.models.shape_of` turns any ``model=`` config of mt-train into a
:class:`ModelShape`; everything here is arithmetic on its fields.

Parameter counts (tp=1, every parameter of the main model; the trainer's counting convention):

* GQA attention (Llama, MoE): ``D·hd·(2H + 2H_kv)`` (q, k, v, o), all split over tp.
* MLA attention (DeepSeek-V3): ``D·q_r + q_r`` (replicated) ``+ q_r·H·E`` (tp) or ``D·H·E`` (tp)
  without a query LoRA; ``D·(kv_r + rope) + kv_r`` (replicated) ``+ kv_r·H·(nope + v)`` (tp);
  ``H·v·D`` (tp), with ``E = nope + rope``.
* Dense SwiGLU MLP ``3·D·F`` (tp); an MoE layer: router ``D·E_n`` (replicated, fp32), routed
  experts ``E_n·3·D·F_e`` (split over ep, replicated over tp: mt-parallel does not TP-shard
  routed experts), shared experts ``3·D·F_s`` (tp).
* Two RMSNorm gains per block (replicated), a final norm, the input embedding and the output
  head ``V·D`` each (vocabulary split over tp).
* ``extra_params``: what a family adds outside the decoder (the VLM's vision tower and
  projector), replicated in this model.

FLOPs per token follow each family's ``flops_per_token`` (``6·N_active`` without the input
embedding plus the non-causal attention term), so MFU here equals the trainer's MFU; a test holds
:meth:`ModelShape.flops_per_token` to the families' functions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The shapes of one model (module docstring); ``num_experts == 0`` is a dense model."""

    name: str
    family: str
    n_layers: int
    dim: int
    vocab_size: int
    n_heads: int
    ffn_dim: int
    n_kv_heads: int = 0
    head_dim: int = 0
    attention: str = "gqa"
    """``gqa`` (Llama) or ``mla`` (DeepSeek-V3's multi-head latent attention)."""
    q_lora_rank: int = 0
    """0: no query LoRA."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    """Hidden width of the one MLP holding every shared expert (0: none)."""
    first_k_dense: int = 0
    mtp_depth: int = 0
    blocks_before: int = 0
    """Blocks of the runtime's full-recompute types that come before the decoder's when the
    whole model is parallelized at once (pp = 1): the VLM's vision blocks, which
    ``recompute_every`` counts too (:meth:`mt_plan.cost.CostModel.recomputed_layers`)."""
    extra_params: int = 0
    extra_flops_per_token: float = 0.0
    tp_divides: tuple[tuple[str, int], ...] = ()
    """(name, value) pairs tensor parallelism must divide (the family's check_parallel)."""
    supports_pp: bool = True
    supports_cp: bool = True
    dropout: float = 0.0
    """``model.dropout``: ring context parallelism refuses it (no attention dropout there)."""

    # -- per-layer parameter counts -----------------------------------------------------------

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense if self.moe else 0

    @property
    def qk_dim(self) -> int:
        """Query/key width per head of the attention core."""
        return (
            self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.attention == "mla"
            else self.head_dim
        )

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    def attention_params(self) -> tuple[int, int]:
        """(tp-split, replicated) parameters of one attention layer (norm gains excluded)."""
        D, H = self.dim, self.n_heads
        if self.attention == "gqa":
            return D * self.head_dim * (2 * H + 2 * self.n_kv_heads), 0
        E = self.qk_nope_head_dim + self.qk_rope_head_dim
        split = H * self.v_head_dim * D + self.kv_lora_rank * H * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        replicated = D * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        if self.q_lora_rank:
            split += self.q_lora_rank * H * E
            replicated += D * self.q_lora_rank + self.q_lora_rank
        else:
            split += D * H * E
        return split, replicated

    def mlp_params(self, layer: int) -> tuple[int, int, int]:
        """(tp-split, replicated, routed-expert) parameters of layer ``layer``'s feed-forward."""
        D = self.dim
        if not self.moe or layer < self.first_k_dense:
            return 3 * D * self.ffn_dim, 0, 0
        return (
            3 * D * self.shared_ffn_dim,
            D * self.num_experts,
            self.num_experts * 3 * D * self.expert_ffn_dim,
        )

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def mtp_params(self) -> int:
        """Own parameters of the MTP modules (the head and embedding are shared)."""
        if not self.mtp_depth:
            return 0
        split, rep = self.attention_params()
        mlp_split, mlp_rep, experts = self.mlp_params(self.n_layers - 1)
        block = split + rep + 2 * self.dim + mlp_split + mlp_rep + experts
        return self.mtp_depth * (2 * self.dim * self.dim + 3 * self.dim + block)

    def total_params(self) -> int:
        """Every parameter of the main model (the MTP modules not counted, as the trainer)."""
        split, rep = self.attention_params()
        n = self.n_layers * (split + rep + 2 * self.dim)
        n += sum(sum(self.mlp_params(layer)) for layer in range(self.n_layers))
        return n + self.dim + 2 * self.embedding_params() + self.extra_params

    def active_params(self) -> int:
        """Parameters one token uses, without the input embedding (the ``N`` of ``6·N``)."""
        skipped = (
            self.moe_layers * (self.num_experts - self.top_k) * 3 * self.dim * self.expert_ffn_dim
        )
        return self.total_params() - skipped - self.embedding_params() - self.extra_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as the family's ``flops_per_token`` counts them."""
        if self.attention == "mla":
            attention = self.n_heads * (self.qk_dim + self.v_head_dim)
            n = self.active_params()
            if self.mtp_depth:
                n += self.mtp_params() - self.mtp_depth * (
                    (self.num_experts - self.top_k) * 3 * self.dim * self.expert_ffn_dim
                )
                n += self.mtp_depth * self.vocab_size * self.dim
            return 6.0 * n + 6.0 * (self.n_layers + self.mtp_depth) * seq_len * attention
        return (
            6.0 * self.active_params()
            + 12.0 * self.n_layers * self.dim * seq_len
            + self.extra_flops_per_token
        )
