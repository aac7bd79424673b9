"""The DeepSeek-V3 family's config: MLA attention, YaRN, MoE feed-forward layers.

:class:`DeepSeekV3Config` is the ``model`` group's schema for ``model=deepseek_v3_tiny``,
``deepseek_v2_lite`` and ``deepseek_v3_671b``. Attention shapes follow Hugging Face's
``DeepseekV3Config`` (``q_lora_rank`` null for no query compression, as in V2-Lite); ``yarn``
is mt-parallel's :class:`~mt_parallel.YarnConfig` and ``moe`` its
:class:`~mt_parallel.moe.MoEConfig`. Validation is eager; the rules that involve the parallel
layout are :meth:`DeepSeekV3Config.check_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mt_parallel import ParallelConfig, YarnConfig
from mt_parallel.moe import MoEConfig
from mt_train.config.schema import ModelConfig, positive


@dataclass
class DeepSeekV3Config(ModelConfig):
    """A DeepSeek-V2/V3 decoder: MLA, dense first blocks, then MoE blocks (module docstring)."""

    name: str = "deepseek_v3_tiny"
    dim: int = 128
    """Hidden size."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads."""
    q_lora_rank: int | None = 64
    """Rank of the query compression (null: a full-rank query projection, V2-Lite)."""
    kv_lora_rank: int = 32
    """Rank of the joint key/value compression (the latent a KV cache holds)."""
    qk_nope_head_dim: int = 32
    """Per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 16
    """Per-head query dims with RoPE, and the width of the one rotary key all heads share."""
    v_head_dim: int = 32
    """Per-head value dims."""
    ffn_dim: int = 384
    """Hidden size of the dense SwiGLU MLP of the first ``first_k_dense`` blocks."""
    first_k_dense: int = 1
    """Blocks with a dense MLP before the MoE blocks (V3: 3, V2-Lite: 1)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (the latent norms included)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    yarn: YarnConfig = field(default_factory=YarnConfig)
    """YaRN scaling of the rotary frequencies and the softmax scale (factor 1: off)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing, balancing and expert shapes of every MoE block."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every matrix."""
    scaled_residual_init: bool = False
    """Draw ``o_proj`` and ``down_proj`` with ``init_std / sqrt(2·n_layers)``."""
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3: 1); module ``k`` predicts token ``i+k+1``."""
    mtp_loss_weight: float = 0.3
    """λ of the training loss ``CE + aux + λ/mtp_depth · Σ_k MTP_k`` (V3: 0.3, later 0.1)."""
    mtp_loss_weight_switch_step: int | None = None
    """With a step ``N``: λ is ``mtp_loss_weight`` for the first ``N`` optimizer steps and
    ``mtp_loss_weight_final`` after them (V3: 0.3 for its first 10T of 14.8T tokens, then 0.1);
    None: λ stays constant."""
    mtp_loss_weight_final: float = 0.1
    """λ after ``mtp_loss_weight_switch_step``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(
            "model", dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            ffn_dim=self.ffn_dim,
        )  # fmt: skip
        if self.q_lora_rank is not None:
            positive("model", q_lora_rank=self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE)")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(f"model.mtp_depth={self.mtp_depth!r} must be an integer >= 0")
        if not self.mtp_loss_weight >= 0:
            raise ValueError(f"model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        if not self.mtp_loss_weight_final >= 0:
            raise ValueError(
                f"model.mtp_loss_weight_final={self.mtp_loss_weight_final} must be >= 0"
            )
        switch = self.mtp_loss_weight_switch_step
        if switch is not None and (not isinstance(switch, int) or switch < 0):
            raise ValueError(
                f"model.mtp_loss_weight_switch_step={switch!r} must be null or an integer >= 0"
            )
        if not 0 <= self.first_k_dense < self.n_layers:
            raise ValueError(
                f"model.first_k_dense={self.first_k_dense} must be in [0, model.n_layers="
                f"{self.n_layers}) (at least one MoE block)"
            )

    def mtp_weight_at(self, completed_steps: int) -> float:
        """λ of the step after ``completed_steps`` optimizer steps (the switch, if set)."""
        switch = self.mtp_loss_weight_switch_step
        if switch is not None and completed_steps >= switch:
            return self.mtp_loss_weight_final
        return self.mtp_loss_weight

    def check_parallel(self, parallel: ParallelConfig, seq_len: int | None = None) -> None:
        """Vocabulary, heads and MLP widths divisible by tp; experts by ep."""
        super().check_parallel(parallel, seq_len)
        widths = {"n_heads": self.n_heads, "ffn_dim": self.ffn_dim}
        if self.moe.n_shared_experts:
            widths["moe shared expert width"] = self.moe.shared_hidden_dim
        for name, value in widths.items():
            if value % parallel.tp:
                raise ValueError(
                    f"tensor parallel size tp={parallel.tp} does not divide {name}={value}"
                )
        self.moe.check_expert_parallel(parallel.ep)

    def summary(self) -> str:
        m = self.moe
        q = "no q-lora" if self.q_lora_rank is None else f"q-lora {self.q_lora_rank}"
        return (
            f"{self.n_layers} layers, width {self.dim}, MLA {self.n_heads} heads ({q}, kv-lora "
            f"{self.kv_lora_rank}), {m.num_experts} experts top-{m.top_k} + "
            f"{m.n_shared_experts} shared, {self.first_k_dense} dense, MTP depth "
            f"{self.mtp_depth}, vocab {self.vocab_size}"
        )
