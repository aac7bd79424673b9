"""The DeepSeek-V3 family (MLA + MoE; also DeepSeek-V2-Lite): config, model, sizes."""

from mt_train.models.deepseek_v3.config import DeepSeekV3Config
from mt_train.models.deepseek_v3.model import (
    DeepSeekV3,
    MTPModule,
    active_parameters,
    attention_parameters,
    deepseek_block,
    deepseek_plan,
    flops_per_token,
    mtp_parameters,
    mtp_targets,
)
from mt_train.models.deepseek_v3.sizes import SIZES

__all__ = [
    "SIZES",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "MTPModule",
    "active_parameters",
    "attention_parameters",
    "deepseek_block",
    "deepseek_plan",
    "flops_per_token",
    "mtp_parameters",
    "mtp_targets",
]
