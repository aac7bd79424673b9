"""The Llama model, its builder and the transforms applied to it."""

from mt_train.models.build import apply_fp8, build_model, resolve_vocab
from mt_train.models.llama import (
    Attention,
    FeedForward,
    Llama,
    RMSNorm,
    TransformerBlock,
    flops_per_token,
    num_params,
    rope_frequencies,
)

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "RMSNorm",
    "TransformerBlock",
    "apply_fp8",
    "build_model",
    "flops_per_token",
    "num_params",
    "resolve_vocab",
    "rope_frequencies",
]
