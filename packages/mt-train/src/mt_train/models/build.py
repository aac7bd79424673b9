"""Build a run's model through its family and make it parallel through mt_parallel's one path.

* :func:`build_model`: the family's plain (tp=1) model on ``device``, initialised with
  ``mt_parallel.init_weights(model, seed)`` before any transform: each module draws its full
  tensors from a generator seeded by (seed, module name), so every TP degree and device starts
  from the same full weights. Building on ``meta`` allocates nothing.
* :func:`parallelize`: :func:`mt_parallel.parallelize` (TP → CP → FP8 → recompute → compile →
  DP, documented there), or with ``parallel.pp > 1`` this pipeline rank's chunks of the model,
  each through the same path, as one :class:`mt_parallel.PipelineModule` with the family's :class:`~mt_parallel.ParallelizePlan` and the
  ``fp8`` group as :class:`mt_parallel.FP8Options`: the blocks' linears run the GEMMs of
  ``fp8.gemms`` in FP8; the output head stays high precision unless ``fp8.output_head`` (then
  ``fp8.output_head_gemms``), and linears whose smaller side is below ``fp8.min_features``
  stay high precision too (FP8 pays only on large GEMMs).

``vocab_size: null`` resolves to the tokenizer's size rounded up to a multiple of 64
(:func:`resolve_vocab`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch import nn

import mt_fp8
import mt_parallel
from mt_comm import ParallelState
from mt_train.config.schema import FP8Config, ModelConfig
from mt_train.models.registry import family_of

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
FASTER_ON_HOPPER = ("tensorwise", "rowwise", "delayed", "blockwise")
"""The fp8 config options that run FP8 tensor-core GEMMs on CUDA GPUs before MX (sm_89/sm_90)."""


def fp8_emulation_warning(recipe: str, capability: tuple[int, int], device: str) -> str | None:
    """The start-up warning for an FP8 recipe that a CUDA GPU of ``capability`` only emulates.

    MXFP8 needs MX tensor cores (compute capability >= 10.0); below that mt_fp8 runs its exact
    emulation (bf16 GEMMs of the dequantized operands), which is slower than plain bf16
    (packages/mt-train/README.md, FP8 recipes).
    """
    if recipe != "mxfp8" or capability >= (10, 0):
        return None
    major, minor = capability
    return (
        f"fp8=mxfp8 on {device} (compute capability {major}.{minor}, no MX tensor cores) runs an "
        "exact bf16 emulation, slower than bf16; "
        + ", ".join(f"fp8={name}" for name in FASTER_ON_HOPPER)
        + " run FP8 GEMMs on this GPU"
    )


def warn_if_fp8_emulated(fp8: FP8Config, device: torch.device, device_name: str) -> None:
    """Print :func:`fp8_emulation_warning`'s line to stderr when it applies to this device."""
    if fp8.enabled and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        warning = fp8_emulation_warning(fp8.recipe, capability, device_name)
        if warning:
            print(f"mt-train: warning: {warning}", file=sys.stderr, flush=True)


def resolve_vocab(cfg: ModelConfig, tokenizer_vocab: int) -> ModelConfig:
    """``cfg`` with ``vocab_size`` set; raises if a fixed vocab is smaller than the tokenizer's."""
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=(tokenizer_vocab + 63) // 64 * 64)
    if cfg.vocab_size < tokenizer_vocab:
        raise ValueError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids"
        )
    return cfg


def build_model(cfg: ModelConfig, device: torch.device | str, seed: int | None = None) -> nn.Module:
    """The family's plain (tp=1) model on ``device``; initialised from ``seed`` unless on
    ``meta``."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be resolved (from the tokenizer) before building")
    device = torch.device(device)
    with torch.device(device):
        model = family_of(cfg).build(cfg)
    if device.type != "meta" and seed is not None:
        mt_parallel.init_weights(model, seed)
    return model


def fp8_options(fp8: FP8Config) -> mt_parallel.FP8Options:
    """The ``fp8`` config group as mt_parallel's :class:`~mt_parallel.FP8Options`."""
    return mt_parallel.FP8Options(
        recipe=mt_fp8.recipe_from_name(fp8.recipe, **dict(fp8.recipe_args)),
        backend=fp8.backend,
        gemms=tuple(fp8.gemms),
        min_features=fp8.min_features,
        output_head=fp8.output_head,
        output_head_gemms=tuple(fp8.output_head_gemms),
        cache_weight=fp8.cache_weight,
        expert_formats=fp8.expert_formats,
    )


def parallelize(
    model: nn.Module,
    cfg: ModelConfig,
    parallel: mt_parallel.ParallelConfig,
    state: ParallelState,
    fp8: FP8Config,
    compile_blocks: bool = False,
) -> nn.Module:
    """Apply the transforms of the module docstring; returns the module to run forward on."""
    if compile_blocks and not parallel.compile:
        parallel = dataclasses.replace(parallel, compile=True)
    options = fp8_options(fp8) if fp8.enabled else None
    plan = family_of(cfg).plan(cfg)
    if parallel.pp > 1:
        return mt_parallel.pipeline_module(model, parallel, state, plan, options)
    return mt_parallel.parallelize(model, parallel, state, plan, options)


def apply_fp8_config(
    model: nn.Module, cfg: ModelConfig, fp8: FP8Config, tp_group: Any
) -> mt_fp8.Recipe:
    """Run an already parallel ``model``'s linears in FP8 as ``fp8`` says (step 3 of
    :func:`mt_parallel.parallelize` on its own); returns the recipe."""
    options = fp8_options(fp8)
    mt_parallel.apply_fp8_options(model, family_of(cfg).plan(cfg), options, tp_group)
    return options.recipe


def fp8_layer_count(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if getattr(m, "fp8_enabled", False))


def canonical_key(key: str) -> str:
    """A state-dict or parameter name without wrapper prefixes (DDP, torch.compile)."""
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


def unwrap(model: nn.Module) -> Any:
    """The model inside a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)
