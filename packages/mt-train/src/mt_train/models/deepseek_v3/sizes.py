"""The DeepSeek-V3 family's named sizes: the ``model=<name>`` options of ``mt-train``.

Every key can be overridden (``model=deepseek_v3_tiny model.moe.top_k=2``). The published
shapes are those of the Hugging Face ``config.json`` files of deepseek-ai/DeepSeek-V3 and
deepseek-ai/DeepSeek-V2-Lite; their parameter counts are asserted in the tests
(docs/architecture.md states the counting convention).
"""

from __future__ import annotations

from mt_parallel import YarnConfig
from mt_parallel.moe import MoEConfig
from mt_train.models.deepseek_v3.config import DeepSeekV3Config

DEEPSEEK_YARN = {"factor": 40.0, "original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0}

SIZES: dict[str, DeepSeekV3Config] = {
    # A small DeepSeek-V3 for the bundled corpus on a CPU: MLA with query compression, 16
    # fine-grained experts of FFN 64 (top-4 from 2 of 4 groups, sigmoid scores, normalised and
    # scaled by 2.5), one shared expert, aux-loss-free balancing, one dense first block, MTP
    # depth 1 (λ 0.3). γ = 1e-2
    # (V3: 1e-3) so the bias moves within a short run, as deepseek_moe_tiny.
    "deepseek_v3_tiny": DeepSeekV3Config(
        name="deepseek_v3_tiny", dim=128, n_layers=4, n_heads=4, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=384,
        first_k_dense=1,
        moe=MoEConfig(
            num_experts=16, top_k=4, expert_ffn_dim=64, score_function="sigmoid",
            routed_scaling_factor=2.5, n_group=4, topk_group=2, balancing="aux_free",
            bias_update_rate=1e-2, n_shared_experts=1,
        ),
        mtp_depth=1,
    ),
    # DeepSeek-V2-Lite: 27 layers, width 2048, 16 heads without query compression, kv-lora 512,
    # 64 routed experts (FFN 1408, top-6, softmax, weights not renormalised) + 2 shared, one
    # dense first block (FFN 10944), vocab 102400, YaRN 40 with mscale 0.707.
    "deepseek_v2_lite": DeepSeekV3Config(
        name="deepseek_v2_lite", vocab_size=102400, dim=2048, n_layers=27, n_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, ffn_dim=10944, first_k_dense=1,
        yarn=YarnConfig(**DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707),
        moe=MoEConfig(
            num_experts=64, top_k=6, expert_ffn_dim=1408, score_function="softmax",
            normalize_weights=False, balancing="aux_loss", aux_loss_coeff=1e-3,
            n_shared_experts=2,
        ),
    ),
    # DeepSeek-V3 (671B): 61 layers, width 7168, 128 heads, q-lora 1536, kv-lora 512, 256
    # routed experts (FFN 2048, top-8 from 4 of 8 groups, sigmoid, ×2.5) + 1 shared, 3 dense
    # blocks (FFN 18432), vocab 129280, YaRN 40 with mscale 1, aux-loss-free balancing, one MTP
    # module.
    "deepseek_v3_671b": DeepSeekV3Config(
        name="deepseek_v3_671b", vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, ffn_dim=18432, first_k_dense=3,
        yarn=YarnConfig(**DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEConfig(
            num_experts=256, top_k=8, expert_ffn_dim=2048, score_function="sigmoid",
            routed_scaling_factor=2.5, n_group=8, topk_group=4, balancing="aux_free",
            bias_update_rate=1e-3, n_shared_experts=1,
        ),
        mtp_depth=1,
    ),
}  # fmt: skip
