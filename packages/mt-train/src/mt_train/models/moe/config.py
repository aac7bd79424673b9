"""The MoE family's config: a Llama decoder whose MLPs are Mixture-of-Experts layers.

:class:`MoEModelConfig` extends :class:`~mt_train.models.llama.LlamaConfig` (attention, norms,
RoPE, embeddings are Llama's) with ``moe`` (mt-parallel's :class:`~mt_parallel.moe.MoEConfig`:
routing, balancing, capacity, expert shapes) and ``first_k_dense`` (DeepSeek's dense first
layers, which use ``ffn_dim``). Validation is eager; :meth:`MoEModelConfig.check_parallel` adds
the expert-parallel rules to Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mt_parallel import ParallelConfig
from mt_parallel.moe import MoEConfig
from mt_train.models.llama.config import LlamaConfig


@dataclass
class MoEModelConfig(LlamaConfig):
    """A Llama decoder with MoE feed-forward layers (module docstring)."""

    name: str = "mixtral_tiny"
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing, balancing, capacity and expert shapes of every MoE layer."""
    first_k_dense: int = 0
    """The first ``k`` blocks keep a dense SwiGLU MLP of ``ffn_dim`` (DeepSeek: 1..3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.first_k_dense < self.n_layers:
            raise ValueError(
                f"model.first_k_dense={self.first_k_dense} must be in [0, model.n_layers="
                f"{self.n_layers}) (at least one MoE layer)"
            )

    def check_parallel(self, parallel: ParallelConfig, seq_len: int | None = None) -> None:
        """Llama's rules and the ep degree dividing the experts."""
        super().check_parallel(parallel, seq_len)
        self.moe.check_expert_parallel(parallel.ep)

    def summary(self) -> str:
        m = self.moe
        shared = f" + {m.n_shared_experts} shared" if m.n_shared_experts else ""
        return (
            f"{self.n_layers} layers, width {self.dim}, {m.num_experts} experts top-{m.top_k}"
            f"{shared} (FFN {m.expert_ffn_dim}), {m.balancing}, vocab {self.vocab_size}"
        )
