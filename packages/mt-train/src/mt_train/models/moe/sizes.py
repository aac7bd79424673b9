"""The MoE family's named sizes: the ``model=<name>`` options of ``mt-train``.

Every key can be overridden (``model=mixtral_tiny model.moe.top_k=1``).
"""

from __future__ import annotations

from mt_parallel.moe import MoEConfig
from mt_train.models.llama.config import RopeScalingConfig
from mt_train.models.moe.config import MoEModelConfig

NO_ROPE_SCALING = RopeScalingConfig(factor=1.0)

SIZES: dict[str, MoEModelConfig] = {
    # A small Mixtral-style model for the bundled corpus on a CPU: the debug Llama's attention
    # (4 layers, width 128, GQA 4:2) with 8 experts of FFN 192, top-2 (the active FFN width is
    # the debug model's 384), softmax routing and the Switch auxiliary loss.
    "mixtral_tiny": MoEModelConfig(
        name="mixtral_tiny", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
        rope_theta=1e6, rope_scaling=NO_ROPE_SCALING,
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=192, balancing="aux_loss"),
    ),
    # Mixtral-8x7B shapes (Mistral's published config): 32 layers, width 4096, 32 query / 8 KV
    # heads, 8 experts of FFN 14336, top-2, vocab 32000, RoPE θ 1e6, untied embeddings:
    # 46,702,792,704 parameters, 12,879,925,248 active per token.
    "mixtral_8x7b": MoEModelConfig(
        name="mixtral_8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim=14336, rope_theta=1e6, rope_scaling=NO_ROPE_SCALING,
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=14336, balancing="aux_loss"),
    ),
    # A small DeepSeek-MoE-style model: fine-grained experts (16 of FFN 64, top-4 from 2 of 4
    # groups), one shared expert, sigmoid scores with normalised weights, aux-loss-free
    # balancing, a dense first layer; Llama attention (MLA is not implemented). γ = 1e-2, not
    # DeepSeek-V3's 1e-3: a run this short needs the bias to move faster (README, MoE models).
    "deepseek_moe_tiny": MoEModelConfig(
        name="deepseek_moe_tiny", dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384,
        rope_theta=1e4, rope_scaling=NO_ROPE_SCALING, first_k_dense=1,
        moe=MoEConfig(
            num_experts=16, top_k=4, expert_ffn_dim=64, score_function="sigmoid",
            n_group=4, topk_group=2, balancing="aux_free", bias_update_rate=1e-2,
            n_shared_experts=1,
        ),
    ),
}  # fmt: skip
