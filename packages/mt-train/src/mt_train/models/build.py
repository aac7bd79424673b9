"""Build the Llama for a run and apply the configured transforms, in the documented order.

Order (torchtitan's): tensor parallel → FP8 → activation recompute → torch.compile → data
parallel. Each step is a function of the plain model, so the model code never changes:

* tensor parallel comes from ``mt_parallel`` once it exports it; until then ``tp > 1`` is
  refused with an error saying so;
* FP8 swaps each block's ``nn.Linear`` for ``mt_fp8.FP8Linear`` (same parameters) when both
  features are ≥ ``fp8.min_features``; embeddings and the output head stay high precision;
* recompute wraps each block's forward in non-reentrant ``torch.utils.checkpoint``;
* compile compiles each block separately (short compile times, one graph per block shape);
* data parallelism is the trainer's gradient all-reduce over the dp group
  (:mod:`mt_train.distributed`), so gradient accumulation needs no ``no_sync`` tricks and
  the reduction order, hence the numbers, do not depend on bucket timing.

``vocab_size: null`` resolves to the tokenizer's size rounded up to a multiple of 64.
Building on ``device="meta"`` allocates nothing, which is how the large configs are checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils.checkpoint as activation_checkpoint
from torch import nn

import mt_fp8
from mt_train.config.schema import FP8Config, ModelConfig, ParallelConfig
from mt_train.models.llama import Llama, TransformerBlock


def resolve_vocab(cfg: ModelConfig, tokenizer_vocab: int) -> ModelConfig:
    """``cfg`` with ``vocab_size`` set; raises if a fixed vocab is smaller than the tokenizer's."""
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=(tokenizer_vocab + 63) // 64 * 64)
    if cfg.vocab_size < tokenizer_vocab:
        raise ValueError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids"
        )
    return cfg


def build_model(cfg: ModelConfig, max_seq_len: int, device: torch.device | str, seed: int) -> Llama:
    """The plain Llama on ``device``, initialised from ``seed`` (not initialised on meta)."""
    device = torch.device(device)
    with torch.device(device):
        model = Llama(cfg, max_seq_len, block_factory=TransformerBlock)
    if device.type != "meta":
        generator = torch.Generator(device=device).manual_seed(seed)
        model.init_weights(generator)
    return model


def apply_tensor_parallel(model: Llama, parallel: ParallelConfig) -> None:
    if parallel.tp == 1:
        return
    raise NotImplementedError(
        f"parallel.tp={parallel.tp} needs mt_parallel's tensor-parallel Llama layers, which the "
        f"installed mt_parallel {getattr(__import__('mt_parallel'), '__version__', '?')} does "
        "not export yet; use parallel.tp=1"
    )


def apply_fp8(model: Llama, fp8: FP8Config) -> int:
    """Swap the blocks' linears for FP8Linear; returns how many were swapped."""
    if not fp8.enabled:
        return 0
    fp8_linear: Any = getattr(mt_fp8, "FP8Linear", None)
    if fp8_linear is None:
        raise NotImplementedError(
            f"fp8.recipe={fp8.recipe!r} needs mt_fp8.FP8Linear, which the installed mt_fp8 does "
            "not export yet; use fp8=none"
        )
    recipe = mt_fp8.recipe_from_name(fp8.recipe, **dict(fp8.recipe_args))
    swapped = 0
    for block in model.layers:
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and min(child.in_features, child.out_features) >= max(
                    fp8.min_features, 16
                ):
                    setattr(
                        parent,
                        name,
                        fp8_linear.from_linear(child, recipe=recipe, backend=fp8.backend),
                    )
                    swapped += 1
    return swapped


class _Recompute(nn.Module):
    """Runs the wrapped block under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> torch.Tensor:
        return activation_checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def apply_recompute(model: Llama, enabled: bool) -> None:
    if enabled:
        for i, block in enumerate(model.layers):
            model.layers[i] = _Recompute(block)


def apply_compile(model: Llama, enabled: bool) -> None:
    if enabled:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)


def unwrap_state_dict_key(key: str) -> str:
    """Parameter names without the wrappers' prefixes (``_orig_mod.``, ``block.``)."""
    return key.replace("._orig_mod", "").replace(".block.", ".")
