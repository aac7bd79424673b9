"""Build the Llama for a run and apply mt_parallel's transforms, in the documented order.

Order (mt_parallel's and torchtitan's): tensor parallel → context parallel → FP8 →
recompute → compile → data parallel. Each is a function of the plain model, so the model code
never changes:

* tensor (and sequence) parallel: ``mt_parallel.apply_tensor_parallel`` shards the full
  weights of every TP layer; parameters are replaced, so the optimizer is built afterwards;
* context parallel (``parallel.cp > 1``): ``mt_parallel.apply_context_parallel`` gives every
  attention core the cp group (all-gather K/V, or ring attention with
  ``parallel.cp_attention=ring``); the trainer feeds each rank its load-balanced chunks;
* FP8: ``mt_parallel.apply_fp8`` routes the blocks' TP linears through ``mt_fp8.FP8Linear``
  with the configured recipe; the output head (unless ``fp8.output_head``), and linears whose
  smaller side is below ``fp8.min_features``, stay high precision (FP8 pays only on large GEMMs);
  the blocks run the GEMMs of ``fp8.gemms`` (default all three) in FP8; an FP8 head runs the GEMMs of ``fp8.output_head_gemms`` in FP8 and the others in bf16;
* recompute: ``mt_parallel.apply_recompute`` with the ``parallel.recompute`` policy;
* compile: ``module.compile()`` on each block (``trainer.compile`` or ``parallel.compile``);
* data parallel: ``mt_parallel.apply_data_parallel`` over dp×cp: DDP (``ddp``), FSDP2
  ``fully_shard`` of every block and the root (``fsdp``: parameters become DTensors sharded
  along dim 0), or nothing (``zero1``, ``none``: the optimizer or the trainer reduces).

Weights are initialised with ``mt_parallel.init_weights(model, seed)`` before any transform:
each module draws its full tensors from a generator seeded by (seed, module name), so every
TP degree and device starts from the same full weights. ``vocab_size: null`` resolves to the
tokenizer's size rounded up to a multiple of 64. Building on ``meta`` allocates nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import mt_fp8
import mt_parallel
from mt_comm import ParallelState
from mt_train.config.schema import FP8Config, ModelConfig
from mt_train.models.llama import Llama

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def resolve_vocab(cfg: ModelConfig, tokenizer_vocab: int) -> ModelConfig:
    """``cfg`` with ``vocab_size`` set; raises if a fixed vocab is smaller than the tokenizer's."""
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=(tokenizer_vocab + 63) // 64 * 64)
    if cfg.vocab_size < tokenizer_vocab:
        raise ValueError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids"
        )
    return cfg


def build_model(cfg: ModelConfig, device: torch.device | str, seed: int | None = None) -> Llama:
    """The plain (tp=1) Llama on ``device``; initialised from ``seed`` unless on ``meta``."""
    device = torch.device(device)
    with torch.device(device):
        model = Llama(cfg)
    if device.type != "meta" and seed is not None:
        mt_parallel.init_weights(model, seed)
    return model


def fp8_skip_names(model: nn.Module, fp8: FP8Config) -> tuple[str, ...]:
    """Names of TP linears that stay high precision: the output head (unless
    ``fp8.output_head``) and the layers below ``fp8.min_features``."""
    skip = [] if fp8.output_head else ["output"]
    for name, module in model.named_modules():
        if hasattr(module, "enable_fp8") and min(module.weight.shape) < fp8.min_features:
            skip.append(name)
    return tuple(skip)


def apply_fp8_config(model: nn.Module, fp8: FP8Config, tp_group: Any) -> mt_fp8.Recipe:
    """Run ``model``'s TP linears in FP8 as ``fp8`` says (``mt_parallel.apply_fp8``): the blocks'
    with the GEMMs of ``fp8.gemms`` in FP8, the head (with ``fp8.output_head``) with those of
    ``fp8.output_head_gemms``; returns the recipe."""
    recipe = mt_fp8.recipe_from_name(fp8.recipe, **dict(fp8.recipe_args))
    skip = fp8_skip_names(model, fp8)
    mt_parallel.apply_fp8(
        model,
        recipe,
        amax_group=tp_group,
        skip=(*skip, "output"),
        backend=fp8.backend,
        fp8_gemms=tuple(fp8.gemms),
    )
    if "output" not in skip:
        mt_parallel.apply_fp8(
            model.output,
            recipe,
            amax_group=tp_group,
            backend=fp8.backend,
            fp8_gemms=tuple(fp8.output_head_gemms),
        )
    return recipe


def parallelize(
    model: Llama,
    parallel: mt_parallel.ParallelConfig,
    state: ParallelState,
    fp8: FP8Config,
    compile_blocks: bool,
) -> nn.Module:
    """Apply the transforms of the module docstring; returns the module to run forward on."""
    tp_group = state.group("tp")
    mt_parallel.apply_tensor_parallel(model, tp_group, parallel.sequence_parallel)
    if parallel.cp > 1:
        mt_parallel.apply_context_parallel(
            model, state.group("cp"), ring=parallel.cp_attention == "ring"
        )
    if fp8.enabled:
        apply_fp8_config(model, fp8, tp_group)
        mt_parallel.set_fp8_weight_cache(model, fp8.cache_weight)
    block_types = (mt_parallel.DecoderBlock,)
    mt_parallel.apply_recompute(
        model,
        parallel.recompute,
        parallel.recompute_every,
        parallel.recompute_targets,
        block_types,
        parallel.recompute_keep,
    )
    if compile_blocks or parallel.compile:
        for block in model.layers:
            block.compile()
    return mt_parallel.apply_data_parallel(
        model, parallel.data_parallel, state.group("dp_cp"), state.device_type, block_types
    )


def fp8_layer_count(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if getattr(m, "fp8_enabled", False))


def canonical_key(key: str) -> str:
    """A state-dict or parameter name without wrapper prefixes (DDP, torch.compile)."""
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


def unwrap(model: nn.Module) -> Any:
    """The Llama inside a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)
