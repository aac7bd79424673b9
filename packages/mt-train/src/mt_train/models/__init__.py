"""The Llama model (on mt_parallel's layers), its builder and the transforms applied to it."""

from mt_train.models.build import build_model, parallelize, resolve_vocab
from mt_train.models.llama import (
    Llama,
    LlamaAttention,
    flops_per_token,
    llama_block,
    num_params,
    rope_frequencies,
)

__all__ = [
    "Llama",
    "LlamaAttention",
    "build_model",
    "flops_per_token",
    "llama_block",
    "num_params",
    "parallelize",
    "resolve_vocab",
    "rope_frequencies",
]
