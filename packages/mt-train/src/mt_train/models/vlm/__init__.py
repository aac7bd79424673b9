"""The LLaVA-style vision-language family: ViT encoder, projector, Llama decoder."""

from mt_train.models.vlm.config import VisionConfig, VLMConfig
from mt_train.models.vlm.hf import LlavaHF
from mt_train.models.vlm.model import IGNORE_INDEX, Projector, VisionLanguageModel
from mt_train.models.vlm.parallelize import vlm_plan
from mt_train.models.vlm.sizes import SIZES
from mt_train.models.vlm.vision import VisionBlock, VisionTransformer

__all__ = [
    "IGNORE_INDEX",
    "SIZES",
    "LlavaHF",
    "Projector",
    "VLMConfig",
    "VisionBlock",
    "VisionConfig",
    "VisionLanguageModel",
    "VisionTransformer",
    "vlm_plan",
]
