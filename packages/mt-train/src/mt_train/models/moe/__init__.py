"""The MoE family (Mixtral, DeepSeek-MoE style): config, model, plan, sizes."""

from mt_train.models.moe.config import MoEModelConfig
from mt_train.models.moe.model import (
    MoETransformer,
    active_parameters,
    flops_per_token,
    moe_block,
)
from mt_train.models.moe.parallelize import moe_plan
from mt_train.models.moe.sizes import SIZES

__all__ = [
    "SIZES",
    "MoEModelConfig",
    "MoETransformer",
    "active_parameters",
    "flops_per_token",
    "moe_block",
    "moe_plan",
]
