"""The vision-language family's named sizes: ``model=vlm_tiny`` and ``model=llava_1_5_7b``.

Every key can be overridden (``model=llava_1_5_7b model.n_layers=4 model.vision.n_layers=4``).
"""

from __future__ import annotations

from mt_train.models.llama.config import RopeScalingConfig
from mt_train.models.vlm.config import VisionConfig, VLMConfig

NO_ROPE_SCALING = RopeScalingConfig(factor=1.0)

SIZES: dict[str, VLMConfig] = {
    # Sized for the bundled digits captions on two CPU cores: 8x8 grey images in 4x4 patches
    # (4 image tokens), a 2-block width-64 encoder and a 2-block width-128 Llama decoder over
    # byte tokens plus the image placeholder (id 257; vocabulary 320), dropout 0.1 (1,438
    # training images: 2x2 patches and no dropout overfit to fewer correct held-out captions,
    # packages/mt-train/README.md, "Learning check").
    "vlm_tiny": VLMConfig(
        name="vlm_tiny",
        dropout=0.1,
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=256,
        rope_theta=10000.0,
        rope_scaling=NO_ROPE_SCALING,
        vision=VisionConfig(
            image_size=8, patch_size=4, channels=1, dim=64, n_layers=2, n_heads=4, ffn_dim=128
        ),
    ),
    # LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf): CLIP ViT-L/14 at 336 px (24 blocks, width 1024,
    # 16 heads, MLP 4096, quick GELU, class token, pre- and post-LayerNorm; features of the
    # second-to-last block without the class token: 576 tokens per image), a 1024→4096→4096
    # GELU projector, and Llama-2-7B (32 blocks, width 4096, 32 heads, FFN 11008, RoPE θ 10^4,
    # no scaling) with llava-hf's vocabulary of 32064 and the image token 32000. Its parameter
    # count equals transformers' LlavaForConditionalGeneration of that config (tested).
    "llava_1_5_7b": VLMConfig(
        name="llava_1_5_7b",
        vocab_size=32064,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=NO_ROPE_SCALING,
        image_token_id=32000,
        vision=VisionConfig(
            image_size=336,
            patch_size=14,
            channels=3,
            dim=1024,
            n_layers=24,
            n_heads=16,
            ffn_dim=4096,
            act="quick_gelu",
            cls_token=True,
            pre_norm=True,
            post_norm=True,
            feature_layer=-2,
            feature_select="patch",
        ),
    ),
}
