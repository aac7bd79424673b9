"""The Llama family's config: :class:`LlamaConfig` (the ``model`` group's schema for ``model=debug``,
``model=llama3_8b`` ...) and its Llama 3.1 RoPE scaling.

Fields are validated eagerly (``__post_init__``) with messages that name the offending values,
as every config group is; the rules that involve other groups (tensor parallelism dividing the
heads) are :meth:`LlamaConfig.check_parallel`, which :class:`mt_train.config.TrainConfig` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mt_parallel import ParallelConfig
from mt_train.config.schema import ModelConfig, positive


@dataclass
class RopeScalingConfig:
    """Llama 3.1 RoPE frequency scaling; ``factor=1`` turns it off."""

    factor: float = 8.0
    """How much longer than ``original_max_position`` the context may be."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position / high_freq_factor`` are kept."""
    original_max_position: int = 8192
    """Context length the model was pre-trained at before scaling."""

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"model.rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        positive("model.rope_scaling", original_max_position=self.original_max_position)


@dataclass
class LlamaConfig(ModelConfig):
    """A Llama 3 decoder: GQA attention with RoPE, SwiGLU MLP, RMSNorm, untied embeddings."""

    name: str = "debug"
    """Label used in logs and run directories."""
    dim: int = 128
    """Hidden size."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Query heads; ``dim`` must be divisible by it."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int = 384
    """Hidden size of the SwiGLU MLP."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Llama 3.1 long-context frequency scaling."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every matrix (embedding, projections, head)."""
    scaled_residual_init: bool = False
    """Draw the two projections that write into the residual stream (``o_proj``, ``down_proj``)
    with ``init_std / sqrt(2·n_layers)`` (Megatron's output-layer init, GPT-2's scaled init);
    false draws them with ``init_std`` like every other matrix."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(
            "model",
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
        )
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"model head dim {self.dim}/{self.n_heads}={self.dim // self.n_heads} must be "
                "even for RoPE"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check_parallel(self, parallel: ParallelConfig, seq_len: int | None = None) -> None:
        """Heads, KV heads, vocabulary and FFN width divisible by tp; the sequence by cp."""
        parallel.validate_model(
            self.n_heads, self.n_kv_heads, self.vocab_size or parallel.tp, seq_len, self.ffn_dim
        )

    def summary(self) -> str:
        return f"{self.n_layers} layers, width {self.dim}, vocab {self.vocab_size}"
