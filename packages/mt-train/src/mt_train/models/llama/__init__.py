"""The Llama 3 family: config, model, parallelize plan, named sizes, Hugging Face adapter."""

from mt_train.models.llama.config import LlamaConfig, RopeScalingConfig
from mt_train.models.llama.hf import LlamaHF
from mt_train.models.llama.model import (
    Llama,
    LlamaAttention,
    embedding_parameters,
    flops_per_token,
    llama_block,
    rope_frequencies,
)
from mt_train.models.llama.parallelize import PLAN, llama_plan
from mt_train.models.llama.sizes import SIZES

__all__ = [
    "PLAN",
    "SIZES",
    "Llama",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaHF",
    "RopeScalingConfig",
    "embedding_parameters",
    "flops_per_token",
    "llama_block",
    "llama_plan",
    "rope_frequencies",
]
